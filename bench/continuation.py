"""Gemma 3 270M (head_dim 256, MQA, 3 full-attention layers among 15 sliding-window ones):
how long retro's greedy continuation of real prose stays token for token stock vLLM's.

Three prompts of 3000 tokens (the first is ``tests/vllm/test_real_models.py``'s Gemma prompt),
32 greedy tokens each, stock vLLM then retro at each ``--config`` (JSON of RetroConfig
fields; ``{}`` is the defaults): the first token that differs from stock's and the number
of equal tokens, per prompt. In process, fp32 unless ``--dtype``::

    .venv/bin/python bench/gemma_continuation.py \\
        --config '{}' '{"min_retrieval_clusters": 0}' '{"estimator": "centroid"}'
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
from vllm_retro.models import ensure_gemma3_270m  # noqa: E402

PROMPT_TOKENS = 3000
STARTS = (0, 3000, 6000)


def continuations(model: pathlib.Path, prompts: list, retro: dict | None, dtype: str
                  ) -> list[list[int]]:
    """32 greedy token ids per prompt from stock vLLM (``retro`` None) or retro."""
    from vllm import LLM, SamplingParams

    from vllm_retro.vllm.settings import engine_kwargs

    args = {"enforce_eager": True, "dtype": dtype, "max_model_len": 8192, "seed": 0}
    if retro is not None:
        args.update(engine_kwargs(**retro))
    llm = LLM(model=str(model), **args)
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0))
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", nargs="+", default=["{}"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", type=pathlib.Path,
                    default=ROOT / "bench" / "results" / "gemma3_continuation.json")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoTokenizer
    from vllm.inputs import TokensPrompt

    model = ensure_gemma3_270m()
    doc = AutoTokenizer.from_pretrained(str(model))(real_prose(80000))["input_ids"]
    prompts = [TokensPrompt(prompt_token_ids=doc[:1] + doc[s + 1:s + PROMPT_TOKENS])
               for s in STARTS]  # each after the <bos>
    stock = continuations(model, prompts, None, args.dtype)
    summary = {}
    for cfg in args.config:
        ids = continuations(model, prompts, json.loads(cfg), args.dtype)
        pairs = list(zip(ids, stock, strict=True))  # a continuation may end early (EOS)
        first = [next((i for i, (a, b) in enumerate(zip(r, s, strict=False)) if a != b),
                      min(len(r), len(s))) for r, s in pairs]
        equal = [sum(a == b for a, b in zip(r, s, strict=False)) for r, s in pairs]
        summary[cfg] = {"first_divergence": first, "equal_tokens": equal, "ids": ids}
        print(f"{cfg:45s} first divergence {first}  equal tokens {equal}", flush=True)
    args.out.write_text(json.dumps({"dtype": args.dtype, "starts": STARTS,
                                    "stock": stock, "configs": summary}, indent=1))


if __name__ == "__main__":
    main()
