"""End-to-end offline throughput through vLLM on a real model at long prompts: retro vs stock.

For each configuration (stock vLLM; retro at its defaults, on CPU index builds inside the
step; retro with background builds while each request decodes its first 16 tokens from
its paged KV, ``build_steps`` 16, the CUDA default) one in-process
engine (prefix caching off, so every run prefills for real) runs, in the same process:

1. serve: every prompt submitted at once with ``max_tokens=M``, stepped by hand.
   Prefill window (until every request has its first token): prompt tokens/s, time to
   first token per request, and (retro) the share of that wall time the engine's steps
   spent on index builds (reading KV back, builds in the step, waiting for a build at a
   switch; paper: <5%), next to all build work (background included). Decode window
   (the steps after it): decode tokens/s of the batch, median and largest step, the time
   steps waited on index work, tokens decoded sparse / dense;
2. capacity: a separate engine whose KV pool holds ``--pool-requests`` long requests,
   given ``--capacity-requests`` of them at once -> the most requests given a token in one step.

``--repeats N`` runs every configuration N times, the order reversed every other repeat (in
one process the engine run second has measured 3-10% slower steps whichever it was), and
reports each quantity's median and the median of each repeat's ratio.

Printed as a table with retro/stock ratios and written to
``bench/results/e2e_throughput_<device>.{json,png}``.

    .venv/bin/python bench/e2e_throughput.py                  # Qwen2.5-Coder-0.5B, 4 x 4K
    .venv/bin/python bench/e2e_throughput.py --prompt-tokens 8192 --requests 2
    .venv/bin/python bench/e2e_throughput.py --requests 3 --capacity-requests 0 \
        --configs stock retro --repeats 2
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import statistics
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.machine import cpu_description  # noqa: E402

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # read the worker runtime here
os.environ.setdefault("HF_HUB_OFFLINE", "1")

BLOCK = 128


def prompts(tokenizer: Any, n: int, length: int) -> list[Any]:
    """``n`` token prompts of exactly ``length`` tokens of real prose, each starting with a
    distinct line so no two share a prefix."""
    from vllm.inputs import TokensPrompt

    from vllm_retro.capture import real_prose

    # each prompt starts 97 tokens further into the text
    body = tokenizer(real_prose((length + 97 * n) * 8), add_special_tokens=False)["input_ids"]
    out = []
    for i in range(n):
        head = tokenizer(f"Document {i}: ", add_special_tokens=False)["input_ids"]
        ids = (head + body[i * 97:])[:length]
        assert len(ids) == length, "not enough prose for this prompt length"
        out.append(TokensPrompt(prompt_token_ids=ids))
    return out


CONFIGS: dict[str, dict[str, Any] | None] = {
    "stock": None, "retro": {}, "retro-background": {"build_steps": 16},
    "retro-rows": {"device_resident": "off"}, "retro-floor16": {"min_retrieval_clusters": 16}}
"""Configuration name -> retro settings (None: stock vLLM). 'retro-rows': the fused CPU
kernel on each row's own tensors, as the CPU decoded before a layer's step read its pools
(the A/B of that change); 'retro-floor16': the retrieval zone's floor of 16 clusters, the
default until 2026-12-03 (the A/B of 32)."""


def make_engine(model: str, retro: dict[str, Any] | None, max_len: int, blocks: int | None,
                args) -> Any:
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
    if retro is not None:
        kw.update(engine_kwargs(**retro))
    return LLM(model=model, **kw)


def close(llm: Any) -> None:
    """Shut the engine down so the next one starts clean."""
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def retro_counters(llm: Any) -> Any:
    """The retro counters of ``llm``'s engine (it runs in this process); zeros for a stock
    engine (it has no retro runtime)."""
    from vllm_retro.vllm.counters import RetroCounters
    from vllm_retro.vllm.runtime import made_runtime

    rt = made_runtime(llm.llm_engine.vllm_config)
    return RetroCounters() if rt is None else rt.counters


def sampling(max_tokens: int) -> Any:
    """Greedy, exactly ``max_tokens`` tokens."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def serve_phase(llm: Any, ps: list[Any], max_tokens: int) -> dict[str, Any]:
    """Submit every prompt at once and step the engine until all finish.

    Prefill window: from submission until every request has its first token (time to first
    token per request, prompt throughput, index work in that window). Decode window: the
    steps after that (decode throughput of the whole batch with no prefill mixed in,
    per-step seconds, index work in that window).
    """
    c = retro_counters(llm)
    engine = llm.llm_engine
    produced: dict[str, int] = {}
    first_token: dict[str, float] = {}

    def index_s() -> tuple[float, float]:
        return c.index_step_seconds, c.index_build_seconds

    def step() -> None:
        for out in engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)
            first_token.setdefault(out.request_id, time.perf_counter() - t0)

    t0 = time.perf_counter()
    idx0 = index_s()
    for i, p in enumerate(ps):
        engine.add_request(f"serve-{i}", p, sampling(max_tokens))
    while len(produced) < len(ps):
        step()
    prefill_s = time.perf_counter() - t0
    idx1 = index_s()
    sparse0, dense0 = c.sparse_decode_tokens, c.dense_decode_tokens
    before = sum(produced.values())
    steps: list[float] = []
    t1 = time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        step()
        steps.append(time.perf_counter() - t)
    decode_s = time.perf_counter() - t1
    idx2 = index_s()
    return {
        "prefill_s": prefill_s, "ttft_s": sorted(first_token.values()),
        "prefill_index_step_s": idx1[0] - idx0[0], "decode_index_step_s": idx2[0] - idx1[0],
        "index_build_s": idx2[1] - idx0[1],
        "decode_s": decode_s, "decode_tokens": sum(produced.values()) - before,
        "decode_steps_s": steps,
        "sparse_decode_tokens": c.sparse_decode_tokens - sparse0,
        "dense_decode_tokens": c.dense_decode_tokens - dense0,
    }


def run_config(name: str, retro: dict[str, Any] | None, model: str, ps: list[Any], args
               ) -> dict[str, Any]:
    """Prefill, decode and capacity measurements of one configuration."""
    n_prompt = sum(len(p["prompt_token_ids"]) for p in ps)
    max_len = args.prompt_tokens + args.max_tokens + BLOCK
    llm = make_engine(model, retro, max_len, None, args)
    llm.generate(ps[:1], sampling(2), use_tqdm=False)  # warm-up (compilation, caches)
    run = serve_phase(llm, ps, args.max_tokens)
    close(llm)

    pool = args.pool_requests * (args.prompt_tokens + args.max_tokens) // BLOCK + 2
    peak = 0
    if args.capacity_requests:
        llm = make_engine(model, retro, max_len, pool, args)
        cap = [p for _ in range(-(-args.capacity_requests // len(ps))) for p in ps]
        engine = llm.llm_engine
        for i, p in enumerate(cap[:args.capacity_requests]):
            engine.add_request(f"capacity-{i}", p, sampling(args.capacity_decode))
        while engine.has_unfinished_requests():  # the most requests given a token in a step
            peak = max(peak, len(engine.step()))
        close(llm)
    ttft, itl, prefill_s = run["ttft_s"], run.pop("decode_steps_s"), run["prefill_s"]
    row = {
        "config": name, "retro_settings": retro, "requests": len(ps),
        "prompt_tokens": n_prompt, **run,
        "prompt_tokens_per_s": n_prompt / prefill_s,
        "ttft_mean_s": statistics.mean(ttft), "ttft_max_s": max(ttft),
        "index_step_share_of_prefill": run["prefill_index_step_s"] / prefill_s,
        "index_build_share_of_prefill": run["index_build_s"] / prefill_s,
        "decode_tokens_per_s": run["decode_tokens"] / run["decode_s"],
        "decode_step_median_s": statistics.median(itl) if itl else None,
        "decode_step_max_s": max(itl) if itl else None,
        "kv_pool_blocks": pool, "capacity_requests": args.capacity_requests,
        "peak_concurrent_decodes": peak,
    }
    share = 100 * row["index_step_share_of_prefill"]
    work = 100 * row["index_build_share_of_prefill"]
    itl_ms = 1e3 * (row["decode_step_median_s"] or 0)
    print(f"{name:>16}: prefill {row['prompt_tokens_per_s']:7.1f} tok/s  TTFT mean "
          f"{row['ttft_mean_s'] or 0:6.2f} s  index in steps {share:4.1f}% (all build work "
          f"{work:4.1f}%)  index in decode steps {run['decode_index_step_s']:5.2f} s  decode "
          f"{row['decode_tokens_per_s']:6.1f} tok/s  step {itl_ms:6.1f} ms  peak concurrent "
          f"{peak}/{args.capacity_requests}", flush=True)
    return row


RATIO_KEYS = ("prompt_tokens_per_s", "ttft_mean_s", "ttft_max_s", "decode_tokens_per_s",
              "peak_concurrent_decodes")


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's row over its repeats: the first run's, with every number that
    rates the run (:data:`RATIO_KEYS`, decode steps) the median over the runs, and the runs
    themselves under ``"repeats"`` when there are several."""
    if len(rows) == 1:
        return rows[0]
    out = dict(rows[0])
    for k in (*RATIO_KEYS, "decode_step_median_s", "prefill_s", "decode_s"):
        values = [r[k] for r in rows if r[k] is not None]
        out[k] = statistics.median(values) if values else None
    out["repeats"] = rows
    return out


def plot(result: dict, path: pathlib.Path) -> None:
    """Bars of retro / stock for each measured quantity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["prompt_tokens_per_s", "decode_tokens_per_s", "peak_concurrent_decodes"]
    configs = result["configs"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    x = range(len(keys))
    width = 0.8 / len(configs)
    for j, cfg in enumerate(configs):
        ax.bar([i - 0.4 + width * (j + 0.5) for i in x], [cfg[k] for k in keys], width,
               label=cfg["config"])
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
    ap.add_argument("--capacity-requests", type=int, default=6,
                    help="capacity run: long requests given at once (0: skip the run)")
    ap.add_argument("--capacity-decode", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-gib", type=int, default=2, help="KV cache size (GiB) of each engine")
    ap.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS),
                    help="configurations to run (ratios are against the first, and need "
                         "'stock' first)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of every configuration, in the given order then reversed, "
                         "alternating (the engine run second in a process measured 3-10%% "
                         "slower steps whichever it was); ratios are medians of each "
                         "repeat's ratios")
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: accepted 1 or more")

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
        "cpu": cpu_description(), "threads": torch.get_num_threads(),
        "requests": args.requests, "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens, "dtype": args.dtype, "eager": args.eager,
    }
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.configs}
    for r in range(args.repeats):
        order = args.configs if r % 2 == 0 else args.configs[::-1]
        for name in order:
            row = run_config(name, CONFIGS[name], model, ps, args)
            row["order"] = order.index(name)
            runs[name].append(row)
    result["configs"] = [median_row(runs[name]) for name in args.configs]
    base_name = args.configs[0]
    result["ratios_over_" + base_name] = ratios = {}
    for name in args.configs[1:]:
        per = [{k: cfg[k] / base[k] for k in RATIO_KEYS if base[k] and cfg[k] is not None}
               for cfg, base in zip(runs[name], runs[base_name], strict=True)]
        ratios[name] = {k: statistics.median(p[k] for p in per) for k in per[0]}
        if args.repeats > 1:
            result.setdefault("ratios_per_repeat", {})[name] = per
        print(f"{name} / {base_name}:", {k: round(v, 3) for k, v in ratios[name].items()},
              "" if args.repeats == 1 else
              f"(median of {args.repeats}; decode per repeat "
              f"{[round(p['decode_tokens_per_s'], 3) for p in per]})")
    result["wall_s"] = time.perf_counter() - t0
    out = args.out or ROOT / "bench" / "results" / f"e2e_throughput_{device}.json"
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
