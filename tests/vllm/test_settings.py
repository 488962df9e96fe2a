"""Retro settings read from a vLLM engine config."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_retro.config import ConfigError, RetroConfig
from vllm_retro.vllm.settings import (
    CONNECTOR_NAME,
    RetroSetupError,
    engine_kwargs,
    kv_transfer_config,
    retro_config,
)


def _vllm_config(retro=None, connector=CONNECTOR_NAME, spec=None, cache_dtype="auto"):
    extra = {} if retro is None else {"retro": retro}
    ktc = None if connector is None else SimpleNamespace(kv_connector=connector)
    return SimpleNamespace(additional_config=extra, kv_transfer_config=ktc,
                           speculative_config=spec,
                           cache_config=SimpleNamespace(cache_dtype=cache_dtype))


def test_defaults_when_connected_without_settings():
    assert retro_config(_vllm_config()) == RetroConfig()


def test_values_are_validated_into_the_dataclass():
    cfg = retro_config(_vllm_config({"retrieval_budget": 0.05, "kernel_backend": "torch"}))
    assert cfg.retrieval_budget == 0.05 and cfg.kernel_backend == "torch"


@pytest.mark.parametrize("retro, match", [
    ({"retrieval_budget": 1.5}, r"retrieval_budget=1\.5 is invalid; accepted"),
    ({"cluster_size": 0}, r"cluster_size=0 is invalid"),
    ({"no_such_knob": 1}, r"unknown key\(s\) 'no_such_knob'; accepted keys: .*cluster_size"),
    ("fast", r"must be a JSON object"),
])
def test_bad_values_name_the_value_and_the_accepted_range(retro, match):
    with pytest.raises(RetroSetupError, match=match):
        retro_config(_vllm_config(retro))


def test_stock_vllm_when_retro_not_requested():
    assert retro_config(_vllm_config(connector=None)) is None
    assert retro_config(_vllm_config(connector="SomeOtherConnector")) is None


def test_disabled_by_configuration():
    assert retro_config(_vllm_config({"enabled": False})) is None
    assert retro_config(_vllm_config({"enabled": False}, connector=None)) is None


def test_settings_without_the_connector_say_how_to_add_it():
    with pytest.raises(RetroSetupError, match="--kv-transfer-config") as err:
        retro_config(_vllm_config({"retrieval_budget": 0.05}, connector=None))
    assert '"kv_connector": "RetroConnector"' in str(err.value)


def test_unsupported_engine_features_fail_clearly():
    with pytest.raises(RetroSetupError, match="speculative decoding"):
        retro_config(_vllm_config({}, spec=object()))
    with pytest.raises(RetroSetupError, match=r"kv_cache_dtype='fp8'; accepted: 'auto'"):
        retro_config(_vllm_config({}, cache_dtype="fp8"))


def test_engine_kwargs_validate_early_and_activate_retro():
    with pytest.raises(ConfigError, match=r"local_window=-1"):
        engine_kwargs(local_window=-1)
    kw = engine_kwargs(retrieval_budget=0.05)
    assert kw["additional_config"] == {"retro": {"retrieval_budget": 0.05}}
    assert kw["kv_transfer_config"] == kv_transfer_config()
    assert kw["worker_extension_cls"].endswith("RetroWorkerExtension")
