"""One decode step of a Llama-3-8B-shaped attention layer: full attention vs wave index + buffer.

32 query heads, 8 KV heads, head_dim 128, bf16, at each context length and batch size. Full
attention runs through the strongest kernel available on the machine — vLLM's own CPU
paged-attention kernel on CPU, PyTorch's FlashAttention SDPA backend on CUDA — and the wave
index + wave buffer (default budgets, the host tier read in place or gathered from it,
layouts on the buffer's worker) serves the same queries; both are timed step by step,
interleaved, in the same run. Printed and written to
``bench/results/decode_step_<device>.{json,png}``: median step times, their ratio, bytes read
per step, and (CUDA) the host->device bandwidth of the gather kernel against a plain
``copy_`` of the same bytes.

Bytes-moved lower bound: the machine's read bandwidth is measured in the same run (a
reduction over a buffer far larger than the caches, or device memory on CUDA); each method's
bytes per step divided by it is the fastest that step could be, and ``*_bw_efficiency`` =
that bound / the measured time says how close each method gets to the memory limit.
Cases whose KV does not fit in memory (dense copy plus host tier) are skipped and recorded.

The KV is synthetic but structured (keys drawn around a few thousand directions, queries
drifting slowly between steps) so that the index has real clusters and consecutive steps
share hot clusters. (Until 2026-12-04 the rows also carried the hit ratio of the wave
buffer's per-request device block cache, removed since; the device step's cluster cache is
measured by ``bench/device_step.py`` and ``bench/cache_hits.py``.)

    .venv/bin/python bench/decode_step.py                 # 8K-128K, batch 1, 8, 32
    .venv/bin/python bench/decode_step.py --contexts 32768 --batches 1 --steps 10
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.machine import cpu_description  # noqa: E402
from vllm_retro.buffer import WaveBufferManager  # noqa: E402
from vllm_retro.config import RetroConfig  # noqa: E402
from vllm_retro.index import WaveIndex  # noqa: E402
from vllm_retro.index.batched import decode_batch, fused_supported, packed_row  # noqa: E402
from vllm_retro.index.graph_index import GraphIndex  # noqa: E402
from vllm_retro.index.padded import MetaViewCache, decode_padded  # noqa: E402
from vllm_retro.index.pages import PAGE_INDEXES  # noqa: E402
from vllm_retro.index.pq_index import PQIndex  # noqa: E402
from vllm_retro.index.saap import SaapIndex, saap_selection  # noqa: E402
from vllm_retro.index.saap_model import ModelIdentity, random_saap_model  # noqa: E402
from vllm_retro.kernels import cpu_decode  # noqa: E402

HQ, HKV, D = 32, 8, 128
SCALE = D ** -0.5


def synthetic_kv(batch: int, n: int, dtype: torch.dtype, seed: int, hkv: int = HKV,
                 d: int = D) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys around 2048 directions per head (each token near one), values random, and the
    directions themselves (queries are drawn near them). Shapes [B, hkv, N, d], [hkv, 2048, d]
    (the Llama-3-8B layer's KV heads and head_dim unless given)."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.nn.functional.normalize(torch.randn(hkv, 2048, d, generator=g), dim=-1) * 4
    keys = torch.empty(batch, hkv, n, d, dtype=dtype)
    values = torch.empty(batch, hkv, n, d, dtype=dtype)
    for b in range(batch):
        for h in range(hkv):
            which = torch.randint(0, 2048, (n,), generator=g)
            keys[b, h] = (centers[h, which] + torch.randn(n, d, generator=g)).to(dtype)
            values[b, h] = torch.randn(n, d, generator=g).to(dtype)
    return keys, values, centers


class QueryWalk:
    """Decode queries [B, hq, D] that drift slowly, so consecutive steps share hot clusters
    (hq query heads, ``hq / hkv`` per KV head of ``centers`` [hkv, 2048, D])."""

    def __init__(self, batch: int, centers: torch.Tensor, seed: int, hq: int = HQ):
        self.g = torch.Generator().manual_seed(seed + 1)
        kv = torch.arange(hq) // (hq // centers.shape[0])
        pick = torch.randint(0, centers.shape[1], (batch, hq), generator=self.g)
        self.q = centers[kv[None, :].expand(batch, hq), pick].clone()
        self.centers, self.kv = centers, kv

    def step(self) -> torch.Tensor:
        jump = torch.rand(self.q.shape[:2], generator=self.g) < 0.05
        pick = torch.randint(0, self.centers.shape[1], self.q.shape[:2], generator=self.g)
        target = self.centers[self.kv[None, :].expand_as(pick), pick]
        self.q = torch.where(jump[..., None], target, self.q)
        return self.q + 0.3 * torch.randn(self.q.shape, generator=self.g)


def full_attention_kernel(keys: torch.Tensor, values: torch.Tensor, device: torch.device,
                          hq: int = HQ):
    """(callable query [B, hq, D] -> out, name, bytes read per call) for the device's
    strongest dense decode kernel over keys and values [B, HKV, N, D]."""
    scale = keys.shape[-1] ** -0.5
    if device.type == "cuda":
        k, v = keys.to(device), values.to(device)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def run(q: torch.Tensor) -> torch.Tensor:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return torch.nn.functional.scaled_dot_product_attention(
                    q[:, :, None].to(device, k.dtype), k, v, scale=scale, enable_gqa=True)[:, :, 0]

        return run, "torch SDPA (FlashAttention backend)", 2 * k.numel() * k.element_size()
    from bench.vllm_cpu_attention import VllmCpuDecodeAttention, available, unavailable_reason

    if not available():
        raise SystemExit(f"vLLM's CPU attention kernel is unavailable: {unavailable_reason()}")
    attn = VllmCpuDecodeAttention(keys, values, hq, scale=scale)
    return ((lambda q: attn(q.to(keys.dtype))), f"vLLM CPU paged attention ({attn.isa} ISA)",
            attn.kv_bytes)


def retro_bytes(index: WaveIndex, n_exact: torch.Tensor, elem: int) -> int:
    """Bytes one decode step reads: all centroids (scoring), the estimated clusters'
    centroids and value sums (with the tilted estimator also their fp32 spread and deviate,
    and each KV head's fp32 profile and rank-r factors), and the K/V rows of the execution
    buffer."""
    c = index.num_clusters
    e = index.config.num_estimation(c)
    hkv, d = index.num_kv_heads, index.head_dim
    tilt = 0
    if index.config.tilted_estimation:
        tilt = hkv * (8 * e + 4 * d * (1 + 2 * index.residuals.rank))
    return hkv * d * elem * (c + 2 * e) + int(n_exact.sum()) * 2 * d * elem + tilt


def pq_bytes(index: PQIndex, elem: int) -> int:
    """Bytes one PQCache step reads: every indexed token's codes (one byte per sub-space),
    the fp32 codebooks, and the K/V rows of the steady zone and the chosen tokens."""
    m = index.config.pq.subspaces
    books = 0 if index.pq is None else index.pq.codebooks.numel() * 4
    exact = HKV * (index.num_steady + index.token_budget()) * 2 * D * elem
    return HKV * index.num_indexed * m + books + exact


class _OpCounter(TorchDispatchMode):
    """Counts the tensor operations dispatched, views aside (on a GPU each is a kernel launch
    or a copy; here the torch reference kernels count as several)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += not func.is_view
        return func(*args, **(kwargs or {}))


def count_ops(fn) -> int:
    """Tensor operations ``fn()`` dispatches."""
    with _OpCounter() as counter:
        fn()
    return counter.ops


def sync(device: torch.device) -> None:
    """Wait for queued device work (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def h2d_bandwidth(device: torch.device, rows: int = 1 << 16, run: int = 16
                  ) -> dict[str, float]:
    """GB/s of the gather kernel reading scattered pinned host rows, in runs of ``run``
    consecutive rows (a cluster's tokens), vs a plain copy_ of the same bytes (contiguous
    pinned -> device)."""
    from vllm_retro import kernels

    host_k = torch.randn(rows * 4, D).to(torch.bfloat16).pin_memory()
    host_v = torch.randn(rows * 4, D).to(torch.bfloat16).pin_memory()
    n = rows // run
    runs = torch.stack([torch.arange(n) * run, torch.randperm(rows * 4 // run)[:n] * run,
                        torch.full((n,), -run)], dim=1)
    dst_k = torch.empty(rows, D, dtype=torch.bfloat16, device=device)
    dst_v = torch.empty_like(dst_k)
    empty = torch.empty(1, D, dtype=torch.bfloat16, device=device)
    nbytes = 2 * rows * D * 2

    def gather() -> None:
        kernels.gather_runs(dst_k, dst_v, empty, empty, host_k, host_v, runs, backend="triton")

    plain_src = torch.randn(2, rows, D).to(torch.bfloat16).pin_memory()
    plain_dst = torch.empty(2, rows, D, dtype=torch.bfloat16, device=device)
    out = {}
    for name, fn in (("gather_kernel", gather),
                     ("plain_copy", lambda: plain_dst.copy_(plain_src, non_blocking=True))):
        fn()
        sync(device)
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        sync(device)
        out[f"{name}_GBps"] = nbytes * 20 / (time.perf_counter() - t0) / 1e9
    return out


def read_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes/s of a streaming read (sum over an fp32 buffer of ``nbytes``), best of 5."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(6):
        sync(device)
        t0 = time.perf_counter()
        x.sum()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    del x
    return nbytes / best


def fits(n: int, batch: int, device: torch.device, copies: float = 2.5, hkv: int = HKV,
         d: int = D) -> tuple[bool, str]:
    """Whether one case's bf16 KV (hkv heads of d dims) fits: the dense copy plus each
    index's host tier (plus slack: ``copies`` KVs in all) in RAM, and on CUDA the dense KV on
    the device."""
    kv = 2 * batch * hkv * n * d * 2
    import psutil

    avail = psutil.virtual_memory().available
    if copies * kv > avail:
        return False, (f"KV {kv / 2**30:.1f} GiB x{copies:g} > {avail / 2**30:.1f} GiB "
                       "available RAM")
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if 1.5 * kv > free:
            return False, f"KV {kv / 2**30:.1f} GiB x1.5 > {free / 2**30:.1f} GiB free on device"
    return True, ""


def wave_config(args: argparse.Namespace) -> RetroConfig:
    """The wave index's settings of the run: defaults, ``--kmeans-iters``, the wave buffer's
    path (not device-resident) and the ``--retro`` JSON's fields."""
    return RetroConfig(kmeans_iters=args.kmeans_iters, device_resident="off",
                       **json.loads(args.retro))


def bench_case(n: int, batch: int, args: argparse.Namespace, device: torch.device) -> dict:
    """Time full vs retro decode steps for one (context, batch)."""
    dtype = torch.bfloat16
    t0 = time.perf_counter()
    keys, values, centers = synthetic_kv(batch, n, dtype, seed=n + batch)
    full, full_name, full_bytes = full_attention_kernel(keys, values, device)
    # the wave buffer's path (host tier): the device step has its own benchmark,
    # bench/device_step.py
    cfg = wave_config(args)
    mgr = WaveBufferManager(cfg)
    build_s = time.perf_counter()
    indexes = [
        WaveIndex.build(keys[b].to(device), values[b].to(device), cfg,
                        store=mgr.store(f"req{b}", HKV, D, dtype, device, layer="L0"))
        for b in range(batch)
    ]
    build_s = (time.perf_counter() - build_s) / batch
    pq_cfg = cfg.replace(index="pqcache")
    pq_mgr = WaveBufferManager(pq_cfg)
    pq_indexes, pq_build_s = [], 0.0
    if "pqcache" in args.policies:
        t1 = time.perf_counter()
        for b in range(batch):
            st = pq_mgr.store(f"req{b}", HKV, D, dtype, device, layer="L0")
            pq_indexes.append(PQIndex.build(keys[b].to(device), values[b].to(device), pq_cfg,
                                            store=st))
            st.settle()
        pq_build_s = (time.perf_counter() - t1) / batch
    graph_cfg = cfg.replace(index="graph")
    graph_mgr = WaveBufferManager(graph_cfg)
    graph_indexes, graph_build_s = [], 0.0
    if "graph" in args.policies:  # trained on a last prefill chunk's queries (1024 tokens)
        g = torch.Generator().manual_seed(n + 11)
        kv = torch.arange(HQ) // (HQ // HKV)
        t1 = time.perf_counter()
        for b in range(batch):
            pick = torch.randint(0, centers.shape[1], (HQ, 1024), generator=g)
            train = centers[kv[:, None], pick] + 0.3 * torch.randn(HQ, 1024, D, generator=g)
            st = graph_mgr.store(f"req{b}", HKV, D, dtype, device, layer="L0")
            graph_indexes.append(GraphIndex.build(keys[b].to(device), values[b].to(device),
                                                  graph_cfg, store=st,
                                                  queries=train.to(device, dtype)))
            st.settle()
        graph_build_s = (time.perf_counter() - t1) / batch
    graph_t: list[float] = []
    saap_indexes, saap_build_s, saap_mgr = [], 0.0, WaveBufferManager(cfg)
    if "saap" in args.policies:
        # the routing's cost, not its quality: 256 buckets centred on key directions of the
        # synthetic keys (balanced buckets), a random classifier of the default width, a
        # RoPE base so large that de-RoPE is nearly the identity (the keys carry no RoPE)
        ident = ModelIdentity("llama", 1, HQ, HKV, D, 1e30, "bench")
        model = random_saap_model(ident, 256, 256, torch.Generator().manual_seed(n))
        pick = torch.randperm(centers.shape[1], generator=torch.Generator().manual_seed(n))
        model.tensors["centroids"] = torch.nn.functional.normalize(
            centers[:, pick[:256]], dim=-1)[None].contiguous()
        model.tensors["key_mean"].zero_()
        t1 = time.perf_counter()
        for b in range(batch):
            st = saap_mgr.store(f"req{b}", HKV, D, dtype, device, layer="L0")
            saap_indexes.append(SaapIndex.build(keys[b].to(device), values[b].to(device), cfg,
                                                store=st, model=model, layer=0))
            st.settle()
        saap_build_s = (time.perf_counter() - t1) / batch
    saap_t: list[float] = []
    # Quest and StreamingLLM: page policies at their defaults, through their serving path
    page_indexes: dict[str, list] = {}
    page_build_s: dict[str, float] = {}
    page_t: dict[str, list[float]] = {}
    page_mgr = WaveBufferManager(cfg)
    for name in ("quest", "streaming"):
        if name not in args.policies:
            continue
        pcfg = cfg.replace(index=name)
        t1 = time.perf_counter()
        page_indexes[name] = []
        for b in range(batch):
            st = page_mgr.store(f"{name}{b}", HKV, D, dtype, device, layer=name)
            page_indexes[name].append(PAGE_INDEXES[name].build(
                keys[b].to(device), values[b].to(device), pcfg, store=st))
            st.settle()
        page_build_s[name] = (time.perf_counter() - t1) / batch
        page_t[name] = []
    saap_views = MetaViewCache()
    pq_views = MetaViewCache()
    pq_t: list[float] = []
    del keys, values
    walk = QueryWalk(batch, centers, seed=n)
    full_t, retro_t, row_t, pad_t, rbytes = [], [], [], [], []
    views = MetaViewCache()  # one layer's, as the route holds it
    fused_ok = all(fused_supported(i, torch.empty(1, HQ, D, dtype=dtype, device=device))
                   for i in indexes)
    for step in range(args.warmup + args.steps):
        q = walk.step()
        sync(device)
        a = time.perf_counter()
        full(q)
        sync(device)
        b = time.perf_counter()
        decode_batch(indexes, qb := q.to(device, dtype), SCALE, cache=views)  # serving path
        sync(device)
        c = time.perf_counter()
        if pq_indexes:  # PQCache's serving path on the same queries
            decode_batch(pq_indexes, qb, SCALE, cache=pq_views)
            sync(device)
            if step >= args.warmup:
                pq_t.append(time.perf_counter() - c)
        if saap_indexes:  # SAAP's serving path: one classifier pass, the fused kernel
            c0 = time.perf_counter()
            decode_batch(saap_indexes, qb, SCALE, cache=saap_views)
            sync(device)
            if step >= args.warmup:
                saap_t.append(time.perf_counter() - c0)
        for name, pidx in page_indexes.items():  # pages chosen per row, one fused call
            c0 = time.perf_counter()
            decode_batch(pidx, qb, SCALE)
            sync(device)
            if step >= args.warmup:
                page_t[name].append(time.perf_counter() - c0)
        if graph_indexes:  # the graph index's serving path (row by row) on the same queries
            c0 = time.perf_counter()
            decode_batch(graph_indexes, qb, SCALE)
            sync(device)
            if step >= args.warmup:
                graph_t.append(time.perf_counter() - c0)
        c1 = time.perf_counter()
        if fused_ok:  # the padded batched path (CUDA's) on this CPU, for comparison
            decode_padded(indexes, qb, SCALE, torch.empty_like(qb), views)
        sync(device)
        c2 = time.perf_counter()
        step_bytes = 0
        for i, idx in enumerate(indexes):  # the per-row reference path, for comparison
            res = idx.decode(qb[i], SCALE)
            step_bytes += retro_bytes(idx, res.n_exact, 2)
        sync(device)
        e = time.perf_counter()
        if step >= args.warmup:
            full_t.append(b - a)
            retro_t.append(c - b)
            row_t.append(e - c2)
            pad_t.append(c2 - c1)
            rbytes.append(step_bytes)
    phases: dict[str, float] = {}
    fused = {"row views (python)": 0.0}
    tilted = cfg.tilted_estimation
    padded: dict[str, float] = {}
    for _ in range(args.phase_steps):  # the per-phase split, on separate steps
        q = walk.step().to(device, dtype)
        for i, idx in enumerate(indexes):
            idx.decode(q[i], SCALE, phases=phases)
        if fused_ok:  # the serving path's cached row views, then the kernel's own split
            t = time.perf_counter()
            packed = [packed_row(i, tilted) for i in indexes]
            windows = [(i.ring_start, i.win_len) for i in indexes]
            u = time.perf_counter()
            cpu_decode.decode_packed(q, packed, SCALE, tilted, windows=windows, phases=fused)
            fused["row views (python)"] += u - t
        decode_padded(indexes, q, SCALE, torch.empty_like(q), views, phases=padded)
    q = walk.step().to(device, dtype)
    ops = {"padded batched": count_ops(
        lambda: decode_padded(indexes, q, SCALE, torch.empty_like(q), views)),
        "per-row": count_ops(lambda: [idx.decode(q[i], SCALE) for i, idx in enumerate(indexes)])}
    pq_phases: dict[str, float] = {}
    if pq_indexes:
        from vllm_retro.index.pq_index import decode_pq

        for _ in range(args.phase_steps):
            q = walk.step().to(device, dtype)
            decode_pq(pq_indexes, q, SCALE, torch.empty_like(q), pq_views, phases=pq_phases)
    pq_step_bytes = sum(pq_bytes(i, 2) for i in pq_indexes)
    mgr.close()
    pq_mgr.close()
    graph_mgr.close()
    saap_tokens = 0.0
    if saap_indexes:  # exact tokens per (request, KV head) at the last query
        ids, counts = saap_selection(saap_indexes, walk.step().to(device, dtype))
        saap_tokens = statistics.mean(
            float(torch.gather(i.sizes, 1, ids[j, :, :c]).sum(1).float().mean())
            for j, (i, c) in enumerate(zip(saap_indexes, counts, strict=True)))
    saap_views.clear()
    saap_mgr.close()
    page_tokens = {name: statistics.mean(min(i.num_pages, i.num_clusters) * i.page_size
                                         for i in pidx) for name, pidx in page_indexes.items()}
    page_mgr.close()
    full_ms, retro_ms = statistics.median(full_t) * 1e3, statistics.median(retro_t) * 1e3
    row = {
        "context": n, "batch": batch, "full_kernel": full_name,
        "full_ms": full_ms, "retro_ms": retro_ms, "speedup": full_ms / retro_ms,
        "retro_path": "fused batched CPU kernel" if fused_ok else "padded batched kernels",
        "retro_padded_ms": statistics.median(pad_t) * 1e3 if fused_ok else None,
        "retro_per_row_ms": statistics.median(row_t) * 1e3,
        "speedup_per_row": full_ms / (statistics.median(row_t) * 1e3),
        "full_bytes_per_step": full_bytes, "retro_bytes_per_step": statistics.mean(rbytes),
        "bytes_ratio": full_bytes / statistics.mean(rbytes),
        "index_build_s_per_request": build_s, "case_wall_s": time.perf_counter() - t0,
        "phase_ms_per_step": {k: v / max(args.phase_steps, 1) * 1e3 for k, v in phases.items()},
        "fused_phase_ms_per_step": {k: v / max(args.phase_steps, 1) * 1e3
                                    for k, v in fused.items()} if fused_ok else {},
        "torch_ops_per_step": ops,
        "padded_phase_ms_per_step": {k: v / max(args.phase_steps, 1) * 1e3
                                     for k, v in padded.items()},
    }
    if pq_t:
        pq_ms = statistics.median(pq_t) * 1e3
        row["pqcache"] = {
            "ms": pq_ms, "speedup": full_ms / pq_ms, "bytes_per_step": pq_step_bytes,
            "bytes_ratio": full_bytes / pq_step_bytes,
            "bw_efficiency": pq_step_bytes / args.read_bw * 1e3 / pq_ms,
            "index_build_s_per_request": pq_build_s,
            "path": "fused CPU kernel (pq_decode)" if device.type == "cpu"
            and pq_indexes[0].backend == "auto" else "batched kernels",
            "phase_ms_per_step": {k: v / max(args.phase_steps, 1) * 1e3
                                  for k, v in pq_phases.items()},
        }
    if saap_t:
        saap_ms = statistics.median(saap_t) * 1e3
        row["saap"] = {"ms": saap_ms, "speedup": full_ms / saap_ms,
                       "index_build_s_per_request": saap_build_s,
                       "tokens_per_kv_head": saap_tokens,
                       "path": "one classifier pass per layer, then the fused kernel with the "
                               "chosen buckets given"}
    for name, times in page_t.items():
        ms = statistics.median(times) * 1e3
        row[name] = {"ms": ms, "speedup": full_ms / ms,
                     "index_build_s_per_request": page_build_s[name],
                     "indexed_tokens_read_per_kv_head": page_tokens[name],
                     "path": "pages chosen per row, then the fused kernel with them given"}
    if graph_t:
        graph_ms = statistics.median(graph_t) * 1e3
        row["graph"] = {"ms": graph_ms, "speedup": full_ms / graph_ms,
                        "index_build_s_per_request": graph_build_s,
                        "top_k_per_query_head": statistics.mean(
                            i.token_budget() for i in graph_indexes),
                        "path": "per request: C++ graph search, torch attention"}
    bw = args.read_bw
    row["full_lower_bound_ms"] = full_bytes / bw * 1e3
    row["retro_lower_bound_ms"] = row["retro_bytes_per_step"] / bw * 1e3
    row["full_bw_efficiency"] = row["full_lower_bound_ms"] / full_ms
    row["retro_bw_efficiency"] = row["retro_lower_bound_ms"] / retro_ms
    print(f"ctx {n:>6} batch {batch}: full {full_ms:8.2f} ms  retro {retro_ms:8.2f} ms  "
          f"speedup {row['speedup']:5.2f}x  bytes {row['bytes_ratio']:5.1f}x fewer  "
          f"(build {build_s:.1f} s/request)", flush=True)
    print(f"    per-row path {row['retro_per_row_ms']:8.2f} ms  speedup "
          f"{row['speedup_per_row']:5.2f}x", flush=True)
    if row["retro_padded_ms"] is not None:
        print(f"    padded batched path {row['retro_padded_ms']:8.2f} ms  speedup "
              f"{full_ms / row['retro_padded_ms']:5.2f}x", flush=True)
    if phases:
        print("    per-row phases (ms/step, all requests): " + "  ".join(
            f"{k} {v:.2f}" for k, v in row["phase_ms_per_step"].items()), flush=True)
    print("    tensor ops per layer step (launches on a GPU): " + "  ".join(
        f"{k} {v}" for k, v in ops.items()), flush=True)
    print("    padded phases (ms/step, all requests): " + "  ".join(
        f"{k} {v:.2f}" for k, v in row["padded_phase_ms_per_step"].items()), flush=True)
    if "pqcache" in row:
        pq = row["pqcache"]
        print(f"    pqcache {pq['ms']:8.2f} ms  speedup {pq['speedup']:5.2f}x  bytes "
              f"{pq['bytes_ratio']:5.1f}x fewer  at {pq['bw_efficiency']:.0%} of its bound  "
              f"(build {pq['index_build_s_per_request']:.1f} s/request)", flush=True)
        print("    pqcache phases (ms/step, all requests): " + "  ".join(
            f"{k} {v:.2f}" for k, v in pq["phase_ms_per_step"].items()), flush=True)
    if "saap" in row:
        si = row["saap"]
        print(f"    saap {si['ms']:8.2f} ms  speedup {si['speedup']:5.2f}x  (build "
              f"{si['index_build_s_per_request']:.1f} s/request, "
              f"{si['tokens_per_kv_head']:.0f} tokens/KV head)", flush=True)
    if "graph" in row:
        gi = row["graph"]
        print(f"    graph {gi['ms']:8.2f} ms  speedup {gi['speedup']:5.2f}x  (build "
              f"{gi['index_build_s_per_request']:.1f} s/request)", flush=True)
    for name in ("quest", "streaming"):
        if name in row:
            pi = row[name]
            print(f"    {name} {pi['ms']:8.2f} ms  speedup {pi['speedup']:5.2f}x  (build "
                  f"{pi['index_build_s_per_request']:.2f} s/request, "
                  f"{pi['indexed_tokens_read_per_kv_head']:.0f} indexed tokens read)",
                  flush=True)
    if row["fused_phase_ms_per_step"]:
        print("    fused phases (ms/step, all requests): " + "  ".join(
            f"{k} {v:.2f}" for k, v in row["fused_phase_ms_per_step"].items()), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--phase-steps", type=int, default=5,
                    help="extra steps timed phase by phase (select, gather, estimator, "
                         "attention, bookkeeping), with a sync at each boundary")
    ap.add_argument("--kmeans-iters", type=int, default=2,
                    help="k-means iterations at index build (build time is not what is timed)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--policies", nargs="+", default=["wave"],
                    choices=["wave", "pqcache", "saap", "graph", "quest", "streaming"],
                    help="indexes timed in the same run (the wave index always is; "
                         "'pqcache' adds PQCache's serving path and build, and a host copy; "
                         "'saap' SAAP (a random router of the default size: its cost), "
                         "'graph' RetrievalAttention's graph index, the same)")
    ap.add_argument("--retro", default="{}",
                    help="JSON of RetroConfig fields for every index of the run, e.g. "
                         "'{\"min_retrieval_clusters\": 0}' for an A/B of a default")
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else cpu_description(),
        "threads": args.threads, "shape": {"query_heads": HQ, "kv_heads": HKV, "head_dim": D},
        "dtype": "bfloat16",
        "config": wave_config(args).to_dict(),
        "steps": args.steps, "cases": [], "skipped": [],
    }
    out = args.out or ROOT / "bench" / "results" / f"decode_step_{device.type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    args.read_bw = read_bandwidth(device)
    result["read_bandwidth_GBps"] = args.read_bw / 1e9
    print(f"{cpu_description()}; read bandwidth {args.read_bw / 1e9:.1f} GB/s", flush=True)
    for n in args.contexts:
        for b in args.batches:
            ok, why = fits(n, b, device, 2.5 + ("pqcache" in args.policies)
                           + ("graph" in args.policies) + ("saap" in args.policies))
            if not ok:
                print(f"ctx {n:>6} batch {b}: skipped ({why})", flush=True)
                result["skipped"].append({"context": n, "batch": b, "reason": why})
                continue
            result["cases"].append(bench_case(n, b, args, device))
            out.write_text(json.dumps(result, indent=2))  # kept if a later case dies
    if device.type == "cuda":
        result["h2d"] = h2d_bandwidth(device)
        print("host->device:", result["h2d"])
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def plot(result: dict, path: pathlib.Path) -> None:
    """Step-time ratio (full / retro) and bandwidth efficiency vs context, one line per batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for b in sorted({c["batch"] for c in result["cases"]}):
        rows = sorted((c for c in result["cases"] if c["batch"] == b), key=lambda c: c["context"])
        ctx = [c["context"] // 1024 for c in rows]
        ax1.plot(ctx, [c["speedup"] for c in rows], "o-", label=f"batch {b}")
        ax1.plot(ctx, [c["bytes_ratio"] for c in rows], "x:", color=ax1.lines[-1].get_color())
        ax2.plot(ctx, [c["full_bw_efficiency"] for c in rows], "s--",
                 color=ax1.lines[-1].get_color(), label=f"full, batch {b}")
        ax2.plot(ctx, [c["retro_bw_efficiency"] for c in rows], "o-",
                 color=ax1.lines[-1].get_color(), label=f"retro, batch {b}")
    ax1.axhline(1.0, color="grey", lw=0.5)
    ax1.set(xscale="log", yscale="log", xlabel="context (K tokens)",
            ylabel="full / retro (o: step time, x: bytes read)",
            title=f"decode step, {result['device']}")
    ax2.set(xscale="log", xlabel="context (K tokens)", ylim=(0, 1),
            ylabel="bytes lower bound / measured time",
            title=f"bandwidth efficiency ({result['read_bandwidth_GBps']:.0f} GB/s read)")
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
