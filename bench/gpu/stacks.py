"""The two decode stacks compared: dense SDPA over resident KV, and the wave index + buffer.

Both append the step's new token to every layer first and then attend over the whole
context including it, so their outputs are comparable token for token.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F

from vllm_retro.buffer import WaveBufferManager
from vllm_retro.config import RetroConfig
from vllm_retro.index import WaveIndex
from vllm_retro.index.batched import append_batch
from vllm_retro.index.padded import MetaViewCache, decode_padded
from vllm_retro.index.steady import SteadyPool


def sdpa_probe(device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
    """SDPA on tiny inputs, called as the bench calls it (raises what a backend refuses):
    :meth:`DenseStack.step`'s decode, 1 query ([1, 4, 1, head_dim]) over 17 keys of a
    32-row buffer ([1, 2, 17, head_dim], strided), not causal; and
    :func:`~bench.gpu.runner.time_prefill`'s causal prefill, 16 queries over 16 keys. Causal
    calls are square only: PyTorch's causal mask is top-left aligned and FlashAttention
    refuses it with fewer queries than keys. Both with native GQA (4 query heads, 2 KV)."""
    query = torch.zeros(1, 4, head_dim, dtype=dtype, device=device)
    keys = torch.zeros(1, 2, 32, head_dim, dtype=dtype, device=device)
    F.scaled_dot_product_attention(query[:, :, None], keys[:, :, :17], keys[:, :, :17],
                                   enable_gqa=True)
    prompt = torch.zeros(1, 4, 16, head_dim, dtype=dtype, device=device)
    F.scaled_dot_product_attention(prompt, keys[:, :, :16], keys[:, :, :16], is_causal=True,
                                   enable_gqa=True)


def sdpa_context(device: torch.device, dtype: torch.dtype, head_dim: int
                 ) -> tuple[Callable[[], AbstractContextManager], str]:
    """(context-manager factory, name) selecting the SDPA backend: FlashAttention on CUDA,
    else memory-efficient attention (both with native GQA), the first that runs
    :func:`sdpa_probe`; on CPU PyTorch's default choice."""
    if device.type != "cuda":
        return nullcontext, "torch SDPA (CPU)"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    errors = []
    for backend, name in ((SDPBackend.FLASH_ATTENTION, "FlashAttention"),
                          (SDPBackend.EFFICIENT_ATTENTION, "memory-efficient")):
        try:
            with sdpa_kernel([backend]):
                sdpa_probe(device, dtype, head_dim)
        except RuntimeError as exc:
            errors.append(f"{name}: {exc}")
            continue
        return (lambda b=backend: sdpa_kernel([b])), f"torch SDPA ({name} backend)"
    raise SystemExit("no fused SDPA backend with GQA on this device:\n" + "\n".join(errors))


class DenseStack:
    """KV of every layer resident on the device, ``[B, H_kv, capacity, D]`` per layer."""

    def __init__(self, layers: int, batch: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device, sdpa: Callable[[],
                                                                         AbstractContextManager]):
        shape = (batch, kv_heads, capacity, head_dim)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.length = 0
        self.sdpa = sdpa

    def nbytes(self) -> int:
        """Device bytes of the KV buffers."""
        return sum(2 * t.numel() * t.element_size() for t in self.k)

    def step(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> torch.Tensor:
        """Append one token per request and layer, then decode attention.

        q: [L, B, H_q, D]; k_new, v_new: [L, B, H_kv, D]. Returns [L, B, H_q, D].
        """
        pos = self.length
        self.length += 1
        outs = []
        with self.sdpa():
            for layer, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
                k[:, :, pos] = k_new[layer]
                v[:, :, pos] = v_new[layer]
                out = F.scaled_dot_product_attention(
                    q[layer][:, :, None], k[:, :, :pos + 1], v[:, :, :pos + 1], enable_gqa=True)
                outs.append(out[:, :, 0])
        return torch.stack(outs)


class RetroStack:
    """One :class:`WaveIndex` per (request, layer), each over a wave buffer store (host tier,
    pinned on CUDA; layouts on the buffer's worker), one manager for the stack, and per layer
    one steady-zone pool (request b in slot b), as the serving runtime keeps. Each step reads
    the retrieval zones from the host tier through the padded batched path (no device cache
    of clusters: that is the device step's, :mod:`vllm_retro.index.resident`, not run here)."""

    def __init__(self, layers: int, batch: int, cfg: RetroConfig, dtype: torch.dtype,
                 device: torch.device):
        self.cfg = cfg
        self.dtype, self.device = dtype, device
        self.manager = WaveBufferManager(cfg)
        self.indexes: list[list[WaveIndex | None]] = [[None] * batch for _ in range(layers)]
        self.views = [MetaViewCache() for _ in range(layers)]  # per layer, as the route keeps
        self.steady: list[SteadyPool | None] = [None] * layers

    def build(self, layer: int, request: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Index one request-layer's prefill. keys, values: [H_kv, N, D] post-RoPE, device."""
        h, _, d = keys.shape
        store = self.manager.store(f"req{request}", h, d, self.dtype, self.device,
                                   layer=f"L{layer}")
        index = WaveIndex.build(keys, values, self.cfg, store=store)
        own = index.steady
        if self.steady[layer] is None:
            self.steady[layer] = SteadyPool(own.num_heads, own.head_dim, own.sink_cap,
                                            own.ring, own.dtype, own.device,
                                            slots=len(self.indexes[layer]), zeroed=True)
        index.adopt_steady(self.steady[layer], request)
        self.indexes[layer][request] = index

    def bound_queue(self, depth: int = 2) -> None:
        """Wait for the update worker while more than ``depth`` jobs are queued, so staged
        prefill copies (pinned host memory) cannot pile up while building."""
        if self.manager.stats.queue_depth > depth:
            self.drain()

    def drain(self) -> None:
        """Wait for every queued worker job (the worker runs jobs in order)."""
        worker = self.manager.worker
        worker.wait(worker.submit(lambda: None))

    def step(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> torch.Tensor:
        """Append one token per request and layer, then tripartite decode of each layer's
        batch through the padded batched path (:func:`decode_padded`, the serving path on
        CUDA; the reduced CPU mode runs the same code with the torch kernels).

        q: [L, B, H_q, D]; k_new, v_new: [L, B, H_kv, D]. Returns [L, B, H_q, D].
        """
        out = torch.empty_like(q)
        rows = None  # the same slots and ring rows in every layer: built once per step
        for layer, row in enumerate(self.indexes):
            _, rows = append_batch(row, k_new[layer], v_new[layer], rows)
            decode_padded(row, q[layer], q.shape[-1] ** -0.5, out[layer], self.views[layer])
        return out

    def device_nbytes(self) -> int:
        """Bytes on the compute device: meta indexes, steady zones and the execution buffers
        (on CPU the same structures, in RAM)."""
        total = self.manager.exec_nbytes() + sum(v.nbytes() for v in self.views)
        total += sum(p.nbytes() for p in self.steady if p is not None)
        for row in self.indexes:
            for index in row:
                if index is None:
                    continue
                total += index.meta_nbytes() + index.steady_nbytes()
        return total

    def host_nbytes(self) -> int:
        """Host-tier bytes held by every store."""
        return self.manager.host_bytes()

    def num_clusters(self) -> int:
        """Clusters per KV head of the first request-layer (0 if none)."""
        index = self.indexes[0][0]
        return 0 if index is None else index.num_clusters

    def close(self) -> None:
        """Free every store and stop the worker."""
        self.manager.close()
        self.indexes = []
        self.steady = []
