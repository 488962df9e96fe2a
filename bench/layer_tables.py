"""The wave buffer's mapping-table lookups of one layer's decode step for a whole batch, at the
Llama-3-8B layer shape, one call per request against one call for the layer, in the same run.

The lookups run on the decode thread, before the gather, on the host-tier path
(``decode_padded``: where the device step does not serve a layer): one call per request
(``ClusterMappingTable.lookup_into`` in a loop, what the batched path did before) against one
call for the layer (``lookup_batch_into``, ``buffer_lookup_batch``: the requests' lookups in
parallel on ``--threads`` threads, each into a region of the gather plan, then closed up), on
the same tables and retrievals. On CUDA their time x layers must stay well below a decode
step. ``--batch`` requests of ``context`` tokens share one layer pool (one host pool: the
serving layout), each with 8 KV heads of clustered keys (16 tokens per cluster on average).
Serving touches each layer's tables once per step, between the other layers' steps: so the
layer's tables (the cluster records) are copied to ``--layers`` layers (1 GB at 128K x 8 x 32
layers: far past the caches) and each variant looks every layer up in turn, as a decode step
does, while the Python and library code it runs stays as warm as it is in serving. Each step
every request reads its retrieval zone's clusters, 30% of them new; the variants alternate
which goes first. Both must write the same plans. Only the tables matter here, so the keys
have head_dim 16 (the host pool is never read).

Until 2026-12-04 this script also timed the per-request device block cache's updates (the
worker's job, ``buffer_update_batch``), removed with that cache (see
``bench/results/gpu_check_h200_2026-11-28/README.md``); ``results/layer_tables*.json`` from
before then carry them.

    .venv/bin/python bench/layer_tables.py --contexts 8192 32768 131072 --batch 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fixtures import random_clusters  # noqa: E402
from vllm_retro.buffer import WaveBufferManager  # noqa: E402
from vllm_retro.buffer.mapping import ClusterMappingTable  # noqa: E402
from vllm_retro.config import RetroConfig  # noqa: E402

HKV, D = 8, 16
VARIANTS = ("per_request", "one_call")


def _stores(manager: WaveBufferManager, context: int, batch: int, seed: int) -> list:
    """``batch`` stores of one layer pool, each with ``context`` clustered tokens per head."""
    c = context // 16
    keys = torch.randn(HKV, context, D, generator=torch.Generator().manual_seed(seed)).bfloat16()
    out = []
    for j in range(batch):
        st = manager.store(f"r{j}", HKV, D, torch.bfloat16, "cpu", layer="L0")
        g = torch.Generator().manual_seed(seed + j)
        st.append(keys, keys, torch.arange(context), random_clusters(HKV, context, c, g))
        st.settle()
        out.append(st)
    return out


def step_ids(ids: list[np.ndarray], c: int, rng: np.random.Generator) -> None:
    """Replace 30% of every request's retrieval clusters, per head, in place."""
    r = ids[0].shape[1]
    for i in ids:
        for h in range(HKV):
            pick = rng.choice(r, int(0.3 * r), replace=False)
            i[h, pick] = rng.choice(np.setdiff1d(np.arange(c), i[h]), pick.size, replace=False)


def run(context: int, batch: int, layers: int, steps: int, threads: int, seed: int = 0
        ) -> dict:
    """Median / p90 ms of one layer step's lookups for the batch, and the median decode
    step's sum over ``layers``, each variant, the one call on ``threads`` threads."""
    cfg = RetroConfig()
    c = context // 16
    r = cfg.num_retrieval(c)
    manager = WaveBufferManager(cfg)
    stores = _stores(manager, context, batch, seed)
    mod = stores[0].compiled
    assert mod is not None, "the extension did not build"
    pages = stores[0].host.capacity_pages
    rng = np.random.default_rng(seed)
    ids = [np.stack([rng.choice(c, r, replace=False) for _ in range(HKV)]) for _ in stores]
    # every layer's tables: copies of this one's (separate memory, so as cold as serving's)
    tables = []
    for _ in range(layers):
        copies = []
        for st in stores:
            t = ClusterMappingTable(HKV, st.page_size)
            t.records = st.table.records.copy()
            copies.append(t)
        tables.append(copies)
    per_layer: dict[str, list[float]] = {v: [] for v in VARIANTS}
    per_step: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for step in range(steps):
        step_ids(ids, c, rng)
        t_cap = max(int(st.table.size[np.arange(HKV)[:, None], i].sum(axis=1).max())
                    for st, i in zip(stores, ids, strict=True))
        plans = {v: np.zeros((batch * HKV * t_cap, 3), dtype=np.int64) for v in VARIANTS}
        written = {}
        for variant in VARIANTS if step % 2 else VARIANTS[::-1]:
            plan, total = plans[variant], 0.0
            for copies in tables:
                t0 = time.perf_counter()
                if variant == "per_request":
                    at = 0
                    for j, (t, i) in enumerate(zip(copies, ids, strict=True)):
                        at += len(t.lookup_into(mod, i, pages, plan, at, j * HKV, 0,
                                                t_cap).runs)
                else:
                    lks = ClusterMappingTable.lookup_batch_into(mod, copies, ids, pages,
                                                                plan, [0] * batch, t_cap,
                                                                threads)
                    at = sum(len(lk.runs) for lk in lks)
                dt = time.perf_counter() - t0
                per_layer[variant].append(dt)
                total += dt
            per_step[variant].append(total)
            written[variant] = plan[:at].copy()
        assert np.array_equal(written["per_request"], written["one_call"]), "plans differ"
    out: dict = {"context": context, "batch": batch, "layers": layers, "threads": threads,
                 "clusters_per_head": c, "reads_per_head": r,
                 "plan_runs_per_layer_step": len(written["one_call"])}
    for variant in VARIANTS:
        ms = [x * 1e3 for x in per_layer[variant]]
        out[f"{variant}_layer_median_ms"] = round(statistics.median(ms), 4)
        out[f"{variant}_layer_p90_ms"] = round(float(np.percentile(ms, 90)), 4)
        out[f"{variant}_step_median_ms"] = round(statistics.median(per_step[variant]) * 1e3, 3)
    out["speedup"] = round(out["per_request_step_median_ms"] / out["one_call_step_median_ms"], 2)
    manager.close()
    return out


def main() -> None:
    """Print the lookups' lines per (context, threads) (and write ``--out`` as JSON)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20, help="lookup steps (x layers)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, len(os.sched_getaffinity(0))])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    threads = list(dict.fromkeys(args.threads))
    rows = [run(n, args.batch, args.layers, args.steps, t)
            for n in args.contexts for t in threads]
    print("lookups, a layer step's for the batch:")
    for row in rows:
        print(f"{row['context']:>7} tokens x {row['batch']} requests, {row['threads']} "
              f"thread(s), {row['plan_runs_per_layer_step']} runs per layer step:")
        for v in VARIANTS:
            print(f"    {v:>11}: {row[f'{v}_layer_median_ms']:.3f} ms per layer "
                  f"({row[f'{v}_layer_p90_ms']:.3f} p90), {row[f'{v}_step_median_ms']:.2f} ms "
                  f"per {row['layers']}-layer step")
        print(f"    one call / per request: {row['speedup']:.2f}x faster")
    if args.out:
        Path(args.out).write_text(json.dumps({"lookups": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
