"""How a request asks for Block-Attention: the ``retro_blocks`` entry of its extra
arguments (``vllm_xargs`` in an OpenAI request body, ``SamplingParams.extra_args``
offline).

``retro_blocks`` lists the prompt's token positions where blocks start: ``0``, then each
further passage's first token, and last the question's (the last block) first token, e.g.
``[0, 512, 1024, 1530]`` for three passages of ~500 tokens and a question from 1530 on.
Tokens before the last block's start attend only within their own block; the last block
and every generated token attend to everything.

Their KV therefore differs from the same tokens' under plain causal attention, so vLLM's
prefix cache must keep them apart: a Block-Attention request carries the ``cache_salt``
:func:`block_salt` derives from its block starts (``vllm-retro serve`` sets it; offline,
:func:`block_prompt` does), and one without it fails with an error saying so.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

KEY = "retro_blocks"
SALT_PREFIX = "retro-blocks-"


def block_salt(blocks: Sequence[int], salt: str | None = None) -> str:
    """The ``cache_salt`` of a request with block starts ``blocks``: requests share prefix
    cache entries only with requests of the same block starts (and the same ``salt`` of
    their own, when they give one)."""
    digest = hashlib.sha256(json.dumps(list(blocks)).encode()).hexdigest()[:24]
    return SALT_PREFIX + digest + ("" if salt is None else "-" + salt)


def block_prompt(token_ids: Sequence[int], blocks: Sequence[int]) -> dict[str, Any]:
    """An offline prompt (``vllm.inputs.TokensPrompt`` fields) for ``token_ids`` under
    block starts ``blocks``; pass ``extra_args={"retro_blocks": blocks}`` in its
    ``SamplingParams``."""
    return {"prompt_token_ids": list(token_ids), "cache_salt": block_salt(blocks)}


def check_blocks(raw: Any) -> list[int]:
    """``raw`` as block starts, checked without the prompt (list of ints, at least two,
    from 0, strictly ascending). Raises ValueError naming the bad value."""
    if not isinstance(raw, list | tuple) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in raw):
        raise ValueError(f"{KEY} must be a list of token positions (ints), got {raw!r}")
    if len(raw) < 2:
        raise ValueError(f"{KEY} needs at least 2 starts (a passage's and the last block's), "
                         f"got {list(raw)}")
    if raw[0] != 0:
        raise ValueError(f"{KEY} must start at position 0, got {raw[0]}")
    for a, b in zip(raw, raw[1:], strict=False):
        if b <= a:
            raise ValueError(f"{KEY} must ascend strictly, got {b} after {a}")
    return list(raw)


def recompute_start(blocks: Sequence[int], recompute_tokens: int) -> int:
    """The first prompt position computed against the whole prompt: the last block's start
    (``blocks[-1]``), moved ``recompute_tokens`` earlier (not below 0). The tokens from
    there to the last block are the tail of the passages before it, recomputed attending to
    everything before them (selective recompute, as CacheBlend's, of the tokens nearest the
    question), so they are never loaded from the passage cache nor saved to it."""
    return max(0, blocks[-1] - recompute_tokens)


def mask_blocks(blocks: Sequence[int], recompute_tokens: int) -> tuple[int, ...] | None:
    """The block starts the attention mask uses: ``blocks`` with the last block starting at
    :func:`recompute_start` (a passage it cuts keeps its head as a block); None when that is
    0 (plain causal attention over the whole prompt)."""
    last = recompute_start(blocks, recompute_tokens)
    if last == 0:
        return None
    return (*(s for s in blocks[:-1] if s < last), last)


def parse_blocks(extra_args: Mapping[str, Any] | None, prompt_len: int,
                 cache_salt: str | None) -> tuple[int, ...] | None:
    """The block starts a request asks for (the last one the last block's), or None when
    it asks for none. Raises ValueError naming the bad value and what is accepted, or the
    missing salt."""
    if not extra_args or KEY not in extra_args:
        return None
    blocks = check_blocks(extra_args[KEY])
    if blocks[-1] >= prompt_len:
        raise ValueError(f"{KEY}: the last block starts at {blocks[-1]}, past the prompt's "
                         f"{prompt_len} tokens (accepted: 1 .. {prompt_len - 1})")
    salt = block_salt(blocks)
    if cache_salt is None or not (cache_salt == salt or cache_salt.startswith(salt + "-")):
        raise ValueError(f"{KEY} needs the request's cache_salt to be {salt!r} (or to start "
                         f"with it and '-'), got {cache_salt!r}: vLLM's prefix cache must "
                         "keep Block-Attention KV apart (vllm-retro serve sets it)")
    return tuple(blocks)
