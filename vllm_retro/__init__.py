"""vllm-retro: RetroInfer's wave index and wave buffer for vLLM's KV cache."""

import os as _os

__version__ = "0.1.0"

QUIET_TEARDOWN_ENV = "VLLM_RETRO_QUIET_TEARDOWN"
"""Set to 1 by ``vllm-retro serve`` for its processes: vLLM's engine-core and worker
processes then end without the interpreter's teardown reports on stderr (see
:mod:`vllm_retro.vllm.plugin`)."""

# The repository keeps kernels/ and server/ at its root (the project's layout); installs map
# them to vllm_retro.kernels / vllm_retro.server (pyproject's package-dir). A source checkout
# used without installing (e.g. `python -m bench.gpu` on a machine with only torch + triton)
# has no such mapping, so there the repository root joins this package's search path. An
# installed wheel has vllm_retro/kernels/ itself and never takes this branch.
_here = _os.path.dirname(_os.path.abspath(__file__))
_root = _os.path.dirname(_here)
if not _os.path.isdir(_os.path.join(_here, "kernels")) and _os.path.isfile(
        _os.path.join(_root, "kernels", "tripartite_attention.py")):
    __path__.append(_root)  # type: ignore[name-defined]  # noqa: F821


def register() -> None:
    """vLLM plugin entry point (``vllm.general_plugins``): see :mod:`vllm_retro.vllm.plugin`."""
    from vllm_retro.vllm.plugin import register as _register

    _register()
