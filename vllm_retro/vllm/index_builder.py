"""Index builds off the step: one background thread per worker process builds the wave
indexes of newly prefilled requests while the engine keeps stepping.

Hand-off, per request:

1. In the step that completes a request's prompt, each retro layer's forward reads the
   request's KV back from the paged cache (the only part on the critical path: a copy)
   and :meth:`IndexBuilder.submit`\\ s it. At the start of the next step the runtime
   :meth:`IndexBuilder.seal`\\ s it: every layer it has on this worker is queued.
2. The thread builds the layers in submission order (k-means and layout into the wave
   buffer); meanwhile the request keeps decoding exactly from its paged blocks, which
   stay allocated.
3. At the step the scheduler switches the request to its index (``build_steps`` of its
   own steps later), :meth:`IndexBuilder.take` hands its indexes over, waiting for the
   rest of the build only if it is not done by then.

``background=False`` runs each build inside :meth:`submit` (the synchronous behaviour);
the hand-off is the same. On CUDA the thread builds on its own stream, after an event
recorded behind the read-back, and synchronises that stream before a request is ready,
so the main stream never waits on a build.

A build that fails (on the thread or in the step) is logged and dropped with the rest of
its request's layers, and the request is marked failed: :meth:`IndexBuilder.take` says so
at its switch, and the request decodes densely from its paged KV for its whole life (the
runtime demotes it), so the engine and every other request go on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)
_FAILED = ("retro: building layer %s of request %s failed; the request decodes densely "
           "from its paged KV")

BuildFn = Callable[..., Any]
"""Builds one (request, layer) index: (request id, layer name, keys [H_kv, N, D], values)
-> index (anything with a ``free()`` method); the prefill's queries ([H, T, D], for the
graph index), when the submitter gave them, as the keyword ``queries``."""


def _extra(queries: torch.Tensor | None) -> dict[str, torch.Tensor]:
    return {} if queries is None else {"queries": queries}


@dataclass
class _Job:
    request_id: str
    layer: str
    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor | None = None
    ready: Any = None
    """CUDA event recorded on the submitting stream after the read-back (None on CPU)."""


@dataclass
class _Request:
    num_tokens: int
    queued: int = 0
    sealed: bool = False
    indexes: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    failed: bool = False
    """A layer's build failed: the rest of this build is dropped (see module docstring)."""


@dataclass(frozen=True, slots=True)
class ReadyRequest:
    """A request whose every layer on this worker is indexed (see :meth:`IndexBuilder.take`)."""

    request_id: str
    num_tokens: int
    """Tokens the indexes cover (the prompt, or prompt + outputs after a preemption)."""
    indexes: dict[str, Any]
    """Index by layer name."""
    seconds: float
    """Build time summed over the layers (on the builder thread when in the background)."""


class IndexBuilder:
    """See module docstring. Thread-safe; one per worker process."""

    def __init__(self, build: BuildFn, background: bool = True):
        self._build = build
        self.background = background
        self._cond = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._requests: dict[str, _Request] = {}
        self._running: str | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self._stream: Any = None

    # ------------------------------------------------------------------ main thread
    def submit(self, request_id: str, layer: str, num_tokens: int, keys: torch.Tensor,
               values: torch.Tensor, seconds: float = 0.0,
               queries: torch.Tensor | None = None) -> None:
        """Queue (or, not in the background, run) the build of one layer of
        ``request_id``. keys, values: [H_kv, num_tokens, D], owned by the builder from now
        on (a private copy, not a view of the paged cache); ``seconds`` already spent on
        it (reading it back) count in the request's build time."""
        with self._cond:
            req = self._requests.get(request_id)
            if req is None or req.sealed:  # sealed: a new build of the same request
                if req is not None:
                    self._cancel_locked(request_id)
                req = self._requests[request_id] = _Request(num_tokens)
            if req.failed:  # an earlier layer of this build failed: nothing more to build
                return
            req.seconds += seconds
            if not self.background:
                req.queued += 1
        if not self.background:
            t0 = time.perf_counter()
            try:
                index = self._build(request_id, layer, keys, values, **_extra(queries))
            except Exception:
                logger.exception(_FAILED, layer, request_id)
                with self._cond:
                    req.queued -= 1
                    if self._requests.get(request_id) is req:
                        self._fail_locked(request_id, req)
                return
            with self._cond:
                req.queued -= 1
                req.indexes[layer] = index
                req.seconds += time.perf_counter() - t0
            return
        job = _Job(request_id, layer, keys, values, queries)
        if keys.is_cuda:
            job.ready = torch.cuda.Event()
            job.ready.record()
        with self._cond:
            req.queued += 1
            self._queue.append(job)
            self._start_thread()
            self._cond.notify_all()

    def seal(self) -> None:
        """Mark every request submitted so far as complete on this worker (called once the
        step that submitted its layers has run all of them)."""
        with self._cond:
            for req in self._requests.values():
                req.sealed = True

    def take(self, request_id: str) -> tuple[ReadyRequest | None, float]:
        """``request_id``'s indexes (they become the caller's), once every layer submitted
        for it is built, waiting for that if needed; None when it has no build here (never
        submitted, cancelled, or failed: then it is forgotten). Returns (request, seconds
        waited)."""
        t0 = time.perf_counter()
        with self._cond:
            req = self._requests.get(request_id)
            if req is None:
                return None, 0.0
            req.sealed = True
            while self._requests.get(request_id) is req and req.queued > 0:
                self._cond.wait()
            if self._requests.get(request_id) is not req:  # cancelled meanwhile
                return None, time.perf_counter() - t0
            del self._requests[request_id]
            if req.failed:
                return None, time.perf_counter() - t0
        ready = ReadyRequest(request_id, req.num_tokens, req.indexes, req.seconds)
        return ready, time.perf_counter() - t0

    def cancel(self, request_id: str) -> float:
        """Drop ``request_id``'s queued builds, wait for its running one (one layer at
        most), and free every index built for it. Returns the seconds waited."""
        t0 = time.perf_counter()
        with self._cond:
            self._cancel_locked(request_id)
        return time.perf_counter() - t0

    def _cancel_locked(self, request_id: str) -> None:
        self._queue = deque(j for j in self._queue if j.request_id != request_id)
        req = self._requests.pop(request_id, None)
        while self._running == request_id:
            self._cond.wait()
        if req is not None:
            self._free(req)

    def pending(self) -> list[str]:
        """Request ids with builds queued, running, or built but not yet taken (a failed
        build is not pending)."""
        with self._cond:
            return [rid for rid, req in self._requests.items() if not req.failed]

    def failed(self, request_id: str) -> bool:
        """Whether ``request_id``'s build failed (and was not taken or cancelled since)."""
        with self._cond:
            req = self._requests.get(request_id)
            return req is not None and req.failed

    def built(self) -> dict[str, list[Any]]:
        """The indexes built and not yet taken, by request id (they hold memory before
        their request's switch)."""
        with self._cond:
            return {rid: list(req.indexes.values()) for rid, req in self._requests.items()
                    if not req.failed}

    def wait(self) -> None:
        """Block until no build is queued or running."""
        with self._cond:
            while self._queue or self._running is not None:
                self._cond.wait()

    def close(self) -> None:
        """Cancel everything and stop the thread."""
        for rid in self.pending():
            self.cancel(rid)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # ------------------------------------------------------------------ internals
    def _fail_locked(self, request_id: str, req: _Request) -> None:
        """Drop the rest of ``req``'s build and what it built; keep it, marked failed, until
        :meth:`take` or :meth:`cancel` (so later layers of the same build are not built)."""
        dropped = [j for j in self._queue if j.request_id == request_id]
        self._queue = deque(j for j in self._queue if j.request_id != request_id)
        req.queued -= len(dropped)
        req.failed = True
        self._free(req)

    @staticmethod
    def _free(req: _Request) -> None:
        for index in req.indexes.values():
            index.free()
        req.indexes.clear()

    def _start_thread(self) -> None:
        if self._thread is None:
            self._closed = False
            self._thread = threading.Thread(target=self._loop, name="retro-index-builder",
                                            daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._queue:
                    self._cond.wait()
                if self._closed:
                    return
                job = self._queue.popleft()
                self._running = job.request_id
            index, seconds, failed = None, 0.0, False
            try:
                t0 = time.perf_counter()
                index = self._run(job)
                seconds = time.perf_counter() - t0
            except Exception:
                logger.exception(_FAILED, job.layer, job.request_id)
                failed = True
            with self._cond:
                self._running = None
                req = self._requests.get(job.request_id)
                if failed:
                    if req is not None:
                        req.queued -= 1
                        self._fail_locked(job.request_id, req)
                elif req is None:  # cancelled meanwhile
                    index.free()
                else:
                    req.queued -= 1
                    req.indexes[job.layer] = index
                    req.seconds += seconds
                self._cond.notify_all()

    def _run(self, job: _Job) -> Any:
        if job.ready is None:
            return self._build(job.request_id, job.layer, job.keys, job.values,
                               **_extra(job.queries))
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=job.keys.device)
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(job.ready)
            index = self._build(job.request_id, job.layer, job.keys, job.values,
                                **_extra(job.queries))
        self._stream.synchronize()
        return index
