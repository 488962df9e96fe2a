"""bench/layer_error.py's evaluation: per-layer error of replayed decode steps vs dense."""

from __future__ import annotations

import math

import torch

from bench.layer_error import layer_errors, relative_error
from vllm_retro.config import RetroConfig


def _data(prompt: int = 3000, steps: int = 3, hkv: int = 2, hq: int = 4, d: int = 32):
    g = torch.Generator().manual_seed(0)
    n = prompt + steps
    layer = {"k": torch.randn(hkv, n, d, generator=g), "v": torch.randn(hkv, n, d, generator=g),
             "q": torch.randn(hq, steps, d, generator=g) * 2, "prompt_tokens": prompt}
    return {"scale": d ** -0.5, "requests": {"r0": {"model.layers.3.self_attn.attn": layer}}}


def test_full_budget_replays_exactly_and_default_budgets_do_not():
    data = _data()
    full = layer_errors(data, RetroConfig(retrieval_budget=1.0, estimation_budget=0.0,
                                          segment_size=512, local_window=16))
    sparse = layer_errors(data, RetroConfig(segment_size=512, local_window=16))
    assert list(full) == list(sparse) == [3]
    assert relative_error(torch.ones(2, 3), torch.ones(2, 3).double()).abs().max() == 0
    assert full[3] < 1e-5, full
    assert math.isfinite(sparse[3]) and sparse[3] > 10 * full[3], (full, sparse)
