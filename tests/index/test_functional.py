"""sparse_attention's input checking: every bad shape, dtype or value gets a clear error."""

import pytest
import torch

from vllm_retro.config import ConfigError, RetroConfig
from vllm_retro.index import sparse_attention

Q, K, V = torch.randn(8, 64), torch.randn(2, 100, 64), torch.randn(2, 100, 64)


@pytest.mark.parametrize("q,k,v,match", [
    (torch.randn(1, 8, 64), K, V, r"query has shape \(1, 8, 64\); expected 2 dims"),
    (Q, torch.randn(100, 64), V, r"keys has shape \(100, 64\); expected 3 dims"),
    (Q, K, torch.randn(2, 99, 64), r"keys \(2, 100, 64\) and values \(2, 99, 64\) differ"),
    (torch.randn(8, 32), K, V, r"head_dim of query \(32\) and keys \(64\) differ"),
    (torch.randn(8, 16), torch.randn(2, 10, 16), torch.randn(2, 10, 16),
     r"head_dim=16 is unsupported; accepted: 32 to 256"),
    (torch.randn(8, 512), torch.randn(2, 10, 512), torch.randn(2, 10, 512),
     r"head_dim=512 is unsupported; accepted: 32 to 256"),
    (torch.randn(7, 64), K, V, r"num_heads=7 must be a positive multiple of num_kv_heads=2"),
    (Q, torch.randn(2, 0, 64), torch.randn(2, 0, 64), r"seq_len=0; accepted: at least 1"),
])
def test_bad_shapes(q, k, v, match):
    with pytest.raises(ValueError, match=match):
        sparse_attention(q, k, v)


def test_bad_dtypes():
    with pytest.raises(TypeError, match=r"query has dtype torch.int64; accepted: float32"):
        sparse_attention(Q.long(), K, V)
    with pytest.raises(TypeError, match=r"dtypes differ: query torch.float16"):
        sparse_attention(Q.half(), K, V)
    with pytest.raises(TypeError, match=r"keys must be a torch.Tensor, got list"):
        sparse_attention(Q, [1, 2], V)


@pytest.mark.parametrize("scale", [0, -1.0, "x"])
def test_bad_scale(scale):
    with pytest.raises(ValueError, match=r"scale=.* accepted: a positive number"):
        sparse_attention(Q, K, V, scale=scale)


def test_bad_config_fails_before_work():
    with pytest.raises(ConfigError, match=r"retrieval_budget=1.5 is invalid; accepted: .*\(0"):
        sparse_attention(Q, K, V, RetroConfig(retrieval_budget=1.5))
