"""vllm_retro.vllm.runtime: where a request's indexes keep their KV."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm_retro.config import RetroConfig  # noqa: E402
from vllm_retro.index.batched import fused_path  # noqa: E402
from vllm_retro.vllm.runtime import RetroRuntime, engine_runtime, made_runtime  # noqa: E402


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_a_layers_requests_share_its_preallocated_pool(backend):
    """Every kernel path reads a layer's rows through one host pool per layer, mapped once
    at its reservation (twice the layer's share of the machine's memory), so no request's
    build grows or copies it, and it holds only the live requests' pages."""
    import psutil

    cfg = RetroConfig(update_segment=64, local_window=16, segment_size=256,
                      kernel_backend=backend)
    rt = RetroRuntime(object(), cfg)
    g = torch.Generator().manual_seed(0)
    for rid in ("x", "y", "z"):
        for layer in ("l0", "l1"):
            rt.build_index(rid, layer, torch.randn(2, 300, 32, generator=g),
                           torch.randn(2, 300, 32, generator=g))
    pool = {(rid, layer): rt.index(rid, layer).store.pool
            for rid in ("x", "y", "z") for layer in ("l0", "l1")}
    assert pool["x", "l0"] is not pool["x", "l1"]
    for layer in ("l0", "l1"):
        assert pool["x", layer] is pool["y", layer] is pool["z", layer]
        host = pool["x", layer].host
        assert host.generation == 1  # mapped once, never grown
        assert host.capacity_pages * host.page_nbytes() >= 2 * psutil.virtual_memory().total
        assert host.nbytes() == host.allocated_pages * host.page_nbytes() > 0
    assert rt.live_bytes()[1] == 0
    if backend == "auto":
        assert fused_path(backend, torch.device("cpu"))  # `make setup` built the kernel
    held = rt.live_bytes()[0]
    rt.free_request("y")
    assert rt.live_bytes()[0] < held  # a finished request's pages are given back
    rt.close()
    assert rt.live_bytes() == (0, 0)


def test_a_request_has_one_slot_in_every_layers_steady_pool():
    """Registered indexes keep their steady zone in their layer's pool, a request at the
    same slot in every layer; a freed request's slot goes to the next one, and with no
    request left the pools give their memory back."""
    cfg = RetroConfig(update_segment=64, local_window=16, segment_size=256)
    rt = RetroRuntime(object(), cfg)
    g = torch.Generator().manual_seed(1)

    def build(rid):
        for layer in ("l0", "l1"):
            k, v = torch.randn(2, 2, 300, 32, generator=g)
            rt.build_index(rid, layer, k, v)
            index = rt.index(rid, layer)
            # the adopted steady zone is the one the index was built from
            assert torch.equal(index.sink_k, k[:, :4]) and torch.equal(index.win_k, k[:, -16:])

    for rid in ("x", "y", "z"):
        build(rid)
    slots = {rid: {rt.index(rid, layer).slot for layer in ("l0", "l1")} for rid in "xyz"}
    assert slots == {"x": {0}, "y": {1}, "z": {2}}
    pools = {layer: rt.index("x", layer).steady for layer in ("l0", "l1")}
    assert pools["l0"] is not pools["l1"]
    assert all(rt.index(r, layer).steady is pools[layer] for r in "yz" for layer in pools)
    host, _ = rt.live_bytes()
    assert host >= sum(p.nbytes() for p in pools.values()) > 0
    # one state per layer holds its pool and its requests' indexes
    for layer in ("l0", "l1"):
        state = rt.registry.layer(layer)
        assert state.name == layer and state.steady is pools[layer]
        assert list(state.indexes) == ["x", "y", "z"]
    assert rt.registry.indexes_of("x") == {layer: rt.index("x", layer) for layer in ("l0", "l1")}
    assert rt.registry.live() == ["x", "y", "z"] and rt.registry.layer("l2") is None
    rt.free_request("y")
    assert rt.registry.indexes_of("y") == {} and "y" not in rt.registry.layer("l0").indexes
    build("w")
    assert rt.index("w", "l1").slot == 1
    for rid in "xzw":
        rt.free_request(rid)
    assert all(p.nbytes() == 0 for p in pools.values())
    assert rt.live_bytes() == (0, 0)
    rt.close()


def test_a_request_counts_live_from_its_build_not_its_switch():
    """The gauges see a request from the step its build holds memory (its indexes wait in
    the builder until the scheduler switches it), with the same clusters then as after its
    switch, and its index meta data in the host bytes; freed, it counts no more."""
    cfg = RetroConfig(update_segment=64, local_window=16, segment_size=256)
    rt = RetroRuntime(object(), cfg)
    g = torch.Generator().manual_seed(2)
    for layer in ("l0", "l1"):
        rt.submit_build("x", layer, torch.randn(2, 300, 32, generator=g),
                        torch.randn(2, 300, 32, generator=g))
    before = rt.take_stats(0).data["gauges"]["0"]
    assert rt.registry.live() == []  # not switched yet
    assert before["live_requests"] == 1 and before["clusters"] > 0
    assert before["host_tier_bytes"] > rt.manager.host_bytes()  # + the indexes' meta data
    rt.index("x", "l0")  # the switch takes the indexes over from the builder
    after = rt.take_stats(0).data["gauges"]["0"]
    assert after["live_requests"] == 1 and after["clusters"] == before["clusters"]
    assert after["host_tier_bytes"] >= before["host_tier_bytes"]  # + its steady-zone slot
    rt.free_request("x")
    freed = rt.take_stats(0).data["gauges"]["0"]
    assert (freed["live_requests"], freed["clusters"], freed["host_tier_bytes"]) == (0, 0, 0)
    rt.close()


def test_an_idle_engine_drops_the_decode_state_and_trims_whichever_request_ends_last(
        monkeypatch):
    """At the step that releases requests and schedules none, every layer's batched-decode
    state (view, packed batch, execution buffer) is dropped and the C heap's free pages go
    back to the OS: also when the last request to end holds no index (dense for life after
    a failed build, or never indexed); not while another request still runs. (No layer runs
    again to drop that state: the soak's worker kept ~0.5 GB of it, and fault requests
    ending last skipped the trim.)"""
    from vllm_retro.vllm import runtime as runtime_module
    from vllm_retro.vllm.plan import RetroStepMetadata, RowStep

    trims = []
    monkeypatch.setattr(runtime_module, "release_free_heap", lambda: trims.append(1) or True)
    cfg = RetroConfig(update_segment=64, local_window=16, segment_size=256)
    rt = RetroRuntime(object(), cfg)
    g = torch.Generator().manual_seed(3)
    rt.build_index("x", "l0", torch.randn(2, 300, 32, generator=g),
                   torch.randn(2, 300, 32, generator=g))
    views = rt.registry.layer("l0").meta_views
    views.exec_buffer(4, 64, 32, torch.float32, torch.device("cpu"))  # as a decode leaves it
    held = views.nbytes()
    assert held > 0
    dense = RowStep(slot=7, start=400, num_tokens=1, indexed=False, build_index=False)
    rt.begin_step(RetroStepMetadata(rows={"d": dense}))
    assert trims == []
    rt.begin_step(RetroStepMetadata(rows={"d": dense}, released={"x"}))  # d still runs
    assert rt.registry.live() == [] and trims == [] and views.nbytes() == held
    rt.begin_step(RetroStepMetadata(released={"d"}))  # the last one, without an index
    assert trims == [1] and views.nbytes() == 0
    rt.begin_step(RetroStepMetadata())  # idle, nothing new released
    assert trims == [1]
    rt.close()


def test_a_layers_indexes_keep_their_meta_rows_in_the_layers_pool():
    """Each layer's indexes hold their centroids, value sums, sizes, ... in extents of one
    meta pool the layer owns (counted once, by the layer); a request leaving gives its
    extent back and the others read their rows unchanged; the last one leaving empties
    it."""
    cfg = RetroConfig(update_segment=64, local_window=16, segment_size=256)
    rt = RetroRuntime(object(), cfg)
    g = torch.Generator().manual_seed(4)
    kv = {rid: [torch.randn(2, n, 32, generator=g) for _ in range(2)]
          for rid, n in (("x", 700), ("y", 300), ("z", 500))}
    for rid, (k, v) in kv.items():
        for layer in ("l0", "l1"):
            rt.build_index(rid, layer, k, v)
    for layer in ("l0", "l1"):
        pool = rt.registry.layer(layer).meta
        places = [rt.index(rid, layer).meta_place() for rid in kv]
        assert all(p is not None and p[0] is pool for p in places)
        assert len(pool.table) == 3 and pool.nbytes() > 0
    alone = rt.index("y", "l0").build(*kv["y"], cfg)  # the same rows, kept by the index
    meta_free = rt.index("y", "l0").meta_nbytes()
    assert meta_free < alone.meta_nbytes()  # the pool's bytes are the layer's to count
    host_before = rt.live_bytes()[0]
    rt.free_request("x")
    assert rt.live_bytes()[0] <= host_before
    y = rt.index("y", "l0")
    for name in ("centroids", "value_sums", "sizes", "spreads", "deviates"):
        assert torch.equal(getattr(y, name), getattr(alone, name)), name
    rt.free_request("y")
    rt.free_request("z")
    assert all(rt.registry.layer(layer).meta.nbytes() == 0 for layer in ("l0", "l1"))
    assert rt.live_bytes() == (0, 0)
    rt.close()


def _engine_config(retro: dict | None, connector: str | None = "RetroConnector"):
    """A stand-in for an engine's ``VllmConfig``: what :func:`engine_runtime` reads."""
    from types import SimpleNamespace

    from vllm.config import KVTransferConfig

    transfer = None if connector is None else KVTransferConfig(kv_connector=connector,
                                                                kv_role="kv_both")
    return SimpleNamespace(additional_config={} if retro is None else {"retro": retro},
                           kv_transfer_config=transfer,
                           device_config=SimpleNamespace(device_type="cpu"))


def test_each_engine_has_its_own_runtime_found_from_its_config():
    """An engine's runtime is made at the first ask and found again from the engine's
    config or a copy sharing its KV-transfer config (``with_hf_config``); another engine
    (its own configs) gets another. Retro off: none, nothing kept. A pickled or deep-copied
    config (another process's, a data-parallel engine's) carries no runtime."""
    import copy
    import pickle
    from types import SimpleNamespace

    one, other = _engine_config({"update_segment": 64}), _engine_config({})
    rt = engine_runtime(one)
    try:
        assert isinstance(rt, RetroRuntime) and rt.config.update_segment == 64
        assert engine_runtime(one) is rt and made_runtime(one) is rt
        assert engine_runtime(SimpleNamespace(**vars(one))) is rt
        rt2 = engine_runtime(other)
        assert rt2 is not rt and rt2.config == RetroConfig()
        rt2.close()
        for moved in (pickle.loads(pickle.dumps(one.kv_transfer_config)),
                      copy.deepcopy(one.kv_transfer_config)):
            assert made_runtime(SimpleNamespace(kv_transfer_config=moved)) is None
    finally:
        rt.close()
    off = _engine_config({"enabled": False})
    assert engine_runtime(off) is None
    assert made_runtime(off) is None
    assert engine_runtime(_engine_config(None, connector=None)) is None  # stock vLLM
