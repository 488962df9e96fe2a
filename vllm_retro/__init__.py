"""vllm-retro: RetroInfer's wave index and wave buffer for vLLM's KV cache."""

__version__ = "0.1.0"


def register() -> None:
    """vLLM plugin entry point (``vllm.general_plugins``): see :mod:`vllm_retro.vllm.plugin`."""
    from vllm_retro.vllm.plugin import register as _register

    _register()
