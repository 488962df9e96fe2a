"""A worker extension (vLLM's ``worker_extension_cls``) exposing each worker's retro state
to ``LLM.collective_rpc("retro_stats")``."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from vllm_retro.vllm.runtime import get_runtime


class RetroWorkerExtension:
    """Mixed into vLLM's worker class; methods are callable through ``collective_rpc``."""

    def retro_stats(self) -> dict[str, Any]:
        """This worker's retro counters, live requests and live (host, device) bytes."""
        rt = get_runtime()
        host, device = rt.live_bytes()
        return {
            "pid": os.getpid(),
            "enabled": rt.config is not None,
            "counters": dataclasses.asdict(rt.counters),
            "live_requests": rt.registry.live(),
            "live_host_bytes": host,
            "live_device_bytes": device,
        }
