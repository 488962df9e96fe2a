"""The wave index on real attention data: per-layer output error and top-100 key recall.

Captures post-RoPE Q/K/V of Qwen2.5-Coder-0.5B-Instruct on 4096 tokens of real prose (the
test fixture's capture, cached under ~/.cache/vllm-retro), prefills the first 4032 tokens into
each policy's index and decodes the last 64 queries in order (``--queries`` fewer). Policies
at the same exact-token budget (the same steady zone plus, per decode step, as many indexed
tokens as the wave index's retrieval zone read; see :mod:`vllm_retro.index.baselines`): the
wave index (default budgets), the same retrieval without the estimation zone, Quest-style
pages, PQCache (2 sub-spaces x 6 bits), StreamingLLM (sinks + widened window), the exact
top-k oracle and RetrievalAttention's graph index (trained on the captured prefill queries
before the decoded ones: 192 of them at 64 decode steps, as a last prefill chunk). Writes
``bench/results/index_accuracy.json`` and ``.png`` and prints the table.

    .venv/bin/python bench/index_accuracy.py
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.fixtures import build_qwen_capture  # noqa: E402
from vllm_retro.config import RetroConfig  # noqa: E402
from vllm_retro.index.compare import compare_all  # noqa: E402

PQ = {"subspaces": 2, "bits": 6}


def run(config: RetroConfig, n_queries: int = 64, saap_file: str | None = None) -> dict:
    """Per-layer summaries of every policy on the Qwen capture (last ``n_queries`` queries);
    SAAP too when ``saap_file`` (trained for the Qwen model) is given."""
    cap = build_qwen_capture()
    saap = None
    if saap_file is not None:
        from vllm_retro.index.saap_model import load_saap
        from vllm_retro.models import ensure_qwen_coder

        saap = load_saap(saap_file, json.loads((ensure_qwen_coder() / "config.json").read_text()))
    layers = {}
    for layer, d in cap["layers"].items():
        t0 = time.perf_counter()
        q, pos = d["q"][:, -n_queries:], d["positions"][-n_queries:]
        res = compare_all(q, d["k"], d["v"], pos, cap["scale"], config, pq_options=PQ,
                          graph_queries=d["q"][:, :-n_queries], saap_model=saap,
                          layer=int(layer))
        layers[int(layer)] = {name: acc.summary() for name, acc in res.items()}
        print(f"layer {layer:>2} ({time.perf_counter() - t0:.1f} s)")
        for name, s in layers[int(layer)].items():
            print(f"   {name:<20} err mean {s['rel_err_mean']:.4f}  p90 {s['rel_err_p90']:.4f}"
                  f"  top-100 recall {s['recall_mean']:.3f}  retrieved {s['retrieved_tokens']:.0f}")
    return {
        "model": "Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, dequantised, fp32)",
        "context_tokens": cap["seq_len"],
        "decode_queries": n_queries,
        "budget_rule": "same steady zone; per step, as many indexed tokens per KV head as the "
                       "wave index's retrieval zone read (mean over KV heads); Quest rounds to "
                       "16-token pages; no estimation zone except 'wave'",
        "pqcache": PQ,
        "saap_file": None if saap is None else {
            "path": saap_file, "buckets": saap.num_buckets, "training": saap.training,
            "held_out_quality": saap.quality},
        "config": config.to_dict(),
        "layers": layers,
    }


def table(result: dict) -> str:
    """Markdown table: per layer and policy, error mean / p90, top-100 recall, tokens."""
    rows = ["| layer | policy | rel err mean | rel err p90 | top-100 recall | retrieved |",
            "|---|---|---|---|---|---|"]
    for layer, by in sorted(result["layers"].items()):
        for name, s in by.items():
            rows.append(f"| {layer} | {name} | {s['rel_err_mean']:.4f} | {s['rel_err_p90']:.4f}"
                        f" | {s['recall_mean']:.3f} | {s['retrieved_tokens']:.1f} |")
    names = list(next(iter(result["layers"].values())))
    for name in names:
        vals = [by[name] for by in result["layers"].values()]
        mean = {k: sum(v[k] for v in vals) / len(vals) for k in vals[0]}
        rows.append(f"| mean | {name} | {mean['rel_err_mean']:.4f} | {mean['rel_err_p90']:.4f}"
                    f" | {mean['recall_mean']:.3f} | {mean['retrieved_tokens']:.1f} |")
    return "\n".join(rows)


def plot(result: dict, path: pathlib.Path) -> None:
    """Grouped bars per layer and policy: mean relative error (top), top-100 recall (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = sorted(result["layers"])
    names = list(result["layers"][layers[0]])
    fig, axes = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    w = 0.8 / len(names)
    for ax, key, label in ((axes[0], "rel_err_mean", "mean relative L2 error vs full attention"),
                           (axes[1], "recall_mean", "top-100 key recall")):
        for i, name in enumerate(names):
            ys = [result["layers"][layer][name][key] for layer in layers]
            ax.bar([x + i * w for x in range(len(layers))], ys, w, label=name)
        ax.set_ylabel(label)
    axes[1].set_xticks([x + w * (len(names) - 1) / 2 for x in range(len(layers))],
                       [f"layer {layer}" for layer in layers])
    axes[0].set_title(f"Qwen2.5-Coder-0.5B, {result['context_tokens']} tokens, "
                      f"{result['decode_queries']} decode steps, same exact-token budget")
    axes[0].legend(ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results")
    ap.add_argument("--queries", type=int, default=64, help="decode steps per layer (<= 256)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (small tensors: 1 avoids contention)")
    ap.add_argument("--saap-file", help="a SAAP file trained for Qwen2.5-Coder-0.5B "
                    "(`vllm-retro calibrate --out FILE`): adds SAAP at the same budget")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result = run(RetroConfig(), args.queries, args.saap_file)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "index_accuracy.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "index_accuracy.png")
    print(table(result))
    print(f"wrote {args.out / 'index_accuracy.json'} and .png")


if __name__ == "__main__":
    main()
