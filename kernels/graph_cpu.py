"""The graph index's CPU kernels (``kernels/csrc/graph_cpu.cpp``): RoarGraph-style build,
insertion, best-first search and the fused decode step, reading keys in place from a key
pool. They are part of the project's single CPU extension
(:func:`vllm_retro.kernels.cpu_ext.load`, compiled by the README's setup command).

Their plain-Python references (the same functions, step by step) are in
:mod:`vllm_retro.index.graph` (``*_ref``), which callers run when :func:`load` returns None
(the extension cannot be built: the reason in :func:`load_error`).
"""

from __future__ import annotations

from typing import Any

from vllm_retro.kernels import cpu_ext


def load() -> Any:
    """The extension module (with ``graph_build``, ``graph_insert``, ``graph_search`` and
    ``graph_decode``), or None when it cannot be built."""
    return cpu_ext.load()


def load_error() -> str | None:
    """Why :func:`load` returned None (None if it did not, or was not called)."""
    return cpu_ext.load_error()
