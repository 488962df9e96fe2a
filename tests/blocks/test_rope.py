"""vllm_retro.blocks.rope: a key written at one position, moved to another, equals the key
vLLM's own rotary embedding writes there."""

from __future__ import annotations

import pytest
import torch

from vllm_retro.blocks.rope import RopeShift

pytest.importorskip("vllm")

from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.rotary_embedding import get_rope  # noqa: E402

MAX_POS = 32768
ROPES = {
    # Qwen2.5: NeoX pairs, base 1e6
    "qwen": dict(head_size=64, is_neox_style=True, rope_parameters={"rope_theta": 1e6}),
    # GPT-J pairs, only half the dims rotated
    "gptj_partial": dict(head_size=64, is_neox_style=False,
                         rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.5}),
    # Llama 3.1's frequency-dependent scaling
    "llama3": dict(head_size=128, is_neox_style=True,
                   rope_parameters={"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192}),
    # YaRN: the table carries a magnitude (mscale) besides the rotation
    "yarn": dict(head_size=64, is_neox_style=True,
                 rope_parameters={"rope_theta": 1e4, "rope_type": "yarn", "factor": 4.0,
                                  "original_max_position_embeddings": 8192}),
}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rope_and_shift(name: str, dtype: torch.dtype):
    spec = ROPES[name]
    with set_current_vllm_config(VllmConfig()):  # vLLM's custom ops read it when built
        rope = get_rope(max_position=MAX_POS, dtype=dtype, **spec)
    return rope, RopeShift(rope.cos_sin_cache, spec["head_size"], spec["is_neox_style"])


def write(rope, pre: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The keys vLLM's rotary embedding writes for pre-RoPE keys ``pre`` [N, H, D]."""
    n, h, d = pre.shape
    _, key = rope.forward_native(positions, pre.reshape(n, h * d).clone(),
                                 pre.reshape(n, h * d).clone())
    return key.reshape(n, h, d)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not got.isnan().any()
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(ROPES))
def test_a_moved_key_equals_the_key_written_at_its_new_position(name, dtype):
    """One block of 300 tokens written at one offset, moved to others (later, earlier,
    near the table's end, to 0), against vLLM writing the same pre-RoPE keys there."""
    rope, shift = rope_and_shift(name, dtype)
    g = torch.Generator().manual_seed(sorted(ROPES).index(name))
    pre = (torch.randn(300, 4, ROPES[name]["head_size"], generator=g) * 3).to(dtype)
    for src, dst in [(0, 5000), (1234, 17), (17, 32000), (20000, 0), (777, 777)]:
        written = write(rope, pre, torch.arange(src, src + 300))
        want = write(rope, pre, torch.arange(dst, dst + 300))
        got = shift.shift(written, src, dst)
        assert got.dtype == dtype and got.shape == want.shape
        assert rel_err(got, want) < TOLERANCE[dtype], (src, dst)
    if dtype == torch.float32:  # in place: not moved at all
        assert rel_err(shift.shift(written, 300, 300), written) < 1e-6


def test_per_token_positions_and_a_round_trip():
    """Positions per token (a block split over two places), and there and back again."""
    rope, shift = rope_and_shift("qwen", torch.float32)
    g = torch.Generator().manual_seed(5)
    pre = torch.randn(64, 2, 64, generator=g)
    src = torch.cat((torch.arange(100, 132), torch.arange(9000, 9032)))
    dst = torch.randperm(30000, generator=g)[:64]
    written = write(rope, pre, src)
    moved = shift.shift(written, src, dst)
    assert rel_err(moved, write(rope, pre, dst)) < 1e-5
    assert rel_err(shift.shift(moved, dst, src), written) < 1e-5


def test_bad_positions_and_shapes_name_the_value_and_the_range():
    _, shift = rope_and_shift("qwen", torch.float32)
    keys = torch.zeros(10, 2, 64)
    with pytest.raises(ValueError, match=r"destination position 32777 out of range.*0 \.\. 32767"):
        shift.shift(keys, 0, 32768)
    with pytest.raises(ValueError, match=r"source position -1 out of range"):
        shift.shift(keys, torch.arange(-1, 9), 0)
    with pytest.raises(ValueError, match=r"keys must be \[tokens, heads, 64\], got \(10, 2, 32\)"):
        shift.shift(torch.zeros(10, 2, 32), 0, 5)
    with pytest.raises(ValueError, match=r"positions must be \[10\]"):
        shift.shift(keys, torch.arange(5), 0)
    with pytest.raises(ValueError, match="rotary_dim 128 must be in"):
        RopeShift(torch.ones(4, 128), 64, True)
