"""Host-memory admission: requests wait for room in the host tier's budget instead of
exhausting the machine's memory, and are answered as they are alone."""

from __future__ import annotations

import pytest

from bench.machine import model_dtype
from tests.vllm.engines import TINY_RETRO, engine, greedy, random_prompts, runtime_of
from vllm_retro.config import ConfigError, RetroConfig
from vllm_retro.vllm.host_budget import (
    TIER_BYTES_PER_KV_BYTE,
    Admission,
    GiB,
    HostBudget,
    available_host_memory,
)


# ---------------------------------------------------------------------------- the ledger
def test_reservations_admit_wait_or_refuse_and_release():
    b = HostBudget(limit_bytes=9_000, kv_bytes_per_token=2, steady_tokens=100)
    assert b.cost(1000) == int(TIER_BYTES_PER_KV_BYTE * 2000) + 200 == 4700
    assert b.reserve("a", 1000) is Admission.ADMITTED
    assert b.reserve("a", 1000) is Admission.ADMITTED  # held: kept, not doubled
    assert b.reserved_bytes == 4700
    assert b.reserve("b", 1000) is Admission.WAIT  # 2 x 4700 > 9000
    assert "b" not in b.held
    b.release("a")
    assert b.reserved_bytes == 0
    assert b.reserve("b", 1000) is Admission.ADMITTED
    assert b.reserve("huge", 5000) is Admission.TOO_LARGE  # 22700 > the whole budget
    assert "huge" not in b.held
    b.release("nobody")  # no-op
    # first come, first served: with an earlier request waiting, one that fits waits too
    assert b.reserve("c", 100, queued_ahead=True) is Admission.WAIT
    assert b.reserve("b", 1000, queued_ahead=True) is Admission.ADMITTED  # held already


def test_a_budget_must_be_positive():
    with pytest.raises(ValueError, match="limit_bytes=0"):
        HostBudget(limit_bytes=0, kv_bytes_per_token=1, steady_tokens=0)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "4", True])
def test_host_memory_gb_is_validated(bad):
    with pytest.raises(ConfigError, match=r"host_memory_gb=.*accepted: a number in \(0"):
        RetroConfig(host_memory_gb=bad)


def test_host_memory_gb_flag_takes_a_float():
    import argparse

    from server.retro_args import add_retro_arguments, retro_overrides

    p = argparse.ArgumentParser()
    add_retro_arguments(p)
    assert retro_overrides(p.parse_args(["--retro-host-memory-gb", "2.5"])) == {
        "host_memory_gb": 2.5}


def test_available_host_memory_is_within_the_machines():
    import psutil

    assert 0 < available_host_memory() <= psutil.virtual_memory().total


# ---------------------------------------------------------------------------- the engine
LENGTHS, NEW = [1500, 3000, 1500], 100


def _connector(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def _run_stepwise(llm, prompts, max_tokens):
    """Add every prompt at once and step the engine to the end. Returns each request's
    tokens and the most requests the workers held indexed at once."""
    eng, rt = llm.llm_engine, runtime_of(llm)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, greedy(max_tokens))
    outs, most = {}, 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[int(o.request_id)] = list(o.outputs[0].token_ids)
        most = max(most, len(rt.registry.live()))
    return [outs[i] for i in range(len(prompts))], most


@pytest.mark.usefixtures("inprocess")
def test_requests_wait_for_room_in_order_and_answer_as_alone(tiny_model_dir):
    # Room for the longest request's reservation, or for the two short ones together, not
    # for a short one beside the long one. The long one (second to come) waits until the
    # first finishes; the third, which would fit beside the first, waits behind the long
    # one (first come, first served), so at most one request is indexed at a time. Nothing
    # is served densely, and each answer is the one it gives alone.
    prompts = random_prompts(LENGTHS, seed=3)
    # the tiny model: 2 layers x 2 KV heads x head_dim 32 x (K, V) x fp32 bytes per token;
    # a steady slot of 4 sinks + 16 window + 2 x 64 ring rows
    probe = HostBudget(1, kv_bytes_per_token=2 * 2 * 32 * 2 * 4, steady_tokens=4 + 16 + 128)
    need, short = probe.cost(max(LENGTHS) + NEW), probe.cost(min(LENGTHS) + NEW)
    assert short + need > 1.5 * need >= 2 * short
    retro = {**TINY_RETRO, "host_memory_gb": 1.5 * need / GiB}
    with engine(tiny_model_dir, retro=retro) as llm:
        alone = [list(llm.generate([p], greedy(NEW))[0].outputs[0].token_ids)
                 for p in prompts]
        conn = _connector(llm)
        assert conn.budget.limit_bytes == int(1.5 * need / GiB * GiB)
        together, most = _run_stepwise(llm, prompts, NEW)
        llm.llm_engine.step()  # deliver the finished ids
        gauges = conn.get_kv_connector_stats().data["gauges"]["0"]
        c = runtime_of(llm).counters
    assert together == alone
    assert most == 1
    assert conn.budget_counts == {"host_budget_waited_requests": 2,
                                  "host_budget_dense_requests": 0}
    assert {k: gauges[k] for k in ("host_budget_bytes", "host_reserved_bytes")} == {
        "host_budget_bytes": conn.budget.limit_bytes, "host_reserved_bytes": 0}
    assert c.indexed_requests == 6  # three alone, three together
    assert c.dense_decode_tokens == 0


@pytest.mark.usefixtures("inprocess")
def test_a_request_larger_than_the_budget_decodes_densely_like_stock(tiny_model_dir):
    prompts = random_prompts(LENGTHS, seed=4)
    with engine(tiny_model_dir) as llm:
        stock = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy(NEW))]
    with engine(tiny_model_dir, retro={**TINY_RETRO, "host_memory_gb": 1e-4}) as llm:
        outs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy(NEW))]
        counts = _connector(llm).budget_counts
        c = runtime_of(llm).counters
    assert outs == stock
    assert c.indexed_requests == 0 and c.retro_decode_tokens == 0
    assert c.dense_decode_tokens > 0
    assert counts == {"host_budget_waited_requests": 0, "host_budget_dense_requests": 3}


@pytest.mark.real_model
@pytest.mark.usefixtures("inprocess")
def test_reservations_bound_the_host_bytes_of_the_real_model(qwen_model_dir):
    # Qwen2.5-0.5B in bf16 where the CPU has it (index meta data is fp32, so bf16 is the larger
    # ratio; fp32 elsewhere: bench.machine.model_dtype), update
    # blocks every 64 tokens so the host pools grow within the test: at every step the
    # host bytes the worker holds stay within the requests' reservations.
    retro = {"update_segment": 64, "update_clusters": 4, "local_window": 16,
             "segment_size": 512}
    with engine(qwen_model_dir, retro=retro, dtype=model_dtype(), max_model_len=8192) as llm:
        eng, rt, conn = llm.llm_engine, runtime_of(llm), _connector(llm)
        for i, n in enumerate([1200, 3000]):
            eng.add_request(str(i), random_prompts([n], seed=i)[0], greedy(200))
        ratios = []
        while eng.has_unfinished_requests():
            finished = any(o.finished for o in eng.step())
            host = rt.live_bytes()[0]
            if rt.registry.live() and not finished:  # a finished one is freed a step later
                ratios.append(host / conn.budget.reserved_bytes)
        assert rt.counters.index_updates > 0
    print(f"host bytes / reservations: max {max(ratios):.2f}, last {ratios[-1]:.2f}")
    assert 0.3 < max(ratios) <= 1.0
