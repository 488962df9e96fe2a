"""vllm-retro: RetroInfer's wave index and wave buffer for vLLM's KV cache."""

__version__ = "0.1.0"
