"""The wave buffer's per-step cache update (the worker's job): milliseconds per (request,
layer) step, at the Llama-3-8B layer shape.

One store of 8 KV heads holding a clustered context (16 tokens per cluster on average, the
default 5% device cache, LRU); each step reads the retrieval zone's clusters
(``retrieval_budget`` of them per head), 30% of which change from the step before, and the
update records the reads, evicts and admits (``WaveBufferStore._update``, timed alone, the
lookup outside). On CUDA this job runs on the worker thread for every (request, layer) of
every step, so its time x layers x requests must stay below a decode step's.

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

from tests.buffer.conftest import random_clusters  # noqa: E402
from vllm_retro.buffer import WaveBufferManager  # noqa: E402
from vllm_retro.config import RetroConfig  # noqa: E402

HKV, D = 8, 128


def run(context: int, steps: int, seed: int = 0) -> dict:
    """Median / p90 update ms and the pages evicted over ``steps`` steps at ``context``."""
    g = torch.Generator().manual_seed(seed)
    c = context // 16
    cfg = RetroConfig()
    r = cfg.num_retrieval(c)
    keys = torch.randn(HKV, context, D, generator=g).bfloat16()
    manager = WaveBufferManager(cfg)
    store = manager.store("r", HKV, D, torch.bfloat16, "cpu")
    store.stage(keys, keys)
    store.append(keys, keys, torch.arange(context), random_clusters(HKV, context, c, g))
    store.settle()
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(c, r, replace=False) for _ in range(HKV)])
    times = []
    for _ in range(steps):
        for h in range(HKV):
            pick = rng.choice(r, int(0.3 * r), replace=False)
            ids[h, pick] = rng.choice(np.setdiff1d(np.arange(c), ids[h]), pick.size,
                                      replace=False)
        lk = store.table.lookup(ids, store.host.page_block)
        t = time.perf_counter()
        store._update(ids, lk, 0)
        times.append(time.perf_counter() - t)
    evicted = manager.stats.snapshot()["pages_evicted"]
    manager.close()
    ms = [x * 1e3 for x in times[steps // 10:]]
    return {"context": context, "clusters_per_head": c, "reads_per_head": r,
            "median_ms": round(statistics.median(ms), 4),
            "p90_ms": round(float(np.percentile(ms, 90)), 4), "pages_evicted": evicted}


def main() -> None:
    """Print one line per context (and write ``--out`` as JSON)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = [run(n, args.steps) for n in args.contexts]
    for row in rows:
        print(f"{row['context']:>7} tokens: {row['clusters_per_head']} clusters/head, "
              f"{row['reads_per_head']} read/step: update {row['median_ms']:.3f} ms median, "
              f"{row['p90_ms']:.3f} p90 per (request, layer) step; "
              f"{row['pages_evicted']} pages evicted")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
