"""Skips that mean a part of the product is missing fail the run under ``make test``.

A test skips where what it needs cannot exist on the machine (a CUDA GPU, kubectl, a second
core). It also skips where the install is broken — vLLM not importable, a C++ extension not
built — and a green run would then hide hundreds of tests that never ran. With
``VLLM_RETRO_REQUIRE_PARTS=1`` (``make test`` sets it) the second kind fails the session,
each such skip listed with its reason; without it (a developer running a subset) they stay
skips.
"""

from __future__ import annotations

import os

import pytest

MISSING_PART = (
    "could not import 'vllm'", "vLLM is not installed", "in the installed vLLM",
    "vllm_retro.vllm.metrics is not importable", "vLLM CPU attention unavailable",
    "extension not built", "fused CPU kernel is not built", "graph kernels unavailable",
    "ninja is not installed", "no C++ compiler on PATH",
    "could not import 'openai'", "could not import 'psutil'", "could not import 'msgspec",
)
"""Substrings of skip reasons that name a missing part of the project's own install."""

ENV = "VLLM_RETRO_REQUIRE_PARTS"

_missing: list[tuple[str, str]] = []


def _reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def _note(report: pytest.TestReport | pytest.CollectReport) -> None:
    if report.skipped:
        reason = _reason(report)
        if any(part in reason for part in MISSING_PART):
            _missing.append((report.nodeid, reason))


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _note(report)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _note(report)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ANN001
    if _missing and os.environ.get(ENV) == "1":
        terminalreporter.section("missing parts", sep="=", red=True, bold=True)
        terminalreporter.line(f"{len(_missing)} skip(s) because a part of the install is "
                              f"missing ({ENV}=1 makes them failures):")
        for nodeid, reason in _missing[:50]:
            terminalreporter.write_line(f"MISSING {nodeid}: {reason}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _missing and os.environ.get(ENV) == "1" and exitstatus in (
            pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
