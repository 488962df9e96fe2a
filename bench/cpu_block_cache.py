"""Memory of one request's index on a CPU with and without the wave buffer's block cache.

    python bench/cpu_block_cache.py [--out bench/results/cpu_block_cache_ab.json]

Builds one request's wave index for 24 layers of Qwen2.5-0.5B's shape (2 KV heads, head_dim
64, bf16) at 4K and 16K tokens, through a :class:`WaveBufferManager` with the block cache
(``cpu_block_cache=True``, the library's default) and without it (what a CPU server uses),
and reports the host-tier bytes, the block pool's bytes and the build's seconds.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from vllm_retro.buffer.manager import WaveBufferManager  # noqa: E402
from vllm_retro.config import RetroConfig  # noqa: E402
from vllm_retro.index.wave_index import WaveIndex  # noqa: E402

LAYERS, HEADS, HEAD_DIM = 24, 2, 64


def build(layers: list[tuple[torch.Tensor, torch.Tensor]], cache: bool) -> dict[str, float]:
    """One request's index over ``layers``; its bytes and build seconds."""
    cfg = RetroConfig()
    mgr = WaveBufferManager(cfg, cpu_block_cache=cache)
    t = time.perf_counter()
    for i, (k, v) in enumerate(layers):
        store = mgr.store("r", HEADS, HEAD_DIM, k.dtype, "cpu", layer=f"l{i}")
        WaveIndex.build(k, v, cfg, store=store)
        store.settle()
    seconds = time.perf_counter() - t
    host, blocks = mgr.live_bytes()
    mgr.free_request("r")
    mgr.close()
    return {"build_s": seconds, "host_bytes": host, "block_pool_bytes": blocks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="bench/results/cpu_block_cache_ab.json")
    args = ap.parse_args()
    out: dict[str, list[dict[str, float]]] = {}
    for tokens in args.contexts:
        g = torch.Generator().manual_seed(0)
        layers = [tuple(torch.randn(HEADS, tokens, HEAD_DIM, generator=g).bfloat16()
                        for _ in range(2)) for _ in range(LAYERS)]
        raw = LAYERS * 2 * HEADS * tokens * HEAD_DIM * 2
        for _ in range(args.repeats):
            for cache in (True, False):
                r = build(layers, cache)
                out.setdefault(f"{tokens}_{cache}", []).append(r)
                print(f"{tokens} tokens, block cache {cache}: host {r['host_bytes'] / 2**20:.1f}"
                      f" MiB, block pool {r['block_pool_bytes'] / 2**20:.1f} MiB "
                      f"({100 * r['block_pool_bytes'] / raw:.1f}% of the K+V), "
                      f"build {r['build_s']:.2f} s")
    pathlib.Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
