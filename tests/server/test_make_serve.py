"""The README's first command, exactly as a user runs it: ``make serve`` with nothing
vLLM-specific in the environment (no ``VLLM_CPU_KVCACHE_SPACE``), while another process holds
4 GiB of memory; then the README's curl request, ``/metrics``, and SIGTERM."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

pytest.importorskip("vllm")

from tests.conftest import STARTING_ENVIRONMENT  # noqa: E402
from tests.server.serving import sample, unexpected_tracebacks  # noqa: E402

# runs_last: the server sizes its KV cache from the memory free when it starts; a real-model
# server started beside it afterwards would take that memory (tests/conftest.py)
pytestmark = [pytest.mark.real_model, pytest.mark.runs_last]

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
HELD_BYTES = 4 << 30
README_PORT = 8000


def user_environment() -> dict[str, str]:
    """The environment the suite started with less anything vLLM-, Triton-, OpenMP- or
    CUDA-specific (the README sets nothing). ``VLLM_RETRO_CACHE`` stays when set (where the
    model was built)."""
    drop = ("VLLM_", "TRITON_", "OMP_", "CUDA_")
    env = {k: v for k, v in STARTING_ENVIRONMENT.items()
           if not k.startswith(drop) or k == "VLLM_RETRO_CACHE"}
    env.pop("VIRTUAL_ENV", None)
    return env


def readme_block(lang: str, must_contain: str) -> str:
    """The first fenced ``lang`` block of the README that contains ``must_contain``."""
    for block in re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S):
        if must_contain in block:
            return block.strip()
    raise AssertionError(f"README has no ```{lang} block with {must_contain!r}")


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def held_memory() -> Iterator[None]:
    """Another process holding (touching) 4 GiB for the duration of the module."""
    hog = subprocess.Popen(
        [sys.executable, "-c",
         f"import sys, time\nb = bytearray({HELD_BYTES})\n"
         "for i in range(0, len(b), 4096): b[i] = 1\n"
         "print('held', flush=True)\ntime.sleep(3600)"],
        stdout=subprocess.PIPE, text=True)
    assert hog.stdout is not None and hog.stdout.readline().strip() == "held"
    yield
    hog.kill()
    hog.wait()


@pytest.fixture(scope="module")
def make_serve(qwen_model_dir: Path, held_memory: None, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[tuple[subprocess.Popen, Path, int]]:
    """``make serve`` as the README writes it (on port 8000 when it is free; else the README's
    ``SERVE_ARGS="--port N"`` form), its process group, output file and port."""
    del qwen_model_dir  # only makes sure the default model is in the cache
    out = tmp_path_factory.mktemp("make-serve") / "out.log"
    cmd = ["make", "serve"]
    port = README_PORT
    if not port_free(port):
        from vllm_retro.server.process import free_port

        port = free_port()
        cmd.append(f"SERVE_ARGS=--port {port}")
    with out.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=user_environment(), stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 900
    while "vllm-retro: ready at" not in out.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"make serve did not become ready:\n{out.read_text()[-4000:]}")
        time.sleep(1)
    yield proc, out, port
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def test_make_serve_as_written(make_serve: tuple[subprocess.Popen, Path, int]) -> None:
    """It starts with 4 GiB held elsewhere and says which KV size it chose and how to change
    it; the README's curl request gets an answer; /metrics carries vLLM's and retro's
    families; SIGTERM to the process group (as a terminal or a supervisor sends it) stops every
    process within 15 s, with no traceback in the log."""
    proc, out, port = make_serve
    text = out.read_text()
    assert "sized from free memory" in text and "--kv-cache-memory-bytes" in text
    log_path = re.search(r"vllm-retro: log (\S+)", text)
    assert log_path and Path(log_path.group(1)).is_file()
    # vLLM's own start-up lines (and any traceback) stay in the log file, not on the terminal.
    assert "EngineCore" not in text and "Traceback" not in text
    assert "EngineCore" in Path(log_path.group(1)).read_text()

    curl = readme_block("bash", "curl -s http://127.0.0.1:8000/v1/chat/completions")
    curl = curl.replace(":8000/", f":{port}/")
    res = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    answer = json.loads(res.stdout)
    content = answer["choices"][0]["message"]["content"]
    assert "[::-1]" in content or "reverse" in content.lower(), content
    assert answer["usage"]["completion_tokens"] > 0

    metrics = subprocess.run(["curl", "-s", f"http://127.0.0.1:{port}/metrics"],
                             capture_output=True, text=True, timeout=60).stdout
    assert sample(metrics, "vllm:prompt_tokens_total") >= answer["usage"]["prompt_tokens"]
    assert sample(metrics, "vllm_retro:live_requests") == 0
    assert "vllm_retro:device_cache_hit_ratio" in metrics

    tree = psutil.Process(proc.pid).children(recursive=True)
    assert len(tree) >= 3  # the supervisor, the API server, the engine core (and more)
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(15)
    _, alive = psutil.wait_procs(tree, timeout=15)
    assert not alive, f"still running after SIGTERM: {alive}"
    print(f"stopped in {time.monotonic() - t0:.1f} s")
    # make reports the signal it got (-SIGTERM); the server itself drained and exited cleanly.
    assert proc.returncode in (0, -signal.SIGTERM), out.read_text()[-2000:]
    after_ready = Path(log_path.group(1)).read_text().split("vllm-retro: ready at", 1)[1]
    assert not unexpected_tracebacks(after_ready), after_ready[-3000:]
    # the terminal shows the stop in vllm-retro's words, not vLLM's teardown
    text = out.read_text()
    assert "vllm-retro: stopping" in text and "vllm-retro: stopped" in text
    assert "Traceback" not in text and "[shutdown]" not in text
