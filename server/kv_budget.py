"""The CPU KV-cache size ``vllm-retro serve`` picks when the user has not chosen one.

vLLM's CPU build reserves ``--gpu-memory-utilization`` (default 0.92) of the NUMA node's
memory for the KV cache and refuses to start when less than that is free, so a plain start
fails as soon as other programs use ~8% of the machine. When none of
``VLLM_CPU_KVCACHE_SPACE``, ``--kv-cache-memory-bytes`` and ``--gpu-memory-utilization`` is
given, the size is derived from the memory free right now instead:

    usable = available - model weights - process overhead
    kv     = usable * KV_SHARE      (the rest is headroom for the wave buffer's host tier,
                                     which grows with indexed context, and for activations)

A user's explicit choice always wins (this module is not consulted then).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vllm_retro.server.serve_dtype import checkpoint_dtype, loaded_weight_bytes

GiB = 1 << 30

PROCESS_OVERHEAD_BYTES = 2 * GiB
"""Resident memory of the API server and engine-core processes besides weights and KV
(measured: about 1.4 GiB for the two with the 0.5B model; rounded up)."""

KV_SHARE = 0.5
"""Share of the usable memory given to vLLM's paged KV pool; the rest stays free for the
wave buffer's host tier (indexed context moves there) and activations."""

MIN_KV_BYTES = GiB // 2
"""Below this the server could not hold one long request: refuse to start instead."""

ALIGN_BYTES = 64 << 20
"""The chosen size is rounded down to a multiple of this (64 MiB)."""

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


class NotEnoughMemory(RuntimeError):
    """Too little free memory for the model plus a useful KV cache."""


@dataclass(frozen=True)
class KVBudget:
    """A chosen KV-cache size and the figures it was derived from (all bytes)."""

    kv_bytes: int
    available_bytes: int
    weight_bytes: int
    overhead_bytes: int

    def describe(self) -> str:
        """One line for the start-up banner: the size, where it came from, how to change it."""
        return (f"KV cache {self.kv_bytes / GiB:.1f} GiB, sized from free memory "
                f"({self.available_bytes / GiB:.1f} GiB available, model "
                f"{self.weight_bytes / GiB:.1f} GiB); set it with "
                f"--kv-cache-memory-bytes (e.g. 4G) or VLLM_CPU_KVCACHE_SPACE=<GiB>")


def weight_bytes(model_dir: str | Path) -> int:
    """Bytes of the weight files (safetensors, bin, pt, gguf) directly in ``model_dir``; 0 if
    it is not a directory (e.g. a hub name, which fails later with its own message)."""
    d = Path(model_dir)
    if not d.is_dir():
        return 0
    return sum(p.stat().st_size for p in d.iterdir()
               if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))


def choose_kv_bytes(available_bytes: int, weights: int,
                    overhead: int = PROCESS_OVERHEAD_BYTES) -> KVBudget:
    """The KV-cache size for ``available_bytes`` of free memory and a model of ``weights``
    bytes. Raises :class:`NotEnoughMemory` (with what to do) when it would be under
    :data:`MIN_KV_BYTES`."""
    usable = available_bytes - weights - overhead
    kv = int(usable * KV_SHARE) // ALIGN_BYTES * ALIGN_BYTES
    if kv < MIN_KV_BYTES:
        need = weights + overhead + int(MIN_KV_BYTES / KV_SHARE)
        raise NotEnoughMemory(
            f"not enough free memory: {available_bytes / GiB:.1f} GiB available, about "
            f"{need / GiB:.1f} GiB needed (model {weights / GiB:.1f} GiB, processes "
            f"{overhead / GiB:.1f} GiB, KV cache and host tier at least "
            f"{MIN_KV_BYTES / KV_SHARE / GiB:.1f} GiB). Free memory, or set the KV cache "
            f"size yourself with --kv-cache-memory-bytes (e.g. 512M)")
    return KVBudget(kv, available_bytes, weights, overhead)


def available_memory() -> int:
    """Bytes free for the engine now (see
    :func:`vllm_retro.vllm.host_budget.available_host_memory`: the NUMA node's figure,
    which vLLM checks, when it is the smaller; on these machines node 0 holds 14 of the
    24 GiB)."""
    from vllm_retro.vllm.host_budget import available_host_memory

    return available_host_memory()


def auto_kv_budget(model_dir: str | Path, dtype: str | None = None) -> KVBudget:
    """:func:`choose_kv_bytes` for the memory available now and the weights in ``model_dir``
    loaded in ``dtype`` (a ``--dtype`` value; None or ``auto``: as vLLM resolves it, see
    :func:`~vllm_retro.server.serve_dtype.loaded_weight_bytes`)."""
    loaded = loaded_weight_bytes(weight_bytes(model_dir), checkpoint_dtype(model_dir), dtype)
    return choose_kv_bytes(available_memory(), loaded)
