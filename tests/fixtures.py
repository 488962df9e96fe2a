"""Fixture data shared by the tests and the benchmarks: plain functions (the pytest fixtures
that wrap them stay in the conftests), so ``bench/`` imports them from here, not from a
conftest.

* :func:`random_clusters` -- a synthetic clustering with uneven, sometimes empty clusters;
* :func:`build_qwen_capture` -- post-RoPE Q/K/V + attention outputs of Qwen2.5-Coder-0.5B
  layers ``(2, 8, 10, 15, 22)`` on 4096 tokens of real English prose, cached as a ``.pt``
  file under ``default_cache_dir()/fixtures/`` (first build ~30 s, later loads well under a
  second; builds serialised across processes with a file lock and published atomically).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from vllm_retro.index.clustering import Clusters
from vllm_retro.models import (
    QWEN25_CODER_05B_INSTRUCT,
    default_cache_dir,
    ensure_qwen_coder,
    file_lock,
)


def random_clusters(h: int, m: int, c: int, g: torch.Generator, max_skew: float = 3.0
                    ) -> Clusters:
    """A clustering of m tokens into c clusters per head with uneven, sometimes empty sizes."""
    weights = torch.rand(h, c, generator=g) ** max_skew
    assign = torch.multinomial(weights, m, replacement=True, generator=g)  # [h, m]
    order = torch.argsort(assign, dim=1, stable=True)
    sizes = torch.stack([torch.bincount(a, minlength=c) for a in assign]).to(torch.int32)
    offsets = torch.zeros(h, c + 1, dtype=torch.int64)
    offsets[:, 1:] = sizes.long().cumsum(1)
    zeros = torch.zeros(h, c, 1)
    return Clusters(centroids=zeros, value_sums=zeros, sizes=sizes, spreads=zeros[..., 0],
                    key_sq=zeros[:, 0], cross=zeros[:, :1], order=order, offsets=offsets)


#: Bump whenever the layout or the meaning of the cached capture changes.
FIXTURE_FORMAT_VERSION = 1
QWEN_CAPTURE_LAYERS = (2, 8, 10, 15, 22)
QWEN_CAPTURE_TOKENS = 4096
QWEN_CAPTURE_QUERIES = 256


def _capture_key(input_ids: torch.Tensor) -> str:
    ids_sha = hashlib.sha256(input_ids.numpy().tobytes()).hexdigest()
    payload = json.dumps(
        {
            "model_sha256": QWEN25_CODER_05B_INSTRUCT.sha256,
            "layers": list(QWEN_CAPTURE_LAYERS),
            "n_tokens": QWEN_CAPTURE_TOKENS,
            "n_queries": QWEN_CAPTURE_QUERIES,
            "format": FIXTURE_FORMAT_VERSION,
            "input_ids_sha256": ids_sha,  # the prose comes from the running CPython's stdlib
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:20]


def build_qwen_capture(
    cache_dir: Path | None = None, progress: Callable[[str], None] = print
) -> dict[str, Any]:
    """Load (or build and cache) the Qwen capture used by the ``qwen_capture`` fixture.

    Returns ``{"layers": {layer: {"q", "k", "v", "o", "positions"}}, "scale": float,
    "num_heads": 14, "num_kv_heads": 2, "head_dim": 64, "seq_len": 4096, "input_ids": [4096]}``
    with ``q``/``o`` ``[14, 256, 64]``, ``k``/``v`` ``[2, 4096, 64]`` fp32 and ``positions``
    ``[256]`` int64 (the last 256 positions).
    """
    from vllm_retro.capture import capture_qkv, load_model, prose_token_ids

    cache = cache_dir if cache_dir is not None else default_cache_dir()
    mdir = ensure_qwen_coder(cache, progress)
    input_ids = prose_token_ids(mdir, QWEN_CAPTURE_TOKENS)
    fixtures = cache / "fixtures"
    fixtures.mkdir(parents=True, exist_ok=True)
    path = fixtures / f"qwen_capture-{_capture_key(input_ids)}.pt"
    if not path.is_file():
        with file_lock(fixtures / ".qwen_capture.lock"):
            if not path.is_file():
                t0 = time.perf_counter()
                progress(
                    f"[vllm-retro] capturing Q/K/V of layers {QWEN_CAPTURE_LAYERS} on "
                    f"{QWEN_CAPTURE_TOKENS} prose tokens (one-time) …"
                )
                model = load_model(mdir)
                cap = capture_qkv(model, input_ids, QWEN_CAPTURE_LAYERS, QWEN_CAPTURE_QUERIES)
                cfg = model.config
                del model
                data = {
                    "layers": {
                        layer: {k: cap[layer][k] for k in ("q", "k", "v", "o", "positions")}
                        for layer in QWEN_CAPTURE_LAYERS
                    },
                    "scale": cap[QWEN_CAPTURE_LAYERS[0]]["scale"],
                    "num_heads": int(cfg.num_attention_heads),
                    "num_kv_heads": int(cfg.num_key_value_heads),
                    "head_dim": int(cap[QWEN_CAPTURE_LAYERS[0]]["q"].shape[-1]),
                    "seq_len": QWEN_CAPTURE_TOKENS,
                    "input_ids": input_ids,
                }
                fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=fixtures)
                os.close(fd)
                try:
                    torch.save(data, tmp)
                    os.chmod(tmp, 0o644)
                    os.replace(tmp, path)
                finally:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(tmp)
                progress(
                    f"[vllm-retro] capture cached at {path} ({time.perf_counter() - t0:.1f} s)"
                )
    return torch.load(path, weights_only=True)
