"""Engine fixtures: a tiny locally built Llama, and in-process vLLM engines on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.tiny_model import build_tiny_llama  # noqa: E402
from tests.vllm.engines import SAAP_BUCKETS  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama (4 heads over 2 KV heads, head_dim 32, fp32) with its tokenizer."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def saap_file(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SAAP file calibrated for the tiny model (:data:`SAAP_BUCKETS` buckets; layer 0
    dense)."""
    from vllm_retro.saap.calibrate import Settings, calibrate

    out = tmp_path_factory.mktemp("saap") / "tiny.saap"
    calibrate(tiny_model_dir, out, Settings(buckets=SAAP_BUCKETS, hidden=16, tokens=1280,
                                            prompt_tokens=640, query_samples=32, steps=20,
                                            eval_probes=2),
              progress=False, log=lambda _: None)
    return out


@pytest.fixture
def inprocess(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run engines in this process (fast start, direct access to the worker runtime)."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
