"""Start-up supervision, the automatic CPU KV-cache size, dtype and eager default: unit tests of
each piece, and failed starts of the real console script answered in a few plain lines."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_retro.server.kv_budget import (
    MIN_KV_BYTES,
    GiB,
    NotEnoughMemory,
    choose_kv_bytes,
    weight_bytes,
)
from vllm_retro.server.supervisor import failure_summary, split_supervisor_options

CONSOLE_SCRIPT = Path(sys.executable).parent / "vllm-retro"

# ---------------------------------------------------------------------- options


def test_supervisor_options_are_split_off() -> None:
    rest, log, mode = split_supervisor_options(
        ["serve", "m", "--log-file", "/tmp/x.log", "--port", "9", "--startup-log=full"])
    assert rest == ["serve", "m", "--port", "9"]
    assert log == Path("/tmp/x.log") and mode == "full"
    rest, log, mode = split_supervisor_options(["serve"])
    assert rest == ["serve"] and log is None and mode == "brief"


@pytest.mark.parametrize(("argv", "needle"), [
    (["serve", "--startup-log", "loud"], "'loud' is invalid; accepted: brief, full"),
    (["serve", "--log-file"], "--log-file needs a value"),
])
def test_bad_supervisor_option_is_one_line(argv: list[str], needle: str) -> None:
    with pytest.raises(SystemExit) as exc:
        split_supervisor_options(argv)
    assert needle in str(exc.value.code)


# ---------------------------------------------------------------------- failure summary

_W = "(Worker pid=3513) ERROR 11-23 08:26:39 [multiproc_executor.py:1063] "
VLLM_MEMORY_FAILURE = [
    "(Worker pid=3513) INFO 11-23 08:26:39 [cpu_model_runner.py:91] Warming up done.",
    _W + "Traceback (most recent call last):",
    _W + "    raise ValueError(",
    _W + "ValueError: Available memory on node 0 (6.37/14.21 GiB) on kv cache allocation is "
         "less than requested memory for kv (7.12 GiB).",
    "(EngineCore pid=3492) ERROR 11-23 08:26:39 [core.py:1510] RuntimeError: Worker failed "
    "with error 'Available memory', please check the stack trace above for the root cause",
    "(APIServer pid=3446) RuntimeError: Engine core initialization failed. See root cause "
    "above. Failed core proc(s): {}",
]


def test_summary_names_the_root_cause_with_a_hint() -> None:
    """vLLM's wall of tracebacks becomes a hint plus the root-cause exception, not the
    wrappers printed after it."""
    lines = failure_summary(VLLM_MEMORY_FAILURE)
    assert len(lines) == 2
    assert lines[0].startswith("not enough free memory") and "--kv-cache-memory-bytes" in lines[0]
    assert "ValueError: Available memory on node 0 (6.37/14.21 GiB)" in lines[1]


def test_summary_prefers_vllm_retro_own_error() -> None:
    log = ["vllm-retro: serving x", "usage: vllm-retro serve ...",
           "vllm-retro serve: error: argument --port: invalid int value: 'x'"]
    assert failure_summary(log) == ["argument --port: invalid int value: 'x'"]
    log = ["vllm-retro: error: port 8000 on 127.0.0.1 is in use (another server?); pick another"
           " with --port N", "Traceback (most recent call last):", "OSError: whatever"]
    assert failure_summary(log) == ["port 8000 on 127.0.0.1 is in use (another server?); pick "
                                    "another with --port N"]


def test_summary_of_an_unknown_exception_and_of_silence() -> None:
    assert failure_summary(["(EngineCore pid=1) KeyError: 'model_type'"]) == [
        "KeyError: 'model_type'"]
    assert "without an error message" in failure_summary(["INFO started"])[0]


# ---------------------------------------------------------------------- KV budget


def test_kv_budget_arithmetic() -> None:
    """Half of what is left after weights and process overhead, 64 MiB aligned."""
    b = choose_kv_bytes(available_bytes=10 * GiB, weights=2 * GiB, overhead=2 * GiB)
    assert b.kv_bytes == 3 * GiB
    assert "3.0 GiB" in b.describe() and "--kv-cache-memory-bytes" in b.describe()
    b = choose_kv_bytes(available_bytes=10 * GiB + 12345, weights=0, overhead=0)
    assert b.kv_bytes % (64 << 20) == 0 and b.kv_bytes <= 5 * GiB + 12345


def test_kv_budget_refuses_too_little_memory_with_what_to_do() -> None:
    with pytest.raises(NotEnoughMemory) as exc:
        choose_kv_bytes(available_bytes=3 * GiB, weights=2 * GiB, overhead=GiB // 2)
    msg = str(exc.value)
    assert "3.0 GiB available" in msg and "--kv-cache-memory-bytes" in msg
    assert choose_kv_bytes(2 * MIN_KV_BYTES, 0, 0).kv_bytes == MIN_KV_BYTES


def test_weight_bytes_counts_weight_files_only(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "pytorch_model.bin").write_bytes(b"x" * 24)
    (tmp_path / "tokenizer.json").write_bytes(b"x" * 5000)
    assert weight_bytes(tmp_path) == 1024
    assert weight_bytes(tmp_path / "missing") == 0


# ---------------------------------------------------------------------- CLI choices

vllm = pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-supervisor"))


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    from vllm_retro.server import cli

    return cli.build_parser()


def _args(parser: argparse.ArgumentParser, *argv: str) -> argparse.Namespace:
    from vllm_retro.server import cli

    return cli.parse_args(["serve", *argv], parser)


def _model_args(parser: argparse.ArgumentParser, *argv: str) -> argparse.Namespace:
    from vllm_retro.server import cli

    args = _args(parser, *argv)
    cli.resolve_model(args)
    return args


def test_kv_size_chosen_only_when_the_user_did_not(parser: argparse.ArgumentParser,
                                                   tiny_model_dir: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """No size given: --kv-cache-memory-bytes is set from free memory (banner line returned).
    VLLM_CPU_KVCACHE_SPACE, --kv-cache-memory-bytes or --gpu-memory-utilization: untouched."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_retro.server import cli

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    args = _model_args(parser, str(tiny_model_dir))
    line = cli.size_kv_cache(args)
    assert line is not None and "sized from free memory" in line
    assert args.kv_cache_memory_bytes >= MIN_KV_BYTES
    assert args.gpu_memory_utilization == EngineArgs.gpu_memory_utilization
    for argv in (["--kv-cache-memory-bytes", "1G"], ["--gpu-memory-utilization", "0.5"]):
        args = _model_args(parser, str(tiny_model_dir), *argv)
        before = args.kv_cache_memory_bytes
        assert cli.size_kv_cache(args) is None
        assert args.kv_cache_memory_bytes == before
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    args = _model_args(parser, str(tiny_model_dir))
    assert cli.size_kv_cache(args) is None and args.kv_cache_memory_bytes is None


@pytest.mark.parametrize(("argv", "eager", "note"), [
    ([], True, True),
    (["--enforce-eager"], True, False),
    (["--no-enforce-eager"], False, False),
    (["-O3"], False, False),
    (["--compilation-config", '{"mode": 3}'], False, False),
])
def test_eager_by_default_on_cpu(parser: argparse.ArgumentParser, argv: list[str], eager: bool,
                                 note: bool) -> None:
    from vllm_retro.server import cli

    args = _args(parser, "m", *argv)
    line = cli.choose_execution_mode(args)
    assert args.enforce_eager is eager
    assert (line is not None) is note


def _model_stored_as(tiny_model_dir: Path, tmp_path: Path, checkpoint: str) -> Path:
    """The tiny model's files with config.json saying ``checkpoint`` (the weights as they
    are)."""
    import json
    import shutil

    model = tmp_path / f"{checkpoint}-model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "torch_dtype": checkpoint}))
    return model


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("checkpoint", ["bfloat16", "float32"])
def test_float32_by_default_on_cpus_without_native_bf16(
        parser: argparse.ArgumentParser, tiny_model_dir: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, native: bool, checkpoint: str) -> None:
    """No --dtype: the model loads in float32 where the CPU lacks native bfloat16 (banner
    line returned), and the automatic KV size counts the weights as loaded (float32 there;
    where vLLM's ``auto`` runs, bfloat16, a float32 checkpoint downcast). A given --dtype
    (``auto`` too) is never changed."""
    from vllm_retro.server import cli, kv_budget, serve_dtype

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(serve_dtype, "native_bf16", lambda cpuinfo=None: native)
    monkeypatch.setattr(kv_budget, "available_memory", lambda: 16 * GiB)
    model = _model_stored_as(tiny_model_dir, tmp_path, checkpoint)
    args = _model_args(parser, str(model))
    line = cli.choose_dtype(args)
    assert args.dtype == ("auto" if native else "float32")
    assert (line is None) is native
    cli.size_kv_cache(args)
    files = weight_bytes(model)  # the tiny model's files are float32, whatever config says
    scale = {("bfloat16", True): 1, ("bfloat16", False): 2, ("float32", True): 0.5,
             ("float32", False): 1}[checkpoint, native]
    expected = choose_kv_bytes(16 * GiB, int(files * scale)).kv_bytes
    assert args.kv_cache_memory_bytes == expected
    for given in ("auto", "bfloat16", "float32"):
        args = _model_args(parser, str(model), "--dtype", given)
        assert cli.choose_dtype(args) is None and args.dtype == given


def test_bf16_kept_when_float32_weights_do_not_fit(
        parser: argparse.ArgumentParser, tiny_model_dir: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_retro.server import cli, kv_budget, serve_dtype

    model = _model_stored_as(tiny_model_dir, tmp_path, "bfloat16")
    need16 = weight_bytes(model) + kv_budget.PROCESS_OVERHEAD_BYTES + 2 * MIN_KV_BYTES
    monkeypatch.setattr(serve_dtype, "native_bf16", lambda cpuinfo=None: False)
    monkeypatch.setattr(kv_budget, "available_memory",
                        lambda: need16 + weight_bytes(model) // 2)
    args = _model_args(parser, str(model))
    line = cli.choose_dtype(args)
    assert args.dtype == "auto" and line is not None and "would not fit" in line
    assert cli.size_kv_cache(args) is not None  # bfloat16 weights still leave room


# ---------------------------------------------------------------------- failed starts


def _run(argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    log = tmp_path / "serve.log"
    return subprocess.run([str(CONSOLE_SCRIPT), "serve", *argv, "--log-file", str(log)],
                          capture_output=True, text=True, timeout=300)


def test_failed_starts_say_why_in_a_few_lines(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A missing model directory, a folder that is not a model, a port in use and a bad option:
    each ends with the reason and the log's path in at most four lines, non-zero status,
    no traceback; the log keeps everything."""
    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cases = [
            (["/nonexistent/model"], "model directory /nonexistent/model does not exist"),
            ([str(not_a_model)], "has no config.json"),
            ([str(tiny_model_dir), "--port", str(port)], f"port {port} on 127.0.0.1 is in use"),
            ([str(tiny_model_dir), "--retro-retrieval-budget", "2"], "(0.0, 1.0]"),
        ]
        for argv, needle in cases:
            res = _run(argv, tmp_path)
            out = res.stdout + res.stderr
            assert res.returncode != 0, out
            assert "Traceback" not in out, out
            lines = out.strip().splitlines()
            assert len(lines) <= 4, out
            assert lines[-2].startswith("vllm-retro: the server did not start: "), out
            assert needle in lines[-2], out
            assert lines[-1] == f"vllm-retro: full log: {tmp_path / 'serve.log'}"
            assert needle in (tmp_path / "serve.log").read_text()
