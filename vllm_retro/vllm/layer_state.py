"""One attention layer's retro state on a worker: the layer as the unit of state.

A :class:`LayerState` holds, for one attention layer (by vLLM's layer name), what every
indexed request keeps in that layer: its wave index, its sinks and window in the layer's
steady-zone pool (one slot per request, the request's slot in every layer: the runtime's
:class:`~vllm_retro.index.steady.SlotTable`), its meta rows in an extent of the layer's meta
pool (:class:`~vllm_retro.index.meta_pool.MetaPool`: centroids, value sums, sizes, ...), and
the layer's batched-decode view of its rows (:class:`~vllm_retro.index.padded.MetaViewCache`,
kept across steps). The wave buffer's pools of the layer are its
:class:`~vllm_retro.buffer.layer_pool.LayerPool` (by the same name, in the buffer manager).

The runtime makes one per layer at the layer's first index and hands it to the layer's
forward; it changes only between forwards, in the engine's thread.
"""

from __future__ import annotations

from vllm_retro.index.meta_pool import MetaPool
from vllm_retro.index.padded import MetaViewCache
from vllm_retro.index.steady import SteadyPool
from vllm_retro.index.wave_index import WaveIndex


class LayerState:
    """See the module docstring."""

    def __init__(self, name: str):
        self.name = name
        """vLLM's name of the attention layer."""
        self.steady: SteadyPool | None = None
        """The layer's steady-zone pool (made at its first index, in that index's layout)."""
        self.meta: MetaPool | None = None
        """The layer's meta pool (made at its first index, in that index's layout)."""
        self.indexes: dict[str, WaveIndex] = {}
        """The layer's indexed requests' indexes, by request id."""
        self.meta_views = MetaViewCache()
        """The layer's batched-decode view of its rows, kept across steps
        (:func:`~vllm_retro.index.batched.decode_batch`'s ``cache``)."""

    def register(self, request_id: str, slot: int, index: WaveIndex) -> WaveIndex | None:
        """Make ``index`` the request's index of this layer, its steady zone moved into the
        layer's pool at ``slot`` and its meta rows into the layer's meta pool; returns the
        index it replaces (None: none), for the caller to free."""
        if self.steady is None:
            own = index.steady
            self.steady = SteadyPool(own.num_heads, own.head_dim, own.sink_cap, own.ring,
                                     own.dtype, own.device, slots=0, zeroed=True)
        if self.meta is None:
            self.meta = MetaPool(*index.meta_pool_layout())
        self.steady.ensure(slot + 1)
        index.adopt_steady(self.steady, slot)
        index.adopt_meta(self.meta)
        old = self.indexes.pop(request_id, None)
        self.indexes[request_id] = index
        return old

    def remove(self, request_id: str) -> WaveIndex | None:
        """Take the request's index out of the layer (None: it had none); the caller frees
        it."""
        return self.indexes.pop(request_id, None)

    def release_pools(self) -> None:
        """Give the steady and meta pools' memory back (no request is left in any
        layer)."""
        if self.steady is not None:
            self.steady.release()
        if self.meta is not None:
            self.meta.clear()

    def pools_nbytes(self) -> tuple[int, bool]:
        """(bytes of the steady and meta pools, whether they are on a CUDA device)."""
        if self.steady is None:
            return 0, False
        meta = 0 if self.meta is None else self.meta.nbytes()
        return self.steady.nbytes() + meta, self.steady.device.type == "cuda"
