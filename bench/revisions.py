"""A benchmark of this tree against another git revision, in one run: each revision in a
process of its own on its own checkout, the two in alternating order.

A benchmark script with a ``--worker`` mode (it times in its own process, importing the
package from the directory an environment variable names, and prints one JSON line) makes
its parser with :func:`parser` and runs with :func:`run` (or :func:`alternate`): the script
itself (this tree's) runs for every revision, only the package it imports changes.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def checkout(rev: str) -> tuple[str, pathlib.Path]:
    """(short sha, a temporary worktree of ``rev``)."""
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.strip()
    path = pathlib.Path(tempfile.mkdtemp(prefix=f"retro-bench-{sha}-"))
    subprocess.run(["git", "worktree", "add", "--detach", "-f", str(path), sha], cwd=ROOT,
                   check=True, capture_output=True)
    return sha, path


def alternate(script: str, argv: list[str], rev: str | None, rounds: int, root_env: str
              ) -> tuple[dict[str, list[dict]], str | None]:
    """Run ``script argv --worker`` ``rounds`` times for this tree (named 'tree') and, with
    ``rev`` (a git revision, or the directory of a checkout of one, its extension built
    there), for that revision, alternating which goes first; each run gets the root to
    import the package from in ``$root_env``. Returns each name's parsed last output lines
    (the revision's name: its short sha) and the revision as recorded (the sha, with the
    directory when given one; None without ``rev``). A temporary worktree is removed at the
    end."""
    roots: dict[str, pathlib.Path] = {"tree": ROOT}
    worktree, label = None, None
    if rev and os.path.isdir(rev):
        path = pathlib.Path(rev).resolve()
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=path, check=True,
                             capture_output=True, text=True).stdout.strip()
        roots[sha], label = path, f"{sha} ({path})"
    elif rev:
        sha, worktree = checkout(rev)
        roots[sha], label = worktree, sha  # recorded by its commit, not by a moving name
    runs: dict[str, list[dict]] = {name: [] for name in roots}
    try:
        for r in range(rounds):
            for name in (list(roots) if r % 2 == 0 else list(roots)[::-1]):
                proc = subprocess.run([sys.executable, script, *argv, "--worker"],
                                      env={**os.environ, root_env: str(roots[name])},
                                      check=True, capture_output=True, text=True)
                runs[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    finally:
        if worktree is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT,
                           capture_output=True)
    return runs, label


def parser(description: str, batches: list[int], context: int, kv_heads: int, group: int,
           head_dim: int, steps: int, rounds: int) -> argparse.ArgumentParser:
    """The options such a benchmark shares (the layer's shape, the batches, the revision)
    with these defaults; the script adds its own."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--rev", default=None,
                    help="git revision to compare with, or the directory of a checkout of it "
                         "(none: tree only)")
    ap.add_argument("--batches", type=int, nargs="+", default=batches)
    ap.add_argument("--context", type=int, default=context)
    ap.add_argument("--kv-heads", type=int, default=kv_heads)
    ap.add_argument("--group", type=int, default=group)
    ap.add_argument("--head-dim", type=int, default=head_dim)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=pathlib.Path, default=None)
    return ap


def run(ap: argparse.ArgumentParser, script: str, worker, root_env: str
        ) -> tuple[argparse.Namespace, dict[str, list[dict]], dict] | None:
    """Parse the command line; as a worker, print ``worker(args)`` as JSON and return None;
    else run the revisions (:func:`alternate`) and return the arguments (``rev`` as
    recorded), the runs, and the result to fill and write: its arguments, and its "cases"
    empty."""
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return None
    runs, args.rev = alternate(str(pathlib.Path(script).resolve()), sys.argv[1:], args.rev,
                               args.rounds, root_env)
    kept = {k: v for k, v in vars(args).items() if k not in ("worker", "out")}
    return args, runs, {"args": kept, "cases": {}}
