"""Matching batch rows to the scheduler's plan."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("vllm")

from vllm_retro.config import RetroConfig  # noqa: E402
from vllm_retro.vllm.batch_plan import RetroDecode, decode_columns, plan_batch  # noqa: E402
from vllm_retro.vllm.plan import RetroStepMetadata, RowStep  # noqa: E402
from vllm_retro.vllm.runtime import RetroRuntime  # noqa: E402


def _runtime(rows: dict[str, RowStep]) -> RetroRuntime:
    rt = RetroRuntime(object(), RetroConfig())
    rt.begin_step(RetroStepMetadata(rows=rows))
    return rt


def test_rows_route_by_the_slot_of_their_last_token():
    # Batch order differs from the plan's order: row 0 = "c" (prefill chunk completing its
    # prompt), row 1 = "a" (indexed decode), row 2 = "b" (short decode), row 3 = padding.
    rt = _runtime({
        "a": RowStep(slot=70, start=500, num_tokens=1, indexed=True, build_index=False),
        "b": RowStep(slot=12, start=11, num_tokens=1, indexed=False, build_index=False),
        "c": RowStep(slot=40, start=96, num_tokens=9, indexed=False, build_index=True),
    })
    qsl = torch.tensor([0, 9, 10, 11, 11])
    slot_mapping = torch.tensor([32, 33, 34, 35, 36, 37, 38, 39, 40, 70, 12])
    block_table = torch.arange(16).reshape(4, 4)
    plan = plan_batch(rt, qsl, slot_mapping, block_table, num_reqs=4)
    assert plan.dense_rows == [0, 2]
    assert [(d.request_id, d.first, d.count) for d in plan.decodes] == [("a", 9, 1)]
    (build,) = plan.builds
    assert build.request_id == "c" and build.num_tokens == 105
    assert torch.equal(build.block_ids, block_table[0])
    # the columns are worked out with the plan, which the layers then only read
    (col,) = plan.columns
    assert col.members is None and col.part == slice(9, 10)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.decodes = []


def test_decode_columns():
    """Column k holds the k-th token of every decode with more than k tokens: all decodes
    (no member list) as a slice when their rows are consecutive (one token each), else
    their rows as a tensor."""
    (col,) = decode_columns([RetroDecode("a", 0, 1), RetroDecode("b", 1, 1)])
    assert col.k == 0 and col.members is None and col.part == slice(0, 2)
    assert col.tokens is None
    cols = decode_columns([RetroDecode("a", 0, 3), RetroDecode("b", 3, 1),
                           RetroDecode("c", 4, 2)])
    assert [c.k for c in cols] == [0, 1, 2]
    assert cols[0].members is None and cols[0].tokens.tolist() == [0, 3, 4]
    assert cols[1].members == [0, 2] and cols[1].tokens.tolist() == [1, 5]
    assert cols[2].members == [0] and cols[2].part == slice(2, 3)
    assert decode_columns([]) == []


def test_a_row_outside_the_plan_is_a_clear_error():
    rt = _runtime({})
    with pytest.raises(RuntimeError, match="matches no request of this step's plan"):
        plan_batch(rt, torch.tensor([0, 1]), torch.tensor([5]), torch.zeros(1, 1), 1)


def test_released_requests_are_freed_before_the_step():
    rt = RetroRuntime(object(), RetroConfig(update_segment=64, local_window=16,
                                            segment_size=256))
    g = torch.Generator().manual_seed(0)
    for rid in ("x", "y", "z"):
        for layer in ("l0", "l1"):
            rt.build_index(rid, layer, torch.randn(2, 300, 32, generator=g),
                           torch.randn(2, 300, 32, generator=g))
    assert rt.live_bytes()[0] > 0
    rt.begin_step(RetroStepMetadata(released={"x", "y", "unknown"}))
    assert rt.registry.live() == ["z"]
    rt.begin_step(RetroStepMetadata(released={"z"}))
    assert rt.registry.live() == [] and rt.live_bytes() == (0, 0)
    assert rt.counters.requests_released == 3
    rt.close()


def test_the_builder_plans_where_every_layer_appends_its_tokens():
    """The plan's column holds the steady-pool rows of the step's tokens, made once by the
    builder: every layer's append writes there (the rows each index reads its window from),
    and a plan whose rows are not the indexes' next ones (a stale step's) is not used."""
    from vllm_retro.index.batched import append_batch

    rt = RetroRuntime(object(), RetroConfig(update_segment=64, local_window=16,
                                            segment_size=256))
    g = torch.Generator().manual_seed(3)
    lengths = {"x": 300, "y": 217}
    for layer in ("l0", "l1"):
        for rid, n in lengths.items():
            rt.build_index(rid, layer, torch.randn(2, n, 32, generator=g),
                           torch.randn(2, n, 32, generator=g))
    stale = None
    for step in range(3):
        rt.begin_step(RetroStepMetadata(rows={
            rid: RowStep(slot=10 * j + 1, start=n + step, num_tokens=1, indexed=True,
                         build_index=False) for j, (rid, n) in enumerate(lengths.items())}))
        plan = plan_batch(rt, torch.tensor([0, 1, 2]), torch.tensor([1, 11]),
                          torch.zeros(2, 4, dtype=torch.long), 2)
        (col,) = plan.columns
        assert col.append is not None
        for layer in ("l0", "l1"):
            indexes = [rt.index(rid, layer) for rid in lengths]
            k, v = torch.randn(2, 2, 32, generator=g), torch.randn(2, 2, 32, generator=g)
            if stale is not None and layer == "l1":  # the last step's rows: made anew
                _, rows = append_batch(indexes, k, v, stale)
                assert rows is not stale
            else:
                _, rows = append_batch(indexes, k, v, col.append)
                assert rows is col.append
            assert rows[1].tolist() == [i.slot for i in indexes]
            for b, (index, n) in enumerate(zip(indexes, lengths.values(), strict=True)):
                assert index.num_tokens == n + step + 1
                assert torch.equal(index.win_k[:, -1], k[b])
                assert torch.equal(index.win_v[:, -1], v[b])
        stale = col.append

