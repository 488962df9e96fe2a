"""Start-up supervision, the automatic CPU KV-cache size, dtype and eager default: unit tests of
each piece, and failed starts of the real console script answered in a few plain lines."""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import STARTING_ENVIRONMENT
from vllm_retro.server.kv_budget import (
    MIN_KV_BYTES,
    GiB,
    NotEnoughMemory,
    choose_kv_bytes,
    weight_bytes,
)
from vllm_retro.server.process import free_port
from vllm_retro.server.supervisor import (
    death_summary,
    failure_summary,
    oom_kills,
    split_supervisor_options,
)

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


WORKER_KILLED = [
    "(APIServer pid=10) INFO 12-04 15:50:01 [loggers.py:259] Engine 000: Avg prompt "
    "throughput: 120.0 tokens/s",
    "(EngineCore pid=11) ERROR 12-04 15:50:02 [multiproc_executor.py:316] Worker proc "
    "VllmWorker-0 died unexpectedly (exit code: -9), shutting down executor.",
    "(APIServer pid=10) ERROR 12-04 15:50:02 [async_llm.py:700] "
    "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack "
    "trace (above) for the root cause.",
]

CORE_KILLED = [
    "(Worker pid=12) INFO 12-04 22:34:56 [multiproc_executor.py:843] Parent process exited, "
    "terminating worker queues",
    "(APIServer pid=10) WARNING 12-04 22:34:56 [core_client.py:817] [shutdown] MPClient: "
    "engine core exited unexpectedly; starting cleanup",
    WORKER_KILLED[2],
]
"""vLLM's lines when its engine-core process is killed (SIGKILL) while it serves."""


def test_death_summary_says_who_died_how_and_what_to_do() -> None:
    """A server that stops on its own after ready: the dead worker and its signal, the
    out-of-memory killer named (with what to change) only when it ran, an engine error's
    root cause, and silence said as such."""
    oom = death_summary(WORKER_KILLED, oom_killed=True, status=0)
    assert oom[0].startswith("a worker process was killed by the system's out-of-memory "
                             "killer") and "--kv-cache-memory-bytes" in oom[0]
    assert oom[1] == "(vLLM said: worker VllmWorker-0 died unexpectedly, exit code -9)"
    killed = death_summary(WORKER_KILLED, oom_killed=False, status=0)
    assert killed[0] == "a worker process was killed (SIGKILL) and the engine stopped with it"
    unread = [WORKER_KILLED[1].replace("-9", "None")]
    assert death_summary(unread, False, 0) == [
        "a worker process died and the engine stopped with it",
        "(vLLM said: worker VllmWorker-0 died unexpectedly, exit code None)"]
    assert "out-of-memory killer" in death_summary(unread, True, 0)[0]
    exited = death_summary([WORKER_KILLED[1].replace("-9", "1"),
                            "(Worker pid=12) RuntimeError: bad thing"], False, 0)
    assert exited[0] == ("a worker process exited (status 1) and the engine stopped with it: "
                         "RuntimeError: bad thing")
    assert death_summary(WORKER_KILLED[2:], oom_killed=True, status=0)[0].startswith(
        "the system's out-of-memory killer ran while it served")
    assert death_summary(["(EngineCore pid=11) ValueError: x"], False, 0) == [
        "the engine failed: ValueError: x"]
    assert death_summary(WORKER_KILLED[:1], False, 3) == [
        "the server exited with status 3 without an error message"]
    assert death_summary([], False, -signal.SIGKILL) == [
        "the server's API process was killed (SIGKILL)"]
    assert death_summary([], True, -signal.SIGKILL)[0].startswith(
        "the server's API process was killed by the system's out-of-memory killer")
    assert death_summary([], False, -signal.SIGSEGV) == ["the server's API process crashed "
                                                         "(SIGSEGV)"]
    crashed = [WORKER_KILLED[1].replace("-9", f"-{int(signal.SIGSEGV)}")]
    assert death_summary(crashed, False, 0)[0] == (
        "a worker process crashed (SIGSEGV) and the engine stopped with it")
    core_said = "(vLLM said: engine core exited unexpectedly)"
    assert death_summary(CORE_KILLED, False, 0) == [
        "the engine-core process ended without an error message (killed by a signal, or a "
        "crash in native code)", core_said]
    core_oom = death_summary(CORE_KILLED, True, 0)
    assert core_oom[0].startswith("the engine-core process was killed by the system's "
                                  "out-of-memory killer")
    assert "--kv-cache-memory-bytes" in core_oom[0]
    assert core_oom[1] == core_said
    segv = ["(EngineCore pid=11) Fatal Python error: Segmentation fault", *CORE_KILLED]
    assert death_summary(segv, False, 0) == [
        "the engine-core process failed: Fatal Python error: Segmentation fault", core_said]


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


@pytest.mark.parametrize("victim", ["VllmWorker-0", "EngineCore", "APIServer"])
def test_an_engine_process_killed_while_serving_is_reported_in_a_few_lines(
        tmp_path: Path, tiny_model_dir: Path, victim: str) -> None:
    """A worker process, the engine-core process or the API server's killed while the server
    serves (what the out-of-memory killer does when other programs take the memory): the
    server stops on its own, the supervisor says which process died and how, and the log's
    path, in at most three lines after vLLM's, exits non-zero, and leaves no process running
    (killed, the API server leaves its engine processes behind: the supervisor stops them)."""
    log = tmp_path / "serve.log"
    console = (tmp_path / "console.txt").open("w")  # a file: a pipe read only at the end fills
    proc = subprocess.Popen(
        [str(CONSOLE_SCRIPT), "serve", str(tiny_model_dir), "--port", str(free_port()),
         "--log-file", str(log)], stdout=console, stderr=subprocess.STDOUT, text=True,
        env={**STARTING_ENVIRONMENT, "VLLM_CPU_KVCACHE_SPACE": "1"}, start_new_session=True)
    kills_at_start = oom_kills()
    try:
        deadline = time.monotonic() + 600
        while "vllm-retro: ready at " not in (log.read_text() if log.exists() else ""):
            assert proc.poll() is None and time.monotonic() < deadline, \
                log.read_text()[-3000:] if log.exists() else "no log"
            time.sleep(0.5)
        # the process by the pid vLLM's log gives it (its process title may show it late),
        # among the server's processes
        pid = re.search(rf"\({victim} pid=(\d+)\)", log.read_text())
        tree = psutil.Process(proc.pid).children(recursive=True)
        victims = [p for p in tree if pid and p.pid == int(pid.group(1))]
        assert len(victims) == 1, _diagnose(proc, tree, log, kills_at_start)
        kills_before = oom_kills()
        os.kill(victims[0].pid, signal.SIGKILL)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        console.close()
    out = (tmp_path / "console.txt").read_text()
    assert proc.returncode != 0, out
    lines = out.strip().splitlines()
    assert lines[-1] == f"vllm-retro: full log: {log}", out
    assert "vllm-retro: stopped (log" not in out, out
    assert not [p for p in tree if _alive(p)]
    oom = oom_kills() != kills_before
    if victim == "APIServer":
        assert lines[-2].startswith("vllm-retro: the server stopped unexpectedly: " + (
            "the server's API process was killed by the system's out-of-memory killer "
            "(other programs" if oom else "the server's API process was killed (SIGKILL)")), out
        assert proc.returncode == 128 + signal.SIGKILL
        return
    if victim == "EngineCore":
        assert lines[-2] == "(vLLM said: engine core exited unexpectedly)", out
        assert lines[-3].startswith(
            "vllm-retro: the server stopped unexpectedly: the engine-core process "
            + ("was killed by the system's out-of-memory killer" if oom else
               "ended without an error message")), out
        return
    said = "(vLLM said: worker VllmWorker-0 died unexpectedly, exit code "
    assert lines[-2] in (said + "-9)", said + "None)"), out  # None: read before reaped
    expect = ("a worker process was killed by the system's out-of-memory killer" if oom else
              "a worker process was killed (SIGKILL)" if "-9" in lines[-2] else
              "a worker process died and the engine stopped with it")
    assert lines[-3].startswith(f"vllm-retro: the server stopped unexpectedly: {expect}"), out


def _diagnose(proc: subprocess.Popen, tree: list[psutil.Process], log: Path,
              kills_at_start: int | None) -> str:
    """What a failed search for the process to kill saw: the process tree, the supervisor's
    state, the kernel's out-of-memory kills since the start and the log's last lines."""
    rows = []
    for p in tree:
        try:
            title = f"{p.name()} {' '.join(p.cmdline())}"[:120].rstrip()
            rows.append(f"{p.pid} <- {p.ppid()} {p.status()} {title}")
        except psutil.NoSuchProcess:
            rows.append(f"{p.pid} gone")
    tail = "\n".join(log.read_text().splitlines()[-40:]) if log.exists() else "no log"
    return (f"supervisor exit status {proc.poll()}; out-of-memory kills since start "
            f"{kills_at_start} -> {oom_kills()}; tree:\n" + "\n".join(rows) + f"\nlog:\n{tail}")


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
