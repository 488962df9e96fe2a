"""Faults injected on purpose inside a real engine (:mod:`vllm_retro.faults`): each fails
only the request it touches — densely answered, or ended with an error to it — frees what
that request held, leaves every other request's tokens unchanged, and the engine goes on."""

from __future__ import annotations

import pytest

from tests.vllm.engines import (
    TINY_RETRO,
    engine,
    finish_step,
    greedy,
    random_prompts,
    runtime_of,
    schedule_of,
)
from vllm_retro import faults

pytestmark = pytest.mark.usefixtures("inprocess")

LENGTHS = [2000, 1500, 2500]
MAX_TOKENS = [90, 90, 90]
"""Three indexed requests; each decodes past its first update block (64 tokens)."""


@pytest.fixture
def faults_on(monkeypatch):
    monkeypatch.setattr(faults, "ENABLED", True)


def run(llm, ids: list[str], lengths=LENGTHS, max_tokens=MAX_TOKENS, then=None
        ) -> dict[str, tuple[list[int], str]]:
    """Add the requests under ``ids`` and step to the end: (token ids, finish reason) by
    id. ``then``: (request id, more tokens) added once the others are done — the engine
    still serves."""
    eng = llm.llm_engine
    prompts = random_prompts(lengths, seed=7)
    for rid, prompt, m in zip(ids, prompts, max_tokens, strict=True):
        eng.add_request(rid, prompt, greedy(m))
    got: dict[str, tuple[list[int], str]] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                got[out.request_id] = (list(out.outputs[0].token_ids),
                                       out.outputs[0].finish_reason)
    finish_step(llm)
    return got


def plain(got: dict[str, tuple[list[int], str]]) -> dict[str, tuple[list[int], str]]:
    """``got`` keyed by the request ids without their fault marks."""
    return {rid.split("-" + faults.MARK)[0]: v for rid, v in got.items()}


def assert_all_freed(llm, ids: list[str]) -> None:
    rt = runtime_of(llm)
    assert rt.registry.live() == [] and rt.live_bytes() == (0, 0)
    assert rt.builder.pending() == []
    assert all(schedule_of(llm).indexed_at(rid) is None for rid in ids)
    core = llm.llm_engine.engine_core.engine_core
    pool = core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # all but the null block


@pytest.mark.parametrize("site", ["index_build", "host_alloc"])
@pytest.mark.parametrize("build_steps", [0, 4])
def test_a_failed_index_build_leaves_its_request_dense_and_the_others_unchanged(
        tiny_model_dir, faults_on, site, build_steps, caplog):
    ids = ["a", "b", "c"]
    with engine(tiny_model_dir) as llm:
        stock = run(llm, ids)
    retro = {**TINY_RETRO, "build_steps": build_steps}
    with engine(tiny_model_dir, retro=retro) as llm:
        clean = run(llm, ids)
    with engine(tiny_model_dir, retro=retro) as llm:
        ids = ["a", f"b-{faults.MARK}{site}", "c"]
        got = plain(run(llm, ids))
        c = runtime_of(llm).counters
        assert c.dense_fallback_requests == 1 and c.failed_requests == 0
        assert c.indexed_requests == 2  # a and c
        assert_all_freed(llm, ids)
    assert got["b"] == stock["b"]  # dense for its whole life: stock vLLM's answer
    assert got["a"] == clean["a"] and got["c"] == clean["c"]
    assert "decodes densely from its paged KV" in caplog.text


@pytest.mark.parametrize("site", ["kernel_row", "host_alloc_late"])
def test_a_request_whose_index_breaks_fails_alone_with_an_error(tiny_model_dir, faults_on,
                                                                 site, caplog):
    ids = ["a", "b", "c"]
    retro = {**TINY_RETRO, "build_steps": 0}
    with engine(tiny_model_dir, retro=retro) as llm:
        clean = run(llm, ids)
    with engine(tiny_model_dir, retro=retro) as llm:
        ids = ["a", f"b-{faults.MARK}{site}", "c"]
        got = plain(run(llm, ids))
        c = runtime_of(llm).counters
        assert c.failed_requests == 1 and c.indexed_requests == 3
        assert_all_freed(llm, ids)
        after = run(llm, ["d"], [1800], [70])  # the engine goes on serving
        assert after["d"][1] == "length" and len(after["d"][0]) == 70
        assert_all_freed(llm, ["d"])
    tokens, reason = got["b"]
    assert reason == "error"
    assert len(tokens) < MAX_TOKENS[1]
    assert got["a"] == clean["a"] and got["c"] == clean["c"]
    assert "request b-retro-fault-" in caplog.text and "fails:" in caplog.text


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_failed_update_worker_jobs_change_no_answer(tiny_model_dir, faults_on, backend,
                                                    caplog):
    # The host pool's room growth (every path, both kernel backends) only saves time: the
    # next layout grows the pool itself.
    ids = ["a", "b", "c"]
    retro = {**TINY_RETRO, "build_steps": 0, "kernel_backend": backend,
             "device_resident": "off"}
    with engine(tiny_model_dir, retro=retro) as llm:
        clean = run(llm, ids)
    with engine(tiny_model_dir, retro=retro) as llm:
        ids = ["a", f"b-{faults.MARK}update_worker", "c"]
        got = plain(run(llm, ids))
        rt = runtime_of(llm)
        assert rt.manager.stats.buffer_update_failures > 0
        assert rt.counters.failed_requests == 0 and rt.counters.dense_fallback_requests == 0
        assert_all_freed(llm, ids)
    assert got == clean
    assert "growing the host pool for request b-retro-fault-update_worker" in caplog.text


def test_faults_are_off_unless_the_server_switches_them_on(tiny_model_dir):
    # Without the switch a client's request id asking for a fault is just an id.
    assert not faults.ENABLED
    with engine(tiny_model_dir, retro={**TINY_RETRO, "build_steps": 0}) as llm:
        got = run(llm, [f"a-{faults.MARK}kernel_row"], [1500], [70])
        c = runtime_of(llm).counters
        assert c.failed_requests == 0 and c.dense_fallback_requests == 0
    assert got[f"a-{faults.MARK}kernel_row"][1] == "length"


def test_a_request_whose_append_raises_fails_alone_with_an_error(tiny_model_dir, monkeypatch,
                                                                  caplog):
    # Not a switchable fault site: the index's own bookkeeping raising for one row, mid
    # decode (its token is already in the layer's steady pool).
    from vllm_retro.index.wave_index import WaveIndex

    ids = ["a", "b", "c"]
    retro = {**TINY_RETRO, "build_steps": 0}
    with engine(tiny_model_dir, retro=retro) as llm:
        clean = run(llm, ids)
    real = WaveIndex.appended

    def appended(self, n):
        if (self.store.request_id or "").startswith("b") and self.num_tokens >= 1540:
            raise MemoryError("injected: append")
        return real(self, n)

    monkeypatch.setattr(WaveIndex, "appended", appended)
    with engine(tiny_model_dir, retro=retro) as llm:
        got = run(llm, ids)
        assert runtime_of(llm).counters.failed_requests == 1
        assert_all_freed(llm, ids)
    assert got["b"][1] == "error" and 30 <= len(got["b"][0]) < MAX_TOKENS[1]
    assert got["a"] == clean["a"] and got["c"] == clean["c"]
    assert "appending its token to its index raised MemoryError" in caplog.text
