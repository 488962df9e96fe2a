"""The plugin in vLLM's multiprocess engine: compiled mode, and tensor parallelism on CPU."""

from __future__ import annotations

import os

import pytest

from tests.vllm.engines import FULL_BUDGET, TINY_RETRO, engine, greedy, random_prompts

LENGTHS = [60, 1500, 3000]


@pytest.fixture
def multiprocess(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="module")
def stock_outputs(tiny_model_dir):
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    try:
        with engine(tiny_model_dir) as llm:
            outs = llm.generate(random_prompts(LENGTHS), greedy(90))
            return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        mp.undo()


def _run(llm):
    outs = llm.generate(random_prompts(LENGTHS), greedy(90))
    return [list(o.outputs[0].token_ids) for o in outs], llm.collective_rpc("retro_stats")


@pytest.mark.usefixtures("multiprocess")
def test_compiled_multiprocess_engine_uses_retro(tiny_model_dir, stock_outputs):
    # vLLM's default (torch.compile) mode; attention runs as vLLM's custom op, so the
    # retro route is the same as in eager mode.
    with engine(tiny_model_dir, retro={**TINY_RETRO, **FULL_BUDGET},
                enforce_eager=False) as llm:
        outs, stats = _run(llm)
    assert outs == stock_outputs
    (worker,) = stats
    assert worker["pid"] != os.getpid()
    assert worker["enabled"]
    c = worker["counters"]
    assert c["indexed_requests"] == 3 and c["indexes_built"] == 6
    assert c["retro_decode_tokens"] > 0
    # The engine core ran the step that delivers the finished ids by itself.
    assert worker["live_requests"] == [] and worker["live_host_bytes"] == 0


@pytest.mark.usefixtures("multiprocess")
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="tensor parallelism needs 2 cores")
def test_tensor_parallel_workers_index_their_own_heads(tiny_model_dir, stock_outputs,
                                                        monkeypatch):
    # vLLM's CPU workers each bind to NUMA-node cores; on a one-node machine they must be
    # bound by hand, one core each.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    with engine(tiny_model_dir, retro={**TINY_RETRO, **FULL_BUDGET},
                tensor_parallel_size=2, gpu_memory_utilization=0.3) as llm:
        outs, stats = _run(llm)
    assert outs == stock_outputs
    assert len(stats) == 2 and len({w["pid"] for w in stats}) == 2
    for worker in stats:
        c = worker["counters"]
        assert c["kv_heads"] == 1  # 2 KV heads split over 2 workers
        assert c["indexes_built"] == 6 and c["retro_decode_tokens"] > 0
        assert worker["live_requests"] == [] and worker["live_host_bytes"] == 0
