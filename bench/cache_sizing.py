"""The wave buffer's device cache at short contexts: hit ratio on real attention data with
the cache sized as it is (:meth:`RetroConfig.cache_tokens`: 5% of the KV, at least 5/1.8
times the retrieval zone's floor) against ``cache_fraction`` alone (the rule before
2026-11-29), in one run.

Data: the Qwen2.5-Coder-0.5B capture of ``tests/fixtures.py`` (4096 prose tokens, layers
2, 8, 10, 15 and 22): each layer's first 3840 tokens are indexed into a buffer-backed wave
index and its last 256 queries decoded in order (``tests.fixtures.hit_ratios``, the replay
of ``tests/buffer/test_real_data.py``). At 4K the
retrieval zone's floor (16 clusters, ~256 tokens) is larger than a 5% cache (~190 tokens).
Prints and writes ``bench/results/cache_sizing_qwen_4k_cpu.json``.

    .venv/bin/python bench/cache_sizing.py [--layers 0 8 16]
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import sys
from unittest import mock

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.fixtures import build_qwen_capture, hit_ratios  # noqa: E402
from vllm_retro.config import RetroConfig  # noqa: E402


def fraction_only(self: RetroConfig, tokens: int) -> int:
    """The device cache budget before the floor-following rule: ``cache_fraction`` alone."""
    if self.cache_pages is not None:
        return self.cache_pages * self.page_size
    return math.ceil(self.cache_fraction * max(0, int(tokens)) - 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=None, help="default: all")
    ap.add_argument("--out", type=pathlib.Path,
                    default=ROOT / "bench" / "results" / "cache_sizing_qwen_4k_cpu.json")
    args = ap.parse_args()
    capture = build_qwen_capture()
    if args.layers is not None:
        capture = dict(capture, layers={k: v for k, v in capture["layers"].items()
                                        if int(k) in args.layers})
    cfg = RetroConfig()
    now = hit_ratios(capture, cfg)
    with mock.patch.object(RetroConfig, "cache_tokens", fraction_only):
        before = hit_ratios(capture, cfg)
    rows = []
    print("layer  token-hit: fraction only -> floor-following")
    for layer in sorted(now):
        a, b = before[layer]["token_hit_ratio"], now[layer]["token_hit_ratio"]
        rows.append({"layer": layer, "fraction_only": before[layer], "floor_following": now[layer]})
        print(f"{layer:>5}  {a:.3f} -> {b:.3f}")
    mean_a = statistics.mean(r["fraction_only"]["token_hit_ratio"] for r in rows)
    mean_b = statistics.mean(r["floor_following"]["token_hit_ratio"] for r in rows)
    tokens = 3840
    print(f" mean  {mean_a:.3f} -> {mean_b:.3f}  (cache per KV head: "
          f"{fraction_only(cfg, tokens)} -> {cfg.cache_tokens(tokens)} tokens of ~{tokens})")
    args.out.write_text(json.dumps({
        "data": "Qwen2.5-Coder-0.5B capture, 3840 tokens indexed, 256 decode queries per layer",
        "config": cfg.to_dict(), "cache_tokens": {"fraction_only": fraction_only(cfg, tokens),
                                                  "floor_following": cfg.cache_tokens(tokens)},
        "mean_token_hit_ratio": {"fraction_only": mean_a, "floor_following": mean_b},
        "layers": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
