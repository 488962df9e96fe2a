"""``python -m bench.gpu``: dense vs retro decode over a Llama-3-8B-shaped attention stack.

    .venv/bin/python -m bench.gpu                       # reduced on CPU, full size on CUDA
    .venv/bin/python -m bench.gpu --device cuda --contexts 32768 --batches 1 4

Prints a table and writes JSON (default ``bench/results/gpu_<device>[_reduced].json``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
from dataclasses import replace

import torch

from bench.gpu.runner import CaseOptions, run_case
from bench.gpu.shapes import FULL, REDUCED, GiB, host_ram_bytes
from bench.gpu.stacks import sdpa_context
from vllm_retro.config import RetroConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (``argv`` None: ``sys.argv``)."""
    ap = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None,
                    help="default: cuda if available, else cpu")
    ap.add_argument("--reduced", action=argparse.BooleanOptionalAction, default=None,
                    help="small stack (2 layers, 8/4 heads, head_dim 64, 4K context); "
                         "default on CPU")
    ap.add_argument("--contexts", type=int, nargs="+", default=None,
                    help="context lengths (tokens); default 32768 65536 131072 "
                         "(reduced: 4096)")
    ap.add_argument("--batches", type=int, nargs="+", default=None,
                    help="batch sizes; default 1 4 16 64 (reduced: 1 2)")
    ap.add_argument("--layers", type=int, default=None, help="layers (default: the shape's)")
    ap.add_argument("--steps", type=int, default=None, help="measured steps (20; reduced 4)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps (3; reduced 1)")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                    help="KV dtype (default bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--retrieval-budget", type=float, default=None)
    ap.add_argument("--estimation-budget", type=float, default=None)
    ap.add_argument("--kmeans-iters", type=int, default=None)
    ap.add_argument("--host-limit-gib", type=float, default=100.0,
                    help="skip cases whose host memory estimate exceeds this (GiB)")
    ap.add_argument("--prefill-reps", type=int, default=None, help="(3; reduced 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=pathlib.Path, default=None)
    return ap.parse_args(argv)


def _table(cases: list[dict]) -> str:
    """A fixed-width table of the cases (skipped ones on one line each)."""
    head = (f"{'ctx':>7} {'B':>3} {'dense ms':>9} {'retro ms':>9} {'speedup':>7} "
            f"{'dense tok/s':>11} {'retro tok/s':>11} {'H2D MB/st':>9} "
            f"{'build ms/L':>10} {'prefill ms/L':>12} {'peak GiB d/r':>13} {'rel err':>8}")
    lines = [head, "-" * len(head)]
    for c in cases:
        if "skipped" in c:
            lines.append(f"{c['context']:>7} {c['batch']:>3}  skipped: {c['skipped']}")
            continue
        peak = "-"
        if c["dense_peak_device_bytes"] is not None:
            peak = (f"{c['dense_peak_device_bytes'] / GiB:.1f}/"
                    f"{c['retro_peak_device_bytes'] / GiB:.1f}")
        lines.append(
            f"{c['context']:>7} {c['batch']:>3} {c['dense_step_ms']:>9.2f} "
            f"{c['retro_step_ms']:>9.2f} {c['speedup']:>6.2f}x {c['dense_tokens_per_s']:>11.1f} "
            f"{c['retro_tokens_per_s']:>11.1f} {c['h2d_bytes_per_step'] / 1e6:>9.2f} "
            f"{c['index_build_ms_per_layer']:>10.1f} "
            f"{c['prefill_attention_ms_per_layer']:>12.1f} {peak:>13} {c['rel_err_mean']:>8.4f}")
    return "\n".join(lines)


def run(argv: list[str] | None = None) -> dict:
    """Run the benchmark as the command line says; returns (and writes) the JSON result."""
    args = parse_args(argv)
    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available")
    device = torch.device(device_type)
    reduced = device_type == "cpu" if args.reduced is None else args.reduced
    shape = REDUCED if reduced else FULL
    if args.layers is not None:
        shape = replace(shape, layers=args.layers)
    dtype = DTYPES[args.dtype or ("bfloat16" if device_type == "cuda" else "float32")]
    overrides = {k: v for k, v in (("retrieval_budget", args.retrieval_budget),
                                   ("estimation_budget", args.estimation_budget),
                                   ("kmeans_iters", args.kmeans_iters)) if v is not None}
    if overrides.get("retrieval_budget", 0) >= 1.0 and "estimation_budget" not in overrides:
        overrides["estimation_budget"] = 0.0
    cfg = RetroConfig(**overrides)
    sdpa, sdpa_name = sdpa_context(device, dtype, shape.head_dim)
    host_limit = int(args.host_limit_gib * GiB)
    if device_type == "cpu":
        host_limit = min(host_limit, int(0.7 * host_ram_bytes()))
    opts = CaseOptions(
        shape=shape, dtype=dtype, device=device, cfg=cfg,
        steps=args.steps or (4 if reduced else 20),
        warmup=args.warmup if args.warmup is not None else (1 if reduced else 3),
        prefill_reps=args.prefill_reps or (1 if reduced else 3),
        host_limit=host_limit, seed=args.seed, sdpa=sdpa, sdpa_name=sdpa_name)
    contexts = args.contexts or ([4096] if reduced else [32768, 65536, 131072])
    batches = args.batches or ([1, 2] if reduced else [1, 4, 16, 64])
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    name = (torch.cuda.get_device_name(device) if device_type == "cuda"
            else platform.processor() or platform.machine())
    print(f"bench.gpu on {name}: {shape}, {str(dtype).removeprefix('torch.')}, "
          f"dense = {sdpa_name}", flush=True)
    cases: list[dict] = []
    result = {
        "device": name, "device_type": device_type, "torch": torch.__version__,
        "triton": triton_version, "cuda": torch.version.cuda,
        "threads": torch.get_num_threads(), "reduced": reduced, "shape": shape.to_dict(),
        "dtype": str(dtype).removeprefix("torch."), "dense_kernel": sdpa_name,
        "kernel_backend": cfg.kernel_backend, "config": cfg.to_dict(), "steps": opts.steps,
        "warmup": opts.warmup, "host_limit_bytes": host_limit, "cases": cases,
    }
    out = args.out or (ROOT / "bench" / "results"
                       / f"gpu_{device_type}{'_reduced' if reduced else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    for n in contexts:
        for b in batches:
            cases.append(run_case(n, b, opts))
            out.write_text(json.dumps(result, indent=2))  # partial results survive a kill
    print(_table(cases))
    print(f"wrote {out}")
    return result


def main() -> None:
    """Entry point of ``python -m bench.gpu``."""
    run()
