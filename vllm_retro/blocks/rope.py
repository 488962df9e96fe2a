"""Moving cached keys to new positions under rotary position embeddings (RoPE).

A RoPE model writes each key pair ``(x1, x2)`` of a token at position ``p`` as
``M(p) (x1, x2)`` with ``M(p) = [[c_p, -s_p], [s_p, c_p]]``, ``(c_p, s_p)`` read from a table
indexed by position (vLLM's ``cos_sin_cache``: a row per position, the ``rotary_dim / 2``
cosines then the sines; YaRN scales both by a constant). A key written at ``src`` moves to
``dst`` by ``M(dst) M(src)^-1``: the exact inverse of the map that was applied, then the
map the model would apply at ``dst``, so the result equals the key the model writes at
``dst`` up to rounding (the tests hold it to that on vLLM's own rotary embeddings).
Computed in float64 from the table, applied in float32, returned in the keys' dtype.
"""

from __future__ import annotations

import torch


class RopeShift:
    """Moves keys between positions for one rotary embedding (see module docstring).

    Args:
        table: [P, rotary_dim] cosines then sines per position ``0 .. P-1`` (any float dtype;
            vLLM's ``cos_sin_cache``).
        head_size: D, the keys' last dimension; dims ``rotary_dim ..`` are not rotated.
        is_neox_style: pairs are ``(i, i + rotary_dim/2)`` (NeoX) or ``(2i, 2i+1)`` (GPT-J).
    """

    def __init__(self, table: torch.Tensor, head_size: int, is_neox_style: bool):
        if table.dim() != 2 or table.shape[1] % 2 or table.shape[0] < 1:
            raise ValueError(f"RoPE table must be [positions, rotary_dim] with rotary_dim "
                             f"even, got shape {tuple(table.shape)}")
        rotary_dim = table.shape[1]
        if not 0 < rotary_dim <= head_size:
            raise ValueError(f"rotary_dim {rotary_dim} must be in [1, head_size {head_size}]")
        t = table.detach().to("cpu", torch.float64)
        self.cos, self.sin = t[:, :rotary_dim // 2], t[:, rotary_dim // 2:]
        norm = self.cos.square() + self.sin.square()
        if not bool((norm > 0).all()):
            raise ValueError("RoPE table has a position whose map is singular (cos = sin = 0)")
        self.norm = norm
        self.rotary_dim = rotary_dim
        self.head_size = head_size
        self.is_neox_style = is_neox_style

    @property
    def max_positions(self) -> int:
        """P: positions ``0 .. P-1`` can be moved from and to."""
        return self.cos.shape[0]

    def _rows(self, pos: torch.Tensor, name: str) -> torch.Tensor:
        pos = pos.to("cpu", torch.int64)
        if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= self.max_positions):
            bad = int(pos.min()) if int(pos.min()) < 0 else int(pos.max())
            raise ValueError(f"{name} position {bad} out of range: RoPE positions are "
                             f"0 .. {self.max_positions - 1}")
        return pos

    def shift(self, keys: torch.Tensor, src: torch.Tensor | int, dst: torch.Tensor | int
              ) -> torch.Tensor:
        """``keys`` written at positions ``src`` as written at ``dst``.

        keys: [N, H, D] (D = ``head_size``). src, dst: [N] int positions, or an int: the
        first token's position, the others following it. Returns a new [N, H, D] tensor of
        ``keys``' dtype and device.
        """
        return self.apply(keys, self.rotation(src, dst, keys.shape[0], keys.device))

    def rotation(self, src: torch.Tensor | int, dst: torch.Tensor | int, n: int,
                 device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """The move of ``n`` keys from positions ``src`` to ``dst`` (as :meth:`shift`'s),
        computed once for :meth:`apply` to any number of layers' keys: per token the cosine
        and sine of ``M(dst) M(src)^-1``, each [n, 1, rotary_dim / 2] float32 on
        ``device``."""
        src_pos = self._rows(_positions(src, n), "source")
        dst_pos = self._rows(_positions(dst, n), "destination")
        cs, ss, ns = self.cos[src_pos], self.sin[src_pos], self.norm[src_pos]
        cd, sd = self.cos[dst_pos], self.sin[dst_pos]
        # M(dst) M(src)^-1 = [[c, -s], [s, c]] with:
        c = ((cd * cs + sd * ss) / ns).to(device=device, dtype=torch.float32)
        s = ((sd * cs - cd * ss) / ns).to(device=device, dtype=torch.float32)
        return c[:, None, :], s[:, None, :]

    def apply(self, keys: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor]
              ) -> torch.Tensor:
        """``keys`` [N, H, D] moved by ``rotation`` (:meth:`rotation` of N keys): a new
        tensor of ``keys``' dtype and device."""
        if keys.dim() != 3 or keys.shape[2] != self.head_size:
            raise ValueError(f"keys must be [tokens, heads, {self.head_size}], got "
                             f"{tuple(keys.shape)}")
        c, s = rotation
        if c.shape[0] != keys.shape[0]:
            raise ValueError(f"rotation is for {c.shape[0]} keys, got {keys.shape[0]}")
        x = keys.float()
        rot, rest = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
        if self.is_neox_style:
            x1, x2 = rot.chunk(2, dim=-1)
            out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
        return torch.cat((out, rest), dim=-1).to(keys.dtype)


def _positions(pos: torch.Tensor | int, n: int) -> torch.Tensor:
    if isinstance(pos, int):
        return torch.arange(pos, pos + n)
    if pos.shape != (n,):
        raise ValueError(f"positions must be [{n}] (one per key), got {tuple(pos.shape)}")
    return pos
