"""Helpers for the wave buffer tests: the strict fake driver (synthetic clusterings:
:func:`tests.fixtures.random_clusters`)."""

from __future__ import annotations

import pytest

from tests.buffer.fake_driver import StrictDriver


@pytest.fixture
def driver():
    """A :class:`~tests.buffer.fake_driver.StrictDriver`, closed (nothing may be left
    registered, nothing unmapped while registered) when the test ends."""
    drv = StrictDriver()
    yield drv
    drv.close()
