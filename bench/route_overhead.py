"""The Python around the fused CPU kernel in a layer's decode call, this tree against another
git revision.

A served layer's decode step for B indexed rows is what ``RouteImplMixin._decode_indexed``
runs: :func:`~vllm_retro.index.batched.append_batch` (the step's new K/V into the layer's
steady pool, then each index's bookkeeping) and :func:`~vllm_retro.index.batched.decode_batch`
(one fused kernel call), with the layer's :class:`~vllm_retro.index.padded.MetaViewCache`.
Here ``--layers`` such layers of B rows each (wave indexes over ``--context`` random tokens,
Qwen2.5-0.5B's layer shape by default: 2 KV heads, 7 query heads each, head_dim 64, bf16)
take one step after another, each layer right after the previous one's kernel call, as in a
model. Printed per batch and revision, microseconds per layer call (medians over
``--steps``): the append, ``decode_batch`` less the kernel call, and the kernel call itself
(binding its arguments included); and the Python function calls one layer call makes
(append + decode), counted by ``sys.setprofile`` over one more step, in all and by module.

Each revision runs in a process of its own on its own checkout (a temporary ``git
worktree``; its extension is built on first use), the two in alternating order for
``--rounds`` rounds::

    .venv/bin/python bench/route_overhead.py --rev HEAD~1 --batches 3 8 --out /tmp/route.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def worker(args: argparse.Namespace) -> dict:
    """Time the layer calls in this process, importing the package from ``$ROUTE_ROOT``."""
    sys.path.insert(0, os.environ.get("ROUTE_ROOT", str(ROOT)))

    # the package first: bench.append_step (this tree's bench package, imported already)
    # puts this tree's root first on sys.path, and a revision's package imported after it
    # would be this tree's
    from vllm_retro.index.batched import append_batch, decode_batch  # isort: skip
    from vllm_retro.index.padded import MetaViewCache  # isort: skip
    from bench.append_step import build_layers  # isort: skip
    try:
        from vllm_retro.kernels import cpu_ext as loader
    except ImportError:  # revisions before the loader had a module of its own
        from vllm_retro.kernels import cpu_decode as loader

    mod = loader.load()
    if mod is None:
        raise SystemExit(f"the fused CPU kernel is unavailable: {loader.load_error()}")
    kernel_s = [0.0]

    class Timed:  # the extension with its decode call timed
        def __getattr__(self, name: str):
            return getattr(mod, name)

        def decode_rows(self, *a):
            t = time.perf_counter()
            try:
                return mod.decode_rows(*a)
            finally:
                kernel_s[0] += time.perf_counter() - t

        def decode_plan(self, *a):  # the layer's step (revisions since it came)
            t = time.perf_counter()
            try:
                return mod.decode_plan(*a)
            finally:
                kernel_s[0] += time.perf_counter() - t

    timed = Timed()
    loader.load = lambda: timed
    h, group, d, dtype = args.kv_heads, args.group, args.head_dim, torch.bfloat16
    torch.manual_seed(0)
    out = {}
    managers = []
    for batch in args.batches:
        manager = None
        if args.stores == "wave_buffer":
            from vllm_retro.buffer import WaveBufferManager
            from vllm_retro.config import RetroConfig

            manager = WaveBufferManager(RetroConfig())
            managers.append(manager)
        layers = build_layers(args.layers, batch, args.context, h, d, dtype, pooled=True,
                              manager=manager)
        caches = [MetaViewCache() for _ in layers]
        g = torch.Generator().manual_seed(1)
        res = []
        for step in range(args.steps + 5):
            k_new = torch.randn(batch, h, d, generator=g).to(dtype)
            q = torch.randn(batch, h * group, d, generator=g).to(dtype)
            o = torch.empty_like(q)
            rows = None
            t_app = t_dec = 0.0
            kernel_s[0] = 0.0
            for row, cache in zip(layers, caches, strict=True):
                t0 = time.perf_counter()
                _, rows = append_batch(row, k_new, k_new, rows)
                t1 = time.perf_counter()
                decode_batch(row, q, d ** -0.5, out=o, cache=cache)
                t_dec += time.perf_counter() - t1
                t_app += t1 - t0
            if step >= 5:  # warm-up steps
                res.append((t_app, t_dec - kernel_s[0], kernel_s[0]))
        per = [statistics.median(r[i] for r in res) * 1e6 / args.layers for i in range(3)]
        out[str(batch)] = dict(zip(("append_us", "decode_python_us", "kernel_us"), per,
                                   strict=True))
        out[str(batch)]["calls"] = count_calls(layers, caches, k_new, q, o, d ** -0.5)
    for manager in managers:
        manager.close()
    return out


def count_calls(layers: list, caches: list, k_new, q, o, scale: float) -> dict[str, float]:
    """Python function calls per layer call (append + decode, C functions not counted) of
    one more step over all layers, in all (``"total"``) and by the module file that defines
    them (``vllm_retro/...`` relative; ``route_overhead.py``: this harness's timing wrapper
    of the kernel call)."""
    from vllm_retro.index.batched import append_batch, decode_batch

    counts: dict[str, int] = {}

    def prof(frame, event, _arg):
        if event == "call":
            name = frame.f_code.co_filename
            key = name.split("vllm_retro/", 1)[-1] if "vllm_retro/" in name else \
                pathlib.Path(name).name
            counts[key] = counts.get(key, 0) + 1

    rows = None
    sys.setprofile(prof)
    try:
        for row, cache in zip(layers, caches, strict=True):
            _, rows = append_batch(row, k_new, k_new, rows)
            decode_batch(row, q, scale, out=o, cache=cache)
    finally:
        sys.setprofile(None)
    per = {k: round(v / len(layers), 1) for k, v in counts.items()}
    return {"total": round(sum(per.values()), 1),
            **dict(sorted(per.items(), key=lambda x: -x[1]))}


def main() -> None:
    from bench import revisions

    ap = revisions.parser(__doc__.splitlines()[0], batches=[3, 8], context=2048, kv_heads=2,
                          group=7, head_dim=64, steps=60, rounds=2)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--stores", choices=["wave_buffer", "dense"], default="wave_buffer",
                    help="the rows' KV in a wave buffer's host tier, one pool per layer (as "
                    "served), or dense stores of their own (the route_overhead runs before "
                    "2026-12-03)")
    done = revisions.run(ap, __file__, worker, "ROUTE_ROOT")
    if done is None:
        return
    args, runs, result = done
    for batch in map(str, args.batches):
        case = result["cases"][batch] = {}
        for name, rr in runs.items():
            case[name] = {k: statistics.median(x[batch][k] for x in rr) for k in rr[0][batch]
                          if k != "calls"}
            c = case[name]
            c["calls"] = rr[0][batch].get("calls", {})
            print(f"batch {batch} {name:>8}: append {c['append_us']:6.1f} us, decode_batch "
                  f"less kernel {c['decode_python_us']:6.1f} us, kernel call "
                  f"{c['kernel_us']:7.1f} us per layer; "
                  f"{c['calls'].get('total', '?')} Python calls", flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
