"""vllm_retro.vllm.heap: free heap memory goes back to the OS."""

import platform

import psutil
import pytest
import torch

from vllm_retro.vllm.heap import release_free_heap


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="malloc_trim is glibc's")
def test_freed_heap_memory_returns_to_the_os():
    """200 MiB of 64 KiB tensors (heap, not mmap) freed while one allocated after them keeps
    the heap's top: the memory stays resident until the trim returns it."""
    proc = psutil.Process()
    chunks = [torch.ones(16 * 1024) for _ in range(3200)]
    pin = torch.ones(16 * 1024)  # above the chunks: free() alone cannot shrink the heap
    held = proc.memory_info().rss
    del chunks
    kept = proc.memory_info().rss
    assert release_free_heap()
    after = proc.memory_info().rss
    assert held - after > 150 * 2**20 and kept - after > 100 * 2**20, (held, kept, after)
    del pin
