"""Execution-buffer gather: copy runs of token rows from a device pool or the host tier.

The plan is a list of runs, ``runs`` [N, 3] int64, one per maximal stretch of consecutive
source rows in one pool going to consecutive destination rows::

    (dst, src, n), n > 0 (device pool):  dst_rows[dst : dst + n]  = dev[src : src + n]
    (dst, src, n), n < 0 (host tier):    dst_rows[dst : dst + |n|] = host[src : src + |n|]

``dst_rows`` is the destination viewed as rows ``[-1, D]`` (an execution buffer [rows, T_cap,
D]: row ``r * T_cap + slot``); ``dev`` and ``host`` are flat row pools ``[rows, D]`` (pages
flattened). A cluster's tokens lie in consecutive host rows, so a run is usually a whole
cluster (the wave buffer's host-tier path, :mod:`vllm_retro.buffer.layer_pool`, sends host
runs only). On CUDA the Triton kernel reads the host pool directly from pinned memory
(unified addressing), so a read costs one PCIe transfer and no staging copy.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_retro.kernels._common import block_size, tl, triton

RUN_FIELDS = ("dst", "src", "count")
"""The columns of a gather plan's runs: destination row, source row, signed row count (> 0
from the device pool, < 0 from the host pool)."""


def expand_runs(runs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row (dst, src) of ``runs`` [N, 3] (whatever their sign), run after run."""
    length = np.abs(runs[:, 2])
    step = np.arange(int(length.sum())) - np.repeat(np.cumsum(length) - length, length)
    return np.repeat(runs[:, 0], length) + step, np.repeat(runs[:, 1], length) + step


def gather_runs_ref(dst_k: torch.Tensor, dst_v: torch.Tensor, dev_k: torch.Tensor,
                    dev_v: torch.Tensor, host_k: torch.Tensor, host_v: torch.Tensor,
                    runs: torch.Tensor) -> None:
    """In-place torch gather. dst_k, dst_v: contiguous [..., D] (viewed as rows); dev_*:
    [R_dev, D]; host_*: [R_host, D]; runs: [N, 3] int64 (see the module docstring). Rows no
    run names are untouched."""
    d = dst_k.shape[-1]
    flat_k, flat_v = dst_k.view(-1, d), dst_v.view(-1, d)
    plan = runs.to("cpu", torch.int64).numpy()  # expanded on the host: numpy's repeat is fast
    for hit, src_k, src_v in ((True, dev_k, dev_v), (False, host_k, host_v)):
        part = plan[plan[:, 2] > 0] if hit else plan[plan[:, 2] < 0]
        if part.shape[0] == 0:
            continue
        dst, src = (torch.from_numpy(x) for x in expand_runs(part))
        src, dst = src.to(src_k.device), dst.to(dst_k.device)
        flat_k.index_copy_(0, dst, src_k.index_select(0, src).to(dst_k.device))
        flat_v.index_copy_(0, dst, src_v.index_select(0, src).to(dst_v.device))


@triton.jit
def _gather_runs_kernel(
    DK, DV, DEVK, DEVV, HK, HV, RUNS, D,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i = tl.program_id(0)
    dst0 = tl.load(RUNS + i * 3)
    src0 = tl.load(RUNS + i * 3 + 1)
    n = tl.load(RUNS + i * 3 + 2)
    length = tl.abs(n)
    # the run's rows in its pool (the other pool's mask is empty): vector masks only
    n_dev = tl.where(n > 0, length, 0)
    n_host = length - n_dev
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    for t0 in range(0, length, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        m = (t < length)[:, None] & dmask[None, :]
        on_dev = (t < n_dev)[:, None] & dmask[None, :]
        on_host = (t < n_host)[:, None] & dmask[None, :]
        src = (src0 + t)[:, None] * D + d[None, :]
        k = tl.where(on_dev, tl.load(DEVK + src, mask=on_dev, other=0.0),
                     tl.load(HK + src, mask=on_host, other=0.0))
        v = tl.where(on_dev, tl.load(DEVV + src, mask=on_dev, other=0.0),
                     tl.load(HV + src, mask=on_host, other=0.0))
        dst = (dst0 + t)[:, None] * D + d[None, :]
        tl.store(DK + dst, k, mask=m)
        tl.store(DV + dst, v, mask=m)


def gather_runs_triton(dst_k: torch.Tensor, dst_v: torch.Tensor, dev_k: torch.Tensor,
                       dev_v: torch.Tensor, host_k: torch.Tensor, host_v: torch.Tensor,
                       runs: torch.Tensor) -> None:
    """Triton version of :func:`gather_runs_ref` (same arguments and effect): one program
    per run. The host pools must be pinned (or, under the interpreter, ordinary CPU
    tensors)."""
    if runs.dim() != 2 or runs.shape[1] != len(RUN_FIELDS):
        raise ValueError(f"runs must be [N, 3], got {list(runs.shape)}")
    if runs.shape[0] == 0:
        return
    d = dst_k.shape[-1]
    for name, x in (("dst_k", dst_k), ("dst_v", dst_v), ("dev_k", dev_k), ("dev_v", dev_v),
                    ("host_k", host_k), ("host_v", host_v)):
        if not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if x.shape[-1] != d:
            raise ValueError(f"{name} has head_dim {x.shape[-1]}, expected {d}")
    runs = runs.to(dst_k.device, torch.int64).contiguous()
    _gather_runs_kernel[(runs.shape[0],)](
        dst_k, dst_v, dev_k, dev_v, host_k, host_v, runs, d,
        BLOCK_T=16, BLOCK_D=block_size(d),
    )
