"""What a benchmark ran on, recorded with its results: ratios measured on machines that
differ here are not comparable (on a CPU with AMX, vLLM's CPU attention takes its AMX path
and ran 1.7x faster than on the AVX-512-less CPU of earlier runs; bench/README.md)."""

from __future__ import annotations

import os
import pathlib
import platform

from vllm_retro.server.serve_dtype import native_bf16


def model_dtype(cpuinfo: str | None = None) -> str:
    """The dtype real-model engine runs use on this CPU: ``"bfloat16"`` (the served models'
    own) where the CPU multiplies it natively (:func:`native_bf16`), else ``"float32"``, as
    ``vllm-retro serve`` picks (:mod:`vllm_retro.server.serve_dtype`)."""
    return "bfloat16" if native_bf16(cpuinfo) else "float32"


def cpu_description(cpuinfo: str | None = None) -> str:
    """The CPU's model name and the vector ISAs that decide which kernels run (vLLM's CPU
    attention takes its AMX path where ``amx_bf16`` is listed, else its AVX path), e.g.
    ``"Intel(R) Xeon(R) Processor; 2 cores; avx2 avx512f avx512_bf16 amx_bf16"``: ratios
    measured on CPUs that differ here are not comparable. ``cpuinfo``: the text of
    ``/proc/cpuinfo`` (read when None; without it, just the platform's name)."""
    info = cpuinfo
    if info is None:
        try:
            info = pathlib.Path("/proc/cpuinfo").read_text()
        except OSError:
            return platform.processor() or platform.machine()
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                  if ln.startswith("model name")), platform.machine())
    flags_line = next((ln for ln in info.splitlines() if ln.startswith("flags")), "")
    flags = set(flags_line.split(":", 1)[-1].split())
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}; {cores} cores; {' '.join(isa) or 'no AVX2'}"
