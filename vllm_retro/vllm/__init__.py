"""vLLM integration: the retro attention backend, KV-cache spec/manager and connector.

Nothing here is imported by ``vllm_retro`` itself; vLLM loads :func:`vllm_retro.register`
(entry point ``vllm.general_plugins``) in every process, which imports :mod:`.plugin`.
Users switch retro on per engine with :func:`engine_kwargs`.
"""

from vllm_retro.vllm.settings import engine_kwargs, kv_transfer_config

__all__ = ["engine_kwargs", "kv_transfer_config"]
