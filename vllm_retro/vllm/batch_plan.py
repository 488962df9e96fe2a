"""Splitting one batch of a retro layer group into dense rows and wave-index rows."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from vllm_retro.index.batched import AppendRows, plan_append
from vllm_retro.vllm.runtime import RetroRuntime


@dataclass(frozen=True, slots=True)
class IndexBuild:
    """A request whose index is built after this step's dense attention."""

    request_id: str
    block_ids: torch.Tensor
    """The request's block-table row (kernel blocks), covering ``num_tokens``."""
    num_tokens: int
    query_rows: tuple[int, int] | None = None
    """Batch token rows ``[start, end)`` of the request in this step (its prompt's last
    chunk), whose queries train a graph index (``index='graph'``) or judge each head's
    estimator (``estimator='auto'``)."""


@dataclass(frozen=True, slots=True)
class RetroDecode:
    """A request decoded through its wave index: tokens ``[first, first + count)`` of the
    batch (one per step without speculative decoding)."""

    request_id: str
    first: int
    count: int
    catch_up: IndexBuild | None = None
    """At the request's first indexed step: its block-table row and the tokens computed
    before this step, whose tail (decoded densely while the index was built) joins the
    index before decoding."""
    position: int = 0
    """The request's tokens before this step: the position of its first token here."""


@dataclass(frozen=True, slots=True)
class BlockPrefill:
    """A prefill chunk under Block-Attention's mask: batch rows ``[first, first + count)``
    are tokens ``[start, start + count)`` of the request, computed after the dense pass
    from its paged KV (:func:`vllm_retro.blocks.attention.block_attention`)."""

    request_id: str
    block_ids: torch.Tensor
    """The request's block-table row (kernel blocks), covering ``start + count``."""
    first: int
    count: int
    start: int
    blocks: tuple[int, ...]
    """Block starts, the last one the last block's (:attr:`RowStep.blocks`)."""


@dataclass(frozen=True, slots=True)
class DecodeColumn:
    """The ``k``-th token of every indexed request that has one this step (one column per
    step without speculative tokens): which decodes take part, and their batch token rows."""

    k: int
    members: list[int] | None
    """Positions in :attr:`BatchPlan.decodes` of the requests taking part, in order; None
    when all do."""
    part: slice | None
    """Their batch rows as a slice when consecutive (decodes come first, one token each)."""
    tokens: torch.Tensor | None
    """Else their batch rows ([n] int64, CPU)."""
    append: AppendRows | None = None
    """Where every layer writes these tokens in its steady pool (:func:`plan_append`: the
    request's slot and position are the same in every layer); None: each layer works it out
    (:func:`~vllm_retro.index.batched.append_batch`)."""


def decode_columns(decodes: list[RetroDecode]) -> list[DecodeColumn]:
    """The token columns of ``decodes``: column k holds the k-th token of every decode with
    more than k tokens."""
    cols = []
    for k in range(max((d.count for d in decodes), default=0)):
        members = [j for j, d in enumerate(decodes) if d.count > k]
        tokens = [decodes[j].first + k for j in members]
        first = tokens[0]
        consecutive = tokens == list(range(first, first + len(tokens)))
        cols.append(DecodeColumn(
            k, None if len(members) == len(decodes) else members,
            slice(first, first + len(tokens)) if consecutive else None,
            None if consecutive else torch.tensor(tokens)))
    return cols


@dataclass(frozen=True)
class BatchPlan:
    """Rows of one batch by path, built once per step by the metadata builder
    (:func:`plan_batch`) and read by every layer."""

    dense_rows: list[int] = field(default_factory=list)
    builds: list[IndexBuild] = field(default_factory=list)
    decodes: list[RetroDecode] = field(default_factory=list)
    block_prefills: list[BlockPrefill] = field(default_factory=list)
    columns: list[DecodeColumn] = field(default_factory=list)
    """The decodes' token columns (:func:`decode_columns`; one without speculative
    tokens)."""


def plan_batch(runtime: RetroRuntime, query_start_loc_cpu: torch.Tensor,
               slot_mapping: torch.Tensor, block_table: torch.Tensor, num_reqs: int
               ) -> BatchPlan:
    """Match each batch row to its request through the slot of its last token and sort it:
    indexed requests decode through the wave index; prefill chunks under Block-Attention's
    mask are computed apart; every other row is dense, and rows that complete an indexable
    sequence build an index after the dense pass. At a request's
    switch its indexes are taken over from the builder here (:meth:`RetroRuntime.switch`),
    before any layer runs: when its build failed, its rows stay dense from then on.
    """
    dense_rows: list[int] = []
    builds: list[IndexBuild] = []
    decodes: list[RetroDecode] = []
    block_prefills: list[BlockPrefill] = []
    qsl = query_start_loc_cpu[: num_reqs + 1].tolist()
    lasts = torch.tensor([max(e - 1, 0) for e in qsl[1:]], dtype=torch.long)
    slots = slot_mapping.index_select(0, lasts.to(slot_mapping.device)).tolist()
    for r in range(num_reqs):
        n = qsl[r + 1] - qsl[r]
        if n == 0:
            continue  # padding row
        hit = runtime.row_for_slot(int(slots[r]))
        if hit is None:
            raise RuntimeError(
                f"retro: batch row {r} (slot {slots[r]}) matches no request of this step's "
                "plan; the scheduler-side retro connector is not running")
        rid, row = hit
        if row.num_tokens != n:
            raise RuntimeError(f"retro: request {rid!r} has {n} tokens in the batch but "
                               f"{row.num_tokens} scheduled")
        if row.blocks_error is not None and not runtime.fates.has_failed(rid):
            runtime.fail_request(rid, row.blocks_error)
        dense = runtime.fates.is_dense(rid)  # its build failed, its index broke, or it failed
        if row.indexed and not dense and (not row.catch_up or runtime.switch(rid)):
            catch_up = IndexBuild(rid, block_table[r].clone(), row.start) if row.catch_up \
                else None
            decodes.append(RetroDecode(rid, qsl[r], n, catch_up, row.start))
            continue
        if row.blocks is not None and not runtime.fates.has_failed(rid):
            block_prefills.append(BlockPrefill(rid, block_table[r].clone(), qsl[r], n,
                                               row.start, row.blocks))
        else:
            # dense: not indexed, or demoted (its paged KV is still allocated), or failed
            # (its rows compute nothing useful until the scheduler ends it with an error)
            dense_rows.append(r)
        if row.build_index and not dense:
            total = row.start + row.num_tokens
            builds.append(IndexBuild(rid, block_table[r].clone(), total, (qsl[r], qsl[r + 1])))
    columns = [replace(c, append=_append_rows(runtime, decodes, c))
               for c in decode_columns(decodes)]
    return BatchPlan(dense_rows, builds, decodes, block_prefills, columns)


def _append_rows(runtime: RetroRuntime, decodes: list[RetroDecode], col: DecodeColumn
                 ) -> AppendRows | None:
    """Column ``col``'s steady-pool rows, from the requests' indexes in the layer that
    indexed first (None: a request has none there yet)."""
    layers = runtime.registry.layers()
    if not layers:
        return None
    held = layers[0].indexes
    members = range(len(decodes)) if col.members is None else col.members
    indexes = [held.get(decodes[j].request_id) for j in members]
    if any([i is None for i in indexes]):
        return None
    return plan_append(indexes, [decodes[j].position + col.k for j in members])
