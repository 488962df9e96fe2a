"""The retro route through an attention backend, shared by the CPU and CUDA backends.

Per batch row of a retro layer group:

- rows of requests that are not indexed (prefill chunks, short requests) run the wrapped
  backend's dense paged kernel, on a sub-batch when the batch also holds indexed rows;
- at the step that completes an indexable request's sequence, after the dense pass, each
  layer's forward reads the request's KV back from the paged cache and hands it to the
  index builder (:mod:`vllm_retro.vllm.index_builder`), which indexes it (segmented
  clustering into the wave buffer) off the step while the request keeps decoding densely;
- rows of indexed requests append their new K/V to the index and decode through the wave
  index and wave buffer (tripartite attention; update blocks every ``update_segment``
  tokens). At a request's first indexed step, the tokens it decoded densely while its
  index was built are read from the paged KV and appended first.

The mixins below go in front of a vLLM backend's builder and impl classes; the concrete
backend supplies :meth:`RouteImplMixin.read_kv` for its cache layout. With retro off the
classes behave exactly as the wrapped backend. Sliding-window, encoder and KV-sharing
layers always take the wrapped backend's path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import Any

import torch
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata
from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec

from vllm_retro.blocks.attention import block_attention, query_starts
from vllm_retro.index.batched import append_batch, decode_batch
from vllm_retro.index.estimator_choice import JUDGE_QUERIES
from vllm_retro.index.padded import MetaViewCache
from vllm_retro.vllm.batch_plan import BatchPlan, BlockPrefill, plan_batch
from vllm_retro.vllm.kv_manager import RetroAttentionSpec
from vllm_retro.vllm.runtime import RetroRuntime, engine_runtime
from vllm_retro.vllm.settings import RetroSetupError, retro_config


@dataclass
class RetroMetadata:
    """Attention metadata of a retro layer group for one step."""

    num_actual_tokens: int
    plan: BatchPlan
    dense: Any
    """The wrapped backend's metadata for the dense rows (None when there are none)."""
    dense_tokens: torch.Tensor | None
    """Batch token indices of the dense rows; None when they are the whole batch."""
    runtime: RetroRuntime
    """The worker's retro state the step's rows are decoded with (handed to ``forward``
    here rather than looked up there)."""


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


class RouteBuilderMixin:
    """Goes before a vLLM metadata builder: adds the per-row route for retro groups."""

    def __init__(self, kv_cache_spec: AttentionSpec, *args: Any, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, *args, **kwargs)
        self.runtime = engine_runtime(self.vllm_config)
        """The engine's retro state in this worker (None: retro off), from the engine config
        vLLM builds the builder with: each step's metadata hands it on to the layers'
        ``forward``."""
        self.retro = self.runtime is not None and isinstance(kv_cache_spec, RetroAttentionSpec)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> Any:
        """The wrapped builder's metadata for non-retro groups; :class:`RetroMetadata` for
        retro ones."""
        cm = common_attn_metadata
        rt = self.runtime
        if rt is None:
            return super().build(common_prefix_len, cm, fast_build)
        qlens = cm.query_start_loc_cpu[1:cm.num_reqs + 1] - cm.query_start_loc_cpu[:cm.num_reqs]
        c = rt.counters
        c.peak_decode_rows = max(c.peak_decode_rows, int((qlens == 1).sum()))
        if not self.retro or rt.step is None:
            return super().build(common_prefix_len, cm, fast_build)
        plan = plan_batch(rt, cm.query_start_loc_cpu, cm.slot_mapping, cm.block_table_tensor,
                          cm.num_reqs)
        c.sparse_decode_tokens += sum(d.count for d in plan.decodes)
        c.dense_decode_tokens += sum(1 for r in plan.dense_rows if int(qlens[r]) == 1)
        if not plan.decodes and not plan.block_prefills:
            dense, tokens = super().build(common_prefix_len, cm, fast_build), None
        elif plan.dense_rows:
            sub, tokens = _restrict(cm, plan.dense_rows)
            dense = super().build(0, sub, fast_build)
        else:
            dense, tokens = None, None
        return RetroMetadata(cm.num_actual_tokens, plan, dense, tokens, rt)


class RouteImplMixin:
    """Goes before a vLLM attention impl: indexed rows decode through the wave index."""

    num_heads: int
    head_size: int
    scale: float

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None,
                 kv_cache_dtype: str, logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None, **kwargs: Any) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                         sliding_window, kv_cache_dtype, logits_soft_cap, attn_type,
                         kv_sharing_target_layer_name, sinks, **kwargs)
        vllm_config = get_current_vllm_config()
        cfg = retro_config(vllm_config)
        engine_runtime(vllm_config)  # made now: the CPU extension is built before any step
        self.retro = (cfg is not None and attn_type == AttentionType.DECODER
                      and sliding_window is None)
        if not self.retro:
            return
        cfg.check_head_dim(head_size)
        if cfg.index == "saap":  # the trained file must be the served model's: say so now
            from vllm_retro.index.saap_model import load_saap

            load_saap(cfg.saap.file, vllm_config.model_config.hf_config)
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

    def read_kv(self, layer: Any, kv_cache: torch.Tensor, block_ids: torch.Tensor,
                num_tokens: int, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """A request's keys and values of tokens ``[first, num_tokens)``,
        [H_kv, num_tokens - first, D] each (private copies), from this backend's paged
        cache."""
        raise NotImplementedError

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: Any,
                output: torch.Tensor, output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Dense rows through the wrapped kernel, index builds, then wave-index decodes.

        query: [T, H, D]; key, value: [T, H_kv, D] (already written to ``kv_cache``);
        output: [T, H, D] or [T, H * D].
        """
        if not isinstance(attn_metadata, RetroMetadata):
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        md = attn_metadata
        rt = md.runtime
        out = output.view(output.shape[0], self.num_heads, self.head_size)
        if md.dense is not None:
            if md.dense_tokens is None:
                super().forward(layer, query, key, value, kv_cache, md.dense, output,
                                output_scale, output_block_scale)
            else:
                tokens = md.dense_tokens.to(query.device)
                sub_out = out.new_empty((tokens.numel(), self.num_heads, self.head_size))
                super().forward(layer, query.index_select(0, tokens),
                                key.index_select(0, tokens), value.index_select(0, tokens),
                                kv_cache, md.dense, sub_out)
                out.index_copy_(0, tokens, sub_out)
            rt.counters.dense_tokens += md.dense.num_actual_tokens
        for p in md.plan.block_prefills:
            self._block_prefill(layer, kv_cache, p, query, out)
        name = layer.layer_name
        for b in md.plan.builds:
            t0 = time.perf_counter()
            keys, values = self.read_kv(layer, kv_cache, b.block_ids, b.num_tokens)
            queries = None
            if rt.config.index == "graph" and b.query_rows is not None:
                # the prompt's last chunk's post-RoPE queries train the graph: [Hq, T, D],
                # at most as many positions as the build uses (evenly spaced), a copy
                s, e = b.query_rows
                group = query.shape[1] // key.shape[1]
                step = max(1, -(-(e - s) * group // rt.config.graph.train_queries))
                queries = query[s:e:step].transpose(0, 1).contiguous()
            elif rt.config.estimator == "auto" and b.query_rows is not None:
                # the prompt's last queries judge each head's estimator ([Hq, T, D]), scaled
                # by the softmax scale here so that the build needs no scale of its own
                s, e = b.query_rows
                queries = (query[max(s, e - JUDGE_QUERIES):e].transpose(0, 1).float()
                           * self.scale)
            rt.submit_build(b.request_id, name, keys, values, time.perf_counter() - t0,
                            queries=queries)
        state = rt.registry.layer(name)
        if md.plan.decodes:
            # the layer's batched-decode view, kept across steps (a fresh one for a layer
            # holding no index yet: its rows fail with a clear error)
            views = state.meta_views if state is not None else MetaViewCache()
            self._decode_indexed(rt, layer, kv_cache, md.plan, query, key, value, out, views)
        elif state is not None:
            state.meta_views.clear()  # no indexed rows left: release the view's copy
        return output

    def _block_prefill(self, layer: Any, kv_cache: torch.Tensor, p: BlockPrefill,
                       query: torch.Tensor, out: torch.Tensor) -> None:
        """A prefill chunk under Block-Attention's mask, from the request's paged KV (this
        step's tokens already written there)."""
        end = p.start + p.count
        keys, values = self.read_kv(layer, kv_cache, p.block_ids, end)
        positions = torch.arange(p.start, end)
        starts = query_starts(positions, p.blocks)
        rows = slice(p.first, p.first + p.count)
        out[rows] = block_attention(query[rows], keys.transpose(0, 1), values.transpose(0, 1),
                                    positions.to(query.device), starts.to(query.device),
                                    self.scale)

    def _decode_indexed(self, rt: Any, layer: Any, kv_cache: torch.Tensor, plan: BatchPlan,
                        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        out: torch.Tensor, views: MetaViewCache) -> None:
        """Append each indexed row's new K/V and decode its queries through the wave index:
        all rows of the layer in one :func:`append_batch` and one :func:`decode_batch` call
        per token position (one each without speculative tokens), with the layer's view
        ``views``.

        A decode that raises is done again row by row; a row that still raises fails its
        request (:meth:`RetroRuntime.fail_request`: an error to that client, every other
        row's answer unchanged). A request failed in this step's earlier layers computes
        zeros in the later ones."""
        name = layer.layer_name
        decodes = plan.decodes
        failed = rt.fates.has_failed
        indexes = [None if failed(d.request_id) else rt.index(d.request_id, name)
                   for d in decodes]
        for d, index in zip(decodes, indexes, strict=True):
            c = d.catch_up
            if index is not None and c is not None and index.num_tokens < c.num_tokens:
                keys, values = self.read_kv(layer, kv_cache, c.block_ids, c.num_tokens,
                                            first=index.num_tokens)
                if index.append(keys, values):
                    rt.counters.index_updates += 1
        for col in plan.columns:
            members = list(range(len(decodes)) if col.members is None else col.members)
            if any(indexes[j] is None for j in members):
                self._decode_apart(rt, col, decodes, indexes, query, key, value, out, views)
                continue
            rows = [indexes[j] for j in members]
            if col.part is not None:
                idx, q, k, v = None, query[col.part], key[col.part], value[col.part]
            else:
                idx = col.tokens.to(query.device)
                q, k, v = (t.index_select(0, idx) for t in (query, key, value))
            failed: list[tuple[int, Exception]] = []
            landed, _ = append_batch(rows, k, v, col.append, failed)
            rt.counters.index_updates += landed
            rt.counters.retro_decode_tokens += len(rows)
            if failed:
                for b, exc in failed:
                    rt.fail_request(decodes[members[b]].request_id,
                                    f"appending its token to its index raised {exc!r}")
                    indexes[members[b]] = None
                self._decode_rows(rt, members, decodes, indexes, _tokens(col), query, out,
                                  failed[0][1], views)
                continue
            try:
                if idx is None:
                    decode_batch(rows, q, self.scale, out=out[col.part], cache=views)
                else:
                    res = decode_batch(rows, q, self.scale, cache=views)
                    out.index_copy_(0, idx, res.to(out.dtype))
            except Exception as exc:
                self._decode_rows(rt, members, decodes, indexes, _tokens(col), query, out, exc,
                                  views)

    def _decode_rows(self, rt: Any, members: list[int], decodes: list, indexes: list,
                     tokens: list[int], query: torch.Tensor, out: torch.Tensor,
                     exc: Exception, views: MetaViewCache) -> None:
        """After a column's batched decode raised (``exc``): decode each of its rows alone
        (``members``: positions in ``decodes``; ``tokens``: their batch rows); a row that
        raises again fails its request and writes zeros."""
        views.clear()  # the layer's batch view may be half built
        for j, t in zip(members, tokens, strict=True):
            index = indexes[j]
            if index is None:
                out[t].zero_()
                continue
            try:
                res = decode_batch([index], query[t:t + 1], self.scale)
                out[t:t + 1].copy_(res.to(out.dtype))
            except Exception as row_exc:
                rt.fail_request(decodes[j].request_id,
                                f"decoding through its index raised {row_exc!r} (the batch "
                                f"of {len(members)} raised {exc!r})")
                indexes[j] = None
                out[t].zero_()

    def _decode_apart(self, rt: Any, col: Any, decodes: list, indexes: list,
                      query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      out: torch.Tensor, views: MetaViewCache) -> None:
        """A column holding a request that failed in this step: every other row appends
        and decodes alone; the failed rows write zeros."""
        members = range(len(decodes)) if col.members is None else col.members
        for j, t in zip(members, _tokens(col), strict=True):
            index = indexes[j]
            if index is None:
                out[t].zero_()
                continue
            failed: list[tuple[int, Exception]] = []
            landed, _ = append_batch([index], key[t:t + 1], value[t:t + 1], None, failed)
            rt.counters.index_updates += landed
            rt.counters.retro_decode_tokens += 1
            if failed:
                rt.fail_request(decodes[j].request_id,
                                f"appending its token to its index raised {failed[0][1]!r}")
                indexes[j] = None
            self._decode_rows(rt, [j], decodes, indexes, [t], query, out,
                              RuntimeError("a request of its batch failed"), views)


def _tokens(col: Any) -> list[int]:
    """A decode column's batch rows, as a list."""
    if col.part is not None:
        return list(range(col.part.start, col.part.stop))
    return col.tokens.tolist()


class RouteBackendMixin:
    """Goes before a vLLM attention backend class: full-attention layers report
    :class:`RetroAttentionSpec`.

    Whatever the engine: vLLM asks the backend class with the spec alone (no engine config,
    none current), so the spec cannot depend on whether retro is on. With retro off nothing
    is indexed, and the spec's manager is vLLM's full-attention manager; the builders route
    nothing (they have no runtime)."""

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        spec = super().customize_spec(spec)
        if (type(spec) is not FullAttentionSpec
                or spec.sliding_window is not None or spec.attention_chunk_size is not None):
            return spec
        return RetroAttentionSpec(**{f.name: getattr(spec, f.name) for f in fields(spec)})
