"""Helpers shared by the kernel launchers."""

from __future__ import annotations

import torch
import triton

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def block_size(n: int, minimum: int = 16) -> int:
    """Smallest power of two >= max(n, minimum): Triton tile extents must be powers of two."""
    return max(minimum, triton.next_power_of_2(max(int(n), 1)))


def check_float(name: str, t: torch.Tensor) -> None:
    """Raise a clear error unless ``t`` is fp32/fp16/bf16."""
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; accepted: float32, float16, bfloat16")


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
