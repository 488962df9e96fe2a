"""Qwen2.5-Coder-0.5B-Instruct under retro at default budgets, against stock vLLM: needles in
~3.1K tokens of real prose and the continuation of a 3K-token document (CPU; bf16 where the CPU
multiplies it natively, else fp32: :func:`bench.machine.model_dtype`). The needle in the middle of
the same document is asked of the served default model (``tests/server/test_default_model.py``)."""

from __future__ import annotations

import pytest

from bench.machine import model_dtype
from tests.vllm.engines import engine, runtime_of
from vllm_retro.capture import real_prose

pytestmark = [pytest.mark.real_model, pytest.mark.usefixtures("inprocess")]

NEEDLE = "The secret passphrase is 'amber-falcon-7391'. Remember it."
QUESTION = ("What is the secret passphrase mentioned in the document above? "
            "Answer with the passphrase only.")
DEPTHS = (0.1, 0.9)
HAYSTACK_TOKENS = 3000
CONTINUATION_TOKENS = 3000


def _needle_prompt(tok, depth: float) -> str:
    """~3.1K tokens of real prose (CPython's language reference) with the needle inserted
    at a paragraph boundary at ``depth``, and the question, in the chat template."""
    ids = tok(real_prose(HAYSTACK_TOKENS * 6), add_special_tokens=False)["input_ids"]
    paras = tok.decode(ids[:HAYSTACK_TOKENS]).split("\n\n")
    cut = max(1, int(len(paras) * depth))
    doc = "\n\n".join([*paras[:cut], NEEDLE, *paras[cut:]])
    msgs = [{"role": "user", "content": f"Read this document.\n\n{doc}\n\n{QUESTION}"}]
    return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def _run(model_dir, retro):
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = [_needle_prompt(tok, d) for d in DEPTHS]
    doc = tok(real_prose(CONTINUATION_TOKENS * 6), add_special_tokens=False)["input_ids"]
    prompts.append(TokensPrompt(prompt_token_ids=doc[:CONTINUATION_TOKENS]))
    greedy = SamplingParams(max_tokens=32, temperature=0.0)
    with engine(model_dir, retro=retro, dtype=model_dtype(), max_model_len=8192) as llm:
        outs = llm.generate(prompts, greedy)
        rt = runtime_of(llm)
        counters = None if rt is None else rt.counters  # None: stock
    answers = [o.outputs[0].text.strip() for o in outs[:-1]]
    return answers, list(outs[-1].outputs[0].token_ids), counters


def test_qwen_needle_and_continuation_match_stock(qwen_model_dir):
    stock_answers, stock_cont, _ = _run(qwen_model_dir, None)
    # build_steps 2: the short answers switch to the index after 2 tokens (at the default
    # they would end before their switch and never touch it)
    retro_answers, retro_cont, counters = _run(qwen_model_dir, {"build_steps": 2})
    # Qwen2.5-Coder-0.5B finds the needle at every depth with full attention...
    assert all("amber-falcon-7391" in a for a in stock_answers), stock_answers
    # ... and answers exactly the same under retro at default budgets.
    assert retro_answers == stock_answers
    n = len(DEPTHS) + 1  # the needle prompts and the continuation
    assert counters.indexed_requests == n and counters.indexes_built == n * 24
    assert counters.retro_decode_tokens > 0
    agree = next((i for i, (a, b) in enumerate(zip(stock_cont, retro_cont, strict=True))
                  if a != b), len(stock_cont))
    same = sum(a == b for a, b in zip(stock_cont, retro_cont, strict=True))
    print(f"continuation of a {CONTINUATION_TOKENS}-token document: {same}/32 tokens equal, "
          f"first {agree} identical")
    assert same >= 24
