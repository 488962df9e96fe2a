"""Cost of the tilted estimator against the paper's, in the tripartite decode kernel.

Llama-3-8B-shaped rows (8 KV heads x batch, 4 query heads each, head_dim 128, bf16) at the
default budgets: per row the steady zone (68 tokens) plus the retrieval zone (1.8% of the
clusters, 16 tokens each) read exactly, and 23.2% of the clusters estimated. Three timings per
case, interleaved step by step in the same run:

- ``centroid``: ``kernels.tripartite_decode`` with the paper's estimator;
- ``tilted``: the same call with the tilted estimator's terms, *plus* computing those terms
  from the query (``ResidualModel.query_terms``), i.e. everything the new estimator adds;
- ``full``: full attention over the whole context (PyTorch SDPA: FlashAttention on CUDA, the
  fused CPU kernel on CPU), for scale.

The kernel is the Triton one on CUDA and the torch reference on CPU (what each device runs).
Prints medians and the ratio tilted / centroid; writes
``bench/results/estimator_cost_<device>.json``.

    .venv/bin/python bench/estimator_cost.py                    # CPU: 8K-32K, batch 1 and 4
    python bench/estimator_cost.py --device cuda --contexts 32768 131072 --batches 1 8
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import platform
import statistics
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vllm_retro import kernels  # noqa: E402
from vllm_retro.config import RetroConfig  # noqa: E402
from vllm_retro.index.estimator import ResidualModel, expected_max_deviate  # noqa: E402

HKV, G, D = 8, 4, 128


def case_inputs(batch: int, n: int, device: str, dtype: torch.dtype, seed: int) -> dict:
    """Inputs of one decode step for ``batch`` requests of ``n`` tokens (rows = batch * HKV)."""
    cfg = RetroConfig()
    g = torch.Generator().manual_seed(seed)
    c = math.ceil((n - cfg.sink_tokens - cfg.local_window) / cfg.cluster_size)
    r_clusters, e_clusters = cfg.num_retrieval(c), cfg.num_estimation(c)
    t = cfg.sink_tokens + cfg.local_window + r_clusters * cfg.cluster_size
    rows = batch * HKV

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device, dtype)

    sizes = torch.randint(8, 25, (rows, c), generator=g, dtype=torch.int32)
    est = torch.stack([torch.randperm(c, generator=g)[:e_clusters] for _ in range(rows)])
    model = ResidualModel(rows, D, torch.device(device))
    key_sq = torch.rand(rows, D, generator=g) + 0.1
    model.add(key_sq.to(device), (torch.randn(rows, D, D, generator=g) * 0.1).to(device))
    return {
        "query": rnd(rows, G, D), "k_exact": rnd(rows, t, D), "v_exact": rnd(rows, t, D),
        "n_exact": torch.full((rows,), t, device=device), "centroids": rnd(rows, c, D),
        "value_sums": rnd(rows, c, D) * 16, "sizes": sizes.to(device), "est_ids":
        est.to(device), "n_est": torch.full((rows,), e_clusters, device=device),
        "spreads": (torch.rand(rows, c, generator=g) * 4).to(device),
        "deviates": expected_max_deviate(sizes).to(device), "model": model,
        "full_k": rnd(batch, HKV, n, D), "full_v": rnd(batch, HKV, n, D),
        "clusters": c, "estimated": e_clusters, "exact_tokens": t,
    }


def step_fns(x: dict, scale: float) -> dict:
    """The three timed callables of a case."""
    args = (x["query"], x["k_exact"], x["v_exact"], x["n_exact"], x["centroids"],
            x["value_sums"], x["sizes"], x["est_ids"], x["n_est"], scale)
    rows = x["query"].shape[0]
    batch = rows // HKV
    fq = x["query"].reshape(batch, HKV * G, 1, D)

    def centroid() -> None:
        kernels.tripartite_decode(*args)

    def tilted() -> None:
        qvar, vshift = x["model"].query_terms(x["query"], scale)
        tilt = kernels.TiltTerms(x["spreads"], x["deviates"], qvar, vshift)
        kernels.tripartite_decode(*args, tilt)

    def full() -> None:
        torch.nn.functional.scaled_dot_product_attention(
            fq, x["full_k"], x["full_v"], scale=scale, enable_gqa=True)

    return {"centroid": centroid, "tilted": tilted, "full": full}


def time_case(fns: dict, steps: int, device: str) -> dict[str, float]:
    """Median seconds per call of each function, interleaved over ``steps`` rounds."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for fn in fns.values():  # warm-up (Triton compilation, allocator)
        fn()
        fn()
    sync()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(steps):
        for name, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    """Run every (context, batch) case, print the table, write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", help="JSON path (default bench/results/estimator_cost_<device>.json)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    dtype, scale = torch.bfloat16, D ** -0.5
    cases = []
    print(f"{'context':>8} {'batch':>5} {'est.cl':>7} {'centroid ms':>12} {'tilted ms':>10} "
          f"{'tilted/centroid':>16} {'full ms':>9} {'centroid/full':>14} {'tilted/full':>12}")
    for n in args.contexts:
        for b in args.batches:
            x = case_inputs(b, n, args.device, dtype, seed=n + b)
            t = time_case(step_fns(x, scale), args.steps, args.device)
            row = {"context": n, "batch": b, "clusters": x["clusters"],
                   "estimated_clusters": x["estimated"], "exact_tokens": x["exact_tokens"],
                   "seconds": t, "tilted_over_centroid": t["tilted"] / t["centroid"],
                   "centroid_over_full": t["centroid"] / t["full"],
                   "tilted_over_full": t["tilted"] / t["full"]}
            cases.append(row)
            print(f"{n:>8} {b:>5} {x['estimated']:>7} {t['centroid'] * 1e3:>12.3f} "
                  f"{t['tilted'] * 1e3:>10.3f} {row['tilted_over_centroid']:>16.3f} "
                  f"{t['full'] * 1e3:>9.3f} {row['centroid_over_full']:>14.3f} "
                  f"{row['tilted_over_full']:>12.3f}")
            del x
    device_name = (torch.cuda.get_device_name() if args.device == "cuda"
                   else platform.processor() or platform.machine())
    result = {
        "command": "python bench/estimator_cost.py " + " ".join(sys.argv[1:] if argv is None
                                                                else argv),
        "device": args.device, "device_name": device_name, "torch": torch.__version__,
        "kernel": "triton" if args.device == "cuda" else "torch reference",
        "shape": {"kv_heads": HKV, "query_heads_per_kv": G, "head_dim": D, "dtype": "bf16"},
        "steps": args.steps, "cases": cases,
    }
    out = pathlib.Path(args.out or ROOT / f"bench/results/estimator_cost_{args.device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
