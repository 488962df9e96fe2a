"""vllm_retro.buffer.policy: eviction orders and greedy admission against plain reference
models (property-based)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_retro.buffer.policy import admit_greedy, eviction_order, victims

# a history of reads: per step, the clusters read (no repeats within a step)
histories = st.lists(st.lists(st.integers(0, 11), unique=True, max_size=5), max_size=40)


def _table(history: list[list[int]], c: int = 12) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """last_access and reads as the store records them, plus the LRU list model (least recent
    first) and per-cluster read counts, from a history of steps."""
    last = np.zeros(c, dtype=np.int64)
    reads = np.zeros(c, dtype=np.int64)
    model: list[int] = []
    clock = 0
    for step in history:
        for k in step:
            clock += 1
            last[k] = clock
            reads[k] += 1
            if k in model:
                model.remove(k)
            model.append(k)
    return last, reads, model


@settings(max_examples=200, deadline=None)
@given(histories, st.frozensets(st.integers(0, 11), max_size=4))
def test_lru_order_matches_list_model(history, protected):
    """LRU evicts in the order of a move-to-end list, protected clusters never."""
    last, reads, model = _table(history)
    cands = np.array([k for k in range(12) if reads[k] and k not in protected], dtype=np.int64)
    want = [k for k in model if k not in protected]
    assert eviction_order("lru", last, reads, cands).tolist() == want


@settings(max_examples=200, deadline=None)
@given(histories, st.frozensets(st.integers(0, 11), max_size=4))
def test_lfu_order_matches_counting_model(history, protected):
    """LFU evicts fewest reads first, ties by least recent read."""
    last, reads, model = _table(history)
    cands = [k for k in range(12) if reads[k] and k not in protected]
    want = sorted(cands, key=lambda k: (reads[k], model.index(k)))
    got = eviction_order("lfu", last, reads, np.array(cands, dtype=np.int64)).tolist()
    assert got == want


def test_unknown_policy_is_named():
    with pytest.raises(ValueError, match=r"cache policy 'fifo' is unknown; accepted: 'lru', 'lfu'"):
        eviction_order("fifo", np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(0, np.int64))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 9), max_size=12), st.integers(0, 40))
def test_admission_matches_one_by_one_model(need, budget):
    """Each miss that still fits is admitted, in order; a later smaller one may follow a
    skipped bigger one."""
    used, want = 0, []
    for n in need:
        fits = used + n <= budget
        want.append(fits)
        used += n if fits else 0
    assert admit_greedy(np.array(need, dtype=np.int64), budget).tolist() == want


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 5), st.sampled_from(["lru", "lfu"]))
def test_victims_of_all_heads_match_each_head_alone(seed, heads, policy):
    """All heads at once: per head, the shortest prefix of its eviction order that frees
    its deficit (none for a head with no deficit)."""
    rng = np.random.default_rng(seed)
    c = 12
    last = np.stack([rng.permutation(c) + 1 for _ in range(heads)]).astype(np.int64)
    reads = rng.integers(1, 4, (heads, c))
    pages = rng.integers(1, 4, (heads, c))
    evictable = rng.random((heads, c)) < 0.6
    deficit = rng.integers(-2, 10, heads)
    vh, vc = np.nonzero(evictable)
    got_h, got_c = victims(policy, last, reads, vh, vc, pages[vh, vc], deficit)
    want_h, want_c = [], []
    for h in range(heads):
        order = eviction_order(policy, last[h], reads[h], np.nonzero(evictable[h])[0])
        freed = 0
        for k in order.tolist():
            if freed >= deficit[h]:
                break
            want_h.append(h)
            want_c.append(k)
            freed += int(pages[h, k])
    assert got_h.tolist() == want_h and got_c.tolist() == want_c


@pytest.mark.parametrize("top", [50, 2**61])  # a packed sort key; stamps too large to pack
def test_lru_victims_order_by_recency_then_cluster_id(top):
    """LRU's order is (head, last access, cluster id) ascending, ties of recency (e.g.
    clusters never read, at 0) by cluster id, however large the stamps."""
    rng = np.random.default_rng(top % 97)
    heads, c = 3, 40
    last = rng.integers(0, 6, (heads, c)) * (top // 5)  # many ties
    vh, vc = np.nonzero(rng.random((heads, c)) < 0.7)
    got_h, got_c = victims("lru", last, np.ones_like(last), vh, vc, np.ones_like(vh),
                           np.full(heads, c))
    want = sorted(zip(vh.tolist(), vc.tolist(), strict=True),
                  key=lambda hc: (hc[0], int(last[hc]), hc[1]))
    assert list(zip(got_h.tolist(), got_c.tolist(), strict=True)) == want
