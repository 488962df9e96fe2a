"""Soak and fault run against ``vllm-retro serve``: hundreds of mixed requests from many
concurrent clients, client disconnects timed for every phase of a request, bad inputs, and
(with ``--faults``) faults injected on purpose; then checks that nothing was lost or leaked.

The requests (seeded, shuffled):

- **needles** (chat or completions, streamed or not): a RULER single needle
  (:func:`bench.accuracy.tasks.niah_single`) in 512 tokens up to ``--max-context``; each is
  also sent *alone* on the idle server first, and must be answered in the crowd as it was
  alone (right where it was right; the text itself is compared too);
- **prose** (chat or completions, streamed or not): 50 tokens up to the model's limit less
  ``max_tokens`` (a few near the limit), ``max_tokens`` from 8 to 512, some with ``n`` 2;
- **bad inputs**: a negative ``max_tokens``, ``n`` 0, a temperature below 0, an unknown
  model, a prompt past the model's limit, malformed JSON — each must get a 4xx;
- **disconnects**, timed for a phase: *queued* (gone 50 ms after sending, while the server
  is busy), *prefill* (a long prompt, gone before its first token), *index_build* (an
  indexed prompt, gone at its first token, while its index builds), *first_tokens* (gone
  after 3 tokens), *late_decode* (gone after 200 of 400 tokens);
- **faults** (``--faults``; the server must run with ``VLLM_RETRO_INJECT_FAULTS=1``, which
  ``--spawn`` sets): ``--faults-each`` requests per site of :mod:`vllm_retro.faults`, asked
  for by their request id (``X-Request-Id``). ``index_build``, ``host_alloc`` and
  ``update_worker`` carry needles and must be answered as alone; ``kernel_row`` and
  ``host_alloc_late`` (which decodes past its first update block) must end with an error to
  their own client and no one else.

Through the run a sampler reads, every second, the server processes' resident memory and
the gauges on ``/metrics`` (retro's live requests, host and device tier bytes, host
reservations; vLLM's running and waiting requests). The report (JSON, and a plot of memory
and gauges over time next to it, in ``bench/results/soak_<label>.*``) gives requests
answered, needles right against alone, aborts by phase, 4xx/5xx, the faults' outcomes and
the server's failure counters, time to drain, latency percentiles, how long the gauges took
to return to zero, resident memory after the run against after warm-up (with ``--rounds``
N > 1 also after each round: growth from round to round is a leak), and the tracebacks in
the server log (injected or not). ``verdict`` lists every check that failed.

    python -m bench.soak --spawn --faults --requests 300 --label qwen_cpu
    python -m bench.soak --url http://127.0.0.1:8000 --model-dir DIR --requests 100

Arguments after ``--`` go to ``vllm-retro serve`` (with ``--spawn`` only).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import random
import re
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil

from bench import serve_metrics as sm

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

FAULT_SITES = ("index_build", "host_alloc", "update_worker", "kernel_row", "host_alloc_late")
ANSWERED_FAULTS = ("index_build", "host_alloc", "update_worker")
"""Faults the request survives (dense fallback, or a recovered buffer job): answered."""
PHASES = ("queued", "prefill", "index_build", "first_tokens", "late_decode")
BAD_KINDS = ("max_tokens_negative", "n_zero", "temperature_negative", "unknown_model",
             "prompt_too_long", "malformed_json")
GAUGES = {
    "live_requests": "vllm_retro:live_requests",
    "host_tier_bytes": "vllm_retro:host_tier_bytes",
    "device_tier_bytes": "vllm_retro:device_tier_bytes",
    "host_reserved_bytes": "vllm_retro:host_reserved_bytes",
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
}
"""Gauges sampled through the run; every one must be back at zero after it."""
FAILURE_COUNTERS = {
    "dense_fallback_requests": "vllm_retro:dense_fallback_requests_total",
    "failed_requests": "vllm_retro:failed_requests_total",
    "buffer_update_failures": "vllm_retro:buffer_update_failures_total",
}


# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------

@dataclass
class Req:
    """One planned request."""

    index: int
    kind: str
    """'needle', 'prose', 'bad', 'abort' or 'fault'."""
    api: str = "completions"
    """'chat' or 'completions'."""
    stream: bool = False
    prompt_tokens: int = 0
    max_tokens: int = 16
    n: int = 1
    phase: str | None = None
    """For 'abort': the phase the client leaves in (:data:`PHASES`)."""
    site: str | None = None
    """For 'fault': the fault site."""
    bad: str | None = None
    """For 'bad': what is wrong (:data:`BAD_KINDS`)."""
    needle: int | None = None
    """Index into the run's needle samples."""
    prompt: str = field(default="", repr=False)
    """The user message (chat) or the rendered prompt (completions)."""


@dataclass
class Result:
    """What one request got."""

    index: int
    kind: str
    outcome: str = ""
    """'answered', 'error' (a 5xx, or an error in the stream), 'rejected' (a 4xx),
    'aborted' (the client left) or 'client_error' (the client's own failure)."""
    status: int = 0
    start: float = 0.0
    end: float = 0.0
    first_token: float | None = None
    tokens: int = 0
    text: str = ""
    error: str = ""
    needle_right: bool | None = None
    needle_same_text: bool | None = None
    phase: str | None = None
    site: str | None = None


def log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    """An integer from ``lo`` to ``hi``, uniform in its logarithm."""
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(max(lo, hi))))))


def plan_requests(args: argparse.Namespace, max_len: int, needle_tokens: list[int]
                  ) -> list[Req]:
    """The run's requests, seeded and shuffled (see module docstring). ``needle_tokens``:
    the needle samples' prompt tokens (a fault's needle must be indexed)."""
    rng = random.Random(args.seed)
    needle_count = len(needle_tokens)
    indexable = [i for i, n in enumerate(needle_tokens) if n >= args.min_indexed + 50]
    if args.faults and not indexable:
        raise SystemExit(f"no needle context reaches the indexed length {args.min_indexed}: "
                         "raise --max-context")
    reqs: list[Req] = []
    indexed = args.min_indexed
    late = args.update_segment + 200  # decodes past its first update block

    def add(**kw: Any) -> Req:
        r = Req(index=len(reqs), **kw)
        reqs.append(r)
        return r

    if args.faults:
        for site in FAULT_SITES:
            for _ in range(args.faults_each):
                if site in ANSWERED_FAULTS:
                    add(kind="fault", site=site, api=rng.choice(("chat", "completions")),
                        stream=rng.random() < 0.5, needle=rng.choice(indexable),
                        max_tokens=24)
                else:
                    add(kind="fault", site=site, api="completions", stream=rng.random() < 0.5,
                        prompt_tokens=rng.randint(indexed + 100, min(4 * indexed, max_len // 2)),
                        max_tokens=late if site == "host_alloc_late" else 64)
    for i in range(args.aborts):
        phase = PHASES[i % len(PHASES)]
        long_prompt = min((args.max_prompt or max_len) - 600, max(8 * indexed, 8192))
        tokens = {"queued": rng.randint(indexed, 4 * indexed),
                  "prefill": rng.randint(long_prompt // 2, long_prompt),
                  "index_build": rng.randint(indexed + 100, 4 * indexed)}.get(
                      phase, rng.randint(indexed + 100, 3 * indexed))
        add(kind="abort", phase=phase, api=rng.choice(("chat", "completions")),
            stream=phase != "queued", prompt_tokens=min(tokens, max_len - 500),
            max_tokens=400)
    n_bad = max(len(BAD_KINDS), round(args.requests * args.bad_share))
    for i in range(n_bad):
        add(kind="bad", bad=BAD_KINDS[i % len(BAD_KINDS)], api=rng.choice(("chat", "completions")))
    n_needles = round(args.requests * args.needle_share)
    for _ in range(n_needles):
        add(kind="needle", needle=rng.randrange(needle_count), max_tokens=24,
            api=rng.choice(("chat", "completions")), stream=rng.random() < 0.5)
    while len(reqs) < args.requests:
        max_tokens = rng.choice((8, 32, 32, 128, 128, 512))
        room = min(max_len, args.max_prompt or max_len) - max_tokens - 64
        # mostly up to 8K tokens, a few at the limit
        tokens = room if rng.random() < 0.03 else log_uniform(rng, 50, min(room, 8192))
        add(kind="prose", api=rng.choice(("chat", "completions")), stream=rng.random() < 0.5,
            prompt_tokens=tokens, max_tokens=max_tokens, n=2 if rng.random() < 0.1 else 1)
    order = list(range(len(reqs)))
    rng.shuffle(order)
    out = [reqs[i] for i in order]
    for i, r in enumerate(out):
        r.index = i
    return out


# --------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------

def tokenizer_fns(model_dir: Path) -> tuple[Any, Any]:
    """``(render, count_tokens)`` of the served model's tokenizer (chat template)."""
    from bench.accuracy.runner import tokenizer_fns as fns

    return fns(model_dir)


def needle_samples(count: int, max_context: int, seed: int, render: Any, count_tokens: Any
                   ) -> list[Any]:
    """``count`` single-needle samples at contexts from 512 tokens to ``max_context``; their
    ``prompt`` is the user message (not rendered)."""
    from bench.accuracy.tasks import niah_single

    contexts = [c for c in (512, 1024, 2048, 4096, 8192, 16384) if c <= max_context] or [512]
    out = []
    for i in range(count):  # sized without the chat template, then counted with it
        sample = niah_single(contexts[i % len(contexts)] - 32, seed + i, lambda text: text,
                             count_tokens)
        out.append(dataclasses.replace(sample, prompt_tokens=count_tokens(render(sample.prompt))))
    return out


def prose_prompt(tokens: int, seed: int, cpt: float) -> str:
    """About ``tokens`` tokens of real prose from a seeded offset, behind a unique header
    (prefix caching cannot serve it)."""
    from vllm_retro.capture import real_prose

    rng = random.Random(seed)
    n_chars = max(1, int(tokens * cpt))
    corpus = real_prose(min(600_000, 2 * n_chars + 100_000))
    header = f"Soak request {seed}-{rng.getrandbits(40):010x}. Continue this text:\n\n"
    start = rng.randrange(max(1, len(corpus) - n_chars))
    return header + corpus[start:start + max(1, n_chars - len(header))]


def fill_prompts(reqs: list[Req], needles: list[Any], render: Any, count_tokens: Any,
                 seed: int) -> None:
    """Each request's text: its needle's message (rendered for completions), or prose cut to
    its token count."""
    sample = prose_prompt(2000, seed, 4.0)
    cpt = len(sample) / max(1, count_tokens(sample))
    for r in reqs:
        if r.needle is not None:
            msg = needles[r.needle].prompt
            r.prompt = msg if r.api == "chat" else render(msg)
            r.prompt_tokens = needles[r.needle].prompt_tokens
        elif r.prompt_tokens:
            # the chat template adds a few tokens: leave room for them
            text = prose_prompt(max(1, r.prompt_tokens - 30), seed * 100_003 + r.index, cpt)
            r.prompt = text if r.api == "chat" else render(text)


# --------------------------------------------------------------------------------------------
# Clients
# --------------------------------------------------------------------------------------------

def request_body(r: Req, model: str, max_len: int) -> tuple[str, Any]:
    """(path, JSON body or raw bytes) of ``r``."""
    path = "/v1/chat/completions" if r.api == "chat" else "/v1/completions"
    body: dict[str, Any] = {"model": model, "max_tokens": r.max_tokens, "n": r.n,
                            "temperature": 0.0 if r.n == 1 else 0.7, "seed": r.index,
                            "stream": r.stream}
    if r.kind in ("abort", "fault", "prose"):
        body["ignore_eos"] = True
    if r.stream:
        body["stream_options"] = {"include_usage": True}
    prompt = r.prompt or "Say hello."
    if r.api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if r.bad == "max_tokens_negative":
        body["max_tokens"] = -5
    elif r.bad == "n_zero":
        body["n"] = 0
    elif r.bad == "temperature_negative":
        body["temperature"] = -1.0
    elif r.bad == "unknown_model":
        body["model"] = "no-such-model"
    elif r.bad == "prompt_too_long":
        text = "word " * (max_len + 500)
        if r.api == "chat":
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
    elif r.bad == "malformed_json":
        return path, b'{"model": "' + model.encode() + b'", "prompt": "unterminated'
    return path, body


def _delta_text(chunk: dict[str, Any], chat: bool) -> str:
    out = []
    for choice in chunk.get("choices") or ():
        if chat:
            out.append((choice.get("delta") or {}).get("content") or "")
        else:
            out.append(choice.get("text") or "")
    return "".join(out)


async def send(http: httpx.AsyncClient, url: str, r: Req, model: str, max_len: int,
               headers: dict[str, str], t0: float) -> Result:
    """Send ``r`` and record what came back; a planned disconnect leaves at its phase."""
    res = Result(r.index, r.kind, phase=r.phase, site=r.site)
    path, body = request_body(r, model, max_len)
    hdrs = dict(headers)
    if r.site is not None:
        hdrs["X-Request-Id"] = f"soak-{r.index}-retro-fault-{r.site}"
    else:
        hdrs["X-Request-Id"] = f"soak-{r.index}-{r.kind}"
    res.start = time.perf_counter() - t0
    chat = r.api == "chat"
    try:
        if isinstance(body, bytes):
            resp = await http.post(url + path, content=body,
                                   headers={**hdrs, "Content-Type": "application/json"})
            res.status, res.error = resp.status_code, resp.text[:300]
        elif r.phase == "queued":
            try:
                await asyncio.wait_for(http.post(url + path, json=body, headers=hdrs), 0.05)
                res.outcome = "answered_before_abort"
            except asyncio.TimeoutError:
                res.outcome = "aborted"
        elif not r.stream:
            resp = await http.post(url + path, json=body, headers=hdrs)
            res.status = resp.status_code
            if resp.status_code == 200:
                data = resp.json()
                choices = data.get("choices") or []
                res.text = (choices[0].get("message", {}).get("content") if chat
                            else choices[0].get("text")) if choices else ""
                res.text = res.text or ""
                res.tokens = int((data.get("usage") or {}).get("completion_tokens") or 0)
                res.first_token = None
            else:
                res.error = resp.text[:300]
        else:
            await _stream(http, url + path, body, hdrs, r, res, t0, chat)
    except (httpx.HTTPError, OSError) as exc:
        res.outcome = res.outcome or "client_error"
        res.error = f"{type(exc).__name__}: {exc}"[:300]
    res.end = time.perf_counter() - t0
    if not res.outcome:
        res.outcome = ("answered" if res.status == 200 and not res.error else
                       "rejected" if 400 <= res.status < 500 else "error")
    return res


async def _stream(http: httpx.AsyncClient, url: str, body: dict[str, Any],
                  headers: dict[str, str], r: Req, res: Result, t0: float, chat: bool) -> None:
    """A streamed request: reads events until the end, an error event, or its phase to
    leave in (then closes the connection: the server sees the client gone)."""
    leave_after = {"index_build": 1, "first_tokens": 3, "late_decode": 200}.get(r.phase or "")
    deadline = None
    if r.phase == "prefill":
        deadline = time.perf_counter() + 1.0  # well inside a long prompt's prefill
    async with http.stream("POST", url, json=body, headers=headers) as resp:
        res.status = resp.status_code
        if resp.status_code != 200:
            res.error = (await resp.aread()).decode(errors="replace")[:300]
            return
        lines = resp.aiter_lines()
        while True:
            try:
                if deadline is not None:
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        res.outcome = "aborted"
                        return
                    line = await asyncio.wait_for(lines.__anext__(), left)
                else:
                    line = await lines.__anext__()
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                res.outcome = "aborted"
                return
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk and not chunk.get("choices"):
                res.error = json.dumps(chunk["error"])[:300]
                res.outcome = "error"
                continue
            piece = _delta_text(chunk, chat)
            usage = chunk.get("usage")
            if usage and usage.get("completion_tokens") is not None:
                res.tokens = int(usage["completion_tokens"])
            elif piece:
                res.tokens += 1
            if piece:
                res.text += piece
                if res.first_token is None:
                    res.first_token = time.perf_counter() - t0
            if leave_after is not None and res.tokens >= leave_after:
                res.outcome = "aborted"
                return


async def run_all(url: str, reqs: list[Req], model: str, max_len: int, concurrency: int,
                  headers: dict[str, str], timeout_s: float) -> tuple[list[Result], float]:
    """Every request through ``concurrency`` clients (a queue); returns the results and the
    seconds from the first send to the last result."""
    queue: asyncio.Queue[Req] = asyncio.Queue()
    for r in reqs:
        queue.put_nowait(r)
    results: list[Result] = []
    t0 = time.perf_counter()
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as http:
        async def worker() -> None:
            while not queue.empty():
                r = queue.get_nowait()
                results.append(await send(http, url, r, model, max_len, headers, t0))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sorted(results, key=lambda x: x.index), time.perf_counter() - t0


async def run_alone(url: str, reqs: list[Req], model: str, max_len: int,
                    headers: dict[str, str], timeout_s: float) -> dict[int, Result]:
    """Each request of ``reqs`` sent alone, one after another (a fault's request without its
    fault: the answer it must still give)."""
    out = {}
    async with httpx.AsyncClient(timeout=timeout_s) as http:
        for r in reqs:
            healthy = Req(**{**asdict(r), "site": None})  # a fault's request: as if none
            out[r.index] = await send(http, url, healthy, model, max_len, headers, 0.0)
    return out


# --------------------------------------------------------------------------------------------
# Watching the server
# --------------------------------------------------------------------------------------------

def server_processes(pid: int) -> list[psutil.Process]:
    """The server and its descendants (engine core, workers)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def resident_bytes(pid: int) -> int:
    """Resident memory of the server and its descendants, summed."""
    total = 0
    for p in server_processes(pid):
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


def resident_by_process(pid: int) -> dict[str, int]:
    """Resident memory of the server and each descendant, by ``"<pid> <name>"`` (where a
    growth sits: the API server, the engine core)."""
    out = {}
    for p in server_processes(pid):
        with contextlib.suppress(psutil.Error):
            out[f"{p.pid} {p.name()}"] = p.memory_info().rss
    return out


def gauges(url: str) -> dict[str, float]:
    """The :data:`GAUGES` and :data:`FAILURE_COUNTERS` now (-1 when ``/metrics`` fails)."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {k: -1.0 for k in (*GAUGES, *FAILURE_COUNTERS)}
    samples = sm.parse(text)
    return {**{k: sm.value(samples, n) for k, n in GAUGES.items()},
            **{k: sm.value(samples, n) for k, n in FAILURE_COUNTERS.items()}}


class Sampler(threading.Thread):
    """Samples resident memory and the gauges every ``period_s`` until stopped."""

    def __init__(self, url: str, pid: int | None, period_s: float = 1.0):
        super().__init__(daemon=True)
        self.url, self.pid, self.period_s = url, pid, period_s
        self.samples: list[dict[str, float]] = []
        self.t0 = time.perf_counter()
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            row = {"t": time.perf_counter() - self.t0, **gauges(self.url)}
            if self.pid is not None:
                row["rss_bytes"] = resident_bytes(self.pid)
            self.samples.append(row)
            self._stop_event.wait(self.period_s)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(30)


def wait_gauges_zero(url: str, timeout_s: float) -> tuple[float | None, dict[str, float]]:
    """Seconds until every gauge of :data:`GAUGES` reads 0 (None if not within
    ``timeout_s``), and the last reading."""
    t0 = time.perf_counter()
    while True:
        g = gauges(url)
        if all(g[k] == 0 for k in GAUGES):
            return time.perf_counter() - t0, g
        if time.perf_counter() - t0 > timeout_s:
            return None, g
        time.sleep(0.25)


_TRACEBACK = "Traceback (most recent call last)"


def tracebacks(log_text: str) -> list[dict[str, Any]]:
    """The tracebacks of a server log: their exception line, and whether an injected fault
    raised them (:class:`vllm_retro.faults.InjectedFault` in the traceback)."""
    lines = log_text.splitlines()
    found = []
    for i, line in enumerate(lines):
        if _TRACEBACK not in line:
            continue
        block = lines[i + 1:i + 60]
        exc = next((x.strip() for x in block
                    if re.match(r"^\s*(\(\w+ pid=\d+\)\s*)?[\w.]+(Error|Exception|Fault)\b", x)),
                   "?")
        found.append({"exception": exc[:300],
                      "injected": any("InjectedFault" in x for x in block)})
    return found


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------

def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    a = np.asarray(values)
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max()), "n": len(values)}


def summarise(reqs: list[Req], results: list[Result], alone: dict[int, Result],
              needles: list[Any]) -> dict[str, Any]:
    """Counts by kind and outcome, needles against alone, faults, latencies."""
    from bench.accuracy.scoring import score

    by_index = {r.index: r for r in reqs}
    for res in results:
        r = by_index[res.index]
        if r.needle is not None and res.outcome == "answered":
            res.needle_right = score(res.text, needles[r.needle].expected) == 1.0
            solo = alone.get(r.index)
            if solo is not None:
                res.needle_same_text = res.text == solo.text
    outcomes: dict[str, dict[str, int]] = {}
    for res in results:
        key = res.kind if res.site is None else f"fault:{res.site}"
        outcomes.setdefault(key, {}).setdefault(res.outcome, 0)
        outcomes[key][res.outcome] += 1
    needle_rows = []
    for res in results:
        r = by_index[res.index]
        if r.needle is None or res.outcome != "answered":
            continue
        solo = alone[r.index]
        solo_right = score(solo.text, needles[r.needle].expected) == 1.0
        needle_rows.append({"index": r.index, "right": res.needle_right,
                            "right_alone": solo_right, "same_text": res.needle_same_text})
    aborts = {p: {"planned": 0, "aborted": 0, "tokens_before": []} for p in PHASES}
    for res in results:
        if res.kind == "abort":
            a = aborts[res.phase or "?"]
            a["planned"] += 1
            a["aborted"] += res.outcome == "aborted"
            a["tokens_before"].append(res.tokens)
    statuses: dict[str, int] = {}
    for res in results:
        if res.status:
            statuses[str(res.status)] = statuses.get(str(res.status), 0) + 1
    answered = [res for res in results if res.outcome == "answered"]
    return {
        "requests": len(results),
        "outcomes": outcomes,
        "statuses": statuses,
        "needles": {
            "answered": len(needle_rows),
            "right": sum(bool(x["right"]) for x in needle_rows),
            "right_alone": sum(x["right_alone"] for x in needle_rows),
            "worse_than_alone": [x for x in needle_rows if x["right_alone"] and not x["right"]],
            "same_text": sum(bool(x["same_text"]) for x in needle_rows),
        },
        "aborts": aborts,
        "latency_s": percentiles([res.end - res.start for res in answered]),
        "ttft_s": percentiles([res.first_token - res.start for res in answered
                               if res.first_token is not None]),
    }


def verdict(report: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """Every check of the run that failed (empty: the run passed)."""
    s = report["summary"]
    bad = []
    unexpected_5xx = [r for r in report["results"] if r["outcome"] == "error"
                      and r["site"] not in ("kernel_row", "host_alloc_late")]
    if unexpected_5xx:
        shown = [(r["index"], r["kind"], r["status"], r["error"][:120])
                 for r in unexpected_5xx[:5]]
        bad.append(f"{len(unexpected_5xx)} errors outside the injected faults: {shown}")
    client = [r for r in report["results"] if r["outcome"] == "client_error"]
    if client:
        bad.append(f"{len(client)} requests failed in the client (timeouts, resets): "
                   f"{[(r['index'], r['error'][:120]) for r in client[:5]]}")
    for r in report["results"]:
        if r["kind"] == "bad" and r["outcome"] != "rejected":
            bad.append(f"bad input {r['index']} got {r['status']} ({r['outcome']}), not a 4xx")
    worse = s["needles"]["worse_than_alone"]
    if worse:
        bad.append(f"{len(worse)} needles right alone but wrong in the crowd: {worse[:5]}")
    if args.faults:
        for site in FAULT_SITES:
            got = s["outcomes"].get(f"fault:{site}", {})
            want = "answered" if site in ANSWERED_FAULTS else "error"
            if got.get(want, 0) != args.faults_each * args.rounds:
                bad.append(f"fault {site}: {got}, want {args.faults_each * args.rounds} {want}")
        c = report["failure_counters"]
        if c.get("failed_requests", 0) < 2 * args.faults_each:
            bad.append(f"server counted {c.get('failed_requests')} failed requests")
        if c.get("dense_fallback_requests", 0) < 2 * args.faults_each:
            bad.append(f"server counted {c.get('dense_fallback_requests')} dense fallbacks")
        if c.get("buffer_update_failures", 0) < args.faults_each:
            bad.append(f"server counted {c.get('buffer_update_failures')} buffer failures")
    if report["gauges_zero_after_s"] is None or report["gauges_zero_after_s"] > 10:
        bad.append(f"gauges not back to zero within 10 s: {report['gauges_after']}")
    rss = report.get("rss_ratio_after_to_warm")
    if rss is not None and rss > 1.05:
        bad.append(f"resident memory after the run {rss:.3f}x after warm-up (> 1.05)")
    grew = report.get("rss_ratio_last_to_first_round")
    if grew is not None and grew > 1.02:
        bad.append(f"resident memory grew {grew:.3f}x from the first round's end to the last's "
                   "(> 1.02: a leak)")
    other = [t for t in report["tracebacks"] if not t["injected"]]
    if other:
        bad.append(f"{len(other)} tracebacks not from injected faults: "
                   f"{[t['exception'] for t in other[:5]]}")
    return bad


def plot(samples: list[dict[str, float]], marks: dict[str, float], title: str,
         path: Path) -> None:
    """Resident memory and the gauges over time (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not samples:
        return
    t = [s["t"] for s in samples]
    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    if "rss_bytes" in samples[0]:
        axes[0].plot(t, [s["rss_bytes"] / 2**30 for s in samples], label="server RSS")
    axes[0].set_ylabel("GiB")
    axes[0].plot(t, [max(0.0, s["host_tier_bytes"]) / 2**30 for s in samples],
                 label="host tier")
    axes[0].plot(t, [max(0.0, s["host_reserved_bytes"]) / 2**30 for s in samples],
                 label="host reserved")
    axes[0].legend(loc="upper left")
    for key in ("live_requests", "running", "waiting"):
        axes[1].plot(t, [s[key] for s in samples], label=key)
    axes[1].set_ylabel("requests")
    axes[1].legend(loc="upper left")
    for key in FAILURE_COUNTERS:
        axes[2].plot(t, [s[key] for s in samples], label=key)
    axes[2].set_ylabel("count")
    axes[2].set_xlabel("seconds")
    axes[2].legend(loc="upper left")
    for ax in axes:
        for name, at in marks.items():
            ax.axvline(at, color="grey", linestyle=":", linewidth=0.8)
            if ax is axes[0]:
                ax.text(at, ax.get_ylim()[1], name, rotation=90, va="top", fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server (faults only if it runs with "
                                     "VLLM_RETRO_INJECT_FAULTS=1)")
    where.add_argument("--spawn", nargs="?", const="", metavar="MODEL",
                       help="start `vllm-retro serve [MODEL]` (default: the embedded model)")
    p.add_argument("--model-dir", help="the served model's directory, for its tokenizer "
                                       "(default: the spawned model, or the embedded one)")
    p.add_argument("--server-pid", type=int, help="with --url: the server's pid, for its "
                                                  "resident memory")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=12)
    p.add_argument("--rounds", type=int, default=1,
                   help="send the crowd this many times (same requests; memory that grows "
                        "from round to round leaks, a first round's growth may be pools "
                        "reaching their high-water mark)")
    p.add_argument("--aborts", type=int, default=65)
    p.add_argument("--faults", action="store_true", help="inject faults (see module docs)")
    p.add_argument("--faults-each", type=int, default=5)
    p.add_argument("--needle-share", type=float, default=0.15)
    p.add_argument("--bad-share", type=float, default=0.05)
    p.add_argument("--max-context", type=int, default=16384,
                   help="longest needle context (tokens)")
    p.add_argument("--max-prompt", type=int, default=None,
                   help="longest prose prompt + max_tokens (default: the model's limit; a "
                        "2-core CPU prefills a 32K prompt in minutes)")
    p.add_argument("--min-indexed", type=int, default=1092,
                   help="the server's shortest indexed context (default: retro's defaults)")
    p.add_argument("--update-segment", type=int, default=1024,
                   help="the server's --retro-update-segment")
    p.add_argument("--api-key", default=None)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default="run")
    p.add_argument("--out", type=Path, default=RESULTS)
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    serve_args: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, serve_args = argv[:at], argv[at + 1:]
    args = build_parser().parse_args(argv)
    server = None
    if args.spawn is not None:
        from vllm_retro.server.process import ServerProcess

        log = Path(tempfile.mkdtemp(prefix="soak-")) / "server.log"
        model_args = [args.spawn] if args.spawn else []
        env = {"VLLM_RETRO_INJECT_FAULTS": "1"} if args.faults else {}
        if args.api_key:
            serve_args = [*serve_args, "--api-key", args.api_key]
        print(f"soak: starting vllm-retro serve {' '.join(model_args + serve_args)} "
              f"(log {log})", flush=True)
        server = ServerProcess.start(model_args + serve_args, log, env)
        server.wait_ready(900)
        url, pid = server.url, server.proc.pid
    else:
        url, pid = args.url.rstrip("/"), args.server_pid
    try:
        report = soak(args, url, pid)
        if server is not None:
            report["server_log"] = str(server.log)
            text = server.log.read_text(errors="replace")
            full = server.log.with_suffix(".full.log")
            if full.exists():
                text += full.read_text(errors="replace")
            report["tracebacks"] = tracebacks(text)
        else:
            report["tracebacks"] = []
        report["verdict"] = verdict(report, args)
    finally:
        if server is not None:
            report_stop = server.stop(30) if server.proc.poll() is None else None
            print(f"soak: server stopped ({report_stop})", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"soak_{args.label}"
    plot(report.pop("timeline"), report["marks"], f"soak {args.label}",
         stem.with_suffix(".png"))
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps({k: report[k] for k in ("summary", "failure_counters", "drain_s",
                                             "gauges_zero_after_s", "rss_ratio_after_to_warm",
                                             "verdict")}, indent=1, default=str))
    print(f"soak: wrote {stem}.json and .png; verdict: "
          f"{'PASS' if not report['verdict'] else 'FAIL'}", flush=True)
    return report


def soak(args: argparse.Namespace, url: str, pid: int | None) -> dict[str, Any]:
    """The run against a serving ``url`` (server process ``pid``, when known)."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    models = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"]
    model, max_len = models[0]["id"], int(models[0].get("max_model_len") or 4096)
    model_dir = Path(args.model_dir) if args.model_dir else None
    if model_dir is None:
        if args.spawn:
            model_dir = Path(args.spawn)
        else:
            from vllm_retro.server.default_model import default_model_dir

            model_dir = default_model_dir()
    render, count_tokens = tokenizer_fns(model_dir)
    n_needle_samples = max(8, args.faults_each * 3)
    needles = needle_samples(n_needle_samples, min(args.max_context, max_len - 200), args.seed,
                             render, count_tokens)
    reqs = plan_requests(args, max_len, [s.prompt_tokens for s in needles])
    fill_prompts(reqs, needles, render, count_tokens, args.seed)
    sampler = Sampler(url, pid)
    sampler.start()
    marks = {}
    # warm-up and the alone answers: every needle request, one at a time, on an idle server
    with_needles = [r for r in reqs if r.needle is not None]
    print(f"soak: {len(reqs)} requests planned; {len(with_needles)} needles first, alone",
          flush=True)
    alone = asyncio.run(run_alone(url, with_needles, model, max_len, headers, args.timeout))
    warm_zero, _ = wait_gauges_zero(url, 30)
    time.sleep(2)
    rss_warm = resident_bytes(pid) if pid is not None else None
    by_process_warm = resident_by_process(pid) if pid is not None else {}
    marks["crowd"] = time.perf_counter() - sampler.t0
    results: list[Result] = []
    rss_rounds: list[int] = []
    wall = 0.0
    for n in range(args.rounds):  # the same crowd again: memory that grows per round leaks
        print(f"soak: alone done ({len(alone)}); the crowd{f' (round {n + 1})' if n else ''}: "
              f"{len(reqs)} requests over {args.concurrency} clients", flush=True)
        got, took = asyncio.run(run_all(url, reqs, model, max_len, args.concurrency, headers,
                                        args.timeout))
        results += got
        wall += took
        marks[f"drained {n + 1}" if n else "drained"] = time.perf_counter() - sampler.t0
        zero_s, after = wait_gauges_zero(url, 60)
        time.sleep(5)
        if pid is not None:
            rss_rounds.append(resident_bytes(pid))
    rss_after = rss_rounds[-1] if rss_rounds else None
    by_process_after = resident_by_process(pid) if pid is not None else {}
    sampler.stop()
    report: dict[str, Any] = {
        "label": args.label, "url": url, "model": model, "max_model_len": max_len,
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "summary": summarise(reqs, results, alone, needles),
        "failure_counters": {k: after[k] for k in FAILURE_COUNTERS},
        "drain_s": wall,
        "gauges_zero_after_s": zero_s,
        "gauges_after": after,
        "gauges_zero_after_warmup_s": warm_zero,
        "rss_warm_bytes": rss_warm, "rss_after_bytes": rss_after,
        "rss_ratio_after_to_warm": (rss_after / rss_warm if rss_warm else None),
        "rss_after_round_bytes": rss_rounds,
        "rss_ratio_last_to_first_round": (rss_rounds[-1] / rss_rounds[0]
                                          if len(rss_rounds) > 1 else None),
        "rss_by_process_warm_bytes": by_process_warm,
        "rss_by_process_after_bytes": by_process_after,
        "rss_peak_bytes": max((s.get("rss_bytes", 0) for s in sampler.samples), default=None),
        "marks": marks,
        "results": [asdict(r) for r in results],
        "alone": {i: asdict(r) for i, r in alone.items()},
        "timeline": sampler.samples,
    }
    return report


if __name__ == "__main__":
    rep = main()
    sys.exit(0 if not rep["verdict"] else 1)
