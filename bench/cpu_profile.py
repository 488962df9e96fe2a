"""Where a CPU-tensor test spends its time on this machine: a diagnosis for hosts where the
CPU tests run far slower than on the dev machine (the lent H100's host ran some 10-100x
slower, cause unknown: ``bench/results/gpu_check_h100_2026-11-27/README.md``).

    python3 bench/cpu_profile.py [PYTEST_NODE_ID ...]

Prints torch's build and threading configuration, then runs the tests under cProfile and
prints the 30 functions with the most time of their own.
"""

from __future__ import annotations

import cProfile
import pathlib
import pstats
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT = ["tests/index/test_wave_index.py::test_updates_append_without_reclustering[0]",
           "tests/index/test_wave_index.py::test_full_budget_equals_full_attention"
           "[8-2-3000-64-8192]"]


def main(argv: list[str] | None = None) -> int:
    import pytest
    import torch

    tests = (sys.argv[1:] if argv is None else argv) or DEFAULT
    print(torch.__config__.parallel_info(), flush=True)
    print(f"torch {torch.__version__}, cuda available {torch.cuda.is_available()}", flush=True)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    rc = pytest.main(["-q", "-p", "no:cacheprovider", "--durations=5", *tests])
    prof.disable()
    print(f"tests: exit {rc} in {time.perf_counter() - t0:.1f} s", flush=True)
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    return int(rc)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
