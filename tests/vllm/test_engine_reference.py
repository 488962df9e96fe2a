"""Inside the engine, at default budgets: every layer's decode through the serving path
equals the per-row reference (:meth:`WaveIndex.decode`) on the same queries and state."""

from __future__ import annotations

import pytest
import torch

from tests.vllm.engines import TINY_RETRO, engine, generate_tokens
from vllm_retro.vllm import route
from vllm_retro.vllm.runtime import get_runtime

pytestmark = pytest.mark.usefixtures("inprocess")

# Relative error allowed per (row, query head) output vector: the serving kernel sums the
# reference's products in another order, and in bf16 rounds where the reference does not
# (measured worst: 3.6e-7 fp32, 5.1e-4 bf16 on an AVX2 CPU). One retrieval cluster swapped
# with an estimated one gives 0.03 in both: the bounds catch a changed selection.
TOLERANCE = {"float32": 1e-5, "bfloat16": 5e-3}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_each_layer_step_equals_the_per_row_reference(tiny_model_dir, monkeypatch, dtype):
    # Mixed lengths under continuous batching with update blocks landing; after every
    # layer's batched decode (the fused CPU kernel here, with whatever scoring ISA this CPU
    # takes), each row is decoded again by the per-row torch reference over the same index
    # state (decode reads, it changes no zone) and compared.
    errors: list[float] = []
    serving = route.decode_batch

    def checked(indexes, query, scale, out=None, cache=None):
        res = serving(indexes, query, scale, out=out, cache=cache)
        for b, index in enumerate(indexes):
            ref = index.decode(query[b], scale).output.float()
            got = res[b].float()
            assert torch.isfinite(got).all(), f"row {b}: non-finite output"
            err = (got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-6)
            errors.append(err.max().item())
        return res

    monkeypatch.setattr(route, "decode_batch", checked)
    # The retrieval zone by its fraction, without the short-context floor: at the floor (16
    # clusters) one of the 414 steps meets two clusters of exactly equal score at the
    # estimation zone's edge (score gap 0.0), which the fused kernel and torch.topk break
    # differently (error 0.04). A tie-break both share is open on issue 40.
    with engine(tiny_model_dir, dtype=dtype,
                retro={**TINY_RETRO, "build_steps": 0, "min_retrieval_clusters": 0}) as llm:
        out = generate_tokens(llm, [300, 1500, 3000], [70, 70, 70])
        c = get_runtime().counters
    assert [len(o) for o in out] == [70, 70, 70]
    assert c.index_updates > 0  # update blocks landed while decoding
    # 2 layers x 3 rows x 69 indexed steps
    assert len(errors) == c.retro_decode_tokens == 2 * 3 * 69
    worst = max(errors)
    assert worst <= TOLERANCE[dtype], (
        f"{dtype}: serving path vs per-row reference, worst relative error {worst:.3g} "
        f"(median {sorted(errors)[len(errors) // 2]:.3g}) over {len(errors)} row steps")
