"""Helpers for engine tests: engines, prompts, sampling."""

from __future__ import annotations

import gc
import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

# Small retro settings so a few thousand tokens exercise every zone and update path:
# indexed from 84 tokens on, update blocks every 64 decoded tokens.
TINY_RETRO = {"update_segment": 64, "update_clusters": 4, "local_window": 16,
              "segment_size": 512}
SAAP_BUCKETS = 8
"""Buckets of the SAAP file calibrated for the tiny model (the ``saap_file`` fixture)."""
FULL_BUDGET = {"retrieval_budget": 1.0, "estimation_budget": 0.0}


@contextmanager
def engine(model: Path | str, retro: dict[str, Any] | None = None, **kwargs: Any
           ) -> Iterator[Any]:
    """A ``vllm.LLM`` on ``model`` (fp32, eager unless told otherwise), with retro at
    ``retro`` settings when given; shut down on exit so the next one starts clean (a
    later garbage collection of this one must not tear down the next one's state), and the
    process environment as it was before (vLLM's start-up sets a dozen variables, such as
    ``LD_PRELOAD`` and ``LOCAL_WORLD_SIZE``, that servers started later would inherit)."""
    with mock.patch.dict(os.environ), _engine(model, retro, **kwargs) as llm:
        yield llm


@contextmanager
def _engine(model: Path | str, retro: dict[str, Any] | None, **kwargs: Any) -> Iterator[Any]:
    from vllm import LLM

    from vllm_retro.vllm.settings import engine_kwargs

    args = {"enforce_eager": True, "dtype": "float32", "max_model_len": 4096, "seed": 0}
    args.update(kwargs)
    if retro is not None:
        args.update(engine_kwargs(**retro))
    # The objects the process holds now (modules, test data: ~700K with torch, vLLM and
    # Triton imported) out of the collector's sight while the engine starts, as vLLM's engine
    # does after its start-up: the full collections of the model load and of vLLM's own
    # freeze (five) then scan only what the engine made, ~0.5-1 s less each on 2 cores. The
    # engine's shutdown unfreezes (and so does a failed start): nothing stays frozen after.
    gc.collect()
    gc.freeze()
    try:
        llm = LLM(model=str(model), **args)
    except BaseException:
        gc.unfreeze()
        raise
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.unfreeze()
        gc.collect()


def variables_changed_since(before: dict[str, str]) -> set[str]:
    """The environment variables set, changed or removed since ``before`` (a copy of
    ``os.environ``), less ``LD_LIBRARY_PATH``: opencv's import (lazy, by transformers)
    prepends its library directory there for its own subprocesses. Take ``before`` after
    ``import vllm``, whose import sets a few variables in every importer."""
    return {k for k in {*before, *os.environ}
            if before.get(k) != os.environ.get(k) and k != "LD_LIBRARY_PATH"}


def runtime_of(llm: Any) -> Any:
    """The retro runtime of ``llm``'s engine (its worker's: the engine runs in this
    process), None when retro is off for it."""
    from vllm_retro.vllm.runtime import made_runtime

    return made_runtime(llm.llm_engine.vllm_config)


def schedule_of(llm: Any) -> Any:
    """The indexed-request state of ``llm``'s scheduler (its engine core runs in this
    process): the retro connector's, checked to be the one its retro KV-cache managers read
    (each from its own spec)."""
    from vllm_retro.vllm.kv_manager import RetroKVCacheManager

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    states = scheduler.connector.schedules
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    read = [m.kv_cache_spec.schedule for m in managers if isinstance(m, RetroKVCacheManager)]
    assert len(read) == len(states), (read, states)
    assert all(r is s for r, s in zip(read, states, strict=True)), (read, states)
    return states[0]


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


# Mixed lengths for full-budget runs: under TINY_RETRO every request but the 30-token one
# gets indexed (the long ones at their prefill, the 60-token one while decoding).
LENGTHS = [30, 60, 90, 700, 1500, 3000]
MAX_TOKENS = [20, 100, 100, 100, 100, 100]


def generate_tokens(llm: Any, lengths: list[int], max_tokens: list[int]) -> list[list[int]]:
    """Greedy token ids of random prompts of ``lengths`` (``max_tokens`` each)."""
    outs = llm.generate(random_prompts(lengths), [greedy(m) for m in max_tokens])
    return [list(o.outputs[0].token_ids) for o in outs]


def full_budget_matches_stock(model: Path | str, retro: dict[str, Any]) -> None:
    """Stock vLLM, then retro at ``retro`` (a policy reading every indexed token) on
    :data:`LENGTHS` under chunked prefill (512-token chunks), continuous batching and update
    blocks: the same greedy tokens, five requests indexed, every byte freed at the end."""
    with engine(model, max_num_batched_tokens=512) as llm:
        stock = generate_tokens(llm, LENGTHS, MAX_TOKENS)
    with engine(model, retro=retro, max_num_batched_tokens=512) as llm:
        got = generate_tokens(llm, LENGTHS, MAX_TOKENS)
        rt = runtime_of(llm)
        c = rt.counters
        assert c.indexed_requests == 5 and c.index_updates > 0
        assert c.retro_decode_tokens > 2 * 4 * 90
        finish_step(llm)
        assert rt.registry.live() == [] and rt.live_bytes() == (0, 0)
    assert got == stock


def decode_two_abort_one(llm: Any, check: Any) -> Any:
    """Two long requests (2000 and 2500 tokens) decode through their indexes; once both
    have, ``check(runtime)`` looks at their live indexes, request 'a' is aborted mid-decode
    and the other runs to its end. Then: sparse tokens and update blocks happened, and every
    byte is freed. Returns the runtime."""
    rt = runtime_of(llm)
    eng = llm.llm_engine
    a, b = random_prompts([2000, 2500], seed=5)
    eng.add_request("a", a, greedy(150))
    eng.add_request("b", b, greedy(100))
    for _ in range(300):
        eng.step()
        if rt.counters.retro_decode_tokens >= 2 * 2 * 20:
            break
    assert len(rt.registry.live()) == 2
    check(rt)
    eng.abort_request(["a"])  # mid-decoding
    while eng.has_unfinished_requests():
        eng.step()
    c = rt.counters
    assert c.sparse_decode_tokens > 100 and c.index_updates > 0
    finish_step(llm)
    assert rt.registry.live() == [] and rt.live_bytes() == (0, 0)
    return rt
