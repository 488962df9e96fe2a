"""Configurations and the serving loop: one vLLM offline engine per configuration, in process.

Engines start the way the test-suite starts them (``tests/vllm/engines.py``): in-process engine
core, bf16 (or ``--dtype``), eager, and an explicit shutdown so the next configuration starts clean.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

from bench.accuracy.scoring import score
from bench.accuracy.tasks import Sample, generate

#: Retro settings per configuration; ``None`` is stock vLLM (full attention).
CONFIGS: dict[str, dict[str, Any] | None] = {
    "full": None,
    "retro": {},
    # half and twice the retrieval zone at every length (its fraction and its floor)
    "retro_half": {"retrieval_budget": 0.009, "min_retrieval_clusters": 16},
    "retro_double": {"retrieval_budget": 0.036, "min_retrieval_clusters": 64},
    "retro_no_est": {"estimation_budget": 0.0},
    "retro_centroid": {"estimator": "centroid"},
    "retro_auto": {"estimator": "auto"},
    # issue 40's 4K regression: the first 16 decode steps exact (the background build's
    # head start before 2026-11-23's build_steps), and k-means run to convergence (its
    # early stop's default tolerance was 0 before that day)
    "retro_build16": {"build_steps": 16},
    "retro_tol0": {"kmeans_tol": 0.0},
    # every cluster outside the retrieval zone estimated (none dropped from the softmax)
    "retro_est_all": {"estimation_budget": 0.982},
    # 16 clusters (~256 tokens) retrieved at 4K: a floor on exact tokens at short contexts
    "retro_r16": {"retrieval_budget": 0.0625},
    # the retrieval zone without its floor (the default before 2026-11-28), with the floor
    # of 16 clusters (~256 tokens, the default until 2026-12-03) and of 32 (~512 tokens, the
    # default since: binds up to ~28K tokens, so 16K's 19 clusters become 32)
    "retro_nofloor": {"min_retrieval_clusters": 0},
    "retro_floor16": {"min_retrieval_clusters": 16},
    "retro_floor32": {"min_retrieval_clusters": 32},
    # PQCache through the same engine: the paper's defaults (1/5 of the tokens read), and
    # at the wave index's bytes per step (about 1/15 of full attention's: 6% of the tokens)
    "pqcache": {"index": "pqcache"},
    "pqcache_6pct": {"index": "pqcache", "pq_token_ratio": 0.06},
    # SAAP (its trained file comes from --saap-file) and RetrievalAttention's graph index,
    # each at its defaults
    "saap": {"index": "saap"},
    "graph": {"index": "graph"},
    # Quest and StreamingLLM at their defaults (1024 indexed tokens read per step)
    "quest": {"index": "quest"},
    "streaming": {"index": "streaming"},
}
#: KV cache of the CPU engine, GiB (Qwen2.5-0.5B: 12 KiB per token in bf16).
KVCACHE_GIB = "2"


def tokenizer_fns(model_dir: Path | str) -> tuple[Callable[[str], str], Callable[[str], int]]:
    """``(render, count_tokens)`` of the model's tokenizer: ``render`` wraps a user message in
    the chat template (with the generation prompt), ``count_tokens`` counts a rendered text's
    tokens exactly as the engine will tokenize it (no extra special tokens)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))

    def render(user: str) -> str:
        msgs = [{"role": "user", "content": user}]
        return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)

    def count_tokens(text: str) -> int:
        return len(tok(text, add_special_tokens=False)["input_ids"])

    return render, count_tokens


def make_samples(tasks: Sequence[str], contexts: Sequence[int], samples: int, seed: int,
                 render: Callable[[str], str], count_tokens: Callable[[str], int]
                 ) -> list[Sample]:
    """Samples of every task at every context: seeds ``seed .. seed + samples - 1``."""
    return [generate(t, ctx, seed + i, render, count_tokens)
            for ctx in contexts for t in tasks for i in range(samples)]


@contextmanager
def engine(model_dir: Path | str, retro: dict[str, Any] | None, max_model_len: int,
           dtype: str = "bfloat16") -> Iterator[Any]:
    """An in-process ``vllm.LLM`` (``dtype``, eager) with retro at ``retro`` settings, or stock
    vLLM for ``None``; shut down on exit (see ``tests/vllm/engines.py`` for why). The process
    environment is the caller's again on exit: what the engine needs
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, a KV-cache size) and what vLLM's start-up sets is
    not left behind for servers this process starts later (they would run without a worker
    process)."""
    with mock.patch.dict(os.environ, {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", KVCACHE_GIB)}):
        from vllm import LLM

        from vllm_retro.vllm import engine_kwargs

        extra = engine_kwargs(**retro) if retro is not None else {}
        llm = LLM(model=str(model_dir), dtype=dtype, max_model_len=max_model_len,
                  enforce_eager=True, seed=0, **extra)
        try:
            yield llm
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()


def settings(name: str, saap_file: str | None = None) -> dict[str, Any] | None:
    """The retro settings of configuration ``name`` (a key of :data:`CONFIGS`), with
    ``saap_file`` filled in for SAAP; a clear error when SAAP has no file."""
    retro = CONFIGS[name]
    if retro is not None and retro.get("index") == "saap":
        if saap_file is None:
            raise SystemExit(f"configuration {name!r} needs --saap-file FILE (written by "
                             "`vllm-retro calibrate MODEL --out FILE`)")
        retro = {**retro, "saap_file": saap_file}
    return retro


def sample_key(record: dict[str, Any]) -> tuple[str, int, int]:
    """What identifies a sample across runs: (task, seed, target tokens)."""
    return record["task"], record["seed"], record["target_tokens"]


def run_config(model_dir: Path | str, name: str, samples: Sequence[Sample],
               log: Callable[[str], None] = print, saap_file: str | None = None,
               dtype: str = "bfloat16", chunk: int | None = None,
               done: dict[str, Any] | None = None,
               checkpoint: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Serve every sample under configuration ``name`` (a key of :data:`CONFIGS`) with greedy
    decoding in ``dtype``; returns ``{"config", "retro", "wall_s", "engine_start_s",
    "samples": [...]}`` where each sample record holds the answer and its score in [0, 1].

    All samples go to the engine in one batch; with ``chunk``, ``chunk`` at a time, each batch
    followed by ``checkpoint(run)`` with the answers so far (``"complete": False``), so that an
    interrupted run resumes mid-configuration: ``done``, such a partial run of this
    configuration, supplies the answers already given (and its wall time is added)."""
    from vllm import SamplingParams

    retro = settings(name, saap_file)
    records = list(done["samples"]) if done is not None else []
    answered = {sample_key(r) for r in records}
    todo = [s for s in samples if sample_key(s.record()) not in answered]
    wall0 = done.get("wall_s", 0.0) if done is not None else 0.0
    size = chunk or max(1, len(todo))
    max_len = max(s.prompt_tokens + s.max_tokens for s in samples) + 16
    t0 = time.perf_counter()

    def run(complete: bool) -> dict[str, Any]:
        out = {"config": name, "retro": retro,
               "wall_s": round(wall0 + time.perf_counter() - t0, 2),
               "engine_start_s": round(t_start, 2), "samples": list(records)}
        return out if complete else {**out, "complete": False}

    t_start = 0.0
    if todo:
        with engine(model_dir, retro, max_len, dtype) as llm:
            t_start = time.perf_counter() - t0
            for at in range(0, len(todo), size):
                part = todo[at:at + size]
                params = [SamplingParams(max_tokens=s.max_tokens, temperature=0.0)
                          for s in part]
                outs = llm.generate([s.prompt for s in part], params, use_tqdm=False)
                for s, o in zip(part, outs, strict=True):
                    answer = o.outputs[0].text
                    records.append({**s.record(), "answer": answer,
                                    "score": score(answer, s.expected, s.forbidden)})
                if checkpoint is not None and at + size < len(todo):
                    checkpoint(run(complete=False))
    order = {sample_key(s.record()): i for i, s in enumerate(samples)}
    records.sort(key=lambda r: order[sample_key(r)])
    result = run(complete=True)
    log(f"[accuracy] {name}: {len(samples)} samples in {result['wall_s']:.1f} s "
        f"(engine start {t_start:.1f} s{', resumed' if done is not None else ''})")
    return result
