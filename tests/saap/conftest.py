"""Fixtures: a tiny random Llama (2 layers, 4 heads over 2 KV heads, head_dim 32)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_model import build_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with its tokenizer (built once per session)."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-saap"))
