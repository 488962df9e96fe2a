"""The wave buffer manager: one per worker process and device.

Owns the update worker, the layers' pools (:class:`~vllm_retro.buffer.layer_pool.LayerPool`,
one per layer name: every request's store of a layer lives in it), the execution buffers of
the per-row path (one per dtype and device, shared by every layer and request), the
counters, and the registry of live per-request stores, so that everything a request held
can be freed at once when it finishes or is aborted.
"""

from __future__ import annotations

import itertools
import threading

import torch

from vllm_retro.buffer.layer_pool import LayerPool
from vllm_retro.buffer.stats import BufferStats
from vllm_retro.buffer.store import WaveBufferStore
from vllm_retro.buffer.worker import UpdateWorker
from vllm_retro.config import RetroConfig
from vllm_retro.growth import grown


class WaveBufferManager:
    """Factory and registry of :class:`WaveBufferStore` objects, keyed by request id."""

    def __init__(self, config: RetroConfig | None = None, pool_reserve_bytes: int = 0):
        """``pool_reserve_bytes``: host address space each layer's page pool is mapped with
        (:class:`~vllm_retro.buffer.layer_pool.LayerPool`; a store's private pool gets
        none and grows as it fills)."""
        if pool_reserve_bytes < 0:
            raise ValueError(f"pool_reserve_bytes {pool_reserve_bytes}; accepted: >= 0")
        self.config = config or RetroConfig()
        self.pool_reserve_bytes = int(pool_reserve_bytes)
        self.stats = BufferStats()
        self.worker = UpdateWorker(self.stats, enabled=self.config.async_updates)
        self._stores: dict[str, list[WaveBufferStore]] = {}
        self._exec: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        self._pools: dict[tuple, LayerPool] = {}
        self._private = itertools.count()
        self._lock = threading.Lock()

    def store(self, request_id: str, num_heads: int, head_dim: int, dtype: torch.dtype,
              device: torch.device | str, layer: str | None = None) -> WaveBufferStore:
        """A new store for one layer of ``request_id`` (registered for :meth:`free_request`),
        in the pools of ``layer`` (a layer name: the stores decoded together in one batch
        share it); None: pools of its own."""
        device = torch.device(device)
        name = ("private", next(self._private)) if layer is None else ("layer", layer)
        key = (name, num_heads, head_dim, dtype, device)
        with self._lock:
            pool = self._pools.get(key)
            if pool is None:
                pool = self._pools[key] = LayerPool(
                    num_heads, head_dim, self.config.page_size, dtype, device, self.stats,
                    on_empty=lambda p, key=key: self._drop_pool(key, p),
                    reserve_bytes=0 if layer is None else self.pool_reserve_bytes,
                    worker=self.worker)
            st = WaveBufferStore(pool, self.config, self.exec_buffer, request_id)
            self._stores.setdefault(request_id, []).append(st)
        return st

    def _drop_pool(self, key: tuple, pool: LayerPool) -> None:
        """Release ``pool`` if it has no store left (checked under the lock that
        :meth:`store` creates stores under)."""
        with self._lock:
            if pool.stores:
                return
            if self._pools.get(key) is pool:
                del self._pools[key]
            pool.release()

    def free_request(self, request_id: str) -> bool:
        """Free every store of ``request_id`` (finished or aborted); False if unknown."""
        with self._lock:
            stores = self._stores.pop(request_id, None)
        for st in stores or ():
            st.free()
        return stores is not None

    def live_requests(self) -> list[str]:
        """Request ids holding stores."""
        with self._lock:
            return list(self._stores)

    def host_bytes(self) -> int:
        """Host bytes of the layers' pools: the live requests' host pages (pinned pools:
        every registered byte, see :meth:`~vllm_retro.buffer.host_tier.HostTier.nbytes`)."""
        with self._lock:
            return sum(p.nbytes() for p in self._pools.values())

    def exec_buffer(self, num_heads: int, tokens: int, head_dim: int, dtype: torch.dtype,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``[num_heads, tokens, head_dim]`` (K, V) of the shared execution buffer,
        grown (by >= 1.5x, zero-filled) when too small; contents are not preserved across
        calls."""
        need = num_heads * tokens * head_dim
        key = (dtype, torch.device(device))
        k, v = self._exec.get(key, (None, None))
        if k is None or k.numel() < need:
            old = 0 if k is None else 2 * k.numel() * k.element_size()
            size = grown(need, 0 if k is None else k.numel())
            k = torch.zeros(size, dtype=dtype, device=device)
            v = torch.zeros(size, dtype=dtype, device=device)
            self._exec[key] = (k, v)
            self.stats.add(device_bytes=2 * size * k.element_size() - old)
        shape = (num_heads, tokens, head_dim)
        return k[:need].view(shape), v[:need].view(shape)

    def exec_nbytes(self) -> int:
        """Device bytes of the shared execution buffers (K and V, every dtype and device)."""
        return sum(2 * k.numel() * k.element_size() for k, _ in self._exec.values())

    def close(self) -> None:
        """Free every request, the execution buffers, and stop the worker."""
        for rid in self.live_requests():
            self.free_request(rid)
        for k, _ in self._exec.values():
            self.stats.add(device_bytes=-2 * k.numel() * k.element_size())
        self._exec.clear()
        self.worker.shutdown()
