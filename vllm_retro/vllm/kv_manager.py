"""KV-cache spec and manager for retro layers, modelled on vLLM's ``RSWAManager``.

A full-attention layer under the retro backend reports :class:`RetroAttentionSpec` (through
the backend's ``customize_spec``, retro on or off: vLLM asks it with the spec alone), which
vLLM's registry maps to :class:`RetroKVCacheManager`. Until a request is indexed (never,
with retro off) the manager is vLLM's full-attention manager. Once the step
that built its index has run, the wave index and buffer own the whole context (sink and
local window included, decoded tokens appended from the forward's own K/V), so the paged
blocks behind the committed tokens are freed and replaced by the null block, exactly as
``RSWAManager`` frees its gap. Only the block being written stays. That is what lets the
scheduler admit more and longer requests into the same pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec

from vllm_retro.vllm.schedule_state import ScheduleState


@dataclass(frozen=True, kw_only=True)
class RetroAttentionSpec(FullAttentionSpec):
    """A full-attention layer whose decode reads the wave index instead of paged blocks.

    Same memory layout as :class:`FullAttentionSpec` (grouped with it for uniformity);
    only the manager differs.
    """

    schedule: ScheduleState = field(default_factory=ScheduleState, compare=False, repr=False)
    """Which requests are indexed: written by the engine's scheduler-side connector, read by
    this group's manager (see :mod:`~vllm_retro.vllm.schedule_state`). Not part of the
    spec's identity (equality, hash); a merged group spec gets a new one."""


class RetroKVCacheManager(FullAttentionManager):
    """Frees the paged blocks of indexed requests (see module docstring)."""

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        """Free every block wholly below the committed tokens of an indexed request.

        ``processed_computed_tokens`` counts only tokens whose step has run, so the step
        that read the paged KV to build the index has finished before its blocks go.
        """
        built_at = self.kv_cache_spec.schedule.indexed_at(request_id)
        if built_at is None or processed_computed_tokens < built_at:
            super().remove_skipped_blocks(request_id, processed_computed_tokens,
                                          num_prompt_tokens)
            return
        self._remove_blocks_in_range(request_id, 0, processed_computed_tokens // self.block_size)


def register_spec() -> None:
    """Map :class:`RetroAttentionSpec` to :class:`RetroKVCacheManager` in vLLM's registry
    (idempotent)."""
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    # The registry fills in vLLM's built-in specs only while it is empty, so they must be
    # registered before ours or they would never be (private helper, no public one).
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(RetroAttentionSpec, RetroKVCacheManager,
                                 uniform_type_base_spec=FullAttentionSpec)
