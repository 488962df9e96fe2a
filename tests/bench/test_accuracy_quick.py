"""The accuracy harness's CI mode end to end: single needle, full vs retro, real Qwen model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.machine import model_dtype

pytestmark = pytest.mark.real_model

ROOT = Path(__file__).resolve().parents[2]


def test_quick_mode_retro_keeps_full_attention_accuracy(qwen_model_dir, tmp_path):
    out = tmp_path / "accuracy_quick.json"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.accuracy", "--quick", "--model", str(qwen_model_dir),
         "--out", str(out), "--dtype", "auto"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert out.with_suffix(".png").is_file()
    assert result["dtype"] == model_dtype()
    assert result["tasks"] == ["niah_single"] and list(result["configs"]) == ["full", "retro"]
    assert result["gate_failed"] == [] and result["margin"] == pytest.approx(0.34)
    for run in result["runs"]:
        assert len(run["samples"]) == 3
        assert all(abs(s["prompt_tokens"] - 2560) < 100 for s in run["samples"])
    # Qwen2.5-Coder-0.5B finds the needle with full attention; retro stays within the margin.
    assert result["mean"]["full"] == 1.0, result["runs"][0]["samples"]
    assert result["mean"]["retro"] >= 1.0 - 0.34
    assert "| niah_single |" in proc.stdout
