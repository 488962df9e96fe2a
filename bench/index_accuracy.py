"""The wave index on real attention data: per-layer output error and top-100 key recall.

Captures post-RoPE Q/K/V of Qwen2.5-Coder-0.5B-Instruct on 4096 tokens of real prose (the
test fixture's capture, cached under ~/.cache/vllm-retro), prefills the first 4032 tokens into
each policy's index and decodes the last 64 queries in order. Policies at the same exact-token
budget: the wave index (default budgets), the same retrieval without the estimation zone, and a
Quest-style page ranking. Writes ``bench/results/index_accuracy.json`` and ``.png``.

    .venv/bin/python bench/index_accuracy.py
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.conftest_real import build_qwen_capture  # noqa: E402
from vllm_retro.config import RetroConfig  # noqa: E402
from vllm_retro.index.evaluate import compare_policies  # noqa: E402


def run(config: RetroConfig) -> dict:
    """Per-layer summaries of every policy on the Qwen capture."""
    cap = build_qwen_capture()
    layers = {}
    for layer, d in cap["layers"].items():
        t0 = time.perf_counter()
        q, pos = d["q"][:, -64:], d["positions"][-64:]  # the last 64 decode queries
        res = compare_policies(q, d["k"], d["v"], pos, cap["scale"], config)
        layers[int(layer)] = {name: acc.summary() for name, acc in res.items()}
        print(f"layer {layer:>2} ({time.perf_counter() - t0:.1f} s)")
        for name, s in layers[int(layer)].items():
            print(f"   {name:<20} err mean {s['rel_err_mean']:.4f}  p90 {s['rel_err_p90']:.4f}"
                  f"  top-100 recall {s['recall_mean']:.3f}  retrieved {s['retrieved_tokens']:.0f}")
    return {
        "model": "Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, dequantised, fp32)",
        "context_tokens": cap["seq_len"],
        "decode_queries": 64,
        "config": config.to_dict(),
        "layers": layers,
    }


def plot(result: dict, path: pathlib.Path) -> None:
    """Grouped bars of the mean relative error per layer and policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = sorted(result["layers"])
    names = list(result["layers"][layers[0]])
    fig, ax = plt.subplots(figsize=(8, 4))
    w = 0.8 / len(names)
    for i, name in enumerate(names):
        ys = [result["layers"][layer][name]["rel_err_mean"] for layer in layers]
        ax.bar([x + i * w for x in range(len(layers))], ys, w, label=name)
    ax.set_xticks([x + w * (len(names) - 1) / 2 for x in range(len(layers))],
                  [f"layer {layer}" for layer in layers])
    ax.set_ylabel("mean relative L2 error vs full attention")
    ax.set_title(f"Qwen2.5-Coder-0.5B, {result['context_tokens']} tokens, same exact-token budget")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    result = run(RetroConfig())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "index_accuracy.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "index_accuracy.png")
    print(f"wrote {args.out / 'index_accuracy.json'} and .png")


if __name__ == "__main__":
    main()
