"""The retro KV connector: the scheduler's per-step plan to the workers.

Scheduler side: decides, for every scheduled request, whether this step starts its index
build or switches it to its index (``build_steps`` of its own steps later; see
:mod:`vllm_retro.vllm.plan`), and which batch slot identifies it (vLLM's attention
backends see rows, not request ids); records indexed requests for the KV-cache manager;
reports finished, aborted and preempted requests so workers free their state; and admits
requests to indexing within the host-memory budget (:mod:`vllm_retro.vllm.host_budget`:
a request that does not fit waits in the queue). Worker side:
hands each step's plan to the per-process :class:`~vllm_retro.vllm.runtime.RetroRuntime`
before the batch is prepared. No KV is transferred: the wave buffer's host tier is filled
by the attention backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from vllm_retro.blocks.request import parse_blocks
from vllm_retro.index.steady import ring_size
from vllm_retro.vllm import schedule_state
from vllm_retro.vllm.host_budget import (
    DEFAULT_SHARE,
    Admission,
    GiB,
    HostBudget,
    available_host_memory,
    describe,
    logger,
)
from vllm_retro.vllm.kv_manager import RetroAttentionSpec
from vllm_retro.vllm.plan import RetroStepMetadata, RowStep
from vllm_retro.vllm.settings import retro_config
from vllm_retro.vllm.stats import COUNTERS, GAUGES, RetroConnectorStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from vllm_retro.vllm.metrics import RetroPromMetrics


@dataclass
class RetroWorkerReport(KVConnectorWorkerMetadata):
    """What the workers tell the scheduler after a step: the requests whose index build
    failed, which decode densely from their paged KV for their whole life."""

    demoted: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """The union over workers."""
        assert isinstance(other, RetroWorkerReport)
        return RetroWorkerReport(self.demoted | other.demoted)


class RetroConnector(KVConnectorBase_V1, SupportsHMA):
    """See module docstring. Loaded by vLLM from ``kv_transfer_config``."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.config = retro_config(vllm_config)
        self.runtime = None
        """Worker side: the worker's retro state, taken once here (vLLM builds the
        connector; the process has one runtime)."""
        if role == KVConnectorRole.WORKER:
            from vllm_retro.vllm.runtime import get_runtime

            self.runtime = get_runtime()
            self.runtime.attach(vllm_config, self.config)
        self._requests: dict[str, Request] = {}
        self._building: dict[str, int] = {}
        """Requests whose build started, with the tokens it covers."""
        self._build_steps = (0 if self.config is None else
                             self.config.build_steps_on(vllm_config.device_config.device_type))
        self._group: int | None = None
        self._block_size = 0
        self._single_group = (kv_cache_config is not None
                              and len(kv_cache_config.kv_cache_groups) == 1)
        """vLLM maps failed blocks back to requests only with one KV-cache group."""
        kv_bytes_per_token = 0
        if kv_cache_config is not None:
            for gid, group in enumerate(kv_cache_config.kv_cache_groups):
                spec = group.kv_cache_spec
                if isinstance(spec, RetroAttentionSpec):
                    if self._group is None:
                        self._group, self._block_size = gid, spec.block_size
                    kv_bytes_per_token += (spec.page_size_bytes // spec.block_size
                                           * len(group.layer_names))
        self._max_model_len = vllm_config.model_config.max_model_len
        self.budget: HostBudget | None = None
        if (role == KVConnectorRole.SCHEDULER and self.config is not None
                and self._group is not None):
            self.budget = _host_budget(self.config, vllm_config, kv_bytes_per_token)
        self._queue: dict[str, float] = {}
        """Requests waiting for host memory now, with their arrival times (a request enters
        once per wait: it leaves when admitted, and is not refused again until released)."""
        self._dense: set[str] = set()
        """Requests too large for the whole budget: never indexed."""
        self.budget_counts = {"host_budget_waited_requests": 0,
                              "host_budget_dense_requests": 0}
        """Requests that waited for host memory, and that decoded densely for want of it
        (each counted once; reported as counters)."""
        self._budget_reported = dict(self.budget_counts)

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """Retro never supplies KV from outside the paged cache. Called as a request is
        about to start (or restart after preemption): if its prompt will be indexed, it
        starts only once its host-memory reservation fits (None: not this step)."""
        if self.budget is None or self.config is None:
            return 0, False
        prompt = request.num_prompt_tokens
        if prompt < self.config.min_indexed_context or not _decodes_more(
                request, prompt, self._build_steps):
            return 0, False  # may reach the threshold decoding: admitted at its build
        if self._admit(request, prompt) is Admission.WAIT:
            return None, False
        return 0, False

    def _admit(self, request: Request, tokens: int) -> Admission:
        """Reserve host memory for ``request`` (now at ``tokens`` tokens), counting and
        logging a wait or a dense fallback once per request."""
        assert self.budget is not None
        rid = request.request_id
        if rid in self._dense:
            return Admission.TOO_LARGE
        most = _most_tokens(request, tokens, self._max_model_len)
        arrival = request.arrival_time
        ahead = any(t < arrival for r, t in self._queue.items() if r != rid)
        verdict = self.budget.reserve(rid, most, queued_ahead=ahead)
        if verdict is not Admission.WAIT:
            self._queue.pop(rid, None)
        if verdict is Admission.TOO_LARGE:
            self._dense.add(rid)
            self.budget_counts["host_budget_dense_requests"] += 1
            logger.warning(
                "retro: request %s decodes densely: indexing its %d tokens needs up to %s of "
                "host memory, more than the whole budget of %s (raise --retro-host-memory-gb)",
                rid, most, describe(self.budget.cost(most)), describe(self.budget.limit_bytes))
        elif verdict is Admission.WAIT and rid not in self._queue:
            self._queue[rid] = arrival
            self.budget_counts["host_budget_waited_requests"] += 1
            logger.info(
                "retro: request %s waits for host memory: needs up to %s, %s of %s reserved",
                rid, describe(self.budget.cost(most)), describe(self.budget.reserved_bytes),
                describe(self.budget.limit_bytes))
        return verdict

    def _release(self, request_id: str, finished: bool) -> None:
        """Drop ``request_id``'s reservation; forget it entirely once ``finished``."""
        if self.budget is not None:
            self.budget.release(request_id)
        self._queue.pop(request_id, None)
        if finished:
            self._dense.discard(request_id)

    def on_new_request(self, request: Request) -> None:
        """Track the request (its length decides when it is indexed)."""
        self._requests[request.request_id] = request

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Track requests that reach allocation without :meth:`on_new_request`."""
        self._requests.setdefault(request.request_id, request)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's plan: a :class:`RowStep` per scheduled request, and the released
        requests (finished since the last step, or preempted)."""
        so = scheduler_output
        preempted = set(so.preempted_req_ids or ())
        released = set(so.finished_req_ids) | preempted
        for rid in released:
            schedule_state.release(rid, preempted=rid in preempted)
            self._building.pop(rid, None)
            self._release(rid, finished=rid not in preempted)
        for rid in so.finished_req_ids:
            self._requests.pop(rid, None)
        meta = RetroStepMetadata(released=released)
        if self.config is None or self._group is None:
            return meta
        start = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        start.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        state = so.kv_connector_block_state
        bs, min_ctx = self._block_size, self.config.min_indexed_context
        lag = self._build_steps
        for rid, n in so.num_scheduled_tokens.items():
            req = self._requests[rid]
            first = start[rid]
            end = first + n
            blocks = state.get_block_ids(rid)[self._group]
            last = end - 1
            slot = blocks[last // bs] * bs + last % bs
            indexed = schedule_state.indexed_at(rid) is not None
            built_at = self._building.get(rid)
            switch = built_at is not None and first >= built_at + lag
            build = (not indexed and built_at is None and end >= req.num_tokens
                     and end >= min_ctx and _decodes_more(req, end, lag)
                     and rid not in self._dense)
            if build and self.budget is not None:
                build = self._admit(req, end) is Admission.ADMITTED
            if switch:
                # Blocks go once this step (which still reads them to catch up) has run.
                schedule_state.mark_indexed(rid, end)
                del self._building[rid]
            elif build:
                self._building[rid] = end
            blocks, error = self._blocks_of(req) if first < req.num_prompt_tokens \
                else (None, None)
            meta.rows[rid] = RowStep(slot=slot, start=first, num_tokens=n,
                                     indexed=indexed or switch, build_index=build,
                                     catch_up=switch,
                                     blocks=blocks if blocks and first < blocks[-1] else None,
                                     blocks_error=error)
        return meta

    def _blocks_of(self, req: Request) -> tuple[tuple[int, ...] | None, str | None]:
        """The Block-Attention starts ``req`` asks for, or the error they raise (read at its
        prefill steps)."""
        params = req.sampling_params
        extra = params.extra_args if params is not None else None
        if not extra:
            return None, None
        try:
            return parse_blocks(extra, req.num_prompt_tokens, req.cache_salt), None
        except ValueError as exc:
            return None, str(exc)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """After each step: a request whose index build failed on a worker decodes densely
        from now on, so it keeps its paged blocks (its indexed mark goes before the
        KV-cache manager could free them: that happens only once this step's output is
        processed), is never built again, and gives its host-memory reservation back."""
        report = connector_output.kv_connector_worker_meta
        if not isinstance(report, RetroWorkerReport):
            return
        for rid in report.demoted:
            schedule_state.release(rid)
            self._building.pop(rid, None)
            self._release(rid, finished=False)
            self._dense.add(rid)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Blocks are freed at once (no asynchronous save); the request's host-memory
        reservation is released now, so a waiting request can start at the next step."""
        self._release(request.request_id, finished=True)
        return False, None

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """Hybrid-allocator variant of :meth:`request_finished`."""
        return self.request_finished(request, [])

    # ------------------------------------------------------------------ worker side
    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Runs before the batch is prepared: free released requests, publish the plan."""
        assert isinstance(kv_connector_metadata, RetroStepMetadata)
        assert self.runtime is not None, "worker-side connector method on the scheduler side"
        self.runtime.begin_step(kv_connector_metadata)

    def build_connector_worker_meta(self) -> RetroWorkerReport | None:
        """After each step: the requests this worker demoted to dense decoding since the
        last step (see :meth:`update_connector_output`)."""
        assert self.runtime is not None, "worker-side connector method on the scheduler side"
        demoted = self.runtime.take_demoted()
        return RetroWorkerReport(demoted) if demoted else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """After each step: the block each failed request of this step writes, so the
        scheduler ends it with an error to its client (vLLM's ``kv_load_failure_policy``
        'fail', the default; a failed request whose block vLLM does not count as computed
        yet is reported again the next step). Nothing with several KV-cache groups, where
        vLLM cannot map blocks back to requests: a failed request then runs to its end with
        meaningless output (logged when it failed)."""
        if not self._single_group or not self._block_size or self.runtime is None:
            return set()
        return self.runtime.failed_blocks(self._block_size)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Nothing to load."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Nothing to save: the backend hands KV to the wave buffer itself."""

    def wait_for_save(self) -> None:
        """Nothing to wait for."""

    # ------------------------------------------------------------------ metrics
    def get_kv_connector_stats(self) -> RetroConnectorStats | None:
        """Worker side, after every step: this worker's counter increments, gauges and index
        build times (see :mod:`vllm_retro.vllm.stats`). Scheduler side: the host-memory
        budget's gauges and counters (reported under rank 0)."""
        if self.role != KVConnectorRole.WORKER:
            if self.budget is None:
                return None
            now = self.budget_counts
            deltas = {k: v - self._budget_reported[k] for k, v in now.items()}
            self._budget_reported = dict(now)
            return RetroConnectorStats(data={
                COUNTERS: {"0": deltas},
                GAUGES: {"0": {"host_budget_bytes": self.budget.limit_bytes,
                               "host_reserved_bytes": self.budget.reserved_bytes}},
            })
        assert self.runtime is not None, "worker-side connector method on the scheduler side"
        return self.runtime.take_stats(_worker_rank())

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> RetroConnectorStats | None:
        """Rebuild the stats object from its payload (API server side)."""
        return RetroConnectorStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict,
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]
                           ) -> RetroPromMetrics | None:
        """Retro's families on ``/metrics`` (see :mod:`vllm_retro.vllm.metrics`)."""
        from vllm_retro.vllm.metrics import RetroPromMetrics

        if retro_config(vllm_config) is None:
            return None
        return RetroPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _decodes_more(request: Request, end: int, steps: int) -> bool:
    """Whether ``request`` may decode more than ``steps`` tokens after the step that
    computes its first ``end`` tokens (so that it would reach its index)."""
    max_tokens = getattr(request, "max_tokens", None)
    if max_tokens is None:
        return True
    return end - request.num_prompt_tokens + 1 + steps < max_tokens


def _most_tokens(request: Request, tokens: int, max_model_len: int) -> int:
    """The most tokens ``request`` (at ``tokens`` now) can reach: its prompt plus
    ``max_tokens``, at least ``tokens``, at most ``max_model_len``."""
    max_tokens = getattr(request, "max_tokens", None)
    most = max_model_len if max_tokens is None else request.num_prompt_tokens + max_tokens
    return max(tokens, min(most, max_model_len))


def _host_budget(config: Any, vllm_config: VllmConfig, kv_bytes_per_token: int) -> HostBudget:
    """The engine's host-memory budget: ``config.host_memory_gb``, or
    :data:`DEFAULT_SHARE` of the memory available now (the scheduler is built after the
    workers loaded the weights and allocated vLLM's KV cache). Raw K+V per token is
    counted over every tensor-parallel worker on this host."""
    tp = vllm_config.parallel_config.tensor_parallel_size
    if config.host_memory_gb is not None:
        limit = int(config.host_memory_gb * GiB)
    else:
        limit = int(DEFAULT_SHARE * available_host_memory())
    budget = HostBudget(limit_bytes=max(1, limit), kv_bytes_per_token=kv_bytes_per_token * tp,
                        steady_tokens=config.sink_tokens + ring_size(config.local_window,
                                                                     config.update_segment))
    logger.info("retro: host-memory budget for indexed requests %s (%s); an index of 32K "
                "tokens reserves up to %s", describe(budget.limit_bytes),
                "--retro-host-memory-gb" if config.host_memory_gb is not None
                else f"{DEFAULT_SHARE:.0%} of the memory available",
                describe(budget.cost(32768)))
    return budget


def _worker_rank() -> int:
    """This worker's rank in the engine's worker group (0 without distributed state)."""
    from vllm.distributed import parallel_state

    try:
        return parallel_state.get_world_group().rank_in_group
    except (AssertionError, AttributeError):
        return 0
