"""Where cached passages' KV lives on a worker: one preallocated host pool of pages.

The worker side of the block cache (the scheduler side, :mod:`.directory`, decides which
pages hold which block). A page holds ``page_tokens`` tokens of every layer's keys and
values for this worker's KV heads: the pool is ``[pages, layers, 2, page_tokens, H_kv, D]``
(pages untouched until written, so an unused budget costs address space only). A block is
written layer by layer as its prefill computes it and read layer by layer when a later
request loads it; keys are stored as written (at the block's first position recorded in
the directory) and moved on load (:class:`~vllm_retro.blocks.rope.RopeShift`).
"""

from __future__ import annotations

import torch


class BlockArena:
    """See module docstring.

    Args:
        num_pages, page_tokens: as the directory's.
        num_layers: attention layers whose KV is cached (indexed ``0 .. num_layers-1``).
        kv_heads, head_size, dtype: the KV layout of this worker's layers.
    """

    def __init__(self, num_pages: int, page_tokens: int, num_layers: int, kv_heads: int,
                 head_size: int, dtype: torch.dtype):
        for name, value in (("num_pages", num_pages), ("page_tokens", page_tokens),
                            ("num_layers", num_layers), ("kv_heads", kv_heads),
                            ("head_size", head_size)):
            if value < (0 if name == "num_pages" else 1):
                raise ValueError(f"{name} must be >= {0 if name == 'num_pages' else 1}, "
                                 f"got {value}")
        self.page_tokens = page_tokens
        self.num_layers = num_layers
        self.pool = torch.empty(num_pages, num_layers, 2, page_tokens, kv_heads, head_size,
                                dtype=dtype)

    def page_nbytes(self) -> int:
        """Bytes of one page (all layers, keys and values)."""
        return self.pool[0].numel() * self.pool.element_size() if len(self.pool) else 0

    def _slots(self, pages: list[int], num_tokens: int, first: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 < num_tokens <= len(pages) * self.page_tokens:
            raise ValueError(f"{num_tokens} tokens do not fit {len(pages)} pages of "
                             f"{self.page_tokens}")
        if not 0 <= first < num_tokens:
            raise ValueError(f"first token {first} outside [0, {num_tokens})")
        t = torch.arange(first, num_tokens)
        return torch.tensor(pages)[t // self.page_tokens], t % self.page_tokens

    def write(self, pages: list[int], layer: int, keys: torch.Tensor,
              values: torch.Tensor) -> None:
        """Store one layer of a block: keys, values [N, H_kv, D] (any device; copied)."""
        self._check_layer(layer)
        page, off = self._slots(pages, keys.shape[0])
        self.pool[page, layer, 0, off] = keys.to("cpu", self.pool.dtype)
        self.pool[page, layer, 1, off] = values.to("cpu", self.pool.dtype)

    def read(self, pages: list[int], layer: int, num_tokens: int, first: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer of a block's tokens ``[first, num_tokens)``: (keys, values), each
        [num_tokens - first, H_kv, D] (host copies)."""
        self._check_layer(layer)
        page, off = self._slots(pages, num_tokens, first)
        return self.pool[page, layer, 0, off], self.pool[page, layer, 1, off]

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range 0 .. {self.num_layers - 1}")
