"""Index builds of several requests into one layer: the wave buffer's preallocated layer pool
(what serving uses) against a layer pool that grows and a pool per request, in the same run.

Serving maps each layer's host pool once with a reservation of address space
(:func:`vllm_retro.vllm.runtime.pool_reserve_bytes`: twice the machine's memory over the
attention layers, here 32 as in Llama-3-8B) and commits pages as they are written. Without
a reservation a layer pool grows by 1.5x when a request's pages do not fit, copying every
request's pages; a pool per request never copies at prefill. This prints each mode's build
seconds per request (wave index build + host layout, as the serving runtime waits for it)
and the host bytes held at the end, and their ratios to the pool per request.

One Llama-3-8B-shaped layer (8 KV heads, head_dim 128, bf16), ``--requests`` random contexts
of ``--context`` tokens; the modes alternate ``--repeat`` times after one warm-up build.

    .venv/bin/python bench/layer_pool_build.py --context 32768 --requests 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm_retro.buffer import WaveBufferManager  # noqa: E402
from vllm_retro.config import RetroConfig  # noqa: E402
from vllm_retro.index import WaveIndex  # noqa: E402

HKV, D = 8, 128


LAYERS = 32
PREALLOCATED, GROWING, OWN = "preallocated layer pool", "growing layer pool", "pool per request"


def build_all(kv: list[tuple[torch.Tensor, torch.Tensor]], cfg: RetroConfig, mode: str
              ) -> tuple[list[float], int, int]:
    """Build every request's index into a fresh manager; (seconds per request, host bytes
    the pools count, growth of the process's resident memory over the builds)."""
    rss = psutil.Process().memory_info().rss
    reserve = 2 * psutil.virtual_memory().total // LAYERS if mode == PREALLOCATED else 0
    mgr = WaveBufferManager(cfg, pool_reserve_bytes=reserve)
    seconds = []
    for b, (k, v) in enumerate(kv):
        t = time.perf_counter()
        store = mgr.store(f"r{b}", HKV, D, k.dtype, "cpu", layer=None if mode == OWN else "L0")
        WaveIndex.build(k, v, cfg, store=store)
        store.settle()
        seconds.append(time.perf_counter() - t)
    host = mgr.host_bytes()
    rss = psutil.Process().memory_info().rss - rss
    mgr.close()
    return seconds, host, rss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    for name, value, low in (("context", args.context, 1024), ("requests", args.requests, 1),
                             ("repeat", args.repeat, 1)):
        if value < low:
            sys.exit(f"--{name}={value}: accepted: an integer >= {low}")
    cfg = RetroConfig(kmeans_iters=2)
    g = torch.Generator().manual_seed(0)
    kv = [(torch.randn(HKV, args.context, D, generator=g).bfloat16(),
           torch.randn(HKV, args.context, D, generator=g).bfloat16())
          for _ in range(args.requests)]
    build_all(kv[:1], cfg, OWN)  # warm-up: kernels loaded, allocator primed
    modes = (OWN, GROWING, PREALLOCATED)
    runs: dict[str, list[float]] = {m: [] for m in modes}
    host: dict[str, int] = {}
    resident: dict[str, int] = {}
    for _ in range(args.repeat):
        for mode in modes:
            seconds, host[mode], resident[mode] = build_all(kv, cfg, mode)
            runs[mode] += seconds
            print(f"{mode:>23}: build s/request " + " ".join(f"{s:.2f}" for s in seconds)
                  + f"  total {sum(seconds):.2f}  host {host[mode] / 2**20:.0f} MiB"
                  + f"  resident +{resident[mode] / 2**20:.0f} MiB", flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    total = {k: sum(v) / args.repeat for k, v in runs.items()}

    def compare(what: str, values: dict[str, float], unit: str) -> str:
        return f"{what}: " + ", ".join(
            f"{m} {values[m]:.2f}{unit} ({values[m] / values[OWN]:.3f}x)" for m in modes)

    lines = [
        f"context {args.context} x {args.requests} requests, one Llama-shaped layer, "
        f"{args.repeat} alternating runs; ratios to the {OWN}",
        compare("build seconds per request, median", med, " s"),
        compare("build seconds, all requests", total, " s"),
        compare("host memory held (pools' count)", {m: b / 2**20 for m, b in host.items()},
                " MiB"),
        compare("resident memory growth (last run)",
                {m: b / 2**20 for m, b in resident.items()}, " MiB"),
    ]
    print("\n".join(lines))
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
