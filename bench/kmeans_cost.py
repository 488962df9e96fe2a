"""Index build cost: the segmented spherical k-means of one layer's prefill keys, before and
after the fast torch path, with and without early stopping, against one prefill layer.

Keys of a Llama-3-8B-shaped layer (8 KV heads, head_dim 128, bf16; structured like
``bench/decode_step.py``'s) at each context length are clustered as the wave index does at
prefill (segments of 8192 tokens, one centroid per 16 tokens, 10 rounds):

- ``before``: the reference assignment and scatter sums (the implementation up to this
  change: masks materialised, element-wise scatter);
- ``after``: the fast torch path (:func:`vllm_retro.kernels.kmeans.kmeans_assign_torch`,
  :func:`~vllm_retro.kernels.kmeans.scatter_sum_torch`), bit-identical clusters, stopping
  once no key moves (exact);
- ``after_tol``: the same with ``--tol`` (stop once a round moves at most that fraction);
- ``fused`` / ``fused_tol``: the serving path, the 'auto' backend: on CPU the fused C++
  assignment (:func:`vllm_retro.kernels.kmeans.kmeans_assign_cpu`, GEMM and argmax in one
  pass, equal up to ties within rounding), on CUDA the Triton kernel.

Scale: one prefill layer of the same model at the same length on the same machine (QKV and
output projections, causal SDPA attention with GQA, SwiGLU MLP; bf16), timed in the same run.
The index build is on the prefill's critical path once per layer, so ``build / layer`` is its
share of prefill (``--layer-max``: time the layer only up to that length; longer rows report
build times alone). Prints each row; writes ``bench/results/kmeans_cost_<device>.json``.

    .venv/bin/python bench/kmeans_cost.py --contexts 8192 16384 32768
    .venv/bin/python bench/kmeans_cost.py --contexts 8192 16384 32768 65536 131072 \
        --layer-max 16384 --repeat 1
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.decode_step import HKV, D, synthetic_kv  # noqa: E402
from vllm_retro import kernels  # noqa: E402
from vllm_retro.index.clustering import cluster_block  # noqa: E402
from vllm_retro.kernels import kmeans as km  # noqa: E402

HIDDEN, HQ, MLP = 4096, 32, 14336


def _timed(fn: Callable[[], object], device: torch.device, repeat: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def prefill_layer_s(n: int, device: torch.device, repeat: int) -> float:
    """Seconds of one Llama-3-8B-shaped decoder layer's prefill over ``n`` tokens (bf16)."""
    dt = torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)

    def w(o: int, i: int) -> torch.Tensor:
        return (torch.randn(o, i, generator=g) * i ** -0.5).to(device, dt)

    wqkv, wo = w((HQ + 2 * HKV) * D, HIDDEN), w(HIDDEN, HQ * D)
    wgu, wd = w(2 * MLP, HIDDEN), w(HIDDEN, MLP)
    x = torch.randn(n, HIDDEN, generator=g).to(device, dt)

    def layer() -> torch.Tensor:
        qkv = F.linear(x, wqkv)
        q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=1)
        q = q.view(n, HQ, D).transpose(0, 1)
        k = k.view(n, HKV, D).transpose(0, 1)
        v = v.view(n, HKV, D).transpose(0, 1)
        a = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True,
                                           enable_gqa=True)[0]
        h = x + F.linear(a.transpose(0, 1).reshape(n, HQ * D), wo)
        gate, up = F.linear(h, wgu).chunk(2, dim=1)
        return h + F.linear(F.silu(gate) * up, wd)

    return _timed(layer, device, repeat)[0]


IMPLS = {"before": "torch", "after": "torch", "after_tol": "torch", "fused": "auto",
         "fused_tol": "auto"}
"""Implementation -> kernel backend it clusters with (see the module docstring)."""


def build_s(keys: torch.Tensor, values: torch.Tensor, impl: str, tol: float, iters: int,
            device: torch.device, repeat: int) -> tuple[float, int]:
    """(seconds, k-means rounds run) of clustering one layer's keys with ``impl``."""
    saved = kernels.kmeans_assign_torch, kernels.scatter_sum_torch
    if impl == "before":  # the reference implementation, every round
        kernels.kmeans_assign_torch, kernels.scatter_sum_torch = (km.kmeans_assign_ref,
                                                                   km.scatter_sum_ref)
        tol = -1.0
    backend = IMPLS[impl] if device.type == "cpu" else "auto"
    try:
        s, cl = _timed(lambda: cluster_block(keys, values, 8192, None, 16, iters, backend, tol),
                       device, repeat)
    finally:
        kernels.kmeans_assign_torch, kernels.scatter_sum_torch = saved
    return s, cl.iterations


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--tol", type=float, default=0.01)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--layer-max", type=int, default=None,
                    help="time the prefill layer only up to this context (the layer's causal "
                    "attention takes tens of minutes per repeat at 64K+ on a few CPU cores); "
                    "longer rows report build times without a share")
    ap.add_argument("--impls", nargs="+", choices=list(IMPLS), default=list(IMPLS),
                    help="implementations to time (default all; ratios need 'before')")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = []
    for n in args.contexts:
        keys, values, _ = synthetic_kv(1, n, torch.bfloat16, seed=n)
        keys, values = keys[0].to(device), values[0].to(device)
        timed = args.layer_max is None or n <= args.layer_max
        layer = prefill_layer_s(n, device, args.repeat) if timed else None
        row = {"context": n, "prefill_layer_s": layer}
        for impl in args.impls:
            tol = args.tol if impl.endswith("_tol") else 0.0
            s, rounds = build_s(keys, values, impl, tol, args.iters, device, args.repeat)
            row[f"{impl}_s"], row[f"{impl}_rounds"] = s, rounds
            row[f"{impl}_share_of_layer"] = s / layer if layer else None
        before = row.get("before_s")
        for name, impl in (("exact", "after"), ("tol", "after_tol"), ("fused", "fused"),
                           ("fused_tol", "fused_tol")):
            if before and f"{impl}_s" in row:
                row[f"speedup_{name}"] = before / row[f"{impl}_s"]
        rows.append(row)
        print(f"ctx {n:>6}: layer " + (f"{layer:.3f} s" if layer else "not timed"), flush=True)
        for impl in args.impls:
            share = row[f"{impl}_share_of_layer"]
            print(f"    {impl:>9}: {row[f'{impl}_s'] * 1e3:9.2f} ms, "
                  f"{row[f'{impl}_rounds']:2d} rounds"
                  + (f", {before / row[f'{impl}_s']:5.2f}x the reference" if before else "")
                  + (f", {share:6.1%} of the layer" if share is not None else ""), flush=True)
    out = args.out or ROOT / "bench" / "results" / f"kmeans_cost_{device.type}.json"
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda"
            else platform.processor() or platform.machine(),
            "threads": args.threads, "iters": args.iters, "tol": args.tol,
            "fused_assignment": "triton" if device.type == "cuda" else
            "C++ extension" if km.available_cpu() else "torch (extension unavailable)",
            "shape": {"kv_heads": HKV, "head_dim": D, "dtype": "bfloat16", "segment": 8192,
                      "tokens_per_cluster": 16}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "cases": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
