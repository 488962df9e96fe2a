"""Giving the C heap's free memory back to the OS when the engine goes idle.

Decoding allocates and frees many mid-sized host buffers (torch CPU tensors: index builds,
execution buffers, per-step temporaries) from many threads. glibc keeps what is freed in its
arenas (and, having freed a large mapped block once, raises its mmap threshold so later ones
come from the heap too), so a burst of long requests leaves the server's resident memory a
step higher for good although nothing is live: the soak's first crowd raised it 4-9%
(``bench/README.md``). ``malloc_trim(0)`` returns every free page of every arena.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

logger = logging.getLogger(__name__)


@functools.cache
def _trim():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return libc.malloc_trim if libc is not None else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to call
        return None


def release_free_heap() -> bool:
    """Return the C heap's free pages to the OS (glibc ``malloc_trim(0)``: a walk over the
    arenas, milliseconds; for idle moments, not the decode step). False where the C library
    has no such call."""
    trim = _trim()
    if trim is None:
        return False
    trim(ctypes.c_size_t(0))
    return True
