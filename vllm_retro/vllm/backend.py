"""The retro attention backend for vLLM's CPU platform.

It is vLLM's own CPU attention backend with one change of route per batch row:

- rows of requests that are not indexed (prefill chunks, short requests) run vLLM's dense
  paged kernel, on a sub-batch when the batch also holds indexed rows;
- at the step that completes an indexable request's sequence, after the dense pass, the
  request's KV is read back from the paged cache and indexed (segmented clustering) into
  the wave buffer, one layer at a time inside that layer's forward;
- rows of indexed requests append their new K/V to the index and decode through the wave
  index and wave buffer (tripartite attention; update blocks every ``update_segment``
  tokens).

It is registered over ``CPU_ATTN`` because the CPU platform selects no other backend; with
retro off it behaves exactly as ``CPU_ATTN``. Sliding-window, encoder and KV-sharing
layers always take vLLM's path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields

import torch
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec

from vllm_retro.vllm.batch_plan import BatchPlan, plan_batch
from vllm_retro.vllm.kv_manager import RetroAttentionSpec
from vllm_retro.vllm.paged_kv import read_cpu_paged_kv
from vllm_retro.vllm.runtime import get_runtime
from vllm_retro.vllm.settings import RetroSetupError, retro_config


@dataclass
class RetroMetadata:
    """Attention metadata of a retro layer group for one step."""

    num_actual_tokens: int
    plan: BatchPlan
    dense: CPUAttentionMetadata | None
    """vLLM's metadata for the dense rows (None when there are none)."""
    dense_tokens: torch.Tensor | None
    """Batch token indices of the dense rows; None when they are the whole batch."""


def _restrict(cm: CommonAttentionMetadata, rows: list[int]) -> tuple[CommonAttentionMetadata,
                                                                     torch.Tensor]:
    """``cm`` for a subset of its rows, and the batch token indices of those rows."""
    qsl = cm.query_start_loc_cpu
    idx = torch.tensor(rows, dtype=torch.long)
    starts, ends = qsl[idx], qsl[idx + 1]
    lens = ends - starts
    tokens = torch.cat([torch.arange(int(s), int(e)) for s, e in zip(starts, ends, strict=True)])
    sub_qsl = torch.zeros(len(rows) + 1, dtype=qsl.dtype)
    torch.cumsum(lens, 0, out=sub_qsl[1:])
    dev = cm.seq_lens.device
    seq_lens = cm.seq_lens.index_select(0, idx.to(dev))
    upper = cm.seq_lens_cpu_upper_bound
    changes = dict(
        query_start_loc=sub_qsl.to(cm.query_start_loc.device),
        query_start_loc_cpu=sub_qsl,
        seq_lens=seq_lens,
        num_reqs=len(rows),
        num_actual_tokens=int(tokens.numel()),
        max_query_len=int(lens.max()),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=cm.block_table_tensor.index_select(0, idx.to(dev)),
        slot_mapping=cm.slot_mapping.index_select(0, tokens.to(cm.slot_mapping.device)),
        seq_lens_cpu_upper_bound=None if upper is None else upper[idx],
        positions=None if cm.positions is None else cm.positions[tokens.to(dev)],
        is_prefilling=None if cm.is_prefilling is None else cm.is_prefilling[idx.to(dev)],
        logits_indices_padded=None, num_logits_indices=None, max_logits_per_req=None,
        req_idx=None, mm_req_doc_ranges=None, rswa_prefix_lens=None,
        dcp_local_seq_lens=None, dcp_local_seq_lens_cpu_upper_bound=None,
        replayssm_decode_base_cpu=None,
    )
    names = {f.name for f in fields(cm)}
    changes = {k: v for k, v in changes.items() if k in names}
    changes.update({k: None for k in ("_num_computed_tokens_cache",
                                       "_token_to_req_indices_cache") if k in names})
    return cm.replace(**changes), tokens


class RetroMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM's CPU builder, plus the per-row route for retro groups."""

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str],
                 vllm_config: VllmConfig, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.retro = isinstance(kv_cache_spec, RetroAttentionSpec)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> CPUAttentionMetadata | RetroMetadata:
        """vLLM's metadata for non-retro groups; :class:`RetroMetadata` for retro ones."""
        cm = common_attn_metadata
        rt = get_runtime()
        qlens = cm.query_start_loc_cpu[1:cm.num_reqs + 1] - cm.query_start_loc_cpu[:cm.num_reqs]
        c = rt.counters
        c.peak_decode_rows = max(c.peak_decode_rows, int((qlens == 1).sum()))
        if not self.retro or rt.step is None:
            return super().build(common_prefix_len, cm, fast_build)
        plan = plan_batch(rt, cm.query_start_loc_cpu, cm.slot_mapping, cm.block_table_tensor,
                          cm.num_reqs)
        if not plan.decodes:
            dense, tokens = super().build(common_prefix_len, cm, fast_build), None
        elif plan.dense_rows:
            sub, tokens = _restrict(cm, plan.dense_rows)
            dense = super().build(0, sub, fast_build)
        else:
            dense, tokens = None, None
        return RetroMetadata(cm.num_actual_tokens, plan, dense, tokens)


class RetroAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, with indexed rows decoded by the wave index."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None,
                 kv_cache_dtype: str, logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                         sliding_window, kv_cache_dtype, logits_soft_cap, attn_type,
                         kv_sharing_target_layer_name, sinks)
        vllm_config = get_current_vllm_config()
        cfg = retro_config(vllm_config)
        get_runtime().attach(vllm_config, cfg)
        self.retro = (cfg is not None and attn_type == AttentionType.DECODER
                      and self.sliding_window == -1)
        if not self.retro:
            return
        unsupported = {
            "ALiBi slopes": alibi_slopes is not None,
            "logits soft-capping": bool(logits_soft_cap),
            "attention sinks": sinks is not None,
            "cross-layer KV sharing": kv_sharing_target_layer_name is not None,
        }
        bad = [name for name, on in unsupported.items() if on]
        if bad:
            raise RetroSetupError(
                f"retro does not support a full-attention layer with {', '.join(bad)}; "
                "accepted: plain softmax attention (set additional_config "
                "{'retro': {'enabled': false}} for this model)")

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Dense rows through vLLM's kernel, index builds, then wave-index decodes.

        query: [T, H, D]; key, value: [T, H_kv, D] (already written to ``kv_cache``);
        output: [T, H, D] or [T, H * D].
        """
        if not isinstance(attn_metadata, RetroMetadata):
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        md = attn_metadata
        rt = get_runtime()
        out = output.view(output.shape[0], self.num_heads, self.head_size)
        if md.dense is not None:
            if md.dense_tokens is None:
                super().forward(layer, query, key, value, kv_cache, md.dense, output,
                                output_scale, output_block_scale)
            else:
                sub_out = out.new_empty((md.dense_tokens.numel(), self.num_heads,
                                         self.head_size))
                super().forward(layer, query.index_select(0, md.dense_tokens), key, value,
                                kv_cache, md.dense, sub_out)
                out.index_copy_(0, md.dense_tokens, sub_out)
            rt.counters.dense_tokens += md.dense.num_actual_tokens
        name = layer.layer_name
        for b in md.plan.builds:
            t0 = time.perf_counter()
            keys, values = read_cpu_paged_kv(kv_cache, b.block_ids, b.num_tokens, layer.isa)
            rt.build_index(b.request_id, name, keys, values)
            rt.counters.index_build_seconds += time.perf_counter() - t0
        for d in md.plan.decodes:
            index = rt.index(d.request_id, name)
            for t in range(d.first, d.first + d.count):
                index.append(key[t].unsqueeze(1), value[t].unsqueeze(1))
                out[t] = index.decode(query[t], self.scale).output.to(out.dtype)
            rt.counters.retro_decode_tokens += d.count
        return output


class RetroAttentionBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with the retro route (see module docstring)."""

    @staticmethod
    def get_name() -> str:
        # vLLM requires the name of an existing enum member; this class overrides CPU_ATTN.
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls() -> type[RetroAttentionImpl]:
        return RetroAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[RetroMetadataBuilder]:
        return RetroMetadataBuilder

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """Full-attention layers report :class:`RetroAttentionSpec` when retro is on."""
        spec = super().customize_spec(spec)
        if (get_runtime().config is None or type(spec) is not FullAttentionSpec
                or spec.sliding_window is not None or spec.attention_chunk_size is not None):
            return spec
        return RetroAttentionSpec(**{f.name: getattr(spec, f.name) for f in fields(spec)})
