"""vllm_retro.capture: real prose and post-RoPE Q/K/V capture from a HF causal LM.

The ``real_model`` tests use the ``qwen_capture`` session fixture from
``tests/conftest_real.py`` (first run: ~30 s to capture; cached after).
"""

from __future__ import annotations

import pytest
import torch

from vllm_retro.capture import (
    apply_rope,
    causal_attention,
    real_prose,
    relative_error,
    rotate_half,
)

# --------------------------------------------------------------------------- fast unit tests


def test_real_prose_deterministic() -> None:
    a, b = real_prose(20_000), real_prose(20_000)
    assert a == b and len(a) >= 20_000
    assert real_prose(50_000).startswith(a)
    assert sum(c.isalpha() for c in a) > 0.6 * len(a)  # prose, not binary


def test_rope_is_a_rotation() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, generator=g, dtype=torch.float64)
    theta = torch.randn(5, 4, generator=g, dtype=torch.float64)
    emb = torch.cat((theta, theta), dim=-1)
    y = apply_rope(x, emb.cos(), emb.sin())
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(apply_rope(y, emb.cos(), -emb.sin()), x)
    torch.testing.assert_close(rotate_half(rotate_half(x)), -x)


# --------------------------------------------------------------------------- real model


def _qwen_rope(positions: torch.Tensor, head_dim: int = 64, theta: float = 1e6):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = positions.double()[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


@pytest.mark.real_model
def test_capture_shapes(qwen_capture: dict) -> None:
    cap = qwen_capture
    assert (cap["num_heads"], cap["num_kv_heads"], cap["head_dim"], cap["seq_len"]) == (
        14,
        2,
        64,
        4096,
    )
    assert cap["scale"] == pytest.approx(64**-0.5)
    assert sorted(cap["layers"]) == [2, 8, 10, 15, 22]
    for layer in cap["layers"].values():
        assert layer["q"].shape == (14, 256, 64) and layer["q"].dtype == torch.float32
        assert layer["o"].shape == (14, 256, 64)
        assert layer["k"].shape == (2, 4096, 64) and layer["v"].shape == (2, 4096, 64)
        assert layer["positions"].dtype == torch.int64
        assert torch.equal(layer["positions"], torch.arange(4096 - 256, 4096))
        for name in ("q", "k", "v", "o"):
            assert torch.isfinite(layer[name]).all()


@pytest.mark.real_model
def test_capture_reproduces_model_attention(qwen_capture: dict) -> None:
    """Causal GQA softmax attention over the captured (post-RoPE) q/k/v equals the model's own
    attention output; with RoPE undone, it does not (so the check really sees the rotation)."""
    cap = qwen_capture
    errors = {}
    for idx, layer in cap["layers"].items():
        q, k, v, o, pos = (layer[n] for n in ("q", "k", "v", "o", "positions"))
        errors[idx] = relative_error(causal_attention(q, k, v, pos, cap["scale"]), o)

        cos_k, sin_k = _qwen_rope(torch.arange(cap["seq_len"]))
        cos_q, sin_q = _qwen_rope(pos)
        k_pre = apply_rope(k.double(), cos_k, -sin_k).float()
        q_pre = apply_rope(q.double(), cos_q, -sin_q).float()
        assert relative_error(causal_attention(q_pre, k_pre, v, pos, cap["scale"]), o) > 1e-2
    print("relative L2 error per layer:", errors)
    assert all(e < 1e-4 for e in errors.values()), errors


