"""The retro KV connector: the scheduler's per-step plan to the workers.

Scheduler side: decides, for every scheduled request, whether this step starts its index
build or switches it to its index (``build_steps`` of its own steps later; see
:mod:`vllm_retro.vllm.plan`), and which batch slot identifies it (vLLM's attention
backends see rows, not request ids); records indexed requests for the KV-cache manager;
reports finished, aborted and preempted requests so workers free their state; and admits
requests to indexing within the host-memory budget (:mod:`vllm_retro.vllm.host_budget`:
a request that does not fit waits in the queue); and plans Block-Attention requests'
passage loads and saves (:mod:`vllm_retro.vllm.block_cache`). Worker side: hands each
step's plan to the per-process :class:`~vllm_retro.vllm.runtime.RetroRuntime` before the
batch is prepared, and moves passages between the passage cache and the paged KV. No other
KV is transferred: the wave buffer's host tier is filled by the attention backend.
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

from vllm_retro.blocks.directory import BlockDirectory
from vllm_retro.blocks.request import mask_blocks, parse_blocks
from vllm_retro.index.steady import ring_size
from vllm_retro.vllm.block_cache import (
    PAGE_TOKENS,
    BlockCachePlanner,
    BlockCacheWorker,
    cache_pages,
)
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
from vllm_retro.vllm.schedule_state import ScheduleState
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
    failed, which decode densely from their paged KV for their whole life; the passages
    written into the passage cache, and those that failed (on any worker: not cached)."""

    demoted: set[str] = field(default_factory=set)
    passages_written: set[str] = field(default_factory=set)
    passages_failed: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """The union over workers."""
        assert isinstance(other, RetroWorkerReport)
        return RetroWorkerReport(self.demoted | other.demoted,
                                 self.passages_written | other.passages_written,
                                 self.passages_failed | other.passages_failed)


class RetroConnector(KVConnectorBase_V1, SupportsHMA):
    """See module docstring. Loaded by vLLM from ``kv_transfer_config``."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.config = retro_config(vllm_config)
        self.runtime = None
        """Worker side: the engine's retro state in this worker (None: retro off), which
        this connector frees at :meth:`shutdown`."""
        if role == KVConnectorRole.WORKER:
            from vllm_retro.vllm.runtime import engine_runtime

            self.runtime = engine_runtime(vllm_config)
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
        retro_groups = []
        self.schedules: list[ScheduleState] = []
        """Scheduler side: which requests are indexed, one per retro KV-cache group, shared
        with the group's KV-cache manager through its spec; each is told the same."""
        if kv_cache_config is not None:
            for gid, group in enumerate(kv_cache_config.kv_cache_groups):
                spec = group.kv_cache_spec
                if isinstance(spec, RetroAttentionSpec):
                    if self._group is None:
                        self._group, self._block_size = gid, spec.block_size
                    if all(spec.schedule is not s for s in self.schedules):
                        self.schedules.append(spec.schedule)
                    retro_groups.append(group)
                    kv_bytes_per_token += (spec.page_size_bytes // spec.block_size
                                           * len(group.layer_names))
        self.passages: BlockCachePlanner | None = None
        """Scheduler side: Block-Attention's passage cache (None: off)."""
        self.passage_worker: BlockCacheWorker | None = None
        """Worker side: the passage cache's pages and transfers (None: off)."""
        self._layers: dict[str, Any] = {}
        """Worker side: the model's attention layers by name (each step's forward context
        hands them to :meth:`start_load_kv`; :meth:`wait_for_save` follows it)."""
        if self.config is not None and len(retro_groups) == 1:
            self._init_passages(vllm_config, role, retro_groups[0], kv_bytes_per_token)
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

    def _init_passages(self, vllm_config: VllmConfig, role: KVConnectorRole, group: Any,
                       kv_bytes_per_token: int) -> None:
        """The passage cache's scheduler or worker half, sized by ``block_cache_gb``."""
        assert self.config is not None
        pages = cache_pages(self.config.block_cache_gb, kv_bytes_per_token)
        if not pages:
            return
        spec = group.kv_cache_spec
        if role == KVConnectorRole.SCHEDULER:
            model = vllm_config.model_config
            namespace = (f"{model.model}@{model.revision}|{spec.dtype}|{spec.num_kv_heads}x"
                         f"{spec.head_size}|{len(group.layer_names)} layers|tp="
                         f"{vllm_config.parallel_config.tensor_parallel_size}")
            self.passages = BlockCachePlanner(BlockDirectory(pages, PAGE_TOKENS), namespace,
                                              kv_bytes_per_token,
                                              self.config.block_recompute_tokens)
        else:
            self.passage_worker = BlockCacheWorker(group.layer_names, pages, spec.num_kv_heads,
                                                   spec.head_size, spec.dtype, spec.block_size)
        self._passage_counts_reported: dict[str, int] = {}

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """Called as a request is about to start (or restart after preemption): if its
        prompt will be indexed, it starts only once its host-memory reservation fits (None:
        not this step); a Block-Attention request is offered its cached passages from
        ``num_computed_tokens`` on, loaded before its first forward."""
        if self.config is None:
            return 0, False
        prompt = request.num_prompt_tokens
        if (self.budget is not None and prompt >= self.config.min_indexed_context
                and _decodes_more(request, prompt, self._build_steps)
                and self._admit(request, prompt) is Admission.WAIT):
            return None, False  # (shorter prompts may be admitted at their build)
        blocks, _ = self._blocks_of(request)
        if self.passages is None or blocks is None or request.prompt_token_ids is None:
            return 0, False
        return self.passages.offer(request.request_id, request.prompt_token_ids, blocks,
                                   num_computed_tokens), False

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
        """Track requests that reach allocation without :meth:`on_new_request`; the
        passages to load are the ``num_external_tokens`` allocated."""
        self._requests.setdefault(request.request_id, request)
        if self.passages is not None:
            self.passages.allocated(request.request_id, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's plan: a :class:`RowStep` per scheduled request, and the released
        requests (finished since the last step, or preempted)."""
        so = scheduler_output
        preempted = set(so.preempted_req_ids or ())
        released = set(so.finished_req_ids) | preempted
        for rid in released:
            for schedule in self.schedules:
                schedule.release(rid, preempted=rid in preempted)
            self._building.pop(rid, None)
            self._release(rid, finished=rid not in preempted)
            if self.passages is not None:
                self.passages.finished(rid)
        if self.passages is not None:
            self.passages.step_planned()
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
            indexed = self.schedules[0].indexed_at(rid) is not None
            built_at = self._building.get(rid)
            switch = built_at is not None and first >= built_at + lag
            build = (not indexed and built_at is None and end >= req.num_tokens
                     and end >= min_ctx and _decodes_more(req, end, lag)
                     and rid not in self._dense)
            if build and self.budget is not None:
                build = self._admit(req, end) is Admission.ADMITTED
            if switch:
                # Blocks go once this step (which still reads them to catch up) has run.
                for schedule in self.schedules:
                    schedule.mark_indexed(rid, end)
                del self._building[rid]
            elif build:
                self._building[rid] = end
            blocks, error = self._blocks_of(req) if first < req.num_prompt_tokens \
                else (None, None)
            blocks = blocks if blocks and first < blocks[-1] else None
            mask = blocks and mask_blocks(blocks, self.config.block_recompute_tokens)
            meta.rows[rid] = RowStep(slot=slot, start=first, num_tokens=n,
                                     indexed=indexed or switch, build_index=build,
                                     catch_up=switch,
                                     blocks=mask if mask and first < mask[-1] else None,
                                     blocks_error=error)
            if self.passages is not None and req.prompt_token_ids is not None:
                transfer = self.passages.transfer(
                    rid, req.prompt_token_ids, blocks, first, end,
                    state.get_block_ids(rid)[self._group])
                if transfer is not None:
                    meta.passages[rid] = transfer
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
        if self.passages is not None:
            self.passages.saved(report.passages_written, report.passages_failed)
        for rid in report.demoted:
            for schedule in self.schedules:
                schedule.release(rid)
            self._building.pop(rid, None)
            self._release(rid, finished=False)
            self._dense.add(rid)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Blocks are freed at once (passages are saved in the step that computes them);
        the request's host-memory reservation is released now, so a waiting request can
        start at the next step, and the cached passages it was offered are unpinned."""
        self._release(request.request_id, finished=True)
        if self.passages is not None:
            self.passages.finished(request.request_id)
        return False, None

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """Hybrid-allocator variant of :meth:`request_finished`."""
        return self.request_finished(request, [])

    # ------------------------------------------------------------------ worker side
    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Runs before the batch is prepared: free released requests, publish the plan."""
        assert isinstance(kv_connector_metadata, RetroStepMetadata)
        if self.runtime is not None:
            self.runtime.begin_step(kv_connector_metadata)

    def build_connector_worker_meta(self) -> RetroWorkerReport | None:
        """After each step: the requests this worker demoted to dense decoding since the
        last step, and the passages it cached or failed to (see
        :meth:`update_connector_output`)."""
        if self.runtime is None:
            return None
        demoted = self.runtime.fates.take_demoted()
        written, failed = (self.passage_worker.take_report() if self.passage_worker
                           is not None else (set(), set()))
        if not (demoted or written or failed):
            return None
        return RetroWorkerReport(demoted, written, failed)

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
        """Before the forward: write this step's cached passages into the paged KV (keys
        moved to their positions). A request whose load raises fails with an error to its
        client; the others are unaffected."""
        if self.passage_worker is None:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, RetroStepMetadata) and self.runtime is not None
        self._layers = forward_context.no_compile_layers
        for rid, transfer in meta.passages.items():
            try:
                self.passage_worker.load(transfer, self._layers)
            except Exception as exc:  # noqa: BLE001 -- that request fails, not the engine
                self.runtime.fail_request(rid, f"loading its cached passages raised {exc!r}")

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads complete in :meth:`start_load_kv`."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Nothing per layer: the backend hands KV to the wave buffer itself, and passages
        are saved after the forward."""

    def wait_for_save(self) -> None:
        """After the forward: copy the passages this step computed into the passage
        cache."""
        if self.passage_worker is None:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, RetroStepMetadata)
        for transfer in meta.passages.values():
            self.passage_worker.save(transfer, self._layers)

    # ------------------------------------------------------------------ metrics
    def get_kv_connector_stats(self) -> RetroConnectorStats | None:
        """Worker side, after every step: this worker's counter increments, gauges and index
        build times (see :mod:`vllm_retro.vllm.stats`). Scheduler side: the host-memory
        budget's gauges and counters (reported under rank 0)."""
        if self.role != KVConnectorRole.WORKER:
            return self._scheduler_stats()
        return None if self.runtime is None else self.runtime.take_stats(_worker_rank())

    def shutdown(self) -> None:
        """Worker side, at the worker's shutdown: free everything the engine's runtime holds
        (requests, index builder, host pools, worker thread)."""
        if self.runtime is not None:
            self.runtime.close()

    def _scheduler_stats(self) -> RetroConnectorStats | None:
        """The host-memory budget's and the passage cache's counters (deltas since the
        last call) and gauges, reported under rank 0."""
        counters: dict[str, int] = {}
        gauges: dict[str, int] = {}
        if self.budget is not None:
            counters.update({k: v - self._budget_reported[k]
                             for k, v in self.budget_counts.items()})
            self._budget_reported = dict(self.budget_counts)
            gauges.update(host_budget_bytes=self.budget.limit_bytes,
                          host_reserved_bytes=self.budget.reserved_bytes)
        if self.passages is not None:
            p = self.passages
            d = p.directory.stats
            now = {"block_cache_hits": p.counts.hits, "block_cache_misses": p.counts.misses,
                   "block_cache_loaded_tokens": p.counts.loaded_tokens,
                   "block_cache_saved_tokens": p.counts.saved_tokens,
                   "block_cache_evictions": d.evictions, "block_cache_rejected": d.rejected}
            counters.update({k: v - self._passage_counts_reported.get(k, 0)
                             for k, v in now.items()})
            self._passage_counts_reported = now
            page_bytes = PAGE_TOKENS * p.bytes_per_token
            gauges.update(block_cache_bytes=d.pages_used * page_bytes,
                          block_cache_capacity_bytes=p.directory.num_pages * page_bytes,
                          block_cache_passages=d.blocks)
        if not counters and not gauges:
            return None
        return RetroConnectorStats(data={COUNTERS: {"0": counters}, GAUGES: {"0": gauges}})

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
