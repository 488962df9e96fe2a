"""Command line: ``python -m bench.accuracy [--contexts 4096 8192] [--tasks ...] [--configs ...]
[--samples N] [--out bench/results/accuracy_{ctx}.json] [--quick] [--margin M]
[--dtype D]``.

Generates the samples, serves them under each configuration (one engine at a time), prints the
task x config table and writes one JSON (+ PNG bar plot) per context. With ``--quick`` (CI):
single-needle only, one ~2.5K-token context, ``full`` and ``retro``, 3 samples, and the exit
status is 1 if retro's mean accuracy is below full attention's by more than ``--margin``.
"""

from __future__ import annotations

import argparse
import functools
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from bench.accuracy.report import plot, summarize, table, write_json
from bench.accuracy.runner import CONFIGS, make_samples, run_config, settings, tokenizer_fns
from bench.accuracy.tasks import TASKS
from bench.machine import model_dtype

MODEL_NAME = "Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF dequantised)"
QUICK = {"tasks": ["niah_single"], "contexts": [2560], "configs": ["full", "retro"],
         "samples": 3}
#: With 3 quick samples one answer flipping (0.33) is tolerated, two (0.67) fail the gate.
QUICK_MARGIN = 0.34


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed command line (``--quick`` fills in unset options with :data:`QUICK`)."""
    ap = argparse.ArgumentParser(prog="python -m bench.accuracy",
                                 description="End-to-end long-context accuracy of retro vs "
                                             "stock vLLM on synthetic RULER-style tasks.")
    ap.add_argument("--contexts", type=int, nargs="+", help="target prompt lengths, tokens "
                    "(default 4096 8192)")
    ap.add_argument("--tasks", nargs="+", choices=list(TASKS), help="default: all")
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), help="default: all")
    ap.add_argument("--samples", type=int, help="samples per task and context (default 2)")
    ap.add_argument("--seed", type=int, default=0, help="first sample seed")
    ap.add_argument("--out", help="JSON path; '{ctx}' is replaced by the context length "
                    "(default bench/results/accuracy_{ctx}.json, accuracy_quick.json "
                    "with --quick); the PNG goes next to it")
    ap.add_argument("--quick", action="store_true", help="small CI run with a pass/fail gate")
    ap.add_argument("--margin", type=float, help="fail (exit 1) if a config's mean accuracy is "
                    f"below full's by more than this (default {QUICK_MARGIN} with --quick, "
                    "else no gate)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32", "auto"], default="bfloat16",
                    help="the engines' dtype (default bfloat16, the model's own; 'auto': "
                    "float32 on a CPU without native bf16, where bf16 runs several times "
                    "slower, see bench/machine.py)")
    ap.add_argument("--chunk", type=int, help="serve N prompts at a time and checkpoint after "
                    "each batch, so an interrupted run resumes mid-configuration (default: "
                    "all of a configuration's prompts in one batch, one checkpoint after it)")
    ap.add_argument("--model", help="model directory (default: ensure_qwen_coder())")
    ap.add_argument("--saap-file", help="the model's SAAP file (`vllm-retro calibrate MODEL "
                    "--out FILE`), for the 'saap' configuration (default configurations "
                    "include it only when given)")
    args = ap.parse_args(argv)
    every = [c for c in CONFIGS if c != "saap" or args.saap_file]
    defaults: dict[str, Any] = (dict(QUICK) if args.quick else
                                {"tasks": list(TASKS), "contexts": [4096, 8192],
                                 "configs": every, "samples": 2})
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.out is None:
        args.out = ("bench/results/accuracy_quick.json" if args.quick
                    else "bench/results/accuracy_{ctx}.json")
    if len(args.contexts) > 1 and "{ctx}" not in args.out:
        ap.error("--out needs '{ctx}' when several contexts are run")
    if args.dtype == "auto":
        args.dtype = model_dtype()
    if args.margin is None and args.quick:
        args.margin = QUICK_MARGIN
    return args


def gate(summary: dict[str, Any], margin: float) -> list[str]:
    """Configurations whose mean accuracy is below ``full``'s by more than ``margin``."""
    full = summary["mean"].get("full")
    if full is None:
        return []
    return [c for c, m in summary["mean"].items() if m < full - margin - 1e-9]


def resumed_runs(partial: Path, command: str, configs: list[str]) -> list[dict[str, Any]]:
    """Finished runs from an interrupted run of the same command (its checkpoint file).

    Returns the checkpoint's runs when it was written by exactly ``command`` and they
    are a prefix of ``configs``; else an empty list (a different command starts over). The
    last may be unfinished (``"complete": False``, written with ``--chunk``): the caller
    resumes it.
    """
    if not partial.exists():
        return []
    try:
        saved = json.loads(partial.read_text())
    except (OSError, ValueError):
        return []
    runs = saved.get("runs", [])
    done = [r.get("config") for r in runs]
    if saved.get("command") != command or done != configs[:len(done)]:
        return []
    if runs:
        print(f"resuming from {partial}: " + ", ".join(
            f"{r['config']} ({len(r.get('samples', []))} answers so far)"
            if r.get("complete") is False else r["config"] for r in runs))
    return runs


def write_checkpoint(partial: Path, command: str, ctx: int, runs: list[dict[str, Any]],
                     run: dict[str, Any] | None = None) -> None:
    """Write the checkpoint of ``command`` at ``ctx``: the finished ``runs``, and ``run``, an
    unfinished one, after them when given."""
    write_json({"command": command, "context_tokens": ctx, "complete": False,
                "runs": runs + ([run] if run is not None else [])}, partial)


def main(argv: list[str] | None = None) -> int:
    """Run the harness; returns the exit status (1 when the accuracy gate fails)."""
    args = parse_args(argv)
    from vllm_retro.models import ensure_qwen_coder

    model_dir = Path(args.model) if args.model else ensure_qwen_coder()
    command = "python -m bench.accuracy " + shlex.join(sys.argv[1:] if argv is None else argv)
    render, count_tokens = tokenizer_fns(model_dir)
    failed: list[str] = []
    for ctx in args.contexts:
        samples = make_samples(args.tasks, [ctx], args.samples, args.seed, render, count_tokens)
        t0 = time.perf_counter()
        out = Path(args.out.replace("{ctx}", str(ctx)))
        partial = out.with_suffix(".partial.json")
        runs = resumed_runs(partial, command, args.configs)
        unfinished = runs.pop() if runs and runs[-1].get("complete") is False else None
        for c in args.configs[len(runs):]:
            # checkpoints: within the configuration with --chunk, and after it, so an
            # interrupted long run keeps its results
            save = functools.partial(write_checkpoint, partial, command, ctx, list(runs))
            runs.append(run_config(model_dir, c, samples, saap_file=args.saap_file,
                                   dtype=args.dtype, chunk=args.chunk, done=unfinished,
                                   checkpoint=save))
            unfinished = None
            write_checkpoint(partial, command, ctx, runs)
        summary = summarize(runs, args.tasks)
        title = f"accuracy at {ctx} tokens ({args.samples} samples/task)"
        print(table(summary, f"\n{title}\n"))
        for c, missed in summary.get("missed_where_full_right", {}).items():
            print(f"{c}: wrong on {len(missed)} sample(s) full attention answers right"
                  + (f" ({', '.join(missed)})" if missed else ""))
        print("wall time per config: " + ", ".join(
            f"{r['config']} {r['wall_s']:.0f} s" for r in runs))
        result = {
            "command": command, "model": MODEL_NAME, "model_dir": str(model_dir),
            "dtype": args.dtype,
            "context_tokens": ctx, "tasks": args.tasks, "samples_per_task": args.samples,
            "seeds": list(range(args.seed, args.seed + args.samples)),
            "configs": {c: settings(c, args.saap_file) for c in args.configs},
            "decoding": "greedy (temperature 0), max_tokens per task",
            "wall_s": round(time.perf_counter() - t0, 1),
            "wall_s_per_config": {r["config"]: r["wall_s"] for r in runs},
            **summary,
            "runs": runs,
        }
        if args.margin is not None:
            result["margin"] = args.margin
            bad = gate(summary, args.margin)
            result["gate_failed"] = bad
            failed += [f"{c}@{ctx}" for c in bad]
        write_json(result, out)
        plot(summary, out.with_suffix(".png"), title)
        out.with_suffix(".partial.json").unlink(missing_ok=True)
        print(f"wrote {out} and {out.with_suffix('.png')}")
    if failed:
        print(f"accuracy gate failed (margin {args.margin}): {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
