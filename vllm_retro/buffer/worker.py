"""The wave buffer's asynchronous worker (layouts and pool growth): one CPU thread, jobs run in
submission order."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from vllm_retro.buffer.stats import BufferStats


class UpdateWorker:
    """Runs buffer-maintenance jobs off the decode path, FIFO (so one store's updates apply in
    order). With ``enabled=False`` every job runs inline at submission (synchronous mode)."""

    def __init__(self, stats: BufferStats, enabled: bool = True):
        self.stats = stats
        self.enabled = enabled
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="retro-buffer") if enabled else None

    def submit(self, fn: Callable[[], Any]) -> Future:
        """Queue ``fn``; the returned future holds its result (or exception)."""
        t0 = time.perf_counter()
        self.stats.record_submit()

        def run() -> Any:
            try:
                return fn()
            finally:
                self.stats.record_update(time.perf_counter() - t0)

        if self._pool is None:
            fut: Future = Future()
            try:
                fut.set_result(run())
            except BaseException as exc:  # delivered to whoever waits, as in the async mode
                fut.set_exception(exc)
            return fut
        return self._pool.submit(run)

    def wait(self, fut: Future | None) -> Any:
        """Block until ``fut`` is done (counting the wait), re-raising its exception."""
        if fut is None:
            return None
        if not fut.done():
            t0 = time.perf_counter()
            result = fut.result()
            self.stats.add(wait_s=time.perf_counter() - t0)
            return result
        return fut.result()

    def shutdown(self) -> None:
        """Finish queued jobs and stop the thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
