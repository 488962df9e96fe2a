"""``vllm-retro serve`` as a real process, over real HTTP, with the ``openai`` client.

One server (tiny Llama, fp32, API key, update blocks of 64 tokens so prompts from 132 tokens
on are indexed) serves every test of this module; the last test stops it with SIGTERM.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator

import httpx
import pytest

pytest.importorskip("vllm")

from tests.server.serving import (  # noqa: E402
    Server,
    help_lines,
    sample,
    start_server,
    unexpected_tracebacks,
)
from tests.tiny_model import build_tiny_llama  # noqa: E402
from vllm_retro.config import RetroConfig  # noqa: E402
from vllm_retro.vllm.metrics import FAMILIES, family_names  # noqa: E402

API_KEY = "sk-retro-test"
MODEL = "tiny-llama"
MAX_MODEL_LEN = 4096
LONG = "the quick brown fox jumps over the lazy dog. " * 40  # ~1000 tokens: indexed


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The module's server (stopped at the end if a test did not stop it)."""
    model = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-http"))
    log = tmp_path_factory.mktemp("server") / "server.log"
    srv = start_server([str(model), "--served-model-name", MODEL, "--dtype", "float32",
                        "--max-model-len", str(MAX_MODEL_LEN), "--api-key", API_KEY,
                        "--retro-update-segment", "64", "--max-num-seqs", "32"], log)
    srv.wait_ready(900)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: Server):
    """An ``openai.OpenAI`` client for the server."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                         timeout=120)


def _greedy(client, prompt: str, max_tokens: int) -> str:
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                    temperature=0.0, extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    return out.choices[0].text


def test_banner_and_models(server: Server, client) -> None:
    """The banner says where it listens and which retro settings are in force; /v1/models
    lists the served name."""
    deadline = time.monotonic() + 10  # the ready line comes from a poller thread
    while f"ready at {server.url}/v1" not in server.log.read_text():
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(0.2)
    log = server.log.read_text()
    assert f"listening on {server.url}" in log and "retro on:" in log
    assert "update_segment=64*" in log and "retrieval_budget=0.018 " in log
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_and_chat_streamed_equal_unstreamed(client) -> None:
    """Completions and chat completions, streamed and not, give the same greedy text."""
    text = _greedy(client, "Once upon a time", 24)
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24,
                                       temperature=0.0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream if c.choices) == text

    msgs = [{"role": "user", "content": "Say something."}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20,
                                          temperature=0.0, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == 20
    parts = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20,
                                           temperature=0.0, stream=True,
                                           extra_body={"ignore_eos": True})
    streamed = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
    assert streamed == chat.choices[0].message.content


def test_long_prompt_is_indexed_and_metrics_show_it(server: Server, client) -> None:
    """A long prompt gets a wave index and decodes through it; /metrics then shows every
    retro family (HELP text included), next to vLLM's own."""
    before = server.metrics()
    out = client.completions.create(model=MODEL, prompt=LONG, max_tokens=120,
                                    temperature=0.0, extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens > 300 and out.usage.completion_tokens == 120
    _greedy(client, "Hi", 8)  # a short request: decoded by vLLM's dense kernel
    time.sleep(1.0)  # the step after the last token reports the final gauges
    text = server.metrics()

    def grew(name: str, **labels: str) -> float:
        return sample(text, name, **labels) - sample(before, name, **labels)

    assert grew("vllm_retro:indexed_requests_total") == 1
    assert grew("vllm_retro:indexed_tokens_total") == out.usage.prompt_tokens
    lag = RetroConfig().build_steps_on("cpu")  # decoded on paged KV while the index builds
    assert grew("vllm_retro:decode_tokens_total", route="sparse") == 119 - lag
    assert grew("vllm_retro:decode_tokens_total", route="dense") >= 7 + lag
    assert grew("vllm_retro:index_build_seconds_count") == 1
    assert grew("vllm_retro:index_build_seconds_sum") > 0
    assert grew("vllm_retro:index_updates_total") >= 2  # 2 layers x >= 1 update block
    # On the CPU the fused decode kernel reads every cluster in place from the host tier
    # (the memory attention runs from): no device cache is used, so its families are
    # exported and stay at zero. Non-zero here would mean the per-row path served.
    for fam in ("device_cache_hit_clusters_total", "device_cache_miss_clusters_total",
                "host_to_device_bytes_total",
                "device_cache_hit_ratio", "device_tier_bytes"):
        assert sample(text, f"vllm_retro:{fam}") == 0, fam
    # Finished requests hold nothing.
    assert sample(text, "vllm_retro:live_requests") == 0
    assert sample(text, "vllm_retro:host_tier_bytes") == 0
    assert sample(text, "vllm_retro:clusters") == 0
    assert sample(text, "vllm:prompt_tokens_total") >= out.usage.prompt_tokens
    assert sample(text, "vllm:generation_tokens_total") >= 128
    assert sample(text, "vllm:time_to_first_token_seconds_count") >= 2
    helps = help_lines(text)
    for fam in FAMILIES:
        assert helps.get(fam.name), f"no HELP for {fam.name}"
    for name in family_names():
        assert name in text


@pytest.mark.parametrize("case", ["malformed_json", "unknown_model", "negative_max_tokens",
                                  "prompt_too_long", "wrong_api_key", "bad_chat_messages",
                                  "block_starts_past_text", "block_starts_past_chat"])
def test_bad_input_answers_4xx_and_server_keeps_serving(server: Server, client,
                                                        case: str) -> None:
    """Each bad request gets a 4xx with a message naming the problem; the next good
    request is served."""
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    body: dict | str = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
    path, status, words = "/v1/completions", 400, ()
    if case == "malformed_json":
        body, words = '{"model": "tiny-llama", "prompt": ', ("JSON",)
    elif case == "unknown_model":
        body["model"], status, words = "no-such-model", 404, ("no-such-model", "does not exist")
    elif case == "negative_max_tokens":
        body["max_tokens"], words = -5, ("max_tokens", "-5")
    elif case == "prompt_too_long":
        body["prompt"], words = "hello world " * 5000, ("maximum context length", "4096")
    elif case == "wrong_api_key":
        headers["Authorization"], status, words = "Bearer wrong", 401, ("Unauthorized",)
    elif case == "bad_chat_messages":
        path, body = "/v1/chat/completions", {"model": MODEL, "messages": "not a list"}
        words = ("messages",)
    elif case == "block_starts_past_text":  # counted by the server's tokenizer
        body["vllm_xargs"] = {"retro_blocks": [0, 2, 900]}
        words = ("retro_blocks", "900", "past the prompt's")
    elif case == "block_starts_past_chat":  # the chat template's tokens counted too
        path, words = "/v1/chat/completions", ("retro_blocks", "past the prompt's")
        body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user",
                                                               "content": "hello"}],
                "vllm_xargs": {"retro_blocks": [0, 900]}}
    data = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(server.url + path, content=data, headers=headers, timeout=60)
    assert r.status_code == status, r.text
    for w in words:
        assert w in r.text, r.text
    assert server.proc.poll() is None
    assert _greedy(client, "still serving?", 4)


def test_client_disconnect_mid_stream_frees_request_state(server: Server) -> None:
    """A client that drops an indexed streaming request: the worker frees its index and
    buffer (gauges back to zero) and vLLM no longer runs it."""
    body = {"model": MODEL, "prompt": LONG, "max_tokens": 2900, "temperature": 0.0,
            "stream": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(timeout=120) as http, \
            http.stream("POST", server.url + "/v1/completions", json=body,
                        headers=headers) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: "):
                break
        # The server generates whether or not the client reads (a slow client on a loaded
        # machine once read its 20th chunk after the request had finished), so the gauges
        # are read from the first chunk on, until a step's report shows the request running
        # with its index (each report is one engine step's, worker and scheduler alike).
        deadline = time.monotonic() + 30
        held = server.metrics()
        while not (sample(held, "vllm_retro:live_requests") == 1
                   and sample(held, "vllm:num_requests_running") == 1) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
            held = server.metrics()
        # what a failure shows: the gauges, and the server's word on this request (a dense
        # fallback or a wait for host memory is logged; a request that finished is counted)
        gauges = [line for line in held.splitlines() if line.startswith(
            ("vllm_retro:live", "vllm_retro:host_", "vllm_retro:clusters", "vllm:num_req",
             "vllm:request_success_total", "vllm_retro:indexed_requests_total"))
            and "_created" not in line and "to_device" not in line]
        said = [line for line in server.log.read_text().splitlines()
                if "retro:" in line and ("request" in line or "WARNING" in line)]
        gauges = "; ".join(gauges) + "\nserver log: " + "\n".join(said[-10:])
        assert sample(held, "vllm_retro:live_requests") == 1, gauges
        assert sample(held, "vllm:num_requests_running") == 1, gauges
        assert sample(held, "vllm_retro:host_tier_bytes") > 0, gauges
        assert sample(held, "vllm_retro:clusters") > 0, gauges
        # its reservation bounds what it holds, within the budget
        reserved = sample(held, "vllm_retro:host_reserved_bytes")
        assert sample(held, "vllm_retro:host_tier_bytes") <= reserved, gauges
        assert reserved <= sample(held, "vllm_retro:host_budget_bytes"), gauges
    # the connection is closed here, mid-stream
    deadline = time.monotonic() + 30
    while True:
        text = server.metrics()
        freed = (sample(text, "vllm_retro:live_requests") == 0
                 and sample(text, "vllm_retro:host_tier_bytes") == 0
                 and sample(text, "vllm_retro:host_reserved_bytes") == 0
                 and sample(text, "vllm:num_requests_running") == 0)
        if freed or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert freed, [line for line in text.splitlines() if "live" in line or "tier" in line
                   or "running" in line]
    assert sample(text, "vllm:generation_tokens_total") < 10_000


def test_sixteen_concurrent_streams_of_mixed_lengths(server: Server, client) -> None:
    """16 streaming requests at once (prompts of 18 to ~1150 tokens, 8 to 64 new tokens):
    each completes with its requested length and the same text as when run alone."""
    reqs = [("word " * (5 + 25 * i) + f"#{i}", 8 + 4 * (i % 15)) for i in range(16)]
    results: dict[int, tuple[str, str | None, int | None]] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        prompt, n = reqs[i]
        try:
            stream = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=n, temperature=0.0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            text, finish, used = "", None, None
            for c in stream:
                if c.choices:
                    text += c.choices[0].text
                    finish = c.choices[0].finish_reason or finish
                if c.usage is not None:
                    used = c.usage.completion_tokens
            results[i] = (text, finish, used)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert sorted(results) == list(range(16))
    for i, (prompt, n) in enumerate(reqs):
        text, finish, used = results[i]
        assert finish == "length" and used == n, (i, finish, used)
        assert text == _greedy(client, prompt, n), f"request {i} differs from a lone run"


def test_sigterm_stops_cleanly_within_10s(server: Server) -> None:
    """SIGTERM: the server exits within 10 s and leaves no child process behind; its log
    has no traceback and no teardown noise."""
    assert server.descendants, "the server should run an engine-core child process"
    took = server.stop(timeout_s=10.0)
    print(f"stopped {took:.1f} s after SIGTERM")
    assert server.proc.returncode is not None
    assert took < 10.0
    assert not server.live_descendants(), "child processes outlived the server"
    with pytest.raises(OSError):
        urllib.request.urlopen(server.url + "/health", timeout=2)
    assert not unexpected_tracebacks(server.log.read_text()), server.log_tail()
    # nor the interpreter's teardown reports of the engine's processes (issue 42)
    full = server.log.with_suffix(".full.log")
    for text in (server.log.read_text(), full.read_text() if full.exists() else ""):
        assert "nanobind: leaked" not in text, text[-3000:]

