"""vllm_retro.buffer.policy: LRU and LFU against plain reference models (property-based)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_retro.buffer.policy import LFUPolicy, LRUPolicy, make_policy

# an operation: ("touch", key) reads key (hit if tracked, else admit); ("evict", protected)
ops = st.lists(st.one_of(
    st.tuples(st.just("touch"), st.integers(0, 12)),
    st.tuples(st.just("evict"), st.frozensets(st.integers(0, 12), max_size=4)),
), max_size=200)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_lru_matches_list_model(seq):
    pol, model = LRUPolicy(), []  # model: least recent first
    for op, arg in seq:
        if op == "touch":
            if arg in model:
                model.remove(arg)
                pol.hit(arg)
            else:
                pol.admitted(arg)
            model.append(arg)
        else:
            want = next((k for k in model if k not in arg), None)
            assert pol.victim(arg) == want
            if want is not None:
                model.remove(want)
                pol.evicted(want)
        assert len(pol) == len(model)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_lfu_matches_counting_model(seq):
    pol, freq, last, tick = LFUPolicy(), {}, {}, 0
    for op, arg in seq:
        if op == "touch":
            tick += 1
            if arg in freq:
                pol.hit(arg)
                freq[arg] += 1
            else:
                pol.admitted(arg)
                freq[arg] = 1
            last[arg] = tick
        else:
            cands = [k for k in freq if k not in arg]
            want = min(cands, key=lambda k: (freq[k], last[k])) if cands else None
            assert pol.victim(arg) == want
            if want is not None:
                del freq[want], last[want]
                pol.evicted(want)
        assert len(pol) == len(freq)


def test_make_policy():
    assert isinstance(make_policy("lru"), LRUPolicy)
    assert isinstance(make_policy("lfu"), LFUPolicy)
    with pytest.raises(ValueError, match=r"cache policy 'fifo' is unknown; accepted: 'lru', 'lfu'"):
        make_policy("fifo")
