"""vllm_retro.blocks.request: the block starts a request asks for, or a clear error."""

from __future__ import annotations

import pytest

from vllm_retro.blocks.request import block_prompt, block_salt, parse_blocks

SALT = block_salt([0, 40, 90])


def test_a_request_without_blocks_asks_for_none():
    assert parse_blocks(None, 100, None) is None
    assert parse_blocks({"other": 1}, 100, "x") is None


def test_block_starts_are_read_as_given_with_their_salt():
    assert parse_blocks({"retro_blocks": [0, 40, 90]}, 100, SALT) == (0, 40, 90)
    assert parse_blocks({"retro_blocks": [0, 40, 90]}, 100, block_salt([0, 40, 90], "mine")) \
        == (0, 40, 90)
    assert block_prompt([5, 6, 7], [0, 1, 2]) == {"prompt_token_ids": [5, 6, 7],
                                                    "cache_salt": block_salt([0, 1, 2])}


def test_the_salt_keeps_block_layouts_apart():
    assert block_salt([0, 40, 90]) != block_salt([0, 41, 90])
    assert block_salt([0, 40, 90]) != block_salt([0, 40, 90], "user")
    with pytest.raises(ValueError, match=r"needs the request's cache_salt to be "
                                         r"'retro-blocks-[0-9a-f]{24}'.*got None"):
        parse_blocks({"retro_blocks": [0, 40, 90]}, 100, None)
    with pytest.raises(ValueError, match="cache_salt"):
        parse_blocks({"retro_blocks": [0, 40, 90]}, 100, block_salt([0, 41, 90]))


@pytest.mark.parametrize(("value", "message"), [
    ("0,40", r"must be a list of token positions \(ints\), got '0,40'"),
    ([0, 4.5], r"must be a list of token positions"),
    ([0, True], r"must be a list of token positions"),
    ([0], r"needs at least 2 starts .* got \[0\]"),
    ([3, 40], r"must start at position 0, got 3"),
    ([0, 40, 40], r"must ascend strictly, got 40 after 40"),
    ([0, 40, 100], r"the last block starts at 100, past the prompt's 100 tokens "
                   r"\(accepted: 1 \.\. 99\)"),
])
def test_bad_blocks_name_the_value_and_what_is_accepted(value, message):
    with pytest.raises(ValueError, match=message):
        parse_blocks({"retro_blocks": value}, 100, SALT)


def test_recompute_moves_the_last_block_earlier_cutting_a_passage_where_it_falls():
    from vllm_retro.blocks.request import mask_blocks, recompute_start

    blocks = [0, 100, 250, 400]
    assert recompute_start(blocks, 0) == 400 and mask_blocks(blocks, 0) == (0, 100, 250, 400)
    assert recompute_start(blocks, 150) == 250 and mask_blocks(blocks, 150) == (0, 100, 250)
    assert mask_blocks(blocks, 200) == (0, 100, 200)  # passage 100..250 keeps its head
    assert mask_blocks(blocks, 399) == (0, 1)
    assert recompute_start(blocks, 10_000) == 0 and mask_blocks(blocks, 400) is None
