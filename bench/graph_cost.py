"""RetrievalAttention's graph index: its build cost against the wave index's k-means, and
its search recall on real attention data.

**Build** (one layer's prefill; synthetic keys structured like ``bench/decode_step.py``'s,
bf16): the wave index's build (:meth:`WaveIndex.build`, the default config: segmented
spherical k-means, 10 rounds, early stop at 1%) and the graph index's
(:meth:`GraphIndex.build`, the default config), the latter split into its phases: the exact
kNN of the training queries (the last ``--train-tokens`` prefill positions' queries of every
query head, pooled per KV head, at most ``graph_train_queries`` each; drawn near the keys'
directions), and the graph (RoarGraph projection + connectivity enhancement, C++). Shapes:
Llama-3-8B (8 KV / 32 query heads, head_dim 128) and Qwen2.5-0.5B (2 / 14, head_dim 64).

**Recall** (the Qwen capture of the tests: 4096 tokens of real prose, layers 2, 8, 10, 15,
22): graphs over the indexed keys of a 4032-token prefill, trained on the 192 prefill
queries before the decode (the route's last chunk) or on the keys themselves (the
off-the-shelf key-to-key graph); recall@100 of the 64 decode queries' searches against the
exact top-100 by ``q . k``, and the fraction of keys each search scored, per search pool.

Writes ``bench/results/graph_cost_<device>.json`` and prints the tables.

    .venv/bin/python bench/graph_cost.py
    .venv/bin/python bench/graph_cost.py --contexts 8192 --shapes qwen
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vllm_retro.config import RetroConfig  # noqa: E402
from vllm_retro.index import graph as gr  # noqa: E402
from vllm_retro.index.graph_index import BUILD_EF, NUM_ENTRIES, GraphIndex  # noqa: E402
from vllm_retro.index.wave_index import WaveIndex  # noqa: E402

SHAPES = {"llama": (32, 8, 128), "qwen": (14, 2, 64)}


def synthetic(hq: int, hkv: int, d: int, n: int, t: int, seed: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys around 2048 directions per KV head, values random, and ``t`` prefill queries
    per query head near the directions (bf16): [Hkv, N, D], [Hkv, N, D], [Hq, T, D]."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.nn.functional.normalize(torch.randn(hkv, 2048, d, generator=g), dim=-1) * 4
    which = torch.randint(0, 2048, (hkv, n), generator=g)
    keys = centers[torch.arange(hkv)[:, None], which] + torch.randn(hkv, n, d, generator=g)
    values = torch.randn(hkv, n, d, generator=g)
    kv = torch.arange(hq) // (hq // hkv)
    pick = torch.randint(0, 2048, (hq, t), generator=g)
    queries = centers[kv[:, None], pick] + 0.3 * torch.randn(hq, t, d, generator=g)
    return keys.bfloat16(), values.bfloat16(), queries.bfloat16()


def build_case(shape: str, n: int, train_tokens: int) -> dict:
    """Build times of one layer (seconds): the wave index, the graph index and its phases."""
    hq, hkv, d = SHAPES[shape]
    keys, values, queries = synthetic(hq, hkv, d, n, min(train_tokens, n), seed=n)
    cfg = RetroConfig(index="graph")
    t0 = time.perf_counter()
    WaveIndex.build(keys, values, cfg)
    wave_s = time.perf_counter() - t0
    # the graph's phases, as GraphIndex builds them (indexed part: sinks to window)
    mid = keys[:, cfg.sink_tokens:n - cfg.local_window]
    spec = gr.GraphSpec.make(hkv, hq, False)
    t0 = time.perf_counter()
    knn, entries = gr.build_inputs(mid, queries, spec, cfg.graph.knn, cfg.graph.train_queries,
                                   NUM_ENTRIES)
    knn_s = time.perf_counter() - t0
    m = mid.shape[1]
    pool, rows = mid.reshape(hkv * m, d), torch.arange(hkv * m).reshape(hkv, m)
    t0 = time.perf_counter()
    adj = gr.build_graphs(pool, rows, knn, spec.graph_head, entries, cfg.graph.degree, BUILD_EF,
                          gr.inverse_norms(mid))
    graph_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    index = GraphIndex.build(keys, values, cfg, queries=queries)
    total_s = time.perf_counter() - t0
    row = {
        "shape": shape, "context": n, "query_heads": hq, "kv_heads": hkv, "head_dim": d,
        "train_queries_per_graph": int(knn.shape[1]), "wave_kmeans_s": wave_s,
        "graph_total_s": total_s, "graph_knn_s": knn_s, "graph_link_s": graph_s,
        "graph_over_kmeans": total_s / wave_s,
        "graph_mean_degree": float((adj >= 0).sum(-1).float().mean()),
        "graph_bytes_per_token_and_kv_head": index.meta_nbytes() / max(1, index.num_indexed)
        / hkv,
    }
    print(f"{shape:5s} {n // 1024:>4}K: k-means {wave_s:6.2f} s | graph {total_s:6.2f} s "
          f"(kNN {knn_s:5.2f} s, projection+connectivity {graph_s:5.2f} s) = "
          f"{row['graph_over_kmeans']:.1f}x k-means", flush=True)
    return row


def recall_case(ef_list: list[int]) -> dict:
    """Recall@100 and scanned fraction per layer and pool on the Qwen capture."""
    from tests.fixtures import build_qwen_capture

    cap = build_qwen_capture()
    out: dict = {}
    for layer, dd in cap["layers"].items():
        keys = dd["k"][:, 4:4032 - 64].contiguous()
        hk, n, d = keys.shape
        test = dd["q"][:, 192:]
        hq, t = test.shape[0], test.shape[1]
        g = hq // hk
        exact = torch.einsum("hgtd,hnd->hgtn", test.reshape(hk, g, t, d), keys).topk(100, -1)[1]
        pool, rows = keys.reshape(-1, d), torch.arange(hk * n).reshape(hk, n)
        cfg = RetroConfig()
        per: dict = {}
        for name, train in (("queries", dd["q"][:, :192]), ("keys", None)):
            spec = gr.GraphSpec.make(hk, hq, False)
            knn, ent = gr.build_inputs(keys, train, spec, cfg.graph.knn, cfg.graph.train_queries,
                                       NUM_ENTRIES)
            adj = gr.build_graphs(pool, rows, knn, spec.graph_head, ent, cfg.graph.degree,
                                  BUILD_EF, gr.inverse_norms(keys))
            per[name] = {}
            for ef in ef_list:
                res = gr.search_graphs(list(test.permute(1, 0, 2)), [adj] * t, [pool] * t,
                                       [rows] * t, [ent] * t, ef)
                hit = scanned = 0.0
                for i, (ids, _, counts) in enumerate(res):
                    top = ids[:, :100].reshape(hk, g, 100)
                    hit += (top[..., :, None] == exact[:, :, i, None, :]).any(-1).float().mean()
                    scanned += counts.float().mean() / n
                per[name][ef] = {"recall_at_100": float(hit / t), "scanned": float(scanned / t)}
        out[int(layer)] = per
        print(f"layer {layer:>2}: " + "  ".join(
            f"ef {ef}: R {per['queries'][ef]['recall_at_100']:.3f} (keys-trained "
            f"{per['keys'][ef]['recall_at_100']:.3f}) scan {per['queries'][ef]['scanned']:.0%}"
            for ef in ef_list), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--shapes", nargs="+", default=["llama", "qwen"], choices=list(SHAPES))
    ap.add_argument("--train-tokens", type=int, default=1024,
                    help="prefill positions whose queries train the graph (a last chunk)")
    ap.add_argument("--ef", type=int, nargs="+", default=[100, 128, 200, 300])
    ap.add_argument("--no-recall", action="store_true")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result: dict = {"device": platform.processor() or platform.machine(),
                    "threads": args.threads, "config": RetroConfig(index="graph").to_dict(),
                    "build_ef": BUILD_EF, "train_tokens": args.train_tokens, "builds": []}
    out = args.out or ROOT / "bench" / "results" / "graph_cost_cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    for shape in args.shapes:
        for n in args.contexts:
            result["builds"].append(build_case(shape, n, args.train_tokens))
            out.write_text(json.dumps(result, indent=2))
    if not args.no_recall:
        result["recall"] = recall_case(args.ef)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
