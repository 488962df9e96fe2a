"""Host-memory admission for indexed requests: the wave buffer's host tier never outgrows
a budget.

Indexing a request moves its context out of vLLM's paged pool (whose blocks are freed, so
vLLM admits more requests) into the host tier, which grows with every indexed token. Left
alone, many long requests could exhaust the machine's memory. So the scheduler reserves, for
each request it will index, the most host memory its index can reach
(:meth:`HostBudget.cost`: its longest possible context, prompt plus ``max_tokens``, capped
at the model's length) and admits it only if every reservation fits the budget:

- it fits: the request is scheduled and indexed as usual;
- it would fit once others finish: it **waits** in vLLM's queue (the connector tells the
  scheduler it cannot start yet) and starts when reservations are released, before any
  indexed request that came after it (first come, first served). Its answer is the one it
  gives alone: the budget delays requests, it never changes how one is served;
- it could never fit (more than the whole budget): it is served **densely** from its paged
  blocks, like a short request, with a warning.

A request that only crosses the indexing threshold while it decodes is reserved when its
build is due, and decodes densely until its reservation fits.

The reservation is an upper bound measured for the wave index on the real model
(``tests/vllm/test_host_budget.py`` checks it against the bytes the worker holds: at most
0.76 of it): the host tier pads every cluster to whole pages (1.35x the raw K+V at cluster
size 16 and page size 8; the layer's pool is preallocated and commits only the pages it
holds, so no growth slack is held: the 0.5x once allowed for pools growing by 1.5x is now
margin), and the index's
meta data (centroids, value sums, estimator terms) adds about 0.1x; plus each request's
slot of the steady-zone pools. Not measured for the other policies: the graph index's
adjacency (2 x 16 int32 per key and KV head) adds 0.5x of the K+V at head_dim 64 in bf16.

The workers' own figure, ``host_tier_bytes``, is not used to admit: it lags the scheduler by
a step, still counting requests that have finished, so it would make a request's start
depend on timing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import Enum

GiB = 1 << 30

TIER_BYTES_PER_KV_BYTE = 2.25
"""Upper bound of host bytes (tier pages, pool growth, index meta) per byte of raw K+V: see
the module docstring."""

DEFAULT_SHARE = 0.8
"""Share of the memory available when the engine starts (weights and vLLM's KV cache
already allocated) that the host tier may use when no budget is configured."""

logger = logging.getLogger("vllm.retro.host_budget")
"""Under vLLM's logger, so its lines reach the server's log with vLLM's own."""


class Admission(Enum):
    """What :meth:`HostBudget.reserve` decided."""

    ADMITTED = "admitted"
    """Reserved: the request may be indexed."""
    WAIT = "wait"
    """Not now: other requests' reservations must be released first."""
    TOO_LARGE = "too large"
    """Never: the request alone needs more than the whole budget."""


@dataclass
class HostBudget:
    """Reservations of host memory by request (bytes, all workers of the engine)."""

    limit_bytes: int
    """The budget."""
    kv_bytes_per_token: int
    """Raw K+V bytes of one token over every retro layer and worker."""
    steady_tokens: int
    """Rows of a request's steady-zone slot (sinks, local window, update-block ring)."""
    held: dict[str, int] = field(default_factory=dict)
    """Bytes reserved per request id."""

    def __post_init__(self) -> None:
        if self.limit_bytes <= 0:
            raise ValueError(f"host budget: limit_bytes={self.limit_bytes}; accepted: > 0")

    @property
    def reserved_bytes(self) -> int:
        """Bytes reserved by every request now."""
        return sum(self.held.values())

    def cost(self, tokens: int) -> int:
        """Upper bound of the host bytes of a request indexed over at most ``tokens``
        tokens (its pages, pool growth, meta data, steady slot)."""
        tier = TIER_BYTES_PER_KV_BYTE * tokens * self.kv_bytes_per_token
        return int(tier) + self.steady_tokens * self.kv_bytes_per_token

    def reserve(self, request_id: str, tokens: int, queued_ahead: bool = False) -> Admission:
        """Reserve :meth:`cost` (``tokens``) for ``request_id`` if it fits beside the other
        reservations and no earlier request is waiting for memory (``queued_ahead``: first
        come, first served, so a large request is not passed over forever by smaller ones);
        a request already holding a reservation keeps it and is admitted."""
        if request_id in self.held:
            return Admission.ADMITTED
        need = self.cost(tokens)
        if need > self.limit_bytes:
            return Admission.TOO_LARGE
        if queued_ahead or self.reserved_bytes + need > self.limit_bytes:
            return Admission.WAIT
        self.held[request_id] = need
        return Admission.ADMITTED

    def release(self, request_id: str) -> None:
        """Drop ``request_id``'s reservation (finished, aborted or preempted); no-op if it
        holds none."""
        self.held.pop(request_id, None)


def available_host_memory() -> int:
    """Bytes free for the engine now: the smaller of the system's available memory and that
    of the NUMA node vLLM's CPU worker allocates on (vLLM checks the node's figure; on a
    multi-node machine the system-wide one alone would overshoot)."""
    import psutil

    avail = psutil.virtual_memory().available
    try:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info

            cpus = get_allowed_cpu_list()
            if cpus:
                avail = min(avail, get_memory_node_info(cpus[0].numa_node).available_memory)
    except (ImportError, OSError, AttributeError, IndexError):  # no NUMA information
        pass
    return int(avail)


def describe(nbytes: int) -> str:
    """``nbytes`` in GiB, for log lines."""
    return f"{nbytes / GiB:.2f} GiB"
