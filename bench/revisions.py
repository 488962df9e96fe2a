"""A benchmark of this tree against another git revision, in one run: each revision in a
process of its own on its own checkout, the two in alternating order.

A benchmark script with a ``--worker`` mode (it times in its own process, importing the
package from the directory an environment variable names, and prints one JSON line) calls
:func:`alternate` from its main: the script itself (this tree's) runs for every revision,
only the package it imports changes.
"""

from __future__ import annotations

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
