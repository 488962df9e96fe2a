"""The CPU server's dtype when the user gives none: float32 on CPUs without native bfloat16,
when the float32 weights fit; vLLM's ``auto`` (bfloat16 on CPU) otherwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_retro.server.serve_dtype import (
    checkpoint_dtype,
    choose_cpu_dtype,
    loaded_weight_bytes,
    native_bf16,
)

_AMX_CPU = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
_AVX512_CPU = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma avx512f avx512bw\n"
_AVX2_CPU = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma f16c\n"


def test_native_bf16_needs_avx512_bf16_or_amx() -> None:
    assert native_bf16(_AMX_CPU)
    assert native_bf16(_AVX2_CPU.replace("f16c", "f16c avx512_bf16"))
    assert not native_bf16(_AVX512_CPU) and not native_bf16(_AVX2_CPU)
    assert not native_bf16("processor\t: 0\n")


@pytest.mark.parametrize(("config", "expected"), [
    ({"torch_dtype": "bfloat16"}, "bfloat16"),
    ({"dtype": "float16"}, "float16"),
    ({"torch_dtype": "torch.float32"}, "float32"),
    ({"text_config": {"torch_dtype": "bfloat16"}}, "bfloat16"),
    ({"torch_dtype": "int8"}, None),
    ({}, None),
])
def test_checkpoint_dtype_reads_config_json(tmp_path: Path, config: dict,
                                            expected: str | None) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert checkpoint_dtype(tmp_path) == expected


def test_checkpoint_dtype_of_no_or_broken_config_is_none(tmp_path: Path) -> None:
    assert checkpoint_dtype(tmp_path) is None
    (tmp_path / "config.json").write_text("{not json")
    assert checkpoint_dtype(tmp_path) is None


def test_loaded_weight_bytes_scale_with_the_dtype_loaded() -> None:
    assert loaded_weight_bytes(1000, "bfloat16", "float32") == 2000
    assert loaded_weight_bytes(1000, "float32", "bfloat16") == 500
    assert loaded_weight_bytes(1000, "bfloat16", "auto") == 1000
    assert loaded_weight_bytes(1000, "bfloat16", None) == 1000
    assert loaded_weight_bytes(1000, "float32", "auto") == 500  # vLLM downcasts float32
    assert loaded_weight_bytes(1000, "float16", "auto") == 1000
    assert loaded_weight_bytes(1000, None, "float32") == 1000  # stored dtype unknown


@pytest.mark.parametrize(("checkpoint", "native", "fits", "dtype", "note"), [
    ("bfloat16", False, True, "float32", "(bfloat16 checkpoint)"),
    ("float16", False, True, "float32", "(float16 checkpoint)"),
    ("float32", False, True, "float32", "(float32 checkpoint)"),  # auto would downcast it
    ("bfloat16", False, False, "auto", "would not fit"),
    ("bfloat16", True, True, "auto", None),
    ("float32", True, True, "auto", None),
    (None, False, True, "auto", None),
])
def test_float32_only_on_cpus_without_native_bf16(
        checkpoint: str | None, native: bool, fits: bool, dtype: str, note: str | None) -> None:
    choice = choose_cpu_dtype(checkpoint, native, fits)
    assert choice.dtype == dtype
    if note is None:
        assert choice.note is None
    else:
        assert choice.note is not None and note in choice.note
        assert choice.note.startswith("vllm-retro: ")
