"""How long retro's greedy continuation of real prose stays token for token stock vLLM's, on
Gemma 3 270M (``--model gemma3``, the default: head_dim 256, MQA, 3 full-attention layers
among 15 sliding-window ones) or Qwen2.5-Coder-0.5B-Instruct (``--model qwen``).

Three prompts of 3000 tokens (Gemma's first is ``tests/vllm/test_real_models.py``'s prompt),
32 greedy tokens each, stock vLLM then retro at each ``--config`` (JSON of RetroConfig
fields; ``{}`` is the defaults): the first token that differs from stock's and the number
of equal tokens, per prompt, and there stock's margin (its top-1 minus its top-2 log
probability; a near-tie flips under any change of summation order) and whether retro took
stock's second choice. In process, fp32 unless ``--dtype``::

    .venv/bin/python bench/continuation.py \\
        --config '{}' '{"min_retrieval_clusters": 0}' '{"estimator": "centroid"}'
    .venv/bin/python bench/continuation.py --model qwen \\
        --config '{}' '{"retrieval_budget": 1.0, "estimation_budget": 0.0}'
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vllm_retro.capture import real_prose  # noqa: E402
from vllm_retro.models import ensure_gemma3_270m, ensure_qwen_coder  # noqa: E402

PROMPT_TOKENS = 3000
STARTS = (0, 3000, 6000)


def continuations(model: pathlib.Path, prompts: list, retro: dict | None, dtype: str
                  ) -> tuple[list[list[int]], list[list[list[tuple[int, float]]]]]:
    """32 greedy token ids per prompt from stock vLLM (``retro`` None) or retro, and at each
    position the two most likely tokens with their log probabilities."""
    from vllm import LLM, SamplingParams

    from vllm_retro.vllm.settings import engine_kwargs

    args = {"enforce_eager": True, "dtype": dtype, "max_model_len": 8192, "seed": 0}
    if retro is not None:
        args.update(engine_kwargs(**retro))
    llm = LLM(model=str(model), **args)
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0,
                                                    logprobs=2))
        top2 = [[sorted(((t, lp.logprob) for t, lp in pos.items()), key=lambda x: -x[1])[:2]
                 for pos in o.outputs[0].logprobs] for o in outs]
        return [list(o.outputs[0].token_ids) for o in outs], top2
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=("gemma3", "qwen"), default="gemma3")
    ap.add_argument("--config", nargs="+", default=["{}"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", type=pathlib.Path, default=None,
                    help="default: bench/results/<model>_continuation.json")
    args = ap.parse_args()
    out = args.out or ROOT / "bench" / "results" / f"{args.model}_continuation.json"
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoTokenizer
    from vllm.inputs import TokensPrompt

    model = ensure_gemma3_270m() if args.model == "gemma3" else ensure_qwen_coder()
    doc = AutoTokenizer.from_pretrained(str(model))(real_prose(80000))["input_ids"]
    head = doc[:1] if args.model == "gemma3" else []  # Gemma's <bos>; Qwen adds none
    prompts = [TokensPrompt(prompt_token_ids=head + doc[s + len(head):s + PROMPT_TOKENS])
               for s in STARTS]
    stock, stock_top2 = continuations(model, prompts, None, args.dtype)
    summary = {}
    for cfg in args.config:
        ids, _ = continuations(model, prompts, json.loads(cfg), args.dtype)
        pairs = list(zip(ids, stock, strict=True))  # a continuation may end early (EOS)
        first = [next((i for i, (a, b) in enumerate(zip(r, s, strict=False)) if a != b),
                      min(len(r), len(s))) for r, s in pairs]
        equal = [sum(a == b for a, b in zip(r, s, strict=False)) for r, s in pairs]
        margin, second = [], []
        for p, (r, f) in enumerate(zip(ids, first, strict=True)):
            if f >= min(len(r), len(stock[p])):
                margin.append(None)
                second.append(None)
                continue
            (_, lp1), (t2, lp2) = stock_top2[p][f]
            margin.append(round(lp1 - lp2, 4))
            second.append(r[f] == t2)
        summary[cfg] = {"first_divergence": first, "equal_tokens": equal,
                        "stock_margin_at_divergence": margin,
                        "took_stock_second_choice": second, "ids": ids}
        print(f"{cfg:45s} first divergence {first}  equal tokens {equal}  stock margin "
              f"there {margin}  stock's 2nd choice {second}", flush=True)
    out.write_text(json.dumps({"model": args.model, "dtype": args.dtype, "starts": STARTS,
                               "stock": stock, "stock_top2": stock_top2, "configs": summary},
                              indent=1))


if __name__ == "__main__":
    main()
