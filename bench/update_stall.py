"""How long the decode step that completes an update block takes, with the block clustered
in that step (``update_rounds_per_step=0``) and spread over the next steps (the default).

One Llama-3-8B-shaped layer (8 KV heads, 32 query heads, head_dim 128, bf16), an indexed
context of ``--context`` tokens, ``--steps`` decode steps (append + fused decode) crossing
one update block; prints the median and the largest step time of each mode.

    .venv/bin/python bench/update_stall.py --context 16384
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm_retro.buffer import WaveBufferManager  # noqa: E402
from vllm_retro.config import RetroConfig  # noqa: E402
from vllm_retro.index import WaveIndex  # noqa: E402
from vllm_retro.index.batched import decode_batch  # noqa: E402

HQ, HKV, D = 32, 8, 128


def run(rounds: int, context: int, steps: int) -> list[float]:
    """Per-step seconds of ``steps`` decode steps starting right before a block is due."""
    g = torch.Generator().manual_seed(0)
    cfg = RetroConfig(update_rounds_per_step=rounds, kmeans_iters=10)
    k = torch.randn(HKV, context, D, generator=g).bfloat16()
    v = torch.randn(HKV, context, D, generator=g).bfloat16()
    manager = WaveBufferManager(cfg)  # the serving path's store
    store = manager.store("r", HKV, D, torch.bfloat16, "cpu", layer="L0")
    index = WaveIndex.build(k, v, cfg, store=store)
    store.settle()  # as the serving runtime does: the prefill's layout is part of its build
    while index.num_tokens - index.window_start < cfg.local_window + cfg.update_segment - 5:
        index.append(torch.randn(HKV, 1, D).bfloat16(), torch.randn(HKV, 1, D).bfloat16())
    times = []
    for _ in range(steps):
        q = torch.randn(1, HQ, D, generator=g).bfloat16()
        kk, vv = torch.randn(HKV, 1, D, generator=g).bfloat16(), torch.randn(HKV, 1, D).bfloat16()
        t = time.perf_counter()
        index.append(kk, vv)
        decode_batch([index], q, D ** -0.5)
        times.append(time.perf_counter() - t)
    assert index.num_updates == 1
    manager.close()
    return times


def main() -> None:
    """Print both modes' step times."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    for rounds in (0, 1):
        t = run(rounds, args.context, args.steps)
        print(f"update_rounds_per_step={rounds}: median step {statistics.median(t) * 1e3:.2f} ms, "
              f"largest {max(t) * 1e3:.2f} ms, next {sorted(t)[-2] * 1e3:.2f} / "
              f"{sorted(t)[-3] * 1e3:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
