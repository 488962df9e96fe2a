"""Retro settings of a vLLM engine: ``additional_config["retro"]`` validated into
:class:`~vllm_retro.config.RetroConfig`, plus the engine features retro needs.

Retro is active when the engine is configured with the retro connector
(``kv_transfer_config={"kv_connector": "RetroConnector", ...}``, see :func:`engine_kwargs`)
and ``retro.enabled`` is not false. Otherwise vLLM runs exactly as without the plugin.
"""

from __future__ import annotations

from typing import Any

from vllm_retro.config import ConfigError, RetroConfig

CONNECTOR_NAME = "RetroConnector"
CONNECTOR_MODULE = "vllm_retro.vllm.connector"
WORKER_EXTENSION = "vllm_retro.vllm.worker_ext.RetroWorkerExtension"


class RetroSetupError(ValueError):
    """The engine's configuration cannot run retro; the message says what to change."""


def kv_transfer_config() -> dict[str, Any]:
    """The ``kv_transfer_config`` that activates retro (connector name, module, role)."""
    return {"kv_connector": CONNECTOR_NAME, "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both"}


def engine_kwargs(**retro: Any) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` / ``EngineArgs`` that run retro with ``retro``
    settings (any :class:`RetroConfig` setting by its flat name, e.g. ``pq_bits``),
    validated here so a bad value fails early.

    Example: ``LLM(model, **engine_kwargs(retrieval_budget=0.05))``; then
    ``llm.collective_rpc("retro_stats")`` reports each worker's counters and live bytes.
    """
    RetroConfig.from_dict(retro)
    kwargs: dict[str, Any] = {"additional_config": {"retro": dict(retro)},
                              "kv_transfer_config": kv_transfer_config(),
                              "worker_extension_cls": WORKER_EXTENSION}
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        kwargs["attention_backend"] = "CUSTOM"  # the retro FlashAttention backend
    return kwargs


def _connector_name(vllm_config: Any) -> str | None:
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    return None if ktc is None else ktc.kv_connector


def retro_config(vllm_config: Any) -> RetroConfig | None:
    """The engine's validated retro config, or None when retro is off.

    Raises :class:`RetroSetupError` for a bad ``retro`` value, for ``retro`` settings given
    without the retro connector, and for engine features retro does not support.
    """
    extra = getattr(vllm_config, "additional_config", None) or {}
    raw = extra.get("retro") if isinstance(extra, dict) else None
    if raw is not None and not isinstance(raw, dict):
        raise RetroSetupError(
            f"retro config: additional_config['retro'] must be a JSON object of settings, "
            f"got {type(raw).__name__}: {raw!r}")
    try:
        cfg = RetroConfig.from_dict(raw or {})
    except (ConfigError, TypeError) as exc:
        raise RetroSetupError(str(exc)) from None
    connected = _connector_name(vllm_config) == CONNECTOR_NAME
    if not cfg.enabled:
        return None
    if not connected:
        if raw is None:
            return None  # plugin installed, retro not requested: stock vLLM
        raise RetroSetupError(
            "retro config: additional_config['retro'] is set but the retro connector is not "
            f"configured; add --kv-transfer-config '{_json(kv_transfer_config())}' (or use "
            "vllm_retro.vllm.engine_kwargs / `vllm-retro serve`), or set "
            "additional_config['retro']['enabled']=false")
    _check_engine(vllm_config)
    return cfg


def _json(obj: Any) -> str:
    import json

    return json.dumps(obj)


def _check_engine(vllm_config: Any) -> None:
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise RetroSetupError(
            "retro does not support speculative decoding (speculative_config is set); "
            "accepted: no speculative_config")
    cache = getattr(vllm_config, "cache_config", None)
    dtype = str(getattr(cache, "cache_dtype", "auto"))
    if dtype != "auto":
        raise RetroSetupError(
            f"retro does not support kv_cache_dtype={dtype!r}; accepted: 'auto' "
            "(the model's dtype)")
