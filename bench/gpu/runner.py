"""One (context, batch) case: build both stacks, time decode steps interleaved, count."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from bench.gpu.shapes import StackShape, estimate_bytes, skip_reason
from bench.gpu.stacks import DenseStack, RetroStack
from bench.gpu.synthetic import QueryWalk, SyntheticStack, new_tokens
from vllm_retro.config import RetroConfig


@dataclass(frozen=True)
class CaseOptions:
    """Everything a case needs besides its (context, batch)."""

    shape: StackShape
    dtype: torch.dtype
    device: torch.device
    cfg: RetroConfig
    steps: int
    warmup: int
    prefill_reps: int
    host_limit: int
    seed: int
    sdpa: Callable[[], AbstractContextManager]
    sdpa_name: str


def sync(device: torch.device) -> None:
    """Wait for queued device work (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_since(device: torch.device, fn: Callable[[], torch.Tensor]
                ) -> tuple[torch.Tensor, float, int]:
    """Run ``fn`` timed; returns (output, seconds, peak device bytes above the start, CUDA)."""
    base = 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    dt = time.perf_counter() - t0
    extra = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else 0
    return out, dt, extra


def time_prefill(syn: SyntheticStack, n: int, opts: CaseOptions) -> float:
    """Seconds of one layer's causal prefill attention (SDPA over the whole prompt, batch 1)."""
    s = opts.shape
    k, v = syn.context(0, n)
    q = torch.randn(1, s.q_heads, n, s.head_dim, generator=syn.gen, device=opts.device
                    ).to(opts.dtype)
    run = lambda: F.scaled_dot_product_attention(q, k[None], v[None], is_causal=True,
                                                 enable_gqa=True)
    times = []
    with opts.sdpa():
        if opts.device.type == "cuda":
            run()  # warm-up (kernel selection, workspace)
        for _ in range(opts.prefill_reps):
            times.append(_peak_since(opts.device, run)[1])
    return statistics.median(times)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Relative L2 error per [L, B] of [L, B, H_q, D] outputs (fp32)."""
    ref = ref.float()
    return (out.float() - ref).norm(dim=(-2, -1)) / ref.norm(dim=(-2, -1)).clamp_min(1e-30)


def _stat_delta(before: dict, after: dict, key: str) -> float:
    return after[key] - before[key]


def run_case(n: int, batch: int, opts: CaseOptions) -> dict:
    """Benchmark one (context ``n``, ``batch``) case; a dict of results (or of the skip reason).

    Times are per decode step over the whole stack (every layer, every request), medians
    over the measured steps; bytes per step are means.
    """
    s, dev = opts.shape, opts.device
    elem = torch.empty(0, dtype=opts.dtype).element_size()
    extra = opts.warmup + opts.steps
    est = estimate_bytes(s, elem, n, batch, extra, opts.cfg, pinned=dev.type == "cuda")
    dev_bytes = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else 0
    reason = skip_reason(est, dev.type, dev_bytes, opts.host_limit)
    head = {"context": n, "batch": batch, "estimate_bytes": est}
    if reason:
        print(f"ctx {n:>6} batch {batch:>3}: skipped ({reason})", flush=True)
        return {**head, "skipped": reason}
    try:
        return {**head, **_run(n, batch, opts)}
    except torch.cuda.OutOfMemoryError as exc:
        torch.cuda.empty_cache()
        reason = f"out of memory: {str(exc).splitlines()[0]}"
        print(f"ctx {n:>6} batch {batch:>3}: skipped ({reason})", flush=True)
        return {**head, "skipped": reason}


def _run(n: int, batch: int, opts: CaseOptions) -> dict:
    s, dev = opts.shape, opts.device
    t_case = time.perf_counter()
    syn = SyntheticStack(s.layers, s.q_heads, s.kv_heads, s.head_dim, opts.dtype, dev,
                         opts.seed + 7919 * n + batch)
    dense = DenseStack(s.layers, batch, s.kv_heads, s.head_dim, n + opts.warmup + opts.steps,
                       opts.dtype, dev, opts.sdpa)
    retro = RetroStack(s.layers, batch, opts.cfg, opts.dtype, dev)
    try:
        build_s = []
        for layer in range(s.layers):
            for b in range(batch):
                k, v = syn.context(layer, n)
                dense.k[layer][b, :, :n] = k
                dense.v[layer][b, :, :n] = v
                sync(dev)
                t0 = time.perf_counter()
                retro.build(layer, b, k, v)
                sync(dev)
                build_s.append(time.perf_counter() - t0)
                del k, v
                retro.bound_queue()
        t0 = time.perf_counter()
        retro.drain()
        drain_s = time.perf_counter() - t0
        dense.length = n
        prefill_s = time_prefill(syn, n, opts)
        build_peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
        return {**_decode(n, batch, opts, syn, dense, retro),
                "build_peak_device_bytes": build_peak,
                "index_build_ms_per_layer": 1e3 * statistics.mean(build_s),
                "prefill_attention_ms_per_layer": 1e3 * prefill_s,
                "build_over_prefill": statistics.mean(build_s) / prefill_s,
                "offload_drain_s": drain_s,
                "clusters_per_head": retro.num_clusters(),
                "retro_host_bytes": retro.host_nbytes(),
                "case_wall_s": time.perf_counter() - t_case}
    finally:
        retro.close()
        del dense
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            empty_host = getattr(torch._C, "_host_emptyCache", None)
            if empty_host is not None:
                empty_host()  # give cached pinned blocks back before the next case


def _decode(n: int, batch: int, opts: CaseOptions, syn: SyntheticStack, dense: DenseStack,
            retro: RetroStack) -> dict:
    """The interleaved decode loop (the order of the two methods alternates every step)."""
    s, dev = opts.shape, opts.device
    walk = QueryWalk(syn, batch)
    dense_t, retro_t, errs = [], [], []
    dense_peak = retro_peak = 0
    stats = retro.manager.stats
    before = stats.snapshot()
    for step in range(opts.warmup + opts.steps):
        pos = n + step
        q = walk.step(pos)
        k_new, v_new = new_tokens(syn, batch, pos)
        if step == opts.warmup:
            before = stats.snapshot()
        stacks = {"dense": dense, "retro": retro}
        order = ("dense", "retro") if step % 2 == 0 else ("retro", "dense")
        res = {name: _peak_since(dev, partial(stacks[name].step, q, k_new, v_new))
               for name in order}
        if step < opts.warmup:
            continue
        dense_t.append(res["dense"][1])
        retro_t.append(res["retro"][1])
        dense_peak = max(dense_peak, res["dense"][2])
        retro_peak = max(retro_peak, res["retro"][2])
        errs.append(_rel_err(res["retro"][0], res["dense"][0]))
    after = stats.snapshot()
    steps = len(dense_t)
    d = lambda key: _stat_delta(before, after, key)
    err = torch.stack(errs)
    dense_ms, retro_ms = 1e3 * statistics.median(dense_t), 1e3 * statistics.median(retro_t)
    elem = dense.k[0].element_size()
    dense_resident = dense.nbytes()
    retro_resident = retro.device_nbytes()
    return {
        "dense_kernel": opts.sdpa_name,
        "dense_step_ms": dense_ms, "retro_step_ms": retro_ms,
        "dense_step_ms_mean": 1e3 * statistics.mean(dense_t),
        "retro_step_ms_mean": 1e3 * statistics.mean(retro_t),
        "step_time_ratio": retro_ms / dense_ms, "speedup": dense_ms / retro_ms,
        "dense_tokens_per_s": batch * steps / sum(dense_t),
        "retro_tokens_per_s": batch * steps / sum(retro_t),
        "dense_kv_bytes_read_per_step": 2 * s.layers * batch * s.kv_heads * s.head_dim * elem
        * (n + opts.warmup + (steps + 1) / 2),
        "h2d_bytes_per_step": d("host_to_device_bytes") / steps,
        "d2d_bytes_per_step": d("bytes_d2d") / steps,
        "host_tokens_per_step": d("miss_tokens") / steps,
        "host_clusters_per_step": d("device_cache_miss_clusters") / steps,
        "worker_wait_ms_per_step": 1e3 * d("wait_s") / steps,
        "rel_err_mean": float(err.mean()), "rel_err_max": float(err.max()),
        "dense_resident_device_bytes": dense_resident,
        "retro_resident_device_bytes": retro_resident,
        "dense_peak_device_bytes": dense_resident + dense_peak if dev.type == "cuda" else None,
        "retro_peak_device_bytes": retro_resident + retro_peak if dev.type == "cuda" else None,
        "steps": steps, "warmup": opts.warmup,
    }
