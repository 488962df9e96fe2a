"""Reading KV back from vLLM's CPU paged cache, for every ISA layout this machine runs."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm_retro.vllm.paged_kv import plane_layout, read_cpu_paged_kv  # noqa: E402


def _isas():
    cases = [("vec", torch.float32, 32, 64), ("vec", torch.bfloat16, 128, 64),
             ("vec", torch.float16, 32, 128), ("vec", torch.float32, 128, 256),
             ("vec16", torch.float32, 16, 80)]
    if torch.cpu._is_amx_tile_supported():
        cases.append(("amx", torch.bfloat16, 32, 128))
    return cases


@pytest.mark.parametrize("isa, dtype, block_size, head_dim", _isas())
def test_round_trip_through_vllms_cache_write(isa, dtype, block_size, head_dim):
    from vllm import _custom_ops as ops

    g = torch.Generator().manual_seed(0)
    h, num_blocks, n = 2, 9, 3 * block_size + 5
    kv = torch.zeros(num_blocks, h, block_size, 2 * head_dim, dtype=dtype)
    key_cache, value_cache = kv.view(num_blocks, h, 2 * block_size, head_dim).chunk(2, dim=2)
    blocks = torch.tensor([7, 2, 5, 0, 3])  # scattered, more than needed
    pos = torch.arange(n)
    slots = blocks[pos // block_size] * block_size + pos % block_size
    keys = torch.randn(n, h, head_dim, generator=g).to(dtype)
    values = torch.randn(n, h, head_dim, generator=g).to(dtype)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa,
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    k, v = read_cpu_paged_kv(kv, blocks, n, isa)
    assert k.shape == v.shape == (h, n, head_dim)
    assert torch.equal(k, keys.transpose(0, 1)) and torch.equal(v, values.transpose(0, 1))


def test_layout_is_a_permutation_and_vec_keys_are_transposed():
    k_pos, v_pos = plane_layout("vec", torch.float32, 32, 64)
    both = torch.cat([k_pos, v_pos]).sort().values
    assert torch.equal(both, torch.arange(2 * 32 * 64))
    # 'vec' stores a block's keys dimension-major: element (t, d) at d * block_size + t.
    t, d = 3, 5
    assert int(k_pos[t * 64 + d]) == d * 32 + t


def test_too_short_block_row_is_a_clear_error():
    kv = torch.zeros(4, 1, 32, 64)
    with pytest.raises(ValueError, match="block row has 1 blocks; 40 tokens at block size 32"):
        read_cpu_paged_kv(kv, torch.tensor([1]), 40, "vec")


def test_flash_attention_layout_round_trip():
    from vllm_retro.vllm.paged_kv import read_flash_paged_kv

    g = torch.Generator().manual_seed(1)
    nb, h, bs, d, n = 6, 2, 16, 64, 37
    kv = torch.zeros(nb, h, bs, 2 * d)
    blocks = torch.tensor([4, 1, 3])
    keys, values = torch.randn(h, n, d, generator=g), torch.randn(h, n, d, generator=g)
    for t in range(n):  # what FlashAttention's cache write does, token by token
        b, o = int(blocks[t // bs]), t % bs
        kv[b, :, o, :d], kv[b, :, o, d:] = keys[:, t], values[:, t]
    # FlashAttention's own split of the cache: (B, H, N, 2D) -> (B, N, H, D) x 2.
    key_cache, _ = kv.transpose(1, 2).split(d, dim=-1)
    assert torch.equal(key_cache[4, 5], keys[:, 5])
    k, v = read_flash_paged_kv(kv, blocks, n)
    assert torch.equal(k, keys) and torch.equal(v, values)


def test_cuda_backend_classes_wrap_flash_attention():
    from vllm.v1.attention.backend import AttentionCGSupport

    from vllm_retro.vllm.backend_cuda import RetroFlashAttentionBackend

    assert RetroFlashAttentionBackend.get_name() == "CUSTOM"
    builder = RetroFlashAttentionBackend.get_builder_cls()
    assert builder.get_cudagraph_support(None, None) is AttentionCGSupport.NEVER
    assert RetroFlashAttentionBackend.get_impl_cls().__name__ == "RetroFlashAttentionImpl"


@pytest.mark.parametrize("isa, dtype, block_size, head_dim", _isas())
def test_strided_read_equals_the_gather(isa, dtype, block_size, head_dim):
    """Strided layouts are read as views; the gather (every layout) gives the same tensors,
    from any first token."""
    from vllm_retro.vllm.paged_kv import _gather_halves, affine_layout

    if isa == "vec":
        assert affine_layout(isa, dtype, block_size, head_dim) is not None
    g = torch.Generator().manual_seed(2)
    h, n = 2, 2 * block_size + 7
    kv = torch.randn(6, h, block_size, 2 * head_dim, generator=g).to(dtype)
    blocks = torch.tensor([4, 1, 3])
    for first in (0, 5, block_size + 1):
        k, v = read_cpu_paged_kv(kv, blocks, n, isa, first)
        planes = kv.reshape(6, h, -1).index_select(0, blocks[first // block_size:])
        lo = first % block_size
        gk, gv = _gather_halves(planes, isa, block_size, head_dim, lo, lo + n - first)
        assert torch.equal(k, gk) and torch.equal(v, gv)
        assert k.is_contiguous() and k.shape == (h, n - first, head_dim)
