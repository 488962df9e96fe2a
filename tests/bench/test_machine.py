"""bench.machine: what a benchmark records about the CPU it ran on."""

from __future__ import annotations

import pathlib

import pytest

from bench.machine import cpu_description, model_dtype, native_bf16

_AMX_CPU = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 fma avx512f avx512bw avx512_bf16 amx_bf16 amx_tile
"""
_AVX2_CPU = """processor\t: 0
model name\t: AMD EPYC 7B12
flags\t\t: fpu sse2 avx2 fma f16c
"""


def test_names_the_model_and_the_isas_that_pick_kernels() -> None:
    text = cpu_description(_AMX_CPU)
    assert text.startswith("Intel(R) Xeon(R) Platinum 8480+; ")
    assert text.endswith("; avx2 avx512f avx512_bf16 amx_bf16")


def test_a_cpu_without_avx512_or_amx_lists_only_what_it_has() -> None:
    text = cpu_description(_AVX2_CPU)
    assert text.startswith("AMD EPYC 7B12; ")
    assert text.endswith("; avx2")
    assert cpu_description("processor\t: 0\n").endswith("; no AVX2")


def test_real_model_runs_use_bf16_only_where_the_cpu_multiplies_it() -> None:
    assert native_bf16(_AMX_CPU) and model_dtype(_AMX_CPU) == "bfloat16"
    avx512_bf16 = _AVX2_CPU.replace("f16c", "f16c avx512f avx512_bf16")
    assert native_bf16(avx512_bf16) and model_dtype(avx512_bf16) == "bfloat16"
    assert not native_bf16(_AVX2_CPU) and model_dtype(_AVX2_CPU) == "float32"
    assert model_dtype("processor\t: 0\n") == "float32"


@pytest.mark.skipif(not pathlib.Path("/proc/cpuinfo").exists(), reason="no /proc/cpuinfo")
def test_this_machine_is_described_from_proc_cpuinfo() -> None:
    text = cpu_description()
    flags = next(ln for ln in pathlib.Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("flags")).split()
    assert ("amx_bf16" in text.split("; ")[-1].split()) == ("amx_bf16" in flags)
    assert " cores; " in text
