"""End-to-end offline throughput through vLLM on a real model at long prompts: retro vs stock.

For each configuration (stock vLLM, then retro at default budgets) one in-process engine
(prefix caching off, so every run prefills for real) runs, in the same process:

1. prefill: every prompt with ``max_tokens=1`` -> prompt tokens/s, time to first token per
   request, and (retro) the share of that wall time spent building wave indexes (paper: <5%);
2. decode: the same prompts with ``max_tokens=M``, stepped by hand: once every request has
   its first token, the remaining steps are timed -> decode tokens/s of the batch and the
   median decode step time (no prefill mixed in);
3. capacity: a separate engine whose KV pool holds ``--pool-requests`` long requests,
   given ``--capacity-requests`` of them at once -> the largest number decoded in one step.

Printed as a table with retro/stock ratios and written to
``bench/results/e2e_throughput_<device>.{json,png}``.

    .venv/bin/python bench/e2e_throughput.py                  # Qwen2.5-Coder-0.5B, 4 x 4K
    .venv/bin/python bench/e2e_throughput.py --prompt-tokens 8192 --requests 2
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import platform
import statistics
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # read the worker runtime here
os.environ.setdefault("HF_HUB_OFFLINE", "1")

BLOCK = 128


def prompts(tokenizer: Any, n: int, length: int) -> list[Any]:
    """``n`` token prompts of exactly ``length`` tokens of real prose, each starting with a
    distinct line so no two share a prefix."""
    from vllm.inputs import TokensPrompt

    from vllm_retro.capture import real_prose

    body = tokenizer(real_prose(length * 8), add_special_tokens=False)["input_ids"]
    out = []
    for i in range(n):
        head = tokenizer(f"Document {i}: ", add_special_tokens=False)["input_ids"]
        ids = (head + body[i * 97:])[:length]
        assert len(ids) == length, "not enough prose for this prompt length"
        out.append(TokensPrompt(prompt_token_ids=ids))
    return out


def make_engine(model: str, retro: bool, max_len: int, blocks: int | None, args) -> Any:
    """An in-process ``LLM``; ``blocks`` caps the KV pool (in blocks of 128 tokens)."""
    from vllm import LLM

    from vllm_retro.vllm import engine_kwargs

    kw: dict[str, Any] = dict(dtype=args.dtype, max_model_len=max_len, enforce_eager=args.eager,
                              enable_prefix_caching=False, disable_log_stats=False, seed=0,
                              block_size=BLOCK, max_num_seqs=64,
                              # sized here: vLLM's CPU default reserves 92% of the NUMA node
                              kv_cache_memory_bytes=args.kv_gib << 30)
    if blocks is not None:
        kw["num_gpu_blocks_override"] = blocks
    if retro:
        kw.update(engine_kwargs())
    return LLM(model=model, **kw)


def close(llm: Any) -> None:
    """Shut the engine down so the next one starts clean."""
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def sampling(max_tokens: int) -> Any:
    """Greedy, exactly ``max_tokens`` tokens."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def decode_phase(llm: Any, ps: list[Any], max_tokens: int) -> tuple[float, int, list[float]]:
    """Submit every prompt, step the engine until each has its first token (prefill done),
    then time the steps until all finish. Returns (seconds, tokens decoded in that window,
    per-step seconds): the decode throughput of the whole batch with no prefill mixed in."""
    engine = llm.llm_engine
    for i, p in enumerate(ps):
        engine.add_request(f"decode-{i}", p, sampling(max_tokens))
    produced: dict[str, int] = {}

    def step() -> None:
        for out in engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)

    while len(produced) < len(ps) or min(produced.values()) < 1:
        step()
    before = sum(produced.values())
    steps: list[float] = []
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        step()
        steps.append(time.perf_counter() - t)
    return time.perf_counter() - t0, sum(produced.values()) - before, steps


def run_config(name: str, retro: bool, model: str, ps: list[Any], args) -> dict[str, Any]:
    """Prefill, decode and capacity measurements of one configuration."""
    from vllm_retro.vllm.runtime import get_runtime

    n_prompt = sum(len(p["prompt_token_ids"]) for p in ps)
    max_len = args.prompt_tokens + args.max_tokens + BLOCK
    llm = make_engine(model, retro, max_len, None, args)
    llm.generate(ps[:1], sampling(2), use_tqdm=False)  # warm-up (compilation, caches)
    c = get_runtime().counters
    build0 = c.index_build_seconds
    t0 = time.perf_counter()
    outs = llm.generate(ps, sampling(1), use_tqdm=False)
    prefill_s = time.perf_counter() - t0
    build_s = c.index_build_seconds - build0
    ttft = [o.metrics.first_token_latency for o in outs if o.metrics is not None]
    decode_s, decode_tokens, itl = decode_phase(llm, ps, args.max_tokens)
    sparse = c.sparse_decode_tokens
    close(llm)

    pool = args.pool_requests * (args.prompt_tokens + args.max_tokens) // BLOCK + 2
    llm = make_engine(model, retro, max_len, pool, args)
    c = get_runtime().counters
    c.peak_decode_rows = 0
    cap = [p for _ in range(-(-args.capacity_requests // len(ps))) for p in ps]
    llm.generate(cap[:args.capacity_requests], sampling(args.capacity_decode), use_tqdm=False)
    peak = c.peak_decode_rows
    close(llm)
    row = {
        "config": name, "requests": len(ps), "prompt_tokens": n_prompt,
        "prefill_s": prefill_s, "prompt_tokens_per_s": n_prompt / prefill_s,
        "ttft_mean_s": statistics.mean(ttft) if ttft else None,
        "ttft_max_s": max(ttft) if ttft else None,
        "index_build_s": build_s, "index_build_share_of_prefill": build_s / prefill_s,
        "decode_s": decode_s, "decode_tokens": decode_tokens,
        "decode_tokens_per_s": decode_tokens / decode_s,
        "decode_step_median_s": statistics.median(itl) if itl else None,
        "sparse_decode_tokens": sparse,
        "kv_pool_blocks": pool, "capacity_requests": args.capacity_requests,
        "peak_concurrent_decodes": peak,
    }
    share = 100 * row["index_build_share_of_prefill"]
    itl_ms = 1e3 * (row["decode_step_median_s"] or 0)
    print(f"{name:>6}: prefill {row['prompt_tokens_per_s']:7.1f} tok/s  TTFT mean "
          f"{row['ttft_mean_s'] or 0:6.2f} s  index build {share:4.1f}%  decode "
          f"{row['decode_tokens_per_s']:6.1f} tok/s  step {itl_ms:6.1f} ms  peak concurrent "
          f"{peak}/{args.capacity_requests}", flush=True)
    return row


def plot(result: dict, path: pathlib.Path) -> None:
    """Bars of retro / stock for each measured quantity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["prompt_tokens_per_s", "decode_tokens_per_s", "peak_concurrent_decodes"]
    stock, retro = result["configs"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    x = range(len(keys))
    ax.bar([i - 0.2 for i in x], [stock[k] for k in keys], 0.4, label="stock vLLM")
    ax.bar([i + 0.2 for i in x], [retro[k] for k in keys], 0.4, label="retro")
    ax.set_xticks(list(x), ["prompt tok/s", "decode tok/s", "peak concurrent"])
    ax.set_title(f"{result['model_name']}, {result['requests']} x {result['prompt_tokens']} "
                 f"tokens, {result['device']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model dir (default: Qwen2.5-Coder-0.5B)")
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--pool-requests", type=float, default=1.5,
                    help="capacity run: KV pool size in long requests")
    ap.add_argument("--capacity-requests", type=int, default=6)
    ap.add_argument("--capacity-decode", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-gib", type=int, default=2, help="KV cache size (GiB) of each engine")
    ap.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    from vllm_retro.models import ensure_qwen_coder

    model = args.model or str(ensure_qwen_coder())
    tok = AutoTokenizer.from_pretrained(model)
    ps = prompts(tok, args.requests, args.prompt_tokens)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    result: dict[str, Any] = {
        "command": " ".join(sys.argv), "model": model,
        "model_name": pathlib.Path(model).name, "device": device,
        "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "requests": args.requests, "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens, "dtype": args.dtype, "eager": args.eager,
        "configs": [run_config("stock", False, model, ps, args),
                    run_config("retro", True, model, ps, args)],
    }
    stock, retro = result["configs"]
    result["ratios_retro_over_stock"] = {
        k: retro[k] / stock[k] for k in ("prompt_tokens_per_s", "decode_tokens_per_s",
                                          "peak_concurrent_decodes") if stock[k]}
    result["wall_s"] = time.perf_counter() - t0
    print("retro / stock:", {k: round(v, 3) for k, v in result["ratios_retro_over_stock"].items()})
    out = args.out or ROOT / "bench" / "results" / f"e2e_throughput_{device}.json"
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
