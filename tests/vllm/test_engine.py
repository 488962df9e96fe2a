"""The retro plugin inside a real vLLM engine (in-process, CPU, tiny Llama)."""

from __future__ import annotations

import pytest

from tests.vllm.engines import (
    FULL_BUDGET,
    TINY_RETRO,
    engine,
    finish_step,
    greedy,
    random_prompts,
)
from vllm_retro.config import ConfigError
from vllm_retro.vllm import schedule_state
from vllm_retro.vllm.runtime import get_runtime
from vllm_retro.vllm.settings import engine_kwargs

pytestmark = pytest.mark.usefixtures("inprocess")

# min_indexed_context under TINY_RETRO: 4 sink + 16 window + 64 update = 84 tokens.
LENGTHS = [30, 60, 90, 700, 1500, 3000]
MAX_TOKENS = [20, 100, 100, 100, 100, 100]


def _generate(llm, lengths, max_tokens):
    outs = llm.generate(random_prompts(lengths), [greedy(m) for m in max_tokens])
    return [list(o.outputs[0].token_ids) for o in outs]


def test_full_budgets_match_stock_token_for_token(tiny_model_dir):
    # Chunked prefill (512-token chunks), mixed lengths, continuous batching; budgets
    # covering every cluster make the wave index exact, so greedy outputs must agree.
    with engine(tiny_model_dir, max_num_batched_tokens=512) as llm:
        stock = _generate(llm, LENGTHS, MAX_TOKENS)
        assert get_runtime().counters.indexes_built == 0
    with engine(tiny_model_dir, retro={**TINY_RETRO, **FULL_BUDGET},
                max_num_batched_tokens=512) as llm:
        retro = _generate(llm, LENGTHS, MAX_TOKENS)
        rt = get_runtime()
        c = rt.counters
        # Every request but the 30-token one (50 tokens in all) reaches 84 tokens and is
        # indexed: the long prompts when their prefill completes, the 60-token one during
        # decoding; 2 layers each.
        assert c.requests_indexed == 5
        assert c.indexes_built == 10
        assert c.retro_decode_tokens > 2 * 4 * 90
        assert c.kv_heads == 2
        finish_step(llm)
        assert rt.live_requests() == [] and rt.live_bytes() == (0, 0)
    assert retro == stock


def test_default_budgets_decode_through_the_index(tiny_model_dir):
    # A random model has no attention structure to exploit, so accuracy is checked on the
    # real models; here default budgets must decode every indexed token through the index
    # (builds in the step, so each request is indexed from its first decode step on).
    with engine(tiny_model_dir, retro={**TINY_RETRO, "background_build": False}) as llm:
        out = _generate(llm, [1500, 3000], [80, 80])
        assert [len(o) for o in out] == [80, 80]
        c = get_runtime().counters
        assert c.retro_decode_tokens == 2 * 2 * 79
        assert c.sparse_decode_tokens == 2 * 79 and c.dense_decode_tokens == 0


def _free_blocks(llm) -> int:
    core = llm.llm_engine.engine_core.engine_core
    return core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def test_a_request_decodes_densely_while_its_index_builds_then_switches(tiny_model_dir):
    # The background build is held for 6 decode steps: the request decodes exactly from
    # its paged KV, keeps its blocks, then switches to its index (catching up the tokens
    # decoded meanwhile) and frees them. At full budgets the output equals stock's and
    # that of a run whose index was ready at once, token for token.
    prompt = random_prompts([1500], seed=5)
    retro = {**TINY_RETRO, **FULL_BUDGET}
    runs = []
    for settings in (None, {**retro, "background_build": False}):
        with engine(tiny_model_dir, retro=settings) as llm:
            runs.append(list(llm.generate(prompt, greedy(60))[0].outputs[0].token_ids))
    stock, at_once = runs
    with engine(tiny_model_dir, retro=retro) as llm:
        rt, eng = get_runtime(), llm.llm_engine
        eng.add_request("r", prompt[0], greedy(60))
        tokens: list[int] = []

        def step() -> None:
            for out in eng.step():
                tokens[:] = out.outputs[0].token_ids

        free0 = _free_blocks(llm)
        with rt.builder.hold():
            while not tokens:
                step()
            held = _free_blocks(llm)
            for _ in range(6):
                step()
            assert len(rt.builder.pending()) == 1 and rt.live_requests() == []
            assert rt.counters.dense_decode_tokens == 6
            assert rt.counters.sparse_decode_tokens == 0
            assert _free_blocks(llm) <= held  # still decoding from its paged blocks
        rt.builder.wait()
        step()  # reports the request ready (still dense)
        step()  # switches: catches up the 7 densely decoded tokens, decodes sparse
        assert len(rt.live_requests()) == 1 and rt.builder.pending() == []
        assert rt.counters.sparse_decode_tokens == 1
        dense = rt.counters.dense_decode_tokens
        assert dense == 7
        step()  # the switch step has run: its blocks are gone
        assert _free_blocks(llm) > held and _free_blocks(llm) >= free0 - 1
        while eng.has_unfinished_requests():
            step()
        assert rt.counters.sparse_decode_tokens == 59 - dense
    assert tokens == at_once == stock


def test_more_requests_run_at_once_in_the_same_kv_pool(tiny_model_dir):
    # 40 blocks of 128 tokens: one 3500-token request fits, two do not. Stock vLLM must
    # serve the four requests one after another; retro frees each request's blocks once
    # it is indexed, so all four decode together.
    kw = {"num_gpu_blocks_override": 40, "max_num_batched_tokens": 1024}
    prompts, params = [3500] * 4, [40] * 4
    with engine(tiny_model_dir, **kw) as llm:
        stock = _generate(llm, prompts, params)
        stock_peak = get_runtime().counters.peak_decode_rows
    with engine(tiny_model_dir, retro=TINY_RETRO, **kw) as llm:
        retro = _generate(llm, prompts, params)
        retro_peak = get_runtime().counters.peak_decode_rows
        assert get_runtime().counters.requests_indexed == 4
    assert [len(o) for o in stock] == [len(o) for o in retro] == params
    assert stock_peak == 1
    assert retro_peak == 4


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
        stock = _generate(llm, lengths, params)
    before = schedule_state.num_preempted()
    with engine(tiny_model_dir, retro=retro, **kw) as llm:
        out = _generate(llm, lengths, params)
        c = get_runtime().counters
        finish_step(llm)
        assert get_runtime().live_bytes() == (0, 0)
    after = schedule_state.num_preempted()
    assert after[1] - before[1] >= 1  # the indexed request was preempted ...
    assert c.requests_indexed >= 2 and c.indexes_built >= 4  # ... and indexed again
    assert out == stock


def test_finished_and_aborted_requests_free_every_byte(tiny_model_dir):
    with engine(tiny_model_dir, retro=TINY_RETRO) as llm:
        rt = get_runtime()
        eng = llm.llm_engine
        long_a, long_b = random_prompts([2000, 2500], seed=3)
        eng.add_request("a", long_a, greedy(200))
        eng.add_request("b", long_b, greedy(30))
        for _ in range(200):
            eng.step()
            if rt.counters.retro_decode_tokens >= 2 * 2 * 10:
                break
        assert len(rt.live_requests()) == 2
        host, _ = rt.live_bytes()
        assert host > 2 * 2 * 2000 * 2 * 32 * 4  # both requests' KV in the host tier
        eng.abort_request(["a"])  # mid-decoding
        while eng.has_unfinished_requests():
            eng.step()
        finish_step(llm)
        assert rt.live_requests() == []
        assert rt.live_bytes() == (0, 0)
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
    with engine(tiny_model_dir, retro={"enabled": False}) as llm:
        _generate(llm, [1500], [20])
        rt = get_runtime()
        assert rt.config is None
        assert rt.counters.indexes_built == 0 and rt.counters.retro_decode_tokens == 0
