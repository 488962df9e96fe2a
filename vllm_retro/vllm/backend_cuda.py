"""The retro attention backend on CUDA: vLLM's FlashAttention backend plus the retro route
(:mod:`vllm_retro.vllm.route`), registered as ``CUSTOM`` (``--attention-backend CUSTOM``;
:func:`vllm_retro.vllm.engine_kwargs` sets it).

CUDA graphs: the builder reports ``AttentionCGSupport.NEVER``, so vLLM runs its piecewise
mode: everything but the attention op is captured, attention runs eagerly. The decode
route cannot be captured: which clusters a query reads, which of them the device cache
holds and what the update worker copies are decided per step on the host and change the
shapes and addresses of the work.

Written against vLLM 0.32's FlashAttention classes; not yet run on a GPU (see the notes
of the vLLM integration issue).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadataBuilder,
)

from vllm_retro.vllm.paged_kv import read_flash_paged_kv
from vllm_retro.vllm.route import RouteBackendMixin, RouteBuilderMixin, RouteImplMixin


class RetroFlashMetadataBuilder(RouteBuilderMixin, FlashAttentionMetadataBuilder):
    """vLLM's FlashAttention builder plus the retro route; no full CUDA graphs."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    @classmethod
    def get_cudagraph_support(cls, vllm_config: Any, kv_cache_spec: Any) -> AttentionCGSupport:
        """Piecewise only (see module docstring)."""
        return AttentionCGSupport.NEVER


class RetroFlashAttentionImpl(RouteImplMixin, FlashAttentionImpl):
    """vLLM's FlashAttention; indexed rows decode through the wave index."""

    def read_kv(self, layer: Any, kv_cache: torch.Tensor, block_ids: torch.Tensor,
                num_tokens: int, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """See :meth:`RouteImplMixin.read_kv`."""
        return read_flash_paged_kv(kv_cache, block_ids, num_tokens, first)


class RetroFlashAttentionBackend(RouteBackendMixin, FlashAttentionBackend):
    """FlashAttention with the retro route, selected as ``CUSTOM``."""

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[RetroFlashAttentionImpl]:
        return RetroFlashAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[RetroFlashMetadataBuilder]:
        return RetroFlashMetadataBuilder
