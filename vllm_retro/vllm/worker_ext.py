"""A worker extension (vLLM's ``worker_extension_cls``) exposing each worker's retro state
to ``LLM.collective_rpc("retro_stats")``."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from vllm_retro.vllm.counters import RetroCounters
from vllm_retro.vllm.runtime import engine_runtime


class RetroWorkerExtension:
    """Mixed into vLLM's worker class; methods are callable through ``collective_rpc``."""

    vllm_config: Any
    """The worker's engine config (vLLM's worker sets it)."""

    def retro_stats(self) -> dict[str, Any]:
        """This worker's retro counters, live requests and live (host, device) bytes (retro
        off: not enabled, counters at zero, nothing live)."""
        rt = engine_runtime(self.vllm_config)
        host, device = (0, 0) if rt is None else rt.live_bytes()
        return {
            "pid": os.getpid(),
            "enabled": rt is not None,
            "counters": dataclasses.asdict(RetroCounters() if rt is None else rt.counters),
            "live_requests": [] if rt is None else rt.registry.live(),
            "live_host_bytes": host,
            "live_device_bytes": device,
        }
