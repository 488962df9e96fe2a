"""``register()``: what vLLM's ``vllm.general_plugins`` entry point runs in every process."""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
import threading

import torch

from vllm_retro import QUIET_TEARDOWN_ENV

_lock = threading.Lock()
_done = False


def register() -> None:
    """Register the retro backend, KV-cache spec/manager and connector with vLLM
    (idempotent; cheap when repeated). Whether retro is active is decided per engine by
    its configuration (:mod:`vllm_retro.vllm.settings`)."""
    global _done
    with _lock:
        if _done:
            return
        if os.environ.get(QUIET_TEARDOWN_ENV) == "1":
            # registered first, so it runs last of the hooks registered from here on
            atexit.register(_quiet_teardown)
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.platforms import current_platform
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

        from vllm_retro.vllm.kv_manager import register_spec
        from vllm_retro.vllm.settings import CONNECTOR_MODULE, CONNECTOR_NAME

        if current_platform.is_cpu():
            # Asks the kernel for permission to use AMX tiles in this process; vLLM's
            # bf16 CPU kernel never does, and dies with SIGILL on a short first request.
            init_amx = getattr(torch.cpu, "_init_amx", None)
            if init_amx is not None:
                init_amx()
            # The CPU platform ignores every backend choice but CPU_ATTN.
            register_backend(AttentionBackendEnum.CPU_ATTN,
                             "vllm_retro.vllm.backend.RetroAttentionBackend")
        elif current_platform.is_cuda():
            register_backend(AttentionBackendEnum.CUSTOM,
                             "vllm_retro.vllm.backend_cuda.RetroFlashAttentionBackend")
        register_spec()
        # vLLM's engine-core and worker processes end with a cyclic-GC pass over their whole
        # heap during interpreter finalization (2-3 s each with a model loaded, measured), which
        # pushes a draining shutdown past --shutdown-timeout and gets the engine killed
        # mid-teardown (an EngineDeadError traceback). Freezing the heap at exit skips that
        # pass; the OS reclaims the memory. vLLM does the same on ROCm only (see
        # EngineCoreProc.run_engine_core).
        atexit.register(gc.freeze)
        # ValueError: already registered (by a second plugin load in this process).
        with contextlib.suppress(ValueError):
            KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE,
                                                  "RetroConnector")
        _done = True


def _quiet_teardown() -> None:
    """At a server process's exit, once the exit hooks registered after it have run (vLLM's
    shutdown included): flush, then send stderr to /dev/null, so the interpreter's teardown
    does not end the server log with Triton's C++ bindings' ~70 lines of nanobind
    "leaked instance" reports (objects alive at exit, which the OS reclaims)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
