"""The integers of one decode step of a layer, as its device kernels take them.

A step's plan is one int64 tensor ``[len(PLAN_FIELDS), B]``, one column per request of the
batch, made on the host before the step (one copy to the device, not waited for). Row ``r``
of the step's work is request ``r // H``'s KV head ``r % H``; the Triton kernels derive
each row's integers from the plan themselves, the torch references through
:func:`plan_rows`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PLAN_FIELDS = ("slot", "steady_slot", "clusters", "retrieval", "estimation", "sinks",
               "ring_start", "window", "step", "meta_row", "meta_stride")
"""The rows of a step plan's int64 tensor, per request of the batch: its slot in the layer's
pools and in the steady pool, its clusters, its zone sizes (clusters), its sinks, its
window (first ring row, tokens), the layer's step counter (the same in every column:
the cluster cache's clock, :mod:`kernels.cluster_cache`), and where its meta rows are:
cluster ``c`` of its KV head ``h`` is row ``meta_row + h * meta_stride + c`` of the meta
tensors seen flat (``[M, ...]``: a layer's meta pool, ``[H, capacity, ...]`` with the
request's extent at ``meta_row`` and ``meta_stride`` = capacity; or any layout with a row
per (request, head) of ``C`` columns: ``slot * H * C`` and ``C``)."""


@dataclass(frozen=True)
class PlanRows:
    """The plan's integers per row (``R = B x H``), [R] int64 each (the torch path's)."""

    pool_row: torch.Tensor
    steady_slot: torch.Tensor
    head: torch.Tensor
    clusters: torch.Tensor
    n_ret: torch.Tensor
    n_est: torch.Tensor
    sinks: torch.Tensor
    ring_start: torch.Tensor
    n_steady: torch.Tensor
    step: torch.Tensor
    meta_row: torch.Tensor
    """The row's first meta row (cluster 0) in the meta tensors seen flat."""


def plan_rows(plan: torch.Tensor, heads: int) -> PlanRows:
    """Expand a plan ([len(PLAN_FIELDS), B] int64) to its rows."""
    b = plan.shape[1]
    ints = plan[:, :, None].expand(-1, -1, heads).contiguous().view(len(PLAN_FIELDS), b * heads)
    (slot, st_slot, clusters, n_ret, n_est, sinks, ring_start, window, step, meta_row,
     meta_stride) = ints.unbind(0)
    head = torch.arange(heads, device=plan.device).repeat(b)
    return PlanRows(slot * heads + head, st_slot, head, clusters, n_ret, n_est, sinks,
                    ring_start, sinks + window, step, meta_row + head * meta_stride)


def flat_meta(x: torch.Tensor, trail: int = 1) -> torch.Tensor:
    """A meta field (``[..., *trail]`` with ``trail`` trailing dimensions, contiguous) seen
    flat, as the kernels address it: ``[M, D]`` (``trail`` 1) or ``[M]`` (0). A view: the
    kernels read the pool itself."""
    if not x.is_contiguous():
        raise ValueError(f"a meta field of shape {tuple(x.shape)} is not contiguous; the "
                         "kernels read meta rows in place")
    return x.view(-1, x.shape[-1]) if trail else x.view(-1)
