"""``VllmCpuDecodeAttention`` (vLLM's CPU paged-attention kernel) against an fp64 SDPA reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench import vllm_cpu_attention as vca

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module", autouse=True)
def _require_vllm() -> None:
    """Skip the module cleanly when vLLM's CPU attention op cannot run in this process."""
    if not vca.available():
        pytest.skip(f"vLLM CPU attention unavailable: {vca.unavailable_reason()}")


def _reference(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float | None = None,
    seq_lens: list[int] | None = None,
) -> torch.Tensor:
    """fp64 SDPA with KV heads repeated per query group; ``seq_lens`` truncates each sequence."""
    batch, num_heads, _ = query.shape
    group = num_heads // keys.shape[1]
    outputs = []
    for b in range(batch):
        n = keys.shape[2] if seq_lens is None else seq_lens[b]
        k = keys[b, :, :n].double().repeat_interleave(group, 0)
        v = values[b, :, :n].double().repeat_interleave(group, 0)
        q = query[b, :, None].double()
        outputs.append(F.scaled_dot_product_attention(q, k, v, scale=scale)[:, 0])
    return torch.stack(outputs)


def _random(
    gen: torch.Generator,
    batch: int,
    heads: int,
    kv_heads: int,
    seq_len: int,
    dim: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh standard-normal query, keys and values in ``dtype``."""
    q = torch.randn(batch, heads, dim, generator=gen).to(dtype)
    k = torch.randn(batch, kv_heads, seq_len, dim, generator=gen).to(dtype)
    v = torch.randn(batch, kv_heads, seq_len, dim, generator=gen).to(dtype)
    return q, k, v


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute error relative to the largest reference magnitude."""
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("batch", "heads", "kv_heads", "seq_len", "dim", "block_size"),
    [
        (1, 8, 8, 1000, 128, None),  # MHA (GQA ratio 1), seq_len not a block multiple
        (2, 32, 8, 2048, 128, None),  # GQA 4, Llama-style
        (3, 14, 2, 777, 64, None),  # GQA 7, Qwen2.5-0.5B-style (kernel falls back to MHA tiles)
        (4, 16, 4, 4096, 64, 32),  # smallest allowed block size
        (8, 28, 4, 129, 128, 256),  # batch 8, one token past a 128 boundary, big blocks
    ],
)
def test_matches_sdpa(
    rng: torch.Generator,
    dtype: torch.dtype,
    batch: int,
    heads: int,
    kv_heads: int,
    seq_len: int,
    dim: int,
    block_size: int | None,
) -> None:
    """Output equals fp64 SDPA over all keys, for several shapes and GQA ratios."""
    q, k, v = _random(rng, batch, heads, kv_heads, seq_len, dim, dtype)
    attn = vca.VllmCpuDecodeAttention(k, v, heads, block_size=block_size)
    out = attn(q)
    assert out.shape == (batch, heads, dim) and out.dtype == dtype
    assert _rel_err(out, _reference(q, k, v)) < TOLERANCE[dtype]
    assert attn.kv_bytes == 2 * k.numel() * k.element_size()
    # Repeated calls (same cached KV, fresh query) stay correct.
    q2 = torch.randn(q.shape, generator=rng).to(dtype)
    assert _rel_err(attn(q2), _reference(q2, k, v)) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ragged_lengths_and_scale(rng: torch.Generator, dtype: torch.dtype) -> None:
    """Per-sequence lengths (ragged batch) and an explicit softmax scale."""
    q, k, v = _random(rng, 4, 32, 8, 1500, 128, dtype)
    lens = [1500, 1, 640, 1029]
    attn = vca.VllmCpuDecodeAttention(k, v, 32, scale=0.05, seq_lens=lens)
    ref = _reference(q, k, v, scale=0.05, seq_lens=lens)
    assert _rel_err(attn(q), ref) < TOLERANCE[dtype]
    assert attn.kv_bytes == 2 * sum(lens) * 8 * 128 * k.element_size()


def test_thread_count_change_rebuilds_plan(rng: torch.Generator) -> None:
    """The scheduler plan bakes in the OpenMP thread count; changing it must still work."""
    q, k, v = _random(rng, 2, 8, 2, 600, 64, torch.float32)
    attn = vca.VllmCpuDecodeAttention(k, v, 8)
    ref = _reference(q, k, v)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert _rel_err(attn(q), ref) < 1e-4
    finally:
        torch.set_num_threads(threads)
    assert _rel_err(attn(q), ref) < 1e-4


def test_rejects_bad_arguments(rng: torch.Generator) -> None:
    """Block sizes the CPU backend cannot run, and mismatched shapes, raise ValueError."""
    q, k, v = _random(rng, 1, 4, 2, 64, 64, torch.float32)
    with pytest.raises(ValueError, match="block_size"):
        vca.VllmCpuDecodeAttention(k, v, 4, block_size=48)
    with pytest.raises(ValueError, match="multiple"):
        vca.VllmCpuDecodeAttention(k, v, 3)
    attn = vca.VllmCpuDecodeAttention(k, v, 4)
    with pytest.raises(ValueError, match="query"):
        attn(q[:, :2])
