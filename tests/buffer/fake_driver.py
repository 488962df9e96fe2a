"""A strict stand-in for the CUDA driver's host-memory registrations, to test a host pool's
pinning lifecycle without a GPU.

The real driver refuses a range that overlaps one registered already (``cudaHostRegister``
error 712, ``cudaErrorHostMemoryAlreadyRegistered``), and memory unmapped while registered
stays in its table: the kernel hands those addresses to the next mapping, whose
registration then fails, as does torch's pinned allocator there ("resource already
mapped"). Whether the addresses come back is up to the kernel, so this fake fails on the
cause instead, deterministically: it makes the pool's mappings itself (``mapper``) and
watches their lifetimes.
"""

from __future__ import annotations

import mmap
import weakref

import numpy as np
import torch

from vllm_retro.buffer.host_tier import anonymous_mapping


def _overlap(a: int, n: int, b: int, m: int) -> bool:
    return a < b + m and b < a + n


class StrictDriver:
    """Registered ranges and live mappings (start -> bytes). Fails, by AssertionError, on:
    a registration overlapping a registered range; a registration outside the mappings it
    made; unregistering what is not a registered start; unmapping a mapping that holds
    registered bytes (recorded when the mapping dies, raised by the next call and by
    :meth:`check`); anything registered at :meth:`close`. :attr:`log` orders the calls, so
    a test can check that a ``fence`` came before the unregistering.

    Hand a pool ``pinner=(driver.register, driver.unregister)``, ``mapper=driver.map`` and
    ``fence=driver.fence``."""

    def __init__(self):
        self.registered: dict[int, int] = {}
        self.mappings: dict[int, int] = {}
        self.violations: list[str] = []
        self.log: list[str] = []
        """"register", "unregister" and "fence", in call order."""

    def map(self, nbytes: int) -> mmap.mmap:
        """A real anonymous mapping, watched until it is unmapped."""
        mm = anonymous_mapping(nbytes)
        start = np.frombuffer(mm, dtype=np.uint8).ctypes.data
        self.mappings[start] = nbytes
        weakref.finalize(mm, self._unmapped, start, nbytes).atexit = False
        return mm

    def _unmapped(self, start: int, nbytes: int) -> None:
        del self.mappings[start]
        for ptr, n in self.registered.items():
            if _overlap(ptr, n, start, nbytes):
                self.violations.append(f"mapping {start:#x} (+{nbytes}) unmapped while "
                                       f"{ptr:#x} (+{n}) of it is registered")

    def register(self, ptr: int, nbytes: int) -> None:
        self.check()
        assert nbytes > 0, f"registering {nbytes} bytes"
        for p, n in self.registered.items():
            assert not _overlap(ptr, nbytes, p, n), (
                f"double registration: {ptr:#x} (+{nbytes}) overlaps {p:#x} (+{n}) "
                "(cudaHostRegister error 712)")
        assert self._mapped(ptr, nbytes), f"registering {ptr:#x} (+{nbytes}): not mapped"
        self.registered[ptr] = nbytes
        self.log.append("register")

    def unregister(self, ptr: int) -> None:
        self.check()
        assert ptr in self.registered, f"unregistering {ptr:#x}: not a registered start"
        del self.registered[ptr]
        self.log.append("unregister")

    def fence(self) -> None:
        """The device's reads submitted so far are done."""
        self.log.append("fence")

    def _mapped(self, ptr: int, nbytes: int) -> bool:
        return any(s <= ptr and ptr + nbytes <= s + n for s, n in self.mappings.items())

    def check(self) -> None:
        """No mapping was unmapped while registered; every registered range is mapped."""
        assert not self.violations, "; ".join(self.violations)
        for ptr, n in self.registered.items():
            assert self._mapped(ptr, n), f"{ptr:#x} (+{n}) registered, not mapped"

    def close(self) -> None:
        """:meth:`check`, and nothing is left registered."""
        self.check()
        assert not self.registered, f"left registered: {sorted(self.registered.items())}"

    def covered(self, t: torch.Tensor) -> int:
        """Bytes of ``t`` registered as one prefix (ranges contiguous from its start)."""
        at = t.data_ptr()
        while at in self.registered:
            at += self.registered[at]
        return at - t.data_ptr()
