"""The retro plugin inside a real vLLM engine (in-process, CPU, tiny Llama)."""

from __future__ import annotations

import os

import pytest

from tests.vllm.engines import (
    FULL_BUDGET,
    LENGTHS,
    MAX_TOKENS,
    TINY_RETRO,
    decode_two_abort_one,
    engine,
    finish_step,
    full_budget_matches_stock,
    generate_tokens,
    greedy,
    random_prompts,
    runtime_of,
    schedule_of,
    variables_changed_since,
)
from vllm_retro.config import ConfigError
from vllm_retro.vllm.settings import engine_kwargs

pytestmark = pytest.mark.usefixtures("inprocess")

# min_indexed_context under TINY_RETRO: 4 sink + 16 window + 64 update = 84 tokens.


def test_full_budgets_match_stock_token_for_token(tiny_model_dir):
    # Chunked prefill (512-token chunks), mixed lengths, continuous batching, background
    # builds (8 dense steps each); budgets covering every cluster make the wave index
    # exact, so greedy outputs must agree.
    with engine(tiny_model_dir, max_num_batched_tokens=512) as llm:
        stock = generate_tokens(llm, LENGTHS, MAX_TOKENS)
        assert runtime_of(llm) is None  # no retro: no runtime, nothing indexed
    with engine(tiny_model_dir, retro={**TINY_RETRO, **FULL_BUDGET, "build_steps": 8},
                max_num_batched_tokens=512) as llm:
        retro = generate_tokens(llm, LENGTHS, MAX_TOKENS)
        rt = runtime_of(llm)
        c = rt.counters
        # Every request but the 30-token one (50 tokens in all) reaches 84 tokens and is
        # indexed: the long prompts when their prefill completes, the 60-token one during
        # decoding; 2 layers each.
        assert c.indexed_requests == 5
        assert c.indexes_built == 10
        assert c.retro_decode_tokens > 2 * 4 * 90
        assert c.kv_heads == 2
        finish_step(llm)
        assert rt.registry.live() == [] and rt.live_bytes() == (0, 0)
    assert retro == stock


def test_default_budgets_decode_through_the_index(tiny_model_dir):
    # A random model has no attention structure to exploit, so accuracy is checked on the
    # real models; here default budgets must decode every indexed token through the index
    # (built in the step, so each request decodes through its index from its first step).
    with engine(tiny_model_dir, retro={**TINY_RETRO, "build_steps": 0}) as llm:
        out = generate_tokens(llm, [1500, 3000], [80, 80])
        assert [len(o) for o in out] == [80, 80]
        c = runtime_of(llm).counters
        assert c.retro_decode_tokens == 2 * 2 * 79
        assert c.sparse_decode_tokens == 2 * 79 and c.dense_decode_tokens == 0
        # built in the step: all of the build time was the steps'
        assert c.index_build_seconds > 0
        assert c.index_step_seconds == pytest.approx(c.index_build_seconds, rel=0.05)


def test_padded_and_resident_batched_paths_match_the_fused_path(tiny_model_dir):
    # CUDA's two batched paths, here through the 'torch' kernels — over padded rows (KV in
    # the wave buffer) and from device-resident KV (one fixed op sequence per layer step),
    # copied or read in place from the host tier — and the fused CPU kernel decode the same
    # rows to the same greedy tokens: mixed
    # lengths, continuous batching, update blocks every 64 tokens, a request finishing early.
    lengths, max_tokens = [90, 700, 1500, 3000], [40, 150, 150, 150]
    runs = {}
    for backend, resident in (("auto", "auto"), ("torch", "off"), ("torch", "on"),
                              ("torch", "in_place")):
        with engine(tiny_model_dir, retro={**TINY_RETRO, "build_steps": 0,
                                           "kernel_backend": backend,
                                           "device_resident": resident}) as llm:
            runs[backend, resident] = generate_tokens(llm, lengths, max_tokens)
            c = runtime_of(llm).counters
            assert c.retro_decode_tokens > 2 * 3 * 140 and c.index_updates > 0
            stats = runtime_of(llm).manager.stats
            # the device step's counters (the server's metrics): every indexed row of the
            # run where it applies, by placement
            # (under 'auto' on a CPU the layer's in-place step is the fused kernel)
            copied = c.retro_decode_tokens if resident == "on" else 0
            in_place = c.retro_decode_tokens if resident in ("in_place", "auto") else 0
            assert (stats.device_step_rows, stats.device_step_in_place_rows) == \
                (copied, in_place)
    assert runs["torch", "off"] == runs["auto", "auto"]
    assert runs["torch", "on"] == runs["auto", "auto"]
    assert runs["torch", "in_place"] == runs["auto", "auto"]


def _free_blocks(llm) -> int:
    core = llm.llm_engine.engine_core.engine_core
    return core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def test_a_request_decodes_densely_while_its_index_builds_then_switches(tiny_model_dir):
    # build_steps 6: the request decodes 6 steps exactly from its paged KV (keeping its
    # blocks) while its index builds in the background, then switches to the index
    # (catching up the 6 tokens) and frees them. At full budgets the output equals stock's
    # and that of a run whose index was built in the step, token for token.
    prompt = random_prompts([1500], seed=5)
    retro = {**TINY_RETRO, **FULL_BUDGET}
    runs = []
    for settings in (None, {**retro, "build_steps": 0}):
        with engine(tiny_model_dir, retro=settings) as llm:
            runs.append(list(llm.generate(prompt, greedy(60))[0].outputs[0].token_ids))
    stock, in_step = runs
    with engine(tiny_model_dir, retro={**retro, "build_steps": 6}) as llm:
        rt, eng = runtime_of(llm), llm.llm_engine
        eng.add_request("r", prompt[0], greedy(60))
        tokens: list[int] = []

        def step() -> None:
            for out in eng.step():
                tokens[:] = out.outputs[0].token_ids

        free0 = _free_blocks(llm)
        while not tokens:
            step()
        held = _free_blocks(llm)
        for _ in range(6):
            step()
            assert rt.registry.live() == []
            assert _free_blocks(llm) <= held  # decoding from its paged blocks
        assert rt.counters.dense_decode_tokens == 6
        assert rt.counters.sparse_decode_tokens == 0
        step()  # switches (waiting for the build if it is not done)
        assert len(rt.registry.live()) == 1 and rt.builder.pending() == []
        assert rt.counters.sparse_decode_tokens == 1 and rt.counters.dense_decode_tokens == 6
        step()  # the switch step has run: the request's blocks are gone
        assert _free_blocks(llm) > held and _free_blocks(llm) >= free0 - 1
        while eng.has_unfinished_requests():
            step()
        assert rt.counters.sparse_decode_tokens == 59 - 6
    assert tokens == in_step == stock


def test_a_failed_background_build_leaves_the_request_dense_for_life(tiny_model_dir,
                                                                    monkeypatch, caplog):
    # Every build on the builder thread fails. The request goes on from its paged KV; at
    # its switch the worker finds no index, keeps it dense (this step and every later one)
    # and tells the scheduler, which keeps its blocks: stock vLLM's answer.
    import threading

    from vllm_retro.vllm.runtime import RetroRuntime

    real = RetroRuntime._build

    def failing(self, request_id, layer, keys, values):
        if threading.current_thread().name == "retro-index-builder":
            raise MemoryError("injected")
        return real(self, request_id, layer, keys, values)

    monkeypatch.setattr(RetroRuntime, "_build", failing)
    retro = {**TINY_RETRO, **FULL_BUDGET}
    with engine(tiny_model_dir) as llm:
        stock = generate_tokens(llm, [1500], [30])
    with engine(tiny_model_dir, retro={**retro, "build_steps": 4}) as llm:
        out = generate_tokens(llm, [1500], [30])
        c = runtime_of(llm).counters
        assert c.indexed_requests == 0 and c.indexes_built == 0 and c.dense_fallback_requests == 1
        assert c.dense_decode_tokens == 29 and c.sparse_decode_tokens == 0
        finish_step(llm)
        assert runtime_of(llm).live_bytes() == (0, 0)
    assert "request decodes densely from its paged KV" in caplog.text
    assert out == stock


def test_a_request_that_ends_within_build_steps_is_never_indexed(tiny_model_dir):
    with engine(tiny_model_dir, retro={**TINY_RETRO, "build_steps": 8}) as llm:
        generate_tokens(llm, [1500, 1500], [9, 10])
        c = runtime_of(llm).counters
        # 9 tokens: 1 from the prompt step + 8 dense, then done: no build at all. 10: built,
        # and its last token goes through the index.
        assert c.indexed_requests == 1 and c.sparse_decode_tokens == 1
        assert c.dense_decode_tokens == 8 + 8


def test_more_requests_run_at_once_in_the_same_kv_pool(tiny_model_dir):
    # 40 blocks of 128 tokens: one 3500-token request fits, two do not. Stock vLLM must
    # serve the four requests one after another; retro frees each request's blocks once
    # it is indexed, so all four decode together. Built in the step (build_steps 0): with
    # background builds a request keeps its blocks for build_steps more steps, so in a pool
    # this tight fewer overlap (measured: 3 of 4 at build_steps 16).
    kw = {"num_gpu_blocks_override": 40, "max_num_batched_tokens": 1024}
    prompts, params = [3500] * 4, [40] * 4
    with engine(tiny_model_dir, **kw) as llm:
        stock, stock_peak = _stepwise_peak(llm, prompts, params)
    with engine(tiny_model_dir, retro={**TINY_RETRO, "build_steps": 0}, **kw) as llm:
        retro, retro_peak = _stepwise_peak(llm, prompts, params)
        c = runtime_of(llm).counters
        assert c.indexed_requests == 4 and c.peak_decode_rows == 4
    assert [len(o) for o in stock] == [len(o) for o in retro] == params
    assert stock_peak == 1
    assert retro_peak == 4


def _stepwise_peak(llm, lengths: list[int], max_tokens: list[int]
                   ) -> tuple[list[list[int]], int]:
    """Greedy token ids of random prompts of ``lengths`` (as ``generate_tokens``), the
    engine stepped by hand, and the most requests that got a token in one step."""
    eng = llm.llm_engine
    for i, (prompt, n) in enumerate(zip(random_prompts(lengths), max_tokens, strict=True)):
        eng.add_request(str(i), prompt, greedy(n))
    outs: dict[int, list[int]] = {}
    peak = 0
    while eng.has_unfinished_requests():
        stepped = eng.step()
        peak = max(peak, len(stepped))
        outs.update({int(o.request_id): list(o.outputs[0].token_ids) for o in stepped})
    return [outs[i] for i in range(len(lengths))], peak


def test_preempted_indexed_request_is_recomputed_and_reindexed(tiny_model_dir):
    # 40 blocks of 128 tokens. Eight short requests grow to 700 tokens each (dense: below the
    # 1044-token indexing threshold of these settings), which needs 48 blocks; the long
    # request, indexed when its prefill completes, arrived last and is the one vLLM
    # preempts. It is recomputed from scratch, indexed again, and must still produce
    # exactly what stock vLLM produces (full budgets).
    retro = {**TINY_RETRO, **FULL_BUDGET, "update_segment": 1024}
    kw = {"num_gpu_blocks_override": 40, "max_num_batched_tokens": 1024}
    lengths, params = [100] * 8 + [1500], [600] * 9
    with engine(tiny_model_dir, **kw) as llm:
        stock = generate_tokens(llm, lengths, params)
    with engine(tiny_model_dir, retro=retro, **kw) as llm:
        out = generate_tokens(llm, lengths, params)
        c = runtime_of(llm).counters
        finish_step(llm)
        assert runtime_of(llm).live_bytes() == (0, 0)
        assert schedule_of(llm).preempted_indexed >= 1  # the indexed request was preempted ...
    assert c.indexed_requests >= 2 and c.indexes_built >= 4  # ... and indexed again
    assert out == stock


def test_finished_and_aborted_requests_free_every_byte(tiny_model_dir):
    def check(rt):
        host, _ = rt.live_bytes()
        assert host > 2 * 2 * 2000 * 2 * 32 * 4  # both requests' KV in the host tier

    with engine(tiny_model_dir, retro=TINY_RETRO) as llm:
        rt = decode_two_abort_one(llm, check)
        assert rt.counters.requests_released == 2


def test_bad_retro_value_fails_at_startup_naming_it(tiny_model_dir):
    with pytest.raises(ConfigError, match=r"retrieval_budget=2\.0"):
        engine_kwargs(retrieval_budget=2.0)
    bad = engine_kwargs()
    bad["additional_config"] = {"retro": {"retrieval_budget": 2.0}}
    with pytest.raises(Exception, match=r"retrieval_budget=2\.0 is invalid; accepted"), \
            engine(tiny_model_dir, **bad):
        pass


def test_retro_settings_without_connector_fail_at_startup(tiny_model_dir):
    with pytest.raises(Exception, match="kv-transfer-config"), \
            engine(tiny_model_dir, additional_config={"retro": {}}):
        pass


def test_retro_switched_off_is_stock_vllm(tiny_model_dir):
    import vllm  # noqa: F401

    environment = dict(os.environ)
    with engine(tiny_model_dir, retro={"enabled": False}) as llm:
        generate_tokens(llm, [1500], [20])
        assert runtime_of(llm) is None  # nothing of retro's made, nothing indexed
        assert llm.collective_rpc("retro_stats")[0]["enabled"] is False
        assert variables_changed_since(environment)  # vLLM's start-up set its variables ...
    # ... and they are not left for servers this process starts later
    assert not variables_changed_since(environment), variables_changed_since(environment)


PQCACHE = {**TINY_RETRO, "index": "pqcache", "pq_block_tokens": 16}


def test_pqcache_with_every_token_matches_stock_token_for_token(tiny_model_dir):
    # --retro-index pqcache reading every indexed token is full attention: same greedy
    # tokens as stock under chunked prefill, mixed lengths and update blocks (64 tokens)
    full_budget_matches_stock(tiny_model_dir,
                              {**PQCACHE, "pq_token_ratio": 1.0, "build_steps": 4})


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_pqcache_default_budget_decodes_sparse_and_frees_aborted_requests(tiny_model_dir,
                                                                          backend):
    # 'auto' on the CPU: the fused kernel reads host pages in place; 'torch': the batched
    # path through the execution buffer and the block cache (CUDA's)
    def check(rt):
        for rid in rt.registry.live():
            layer = next(iter(rt.registry.indexes_of(rid)))
            idx = rt.index(rid, layer)
            assert type(idx).__name__ == "PQIndex" and 0 < idx.token_budget() < idx.num_indexed

    with engine(tiny_model_dir, retro={**PQCACHE, "build_steps": 0,
                                       "kernel_backend": backend}) as llm:
        rt = decode_two_abort_one(llm, check)
        stats = rt.manager.stats
        assert (stats.hit_tokens + stats.miss_tokens > 0) == (backend == "torch")


def test_pq_subspaces_not_dividing_head_dim_fails_at_startup(tiny_model_dir):
    with pytest.raises(Exception, match=r"pq_subspaces=3 is invalid; accepted: a divisor of "
                                        r"the model's head_dim 32"), \
            engine(tiny_model_dir, retro={"index": "pqcache", "pq_subspaces": 3}):
        pass
