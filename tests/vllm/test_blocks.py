"""Block-Attention's mask inside a real engine: a request listing block starts
(``retro_blocks``) prefills each passage attending only to itself and its last block to
everything, exactly as the same model under the same mask in transformers; requests without
blocks are untouched, and bad starts fail only their own request."""

from __future__ import annotations

import pytest
import torch

from tests.vllm.engines import FULL_BUDGET, TINY_RETRO, engine, finish_step, random_prompts
from vllm_retro.blocks.attention import query_starts
from vllm_retro.blocks.request import block_prompt

pytestmark = pytest.mark.usefixtures("inprocess")

BLOCKS = [0, 90, 200, 330, 470]
"""Four passages and a last block: 520-token prompts, prefilled in 128-token chunks that
cross every block boundary."""
LENGTH = 520
STEPS = 12


def params(max_tokens: int, blocks: list[int] | None = None):
    from vllm import SamplingParams

    extra = {"retro_blocks": blocks} if blocks is not None else None
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                          extra_args=extra)


def hf_greedy(model_dir, prompt: list[int], blocks: list[int] | None, steps: int
              ) -> list[int]:
    """Greedy tokens of the same checkpoint in transformers (fp32, eager attention), under
    the block mask (``blocks``) or plain causal (None); generated tokens see everything."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager")
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            pos = torch.arange(len(ids))
            starts = (query_starts(pos, blocks) if blocks is not None
                      else torch.zeros_like(pos))
            visible = (pos[None, :] >= starts[:, None]) & (pos[None, :] <= pos[:, None])
            mask = torch.zeros(1, 1, len(ids), len(ids)).masked_fill(~visible, float("-inf"))
            logits = model(torch.tensor([ids]), attention_mask=mask,
                           position_ids=pos[None]).logits[0, -1]
            out.append(int(logits.argmax()))
            ids.append(out[-1])
    return out


def test_passages_attend_only_to_themselves_as_in_transformers(tiny_model_dir):
    p_blocks, p_plain = (list(p["prompt_token_ids"]) for p in
                         random_prompts([LENGTH, LENGTH], seed=11))
    want = hf_greedy(tiny_model_dir, p_blocks, BLOCKS, STEPS)
    causal = hf_greedy(tiny_model_dir, p_blocks, None, STEPS)
    assert want != causal  # the mask changes the answer: the test can tell them apart
    with engine(tiny_model_dir, max_num_batched_tokens=128) as llm:
        stock = llm.generate([{"prompt_token_ids": p_plain}], [params(STEPS)])
    with engine(tiny_model_dir, retro={**TINY_RETRO, **FULL_BUDGET},
                max_num_batched_tokens=128) as llm:
        eng = llm.llm_engine
        eng.add_request("blocks", block_prompt(p_blocks, BLOCKS), params(STEPS, BLOCKS))
        eng.add_request("plain", {"prompt_token_ids": p_plain}, params(STEPS))
        eng.add_request("bad", block_prompt(p_plain, [0, LENGTH]), params(STEPS, [0, LENGTH]))
        # the same prompt under the block mask without the salt: vLLM's prefix cache
        # would mix its KV with plain requests', so it fails with an error to its client
        eng.add_request("nosalt", {"prompt_token_ids": p_plain}, params(STEPS, BLOCKS))
        got = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    got[out.request_id] = out.outputs[0]
        finish_step(llm)
    assert list(got["blocks"].token_ids) == want
    assert list(got["plain"].token_ids) == list(stock[0].outputs[0].token_ids)
    assert got["bad"].finish_reason == got["nosalt"].finish_reason == "error"
