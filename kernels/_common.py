"""Helpers shared by the kernel launchers, and the one place that imports Triton.

Triton is optional: the torch references run without it (CPU installs need not have it). When
it is missing, ``triton`` and ``tl`` here are stand-ins: ``@triton.jit`` still defines the
kernels, and launching one (or using any other Triton function) raises one clear error.
"""

from __future__ import annotations

from typing import Any

import torch

_MISSING = ("Triton is not installed, so the Triton kernels cannot run; install it "
            "(`pip install triton`, or vllm-retro[cuda]) or use kernel_backend='torch'")


class _NoTriton:
    """Stands in for ``triton`` / ``triton.language`` when Triton is not installed."""

    def jit(self, fn: Any = None, **_: Any) -> Any:
        return self  # a "kernel" that fails when launched

    def __getitem__(self, _grid: Any) -> Any:
        raise ModuleNotFoundError(_MISSING)

    def __getattr__(self, name: str) -> Any:
        raise ModuleNotFoundError(_MISSING)


try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # the torch references need no Triton
    triton = tl = _NoTriton()  # type: ignore[assignment]
    HAVE_TRITON = False

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def block_size(n: int, minimum: int = 16) -> int:
    """Smallest power of two >= max(n, minimum): Triton tile extents must be powers of two."""
    return max(minimum, next_power_of_2(n))


def check_float(name: str, t: torch.Tensor) -> None:
    """Raise a clear error unless ``t`` is fp32/fp16/bf16."""
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; accepted: float32, float16, bfloat16")


def tensor_cores_16bit(*tensors: torch.Tensor) -> bool:
    """Whether a kernel may multiply these tensors on tensor cores in their own 16-bit type:
    all fp16 or all bf16, on CUDA. Elsewhere the kernel runs in Triton's interpreter, whose
    16-bit ``tl.dot`` returns garbage (Triton 3.9), so there it multiplies in fp32."""
    dtype = tensors[0].dtype
    return (dtype in (torch.float16, torch.bfloat16) and tensors[0].device.type == "cuda"
            and all(t.dtype == dtype for t in tensors))


def upload(values: list, device: torch.device, dtype: torch.dtype = torch.int64
           ) -> torch.Tensor:
    """``values`` (host integers, nested lists allowed) as a tensor on ``device``. On CUDA
    the copy goes from pinned memory without waiting for the device (a plain
    ``torch.tensor(values, device=...)`` copies from pageable memory, which synchronises the
    stream); the pinned block is kept until the copy has run (torch's host allocator)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def take_rows(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per-row selection along dim 1: x [H, C, *F], ids [H, R] (valid, any int) -> [H, R, *F].

    One flat ``index_select`` (a fast row copy), unlike ``torch.gather`` with an expanded
    index, which gathers element by element.
    """
    h, c = x.shape[:2]
    base = torch.arange(h, device=ids.device)[:, None] * c
    flat = x.reshape(h * c, *x.shape[2:])
    return flat.index_select(0, (ids.long() + base).reshape(-1)).reshape(h, ids.shape[1],
                                                                        *x.shape[2:])
