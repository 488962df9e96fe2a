"""Summaries of a run: accuracy per task and configuration, the text table, JSON and a plot."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def summarize(runs: Sequence[dict[str, Any]], tasks: Sequence[str]) -> dict[str, Any]:
    """Mean scores of each ``run_config`` result: ``{"accuracy": {task: {config: mean}},
    "mean": {config: mean over tasks}, "delta_vs_full": {config: mean - full's mean}}``
    (the delta only when a ``full`` run is present). Scores are in [0, 1]."""
    acc: dict[str, dict[str, float]] = {t: {} for t in tasks}
    for run in runs:
        for t in tasks:
            scores = [r["score"] for r in run["samples"] if r["task"] == t]
            if scores:
                acc[t][run["config"]] = round(sum(scores) / len(scores), 4)
    configs = [run["config"] for run in runs]
    mean = {c: round(sum(acc[t][c] for t in tasks if c in acc[t])
                     / max(1, sum(c in acc[t] for t in tasks)), 4) for c in configs}
    out: dict[str, Any] = {"accuracy": acc, "mean": mean}
    if "full" in mean:
        out["delta_vs_full"] = {c: round(mean[c] - mean["full"], 4) for c in configs}
        out["missed_where_full_right"] = paired_misses(runs)
    return out


def paired_misses(runs: Sequence[dict[str, Any]]) -> dict[str, list[str]]:
    """Per configuration, the samples (``task:seed``) that ``full`` answers fully right and
    it does not."""
    by = {run["config"]: {(r["task"], r["seed"]): r["score"] for r in run["samples"]}
          for run in runs}
    right = {k for k, s in by.get("full", {}).items() if s >= 1.0}
    return {c: [f"{t}:{s}" for (t, s) in sorted(right) if scores.get((t, s), 0.0) < 1.0]
            for c, scores in by.items() if c != "full"}


def table(summary: dict[str, Any], title: str = "") -> str:
    """The summary as a Markdown table: one row per task, one column per configuration, then
    the mean over tasks and its delta against ``full``."""
    configs = list(summary["mean"])
    lines = [title] if title else []
    lines.append("| task | " + " | ".join(configs) + " |")
    lines.append("|---" * (len(configs) + 1) + "|")
    for task, row in summary["accuracy"].items():
        lines.append(f"| {task} | " + " | ".join(
            f"{row[c]:.2f}" if c in row else "-" for c in configs) + " |")
    lines.append("| **mean** | " + " | ".join(f"{summary['mean'][c]:.3f}" for c in configs)
                 + " |")
    if "delta_vs_full" in summary:
        lines.append("| delta vs full | " + " | ".join(
            f"{summary['delta_vs_full'][c]:+.3f}" for c in configs) + " |")
    return "\n".join(lines)


def write_json(result: dict[str, Any], path: Path) -> None:
    """Write ``result`` as indented JSON at ``path`` (parents created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def plot(summary: dict[str, Any], path: Path, title: str) -> None:
    """Grouped bar plot (PNG at ``path``): accuracy per task and the mean, one bar per config."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(summary["mean"])
    groups = [*summary["accuracy"], "mean"]
    rows = {**summary["accuracy"], "mean": summary["mean"]}
    width = 0.8 / len(configs)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(groups)), 4))
    for i, c in enumerate(configs):
        xs = [g + (i - (len(configs) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [rows[g].get(c, 0.0) for g in groups], width, label=c)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=20, ha="right")
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("accuracy (fraction of expected values found)")
    ax.set_title(title)
    ax.legend(fontsize="small", ncol=min(5, len(configs)))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
