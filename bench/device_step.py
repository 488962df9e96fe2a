"""One decode step of a layer with its KV resident on the device: dense vs the device step.

The regime where a request's KV fits the device (DESIGN.md: offload only under memory
pressure). A Llama-3-8B-shaped layer (32 query heads, 8 KV heads, head_dim 128, bf16 on
CUDA), one wave index per context length built once on the device from synthetic clustered
KV and loaded into every slot of a :class:`~vllm_retro.index.device_layer.DeviceLayer`
(each row decodes its own query). Per step, interleaved, timed with CUDA events and the
query already on the device:

- **dense**: the fastest of SDPA with ``enable_gqa`` (FlashAttention on CUDA, else the first
  backend that runs; a 1-query non-causal decode over every row's materialised KV), on CUDA
  the same SDPA replayed from a CUDA graph (as the step's graph is: no host launch time in
  the window) and our split-KV flash-decoding kernel
  (:mod:`vllm_retro.kernels.flash_decode`), each recorded;
- **eager**: :func:`~vllm_retro.index.device_layer.decode_step`;
- **graph**: the same step replayed from a CUDA graph
  (:class:`~vllm_retro.index.device_graph.StepGraphs`);
- **served**: what a served layer pays per step: the host's refresh and plan
  (:meth:`~vllm_retro.index.device_layer.DeviceLayer.plan`, its integers copied straight into
  the graph's input on CUDA), then the replay (``graph`` times the replay of a plan made
  once);
- per ``--placements``: ``copy``, the index's tokens copied into the layer (KV on the
  device), ``in_place``, only its meta index on the device and the retrieval zone read
  where the wave buffer's host tier keeps it (pinned host memory, over the bus: the regime
  where the KV does not fit the device; the index is built over a wave buffer store then),
  and ``in_place_cache``, the same through the layer's cluster cache on the device (the
  only device cache of clusters, LRU; sized as serving sizes it: ``cache_fraction`` of the
  tokens in blocks of 1.25 average clusters), with its token hit ratio over the timed steps;
- **rank** and **attend**: the eager step's two parts alone
  (:func:`~vllm_retro.index.device_layer.rank_clusters`: cluster scoring and top-k;
  :func:`~vllm_retro.index.device_layer.attend`), where its time goes.

Checks recorded in the JSON (CUDA): ``torch.cuda.set_sync_debug_mode("error")`` passes over
an eager step; graph replay equals eager (max abs difference); the step's relative error
against the per-row reference :meth:`WaveIndex.decode` (row 0) and against dense. Off
CUDA the same code runs on the CPU against torch's SDPA (a smoke run: the CPU's serving
path is the fused kernel, ``bench/decode_step.py``).

    python bench/device_step.py --out DIR/device_step.json          # 32K, 128K x batch 1, 8
    python bench/device_step.py --placements copy in_place in_place_cache --out DIR/x.json
    python bench/device_step.py --contexts 4096 --batches 1 2 --heads 8 2 64   # small, CPU
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.decode_step import QueryWalk, synthetic_kv  # noqa: E402
from bench.gpu.stacks import sdpa_context  # noqa: E402
from vllm_retro.buffer import WaveBufferManager  # noqa: E402
from vllm_retro.config import RetroConfig  # noqa: E402
from vllm_retro.index import WaveIndex  # noqa: E402
from vllm_retro.index.device_graph import StepGraphs  # noqa: E402
from vllm_retro.index.device_layer import (  # noqa: E402
    DeviceLayer,
    attend,
    cache_block_size,
    cache_blocks_for,
    decode_step,
    rank_clusters,
)
from vllm_retro.index.meta_pool import MetaPool  # noqa: E402
from vllm_retro.index.pages import QuestIndex  # noqa: E402
from vllm_retro.index.resident import layer_kind  # noqa: E402
from vllm_retro.kernels.flash_decode import flash_decode_triton  # noqa: E402
from vllm_retro.kernels.sync_check import SyncCheck  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None)
    ap.add_argument("--contexts", type=int, nargs="+", default=None,
                    help="default 32768 131072 (CPU: 8192)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--heads", type=int, nargs=3, default=[32, 8, 128],
                    metavar=("HQ", "HKV", "D"))
    ap.add_argument("--steps", type=int, default=None, help="timed steps (50; CPU 5)")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                    help="default bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--kmeans-iters", type=int, default=None,
                    help="k-means rounds of the index build (default: the config's)")
    ap.add_argument("--placements", nargs="+", choices=("copy", "in_place", "in_place_cache"),
                    default=["copy"],
                    help="the layer's tokens copied to the device, read in place from the "
                         "host tier, or both (default: copy)")
    ap.add_argument("--policy", choices=("wave", "quest"), default="wave",
                    help="the index: the wave index, or Quest's pages scored on the device "
                         "by their bounds (its --placements alike)")
    ap.add_argument("--kernels", action="store_true",
                    help="CUDA: also each kernel's device time in the step (torch.profiler), "
                         "the zone selection against its alternatives on the step's own scores "
                         "and the attention launch by each retrieval map")
    ap.add_argument("--out", type=pathlib.Path, default=None)
    return ap.parse_args(argv)


def kernel_times(fn, calls: int = 20) -> dict[str, float]:
    """Each CUDA kernel ``fn`` launches, by name: its mean device time per call of ``fn``
    in microseconds (torch.profiler over ``calls`` calls, CUPTI's kernel records; copies and
    memsets included under their names), largest first. ``{"error": ...}`` when the profiler
    cannot run."""
    from torch.profiler import ProfilerActivity, profile

    try:
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        times = {e.key: e.self_device_time_total / calls for e in prof.key_averages()
                 if e.self_device_time_total > 0}
    except Exception as exc:  # noqa: BLE001 - recorded: the timings above still stand
        return {"error": repr(exc)}
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def topk_variants(layer: DeviceLayer, plan, rows: torch.Tensor, scale: float
                  ) -> dict[str, float]:
    """The step's zone selection and its alternatives on the step's own scores, each one's
    summed kernel time (microseconds per call): :func:`~vllm_retro.kernels.select_zones`
    (the step's), ``torch.topk`` sorted (the step's until 2026-11-28) and unsorted,
    :func:`~vllm_retro.kernels.scoring.top_clusters` (one topk over int64 keys: the tie-break
    by id in torch ops) and a stable sort."""
    from vllm_retro import kernels

    pools = layer.pools(plan.steady)
    scores = kernels.pool_scores(rows, pools.centroids, pools.sizes, plan.ints, plan.clusters,
                                 scale, backend=layer.config.kernel_backend)
    k = min(plan.retrieval + plan.estimation, plan.clusters)
    variants = {"select_zones": lambda: kernels.select_zones(
                    scores, plan.ints, plan.retrieval, plan.estimation,
                    backend=layer.config.kernel_backend),
                "topk_sorted": lambda: torch.topk(scores, k, dim=1, sorted=True),
                "topk_unsorted": lambda: torch.topk(scores, k, dim=1, sorted=False),
                "top_clusters": lambda: kernels.top_clusters(scores, k),
                "sort_stable": lambda: torch.sort(scores, dim=1, descending=True, stable=True)}
    out: dict[str, float] = {"k": k, "columns": plan.clusters}
    for name, fn in variants.items():
        times = kernel_times(fn)
        out[name] = times.get("error") or round(sum(times.values()), 2)
    return out


def attention_variants(layer: DeviceLayer, plan, rows: torch.Tensor, top: torch.Tensor,
                       scale: float) -> dict[str, float]:
    """The step's attention launch by each way of finding a retrieval token's cluster
    (:data:`~vllm_retro.kernels.resident_attention.RETRIEVAL_MAPS`): summed kernel time
    (microseconds per call), and the largest difference of its output from the default's."""
    from vllm_retro.kernels.resident_attention import (
        RETRIEVAL_MAP,
        RETRIEVAL_MAPS,
        resident_attention_triton,
    )

    runs, saved = None, {}
    pools = layer.pools(plan.steady)
    if layer.cache is not None:
        from vllm_retro import kernels

        runs = kernels.cache_lookup(layer.cache, pools.sizes, plan.ints, top, plan.retrieval,
                                    backend=layer.config.kernel_backend)
        # a call writes the step's admissions into the cache: each starts from this state
        saved = {k: v.clone() for k, v in vars(layer.cache).items()
                 if isinstance(v, torch.Tensor)}

    def call(how: str) -> torch.Tensor:
        for k, v in saved.items():
            getattr(layer.cache, k).copy_(v)
        return resident_attention_triton(
            rows, pools, plan.ints, top,
            plan.steady_tokens + plan.retrieval_tokens, plan.retrieval, plan.estimation,
            scale, tilted=layer.config.tilted_estimation, cache=layer.cache, runs=runs,
            retrieval_map=how)

    base = call(RETRIEVAL_MAP).float()
    out: dict[str, float] = {"default": RETRIEVAL_MAP}
    for how in RETRIEVAL_MAPS:
        times = kernel_times(lambda how=how: call(how))
        out[how] = times.get("error") or round(sum(times.values()), 2)
        out[f"{how}_max_abs"] = float((call(how).float() - base).abs().max())
    return out


class Timer:
    """Times calls with CUDA events on CUDA (the host's clock elsewhere); milliseconds."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: list[tuple[str, object, object]] = []
        self.times: dict[str, list[float]] = {}

    def __call__(self, name: str, fn):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            self.pending.append((name, start, end))
        else:
            t0 = time.perf_counter()
            out = fn()
            self.times.setdefault(name, []).append((time.perf_counter() - t0) * 1e3)
        return out

    def medians(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
            for name, start, end in self.pending:
                self.times.setdefault(name, []).append(start.elapsed_time(end))
            self.pending.clear()
        return {k: statistics.median(v) for k, v in self.times.items()}


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return float(((out - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).mean())


def bench_context(n: int, batches: list[int], args, device: torch.device, dtype: torch.dtype,
                  cfg: RetroConfig, sdpa) -> list[dict]:
    """Every batch size at context ``n``: one index built on the device, loaded per slot."""
    hq, hkv, d = args.heads
    keys, values, centers = synthetic_kv(1, n, dtype, seed=n, hkv=hkv, d=d)
    # read in place, the tokens must be in a wave buffer's host tier (pinned on CUDA)
    manager = WaveBufferManager(cfg) if any(p.startswith("in_place")
                                            for p in args.placements) else None
    store = manager.store("r0", hkv, d, dtype, device, layer="L0") if manager else None
    t0 = time.perf_counter()
    policy = QuestIndex if args.policy == "quest" else WaveIndex
    index = policy.build(keys[0].to(device), values[0].to(device), cfg, store=store)
    index.adopt_meta(MetaPool(*index.meta_pool_layout()))  # a layer's meta pool, as served
    if store is not None:
        store.cluster_rows()  # the buffer's worker has laid the tokens out
    if device.type == "cuda":
        torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    kv = (keys.to(device), values.to(device))
    del keys, values
    cases = [{"context": n, "batch": b, "placement": where, "policy": args.policy,
              "clusters": index.num_clusters,
              "index_build_s": build_s,
              **bench_case(index, kv, centers, b, args, device, dtype, cfg, sdpa, where)}
             for b in batches for where in args.placements]
    index.free()
    if manager is not None:
        manager.close()
    return cases


def graphed(fn, example: torch.Tensor):
    """``fn`` (one tensor in, one out) captured in a CUDA graph over a static copy of
    ``example``: the returned call copies its argument in and replays, as
    :class:`~vllm_retro.index.device_graph.StepGraphs` does for the step. Dense timed eagerly
    includes the host's launch time wherever it exceeds the kernel's (batch 1: an H200 ran
    SDPA at 32K x 1 in 0.064 ms from a loop, the eager timing here read 0.13-0.2 ms on an
    H100), so the graph's time is the fair baseline for the step's graph."""
    static = example.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = fn(static)

    def call(x: torch.Tensor) -> torch.Tensor:
        static.copy_(x)
        graph.replay()
        return out

    return call


def bench_case(index: WaveIndex, kv: tuple[torch.Tensor, torch.Tensor], centers: torch.Tensor,
               b: int, args, device: torch.device, dtype: torch.dtype, cfg: RetroConfig,
               sdpa, where: str = "copy") -> dict:
    """One batch size: ``index`` in each of ``b`` slots (its tokens copied to the layer, or
    read in place, through a cluster cache or not: ``where``), dense over ``b`` copies of
    ``kv``."""
    hq, hkv, d = args.heads
    n, scale = kv[0].shape[2], d ** -0.5
    in_place = where.startswith("in_place")
    block = cache_block_size(cfg.cluster_size)
    blocks = cache_blocks_for(cfg, n, block) if where == "in_place_cache" else 0
    score_dim, tilted = layer_kind(index)
    layer = DeviceLayer(cfg, hkv, d, dtype, device, slots=b, max_clusters=index.num_clusters,
                        max_tokens=0 if in_place else n, rank=index.residuals.rank,
                        meta=index.meta_place()[0], in_place=in_place, cache_blocks=blocks,
                        cache_block_tokens=block, score_dim=score_dim, tilted=tilted,
                        scoring_field=index.scoring_field)
    slots, rows = list(range(b)), [index] * b
    layer.refresh(slots, rows)
    plan = layer.plan(slots, rows)
    graphs = StepGraphs(layer)
    dk, dv = (t.expand(b, -1, -1, -1).contiguous() for t in kv)
    walk = QueryWalk(b, centers, seed=b, hq=hq)

    def dense(q):
        with sdpa():
            return F.scaled_dot_product_attention(q[:, :, None], dk, dv, scale=scale,
                                                  enable_gqa=True)[:, :, 0]

    # the second dense baseline: our split-KV flash-decoding kernel (CUDA only: on the CPU
    # Triton runs in its interpreter)
    ours = (lambda q: flash_decode_triton(q, dk, dv, scale)) if device.type == "cuda" else None

    q = walk.step().to(device, dtype)
    checks: dict = {}
    with SyncCheck() as check:  # the op sequence (host-side dispatch: counts only)
        decode_step(layer, plan, q, scale)
    checks["torch_ops"] = check.launches
    checks["fused_cpu"] = layer.fused  # one extension call (no torch op) on the CPU
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode("error")
        try:
            decode_step(layer, plan, q, scale)
            checks["sync_debug_error_mode"] = "passed"
        except RuntimeError as exc:
            checks["sync_debug_error_mode"] = f"failed: {exc}"
        finally:
            torch.cuda.set_sync_debug_mode(0)
    eager = decode_step(layer, plan, q, scale)
    replay = graphs(plan, q, scale).clone()
    checks["graph_vs_eager_max_abs"] = float((replay.float() - eager.float()).abs().max())
    checks["graph_captures"] = graphs.captures
    # correctness: the per-row reference (WaveIndex.decode) on row 0; the error against
    # dense is the approximation's on this synthetic data, whose random values make a
    # diffuse attention's output small (large relative errors mean nothing there)
    checks["rel_err_vs_reference"] = _rel(replay[0], index.decode(q[0], scale).output)
    ref = dense(q)
    checks["rel_err_vs_dense_synthetic"] = _rel(replay, ref)
    if ours is not None:
        checks["dense_triton_vs_sdpa_rel"] = _rel(ours(q), ref)
    dense_graph = graphed(dense, q) if device.type == "cuda" else None
    if dense_graph is not None:
        checks["dense_graph_vs_eager_max_abs"] = float(
            (dense_graph(q).float() - ref.float()).abs().max())
    batch = list(rows)  # (the loop below reuses the name ``rows``)

    def served_plan():
        layer.refresh(slots, batch)
        return layer.plan(slots, batch, upload=device.type != "cuda")

    timer = Timer(device)
    before = layer.cache_tokens()
    for _ in range(3):  # warm-up
        dense(q), decode_step(layer, plan, q, scale), graphs(plan, q, scale)
        if ours is not None:
            ours(q)
    for _ in range(args.steps or (50 if device.type == "cuda" else 5)):
        q = walk.step().to(device, dtype)
        timer("dense_sdpa", lambda q=q: dense(q))
        if dense_graph is not None:
            timer("dense_sdpa_graph", lambda q=q: dense_graph(q))
        if ours is not None:
            timer("dense_triton", lambda q=q: ours(q))
        timer("eager", lambda q=q: decode_step(layer, plan, q, scale))
        timer("graph", lambda q=q: graphs(plan, q, scale))
        # what serving pays per step: the host's refresh and plan, then the replay
        timer("served", lambda q=q: graphs(served_plan(), q, scale))
        # where the eager step's time goes: its two parts alone
        rows = q.reshape(b * hkv, -1, d)
        top = timer("rank", lambda rows=rows: rank_clusters(layer, plan, rows, scale))
        timer("attend", lambda rows=rows, top=top: attend(layer, plan, rows, top, scale))
    if args.kernels:  # off CUDA: no device times (recorded as errors), the outputs compared
        rows = q.reshape(b * hkv, -1, d)
        checks["kernels_us"] = kernel_times(lambda: decode_step(layer, plan, q, scale))
        checks["topk_us"] = topk_variants(layer, plan, rows, scale)
        checks["attention_us"] = attention_variants(
            layer, plan, rows, rank_clusters(layer, plan, rows, scale), scale)
        print("    kernels (us): " + ", ".join(
            f"{k[:48]} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
            for k, v in checks["kernels_us"].items()), flush=True)
        print(f"    top-k (us): {checks['topk_us']}", flush=True)
        print(f"    attention (us): {checks['attention_us']}", flush=True)
    cached, read = (a - b for a, b in zip(layer.cache_tokens(), before, strict=True))
    checks["cache_blocks"] = blocks
    checks["cache_hit_ratio"] = cached / (cached + read) if blocks and cached + read else None
    ms = timer.medians()
    ms["dense"] = min(ms["dense_sdpa"], ms.get("dense_triton", float("inf")),
                      ms.get("dense_sdpa_graph", float("inf")))
    case = {
        "dense_ms": ms["dense"], "dense_sdpa_ms": ms["dense_sdpa"],
        "dense_sdpa_graph_ms": ms.get("dense_sdpa_graph"),
        "dense_triton_ms": ms.get("dense_triton"), "eager_ms": ms["eager"],
        "graph_ms": ms["graph"], "served_ms": ms["served"], "rank_ms": ms["rank"],
        "attend_ms": ms["attend"], "speedup_eager": ms["dense"] / ms["eager"],
        "speedup_graph": ms["dense"] / ms["graph"], "speedup_served": ms["dense"] / ms["served"],
        "dense_GBps": 2 * dk.numel() * dk.element_size() / ms["dense"] / 1e6,
        "widths": {"clusters": plan.clusters, "retrieval": plan.retrieval,
                   "estimation": plan.estimation, "retrieval_tokens": plan.retrieval_tokens,
                   "steady_tokens": plan.steady_tokens},
        "layer_bytes": layer.nbytes(), **checks,
    }
    graph_note = (f", sdpa graph {ms['dense_sdpa_graph']:.3f}" if "dense_sdpa_graph" in ms
                  else "")
    hits = f"  hits {checks['cache_hit_ratio']:.2f}" if blocks else ""
    print(f"{n:>7} x {b:<3} {where:<14} dense {ms['dense']:.3f} ms "
          f"(sdpa {ms['dense_sdpa']:.3f}"
          f"{graph_note})  "
          f"eager {ms['eager']:.3f} ms "
          f"({case['speedup_eager']:.2f}x)  graph {ms['graph']:.3f} ms "
          f"({case['speedup_graph']:.2f}x)  served {ms['served']:.3f} ms "
          f"({case['speedup_served']:.2f}x)  [rank {ms['rank']:.3f} + attend "
          f"{ms['attend']:.3f} ms]  graph-eager {checks['graph_vs_eager_max_abs']:.2g}"
          f"  vs reference {checks['rel_err_vs_reference']:.2g}  ops {checks['torch_ops']}"
          f"{hits}",
          flush=True)
    return case


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    cfg = RetroConfig() if args.kmeans_iters is None else RetroConfig(
        kmeans_iters=args.kmeans_iters)
    sdpa, sdpa_name = sdpa_context(device, dtype, args.heads[2])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (
        platform.processor() or platform.machine())
    contexts = args.contexts or ([32768, 131072] if device.type == "cuda" else [8192])
    print(f"device step on {name}: heads {args.heads}, {dtype}, dense = {sdpa_name}",
          flush=True)
    result = {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda,
              "dtype": str(dtype).removeprefix("torch."), "heads": args.heads,
              "dense_kernel": sdpa_name, "config": cfg.to_dict(), "cases": []}
    out = args.out or ROOT / "bench" / "results" / f"device_step_{device.type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    for n in contexts:
        result["cases"] += bench_context(n, args.batches, args, device, dtype, cfg, sdpa)
        out.write_text(json.dumps(result, indent=2))  # partial results survive a kill
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
