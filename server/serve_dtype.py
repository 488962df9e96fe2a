"""The dtype ``vllm-retro serve`` runs a model in on CPU when the user has not chosen one.

vLLM's ``--dtype auto`` runs bfloat16 on every x86 CPU: a bfloat16 checkpoint as stored, a
float32 one downcast (a float16 one stays float16). Only CPUs with ``avx512_bf16`` or
``amx_bf16`` multiply bfloat16 natively; elsewhere (AVX2-only CPUs, many AVX-512 ones)
torch's 16-bit GEMMs take a slow path. Served on a 2-core AVX2 EPYC (Qwen2.5-Coder-0.5B,
2 requests of 3142 prompt tokens and 32 output tokens each, one at a time;
``bench/results/serve_load_cpu_dtype_{default,bf16}_avx2.json``), float32 against bfloat16:
time to first token 32.2 s against 132.6 s (4.1x faster), inter-token latency 0.177 s
against 0.096 s (1.8x slower: decode reads every weight once per token, twice the bytes),
end to end 37.7 s against 135.6 s. Long prompts are what this server is for, so there it
loads the model in float32, when the float32 weights still leave room for a KV cache, and
says so in one line; ``--dtype bfloat16`` suits short prompts with long answers and takes
half the memory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DTYPE_BYTES = {"half": 2, "float16": 2, "bfloat16": 2, "float": 4, "float32": 4}
"""Bytes per weight of each ``--dtype`` value vLLM accepts besides ``auto``."""


def native_bf16(cpuinfo: str | None = None) -> bool:
    """True when the CPU multiplies bfloat16 natively (``avx512_bf16`` or ``amx_bf16`` in
    ``/proc/cpuinfo``; ``cpuinfo``: its text, read when None; False where it cannot be
    read)."""
    info = cpuinfo
    if info is None:
        try:
            info = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags_line = next((ln for ln in info.splitlines() if ln.startswith("flags")), "")
    return bool({"avx512_bf16", "amx_bf16"} & set(flags_line.split(":", 1)[-1].split()))


def checkpoint_dtype(model_dir: str | Path) -> str | None:
    """The dtype ``config.json`` in ``model_dir`` records (``torch_dtype`` or ``dtype``, at
    the top or in ``text_config``), e.g. ``"bfloat16"``; None when there is none to read."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for level in (config, config.get("text_config") or {}):
        for key in ("torch_dtype", "dtype"):
            value = level.get(key)
            if isinstance(value, str) and value.removeprefix("torch.") in DTYPE_BYTES:
                return value.removeprefix("torch.")
    return None


def loaded_weight_bytes(file_bytes: int, checkpoint: str | None, dtype: str | None) -> int:
    """Bytes the weights take once loaded in ``dtype`` (a ``--dtype`` value; ``auto`` or
    None: as vLLM resolves it, the checkpoint's own, float32 downcast to bfloat16) from
    ``file_bytes`` of checkpoint files stored in ``checkpoint`` (None: unknown, taken as
    loaded as stored)."""
    if checkpoint not in DTYPE_BYTES:
        return file_bytes
    if dtype in (None, "auto"):
        dtype = "bfloat16" if DTYPE_BYTES[checkpoint] == 4 else checkpoint
    if dtype not in DTYPE_BYTES:
        return file_bytes
    return file_bytes * DTYPE_BYTES[dtype] // DTYPE_BYTES[checkpoint]


@dataclass(frozen=True)
class DtypeChoice:
    """What the server passes to vLLM as ``--dtype`` and the banner line saying why (None
    when it keeps vLLM's own choice silently)."""

    dtype: str
    note: str | None = None


def choose_cpu_dtype(checkpoint: str | None, native: bool, float32_fits: bool) -> DtypeChoice:
    """The ``--dtype`` for a CPU server whose user gave none: ``float32`` for a
    ``checkpoint`` of known dtype on a CPU without ``native`` bfloat16 when ``float32_fits``
    (its float32 weights leave room for the smallest KV cache the server starts with); else
    ``auto``, with a line when the slow 16-bit path is kept for lack of memory."""
    if native or checkpoint not in DTYPE_BYTES:
        return DtypeChoice("auto")
    if not float32_fits:
        return DtypeChoice("auto", (
            "vllm-retro: 16-bit weights, though this CPU has no native bfloat16 (no "
            "avx512_bf16 or amx_bf16), where float32 prefills ~4x faster: float32 weights "
            "would not fit in the memory free now; --dtype float32 forces it"))
    return DtypeChoice("float32", (
        f"vllm-retro: float32 weights and KV cache ({checkpoint} checkpoint): this CPU has no "
        "native bfloat16 (no avx512_bf16 or amx_bf16), where float32 prefills ~4x faster "
        "and decodes ~1.8x slower; --dtype bfloat16 for short prompts with long answers, "
        "and half the memory"))
