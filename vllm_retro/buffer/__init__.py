"""The wave buffer: host-resident KV of every request of a layer in one page pool, a cluster
mapping table per request, layouts on a CPU worker (RetroInfer §4.3-4.4); the device's cache of
clusters is the device step's (:mod:`vllm_retro.kernels.cluster_cache`)."""

from vllm_retro.buffer.layer_pool import LayerPool
from vllm_retro.buffer.manager import WaveBufferManager
from vllm_retro.buffer.stats import BufferStats
from vllm_retro.buffer.store import WaveBufferStore

__all__ = [
    "BufferStats",
    "LayerPool",
    "WaveBufferManager",
    "WaveBufferStore",
]
