"""Pytest plugin: session fixtures backed by real pretrained models (Qwen2.5-Coder-0.5B-Instruct,
Gemma 3 270M).

Enable it from ``tests/conftest.py`` (see the repository's test wiring).  Fixtures:

* ``qwen_model_dir`` -- the converted safetensors directory (built once, ~1-2 min, then cached);
* ``gemma_model_dir`` -- the same for Gemma 3 270M (base model; built once, about a minute);
* ``qwen_capture`` -- post-RoPE Q/K/V + attention outputs of layers ``(2, 8, 10, 15, 22)`` on 4096
  tokens of real English prose, cached as a ``.pt`` file under
  ``default_cache_dir()/fixtures/`` (first build ~30 s, later loads well under a second).

Builds are serialised across processes (pytest-xdist workers) with a file lock and published
atomically, so concurrent sessions never see a half-written file.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures import build_qwen_capture
from vllm_retro.models import ensure_gemma3_270m, ensure_qwen_coder


@contextlib.contextmanager
def _uncaptured(config: pytest.Config) -> Iterator[None]:
    """Let one-time build progress reach the terminal even while pytest captures output."""
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is None:
        yield
        return
    with capman.global_and_fixture_disabled():
        yield


@pytest.fixture(scope="session")
def qwen_model_dir(pytestconfig: pytest.Config) -> Path:
    """Converted safetensors directory of Qwen2.5-Coder-0.5B-Instruct (built on first use)."""
    with _uncaptured(pytestconfig):
        return ensure_qwen_coder()


@pytest.fixture(scope="session")
def gemma_model_dir(pytestconfig: pytest.Config) -> Path:
    """Converted safetensors directory of Gemma 3 270M, the base model (built on first use)."""
    with _uncaptured(pytestconfig):
        return ensure_gemma3_270m()


@pytest.fixture(scope="session")
def qwen_capture(pytestconfig: pytest.Config) -> dict[str, Any]:
    """Real post-RoPE Q/K/V captured from Qwen2.5-Coder-0.5B-Instruct; see
    :func:`build_qwen_capture` for the layout."""
    with _uncaptured(pytestconfig):
        return build_qwen_capture()
