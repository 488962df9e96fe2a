"""The index builder: background builds, readiness, cancellation, failures."""

from __future__ import annotations

import threading

import pytest
import torch

from vllm_retro.config import RetroConfig
from vllm_retro.index.wave_index import WaveIndex
from vllm_retro.vllm.index_builder import IndexBuilder

CFG = RetroConfig(segment_size=256, local_window=16, update_segment=64, update_clusters=4)


def _kv(seed: int, n: int = 700, h: int = 2, d: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(h, n, d, generator=g), torch.randn(h, n, d, generator=g)


class Recorder:
    """Real wave-index builds, recording which indexes were built and freed."""

    def __init__(self, gate: threading.Event | None = None, fail: set[int] | None = None):
        self.gate, self.fail = gate, fail or set()
        self.built: list[WaveIndex] = []
        self.started = threading.Event()
        self.calls = 0

    def __call__(self, request_id: str, layer: str, keys: torch.Tensor, values: torch.Tensor
                 ) -> WaveIndex:
        self.calls += 1
        self.started.set()
        if self.gate is not None:
            self.gate.wait(10)
        if self.calls in self.fail:
            raise RuntimeError("boom")
        index = WaveIndex.build(keys, values, CFG)
        self.built.append(index)
        return index


def _gated_builder() -> tuple[threading.Event, Recorder, IndexBuilder]:
    """A background builder whose builds wait for the returned event."""
    gate = threading.Event()
    rec = Recorder(gate)
    return gate, rec, IndexBuilder(rec)


def _freed(index: WaveIndex) -> bool:
    return index.centroids.shape[1] == 0 and index.store.nbytes() == 0


@pytest.mark.parametrize("background", [True, False])
def test_take_hands_over_every_layer_once_built(background):
    rec = Recorder()
    b = IndexBuilder(rec, background=background)
    kv = [_kv(0), _kv(1)]
    for layer, (k, v) in zip(("l0", "l1"), kv, strict=True):
        b.submit("r", layer, 700, k, v)
    b.seal()
    ready, waited = b.take("r")  # waits for the thread when in the background
    assert ready.request_id == "r" and ready.num_tokens == 700 and ready.seconds > 0
    assert waited >= 0 and sorted(ready.indexes) == ["l0", "l1"]
    for layer, (k, v) in zip(("l0", "l1"), kv, strict=True):
        ref = WaveIndex.build(k, v, CFG)
        assert torch.equal(ready.indexes[layer].centroids, ref.centroids)
        assert torch.equal(ready.indexes[layer].sizes, ref.sizes)
    assert b.take("r") == (None, 0.0) and b.pending() == []
    b.close()


def test_take_waits_for_a_build_still_running():
    gate, rec, b = _gated_builder()
    b.submit("r", "l0", 700, *_kv(0))
    assert rec.started.wait(10)
    threading.Timer(0.1, gate.set).start()
    ready, waited = b.take("r")
    assert waited >= 0.05 and list(ready.indexes) == ["l0"]
    b.close()


def test_cancel_drops_queued_builds_unbuilt():
    gate, rec, b = _gated_builder()
    b.submit("s", "l0", 700, *_kv(1))  # runs first, held at the gate
    b.submit("r", "l0", 700, *_kv(0))
    b.submit("r", "l1", 700, *_kv(0))
    b.seal()
    assert rec.started.wait(10)
    assert b.cancel("r") < 0.05  # r never started: nothing to wait for
    gate.set()
    b.wait()
    assert rec.calls == 1 and b.pending() == ["s"]
    assert b.take("r") == (None, 0.0)
    b.close()


def test_cancel_waits_for_the_running_build_and_frees_everything_built():
    gate, rec, b = _gated_builder()
    b.submit("r", "l0", 700, *_kv(0))
    b.submit("r", "l1", 700, *_kv(1))
    b.seal()
    assert rec.started.wait(10)
    threading.Timer(0.1, gate.set).start()
    waited = b.cancel("r")  # l0 is running: waits for it; l1 never starts
    assert waited >= 0.05
    assert rec.calls == 1 and len(rec.built) == 1 and _freed(rec.built[0])
    assert b.pending() == [] and b.take("r") == (None, 0.0)
    b.close()


@pytest.mark.parametrize("background", [True, False])
def test_a_failed_build_leaves_its_request_dense_and_the_rest_going(caplog, background):
    rec = Recorder(fail={2})
    b = IndexBuilder(rec, background=background)
    for layer in ("l0", "l1", "l2"):
        b.submit("bad", layer, 700, *_kv(0))
    b.submit("good", "l0", 700, *_kv(1))
    b.seal()
    b.wait()
    assert b.failed("bad") and not b.failed("good")
    assert b.pending() == ["good"] and list(b.built()) == ["good"]
    assert b.take("bad")[0] is None
    assert not b.failed("bad")  # taken: forgotten
    assert list(b.take("good")[0].indexes) == ["l0"]
    assert "request decodes densely from its paged KV" in caplog.text
    assert rec.calls == 3  # bad's third layer was dropped with it
    assert _freed(rec.built[0])  # bad's first layer
    b.close()


def test_layers_submitted_after_a_failed_one_are_not_built():
    # The builder thread may fail a request's first layer before the step has submitted
    # the others: they must not start a build of their own (take would then hand over a
    # request missing layers).
    rec = Recorder(fail={1})
    b = IndexBuilder(rec)
    b.submit("bad", "l0", 700, *_kv(0))
    b.wait()
    assert b.failed("bad")
    for layer in ("l1", "l2"):
        b.submit("bad", layer, 700, *_kv(0))
    b.seal()
    b.wait()
    assert rec.calls == 1 and b.pending() == []
    assert b.take("bad")[0] is None
    b.close()


def test_a_request_submitted_again_after_sealing_starts_over():
    # A preempted request is recomputed and indexed again under the same id.
    rec = Recorder()
    b = IndexBuilder(rec, background=False)
    b.submit("r", "l0", 500, *_kv(0, n=500))
    b.seal()
    b.submit("r", "l0", 700, *_kv(1))
    ready, _ = b.take("r")
    assert ready.num_tokens == 700 and _freed(rec.built[0])
    b.close()
