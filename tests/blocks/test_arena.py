"""vllm_retro.blocks.arena: a block's layers stored in pages and read back unchanged."""

from __future__ import annotations

import pytest
import torch

from vllm_retro.blocks.arena import BlockArena


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_written_over_scattered_pages_read_back_exactly(dtype):
    arena = BlockArena(num_pages=8, page_tokens=16, num_layers=3, kv_heads=2, head_size=8,
                       dtype=dtype)
    assert arena.page_nbytes() == 3 * 2 * 16 * 2 * 8 * arena.pool.element_size()
    g = torch.Generator().manual_seed(0)
    blocks = {(5, 2, 7): 37, (0, 3): 20}  # pages -> tokens (the last page partly)
    kv = {}
    for pages, n in blocks.items():
        for layer in range(3):
            k, v = torch.randn(2, n, 2, 8, generator=g).to(dtype)
            arena.write(list(pages), layer, k, v)
            kv[pages, layer] = k, v
    for (pages, layer), (k, v) in kv.items():
        got_k, got_v = arena.read(list(pages), layer, blocks[pages])
        assert torch.equal(got_k, k) and torch.equal(got_v, v)


def test_bad_layers_and_sizes_name_the_value():
    arena = BlockArena(2, 4, 2, 1, 4, torch.float32)
    with pytest.raises(ValueError, match="layer 2 out of range 0 .. 1"):
        arena.read([0], 2, 4)
    with pytest.raises(ValueError, match="9 tokens do not fit 2 pages of 4"):
        arena.write([0, 1], 0, torch.zeros(9, 1, 4), torch.zeros(9, 1, 4))
    with pytest.raises(ValueError, match="kv_heads must be >= 1, got 0"):
        BlockArena(2, 4, 2, 0, 4, torch.float32)
