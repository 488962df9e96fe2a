"""One decode step's appends of new K/V into the steady zones of every layer.

Compares, on the same indexes and tokens, in one run:

- ``per-row``: each index appends its own token (two row writes and its bookkeeping per
  request and layer; how the route appended before the layer pools);
- ``batched``: :func:`~vllm_retro.index.batched.append_batch` over each layer's steady
  pool (one ``index_put`` per K and V per layer for the whole batch, the index tensors built
  by the first layer and reused by the others), as the route now does.

Shape: Llama-3-8B (8 KV heads x 128, bf16) by default, ``--layers`` layers, ``--batch``
requests each with a context of ``--context`` tokens (dense windows only: the indexed middle
does not take part in an append). Prints milliseconds per step and the ratio; writes JSON
with ``--out``. Run from the repository root: ``.venv/bin/python bench/append_step.py``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from vllm_retro.config import RetroConfig  # noqa: E402
from vllm_retro.index.batched import append_batch  # noqa: E402
from vllm_retro.index.meta_pool import MetaPool  # noqa: E402
from vllm_retro.index.steady import SteadyPool  # noqa: E402
from vllm_retro.index.wave_index import WaveIndex  # noqa: E402


def build_layers(layers: int, batch: int, context: int, heads: int, dim: int,
                 dtype: torch.dtype, pooled: bool, manager=None) -> list[list[WaveIndex]]:
    """``layers`` x ``batch`` indexes over random KV (short enough to stay dense: only the
    steady zone matters here), each layer's in one steady pool and one meta pool when
    ``pooled``, as a served layer's; their KV in ``manager``'s wave buffer (one host pool
    per layer, as served) when given, else in dense stores of their own."""
    cfg = RetroConfig() if manager is None else manager.config
    g = torch.Generator().manual_seed(0)
    out = []
    for layer in range(layers):
        row = []
        for b in range(batch):
            kv = torch.randn(2, heads, context, dim, generator=g).to(dtype)
            store = None if manager is None else manager.store(
                f"r{b}", heads, dim, dtype, "cpu", layer=f"L{layer}")
            row.append(WaveIndex.build(kv[0], kv[1], cfg, store=store))
        if pooled:
            own = row[0].steady
            pool = SteadyPool(heads, dim, own.sink_cap, own.ring, dtype, own.device,
                              slots=batch, zeroed=True)
            meta = MetaPool(*row[0].meta_pool_layout())
            for b, index in enumerate(row):
                index.adopt_steady(pool, b)
                index.adopt_meta(meta)
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, default=600)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--out", type=pathlib.Path)
    args = p.parse_args(argv)
    dtype = torch.bfloat16
    torch.set_num_threads(max(1, torch.get_num_threads()))
    results = []
    for batch in args.batches:
        per_row = build_layers(args.layers, batch, args.context, args.heads, args.dim,
                               dtype, pooled=False)
        pooled = build_layers(args.layers, batch, args.context, args.heads, args.dim,
                              dtype, pooled=True)
        g = torch.Generator().manual_seed(1)
        times: dict[str, list[float]] = {"per-row": [], "batched": []}
        for _ in range(args.steps):
            k_new = torch.randn(args.layers, batch, args.heads, args.dim, generator=g).to(dtype)
            v_new = torch.randn_like(k_new)
            t0 = time.perf_counter()
            for layer, row in enumerate(per_row):
                for b, index in enumerate(row):
                    index.append(k_new[layer, b][:, None], v_new[layer, b][:, None])
            t1 = time.perf_counter()
            rows = None
            for layer, row in enumerate(pooled):
                _, rows = append_batch(row, k_new[layer], v_new[layer], rows)
            t2 = time.perf_counter()
            times["per-row"].append(t1 - t0)
            times["batched"].append(t2 - t1)
        for a, b in zip(per_row, pooled, strict=True):  # same tokens, same windows
            assert all(torch.equal(x.win_k, y.win_k) for x, y in zip(a, b, strict=True))
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        res = {"batch": batch, "layers": args.layers, "ms_per_step": med,
               "speedup": med["per-row"] / med["batched"]}
        results.append(res)
        print(f"batch {batch:3d}, {args.layers} layers: per-row {med['per-row']:.3f} ms, "
              f"batched {med['batched']:.3f} ms per step ({res['speedup']:.2f}x)", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                        "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
