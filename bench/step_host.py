"""The host's work per layer step on the device path, this tree against another git revision.

On CUDA a served layer's decode step (:class:`~vllm_retro.index.resident.ResidentDecode`)
is, on the host: whether the batch decodes there (``applies``: every slot loaded?), the
slots' refresh (nothing to load in the usual step), the step's plan
(:meth:`~vllm_retro.index.device_layer.DeviceLayer.plan`: the batch's integers, copied to
the device without waiting), then one graph replay. At batch 1 the device's work is ~0.08-0.2
ms per layer (H200, ``bench/results/gpu_check_h200_2026-11-28``), so host microseconds before
the replay are a real share of the step: when the host is slower than the device, the
device waits for it.

Here the same host work runs on CPU tensors (the replay and the attention excluded: on the
CPU the step runs eagerly), for wave indexes of ``--context`` random tokens in a layer of
Llama-3-8B's shape (8 KV heads, head_dim 128), one per request, in one steady pool and one
meta pool (as served). Printed
per batch and revision: microseconds per layer step (medians over ``--rounds`` processes of
``--steps`` steps each) of applies, refresh and plan. On CUDA the plan's copy goes to the
device too (with the tree: straight into the graph's input), which is not timed here.

Each revision runs in a process of its own on its own checkout (a temporary ``git
worktree``, :func:`bench.revisions.alternate`), the two in alternating order::

    .venv/bin/python bench/step_host.py --rev HEAD~1 --batches 1 8 --out /tmp/step_host.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
PARTS = ("applies_us", "refresh_us", "plan_us")


def worker(args: argparse.Namespace) -> dict:
    """Time the host parts in this process, importing the package from ``$STEP_ROOT``."""
    sys.path.insert(0, os.environ.get("STEP_ROOT", str(ROOT)))
    import torch

    from vllm_retro.config import RetroConfig
    from vllm_retro.index import WaveIndex
    from vllm_retro.index.meta_pool import MetaPool
    from vllm_retro.index.resident import ResidentDecode
    from vllm_retro.index.steady import SteadyPool, ring_size

    torch.manual_seed(0)
    cfg = RetroConfig(device_resident="on", kernel_backend="torch")
    h, d = args.kv_heads, args.head_dim
    out: dict[str, dict] = {}
    for b in args.batches:
        indexes = [WaveIndex.build(torch.randn(h, args.context, d),
                                   torch.randn(h, args.context, d), cfg) for _ in range(b)]
        pool = SteadyPool(h, d, cfg.sink_tokens, ring_size(cfg.local_window, cfg.update_segment),
                          torch.float32, "cpu", slots=b, zeroed=True)
        meta = MetaPool(*indexes[0].meta_pool_layout())
        for slot, index in enumerate(indexes):
            index.adopt_steady(pool, slot)
            index.adopt_meta(meta)  # the layer's meta pool, as served
        resident = ResidentDecode()
        q = torch.randn(b, h * args.group, d)
        if not resident.applies(indexes, q):
            raise SystemExit("the batch does not decode on the device path")
        layer, slots = resident.layer, [i.slot for i in indexes]
        layer.refresh(slots, indexes)
        times: dict[str, list[float]] = {p: [] for p in PARTS}
        for _ in range(args.steps):
            t0 = time.perf_counter()
            resident.applies(indexes, q)
            t1 = time.perf_counter()
            layer.refresh(slots, indexes)
            t2 = time.perf_counter()
            layer.plan(slots, indexes)
            t3 = time.perf_counter()
            for part, dt in zip(PARTS, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                times[part].append(dt * 1e6)
        out[str(b)] = {p: statistics.median(v) for p, v in times.items()}
    return out


def main() -> None:
    from bench import revisions

    ap = revisions.parser(__doc__.splitlines()[0], batches=[1, 8], context=8192, kv_heads=8,
                          group=4, head_dim=128, steps=2000, rounds=3)
    done = revisions.run(ap, __file__, worker, "STEP_ROOT")
    if done is None:
        return
    args, runs, result = done
    for batch in map(str, args.batches):
        case = result["cases"][batch] = {}
        for name, rr in runs.items():
            c = case[name] = {p: statistics.median(x[batch][p] for x in rr) for p in PARTS}
            c["total_us"] = sum(c[p] for p in PARTS)
        line = ", ".join(f"{name} {c['total_us']:.1f} us (applies {c['applies_us']:.1f}, "
                         f"refresh {c['refresh_us']:.1f}, plan {c['plan_us']:.1f})"
                         for name, c in case.items())
        if args.rev:
            other = case[args.rev.split()[0]]
            case["tree_over_rev"] = case["tree"]["total_us"] / other["total_us"]
            line += f"; tree / {args.rev}: {case['tree_over_rev']:.2f}x"
        print(f"batch {batch}: {line}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
