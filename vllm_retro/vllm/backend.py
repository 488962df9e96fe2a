"""The retro attention backend on vLLM's CPU platform: ``CPU_ATTN`` plus the retro route
(:mod:`vllm_retro.vllm.route`).

Registered over ``CPU_ATTN`` because the CPU platform selects no other backend; with retro
off it behaves exactly as ``CPU_ATTN``.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from vllm_retro.vllm.paged_kv import read_cpu_paged_kv
from vllm_retro.vllm.route import RouteBackendMixin, RouteBuilderMixin, RouteImplMixin


class RetroMetadataBuilder(RouteBuilderMixin, CPUAttentionMetadataBuilder):
    """vLLM's CPU builder plus the retro route."""


class RetroAttentionImpl(RouteImplMixin, CPUAttentionBackendImpl):
    """vLLM's CPU attention; indexed rows decode through the wave index."""

    def read_kv(self, layer: Any, kv_cache: torch.Tensor, block_ids: torch.Tensor,
                num_tokens: int, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """See :meth:`RouteImplMixin.read_kv` (layout of the layer's CPU kernel ISA)."""
        return read_cpu_paged_kv(kv_cache, block_ids, num_tokens, layer.isa, first)


class RetroAttentionBackend(RouteBackendMixin, CPUAttentionBackend):
    """``CPU_ATTN`` with the retro route."""

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
