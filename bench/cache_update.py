"""The wave buffer's mapping-table lookup per (request, layer) decode step, at the Llama-3-8B
layer shape, compiled (``kernels/csrc/buffer_cpu.cpp``, what serving runs) against the numpy
reference, in the same run.

Two identical stores of 8 KV heads hold a clustered context (16 tokens per cluster on
average); each step reads the retrieval zone's clusters (``retrieval_budget`` of them per
head), 30% of which change from the step before; each store looks them up into a layer's
gather plan (runs of consecutive rows, ``WaveBufferStore.lookup_into``) after a sweep
through 64 MB that leaves its tables as cold as serving finds them (every layer's and
request's tables are touched once per step). Both must write the same plans. On the
host-tier path (``decode_padded``: where the device step does not serve a layer) the lookup
runs for every (request, layer) of every step on the decode thread, before the gather, so
its time x layers x requests must stay well below a decode step's.

The script's name is historical: until 2026-12-04 it also timed the per-request device block
cache's update (the worker's job), which was removed with that cache (see
``bench/results/gpu_check_h200_2026-11-28/README.md``); results before then
(``results/cache_update_*.json``) carry both.

    .venv/bin/python bench/cache_update.py --contexts 8192 32768 131072
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fixtures import random_clusters  # noqa: E402
from vllm_retro.buffer import WaveBufferManager  # noqa: E402
from vllm_retro.config import RetroConfig  # noqa: E402

HKV, D = 8, 128
IMPLS = ("compiled", "numpy")


def _store(manager: WaveBufferManager, keys: torch.Tensor, c: int, seed: int, compiled: bool):
    store = manager.store("r", HKV, D, torch.bfloat16, "cpu")
    if not compiled:
        store.compiled = None
    g = torch.Generator().manual_seed(seed)
    store.append(keys, keys, torch.arange(keys.shape[1]), random_clusters(HKV, keys.shape[1], c, g))
    store.settle()
    return store


def run(context: int, steps: int, seed: int = 0, sweep_mb: int = 64) -> dict:
    """Median / p90 ms of the lookup, compiled and numpy, over ``steps`` steps at
    ``context``, and whether both wrote the same plans; before each lookup a sweep through
    ``sweep_mb`` MB pushes the tables out of the caches, as the other layers' and requests'
    steps do in serving (0: no sweep)."""
    c = context // 16
    cfg = RetroConfig()
    r = cfg.num_retrieval(c)
    keys = torch.randn(HKV, context, D, generator=torch.Generator().manual_seed(seed)).bfloat16()
    managers = {name: WaveBufferManager(cfg) for name in IMPLS}
    stores = {name: _store(managers[name], keys, c, seed, name == "compiled") for name in IMPLS}
    assert stores["compiled"].compiled is not None, "the extension did not build"
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(c, r, replace=False) for _ in range(HKV)])
    times: dict[str, list[float]] = {n: [] for n in IMPLS}
    # each store's gather plan, kept across steps as the layer pool keeps it
    plans = {n: np.zeros((HKV * 4 * r * 16, 3), dtype=np.int64) for n in IMPLS}
    runs: list[tuple[int, int]] = []
    same = True
    sweep = np.ones(sweep_mb << 17)  # float64: sweep_mb MB
    for step in range(steps):
        for h in range(HKV):
            pick = rng.choice(r, int(0.3 * r), replace=False)
            ids[h, pick] = rng.choice(np.setdiff1d(np.arange(c), ids[h]), pick.size,
                                      replace=False)
        written = {}
        for name in IMPLS if step % 2 else IMPLS[::-1]:  # alternate which runs first
            store = stores[name]
            # the execution buffer's slots: the most tokens of any head (as decode_padded)
            t_cap = int(store.table.size[np.arange(HKV)[:, None], ids].sum(axis=1).max())
            sweep.sum()
            t0 = time.perf_counter()
            lk = store.lookup_into(ids, plans[name], 0, 0, 0, t_cap)
            times[name].append(time.perf_counter() - t0)
            written[name] = lk.runs.copy()
            if name == "compiled":
                runs.append((len(lk.runs), int(lk.counts[0])))
        same &= np.array_equal(written["compiled"], written["numpy"])
    out: dict = {"context": context, "clusters_per_head": c, "reads_per_head": r,
                 "sweep_mb": sweep_mb}
    n_runs, n_tokens = np.array(runs).sum(axis=0)
    out["plan_runs_per_step"] = round(float(n_runs) / steps, 1)
    out["plan_tokens_per_step"] = round(float(n_tokens) / steps, 1)
    for name in IMPLS:
        ms = [x * 1e3 for x in times[name][steps // 10:]]
        out[name] = {"lookup_median_ms": round(statistics.median(ms), 4),
                     "lookup_p90_ms": round(float(np.percentile(ms, 90)), 4)}
        managers[name].close()
    out["lookup_speedup"] = round(out["numpy"]["lookup_median_ms"]
                                  / out["compiled"]["lookup_median_ms"], 2)
    out["same_plans"] = bool(same)
    return out


def main() -> None:
    """Print one line per context (and write ``--out`` as JSON)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--sweep-mb", type=int, default=64,
                    help="MB swept through the caches before each lookup (0: none)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = [run(n, args.steps, sweep_mb=args.sweep_mb) for n in args.contexts]
    for row in rows:
        print(f"{row['context']:>7} tokens: {row['clusters_per_head']} clusters/head, "
              f"{row['reads_per_head']} read/step, per (request, layer) step:")
        for name in IMPLS:
            x = row[name]
            print(f"    {name:>8}: lookup {x['lookup_median_ms']:.3f} ms median "
                  f"({x['lookup_p90_ms']:.3f} p90)")
        print(f"    gather plan: {row['plan_runs_per_step']:.0f} runs for "
              f"{row['plan_tokens_per_step']:.0f} tokens per step")
        print(f"    compiled / numpy: lookup {row['lookup_speedup']:.1f}x faster; "
              f"same plans: {row['same_plans']}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
