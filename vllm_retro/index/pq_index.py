"""PQCache as a serving index (Zhang et al., 2025; ``../shared/seeds/004``).

At prefill the indexed keys (between the sinks and the local window) of every KV head are
product-quantised: the head dimension is cut into ``pq_subspaces`` sub-spaces, each gets
``2 ** pq_bits`` k-means codewords, and every key one code per sub-space. Decoded tokens
leaving the window are encoded with the same codebooks (as PQCache does). At each decode
step a query's approximate logits ``q . k_hat`` are sums of per-sub-space lookup tables
indexed by the codes; the GQA group's summed softmax of them ranks the indexed tokens, and
the top ``pq_token_ratio`` of them are attended exactly, with the steady zone. There is no
estimation zone.

Layout: the device holds the codes ([H, N, m] uint8, ``m`` bytes per token and head) and the
codebooks; the KV is in the wave buffer's host tier, cut into blocks of ``pq_block_tokens``
consecutive positions: each block is one "cluster" of the buffer's mapping table, and the
reads are of single tokens (:meth:`WaveBufferStore.gather_tokens_into`) from the host tier.
PQCache's block-level GPU cache is not kept here (unmeasured on a GPU; its host-side
predecessor was removed with the per-request block cache).

:func:`decode_pq` decodes all PQCache indexes of a layer with one sequence of calls whatever
the batch: one lookup-table product and one code gather over the padded codes, one top-k,
one device->host copy of the chosen tokens, then

- on CUDA (and on the CPU with the 'torch'/'triton' kernel backends): one gather into one
  execution buffer and one attention call (the tripartite kernel with an empty estimation
  zone);
- on the CPU with the default backend: one call of the fused kernel
  (:func:`vllm_retro.kernels.cpu_decode.pq_decode`) that scores, chooses and attends per
  (request, KV head) in parallel, reading the chosen tokens in place from the host pages,
  as the wave index's fused path does.

What a CUDA graph could capture: the scoring and top-k at a fixed batch composition; not the
gather, whose shapes follow the host-side lookup.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from vllm_retro import kernels
from vllm_retro.config import RetroConfig
from vllm_retro.index.clustering import Clusters
from vllm_retro.index.padded import MetaViewCache
from vllm_retro.index.pq import ProductQuantizer, fit_pq, pq_encode, pq_logits
from vllm_retro.index.steady import fill_steady_batch
from vllm_retro.index.store import ClusterStore, shared_batch_group
from vllm_retro.index.token_index import TokenIndex
from vllm_retro.index.wave_index import (
    DecodeResult,
    GrowingRows,
    PhaseClock,
    Selection,
)
from vllm_retro.kernels import cpu_decode

FIT_SAMPLE_PER_CODEWORD = 256
"""Codebooks are fitted on at most this many keys per codeword (evenly spaced over the
prefill): 16K keys at the default 6 bits, so the fit does not grow with the context."""

JOINT_MAX = 1 << 16
"""Largest joint lookup table (``K^m`` entries per query head) scored in one gather."""


def top_tokens(scores: torch.Tensor, budgets: torch.Tensor) -> torch.Tensor:
    """The top ``budgets[r]`` entries of each row of ``scores`` ([R, N]; budgets [R] int64,
    each at most the row's count of real entries, padding last in its row and scoring no
    more than any real entry), ties broken by the lower index, so the
    choice does not depend on the batch a row is in (tokens with equal codes score exactly
    alike). Returns their column indices, row after row, each row's ascending ([sum
    budgets] int64, on the scores' device)."""
    k_max = int(budgets.max()) if budgets.numel() else 0
    if k_max == 0:
        return torch.zeros(0, dtype=torch.int64, device=scores.device)
    if int(budgets.min()) == k_max:  # one budget: the k-th largest directly
        thr = -torch.kthvalue(-scores, k_max, dim=1, keepdim=True).values
    else:
        vals = torch.topk(scores, k_max, dim=1, sorted=True).values
        thr = vals.gather(1, (budgets - 1).clamp_min(0)[:, None])  # each row's k-th score
    above = scores > thr
    tied = scores == thr
    room = budgets[:, None] - above.sum(1, keepdim=True)
    take = (above | (tied & (tied.cumsum(1) <= room))) & (budgets > 0)[:, None]
    return take.nonzero()[:, 1]


class PQIndex(TokenIndex):
    """The PQCache index of one (request, layer); see the module docstring. Built and
    appended to like :class:`WaveIndex`; decode through :func:`decode_pq` (or
    :meth:`decode` for one request)."""

    @staticmethod
    def decode_own(indexes: list[PQIndex], query: torch.Tensor, scale: float,
                   out: torch.Tensor, cache: MetaViewCache | None) -> bool:
        """See :attr:`WaveIndex.decode_own`: :func:`decode_pq`, for every batch."""
        decode_pq(indexes, query, scale, out, cache)
        return True

    def __init__(self, config: RetroConfig, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, store: ClusterStore | None = None,
                 subspaces: int | None = None, bits: int | None = None,
                 iters: int | None = None):
        # the research harness's options (vllm_retro.index.baselines), as config overrides
        overrides = {name: value for name, value in (("pq_subspaces", subspaces),
                                                     ("pq_bits", bits), ("kmeans_iters", iters))
                     if value is not None}
        config = config.replace(**overrides) if overrides else config
        config.check_head_dim(head_dim, index="pqcache")
        super().__init__(config, num_kv_heads, head_dim, dtype, device, store,
                         config.pq.block_tokens)
        self.pq: ProductQuantizer | None = None
        """The codebooks, fitted on the prefill's indexed keys."""
        self._codes = GrowingRows(torch.empty(num_kv_heads, 0, config.pq.subspaces,
                                              dtype=torch.uint8, device=device))
        self.codes = self._codes.buf
        """[H, N, m] uint8 codes of the N indexed tokens (positions sink .. window start)."""

    def token_budget(self) -> int:
        """Indexed tokens read exactly per KV head and step: ``ceil(pq_token_ratio * N)``,
        or the count given to :meth:`set_token_budget`, at most N."""
        n = self.num_indexed
        if self.fixed_budget is not None:
            return min(n, self.fixed_budget)
        return min(n, math.ceil(self.config.pq.token_ratio * n - 1e-9))

    def _add_block(self, keys: torch.Tensor, values: torch.Tensor, start: int,
                   clusters: Clusters) -> None:
        super()._add_block(keys, values, start, clusters)
        cfg = self.config
        if self.pq is None:
            self.pq = fit_pq(keys, cfg.pq.subspaces, cfg.pq.bits, cfg.kmeans_iters,
                             sample=FIT_SAMPLE_PER_CODEWORD << cfg.pq.bits)
        self.codes = self._codes.append(pq_encode(self.pq, keys).to(torch.uint8),
                                        headroom=4 * cfg.update_segment)

    def meta_nbytes(self) -> int:
        """Bytes of the codes (with their room for later blocks), codebooks and block sizes."""
        books = 0 if self.pq is None else self.pq.codebooks.numel() * 4
        return self._codes.nbytes() + books + self._own_meta_nbytes()

    def free(self) -> None:
        """Release the store's KV, the codes and codebooks (the index is unusable after)."""
        super().free()
        self.pq = None
        self._codes = GrowingRows(self._codes.buf[:, :0].clone())
        self.codes = self._codes.buf

    def select(self, query: torch.Tensor, scale: float) -> Selection:
        """The indexed tokens read exactly for a query [num_heads, D]: retrieval ids [H, k]
        (token indices, position ``sink_tokens + index``, ascending) by the PQ lookup-table
        score, ties to the lower index; no estimation. (:func:`decode_pq` does the same for
        a batch.)"""
        h, k = self.num_kv_heads, self.token_budget()
        if k == 0 or self.pq is None:
            none = torch.empty(h, 0, dtype=torch.int64, device=query.device)
            return Selection(none, none)
        view = pq_view([self], ((self.uid, self.meta_generation),))
        top = top_tokens(pq_scores(view, query.reshape(h, -1, self.head_dim), scale),
                         view.row_budgets).reshape(h, k)
        return Selection(top, top[:, :0])

    def decode(self, query: torch.Tensor, scale: float | None = None,
               selection: Selection | None = None, return_positions: bool = False,
               phases: dict[str, float] | None = None) -> DecodeResult:
        """One request's step through :func:`decode_pq` (``selection`` is not supported:
        the top tokens are chosen inside). Returns the output [num_heads, D] with the
        chosen token indices as ``selection.retrieval_ids`` ([H, k])."""
        if selection is not None:
            raise ValueError("PQIndex.decode chooses its tokens itself; selection must be None")
        scale = self.head_dim ** -0.5 if scale is None else scale
        out = torch.empty_like(query)[None]
        picked, lse = decode_pq([self], query[None], scale, out, phases=phases,
                                want_chosen=True)
        chosen = picked[0]
        h = self.num_kv_heads
        ids = torch.from_numpy(chosen).to(query.device)
        n_exact = torch.full((h,), self.num_steady + ids.shape[1], dtype=torch.int64,
                             device=query.device)
        positions = None
        if return_positions:
            steady = torch.cat([torch.arange(self.num_sinks),
                                torch.arange(self.window_start, self.num_tokens)]).to(ids.device)
            positions = torch.cat([steady[None].expand(h, -1), ids + self.num_sinks], 1)
        none = ids[:, :0]
        return DecodeResult(out[0], lse, Selection(ids, none), n_exact, positions)


def pq_row(index: PQIndex) -> cpu_decode.PQRow:
    """The fused CPU kernel's view of one index (tensors referenced, not copied), kept in
    :attr:`WaveIndex.fused_view` until the codes, the store's layout or the window buffer
    change; the window's current length is filled in per call."""
    st = index.store
    generation = (getattr(st, "layout_generation", None), index.steady.generation)
    view = index.fused_view
    if view is None or view[0] != generation:
        keys, values, starts, head_rows, mult = st.cluster_rows()
        pq = index.pq
        books = pq.codebooks.contiguous() if pq is not None else torch.zeros(
            index.num_kv_heads, index.config.pq.subspaces, 1,
            index.head_dim // index.config.pq.subspaces)
        win_k, win_v, _, _ = index.window_ring()
        row = cpu_decode.PQRow(
            index.codes, books, torch.from_numpy(index.token_cluster),
            torch.from_numpy(index.token_offset), starts, head_rows, mult, keys, values,
            index.sink_k, index.sink_v, win_k, win_v, 0, index.token_budget())
        # the layout generation after the wait above (a pending layout may have landed)
        view = index.fused_view = ((getattr(st, "layout_generation", None),
                                    index.steady.generation), row)
    view[1].win_first, view[1].n_win = index.ring_start, index.win_len
    return view[1]


@dataclass(frozen=True)
class PQView:
    """The codes of a batch's PQCache indexes, padded to the longest (R = B x H rows)."""

    key: tuple[tuple[int, int], ...]
    """(uid, meta generation) of each index: what the view was built from."""
    codes: torch.Tensor
    """[R, N_max, m] int64 codes (0 as padding); [R, N_max] joint codes (``sum_s code_s *
    K^(m-1-s)``) when :attr:`joint`."""
    joint: bool
    """Scored through one joint lookup table of ``K^m`` entries (small enough: at most
    :data:`JOINT_MAX`), one gather per token instead of ``m``."""
    valid: torch.Tensor
    """[R, N_max] bool: an indexed token (not padding)."""
    full: bool
    """No padding: every row has N_max tokens."""
    codebooks: torch.Tensor
    """[R, m, K_max, D / m] fp32 codewords (zeros as padding, never indexed)."""
    budgets: list[int]
    """Tokens read per KV head, per request."""
    row_budgets: torch.Tensor
    """[R] int64 the same per row."""


def pq_view(indexes: list[PQIndex], key: tuple[tuple[int, int], ...]) -> PQView:
    """Build the padded view of ``indexes`` (one layer)."""
    first = indexes[0]
    h, m, dev = first.num_kv_heads, first.config.pq.subspaces, first.codes.device
    ds = first.head_dim // m
    width = max(i.num_indexed for i in indexes)
    k_max = max((i.pq.num_codewords for i in indexes if i.pq is not None), default=1)
    codes = torch.zeros(len(indexes), h, width, m, dtype=torch.int64, device=dev)
    books = torch.zeros(len(indexes), h, m, k_max, ds, device=dev)
    valid = torch.zeros(len(indexes), h, width, dtype=torch.bool, device=dev)
    for b, i in enumerate(indexes):
        n = i.num_indexed
        codes[b, :, :n] = i.codes
        valid[b, :, :n] = True
        if i.pq is not None:
            books[b, :, :, :i.pq.num_codewords] = i.pq.codebooks
    budgets = [i.token_budget() for i in indexes]
    codes = codes.flatten(0, 1)
    joint = k_max ** m <= JOINT_MAX
    if joint:
        weights = k_max ** torch.arange(m - 1, -1, -1, device=dev)
        codes = (codes * weights).sum(-1)
    return PQView(key, codes, joint, valid.flatten(0, 1),
                  all(i.num_indexed == width for i in indexes), books.flatten(0, 1),
                  budgets, torch.tensor(budgets, device=dev).repeat_interleave(h))


def pq_scores(view: PQView, query: torch.Tensor, scale: float) -> torch.Tensor:
    """Rank of every token of the view's rows for query [R, G, D]: the GQA group's summed
    softmax of ``scale * q . k_hat`` ([R, N_max] fp32; 0 on padding, which
    :func:`top_tokens` ranks after every token of its row)."""
    r, g, d = query.shape
    if not view.joint:
        logits = pq_logits(ProductQuantizer(view.codebooks), view.codes, query)
    else:
        m = view.codebooks.shape[1]
        lut = torch.einsum("rgmd,rmkd->rgmk", query.float().reshape(r, g, m, d // m),
                           view.codebooks)
        table = lut[:, :, 0]
        for s in range(1, m):  # [R, G, K^(s+1)]: code tuples in row-major order
            table = (table[..., None] + lut[:, :, s, None, :]).flatten(2)
        n = view.codes.shape[1]
        logits = torch.gather(table, 2, view.codes[:, None, :].expand(r, g, n))
    if not view.full:
        logits = logits.masked_fill(~view.valid[:, None, :], float("-inf"))
    return torch.softmax(logits * scale, dim=-1).sum(1)


def decode_pq(indexes: list[PQIndex], query: torch.Tensor, scale: float, out: torch.Tensor,
              cache: MetaViewCache | None = None, phases: dict[str, float] | None = None,
              want_chosen: bool = False) -> tuple[list[np.ndarray], torch.Tensor]:
    """PQCache decode of ``query[b]`` ([B, Hq, D]) over ``indexes[b]`` for all rows at once
    (see the module docstring); ``out`` ([B, Hq, D]) is written. ``cache``: the layer's
    :class:`~vllm_retro.index.padded.MetaViewCache` (keeps the padded codes and the
    execution buffer across steps); None: built for this call. ``phases``: seconds per
    phase (``view``, ``select``, ``transfer``, ``lookup+gather``, ``attention``; on the
    fused CPU path ``view`` and ``kernel``), for benchmarks. Returns each request's chosen
    token indices ([H, k_b] int64 numpy, ascending; on the fused CPU path only with
    ``want_chosen``, else [H, 0]) and the log softmax denominators ([B * Hq] fp32)."""
    first = indexes[0]
    mark = PhaseClock(phases, query.device)
    b, h, d = len(indexes), first.num_kv_heads, first.head_dim
    dev, dtype = first.codes.device, first.steady.dtype
    if cpu_decode.fused_path(first.backend, dev) and query.dtype == dtype:
        # the CPU: one kernel call scores, chooses and attends, reading the chosen tokens
        # in place from the host pages, as the wave index's fused path does
        rows = [pq_row(i) for i in indexes]
        mark("view")
        width = max(r.budget for r in rows) if want_chosen else 0
        _, lse, sel = cpu_decode.pq_decode(query, rows, scale, out=out, selection_width=width)
        mark("kernel")
        picks = [sel[j, :, :r.budget].numpy() for j, r in enumerate(rows)] if width else \
            [np.zeros((h, 0), dtype=np.int64) for _ in rows]
        return picks, lse.reshape(-1)
    buffers = cache if cache is not None else MetaViewCache()
    view = buffers.get(indexes, build=pq_view)
    mark("view")
    q = query.reshape(b * h, -1, d)
    if max(view.budgets):
        top = top_tokens(pq_scores(view, q, scale), view.row_budgets)
    else:
        top = torch.zeros(0, dtype=torch.int64, device=dev)
    mark("select")
    host = top.cpu().numpy()  # the step's one device->host copy
    mark("transfer")
    ends = np.cumsum([h * k for k in view.budgets])
    chosen = [host[e - h * k:e].reshape(h, k) for e, k in zip(ends, view.budgets, strict=True)]
    clusters = [i.token_cluster[c] for i, c in zip(indexes, chosen, strict=True)]
    offsets = [i.token_offset[c] for i, c in zip(indexes, chosen, strict=True)]
    n_steady = [i.num_steady for i in indexes]
    n_exact = torch.tensor([n + k for n, k in zip(n_steady, view.budgets, strict=True)]
                           ).repeat_interleave(h)
    exec_k, exec_v = buffers.exec_buffer(b * h, max(int(n_exact.max()), 1), d, dtype, dev)
    fill_steady_batch(indexes, exec_k, exec_v)
    stores = [i.store for i in indexes]
    group = shared_batch_group(stores)
    if group is not None:
        group.gather_batch(stores, clusters, n_steady, exec_k, exec_v, offsets=offsets)
    else:
        for j, st in enumerate(stores):
            rows = slice(j * h, (j + 1) * h)
            st.gather_tokens_into(clusters[j], offsets[j], n_steady[j], exec_k[rows],
                                  exec_v[rows])
    mark("lookup+gather")
    none = torch.zeros(b * h, 0, dtype=torch.int64, device=dev)
    res, lse = kernels.tripartite_decode(
        q, exec_k, exec_v, n_exact.to(dev, non_blocking=True), exec_k[:, :0], exec_v[:, :0],
        none.int(), none, torch.zeros(b * h, dtype=torch.int64, device=dev), scale,
        backend=first.backend)
    mark("attention")
    out.copy_(res.reshape(out.shape))
    return chosen, lse.reshape(-1)
