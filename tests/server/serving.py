"""Server processes and ``/metrics`` reading for the HTTP tests (the process handling is the
product's own :mod:`server.process`; the Prometheus parsing is :mod:`bench.serve_metrics`)."""

from __future__ import annotations

from pathlib import Path

from bench import serve_metrics
from vllm_retro.server.process import ServerProcess as Server

__all__ = ["Server", "help_lines", "sample", "start_server", "unexpected_tracebacks"]


def unexpected_tracebacks(log_text: str) -> list[str]:
    """The exception lines of the tracebacks in a server log, less the one vLLM 0.32 may log
    during a clean drain: once ``[shutdown] MPClient`` cleans up it cancels its output task,
    and the API server's output handler, if still running, logs an EngineDeadError
    ("AsyncLLM output_handler failed") for it (a race inside vLLM, seen with and without
    retro)."""
    shutdown = log_text.find("[shutdown] MPClient: cleaning up background resources")
    found = []
    for i, line in enumerate(log_text.splitlines()):
        if "Traceback (most recent call last)" not in line:
            continue
        rest = log_text.splitlines()[i + 1:i + 40]
        exc = next((x for x in rest if "Error:" in x or "Exception:" in x), "?")
        benign = ("EngineDeadError" in exc and shutdown >= 0
                  and log_text.find(line) > shutdown)
        if not benign:
            found.append(exc.strip())
    return found


def start_server(args: list[str], log: Path, env: dict[str, str] | None = None) -> Server:
    """``vllm-retro serve ARGS`` on a free port with a 1 GiB CPU KV pool (unless ``env``
    says otherwise)."""
    return Server.start(args, log, {"VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})})


def sample(metrics_text: str, name: str, **labels: str) -> float:
    """The value of the samples ``name`` whose labels include ``labels`` (summed over the
    other labels); 0.0 when absent."""
    return serve_metrics.value(serve_metrics.parse(metrics_text), name, **labels)


def help_lines(metrics_text: str) -> dict[str, str]:
    """``# HELP`` text per family name."""
    out = {}
    for line in metrics_text.splitlines():
        if line.startswith("# HELP "):
            name, _, text = line[len("# HELP "):].partition(" ")
            out[name] = text
    return out
