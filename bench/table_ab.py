"""Two builds of the compiled mapping-table lookup (``kernels/csrc/buffer_cpu.cpp``) in one
run: one store's lookup per step, each build on the same tables and retrievals (the plans
they write must be equal). For before/after measurements of a change to ``buffer_cpu.cpp``:
build the old commit's extension (``cpu_ext.load()`` in a worktree of it: it lands in the
same cache), then

    .venv/bin/python bench/table_ab.py --old <hash> --new <hash> --contexts 32768 131072

with the hashes of ``~/.cache/vllm-retro/extensions/retro_cpu-<hash>``. Both builds must
have the ``buffer_lookup`` this checkout's ``WaveBufferStore.lookup_into`` calls (the host
pool's page count rather than a page -> block map, since the per-request device block cache
was removed on 2026-12-04), so older builds cannot be compared this way; until then this
script also timed the cache update (``results/table_ab_*.json``). Keys have head_dim 16 (the
tables are what is timed); a 64 MB sweep precedes each lookup, as in
``bench/cache_update.py``.
"""

from __future__ import annotations

import argparse
import importlib.util
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

HKV, D = 8, 16
CACHE = Path.home() / ".cache" / "vllm-retro" / "extensions"


def load(build: str):
    """The extension module built under ``CACHE / retro_cpu-<build>``."""
    name = f"vllm_retro_cpu_{build}"
    spec = importlib.util.spec_from_file_location(name, CACHE / f"retro_cpu-{build}" / f"{name}.so")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(context: int, steps: int, builds: dict, seed: int = 0) -> dict:
    """Median ms of each build's lookup at ``context``."""
    cfg = RetroConfig()
    c = context // 16
    r = cfg.num_retrieval(c)
    keys = torch.randn(HKV, context, D, generator=torch.Generator().manual_seed(seed)).bfloat16()
    manager = WaveBufferManager(cfg)
    st = manager.store("r", HKV, D, torch.bfloat16, "cpu")
    st.append(keys, keys, torch.arange(context),
              random_clusters(HKV, context, c, torch.Generator().manual_seed(seed)))
    st.settle()
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(c, r, replace=False) for _ in range(HKV)])
    plan = np.zeros((HKV * 4 * r * 16, 3), dtype=np.int64)
    sweep = np.ones(64 << 17)
    times: dict[str, list[float]] = {b: [] for b in builds}
    for step in range(steps):
        for h in range(HKV):
            pick = rng.choice(r, int(0.3 * r), replace=False)
            ids[h, pick] = rng.choice(np.setdiff1d(np.arange(c), ids[h]), pick.size,
                                      replace=False)
        t_cap = int(st.table.size[np.arange(HKV)[:, None], ids].sum(axis=1).max())
        order = list(builds) if step % 2 else list(builds)[::-1]
        written = {}
        for b in order:
            st.compiled = builds[b]
            sweep.sum()
            t0 = time.perf_counter()
            lk = st.lookup_into(ids, plan, 0, 0, 0, t_cap)
            times[b].append(time.perf_counter() - t0)
            written[b] = (lk.runs.copy(), lk.begins.copy(), lk.totals.copy(), lk.counts.copy())
        a, b = written.values()
        assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True)), \
            f"step {step}: the builds' lookups differ"
    out = {"context": context, "steps": steps}
    for b in builds:
        out[f"{b}_lookup_median_ms"] = round(statistics.median(times[b][steps // 10:]) * 1e3, 4)
    manager.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    builds = {"old": load(args.old), "new": load(args.new)}
    rows = [run(n, args.steps, builds) for n in args.contexts]
    for row in rows:
        print(f"{row['context']:>7} tokens: lookup old {row['old_lookup_median_ms']:.3f} -> new "
              f"{row['new_lookup_median_ms']:.3f} ms (same plans)")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(builds={"old": args.old, "new": args.new},
                                                  rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
