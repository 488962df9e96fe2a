"""``--retro-estimator auto`` inside a real vLLM engine (in-process, CPU, tiny Llama): the
route hands each build its prompt's last queries, which choose each KV head's estimator."""

from __future__ import annotations

import pytest

from tests.vllm.engines import TINY_RETRO, decode_two_abort_one, engine
from vllm_retro.index.estimator_choice import JUDGE_QUERIES

pytestmark = pytest.mark.usefixtures("inprocess")


def test_auto_estimator_is_judged_on_the_prompts_queries(tiny_model_dir):
    seen = []

    def check(rt):
        for rid in rt.registry.live():
            for layer in rt.registry.indexes_of(rid):
                idx = rt.index(rid, layer)
                assert idx.judged_queries == JUDGE_QUERIES, (rid, layer)
                heads = idx.residuals.tilted_heads
                assert heads.shape == (idx.num_kv_heads,)
                # a centroid head carries no tilt terms, a tilted one does
                assert (idx.residuals.profile[~heads] == 0).all()
                assert (idx.residuals.profile[heads].sum(-1) > 0).all()
                seen.append(heads.tolist())

    with engine(tiny_model_dir, retro={**TINY_RETRO, "estimator": "auto",
                                       "build_steps": 0}) as llm:
        decode_two_abort_one(llm, check)
    assert seen
