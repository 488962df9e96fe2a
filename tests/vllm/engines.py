"""Helpers for engine tests: engines, prompts, sampling."""

from __future__ import annotations

import gc
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# Small retro settings so a few thousand tokens exercise every zone and update path:
# indexed from 84 tokens on, update blocks every 64 decoded tokens.
TINY_RETRO = {"update_segment": 64, "update_clusters": 4, "local_window": 16,
              "segment_size": 512}
FULL_BUDGET = {"retrieval_budget": 1.0, "estimation_budget": 0.0}


@contextmanager
def engine(model: Path | str, retro: dict[str, Any] | None = None, **kwargs: Any
           ) -> Iterator[Any]:
    """A ``vllm.LLM`` on ``model`` (fp32, eager unless told otherwise), with retro at
    ``retro`` settings when given; shut down on exit so the next one starts clean (a
    later garbage collection of this one must not tear down the next one's state)."""
    from vllm import LLM

    from vllm_retro.vllm.settings import engine_kwargs

    args = {"enforce_eager": True, "dtype": "float32", "max_model_len": 4096, "seed": 0}
    args.update(kwargs)
    if retro is not None:
        args.update(engine_kwargs(**retro))
    llm = LLM(model=str(model), **args)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = 500) -> list[Any]:
    """Token-id prompts of the given lengths (ids 10..vocab-1)."""
    from vllm.inputs import TokensPrompt

    rng = random.Random(seed)
    return [TokensPrompt(prompt_token_ids=[rng.randrange(10, vocab) for _ in range(n)])
            for n in lengths]


def greedy(max_tokens: int, **kwargs: Any) -> Any:
    """Greedy sampling of exactly ``max_tokens`` tokens."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


def finish_step(llm: Any) -> None:
    """One more engine step: delivers the finished/aborted request ids to the workers (the
    multiprocess engine core does this by itself; the in-process ``LLM`` stops earlier)."""
    llm.llm_engine.step()
