"""Full decode attention through vLLM's own CPU paged-attention kernel.

This is the strongest full-attention baseline on CPU: the exact op sequence vLLM's ``CPU_ATTN``
backend (``vllm/v1/attention/backends/cpu_attn.py``) runs for a decode step.

* KV cache: one tensor ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]`` (layout LBHNC),
  viewed as ``[num_blocks, num_kv_heads, 2 * block_size, head_dim]`` and split in two along
  dim 2 (``cpu_attn.py:415-416``): per (block, kv_head) the block's K part, then its V part.
  The *interior* of the K part is ISA-specific (the ``vec`` kernel stores K transposed,
  ``[head_dim, block_size]``; V is row-major ``[block_size, head_dim]``), so the cache is only
  ever written through ``ops.cpu_attn_reshape_and_cache`` with the same ISA the kernel runs.
* ISA: ``cpu_attn._get_attn_isa`` ("amx" for bf16 on AMX CPUs, else "vec"/"vec16"/...). The
  "vec" kernel widens bf16/fp16 K/V to fp32 and computes in fp32, so without AMX bf16 is
  compute-bound rather than bandwidth-bound.
* Metadata: int32 ``query_start_loc`` ``[batch + 1]``, int32 ``seq_lens`` ``[batch]``, int32
  ``block_table`` ``[batch, max_blocks]``, and an opaque scheduler plan from
  ``ops.cpu_attn_get_scheduler_metadata`` (``cpu_attn.py:253-266``) which bakes in the OpenMP
  thread count: the kernel refuses to run a plan made for another count, so the plan is rebuilt
  here whenever ``torch.get_num_threads()`` changes.
* Attention: ``ops.cpu_attention_with_kv_cache`` (``cpu_attn.py:440-459``).

Importing vLLM is deferred to first use (``available()`` or the constructor); see
``unavailable_reason()`` for why the op cannot be used in this process.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["VllmCpuDecodeAttention", "available", "unavailable_reason"]

DEFAULT_BLOCK_SIZE = 128
"""vLLM's CPU default cache block size (``vllm/platforms/cpu.py``: ``block_size = 128``)."""

_vllm: dict[str, Any] | None = None
_vllm_error: str | None = None


@contextmanager
def _preserve_environ() -> Iterator[None]:
    """Undo the environment variables vLLM sets on import (inductor/triton/tilelang knobs).

    None of them affect the CPU attention op; restoring them keeps the import from changing the
    behaviour of unrelated code (e.g. other tests) running in the same process.
    """
    saved = dict(os.environ)
    try:
        yield
    finally:
        for key in [k for k in os.environ if k not in saved]:
            del os.environ[key]
        for key, value in saved.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


def _smoke_test() -> None:
    """Run the op once on a tiny problem and check it against a direct computation."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, seq_len, head_dim, block_size = 4, 2, 40, 64, 32
    keys = torch.randn(1, kv_heads, seq_len, head_dim, generator=gen)
    values = torch.randn(1, kv_heads, seq_len, head_dim, generator=gen)
    query = torch.randn(1, heads, head_dim, generator=gen)
    out = VllmCpuDecodeAttention(keys, values, heads, block_size=block_size)(query)
    k = keys[0].repeat_interleave(heads // kv_heads, 0)
    v = values[0].repeat_interleave(heads // kv_heads, 0)
    probs = torch.softmax((k @ query[0, :, :, None])[..., 0] / math.sqrt(head_dim), -1)
    ref = (probs[:, None, :] @ v)[:, 0]
    if not torch.allclose(out[0], ref, rtol=1e-3, atol=1e-4):
        raise RuntimeError("vLLM CPU attention smoke test gave wrong results")


def _load() -> dict[str, Any] | None:
    """Import vLLM's CPU attention pieces once; remember why when that fails."""
    global _vllm, _vllm_error
    if _vllm is not None or _vllm_error is not None:
        return _vllm
    try:
        with _preserve_environ():
            from vllm import _custom_ops as ops  # loads vllm/_C*.so via import_kernels()
            from vllm import envs
            from vllm.platforms import current_platform
            from vllm.v1.attention.backend import MultipleOf
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, _get_attn_isa
    except Exception as exc:  # vLLM missing, or a build that fails to import here
        _vllm_error = f"cannot import vLLM's CPU attention backend: {exc!r}"
        return None
    if not current_platform.is_cpu():
        _vllm_error = f"vLLM platform is {type(current_platform).__name__}, not the CPU platform"
        return None
    for name in (
        "cpu_attention_with_kv_cache",
        "cpu_attn_reshape_and_cache",
        "get_scheduler_metadata",
    ):
        if not hasattr(torch.ops._C, name):
            _vllm_error = f"torch.ops._C.{name} is not registered (vLLM built without CPU ops?)"
            return None
    _vllm = {
        "ops": ops,
        "envs": envs,
        "backend": CPUAttentionBackend,
        "multiple_of": MultipleOf,
        "get_isa": _get_attn_isa,
    }
    try:
        _smoke_test()
    except Exception as exc:
        _vllm = None
        _vllm_error = f"vLLM CPU attention op failed a smoke test: {exc!r}"
        return None
    return _vllm


def available() -> bool:
    """True when vLLM's CPU attention op can be used in this process.

    Imports vLLM on first call (a few seconds), checks the platform and the op registrations,
    and runs the op once on a tiny problem. ``unavailable_reason()`` says why when it is False.
    """
    return _load() is not None


def unavailable_reason() -> str | None:
    """Why ``available()`` is False, or None when the op can be used."""
    _load()
    return _vllm_error


def _require() -> dict[str, Any]:
    """vLLM's pieces, or a RuntimeError carrying the reason they are unusable."""
    mods = _load()
    if mods is None:
        raise RuntimeError(_vllm_error or "vLLM CPU attention unavailable")
    return mods


class VllmCpuDecodeAttention:
    """Full decode attention through vLLM's own CPU paged-attention kernel.

    The constructor writes K/V once into a vLLM-layout paged KV cache (blocks of each sequence
    are contiguous and in order); ``__call__`` runs one decode step (one query token per
    sequence, attending all of its keys) through ``torch.ops._C.cpu_attention_with_kv_cache``,
    with metadata built as ``CPUAttentionMetadataBuilder.build`` builds it.

    Args:
        keys: ``[batch, num_kv_heads, seq_len, head_dim]``, fp32, bf16 or fp16. The cache and
            the query/output use this dtype (vLLM has no mixed-dtype path for "auto" caches).
        values: same shape and dtype as ``keys``.
        num_heads: number of query heads; a multiple of ``num_kv_heads``.
        scale: softmax scale; ``1 / sqrt(head_dim)`` when None.
        block_size: cache block size in tokens; a multiple of 32 (vLLM's CPU backend
            constraint). Defaults to 128, vLLM's CPU default.
        seq_lens: optional per-sequence lengths (ragged batch), each in ``[1, seq_len]``; only
            the first ``seq_lens[b]`` keys of sequence ``b`` are cached and attended.
    """

    kv_bytes: int
    """Bytes of K+V the kernel must read per call (lower bound of its memory traffic)."""

    def __init__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        num_heads: int,
        scale: float | None = None,
        block_size: int | None = None,
        *,
        seq_lens: Sequence[int] | None = None,
    ) -> None:
        """Write ``keys``/``values`` into a fresh paged KV cache and plan the decode step."""
        # _vllm is already set while _load() runs its smoke test through this constructor.
        mods = _vllm if _vllm is not None else _require()
        self._ops = mods["ops"]
        backend = mods["backend"]
        if keys.dim() != 4 or keys.shape != values.shape:
            raise ValueError(
                f"keys/values must both be [B, Hkv, S, D]; got "
                f"{tuple(keys.shape)} and {tuple(values.shape)}"
            )
        if keys.dtype != values.dtype:
            raise ValueError(f"keys/values dtypes differ: {keys.dtype} vs {values.dtype}")
        batch, num_kv_heads, seq_len, head_dim = keys.shape
        dtype = keys.dtype
        if not backend.supports_dtype(dtype):
            raise ValueError(
                f"dtype {dtype} unsupported; vLLM CPU attention supports {backend.supported_dtypes}"
            )
        if not backend.supports_head_size(head_dim):
            raise ValueError(
                f"head_dim {head_dim} unsupported; vLLM CPU attention supports "
                f"{backend.get_supported_head_sizes()}"
            )
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
        block_size = DEFAULT_BLOCK_SIZE if block_size is None else int(block_size)
        multiple = self._block_multiple(backend, mods["multiple_of"])
        if block_size <= 0 or block_size % multiple != 0:
            raise ValueError(
                f"block_size {block_size} must be a positive multiple of "
                f"{multiple} (CPUAttentionBackend.get_supported_kernel_block_sizes)"
            )
        lens = [seq_len] * batch if seq_lens is None else [int(n) for n in seq_lens]
        if len(lens) != batch or any(not 1 <= n <= seq_len for n in lens):
            raise ValueError(f"seq_lens must hold {batch} lengths in [1, {seq_len}]; got {lens}")

        self.batch, self.num_heads, self.num_kv_heads = batch, num_heads, num_kv_heads
        self.head_dim, self.block_size, self.dtype = head_dim, block_size, dtype
        self.scale = float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)
        self.isa: str = mods["get_isa"](dtype, block_size, head_dim, "auto")
        if self.isa == "amx":
            # AMX tiles need the kernel's permission (XFEATURE_XTILEDATA) before first use,
            # else the bf16 AMX kernel dies with SIGILL.
            torch.cpu._init_amx()
        self._split_kv = bool(mods["envs"].VLLM_CPU_ATTN_SPLIT_KV)
        self.kv_bytes = 2 * sum(lens) * num_kv_heads * head_dim * keys.element_size()

        blocks_per_seq = [math.ceil(n / block_size) for n in lens]
        starts = [0]
        for nb in blocks_per_seq:
            starts.append(starts[-1] + nb)
        num_blocks = starts[-1]
        # The backend's per-layer cache view; zeroed so padded tail slots hold finite values.
        self.kv_cache = torch.zeros(num_blocks, num_kv_heads, block_size, 2 * head_dim, dtype=dtype)
        kv = self.kv_cache.view(num_blocks, num_kv_heads, 2 * block_size, head_dim)
        self._key_cache, self._value_cache = kv.chunk(2, dim=2)  # as cpu_attn.py:415-416

        max_blocks = max(blocks_per_seq)
        self.block_table = torch.zeros(batch, max_blocks, dtype=torch.int32)
        with torch.no_grad():
            for b, n in enumerate(lens):
                self.block_table[b, : blocks_per_seq[b]] = torch.arange(
                    starts[b], starts[b + 1], dtype=torch.int32
                )
                slot_mapping = torch.arange(n, dtype=torch.int64) + starts[b] * block_size
                # [Hkv, S, D] -> [S, Hkv, D] view: the op takes token/head strides, last dim
                # must be contiguous.
                k = keys[b, :, :n].transpose(0, 1)
                v = values[b, :, :n].transpose(0, 1)
                if k.stride(-1) != 1:
                    k = k.contiguous()
                if v.stride(-1) != 1:
                    v = v.contiguous()
                self._ops.cpu_attn_reshape_and_cache(
                    k, v, self._key_cache, self._value_cache, slot_mapping, self.isa
                )

        self.seq_lens = torch.tensor(lens, dtype=torch.int32)
        self.query_start_loc = torch.arange(batch + 1, dtype=torch.int32)  # 1 token per seq
        self._metadata: torch.Tensor | None = None
        self._metadata_threads = -1
        self._scheduler_metadata()

    @staticmethod
    def _block_multiple(backend: Any, multiple_of: type) -> int:
        """The block-size multiple the backend's kernel requires (32 for CPU_ATTN)."""
        sizes = backend.get_supported_kernel_block_sizes()
        for size in sizes:
            if isinstance(size, multiple_of):
                return int(size.base)
        return 32

    def _scheduler_metadata(self) -> torch.Tensor:
        """The kernel's work plan, rebuilt if the OpenMP thread count changed since last time."""
        threads = torch.get_num_threads()
        if self._metadata is None or threads != self._metadata_threads:
            self._metadata = self._ops.cpu_attn_get_scheduler_metadata(
                num_reqs=self.batch,
                num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim,
                seq_lens=self.seq_lens,
                dtype=self.dtype,
                query_start_loc=self.query_start_loc,
                causal=True,  # decoder self-attention; a 1-token query sees every key
                sliding_window_size=-1,
                isa=self.isa,
                enable_kv_split=self._split_kv,
            )
            self._metadata_threads = threads
        return self._metadata

    def __call__(self, query: torch.Tensor) -> torch.Tensor:
        """One decode step: ``query`` ``[batch, num_heads, head_dim]`` -> output, same shape.

        The query is cast to the cache dtype if needed; the output has the cache dtype.
        """
        expected = (self.batch, self.num_heads, self.head_dim)
        if tuple(query.shape) != expected:
            raise ValueError(f"query must be {expected}; got {tuple(query.shape)}")
        if query.dtype != self.dtype:
            query = query.to(self.dtype)
        if query.stride(-1) != 1:
            query = query.contiguous()
        output = torch.empty(expected, dtype=self.dtype)
        self._ops.cpu_attention_with_kv_cache(
            query=query,
            key_cache=self._key_cache,
            value_cache=self._value_cache,
            output=output,
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            scale=self.scale,
            causal=True,
            alibi_slopes=None,
            sliding_window=-1,
            block_table=self.block_table,
            softcap=0.0,
            scheduler_metadata=self._scheduler_metadata(),
            s_aux=None,
        )
        return output
