"""De-RoPEd queries and keys of every layer of a Hugging Face causal LM, for calibration.

One forward pass per prompt (batch 1, ``torch.inference_mode``, the base model only: no
``lm_head``) with forward hooks on each layer's query and key projections -- or on its
``q_norm`` / ``k_norm`` when the model normalises them before RoPE -- records the vectors
RoPE is then applied to: exactly the de-RoPEd queries and keys SAAP routes on. The RoPE
tables (``inv_freq``, ``attention_scaling``) come from the model's rotary embedding, so that
serving rotates and de-rotates as the model does
(:func:`vllm_retro.index.saap_model.rope`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_retro.index.saap_model import ModelIdentity


@dataclass(frozen=True)
class RopeTables:
    """The model's RoPE: ``inv_freq`` [R/2] fp32 and the output scale."""

    inv_freq: torch.Tensor
    scale: float


def load_causal_lm(model_dir: str | Path, dtype: torch.dtype) -> Any:
    """A local Hugging Face causal LM in ``dtype`` on the CPU, in eval mode (SDPA)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype,
                                                 attn_implementation="sdpa")
    return model.eval()


def _decoder(model: Any) -> Any:
    inner = getattr(model, "model", model)
    return getattr(inner, "language_model", inner)


def model_identity(model: Any, name: str = "") -> ModelIdentity:
    """The :class:`ModelIdentity` of a loaded model."""
    return ModelIdentity.of(model.config, name=name)


def rope_tables(model: Any) -> RopeTables:
    """The model's RoPE frequencies and output scale (its ``rotary_emb``)."""
    rot = _decoder(model).rotary_emb
    return RopeTables(rot.inv_freq.detach().float().cpu().clone(),
                      float(getattr(rot, "attention_scaling", 1.0)))


def record_prompt(model: Any, input_ids: torch.Tensor, query_positions: torch.Tensor,
                  on_layer: Callable[[], None] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``model`` on ``input_ids`` ([T] int64) and return its de-RoPEd (pre-RoPE)
    (queries [L, Hq, S, D] at ``query_positions`` ([S] int64), keys [L, Hkv, T, D]) of every
    layer, in the model's dtype. ``on_layer`` is called after each layer (progress)."""
    idn = model_identity(model)
    t = int(input_ids.shape[0])
    s = int(query_positions.shape[0])
    dec = _decoder(model)
    layers = dec.layers
    dtype = next(model.parameters()).dtype
    q_out = torch.empty(idn.num_layers, idn.num_heads, s, idn.head_dim, dtype=dtype)
    k_out = torch.empty(idn.num_layers, idn.num_kv_heads, t, idn.head_dim, dtype=dtype)
    handles = []

    def keep(layer: int, which: str) -> Callable[..., None]:
        def hook(_mod: Any, _args: Any, out: torch.Tensor) -> None:
            if which == "q":
                x = out[0].reshape(t, idn.num_heads, idn.head_dim)
                q_out[layer] = x[query_positions].transpose(0, 1)
            else:
                k_out[layer] = out[0].reshape(t, idn.num_kv_heads, idn.head_dim).transpose(0, 1)
        return hook

    for i, layer in enumerate(layers):
        attn = layer.self_attn
        q_mod = getattr(attn, "q_norm", None) or attn.q_proj
        k_mod = getattr(attn, "k_norm", None) or attn.k_proj
        handles.append(q_mod.register_forward_hook(keep(i, "q")))
        handles.append(k_mod.register_forward_hook(keep(i, "k")))
        if on_layer is not None:
            handles.append(layer.register_forward_hook(lambda *_: on_layer()))
    try:
        with torch.inference_mode():
            dec(input_ids=input_ids[None].long(), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return q_out, k_out
