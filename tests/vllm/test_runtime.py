"""vllm_retro.vllm.runtime: where a request's indexes keep their KV."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm_retro.config import RetroConfig  # noqa: E402
from vllm_retro.index.batched import fused_path  # noqa: E402
from vllm_retro.vllm.runtime import RetroRuntime  # noqa: E402


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_a_layers_requests_share_its_pool_where_the_batched_path_decodes(backend):
    """The padded batched path (here the torch kernels) reads a layer's rows through one
    pool per layer; the fused CPU kernel's path keeps a pool per request."""
    cfg = RetroConfig(update_segment=64, local_window=16, segment_size=256,
                      kernel_backend=backend)
    rt = RetroRuntime()
    rt.attach(object(), cfg)
    g = torch.Generator().manual_seed(0)
    for rid in ("x", "y"):
        for layer in ("l0", "l1"):
            rt.build_index(rid, layer, torch.randn(2, 300, 32, generator=g),
                           torch.randn(2, 300, 32, generator=g))
    pool = {(rid, layer): rt.index(rid, layer).store.pool
            for rid in ("x", "y") for layer in ("l0", "l1")}
    assert pool["x", "l0"] is not pool["x", "l1"]
    shared = pool["x", "l0"] is pool["y", "l0"] and pool["x", "l1"] is pool["y", "l1"]
    assert shared == (not fused_path(backend, torch.device("cpu")))
    if backend == "auto":
        assert fused_path(backend, torch.device("cpu"))  # `make setup` built the kernel
    rt.close()
    assert rt.live_bytes() == (0, 0)
