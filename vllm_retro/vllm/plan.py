"""What the scheduler tells the workers each step (carried by the connector's metadata).

The scheduler decides; workers execute. A request's index build starts at the step whose
tokens complete its known sequence (prompt, or prompt + outputs after a preemption) when
that sequence is at least ``RetroConfig.min_indexed_context`` long and the request will
decode at least one more token. The workers build it (in the background by default) while
the request decodes densely from its paged KV, and report it ready through the
connector's worker metadata (:class:`RetroWorkerMetadata`); at the scheduler's next step
the request switches: its rows decode through the wave index, and once that step has run
the KV-cache manager frees its paged blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


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


@dataclass
class RetroStepMetadata(KVConnectorMetadata):
    """Per-step plan from the scheduler-side connector to the workers."""

    rows: dict[str, RowStep] = field(default_factory=dict)
    """Scheduled requests by request id."""
    released: set[str] = field(default_factory=set)
    """Requests whose worker state must be freed before this step: finished, aborted or
    preempted (a preempted request is recomputed from scratch and re-indexed)."""


@dataclass
class RetroWorkerMetadata(KVConnectorWorkerMetadata):
    """Per-step report from a worker to the scheduler-side connector: the requests whose
    every layer on that worker is now indexed, as ``{(request id, tokens indexed): number
    of workers}`` (1 from each worker; summed over workers by :meth:`aggregate`)."""

    ready: dict[tuple[str, int], int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """This report plus another worker's."""
        assert isinstance(other, RetroWorkerMetadata)
        merged = dict(self.ready)
        for key, n in other.ready.items():
            merged[key] = merged.get(key, 0) + n
        return RetroWorkerMetadata(merged)
