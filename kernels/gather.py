"""Execution-buffer gather: copy token rows from the device block cache or the host tier.

For every slot ``(h, t)`` of the destination with ``kind[h, t] != 0`` one K row and one V row
are copied::

    kind == 1 (cache hit):  dst[h, offset + t] = dev[src_row[h, t]]    device -> device
    kind == 2 (miss):       dst[h, offset + t] = host[src_row[h, t]]   host -> device

``dev`` and ``host`` are flat row pools ``[rows, D]`` (pages flattened). On CUDA the Triton
kernel reads the host pool directly from pinned memory (unified addressing), so misses cost
one PCIe read and no staging copy.
"""

from __future__ import annotations

import torch

from vllm_retro.kernels._common import block_size, tl, triton

HIT, MISS = 1, 2


def gather_rows_ref(dst_k: torch.Tensor, dst_v: torch.Tensor, offset: int,
                    dev_k: torch.Tensor, dev_v: torch.Tensor,
                    host_k: torch.Tensor, host_v: torch.Tensor,
                    kind: torch.Tensor, src_row: torch.Tensor) -> None:
    """In-place torch gather. dst_k, dst_v: [H, T_cap, D] contiguous; dev_*: [R_dev, D];
    host_*: [R_host, D]; kind, src_row: [H, T] (T + offset <= T_cap). Slots of kind 0 are
    untouched."""
    h, cap, d = dst_k.shape
    flat_k, flat_v = dst_k.view(h * cap, d), dst_v.view(h * cap, d)
    for code, src_k, src_v in ((HIT, dev_k, dev_v), (MISS, host_k, host_v)):
        hh, tt = torch.nonzero(kind == code, as_tuple=True)
        if hh.numel() == 0:
            continue
        rows = src_row[hh, tt].to(src_k.device)
        dst = (hh * cap + tt + offset).to(dst_k.device)
        flat_k.index_copy_(0, dst, src_k.index_select(0, rows).to(dst_k.device))
        flat_v.index_copy_(0, dst, src_v.index_select(0, rows).to(dst_v.device))


@triton.jit
def _gather_rows_kernel(
    DK, DV, DEVK, DEVV, HK, HV, KIND, SRC,
    T, D, offset,
    sd_h, sd_t, sk_h,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    h = tl.program_id(0)
    tb = tl.program_id(1)
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    tmask = t < T
    dmask = d < D
    kind = tl.load(KIND + h * sk_h + t, mask=tmask, other=0)
    row = tl.load(SRC + h * sk_h + t, mask=tmask, other=0).to(tl.int64)
    hit = (kind == 1)[:, None] & dmask[None, :]
    miss = (kind == 2)[:, None] & dmask[None, :]
    src = row[:, None] * D + d[None, :]
    k = tl.load(DEVK + src, mask=hit, other=0.0) + tl.load(HK + src, mask=miss, other=0.0)
    v = tl.load(DEVV + src, mask=hit, other=0.0) + tl.load(HV + src, mask=miss, other=0.0)
    dst = h * sd_h + (t[:, None] + offset) * sd_t + d[None, :]
    tl.store(DK + dst, k, mask=hit | miss)
    tl.store(DV + dst, v, mask=hit | miss)


def gather_rows_triton(dst_k: torch.Tensor, dst_v: torch.Tensor, offset: int,
                       dev_k: torch.Tensor, dev_v: torch.Tensor,
                       host_k: torch.Tensor, host_v: torch.Tensor,
                       kind: torch.Tensor, src_row: torch.Tensor) -> None:
    """Triton version of :func:`gather_rows_ref` (same arguments and effect). The host pools
    must be pinned (or, under the interpreter, ordinary CPU tensors)."""
    h, t = kind.shape
    if h == 0 or t == 0:
        return
    d = dst_k.shape[2]
    for name, x in (("dst_k", dst_k), ("dst_v", dst_v), ("dev_k", dev_k), ("dev_v", dev_v),
                    ("host_k", host_k), ("host_v", host_v)):
        if not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if x.shape[-1] != d:
            raise ValueError(f"{name} has head_dim {x.shape[-1]}, expected {d}")
    kind = kind.to(dst_k.device, torch.int32).contiguous()
    src_row = src_row.to(dst_k.device, torch.int64).contiguous()
    block_t = 32
    _gather_rows_kernel[(h, triton.cdiv(t, block_t))](
        dst_k, dst_v, dev_k, dev_v, host_k, host_v, kind, src_row,
        t, d, offset, dst_k.stride(0), dst_k.stride(1), kind.stride(0),
        BLOCK_T=block_t, BLOCK_D=block_size(d),
    )
