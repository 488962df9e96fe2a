"""Time to first token on a RAG workload: Block-Attention with the passage cache vs stock
vLLM with prefix caching on (issue 41).

The workload: a pool of ``--pool`` passages of ``--passage-tokens`` tokens of real prose
(each opening with its own heading), and requests of as many passages as fill
``--lengths`` tokens, drawn from the pool and shuffled per request, then a
``--question-tokens`` question. Each configuration runs in its own in-process engine:

1. warm-up: requests that between them list every passage of the pool once (Block-
   Attention caches each passage; stock vLLM's prefix cache holds whatever it holds);
2. measure: per length, ``--requests`` requests one at a time, ``max_tokens=1``: time to
   first token (wall time of the request) and the prompt tokens computed (the prompt less
   vLLM's ``num_cached_tokens``: prefix-cache hits, and passages loaded by the connector).

Both configurations see the same requests in the same order. Printed as a table with the
stock/blocks TTFT ratio per length and written to
``bench/results/block_ttft_<device>.json``.

    .venv/bin/python bench/block_ttft.py                          # 2K and 8K
    .venv/bin/python bench/block_ttft.py --lengths 2048 8192 32768 --requests 2
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import random
import statistics
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.machine import cpu_description  # noqa: E402

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def passage_pool(tokenizer: Any, n: int, tokens: int) -> list[list[int]]:
    """``n`` passages of exactly ``tokens`` tokens of prose, each from a different place of
    the text and opening with its own heading."""
    from vllm_retro.capture import real_prose

    body = tokenizer(real_prose(n * tokens * 5), add_special_tokens=False)["input_ids"]
    stride = max(1, (len(body) - tokens) // n)
    out = []
    for i in range(n):
        head = tokenizer(f"\n\nPassage {i}:\n", add_special_tokens=False)["input_ids"]
        ids = (head + body[i * stride:])[:tokens]
        assert len(ids) == tokens, "not enough prose for this pool"
        out.append(ids)
    return out


def model_tokenizer(args: Any) -> Any:
    """The tokenizer of ``args.model``, the embedded default model when None (then set)."""
    from transformers import AutoTokenizer

    if args.model is None:
        from server.default_model import default_model_dir

        args.model = str(default_model_dir())
    return AutoTokenizer.from_pretrained(args.model)


def question(tokenizer: Any, i: int, tokens: int) -> list[int]:
    """A ``tokens``-token question (the last block), different per request."""
    text = (f"\n\nQuestion {i}: using only the passages above, explain in detail what they "
            "say about the behaviour of the language constructs they describe, and quote "
            "the passage that matters most for each point you make. Answer:")
    ids = tokenizer(text * 4, add_special_tokens=False)["input_ids"][:tokens]
    assert len(ids) == tokens
    return ids


def compose(pool: list[list[int]], order: list[int], q: list[int]) -> tuple[list[int],
                                                                             list[int]]:
    ids, blocks = [], []
    for i in order:
        blocks.append(len(ids))
        ids += pool[i]
    blocks.append(len(ids))
    return ids + q, blocks


def workload(pool: list[list[int]], tokenizer: Any, lengths: list[int], requests: int,
             passage_tokens: int, question_tokens: int, seed: int
             ) -> tuple[list[tuple[list[int], list[int]]], dict[int, list[Any]]]:
    """Warm-up prompts covering the pool, and per length the measured prompts."""
    rng = random.Random(seed)
    per = max(1, (min(lengths) - question_tokens) // passage_tokens)
    order = list(range(len(pool)))
    rng.shuffle(order)
    warm = [compose(pool, order[i:i + per], question(tokenizer, 10_000 + i, question_tokens))
            for i in range(0, len(order), per)]
    measured: dict[int, list[Any]] = {}
    for length in lengths:
        k = max(1, round((length - question_tokens) / passage_tokens))
        if k > len(pool):
            raise SystemExit(f"--lengths {length} needs {k} passages; the pool has "
                             f"{len(pool)} (raise --pool)")
        measured[length] = [compose(pool, rng.sample(range(len(pool)), k),
                                    question(tokenizer, length + j, question_tokens))
                            for j in range(requests)]
    return warm, measured


def make_engine(model: str, blocks: bool, max_len: int, args: Any) -> Any:
    from vllm import LLM

    from vllm_retro.vllm import engine_kwargs

    kw: dict[str, Any] = dict(dtype=args.dtype, max_model_len=max_len, enforce_eager=True,
                              enable_prefix_caching=True, seed=0, max_num_seqs=8,
                              kv_cache_memory_bytes=args.kv_gib << 30)
    if blocks:
        kw.update(engine_kwargs(block_cache_gb=args.block_cache_gb))
    return LLM(model=model, **kw)


def run_one(llm: Any, ids: list[int], blocks: list[int] | None) -> tuple[float, int]:
    """One request alone, ``max_tokens=1``: (seconds, prompt tokens computed)."""
    from vllm import SamplingParams

    from vllm_retro.blocks.request import block_prompt

    extra = {"retro_blocks": blocks} if blocks is not None else None
    params = SamplingParams(max_tokens=1, temperature=0.0, extra_args=extra)
    prompt = block_prompt(ids, blocks) if blocks is not None else {"prompt_token_ids": ids}
    t0 = time.perf_counter()
    out = llm.generate([prompt], [params], use_tqdm=False)[0]
    seconds = time.perf_counter() - t0
    return seconds, len(ids) - (out.num_cached_tokens or 0)


def run_config(name: str, model: str, warm: list[Any], measured: dict[int, list[Any]],
               args: Any) -> dict[str, Any]:
    use_blocks = name == "blocks"
    max_len = max(len(ids) for ids, _ in [*warm, *(p for ps in measured.values() for p in ps)])
    llm = make_engine(model, use_blocks, max_len + 16, args)
    try:
        t0 = time.perf_counter()
        for ids, blocks in warm:
            run_one(llm, ids, blocks if use_blocks else None)
        warm_s = time.perf_counter() - t0
        print(f"[{name}] warm-up: {len(warm)} requests, {warm_s:.1f} s", flush=True)
        rows = {}
        for length, prompts in measured.items():
            ttft, computed = [], []
            for ids, blocks in prompts:
                s, c = run_one(llm, ids, blocks if use_blocks else None)
                ttft.append(s)
                computed.append(c)
                print(f"[{name}] {len(ids)} tokens: TTFT {s:.3f} s, computed {c}", flush=True)
            rows[str(length)] = {"prompt_tokens": [len(ids) for ids, _ in prompts],
                                 "ttft_s": ttft, "computed_tokens": computed,
                                 "ttft_median_s": statistics.median(ttft)}
        extra = {}
        if use_blocks:
            p = llm.llm_engine.engine_core.engine_core.scheduler.connector.passages
            extra = {"hits": p.counts.hits, "misses": p.counts.misses,
                     "cached_passages": p.directory.stats.blocks,
                     "evictions": p.directory.stats.evictions}
        return {"warmup_s": warm_s, "lengths": rows, **extra}
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: the embedded "
                    "Qwen2.5-Coder-0.5B-Instruct)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--requests", type=int, default=3, help="measured requests per length")
    ap.add_argument("--pool", type=int, default=100)
    ap.add_argument("--passage-tokens", type=int, default=500)
    ap.add_argument("--question-tokens", type=int, default=50)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-gib", type=int, default=4)
    ap.add_argument("--block-cache-gb", type=float, default=2.0)
    ap.add_argument("--configs", nargs="+", default=["stock", "blocks"],
                    choices=["stock", "blocks"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    tok = model_tokenizer(args)
    pool = passage_pool(tok, args.pool, args.passage_tokens)
    warm, measured = workload(pool, tok, args.lengths, args.requests, args.passage_tokens,
                              args.question_tokens, args.seed)
    results = {name: run_config(name, args.model, warm, measured, args)
               for name in args.configs}
    print(f"\n{'length':>8} {'config':>7} {'TTFT median s':>14} {'computed tokens':>16}")
    summary = {}
    for length in args.lengths:
        for name in args.configs:
            row = results[name]["lengths"][str(length)]
            print(f"{length:>8} {name:>7} {row['ttft_median_s']:>14.3f} "
                  f"{statistics.median(row['computed_tokens']):>16.0f}")
        if len(args.configs) == 2:
            ratio = (results["stock"]["lengths"][str(length)]["ttft_median_s"]
                     / results["blocks"]["lengths"][str(length)]["ttft_median_s"])
            summary[str(length)] = ratio
            print(f"{length:>8}   stock/blocks TTFT: {ratio:.1f}x")
    out = pathlib.Path(args.out or ROOT / "bench" / "results" / "block_ttft_cpu.json")
    out.write_text(json.dumps({
        "device": cpu_description(), "model": args.model, "dtype": args.dtype,
        "pool": args.pool, "passage_tokens": args.passage_tokens,
        "question_tokens": args.question_tokens, "requests": args.requests,
        "ttft_ratio_stock_over_blocks": summary, "configs": results,
        "command": " ".join(sys.argv)}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
