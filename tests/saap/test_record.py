"""Recording de-RoPEd queries and keys: what the hooks keep is what the model rotates, and
the RoPE the serving index undoes is the model's own (tiny Llama; Qwen2.5 on real text)."""

from __future__ import annotations

import pytest
import torch

from vllm_retro.capture import capture_qkv
from vllm_retro.index.saap_model import ModelIdentity, derope, rope
from vllm_retro.saap import record


def _check_model(model_dir, n: int, layers: list[int]) -> None:
    model = record.load_causal_lm(model_dir, torch.float32)
    idn = record.model_identity(model)
    assert not idn.differs(ModelIdentity.of_directory(model_dir))
    tables = record.rope_tables(model)
    ids = torch.randint(20, 400, (n,), generator=torch.Generator().manual_seed(0))
    qpos = torch.tensor([0, 5, n // 2, n - 1])
    calls = []
    q_pre, k_pre = record.record_prompt(model, ids, qpos, on_layer=lambda: calls.append(1))
    assert len(calls) == idn.num_layers
    assert q_pre.shape == (idn.num_layers, idn.num_heads, 4, idn.head_dim)
    assert k_pre.shape == (idn.num_layers, idn.num_kv_heads, n, idn.head_dim)
    # capture_qkv rotates with the model's own cos/sin tables (transformers' RoPE)
    cap = capture_qkv(model, ids, layers, n_queries=n)
    pos = torch.arange(n)
    for layer in layers:
        k_post, q_post = cap[layer]["k"], cap[layer]["q"][:, qpos]
        torch.testing.assert_close(rope(k_pre[layer], pos, tables.inv_freq, tables.scale),
                                   k_post, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(rope(q_pre[layer], qpos, tables.inv_freq, tables.scale),
                                   q_post, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(derope(k_post, pos, tables.inv_freq, tables.scale),
                                   k_pre[layer], atol=2e-4, rtol=1e-4)


def test_recorded_vectors_are_the_models_de_roped_ones(tiny_llama):
    _check_model(tiny_llama, 300, [0, 1])


@pytest.mark.real_model
def test_qwen_rope_is_undone_exactly(qwen_model_dir):
    _check_model(qwen_model_dir, 160, [0, 13])
