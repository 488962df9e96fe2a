"""Where the indexed KV lives: the interface the wave index reads clusters through.

The wave index decides *which* clusters to read; a :class:`ClusterStore` decides *where the
bytes come from*. :class:`DenseClusterStore` keeps the cluster-contiguous KV in one tensor
pair on the index's own device; the wave buffer implements the same interface over a host
tier shared by the layer's requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from vllm_retro.index.clustering import Clusters
from vllm_retro.kernels import take_rows

SteadyParts = Sequence[tuple[torch.Tensor, torch.Tensor]]
"""The steady zone as (keys, values) pieces, each [H, n_i, D], placed first in order."""


class BatchGroup(Protocol):
    """What the stores of one layer share when their pools are one (the wave buffer's
    :class:`~vllm_retro.buffer.layer_pool.LayerPool`, a store's ``batch_group``): the
    batched path fills all of them with one call."""

    def gather_batch(self, stores: Sequence[ClusterStore], cluster_ids: Sequence[np.ndarray],
                     n_steady: Sequence[int], exec_k: torch.Tensor,
                     exec_v: torch.Tensor) -> None:
        """:meth:`ClusterStore.gather_into` for every store, store j into rows
        ``j * H .. (j + 1) * H`` of exec_k/exec_v ([B * H, T_cap, D]), after its
        ``n_steady[j]`` steady rows."""
        ...


def shared_batch_group(stores: Sequence[object]) -> BatchGroup | None:
    """The batch group all ``stores`` share, or None (no group, or not one)."""
    group = getattr(stores[0], "batch_group", None) if stores else None
    if group is None or any(getattr(s, "batch_group", None) is not group for s in stores):
        return None
    return group


@runtime_checkable
class ClusterStore(Protocol):
    """Storage of the indexed tokens' KV, addressed by (KV head, cluster id).

    Per decode step the index calls :meth:`gather` (which assembles the execution buffer)
    and runs attention on it.
    """

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
               clusters: Clusters) -> None:
        """Add a clustered block: keys/values [H, M, D] in token order, positions [M] int64
        absolute token positions, ``clusters`` its clustering (ids continue after the
        clusters already stored)."""
        ...

    def gather(self, cluster_ids: torch.Tensor, steady: SteadyParts
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Assemble the execution buffer: the steady zone, then whole clusters.

        cluster_ids: [H, R] int64 (no repeats per head). Returns (keys [H, T, D],
        values [H, T, D], positions [H, T - n_steady] int64 of the clusters' tokens (-1 as
        padding), lengths [H] int64 valid rows per head, steady zone included). The
        tensors may be views of a buffer reused by the next :meth:`gather`.
        """
        ...

    def gather_into(self, cluster_ids: np.ndarray, n_steady: int,
                    dst_k: torch.Tensor, dst_v: torch.Tensor) -> None:
        """:meth:`gather` into given buffers, with the cluster ids already on the host and
        the steady zone already in the buffers' first ``n_steady`` rows (the caller fills it,
        for a whole batch at once): the batched path's fill of one request's slice of a
        layer's execution buffer.

        cluster_ids: [H, R] int64 numpy (no repeats per head); dst_k, dst_v: [H, T_cap, D]
        contiguous, T_cap at least the steady zone plus each head's retrieved tokens. Rows
        past a head's total are left as they are. Makes no device->host transfer.
        """
        ...

    def nbytes(self) -> int:
        """Bytes of KV held."""
        ...

    def free(self) -> None:
        """Release everything held; the store is unusable afterwards."""
        ...


@runtime_checkable
class RowAddressedStore(Protocol):
    """A store whose clusters are contiguous rows of one key pool and one value pool, which
    fused kernels read in place."""

    def cluster_rows(self, wait: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
        """(keys [rows, D], values [rows, D], starts [H, >=C] int64, head_rows, start_mult):
        cluster c of KV head h occupies rows ``head_rows * h + starts[h, c] * start_mult``
        onward, one per token. Valid until the store next changes. ``wait`` False: do not
        wait for background work on the newest block (its rows may be missing)."""
        ...

    @property
    def layout_generation(self) -> int:
        """Changes whenever the pools :meth:`cluster_rows` returns are replaced (a caller
        holding them re-reads them then, so the replaced pools can be released)."""
        ...


class DenseClusterStore:
    """All indexed KV in one cluster-contiguous tensor pair per request-layer (no tiers)."""

    def __init__(self, num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.keys = torch.empty(num_heads, 0, head_dim, dtype=dtype, device=device)
        self.values = torch.empty_like(self.keys)
        self.positions = torch.empty(num_heads, 0, dtype=torch.int64, device=device)
        self.offsets = torch.zeros(num_heads, 1, dtype=torch.int64, device=device)
        self._offsets_host = self.offsets.cpu()
        """A host copy of ``offsets`` (refreshed per block), so that :meth:`gather_into`
        expands cluster ids into token rows without reading the device."""
        self.layout_generation = 0
        """See :attr:`RowAddressedStore.layout_generation`."""

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
               clusters: Clusters) -> None:
        """See :meth:`ClusterStore.append`."""
        base = self.keys.shape[1]
        self.keys = torch.cat([self.keys, take_rows(keys, clusters.order)], dim=1)
        self.values = torch.cat([self.values, take_rows(values, clusters.order)], dim=1)
        self.positions = torch.cat([self.positions, positions[clusters.order]], dim=1)
        self.offsets = torch.cat([self.offsets, clusters.offsets[:, 1:] + base], dim=1)
        self._offsets_host = self.offsets.cpu()
        self.layout_generation += 1

    def gather(self, cluster_ids: torch.Tensor, steady: SteadyParts
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """See :meth:`ClusterStore.gather`."""
        token_idx, lengths = cluster_token_index(self.offsets, cluster_ids)
        safe = token_idx.clamp_min(0)
        k = take_rows(self.keys, safe)
        v = take_rows(self.values, safe)
        pos = torch.where(token_idx >= 0, torch.gather(self.positions, 1, safe), -1)
        n_steady = sum(sk.shape[1] for sk, _ in steady)
        keys = torch.cat([sk for sk, _ in steady] + [k.to(self.keys.dtype)], dim=1)
        values = torch.cat([sv for _, sv in steady] + [v.to(self.values.dtype)], dim=1)
        return keys, values, pos, lengths + n_steady

    def gather_into(self, cluster_ids: np.ndarray, n_steady: int,
                    dst_k: torch.Tensor, dst_v: torch.Tensor) -> None:
        """See :meth:`ClusterStore.gather_into`."""
        token_idx, _ = cluster_token_index(self._offsets_host, torch.from_numpy(cluster_ids))
        t = token_idx.shape[1]
        if t:
            safe = token_idx.clamp_min(0).to(self.keys.device)
            dst_k[:, n_steady:n_steady + t] = take_rows(self.keys, safe)
            dst_v[:, n_steady:n_steady + t] = take_rows(self.values, safe)

    def gather_tokens_into(self, cluster_ids: np.ndarray, offsets: np.ndarray,
                           n_steady: int, dst_k: torch.Tensor, dst_v: torch.Tensor
                           ) -> None:
        """Single tokens after the steady zone (the first ``n_steady`` rows, already
        there): token i of head h is token ``offsets[h, i]`` of cluster
        ``cluster_ids[h, i]`` ([H, k] int64 numpy; clusters stored in token order, as
        position blocks are). dst_k, dst_v: [H, T_cap, D]."""
        k = cluster_ids.shape[1]
        if k:
            starts = np.take_along_axis(self._offsets_host.numpy(), cluster_ids, axis=1)
            rows = torch.from_numpy(starts + offsets).to(self.keys.device)
            dst_k[:, n_steady:n_steady + k] = take_rows(self.keys, rows)
            dst_v[:, n_steady:n_steady + k] = take_rows(self.values, rows)

    def cluster_rows(self, wait: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
        """See :meth:`RowAddressedStore.cluster_rows` (head h's tokens start at row
        ``h * N``, N the tokens per head; no background work, ``wait`` is moot)."""
        d = self.keys.shape[2]
        return (self.keys.reshape(-1, d), self.values.reshape(-1, d), self.offsets,
                int(self.keys.shape[1]), 1)

    def nbytes(self) -> int:
        """See :meth:`ClusterStore.nbytes`."""
        return self.keys.numel() * self.keys.element_size() * 2

    def free(self) -> None:
        """See :meth:`ClusterStore.free`."""
        self.keys = self.values = self.keys[:, :0]


def fill_steady(steady: SteadyParts, dst_k: torch.Tensor, dst_v: torch.Tensor) -> int:
    """Copy the steady zone's pieces, in order, to the front of dst_k / dst_v ([H, T_cap, D]);
    returns its length in tokens."""
    off = 0
    for sk, sv in steady:
        n = sk.shape[1]
        dst_k[:, off:off + n] = sk
        dst_v[:, off:off + n] = sv
        off += n
    return off


def expand_runs(starts: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                     torch.Tensor]:
    """Concatenate runs of consecutive indices, per row.

    starts, lengths: [H, R] (run r of row h covers ``starts[h, r] .. + lengths[h, r] - 1``).
    Returns (index [H, T] int64 with -1 padding, T the largest row total; run [H, T] int64,
    the run each slot belongs to; totals [H] int64).
    """
    h, r = starts.shape
    dev = starts.device
    ends = lengths.long().cumsum(1)
    totals = ends[:, -1] if r else torch.zeros(h, dtype=torch.int64, device=dev)
    t = int(totals.max().item()) if h else 0
    slot = torch.arange(t, device=dev)[None, :].expand(h, t).contiguous()
    run = torch.searchsorted(ends, slot, right=True).clamp_max(max(r - 1, 0))
    begin = ends - lengths.long()
    idx = torch.gather(starts.long(), 1, run) + slot - torch.gather(begin, 1, run)
    idx = torch.where(slot < totals[:, None], idx, torch.full_like(idx, -1))
    return idx, run, totals


def cluster_token_index(
    offsets: torch.Tensor, cluster_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expand cluster ids into the indices of their tokens in a cluster-contiguous layout.

    offsets: [H, C + 1] run starts; cluster_ids: [H, R]. Returns (index [H, T] int64 into
    the layout, -1 as padding, T = the largest per-head total; lengths [H] int64).
    """
    ids = cluster_ids.long()
    starts = torch.gather(offsets, 1, ids)
    idx, _, totals = expand_runs(starts, torch.gather(offsets, 1, ids + 1) - starts)
    return idx, totals
