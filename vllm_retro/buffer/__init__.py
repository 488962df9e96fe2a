"""The wave buffer: host-resident KV, a device block cache behind a cluster mapping table,
replacement decided asynchronously on a CPU worker (RetroInfer §4.3-4.4)."""

from vllm_retro.buffer.layer_pool import LayerPool
from vllm_retro.buffer.manager import WaveBufferManager
from vllm_retro.buffer.policy import admit_greedy, eviction_order
from vllm_retro.buffer.stats import BufferStats
from vllm_retro.buffer.store import WaveBufferStore

__all__ = [
    "BufferStats",
    "LayerPool",
    "WaveBufferManager",
    "WaveBufferStore",
    "admit_greedy",
    "eviction_order",
]
