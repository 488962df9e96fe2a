"""Block-Attention's passage cache inside a real engine: passages computed once are loaded
into later requests at new positions (keys equal to a full prefill's there), answers equal
a full prefill's, a request mixes cached and new passages, the cache evicts under its
budget, and an aborted request leaves nothing pinned."""

from __future__ import annotations

import random

import pytest
import torch

from tests.vllm.engines import (
    FULL_BUDGET,
    TINY_RETRO,
    engine,
    finish_step,
    random_prompts,
    schedule_of,
)
from tests.vllm.test_blocks import params
from vllm_retro.blocks.attention import query_starts
from vllm_retro.blocks.request import block_prompt, mask_blocks
from vllm_retro.vllm.block_cache import BlockCacheWorker

pytestmark = pytest.mark.usefixtures("inprocess")

STEPS = 8
RETRO = {**TINY_RETRO, **FULL_BUDGET}


def _tokens(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(10, 500) for _ in range(n)]


_rng = random.Random(5)
PASSAGES = [_tokens(n, _rng) for n in (90, 110, 130, 75, 100)]
QUESTIONS = [_tokens(40, _rng), _tokens(35, _rng), _tokens(300, _rng)]


def compose(order: list[int], question: int) -> tuple[list[int], list[int]]:
    """A prompt of the passages ``order`` then a question, and its block starts."""
    ids, blocks = [], []
    for i in order:
        blocks.append(len(ids))
        ids += PASSAGES[i]
    blocks.append(len(ids))
    return ids + QUESTIONS[question], blocks


PROMPTS = {
    "cold": compose([0, 1, 2, 3], 0),
    "reordered": compose([2, 0, 3, 1], 1),  # every passage cached, each at a new position
    "mixed": compose([1, 4, 0], 0),  # 1 cached, 4 new, 0 cached but after a miss
    "long": compose([3, 2, 1, 0], 2),  # a 300-token question: prefilled over 3 steps
    "long_again": compose([1, 0, 3, 2], 2),  # new starts: nothing from vLLM's prefix cache
}


def run(llm, name: str) -> list[int]:
    """Greedy tokens of ``PROMPTS[name]`` alone."""
    ids, blocks = PROMPTS[name]
    out = llm.generate([block_prompt(ids, blocks)], [params(STEPS, blocks)], use_tqdm=False)
    finish_step(llm)
    return list(out[0].outputs[0].token_ids)


def planner(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler.connector.passages


def hf_keys(model_dir, ids: list[int], blocks: list[int]) -> list[torch.Tensor]:
    """Each layer's keys [H_kv, T, D] (after RoPE) of a full prefill of ``ids`` under the
    block mask, in transformers (fp32, eager)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager")
    pos = torch.arange(len(ids))
    starts = query_starts(pos, blocks)
    visible = (pos[None, :] >= starts[:, None]) & (pos[None, :] <= pos[:, None])
    mask = torch.zeros(1, 1, len(ids), len(ids)).masked_fill(~visible, float("-inf"))
    with torch.no_grad():
        cache = model(torch.tensor([ids]), attention_mask=mask, position_ids=pos[None],
                      use_cache=True).past_key_values
    return [layer.keys[0] for layer in cache.layers]


@pytest.fixture(scope="module")
def references(tiny_model_dir):
    """Every prompt's tokens from an engine without the passage cache (full prefills)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        with engine(tiny_model_dir, retro={**RETRO, "block_cache_gb": 0.0},
                    max_num_batched_tokens=128) as llm:
            assert planner(llm) is None
            return {name: run(llm, name) for name in PROMPTS}


def test_cached_passages_load_at_new_positions_as_a_full_prefill(tiny_model_dir, references,
                                                                 monkeypatch):
    loaded: dict[int, torch.Tensor] = {}  # layer -> keys [H, T, D] at the loaded positions
    positions: list[int] = []
    real_load = BlockCacheWorker.load

    def spy(self, transfer, layers):
        """Load, then read back what landed in the paged cache."""
        real_load(self, transfer, layers)
        if not transfer.loads:
            return
        table = torch.tensor(transfer.block_ids)
        for i, name in enumerate(self.layer_names):
            layer = layers[name]
            parts = [layer.impl.read_kv(layer, layer.kv_cache, table, ld.dst + ld.count,
                                        first=ld.dst)[0] for ld in transfer.loads]
            loaded[i] = torch.cat(parts, dim=1)
        positions[:] = [p for ld in transfer.loads for p in range(ld.dst, ld.dst + ld.count)]

    monkeypatch.setattr(BlockCacheWorker, "load", spy)
    with engine(tiny_model_dir, retro=RETRO, max_num_batched_tokens=128) as llm:
        p = planner(llm)
        assert run(llm, "cold") == references["cold"]
        assert (p.counts.hits, p.counts.misses, p.counts.loaded_tokens) == (0, 4, 0)
        assert p.counts.saved_tokens == sum(len(PASSAGES[i]) for i in range(4))
        assert not loaded
        assert run(llm, "reordered") == references["reordered"]
        ids, blocks = PROMPTS["reordered"]
        assert p.counts.hits == 4 and p.counts.loaded_tokens == blocks[-1]
        assert positions == list(range(blocks[-1]))  # every passage, none computed
        want = hf_keys(tiny_model_dir, ids, blocks)
        for layer, keys in loaded.items():
            torch.testing.assert_close(keys, want[layer][:, :blocks[-1]], atol=2e-5,
                                       rtol=1e-4)
        loaded.clear()
        assert run(llm, "mixed") == references["mixed"]
        ids, blocks = PROMPTS["mixed"]
        assert positions == list(range(blocks[1]))  # passage 1 loaded; 4 and 0 computed
        assert (p.counts.hits, p.counts.misses) == (5, 6)
        assert p.counts.saved_tokens == sum(len(q) for q in PASSAGES)
        assert p.directory.pinned_pages() == 0


def test_recompute_computes_the_tail_before_the_question_against_everything(tiny_model_dir,
                                                                          monkeypatch):
    """``block_recompute_tokens``: the tail is neither loaded nor saved, and its keys are a
    full prefill's under the widened mask (not the paper's, which this test tells apart)."""
    recompute = 50
    seen: dict[str, object] = {}
    real_load = BlockCacheWorker.load

    def spy(self, transfer, layers):
        real_load(self, transfer, layers)
        if transfer.loads:
            seen.update(table=torch.tensor(transfer.block_ids), layers=layers,
                        names=self.layer_names)

    monkeypatch.setattr(BlockCacheWorker, "load", spy)
    # one step loads and computes the whole prompt: its block-table row covers it all
    with engine(tiny_model_dir, retro={**RETRO, "block_recompute_tokens": recompute},
                max_num_batched_tokens=512) as llm:
        p = planner(llm)
        run(llm, "cold")  # passages 0..3; 3 (330..405) reaches past 405 - 50: not saved
        assert p.counts.saved_tokens == sum(len(PASSAGES[i]) for i in range(3))
        ids, blocks = PROMPTS["reordered"]  # 2, 0, 3 (new), 1 (cut at 355)
        run(llm, "reordered")
        assert (p.counts.hits, p.counts.misses, p.counts.loaded_tokens) == (2, 6, 220)
        assert p.counts.saved_tokens == sum(len(PASSAGES[i]) for i in range(4))
        assert p.directory.pinned_pages() == 0
        widened = mask_blocks(blocks, recompute)
        assert widened == (0, 130, 220, 295, 355)
        want = hf_keys(tiny_model_dir, ids, list(widened))
        paper = hf_keys(tiny_model_dir, ids, blocks)
        n = len(ids)
        for i, name in enumerate(seen["names"]):
            layer = seen["layers"][name]
            keys = layer.impl.read_kv(layer, layer.kv_cache, seen["table"], n)[0]
            torch.testing.assert_close(keys, want[i][:, :n], atol=2e-5, rtol=1e-4)
        # the last layer's tail keys depend on the mask: the paper's differs there
        assert (paper[-1][:, 355:405] - want[-1][:, 355:405]).abs().max() > 1e-3


def test_a_request_aborted_after_its_load_leaves_nothing_pinned(tiny_model_dir, references):
    with engine(tiny_model_dir, retro=RETRO, max_num_batched_tokens=128) as llm:
        p = planner(llm)
        run(llm, "cold")
        ids, blocks = PROMPTS["long"]
        eng = llm.llm_engine
        eng.add_request("gone", block_prompt(ids, blocks), params(STEPS, blocks))
        eng.step()  # loads every passage, computes 128 of the question's 300 tokens
        assert p.counts.hits == 4 and p.directory.pinned_pages() > 0
        eng.abort_request(["gone"])
        eng.add_request("waiting", block_prompt(ids, blocks), params(STEPS, blocks))
        eng.abort_request(["waiting"])  # aborted before it was ever scheduled
        finish_step(llm)
        finish_step(llm)
        assert p.directory.pinned_pages() == 0
        assert run(llm, "long_again") == references["long_again"]  # the passages are intact
        assert p.counts.hits == 8 and p.directory.pinned_pages() == 0


def test_a_preempted_request_loads_its_passages_again(tiny_model_dir, monkeypatch):
    """20 blocks of 128 tokens; eight plain requests growing to 350 tokens need 24, so vLLM
    preempts the latest: the Block-Attention request, which loaded its passages. It loads
    them again when it restarts and answers as without the cache; nothing stays pinned.
    (Update segments of 1024 tokens: no prompt here is indexed, which would free blocks.)"""
    from vllm_retro.vllm.block_cache import BlockCachePlanner

    taken: list[tuple[str, int]] = []
    real_allocated = BlockCachePlanner.allocated

    def spy(self, request_id, num_external):
        if request_id in self._offered:
            taken.append((request_id, num_external))
        real_allocated(self, request_id, num_external)

    monkeypatch.setattr(BlockCachePlanner, "allocated", spy)
    ids, blocks = PROMPTS["reordered"]
    prompts = [*random_prompts([100] * 8, seed=3), block_prompt(ids, blocks)]
    sampling = [params(250)] * 8 + [params(150, blocks)]
    kw = {"num_gpu_blocks_override": 20, "max_num_batched_tokens": 1024, "max_model_len": 2048}
    retro = {**RETRO, "update_segment": 1024}

    def generate(llm) -> list[list[int]]:
        outs = llm.generate(prompts, sampling, use_tqdm=False)
        finish_step(llm)
        return [list(o.outputs[0].token_ids) for o in outs]

    with engine(tiny_model_dir, retro={**retro, "block_cache_gb": 0.0}, **kw) as llm:
        want = generate(llm)
    with engine(tiny_model_dir, retro=retro, **kw) as llm:
        p = planner(llm)
        run(llm, "cold")
        taken.clear()
        assert generate(llm) == want
        assert p.directory.pinned_pages() == 0
        assert schedule_of(llm).preempted > 0
    loads = [n for _, n in taken if n]
    assert len(loads) >= 2 and len({rid for rid, _ in taken}) == 1  # loaded, and again
    assert loads[0] == blocks[-1]


def test_the_cache_evicts_least_recently_used_passages_within_its_budget(tiny_model_dir,
                                                                         references):
    # 10 pages of 32 tokens (1 KiB a token: 2 layers x K,V x 2 heads x 32 x fp32): room
    # for two or three of the four passages
    budget = 10 * 32 * 1024 / (1 << 30)
    with engine(tiny_model_dir, retro={**RETRO, "block_cache_gb": budget},
                max_num_batched_tokens=128) as llm:
        p = planner(llm)
        assert p.directory.num_pages == 10
        for name in ("cold", "reordered", "mixed", "cold"):
            assert run(llm, name) == references[name]
            assert p.directory.stats.pages_used <= 10
        d = p.directory.stats
        assert d.evictions > 0 and 0 < p.counts.hits < 12
        assert p.directory.pinned_pages() == 0


# ------------------------------------------------------------------ the planner alone
def _planner(pages: int = 64):
    from vllm_retro.blocks.directory import BlockDirectory
    from vllm_retro.vllm.block_cache import PAGE_TOKENS, BlockCachePlanner

    return BlockCachePlanner(BlockDirectory(pages, PAGE_TOKENS), "ns", 1024)


def _save_all(p, rid, ids, blocks):
    """Prefill ``rid`` whole in one step and report its passages written."""
    t = p.transfer(rid, ids, blocks, 0, len(ids), list(range(len(ids) // 16 + 1)))
    p.saved({s.digest for s in t.saves}, set())
    p.finished(rid)
    return t


def test_offers_run_from_the_first_uncomputed_token_to_the_first_miss():
    p = _planner()
    ids, blocks = PROMPTS["cold"]  # passages 0..3
    t = _save_all(p, "a", ids, blocks)
    assert [(s.start, s.num_tokens) for s in t.saves] == [(0, 90), (90, 110), (200, 130),
                                                          (330, 75)]
    ids, blocks = PROMPTS["mixed"]  # 1 cached, 4 new, 0 cached
    assert p.offer("b", ids, blocks, 0) == 110
    assert p.offer("b", ids, blocks, 48) == 62  # vLLM's prefix cache holds 48: the rest
    p.allocated("b", 62)
    assert p.directory.pinned_pages() == 4
    t = p.transfer("b", ids, blocks, 110, 110 + 128, list(range(20)))
    (load,), (save,) = t.loads, t.saves  # passage 4 ends in this step: saved
    assert (load.src, load.first, load.count, load.dst) == (90, 48, 62, 48)
    assert (save.start, save.num_tokens) == (110, 100)
    assert (p.counts.hits, p.counts.misses, p.counts.loaded_tokens) == (1, 2, 62)
    p.step_planned()
    assert p.directory.pinned_pages() == 4  # the save's, until reported
    p.saved({save.digest}, set())
    assert p.directory.pinned_pages() == 0 and p.directory.stats.blocks == 5


def test_a_cut_load_keeps_whole_passages_first_and_a_refused_one_unpins():
    p = _planner()
    _save_all(p, "a", *PROMPTS["cold"])
    ids, blocks = PROMPTS["reordered"]
    assert p.offer("b", ids, blocks, 0) == blocks[-1]
    p.allocated("b", 150)  # vLLM took fewer: passage 2 whole, 20 tokens of passage 0
    loads = p.transfer("b", ids, blocks, 150, 200, list(range(30))).loads
    assert [(ld.dst, ld.count) for ld in loads] == [(0, 130), (130, 20)]
    assert p.offer("c", ids, blocks, 0) == blocks[-1]
    p.allocated("c", 0)  # offered, not taken
    p.offer("d", ids, blocks, 0)
    p.finished("d")  # aborted while waiting
    p.step_planned()
    assert p.directory.pinned_pages() == 0


def test_recompute_stops_offers_and_saves_at_the_tail():
    from vllm_retro.blocks.directory import BlockDirectory
    from vllm_retro.vllm.block_cache import PAGE_TOKENS, BlockCachePlanner

    p = BlockCachePlanner(BlockDirectory(64, PAGE_TOKENS), "ns", 1024, recompute_tokens=100)
    ids, blocks = PROMPTS["cold"]  # passages 0..3 end at 90, 200, 330, 405: tail from 305
    t = _save_all(p, "a", ids, blocks)
    assert [(s.start, s.num_tokens) for s in t.saves] == [(0, 90), (90, 110)]
    ids, blocks = PROMPTS["mixed"]  # 1 (0..110) cached, 4 (110..210) new, 0 (210..300)
    assert p.offer("b", ids, blocks, 0) == 110
    p.finished("b")
    p2 = BlockCachePlanner(BlockDirectory(64, PAGE_TOKENS), "ns", 1024, recompute_tokens=150)
    _save_all(p2, "a", *PROMPTS["cold"])  # tail from 255: passages 0 and 1 saved
    ids, blocks = PROMPTS["mixed"]  # tail from 300 - 150 = 150: passage 1 whole, no more
    assert p2.offer("c", ids, blocks, 0) == 110
    ids, blocks = compose([0, 1, 2], 0)  # tail from 330 - 150 = 180: 0, and 1 up to 180
    assert p2.offer("d", ids, blocks, 0) == 180
    p2.allocated("d", 180)
    loads = p2.transfer("d", ids, blocks, 180, 370, list(range(30))).loads
    assert [(ld.first, ld.count, ld.dst) for ld in loads] == [(0, 90, 0), (0, 90, 90)]
    assert (p2.counts.hits, p2.counts.misses) == (2, 1)


def test_saves_are_readable_once_reported_and_dropped_when_they_fail():
    p = _planner()
    ids, blocks = PROMPTS["cold"]
    t = p.transfer("a", ids, blocks, 0, 128, list(range(40)))
    assert [s.start for s in t.saves] == [0]  # only passage 0 ends in [0, 128)
    assert p.offer("b", ids, blocks, 0) == 0  # being written: not offered
    t2 = p.transfer("a", ids, blocks, 128, 256, list(range(40)))
    assert [s.start for s in t2.saves] == [90]
    p.saved({t.saves[0].digest}, {t2.saves[0].digest})
    assert p.offer("b", ids, blocks, 0) == 90
    assert p.directory.stats.blocks == 1 and p.counts.saved_tokens == 90
    p.finished("b")
    assert p.directory.pinned_pages() == 0


def test_a_model_with_other_rotary_embeddings_is_refused_by_name(monkeypatch):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers import rotary_embedding as re
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from vllm_retro.vllm.block_cache import model_rope

    monkeypatch.setattr(re, "_ROPE_DICT", {})
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(32, 4096, rope_parameters={"rope_theta": 1e4})
        assert model_rope(32).rotary_dim == 32 and model_rope(32).is_neox_style
        get_rope(32, 4096, rope_parameters={"rope_theta": 5e5})
    with pytest.raises(RuntimeError, match="RotaryEmbedding', 'RotaryEmbedding'"):
        model_rope(32)
    with pytest.raises(RuntimeError, match="are none"):
        model_rope(64)
    assert rope is not None
