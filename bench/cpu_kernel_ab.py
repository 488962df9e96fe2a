"""The fused CPU decode kernel of this tree against the same kernel at another git revision,
and both against vLLM's CPU paged attention, on the same indexes and queries in one process.

Each case (context, batch) builds the wave indexes of a Llama-3-8B-shaped layer (32 query /
8 KV heads, head_dim 128, bf16, synthetic clustered keys as in ``bench/decode_step.py``;
``--kv-heads/--group/--head-dim`` give another shape, e.g. ``2 7 64`` for the Qwen2.5-0.5B
layer of ``bench/e2e_throughput.py``) once; then every step runs vLLM's kernel, the
revision's kernel and this tree's kernel on the step's query, in turn (the two retro kernels
in alternating order), each after a sweep of 64 MB through the caches (so each reads its
bytes cold, as in a model's step, where the other layers' weights and KV have passed through
the caches since). Outputs are compared (the maximum absolute difference between the two
retro kernels is printed: 0 where the arithmetic is the same). Printed and written to
``--out``: median ms per step, the speed-up of each kernel over vLLM's, the tree's over the
revision's, each kernel's own phase split (scoring, selection, lookup, exact attention,
estimation), and each kernel's share of its bytes-moved bound (bytes read per step over the
read bandwidth measured in the same run, as ``bench/decode_step.py`` counts them).

    .venv/bin/python bench/cpu_kernel_ab.py --rev be6b486 --contexts 8192 32768 --batches 1 8
    .venv/bin/python bench/cpu_kernel_ab.py --rev be6b486 --contexts 16384 --batches 8 \
        --kv-heads 2 --group 7 --head-dim 64 --out /tmp/ab_qwen.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.decode_step import (  # noqa: E402
    QueryWalk,
    fits,
    full_attention_kernel,
    read_bandwidth,
    retro_bytes,
    synthetic_kv,
)
from bench.machine import cpu_description  # noqa: E402
from vllm_retro.buffer import WaveBufferManager  # noqa: E402
from vllm_retro.config import RetroConfig  # noqa: E402
from vllm_retro.index import WaveIndex  # noqa: E402
from vllm_retro.index.batched import packed_row  # noqa: E402
from vllm_retro.kernels import (
    cpu_decode,  # noqa: E402
    cpu_ext,  # noqa: E402
)

ROOT = pathlib.Path(__file__).resolve().parents[1]


def build_revision(rev: str) -> object:
    """The CPU extension compiled from the kernel sources at git revision ``rev``."""
    from torch.utils import cpp_extension

    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.strip()
    src = pathlib.Path(tempfile.mkdtemp(prefix=f"retro-kernel-{sha}-"))
    paths = []
    for p in cpu_ext._SOURCES:
        rel = p.relative_to(ROOT)
        text = subprocess.run(["git", "show", f"{sha}:{rel}"], cwd=ROOT, check=True,
                              capture_output=True).stdout
        (src / p.name).write_bytes(text)
        paths.append(str(src / p.name))
    flags = list(cpu_ext._flags())
    key = hashlib.sha256(b"".join(pathlib.Path(p).read_bytes() for p in paths)
                         + " ".join(flags).encode()).hexdigest()[:12]
    build = pathlib.Path(tempfile.gettempdir()) / f"retro-kernel-build-{key}"
    build.mkdir(exist_ok=True)
    return cpp_extension.load(name=f"retro_cpu_rev_{key}", sources=paths, extra_cflags=flags,
                              extra_ldflags=["-fopenmp"], build_directory=str(build))


def run_case(n: int, batch: int, kernels: dict[str, object], args: argparse.Namespace) -> dict:
    """Time vLLM's kernel and each retro kernel on one (context, batch)."""
    hkv, d, hq = args.kv_heads, args.head_dim, args.kv_heads * args.group
    scale = d ** -0.5
    keys, values, centers = synthetic_kv(batch, n, torch.bfloat16, seed=n + batch, hkv=hkv, d=d)
    full, full_name, full_bytes = full_attention_kernel(keys, values, torch.device("cpu"), hq=hq)
    cfg = RetroConfig(kmeans_iters=args.kmeans_iters)
    mgr = WaveBufferManager(cfg)
    indexes = [WaveIndex.build(keys[b], values[b], cfg,
                               store=mgr.store(f"req{b}", hkv, d, torch.bfloat16,
                                               torch.device("cpu"), layer="L0"))
               for b in range(batch)]
    del keys, values
    tilted = cfg.tilted_estimation
    walk = QueryWalk(batch, centers, seed=n, hq=hq)
    sweep = torch.empty(64 << 20, dtype=torch.uint8)
    times: dict[str, list[float]] = {"vllm": [], **{k: [] for k in kernels}}
    outs: dict[str, torch.Tensor] = {}

    def retro(name: str, q: torch.Tensor, phases: dict | None = None) -> torch.Tensor:
        cpu_ext._module = kernels[name]
        packed = [packed_row(i, tilted) for i in indexes]
        windows = [(i.ring_start, i.win_len) for i in indexes]
        return cpu_decode.decode_packed(q, packed, scale, tilted, windows=windows,
                                        phases=phases)

    try:
        for step in range(args.warmup + args.steps):
            q = walk.step().to(torch.bfloat16)
            # vLLM first, then the two retro kernels in alternating order: the one that runs
            # second reads what the first left in the caches for the same query (an A/A run
            # with a fixed order measured the second 1.14x faster)
            order = list(times) if step % 2 == 0 else ["vllm", *reversed(list(kernels))]
            for name in order:
                sweep.add_(1)
                t0 = time.perf_counter()
                out = full(q) if name == "vllm" else retro(name, q)
                dt = time.perf_counter() - t0
                if step >= args.warmup:
                    times[name].append(dt)
                if name != "vllm":
                    outs[name] = out[0] if isinstance(out, tuple) else out
        phases: dict[str, dict[str, float]] = {}
        for name in kernels:
            split: dict[str, float] = {}
            for _ in range(args.phase_steps):
                q = walk.step().to(torch.bfloat16)
                sweep.add_(1)
                retro(name, q, phases=split)
            phases[name] = {k.replace("kernel ", ""): v / args.phase_steps * 1e3
                            for k, v in split.items()}
    finally:
        cpu_ext._module = None
        cpu_ext.load()
    step_bytes = []  # what a step reads, from the per-row path's exact-row counts
    for _ in range(3):
        q = walk.step().to(torch.bfloat16)
        step_bytes.append(sum(retro_bytes(idx, idx.decode(q[i], scale).n_exact, 2)
                              for i, idx in enumerate(indexes)))
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    bound_ms = {"vllm": full_bytes / args.read_bw * 1e3,
                "retro": statistics.mean(step_bytes) / args.read_bw * 1e3}
    names = list(kernels)
    diff = (outs[names[0]].float() - outs[names[-1]].float()).abs().max().item()
    return {"context": n, "batch": batch, "full_kernel": full_name, "median_ms": med,
            "speedup_vs_vllm": {k: med["vllm"] / med[k] for k in kernels},
            "tree_speedup_vs_rev": med[names[0]] / med[names[-1]],
            "max_abs_diff": diff, "phase_ms": phases,
            "bytes_per_step": {"vllm": full_bytes, "retro": statistics.mean(step_bytes)},
            "lower_bound_ms": bound_ms,
            "bw_efficiency": {k: bound_ms["vllm" if k == "vllm" else "retro"] / m
                              for k, m in med.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", required=True, help="git revision whose kernel is compared")
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--phase-steps", type=int, default=5)
    ap.add_argument("--kmeans-iters", type=int, default=4,
                    help="k-means iterations at index build (the build is not timed)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=8, help="KV heads of the layer")
    ap.add_argument("--group", type=int, default=4, help="query heads per KV head")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--out", type=pathlib.Path,
                    default=ROOT / "bench" / "results" / "cpu_kernel_ab.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if cpu_ext.load() is None:
        raise SystemExit(f"the fused CPU kernel cannot be built: {cpu_ext.load_error()}")
    # the revision by its commit in the output: a name like HEAD means another commit later
    args.rev = subprocess.run(["git", "rev-parse", "--short", args.rev], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
    kernels = {args.rev: build_revision(args.rev), "tree": cpu_ext.load()}
    args.read_bw = read_bandwidth(torch.device("cpu"))
    print(f"{cpu_description()}; read bandwidth {args.read_bw / 1e9:.1f} GB/s", flush=True)
    rows = []
    for n in args.contexts:
        for b in args.batches:
            ok, why = fits(n, b, torch.device("cpu"), hkv=args.kv_heads, d=args.head_dim)
            if not ok:
                print(f"{n:>7} x {b}: skipped ({why})", flush=True)
                continue
            r = run_case(n, b, kernels, args)
            rows.append(r)
            m, s = r["median_ms"], r["speedup_vs_vllm"]
            print(f"{n:>7} x {b}: vLLM {m['vllm']:.3f} ms | {args.rev} {m[args.rev]:.3f} ms "
                  f"({s[args.rev]:.2f}x) | tree {m['tree']:.3f} ms ({s['tree']:.2f}x) | "
                  f"tree {r['tree_speedup_vs_rev']:.2f}x {args.rev} | max |diff| "
                  f"{r['max_abs_diff']:.3g}", flush=True)
            print("    of its bytes-moved bound: " + "  ".join(
                f"{k} {v:.0%}" for k, v in r["bw_efficiency"].items()), flush=True)
            for k, ph in r["phase_ms"].items():
                print(f"    {k:>8} phases ms: " + "  ".join(f"{p} {v:.2f}" for p, v in ph.items()),
                      flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rev": args.rev, "cpu": cpu_description(),
                                    "threads": args.threads,
                                    "shape": {"kv_heads": args.kv_heads, "group": args.group,
                                              "head_dim": args.head_dim},
                                    "read_bandwidth_GBps": args.read_bw / 1e9,
                                    "steps": args.steps, "cases": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
