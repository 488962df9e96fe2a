"""Index build cost at prefill: SAAP's nearest-centroid assignment against the wave index's
segmented k-means, on the same keys, in one run.

Per shape, one layer's prefill keys (``bench/decode_step.py``'s structured keys: each token
near one of 2048 directions per head) are indexed

- ``wave``: :meth:`WaveIndex.build` as served (spherical k-means in 8192-token segments, one
  centroid per 16 tokens, up to 10 rounds stopping once a round moves under 1% of the keys;
  on the CPU the fused C++ assignment);
- ``saap``: :meth:`SaapIndex.build` with ``C`` trained buckets (a random routing: the cost
  does not depend on what was learnt): de-RoPE, the nearest of ``C`` centroids, the layout;

both into a :class:`DenseClusterStore` (the same layout work). ``cluster`` times the
clustering step alone (:meth:`WaveIndex._cluster` / :meth:`SaapIndex._cluster`), ``build``
the whole build. Shapes: Llama-3-8B (8 KV heads, head_dim 128, bf16; ``C`` = 1024 as in the
paper, and 256) and Qwen2.5-0.5B (2 KV heads, head_dim 64, fp32, ``C`` = 256). The two
indexes alternate within each repeat and the medians are compared, so the ratios are of
one run on one machine. Prints each row; writes ``bench/results/saap_build_<device>.json``.

    .venv/bin/python bench/saap_build.py --contexts 32768 --repeat 3
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

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vllm_retro.config import RetroConfig  # noqa: E402
from vllm_retro.index.saap import SaapIndex  # noqa: E402
from vllm_retro.index.saap_model import ModelIdentity, random_saap_model  # noqa: E402
from vllm_retro.index.wave_index import WaveIndex  # noqa: E402

SHAPES = {  # name: (KV heads, query heads, head_dim, dtype, RoPE theta, buckets)
    "llama-c1024": (8, 32, 128, torch.bfloat16, 5e5, 1024),
    "llama-c256": (8, 32, 128, torch.bfloat16, 5e5, 256),
    "qwen-c256": (2, 14, 64, torch.float32, 1e6, 256),
}


def structured_keys(h: int, n: int, d: int, dtype: torch.dtype, seed: int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys near one of 2048 directions per head, random values ([H, N, D] each)."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.nn.functional.normalize(torch.randn(h, 2048, d, generator=g), dim=-1) * 4
    which = torch.randint(0, 2048, (h, n), generator=g)
    keys = centers[torch.arange(h)[:, None], which] + torch.randn(h, n, d, generator=g)
    return keys.to(dtype), torch.randn(h, n, d, generator=g).to(dtype)


def _time(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_case(shape: str, n: int, repeat: int) -> dict:
    """Median seconds of ``wave`` and ``saap`` (build and cluster step) for one shape."""
    h, hq, d, dtype, theta, c = SHAPES[shape]
    keys, values = structured_keys(h, n, d, dtype)
    cfg = RetroConfig()
    model = random_saap_model(ModelIdentity("bench", 1, hq, h, d, theta, "bench"), c, 256)
    wave_idx = WaveIndex(cfg, h, d, dtype, keys.device)
    saap_idx = SaapIndex(cfg, h, d, dtype, keys.device, model=model)
    sink, end = cfg.sink_tokens, n - cfg.local_window
    mk, mv = keys[:, sink:end], values[:, sink:end]
    saap_idx.window_start = sink
    runs: dict[str, list[float]] = {k: [] for k in ("wave_build", "saap_build", "wave_cluster",
                                                     "saap_cluster")}
    for _ in range(repeat):
        runs["wave_build"].append(_time(lambda: WaveIndex.build(keys, values, cfg)))
        runs["saap_build"].append(_time(lambda: SaapIndex.build(keys, values, cfg,
                                                                model=model)))
        runs["wave_cluster"].append(_time(lambda: wave_idx._cluster(mk, mv, update=False)))
        runs["saap_cluster"].append(_time(lambda: saap_idx._cluster(mk, mv, update=False)))
    row = {"shape": shape, "context": n, "kv_heads": h, "head_dim": d, "dtype": str(dtype),
           "buckets": c, **{k: statistics.median(v) for k, v in runs.items()}}
    row["build_ratio"] = row["wave_build"] / row["saap_build"]
    row["cluster_ratio"] = row["wave_cluster"] / row["saap_cluster"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for n in args.contexts:
        for shape in args.shapes:
            row = bench_case(shape, n, args.repeat)
            rows.append(row)
            print(f"{shape:12s} n={n:6d}  build: wave {row['wave_build']:7.3f} s  saap "
                  f"{row['saap_build']:7.3f} s  ({row['build_ratio']:5.1f}x)   cluster step: "
                  f"wave {row['wave_cluster']:7.3f} s  saap {row['saap_cluster']:7.3f} s  "
                  f"({row['cluster_ratio']:5.1f}x)", flush=True)
    out = args.out or ROOT / "bench" / "results" / "saap_build_cpu.json"
    out.write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                               "threads": args.threads, "repeat": args.repeat, "rows": rows},
                              indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
