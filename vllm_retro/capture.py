"""Capture post-RoPE queries, keys and values from a Hugging Face causal LM.

:func:`capture_qkv` runs one forward pass (batch 1, fp32, ``torch.inference_mode``) with plain
PyTorch forward hooks -- no monkey-patching of transformers:

* forward hooks on ``self_attn.q_proj`` / ``k_proj`` / ``v_proj`` of each requested layer record
  the pre-RoPE projections (biases included, as the model computes them);
* a forward hook on ``model.model.rotary_emb`` records the ``(cos, sin)`` tables it returns;
* RoPE is then applied here with the standard ``x * cos + rotate_half(x) * sin``;
* a forward pre-hook on ``self_attn.o_proj`` records the model's own attention output (the input
  of the output projection), returned as ``o`` so callers can check that causal softmax attention
  over the captured ``q``/``k``/``v`` (:func:`causal_attention`) reproduces it.

:func:`real_prose` / :func:`prose_token_ids` provide real English text without any download
(the Python language reference shipped in CPython's ``pydoc_data.topics``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "apply_rope",
    "capture_qkv",
    "causal_attention",
    "load_model",
    "prose_token_ids",
    "real_prose",
    "relative_error",
    "rotate_half",
]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last dimension (split in two halves)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding, half-split convention: ``x * cos + rotate_half(x) * sin``.

    ``x``: ``[heads, n, head_dim]``; ``cos``/``sin``: ``[n, head_dim]`` (broadcast over heads).
    """
    return x * cos + rotate_half(x) * sin


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    k_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference causal softmax attention with grouped-query heads, computed in fp64.

    Args:
        q: ``[num_heads, n_queries, head_dim]`` post-RoPE queries.
        k, v: ``[num_kv_heads, seq_len, head_dim]`` post-RoPE keys and values.
        q_positions: ``[n_queries]`` int64 absolute positions of the queries.
        scale: softmax scaling applied to ``q . k`` (``1/sqrt(head_dim)`` for qwen2).
        k_positions: ``[seq_len]`` positions of the keys (default ``arange(seq_len)``).

    Returns:
        ``[num_heads, n_queries, head_dim]`` in ``q.dtype``; query head ``h`` attends over KV head
        ``h // (num_heads // num_kv_heads)`` and only to keys at positions ``<=`` its own.
    """
    num_heads, num_kv_heads = q.shape[0], k.shape[0]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    group = num_heads // num_kv_heads
    if k_positions is None:
        k_positions = torch.arange(k.shape[1], device=k.device)
    kk = k.double().repeat_interleave(group, dim=0)
    vv = v.double().repeat_interleave(group, dim=0)
    scores = torch.einsum("hqd,hkd->hqk", q.double(), kk) * scale
    mask = k_positions[None, :] > q_positions[:, None]  # [n_queries, seq_len]
    scores = scores.masked_fill(mask, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vv
    return out.to(q.dtype)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error ``||a - b|| / ||b||`` (computed in fp64)."""
    a64, b64 = a.double(), b.double()
    return float(torch.linalg.vector_norm(a64 - b64) / torch.linalg.vector_norm(b64))


def load_model(model_dir: str | Path, attn_implementation: str = "sdpa") -> Any:
    """Load a causal LM from a local HF directory in fp32 on CPU, in eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation=attn_implementation
    )
    return model.eval()


class _StopForward(Exception):
    """Raised by a hook once every requested layer has been captured (skips the rest)."""


def capture_qkv(
    model_dir: str | Path | Any,
    input_ids: torch.Tensor,
    layers: Sequence[int],
    n_queries: int = 64,
    dtype: torch.dtype = torch.float32,
) -> dict[int, dict[str, Any]]:
    """Capture post-RoPE Q/K/V (and the model's attention output) for some layers.

    Runs the model (fp32, batch 1, ``torch.inference_mode``) once on ``input_ids`` and stops right
    after the deepest requested layer's attention; only the requested layers' tensors are kept.

    Args:
        model_dir: local HF model directory, or an already loaded causal LM (qwen2/llama-style:
            ``model.model.layers[i].self_attn.{q,k,v,o}_proj`` and ``model.model.rotary_emb``).
        input_ids: ``[seq_len]`` int64 token ids.
        layers: decoder layer indices to capture.
        n_queries: how many of the last positions to keep queries (and outputs) for.
        dtype: dtype of the returned tensors (the model always computes in fp32).

    Returns:
        ``{layer: {...}}`` with, for each requested layer:

        * ``q``: ``[num_heads, n_queries, head_dim]`` post-RoPE queries of the last ``n_queries``
          positions;
        * ``k``: ``[num_kv_heads, seq_len, head_dim]`` post-RoPE keys of all positions;
        * ``v``: ``[num_kv_heads, seq_len, head_dim]`` values of all positions;
        * ``o``: ``[num_heads, n_queries, head_dim]`` the model's own attention output (input of
          ``o_proj``) at those query positions;
        * ``positions``: ``[n_queries]`` int64 positions of the queries;
        * ``scale``: float softmax scaling used by the layer.
    """
    model = load_model(model_dir) if isinstance(model_dir, (str, Path)) else model_dir
    if input_ids.dim() != 1:
        raise ValueError(f"input_ids must be 1-D [seq_len], got shape {tuple(input_ids.shape)}")
    seq_len = int(input_ids.shape[0])
    if not 0 < n_queries <= seq_len:
        raise ValueError(f"n_queries={n_queries} must be in [1, seq_len={seq_len}]")
    layers = sorted(set(int(i) for i in layers))
    if not layers:
        raise ValueError("no layers requested")

    cfg = model.config
    num_heads = cfg.num_attention_heads
    num_kv_heads = cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    decoder_layers = model.model.layers
    if layers[0] < 0 or layers[-1] >= len(decoder_layers):
        raise ValueError(f"layers {layers} out of range for {len(decoder_layers)} layers")

    q0 = seq_len - n_queries
    rope: dict[str, torch.Tensor] = {}
    raw: dict[int, dict[str, torch.Tensor]] = {i: {} for i in layers}
    handles = []

    def rope_hook(_mod, _args, out):
        cos, sin = out
        rope["cos"], rope["sin"] = cos[0].float().clone(), sin[0].float().clone()  # [seq, hd]

    def proj_hook(layer: int, name: str, keep_from: int):
        def hook(_mod, _args, out):
            raw[layer][name] = out[0, keep_from:].float().clone()  # [n, heads*hd]

        return hook

    def o_pre_hook(layer: int, stop: bool):
        def hook(_mod, args):
            raw[layer]["o"] = args[0][0, q0:].float().clone()
            if stop:
                raise _StopForward

        return hook

    handles.append(model.model.rotary_emb.register_forward_hook(rope_hook))
    for i in layers:
        attn = decoder_layers[i].self_attn
        handles.append(attn.q_proj.register_forward_hook(proj_hook(i, "q", q0)))
        handles.append(attn.k_proj.register_forward_hook(proj_hook(i, "k", 0)))
        handles.append(attn.v_proj.register_forward_hook(proj_hook(i, "v", 0)))
        handles.append(attn.o_proj.register_forward_pre_hook(o_pre_hook(i, i == layers[-1])))
    try:
        with torch.inference_mode():
            # The base model only: no lm_head logits ([seq, vocab] would be ~2.5 GB at 4k tokens).
            model.model(input_ids=input_ids[None].long(), use_cache=False)
    except _StopForward:
        pass
    finally:
        for h in handles:
            h.remove()

    cos, sin = rope["cos"], rope["sin"]
    positions = torch.arange(q0, seq_len, dtype=torch.int64)
    result: dict[int, dict[str, Any]] = {}
    for i in layers:
        r = raw.pop(i)
        q = r["q"].view(n_queries, num_heads, head_dim).transpose(0, 1)
        k = r["k"].view(seq_len, num_kv_heads, head_dim).transpose(0, 1)
        v = r["v"].view(seq_len, num_kv_heads, head_dim).transpose(0, 1)
        o = r["o"].view(n_queries, num_heads, head_dim).transpose(0, 1)
        result[i] = {
            "q": apply_rope(q, cos[q0:], sin[q0:]).to(dtype).contiguous(),
            "k": apply_rope(k, cos, sin).to(dtype).contiguous(),
            "v": v.to(dtype).contiguous(),
            "o": o.to(dtype).contiguous(),
            "positions": positions.clone(),
            "scale": float(getattr(decoder_layers[i].self_attn, "scaling", head_dim**-0.5)),
        }
    return result


def _all_prose() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(t for t in (topics[k].strip() for k in sorted(topics)) if t)


def real_prose(min_chars: int) -> str:
    """At least ``min_chars`` characters of real English prose, available offline.

    Concatenates (separated by blank lines) the entries of CPython's ``pydoc_data.topics.topics``
    -- the Python language reference -- in sorted key order until the length reaches
    ``min_chars``.  Deterministic for a given Python version.  Raises ``ValueError`` if the whole
    corpus (several hundred thousand characters) is shorter.
    """
    from pydoc_data.topics import topics

    parts: list[str] = []
    total = 0
    for key in sorted(topics):
        text = topics[key].strip()
        if not text:
            continue
        parts.append(text)
        total += len(text) + 2
        if total >= min_chars:
            return "\n\n".join(parts)
    raise ValueError(f"pydoc_data.topics holds only ~{total} characters, < {min_chars} requested")


def prose_token_ids(tokenizer_or_model_dir: Any, n_tokens: int) -> torch.Tensor:
    """Exactly ``n_tokens`` token ids (``[n_tokens]`` int64) of :func:`real_prose`, tokenized
    without special tokens by the given tokenizer (or the one in the given model directory)."""
    tok = tokenizer_or_model_dir
    if isinstance(tok, (str, Path)):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tok))
    full_len = len(_all_prose())
    chars = min(max(1024, n_tokens * 5), full_len)
    while True:
        ids = tok(real_prose(chars), add_special_tokens=False)["input_ids"]
        if len(ids) > n_tokens:  # strictly more, so the cut never splits the last kept token
            return torch.tensor(ids[:n_tokens], dtype=torch.int64)
        if chars >= full_len:
            raise ValueError(f"the prose corpus has only {len(ids)} tokens < {n_tokens} requested")
        chars = min(chars * 2, full_len)
