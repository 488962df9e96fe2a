"""Test-wide setup.

``TRITON_INTERPRET`` must be set before any ``@triton.jit`` kernel is defined, so the kernel
tests can run Triton on CPU tensors; it is set here, before any test module imports kernels.
"""

import os

STARTING_ENVIRONMENT = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
"""The environment the suite was started with, before this file, an engine in this process or
any test changed it (vLLM's start-up sets a dozen variables that a server started later would
inherit): what a user's shell hands the servers the tests start."""

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    # every core even under pytest-xdist: a real-model file that runs last runs alone
    torch.set_num_threads(max(1, os.cpu_count() or 1))


@pytest.fixture
def rng() -> torch.Generator:
    """A fresh, seeded generator per test (the seed varies with the test's name)."""
    import zlib

    name = os.environ.get("PYTEST_CURRENT_TEST", "")
    return torch.Generator().manual_seed(zlib.crc32(name.encode()))


@pytest.fixture
def triton_device() -> str:
    """Where Triton kernels run in this process: 'cpu' under the interpreter, 'cuda' on a GPU."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    pytest.skip("Triton needs TRITON_INTERPRET=1 or a CUDA GPU")
pytest_plugins = ["tests.conftest_real", "tests.required_parts", "pytester"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files with real-model tests first (stable otherwise): pytest-xdist hands out files in
    this order, and a minutes-long file handed out last would run alone at the end. Files
    marked ``runs_last`` go after everything else: they size a server from the memory free
    when it starts, so no real-model server may start beside them later (two such servers
    overran a 23 GB machine, and a shutdown meant to take 5 s took over 15)."""
    def rank(item: pytest.Item) -> int:
        if item.get_closest_marker("runs_last") is not None:
            return 2
        return 0 if item.nodeid.split("::")[0] in heavy else 1

    heavy = {item.nodeid.split("::")[0] for item in items
             if item.get_closest_marker("real_model") is not None}
    items.sort(key=rank)
