"""vLLM integration: the retro attention backend, KV-cache spec/manager and connector.

Nothing here is imported by ``vllm_retro`` itself; vLLM loads :func:`vllm_retro.register`
(entry point ``vllm.general_plugins``) in every process, which imports :mod:`.plugin`.
"""
