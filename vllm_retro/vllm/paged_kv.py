"""Reading one request's KV back from vLLM's CPU paged cache (to build its index).

vLLM's CPU cache (``LBHNC``) holds, per block and KV head, one plane of ``2 * block_size *
head_dim`` elements: the block's keys then its values, each half in a layout private to
the kernel ISA (``vec`` stores keys transposed, ``amx`` tiles them, ...). Rather than
hard-code those layouts, :func:`plane_layout` asks vLLM's own cache-write op where each
element lands, once per (ISA, dtype, block size, head dim), and reading is then a gather.
"""

from __future__ import annotations

import functools

import torch


def _write(isa: str, dtype: torch.dtype, block_size: int, head_dim: int,
           keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One block's plane after vLLM writes ``keys``/``values`` [block_size, D] into it."""
    from vllm import _custom_ops as ops

    kv = torch.zeros(1, 1, block_size, 2 * head_dim, dtype=dtype)
    key_cache, value_cache = kv.view(1, 1, 2 * block_size, head_dim).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(
        keys[:, None].to(dtype), values[:, None].to(dtype), key_cache, value_cache,
        torch.arange(block_size, dtype=torch.long), isa, k_scale=1.0, v_scale=1.0,
        kv_cache_dtype="auto")
    return kv.reshape(-1).float()


@functools.cache
def plane_layout(isa: str, dtype: torch.dtype, block_size: int, head_dim: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions in a block's plane of key and value element ``(t, d)`` (index
    ``t * head_dim + d``), each a long tensor [block_size * head_dim].

    Every element index is written in base-256 digits (exact in fp32/fp16/bf16), one
    cache write per digit, after a marker write that tells key positions from value ones.
    """
    n = block_size * head_dim
    ones, zeros = torch.ones(block_size, head_dim), torch.zeros(block_size, head_dim)
    k_mark = _write(isa, dtype, block_size, head_dim, ones, zeros) == 1
    v_mark = _write(isa, dtype, block_size, head_dim, zeros, ones) == 1
    if int(k_mark.sum()) != n or int(v_mark.sum()) != n or bool((k_mark & v_mark).any()):
        raise RuntimeError(f"vLLM's CPU KV-cache layout for isa={isa!r} is not a per-block "
                           "permutation; retro cannot read it back")
    code = torch.zeros(2 * n, dtype=torch.long)
    idx = torch.arange(n)
    digit, scale = 0, 1
    while scale < n:
        d = ((idx // scale) % 256).float().reshape(block_size, head_dim)
        code += _write(isa, dtype, block_size, head_dim, d, d).long() * scale
        digit, scale = digit + 1, scale * 256
    k_pos = torch.empty(n, dtype=torch.long)
    v_pos = torch.empty(n, dtype=torch.long)
    k_where = k_mark.nonzero().flatten()
    v_where = v_mark.nonzero().flatten()
    k_pos[code[k_where]] = k_where
    v_pos[code[v_where]] = v_where
    return k_pos, v_pos


def _blocks_for(block_ids: torch.Tensor, first: int, num_tokens: int, block_size: int,
                device: torch.device) -> torch.Tensor:
    """The entries of a block-table row that hold tokens ``[first, num_tokens)`` (long)."""
    need = -(-num_tokens // block_size)
    if block_ids.numel() < need:
        raise ValueError(f"block row has {block_ids.numel()} blocks; {num_tokens} tokens "
                         f"at block size {block_size} need {need}")
    if not 0 <= first <= num_tokens:
        raise ValueError(f"first token {first} outside [0, {num_tokens}]")
    return block_ids[first // block_size:need].to(device=device, dtype=torch.long)


@functools.cache
def affine_layout(isa: str, dtype: torch.dtype, block_size: int, head_dim: int
                  ) -> tuple[tuple[int, int, int], tuple[int, int, int]] | None:
    """When both halves of the plane are strided views — element ``(t, d)`` at
    ``offset + t * stride_t + d * stride_d`` (``vec`` stores keys dimension-major and
    values token-major) — their ``(offset, stride_t, stride_d)`` for keys and for values;
    None for layouts that are not (tiled ISAs), which are read by a gather."""
    out = []
    for pos in plane_layout(isa, dtype, block_size, head_dim):
        grid = pos.view(block_size, head_dim)
        off = int(grid[0, 0])
        st = int(grid[1, 0]) - off if block_size > 1 else 0
        sd = int(grid[0, 1]) - off if head_dim > 1 else 0
        t = torch.arange(block_size)[:, None]
        d = torch.arange(head_dim)[None, :]
        if not torch.equal(grid, off + t * st + d * sd):
            return None
        out.append((off, st, sd))
    return out[0], out[1]


def read_cpu_paged_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int,
                      isa: str, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of tokens ``[first, num_tokens)`` of one request.

    kv_cache: [num_blocks, H_kv, block_size, 2 * D] as vLLM's CPU backend holds it;
    block_ids: the request's block-table row (at least ``ceil(num_tokens / block_size)``
    entries); isa: the layer's kernel ISA. Returns two contiguous
    [H_kv, num_tokens - first, D]. Strided layouts (:func:`affine_layout`) are read as
    views, one copy per half; others by one gather of both halves.
    """
    nb, h, bs, d2 = kv_cache.shape
    d = d2 // 2
    ids = _blocks_for(block_ids, first, num_tokens, bs, kv_cache.device)
    need = ids.numel()
    lo, hi = first % bs, first % bs + num_tokens - first
    plane = 2 * bs * d
    planes = kv_cache.reshape(nb, h, plane).index_select(0, ids)  # [need, H, plane]
    affine = affine_layout(isa, kv_cache.dtype, bs, d)
    if affine is None:
        return _gather_halves(planes, isa, bs, d, lo, hi)
    halves = []
    for off, st, sd in affine:
        half = planes.as_strided((h, need, bs, d), (plane, h * plane, st, sd),
                                 planes.storage_offset() + off)
        halves.append(half.reshape(h, need * bs, d)[:, lo:hi].contiguous())
    return halves[0], halves[1]


def _gather_halves(planes: torch.Tensor, isa: str, bs: int, d: int, lo: int, hi: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [H, hi - lo, D] of block planes [need, H, plane] in any layout: one
    gather of both halves by :func:`plane_layout`'s positions, then one copy each."""
    need, h, _ = planes.shape
    k_pos, v_pos = plane_layout(isa, planes.dtype, bs, d)
    both = planes.index_select(2, torch.cat([k_pos, v_pos])).view(need, h, 2, bs, d)
    both = both.permute(2, 1, 0, 3, 4).reshape(2, h, need * bs, d)[:, :, lo:hi]
    return both[0].contiguous(), both[1].contiguous()


def read_flash_paged_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int,
                        first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of tokens ``[first, num_tokens)`` of one request, from the cache of
    vLLM's FlashAttention backend: [num_blocks, H_kv, block_size, 2 * D], keys in the first
    ``D`` channels and values in the last ``D`` (the backend splits the last dim).

    Returns two contiguous [H_kv, num_tokens - first, D] tensors on the cache's device.
    """
    nb, h, bs, d2 = kv_cache.shape
    d = d2 // 2
    ids = _blocks_for(block_ids, first, num_tokens, bs, kv_cache.device)
    need = ids.numel()
    lo, hi = first % bs, first % bs + num_tokens - first
    blocks = kv_cache.index_select(0, ids).transpose(0, 1).reshape(h, need * bs, d2)
    return blocks[:, lo:hi, :d].contiguous(), blocks[:, lo:hi, d:].contiguous()
