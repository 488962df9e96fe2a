"""CUDA graphs of a layer's device decode step (:func:`~vllm_retro.index.device_layer.decode_step`).

The step's shapes depend only on the batch size and the plan's static widths
(:class:`~vllm_retro.index.device_layer.StepPlan`), so one graph per such key replays it:
per step the query and the plan's integers are copied into the graph's static inputs, then
the whole step is one replay (no per-operation launch cost). A key also holds the steady
pool's storage, the token pools' and the meta rows', which the graph reads by address: a
grown pool (or, read in place, a store's replaced one; a grown meta pool) is a new key. Off
CUDA the step runs eagerly.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

import torch

from vllm_retro.index.device_layer import (
    DeviceLayer,
    StepPlan,
    decode_given_step,
    decode_step,
)


@dataclass
class _Captured:
    graph: Any
    query: torch.Tensor
    ints: torch.Tensor
    given: torch.Tensor | None
    out: torch.Tensor


class StepGraphs:
    """Replays :func:`decode_step` of one :class:`DeviceLayer` from CUDA graphs, captured on
    first use per (batch shape, widths, steady storage, scale); at most ``capacity`` kept
    (least recently used dropped)."""

    def __init__(self, layer: DeviceLayer, capacity: int = 16):
        if capacity < 1:
            raise ValueError(f"StepGraphs: capacity={capacity}; accepted: an integer >= 1")
        self.layer = layer
        self.capacity = capacity
        self._graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self.captures = 0
        """Graphs captured so far (a count for benchmarks and tests)."""

    def _key(self, plan: StepPlan, query: torch.Tensor, scale: float,
             given: torch.Tensor | None) -> tuple:
        return (tuple(query.shape), query.dtype, plan.clusters, plan.retrieval,
                plan.estimation, plan.retrieval_tokens, plan.steady_tokens,
                plan.steady.k.data_ptr(), plan.steady.v.data_ptr(),
                self.layer.keys.data_ptr(), self.layer.values.data_ptr(),
                self.layer.meta_storage(), float(scale),
                None if given is None else tuple(given.shape))

    def _step(self, plan: StepPlan, query: torch.Tensor, scale: float,
              given: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
        if given is None:
            return decode_step(self.layer, plan, query, scale, out)
        return decode_given_step(self.layer, plan, query, given, scale, out)

    def _capture(self, plan: StepPlan, query: torch.Tensor, scale: float,
                 given: torch.Tensor | None) -> _Captured:
        static_q = query.clone()
        static_given = None if given is None else given.clone()
        static_plan = replace(plan, ints=plan.ints.to(query.device, copy=True,
                                                      non_blocking=True))
        stream = torch.cuda.Stream(device=query.device)
        stream.wait_stream(torch.cuda.current_stream(query.device))
        with torch.cuda.stream(stream):  # warm-up outside the graph (allocator, autotuning)
            for _ in range(2):
                self._step(static_plan, static_q, scale, static_given)
        torch.cuda.current_stream(query.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread-local: the wave buffer's worker and the index builder run CUDA calls of their
        # own (pinned allocations, event queries, copies) while a step is captured; under the
        # default global mode any of them invalidated the capture (seen on an H200)
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = self._step(static_plan, static_q, scale, static_given)
        self.captures += 1
        return _Captured(graph, static_q, static_plan.ints, static_given, out)

    def __call__(self, plan: StepPlan, query: torch.Tensor, scale: float,
                 given: torch.Tensor | None = None, out: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """The step's output [B, Hq, D]: :func:`decode_step`, or with ``given`` (the clusters
        the policy chose, [B, H, W]) :func:`decode_given_step`; written into ``out`` when
        given, else on CUDA a view of the graph's static output, valid until the next call
        with the same key. On CUDA ``plan``'s integers may be on the device or pinned on the
        host (:meth:`DeviceLayer.plan` with ``upload=False``: one copy, straight into the
        graph's input)."""
        if query.device.type != "cuda":
            return self._step(plan, query, scale, given, out)
        key = self._key(plan, query, scale, given)
        cap = self._graphs.get(key)
        if cap is None:
            cap = self._capture(plan, query, scale, given)
            self._graphs[key] = cap
            while len(self._graphs) > self.capacity:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
        cap.query.copy_(query)
        cap.ints.copy_(plan.ints, non_blocking=True)
        if given is not None:
            cap.given.copy_(given)
        cap.graph.replay()
        return cap.out if out is None else out.copy_(cap.out)

    def clear(self) -> None:
        """Drop every graph (their memory pools with them)."""
        self._graphs.clear()
