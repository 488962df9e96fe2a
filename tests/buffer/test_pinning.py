"""The host pool's pinning lifecycle against a strict fake of the CUDA driver
(:mod:`tests.buffer.fake_driver`): no range registered twice, no registered memory unmapped,
nothing registered after the pool is freed."""

import pytest

from tests.buffer.fake_driver import StrictDriver


def test_the_fake_driver_refuses_what_the_cuda_driver_refuses():
    drv = StrictDriver()
    mm = drv.map(1 << 20)
    ptr = drv.mappings.copy().popitem()[0]
    drv.register(ptr, 4096)
    with pytest.raises(AssertionError, match="double registration"):
        drv.register(ptr + 4095, 10)
    with pytest.raises(AssertionError, match="not mapped"):
        drv.register(ptr + (1 << 20) - 4096, 8192)
    with pytest.raises(AssertionError, match="not a registered start"):
        drv.unregister(ptr + 64)
    drv.register(ptr + 4096, 4096)  # adjacent: fine
    with pytest.raises(AssertionError, match="left registered"):
        drv.close()
    drv.unregister(ptr)
    drv.unregister(ptr + 4096)
    del mm  # unmapped, nothing registered: fine
    drv.close()


def test_the_fake_driver_catches_registered_memory_unmapped():
    drv = StrictDriver()
    mm = drv.map(1 << 16)
    ptr = next(iter(drv.mappings))
    drv.register(ptr, 4096)
    del mm  # the last reference: unmapped
    with pytest.raises(AssertionError, match="unmapped while"):
        drv.check()
    other = drv.map(1 << 16)
    with pytest.raises(AssertionError, match="unmapped while"):
        drv.register(next(iter(drv.mappings)), 4096)
    del other
