"""vllm_retro.vllm.layer_registry: which indexes a worker holds, by layer and request."""

from __future__ import annotations

import torch

from vllm_retro.config import RetroConfig
from vllm_retro.index.wave_index import WaveIndex
from vllm_retro.vllm.layer_registry import LayerRegistry

CFG = RetroConfig(update_segment=64, local_window=16, segment_size=256)


def build(g: torch.Generator) -> WaveIndex:
    k, v = torch.randn(2, 2, 300, 32, generator=g)
    return WaveIndex.build(k, v, CFG)


def test_register_remove_and_release():
    """A request's first index is reported as its first; a second index of the same layer
    replaces (and hands back) the first; removal hands every layer's index back, and the
    pools keep their memory until the last request's slot is given back."""
    g = torch.Generator().manual_seed(0)
    reg = LayerRegistry()
    a0, a1, b0 = build(g), build(g), build(g)
    assert reg.register("a", "l0", a0) == (None, True)
    assert reg.register("a", "l1", a1) == (None, False)
    assert reg.register("b", "l0", b0) == (None, True)
    assert reg.live() == ["a", "b"] and reg.holds("a") and not reg.holds("c")
    assert reg.index("a", "l1") is a1 and reg.index("b", "l1") is None
    assert reg.index("a", "l2") is None and reg.layer("l2") is None
    assert reg.indexes_of("a") == {"l0": a0, "l1": a1}
    assert reg.held() == {"a": [a0, a1], "b": [b0]}
    assert [s.name for s in reg.layers()] == ["l0", "l1"]
    assert {a0.slot, b0.slot} == {0, 1} and a1.slot == a0.slot  # one slot in every layer

    again = build(g)
    assert reg.register("b", "l0", again) == (b0, False)  # replaced: the caller frees b0
    b0.free()
    pool = reg.layer("l0").steady
    removed = reg.remove("a")
    assert removed == [a0, a1] and reg.live() == ["b"] and reg.remove("a") == []
    for index in removed:
        index.free()
    reg.release_slot("a")
    assert pool.nbytes() > 0  # "b" still holds its slot
    assert reg.remove("b") == [again]
    again.free()
    reg.release_slot("b")
    assert pool.nbytes() == 0 and reg.layer("l0").meta.nbytes() == 0
    assert reg.live() == [] and reg.held() == {}
