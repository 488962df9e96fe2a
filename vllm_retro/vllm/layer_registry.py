"""Which indexes a worker holds: every attention layer's
:class:`~vllm_retro.vllm.layer_state.LayerState` (its requests' indexes, its steady-zone and
meta pools) and each live request's slot in those pools (the same slot in every layer).

The registry only records: it neither builds nor frees an index (an index it hands back, replaced
or removed, is the caller's to free) and counts nothing. It changes only between forwards, in
the engine's thread; its reads are lock-protected because metrics and tests read it from other
threads, except :meth:`LayerRegistry.index`, the per-row lookup of the decode path, which reads
two dicts the engine's thread alone writes.
"""

from __future__ import annotations

import threading

from vllm_retro.index.steady import SlotTable
from vllm_retro.index.wave_index import WaveIndex
from vllm_retro.vllm.layer_state import LayerState


class LayerRegistry:
    """See the module docstring."""

    def __init__(self) -> None:
        self._layers: dict[str, LayerState] = {}
        """Each attention layer's state, by vLLM's layer name (made at its first index)."""
        self._slots = SlotTable()
        """Each live request's slot, the same in every layer's steady pool."""
        self._lock = threading.Lock()

    def register(self, request_id: str, layer: str, index: WaveIndex
                 ) -> tuple[WaveIndex | None, bool]:
        """Make ``index`` the request's index of ``layer`` (its steady zone and meta rows
        moved into the layer's pools at the request's slot). Returns the index it replaces
        (None: none; the caller frees it) and whether it is the request's first index here."""
        slot = self._slots.get(request_id)
        with self._lock:
            first = not self._holds(request_id)
            state = self._layers.get(layer)
            if state is None:
                state = self._layers[layer] = LayerState(layer)
            return state.register(request_id, slot, index), first

    def remove(self, request_id: str) -> list[WaveIndex]:
        """Take every index of ``request_id`` out of the layers; returns them for the caller
        to free, before it gives the slot back (:meth:`release_slot`: their rows are in the
        pools)."""
        with self._lock:
            return [i for i in (state.remove(request_id) for state in self._layers.values())
                    if i is not None]

    def release_slot(self, request_id: str) -> None:
        """Give ``request_id``'s slot back; when no request is left, the layers' pools give
        their memory back."""
        self._slots.release(request_id)
        if not len(self._slots):
            for state in self._layers.values():
                state.release_pools()

    def holds(self, request_id: str) -> bool:
        """Whether some layer holds an index of ``request_id``."""
        with self._lock:
            return self._holds(request_id)

    def _holds(self, request_id: str) -> bool:
        return any(request_id in state.indexes for state in self._layers.values())

    def index(self, request_id: str, layer: str) -> WaveIndex | None:
        """The request's index of ``layer`` (None: none here yet). Lock-free: see the module
        docstring."""
        state = self._layers.get(layer)
        return None if state is None else state.indexes.get(request_id)

    def layer(self, name: str) -> LayerState | None:
        """The state of attention layer ``name`` (None before its first index)."""
        return self._layers.get(name)

    def layers(self) -> list[LayerState]:
        """Every layer's state, in the order of their first index."""
        return list(self._layers.values())

    def indexes_of(self, request_id: str) -> dict[str, WaveIndex]:
        """The request's indexes, by layer name."""
        with self._lock:
            return {name: state.indexes[request_id] for name, state in self._layers.items()
                    if request_id in state.indexes}

    def live(self) -> list[str]:
        """The request ids some layer holds an index of, in order of arrival."""
        with self._lock:
            return list(dict.fromkeys(rid for state in self._layers.values()
                                      for rid in state.indexes))

    def held(self) -> dict[str, list[WaveIndex]]:
        """Every held index, by request id (a request's in layer order)."""
        out: dict[str, list[WaveIndex]] = {}
        with self._lock:
            for state in self._layers.values():
                for rid, index in state.indexes.items():
                    out.setdefault(rid, []).append(index)
        return out
