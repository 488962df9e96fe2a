"""Server processes and ``/metrics`` reading for the HTTP tests (the process handling is the
product's own :mod:`server.process`; the Prometheus parsing is :mod:`bench.serve_metrics`)."""

from __future__ import annotations

from pathlib import Path

from bench import serve_metrics
from vllm_retro.server.process import ServerProcess as Server

__all__ = ["Server", "help_lines", "sample", "start_server"]


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
