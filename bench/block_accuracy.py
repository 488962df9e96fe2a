"""Multi-passage needle QA under Block-Attention vs full attention (issue 41).

Each trial is a chat request: ``--passages`` passages of ``--passage-tokens`` tokens of real
prose, one of which carries a sentence "The special magic number for <key> is <7 digits>.",
then the question asking for that number. A trial is right when the greedy answer
(``--answer-tokens`` tokens) contains the digits.

Configurations, each on its own in-process engine and the same trials:

- ``stock``: vLLM, plain causal attention over the whole prompt;
- ``blocks``: Block-Attention (each passage attends only to itself, the question to
  everything), passages cold: every passage prefilled (and cached);
- ``blocks-cached``: the same engine, the trials again with their passages in another
  order: every passage loaded from the passage cache at its new position;
- ``blocks-nocache`` (``--configs nocache``): that other order on an engine without the
  passage cache (``block_cache_gb`` 0), every passage prefilled: the control telling what
  the order changes from what loading changes.

``--recompute-tokens N ...`` runs the block configurations once per ``N`` with
``block_recompute_tokens`` N (the last N tokens before the question attend to everything:
selective recompute), labelled ``+recomputeN`` when N > 0.

The chat template's opening is a block of its own (shared by every request, so cached
once; merged into the first passage's block it would make every request's first block new,
and loads stop at the first block not cached), its closing goes in the last block. The
model is used as it is (no block fine-tuning). Written to
``bench/results/block_accuracy_<device>.json``.

    .venv/bin/python bench/block_accuracy.py                      # 20 trials, ~2K tokens
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import random
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.block_ttft import model_tokenizer, passage_pool  # noqa: E402
from bench.machine import cpu_description  # noqa: E402

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

KEYS = ["amber", "basalt", "cedar", "delta", "ember", "falcon", "garnet", "harbor",
        "indigo", "juniper", "kestrel", "lagoon", "meadow", "nimbus", "onyx", "prairie"]


def trials(tok: Any, args: Any) -> list[dict[str, Any]]:
    """Each trial's passages (token ids), the needle's passage, and its question."""
    rng = random.Random(args.seed)
    pool = passage_pool(tok, args.pool, args.passage_tokens)
    out = []
    for _ in range(args.trials):
        picks = rng.sample(range(len(pool)), args.passages)
        key, number = rng.choice(KEYS), str(rng.randrange(1_000_000, 10_000_000))
        needle = tok(f" The special magic number for {key} is {number}. ",
                     add_special_tokens=False)["input_ids"]
        where = rng.randrange(args.passages)
        passages = []
        for j, p in enumerate(picks):
            ids = list(pool[p])
            if j == where:
                cut = rng.randrange(len(ids) // 4, 3 * len(ids) // 4)
                ids = ids[:cut] + needle + ids[cut:]
            passages.append(ids)
        q = tok(f"\n\nWhat is the special magic number for {key} mentioned in the passages "
                "above? Answer with the number only.", add_special_tokens=False)["input_ids"]
        out.append({"passages": passages, "question": q, "number": number, "needle_in": where})
    return out


def chat_frame(tok: Any) -> tuple[list[int], list[int]]:
    """The chat template's tokens before and after a user message."""
    marker = "\u2063MSG\u2063"
    text = tok.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                   add_generation_prompt=True)
    head, tail = text.split(marker)
    return (tok(head, add_special_tokens=False)["input_ids"],
            tok(tail, add_special_tokens=False)["input_ids"])


def compose(frame: tuple[list[int], list[int]], trial: dict[str, Any], order: list[int]
            ) -> tuple[list[int], list[int]]:
    head, tail = frame
    ids, blocks = list(head), [0]
    for j in order:
        blocks.append(len(ids))
        ids += trial["passages"][j]
    blocks.append(len(ids))
    return ids + trial["question"] + tail, blocks


def run(llm: Any, tok: Any, prompts: list[tuple[list[int], list[int]]], use_blocks: bool,
        answer_tokens: int) -> list[str]:
    from vllm import SamplingParams

    from vllm_retro.blocks.request import block_prompt

    answers = []
    for ids, blocks in prompts:
        extra = {"retro_blocks": blocks} if use_blocks else None
        params = SamplingParams(max_tokens=answer_tokens, temperature=0.0, extra_args=extra)
        prompt = block_prompt(ids, blocks) if use_blocks else {"prompt_token_ids": ids}
        out = llm.generate([prompt], [params], use_tqdm=False)[0]
        answers.append(out.outputs[0].text)
    return answers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--passages", type=int, default=8)
    ap.add_argument("--passage-tokens", type=int, default=250)
    ap.add_argument("--pool", type=int, default=40)
    ap.add_argument("--answer-tokens", type=int, default=12)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", nargs="+", default=["stock", "blocks"],
                    choices=["stock", "blocks", "nocache"],
                    help="blocks runs blocks and blocks-cached; nocache blocks-nocache")
    ap.add_argument("--recompute-tokens", type=int, nargs="+", default=[0],
                    help="block_recompute_tokens of the block configurations (one run each)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from vllm import LLM

    from vllm_retro.vllm import engine_kwargs

    tok = model_tokenizer(args)
    frame = chat_frame(tok)
    ts = trials(tok, args)
    natural = [compose(frame, t, list(range(args.passages))) for t in ts]
    rng = random.Random(args.seed + 1)
    shuffled = [compose(frame, t, rng.sample(range(args.passages), args.passages)) for t in ts]
    results: dict[str, Any] = {}
    configs = [(name, r) for name in args.configs
               for r in ([0] if name == "stock" else args.recompute_tokens)]
    for name, recompute in configs:
        kw: dict[str, Any] = dict(dtype=args.dtype, enforce_eager=True, seed=0,
                                  max_model_len=max(len(p[0]) for p in natural) + 64,
                                  kv_cache_memory_bytes=2 << 30)
        if name != "stock":
            kw.update(engine_kwargs(block_cache_gb=0.0 if name == "nocache" else 2.0,
                                    block_recompute_tokens=recompute))
        llm = LLM(model=args.model, **kw)
        suffix = f"+recompute{recompute}" if recompute else ""
        try:
            runs = ({"blocks": natural, "blocks-cached": shuffled} if name == "blocks" else
                    {"blocks-nocache": shuffled} if name == "nocache" else {name: natural})
            runs = {label + suffix: prompts for label, prompts in runs.items()}
            for label, prompts in runs.items():
                t0 = time.perf_counter()
                answers = run(llm, tok, prompts, name != "stock", args.answer_tokens)
                right = [t["number"] in a for t, a in zip(ts, answers, strict=True)]
                results[label] = {"accuracy": sum(right) / len(right), "right": right,
                                  "answers": answers, "seconds": time.perf_counter() - t0}
                print(f"{label:>14}: {sum(right)}/{len(right)} right "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
            if name == "blocks":
                p = llm.llm_engine.engine_core.engine_core.scheduler.connector.passages
                results["blocks-cached" + suffix]["cache"] = {"hits": p.counts.hits,
                                                              "misses": p.counts.misses}
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
    out = pathlib.Path(args.out or ROOT / "bench" / "results" / "block_accuracy_cpu.json")
    out.write_text(json.dumps({"device": cpu_description(), "model": args.model,
                               "dtype": args.dtype, "trials": args.trials,
                               "passages": args.passages,
                               "passage_tokens": args.passage_tokens,
                               "recompute_tokens": args.recompute_tokens, "results": results,
                               "command": " ".join(sys.argv)}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
