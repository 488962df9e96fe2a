"""vllm_retro.blocks.attention: the block mask, against one masked softmax in float64."""

from __future__ import annotations

import pytest
import torch

from vllm_retro.blocks.attention import block_attention, block_attention_reference, query_starts

BLOCKS = [0, 50, 120, 200, 260]
"""Four passages, the last block from 260 on."""
LAST = BLOCKS[-1]
N = 300


def test_each_query_starts_at_its_passage_and_the_last_block_at_zero():
    pos = torch.tensor([0, 49, 50, 119, 120, 259, 260, 299, 5000])
    got = query_starts(pos, BLOCKS)
    assert got.tolist() == [0, 0, 50, 50, 120, 200, 0, 0, 0]


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("chunk", [(0, N), (100, 230), (255, 265), (299, 300)])
def test_block_attention_equals_the_masked_softmax(dtype, tol, chunk):
    """A chunk of a prompt's prefill (the whole prompt, chunks crossing blocks and the last
    block's start, one decode query), GQA 8 query heads on 2 KV heads."""
    g = torch.Generator().manual_seed(chunk[0])
    q = torch.randn(chunk[1] - chunk[0], 8, 32, generator=g).to(dtype)
    k, v = (torch.randn(2, N, 2, 32, generator=g) * 2).to(dtype)
    pos = torch.arange(*chunk)
    starts = query_starts(pos, BLOCKS)
    got = block_attention(q, k, v, pos, starts, 32 ** -0.5)
    want = block_attention_reference(q, k, v, pos, starts, 32 ** -0.5)
    assert not got.isnan().any()
    err = (got.float() - want.float()).abs().max() / want.float().abs().max()
    assert err < tol


def test_a_passage_sees_only_itself_and_the_last_block_sees_everything():
    g = torch.Generator().manual_seed(9)
    q = torch.randn(N, 4, 16, generator=g)
    k, v = torch.randn(2, N, 4, 16, generator=g)
    pos = torch.arange(N)
    starts = query_starts(pos, BLOCKS)
    out = block_attention(q, k, v, pos, starts, 0.25)
    k2, v2 = k.clone(), v.clone()
    k2[:120], v2[:120] = torch.randn(2, 120, 4, 16, generator=g)  # the first two passages
    out2 = block_attention(q, k2, v2, pos, starts, 0.25)
    assert torch.equal(out[120:LAST], out2[120:LAST])  # later passages: unchanged
    assert not torch.allclose(out[LAST:], out2[LAST:])  # the question reads them all


def test_bad_blocks_name_the_value():
    pos = torch.arange(5)
    with pytest.raises(ValueError, match=r"must start at position 0, got 3"):
        query_starts(pos, [3, 9, 20])
    with pytest.raises(ValueError, match=r"must ascend strictly, got 9 after 9"):
        query_starts(pos, [0, 9, 9, 20])
    with pytest.raises(ValueError, match="query heads 6 are not a multiple of KV heads 4"):
        block_attention(torch.zeros(5, 6, 8), torch.zeros(9, 4, 8), torch.zeros(9, 4, 8),
                        pos, torch.zeros(5, dtype=torch.int64), 1.0)
