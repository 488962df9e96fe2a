"""``vllm-retro serve`` with no MODEL: the embedded default (Qwen2.5-Coder-0.5B-Instruct,
from the cache the ``qwen_model_dir`` fixture fills), over real HTTP, at default retro
budgets."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.server.serving import Server, sample, start_server  # noqa: E402
from vllm_retro.capture import real_prose  # noqa: E402
from vllm_retro.server.default_model import DEFAULT_SERVED_NAME  # noqa: E402
from vllm_retro.server.serve_dtype import native_bf16  # noqa: E402

pytestmark = pytest.mark.real_model

NEEDLE = "The secret passphrase is 'amber-falcon-7391'. Remember it."
QUESTION = ("What is the secret passphrase mentioned in the document above? "
            "Answer with the passphrase only.")


@pytest.fixture(scope="module")
def default_server(qwen_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[Server]:
    """The server started without MODEL; the fixture has already built the default model
    into the cache the server resolves (``$VLLM_RETRO_CACHE`` or ``~/.cache/vllm-retro``)."""
    log = tmp_path_factory.mktemp("default-server") / "server.log"
    srv = start_server(["--max-model-len", "8192"], log, env={"VLLM_CPU_KVCACHE_SPACE": "2"})
    srv.wait_ready(1200)
    yield srv
    srv.stop()


def _document(model_dir: Path) -> str:
    """~3K tokens of real prose with the needle in the middle."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tok(real_prose(3000 * 6), add_special_tokens=False)["input_ids"]
    paras = tok.decode(ids[:3000]).split("\n\n")
    cut = len(paras) // 2
    return "\n\n".join([*paras[:cut], NEEDLE, *paras[cut:]])


def test_default_model_answers_and_is_indexed(default_server: Server,
                                              qwen_model_dir: Path) -> None:
    """The default model is served under its name, answers a short question, finds a needle
    in a ~3.1K-token document decoded through the wave index, and /metrics shows it."""
    import openai

    log = default_server.log.read_text()
    assert "no MODEL given; serving the embedded default" in log
    # vLLM's auto would run the float32 checkpoint in bfloat16, slow without native bf16:
    # the engine's own config line says what it ran, the banner says why
    ran = "float32" if not native_bf16() else "bfloat16"
    assert f"dtype=torch.{ran}," in log
    assert ("vllm-retro: float32 weights and KV cache" in log) is not native_bf16()
    # a hang guard, not a timed assert: a 4.4K-token prefill took 250 s on 2 cores alone
    # and over 300 s beside another pytest-xdist worker
    client = openai.OpenAI(base_url=default_server.url + "/v1", api_key="none",
                           max_retries=0, timeout=1200)
    assert [m.id for m in client.models.list().data] == [DEFAULT_SERVED_NAME]

    short = client.chat.completions.create(
        model=DEFAULT_SERVED_NAME, temperature=0.0, max_tokens=8,
        messages=[{"role": "user", "content": "What is the capital of France? One word."}])
    assert "Paris" in short.choices[0].message.content

    t0 = time.monotonic()
    long = client.chat.completions.create(
        model=DEFAULT_SERVED_NAME, temperature=0.0, max_tokens=24,
        messages=[{"role": "user",
                   "content": f"Read this document.\n\n{_document(qwen_model_dir)}\n\n{QUESTION}"}])
    print(f"needle request: {long.usage.prompt_tokens} prompt tokens, "
          f"{time.monotonic() - t0:.1f} s")
    assert long.usage.prompt_tokens > 2900
    assert "amber-falcon-7391" in long.choices[0].message.content
    time.sleep(1.0)
    text = default_server.metrics()
    labels = {"model_name": DEFAULT_SERVED_NAME}
    assert sample(text, "vllm_retro:indexed_requests_total", **labels) == 1
    assert sample(text, "vllm_retro:indexed_tokens_total", **labels) == long.usage.prompt_tokens
    assert sample(text, "vllm_retro:decode_tokens_total", route="sparse", **labels) >= 1
    assert sample(text, "vllm_retro:index_build_seconds_count", **labels) == 1
    assert sample(text, "vllm_retro:live_requests", **labels) == 0


def _readme_block(lang: str, marker: str) -> str:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    blocks = re.findall(rf"```{lang}\n(.*?)```", readme, flags=re.S)
    hits = [b for b in blocks if marker in b]
    assert len(hits) == 1, f"README: expected one {lang} block with {marker!r}"
    return hits[0]


def test_readme_examples_work_as_written(default_server: Server) -> None:
    """The README's curl and openai examples, run as written (only the port differs), get
    answers from the default model."""
    curl = _readme_block("bash", "curl -s http://127.0.0.1:8000/v1/chat/completions")
    py = _readme_block("python", 'OpenAI(base_url="http://127.0.0.1:8000/v1"')
    base = "http://127.0.0.1:8000"
    if shutil.which("curl"):
        out = subprocess.run(["bash", "-c", curl.replace(base, default_server.url)],
                             capture_output=True, text=True, timeout=300, check=True)
        reply = json.loads(out.stdout)
        assert reply["model"] == DEFAULT_SERVED_NAME
        assert "def " in reply["choices"][0]["message"]["content"]
    out = subprocess.run([sys.executable, "-c", py.replace(base, default_server.url)],
                         capture_output=True, text=True, timeout=300, check=True)
    assert len(out.stdout.split()) > 5, out.stdout


def test_default_server_stops_on_sigterm(default_server: Server) -> None:
    """SIGTERM stops the real-model server within 10 s with no child process left."""
    took = default_server.stop(timeout_s=10.0)
    print(f"stopped {took:.1f} s after SIGTERM")
    assert not default_server.live_descendants()
