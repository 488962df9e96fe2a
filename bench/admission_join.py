"""The join of one layer step's cache updates on the padded/CUDA path: every admitted page
copied from the execution buffer into the device block pool. One gather call over one run
per admitted page (``LayerPool.join_batch``, this code) against the per-token copy it
replaced (an index_select of every admitted token's execution-buffer row and an index_copy_
into its block-pool row, with both index arrays sent to the device), on the same plans, in
the same run (the copies are idempotent: same rows, same bytes).

``--batch`` requests of ``context`` tokens in one layer pool (Llama-3-8B layer shape, bf16,
the default 5% device cache, LRU), each step 30% of the retrieval zone new; the plans come
from the real ``gather_batch`` + worker update of each step.

    .venv/bin/python bench/admission_join.py --contexts 32768 131072 --batch 8
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

from bench.layer_tables import step_ids  # noqa: E402
from tests.fixtures import random_clusters  # noqa: E402
from vllm_retro.buffer import WaveBufferManager  # noqa: E402
from vllm_retro.buffer.layer_pool import admission_runs  # noqa: E402
from vllm_retro.config import RetroConfig  # noqa: E402
from vllm_retro.kernels.gather import expand_runs  # noqa: E402

HKV, D = 8, 128


def per_token_copy(pool, exec_k: torch.Tensor, exec_v: torch.Tensor, runs: np.ndarray) -> None:
    """The replaced join: per-token source and destination rows, index_select + index_copy_."""
    dst, src = expand_runs(runs)
    src_t = torch.from_numpy(src).to(exec_k.device)
    dst_t = torch.from_numpy(dst).to(pool.device)
    k = exec_k.reshape(-1, D).index_select(0, src_t)
    v = exec_v.reshape(-1, D).index_select(0, src_t)
    with pool.blocks.lock:  # as the old join's write did
        pool.blocks.k.view(-1, D).index_copy_(0, dst_t, k)
        pool.blocks.v.view(-1, D).index_copy_(0, dst_t, v)


def run(context: int, batch: int, steps: int, seed: int = 0) -> dict:
    cfg = RetroConfig(kernel_backend="torch")
    c = context // 16
    r = cfg.num_retrieval(c)
    manager = WaveBufferManager(cfg)
    keys = torch.randn(HKV, context, D, generator=torch.Generator().manual_seed(seed)).bfloat16()
    stores = []
    for j in range(batch):
        st = manager.store(f"r{j}", HKV, D, torch.bfloat16, "cpu", layer="L0")
        st.append(keys, keys, torch.arange(context),
                  random_clusters(HKV, context, c, torch.Generator().manual_seed(seed + j)))
        st.settle()
        stores.append(st)
    pool = stores[0].pool
    rng = np.random.default_rng(seed)
    ids = [np.stack([rng.choice(c, r, replace=False) for _ in range(HKV)]) for _ in stores]
    times: dict[str, list[float]] = {"runs": [], "per_token": []}
    n_runs, n_tokens = [], []
    for step in range(steps):
        step_ids(ids, c, rng)
        t_cap = max(int(st.table.size[np.arange(HKV)[:, None], i].sum(axis=1).max())
                    for st, i in zip(stores, ids, strict=True))
        exec_k = torch.zeros(batch * HKV, t_cap, D, dtype=torch.bfloat16)
        exec_v = torch.zeros_like(exec_k)
        pool.gather_batch(stores, ids, [0] * batch, exec_k, exec_v)
        taken = [st.take_step() for st in stores]
        runs = np.concatenate([admission_runs(plan, (row0 + plan[0]) * t_cap + plan[1])
                               for _, _, row0, plan in taken])
        for variant in ("runs", "per_token") if step % 2 else ("per_token", "runs"):
            t0 = time.perf_counter()
            if variant == "runs":
                pool._copy_in(exec_k, exec_v, runs, "torch")
            else:
                per_token_copy(pool, exec_k, exec_v, runs)
            times[variant].append(time.perf_counter() - t0)
        n_runs.append(len(runs))
        n_tokens.append(int(runs[:, 2].sum()))
    out = {"context": context, "batch": batch, "steps": steps,
           "admitted_pages_per_layer_step": round(float(np.mean(n_runs)), 1),
           "admitted_tokens_per_layer_step": round(float(np.mean(n_tokens)), 1),
           "index_bytes_to_device_per_token_copy": round(float(np.mean(n_tokens)) * 16),
           "index_bytes_to_device_runs": round(float(np.mean(n_runs)) * 24)}
    for variant, ts in times.items():
        out[f"{variant}_median_ms"] = round(statistics.median(ts[steps // 10:]) * 1e3, 4)
    manager.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = [run(n, args.batch, args.steps) for n in args.contexts]
    for row in rows:
        print(f"{row['context']:>7} tokens x {row['batch']}: "
              f"{row['admitted_pages_per_layer_step']:.0f} pages "
              f"({row['admitted_tokens_per_layer_step']:.0f} tokens) admitted per layer step; "
              f"join as page runs {row['runs_median_ms']:.3f} ms, per token "
              f"{row['per_token_median_ms']:.3f} ms; index bytes to the device "
              f"{row['index_bytes_to_device_runs']} vs "
              f"{row['index_bytes_to_device_per_token_copy']}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
