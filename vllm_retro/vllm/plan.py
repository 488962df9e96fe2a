"""What the scheduler tells the workers each step (carried by the connector's metadata).

The scheduler decides; workers execute. A request's index build starts at the step whose
tokens complete its known sequence (prompt, or prompt + outputs after a preemption) when
that sequence is at least ``RetroConfig.min_indexed_context`` long and the request may
decode more than ``RetroConfig.build_steps`` further tokens. The workers build it in the
background while the request decodes exactly from its paged KV for ``build_steps`` of its
own steps (in that step itself when ``build_steps`` is 0); then it switches: its rows
decode through the wave index, and once that step has run the KV-cache manager frees its
paged blocks. The switch point is fixed in the request's tokens, so a request's output
never depends on other requests or on timing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from vllm_retro.vllm.block_cache import BlockTransfer


@dataclass(frozen=True, slots=True)
class RowStep:
    """One scheduled request in one step."""

    slot: int
    """KV-cache slot of the request's last scheduled token (block id * block size +
    offset, in the retro KV-cache group). Slots being written are owned by exactly one
    live request, so the worker finds the request's row in the batch by this slot."""
    start: int
    """Tokens already computed before this step."""
    num_tokens: int
    """Tokens scheduled in this step."""
    indexed: bool
    """The request's index exists (built in an earlier step): its rows are decoded by
    the wave index and its paged blocks may be gone."""
    build_index: bool
    """This step completes the request's sequence: build its index after the dense
    attention of this step, from the paged KV of tokens ``[0, start + num_tokens)``."""
    catch_up: bool = False
    """First indexed step after a build: the tokens decoded densely while the index was
    being built (``[indexed tokens, start)``) are read from the paged KV, still allocated
    in this step, and appended to the index before decoding."""
    blocks: tuple[int, ...] | None = None
    """Block-Attention (:mod:`vllm_retro.blocks.request`): the block starts the mask uses
    (:func:`~vllm_retro.blocks.request.mask_blocks`: the last block's start moved earlier
    by ``block_recompute_tokens``), while this step computes tokens before the last block
    (its passages attend only within themselves); None otherwise."""
    blocks_error: str | None = None
    """The request asked for Block-Attention with bad block starts: it fails with this
    error to its client."""


@dataclass
class RetroStepMetadata(KVConnectorMetadata):
    """Per-step plan from the scheduler-side connector to the workers."""

    rows: dict[str, RowStep] = field(default_factory=dict)
    """Scheduled requests by request id."""
    released: set[str] = field(default_factory=set)
    """Requests whose worker state must be freed before this step: finished, aborted or
    preempted (a preempted request is recomputed from scratch and re-indexed)."""
    passages: dict[str, BlockTransfer] = field(default_factory=dict)
    """Block-Attention requests' cached passages to load before this step's forward and
    computed passages to save after it, by request id
    (:mod:`vllm_retro.vllm.block_cache`)."""
