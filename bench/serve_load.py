"""Load generator for ``vllm-retro serve``: N concurrent streaming OpenAI clients, client-side
latency and throughput, cross-checked against the server's own ``/metrics``.

Each request sends a long prompt of real prose (``vllm_retro.capture.real_prose``) behind a
unique prefix, so prefix caching cannot serve it, and asks for exactly ``--max-tokens`` tokens
(``ignore_eos``). The client measures time to first token (TTFT), inter-token latency (ITL:
gaps between streamed tokens) and end-to-end latency per request, and the usage the server
returns. ``/metrics`` is scraped before and after the run; the report puts the client's numbers
next to the server's deltas (vLLM's latency histograms, token counters, retro's families).

Writes ``bench/results/serve_load_<label>.json`` and ``.png`` (latency CDFs). Examples::

    python -m bench.serve_load --url http://127.0.0.1:8000 --concurrency 4 --requests 8
    python -m bench.serve_load --spawn-server MODEL_DIR --label qwen_cpu \\
        --prompt-tokens 3000 --max-tokens 32 -- --max-model-len 8192

Arguments after ``--`` go to ``vllm-retro serve`` (with ``--spawn-server`` only).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench import serve_metrics as sm
from vllm_retro.server.process import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DEFAULT_URL = "http://127.0.0.1:8000"
FALLBACK_CHARS_PER_TOKEN = 4.0


# --------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------

def chars_per_token(url: str, headers: dict[str, str], model: str) -> float:
    """Characters per token of the prose for the served tokenizer, from the server's
    ``/tokenize``; :data:`FALLBACK_CHARS_PER_TOKEN` if it does not answer."""
    from vllm_retro.capture import real_prose

    text = real_prose(40_000)[:40_000]
    try:
        r = httpx.post(url + "/tokenize", json={"model": model, "prompt": text},
                       headers=headers, timeout=60)
        r.raise_for_status()
        return len(text) / max(1, int(r.json()["count"]))
    except (httpx.HTTPError, KeyError, ValueError):
        return FALLBACK_CHARS_PER_TOKEN


def build_prompts(n: int, prompt_tokens: int, cpt: float, seed: int) -> list[str]:
    """``n`` prompts of about ``prompt_tokens`` tokens (``cpt`` characters per token): a
    unique header per request, then prose from a seeded random offset of the corpus."""
    from vllm_retro.capture import real_prose

    rng = random.Random(seed)
    n_chars = max(1, int(prompt_tokens * cpt))
    corpus = real_prose(min(400_000, 4 * n_chars + 100_000))
    prompts = []
    for i in range(n):
        header = f"Request {i} of run {seed}-{rng.getrandbits(48):012x}. Summarise:\n\n"
        body_chars = max(1, n_chars - len(header))
        start = rng.randrange(max(1, len(corpus) - body_chars))
        prompts.append(header + corpus[start:start + body_chars])
    return prompts


# --------------------------------------------------------------------------------------------
# Client
# --------------------------------------------------------------------------------------------

@dataclass
class RequestResult:
    """One request as the client saw it (times in seconds from the run's start;
    ``token_times``: when each streamed token arrived, from the per-chunk usage the server
    reports, so tokens coalesced into one chunk share its time)."""

    index: int
    start: float = 0.0
    token_times: list[float] = field(default_factory=list)
    end: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ttft(self) -> float:
        """Seconds from sending to the first streamed token."""
        return self.token_times[0] - self.start

    @property
    def itls(self) -> list[float]:
        """Seconds between successive streamed tokens."""
        return list(np.diff(self.token_times)) if len(self.token_times) > 1 else []

    @property
    def e2e(self) -> float:
        """Seconds from sending to the end of the stream."""
        return self.end - self.start


def _is_token_chunk(chunk: Any, chat: bool) -> bool:
    """Whether a streamed chunk carries a generated token (not chat's leading role-only
    delta, nor the trailing usage chunk)."""
    if not chunk.choices:
        return False
    choice = chunk.choices[0]
    if chat:
        return bool(choice.delta.content) or choice.finish_reason is not None
    return True


async def one_request(client: Any, args: argparse.Namespace, model: str, prompt: str,
                      res: RequestResult, t0: float) -> None:
    """Send one streaming request and fill ``res`` (errors are recorded, not raised)."""
    chat = args.api == "chat"
    common = dict(model=model, max_tokens=args.max_tokens, temperature=args.temperature,
                  seed=args.seed + res.index, stream=True,
                  # continuous usage: every chunk says how many tokens it carries (the
                  # server coalesces tokens into one chunk when the client falls behind)
                  stream_options={"include_usage": True, "continuous_usage_stats": True},
                  extra_body={"ignore_eos": True})
    res.start = time.perf_counter() - t0
    try:
        if chat:
            stream = await client.chat.completions.create(
                messages=[{"role": "user", "content": prompt}], **common)
        else:
            stream = await client.completions.create(prompt=prompt, **common)
        seen = 0  # completion tokens accounted for so far
        async for chunk in stream:
            now = time.perf_counter() - t0
            usage = chunk.usage
            if usage is not None and usage.completion_tokens is not None:
                # each token of a chunk arrived with it (a coalesced chunk: zero gaps)
                res.token_times += [now] * max(usage.completion_tokens - seen, 0)
                seen = max(seen, usage.completion_tokens)
            elif _is_token_chunk(chunk, chat):  # a server without per-chunk usage
                res.token_times.append(now)
                seen += 1
            if _is_token_chunk(chunk, chat):
                res.finish_reason = chunk.choices[0].finish_reason or res.finish_reason
            if usage is not None:
                res.prompt_tokens = usage.prompt_tokens
                res.completion_tokens = usage.completion_tokens
        res.end = time.perf_counter() - t0
        if not res.token_times:
            res.error = "no tokens streamed"
    except Exception as exc:  # counted and reported, the run goes on
        res.end = time.perf_counter() - t0
        res.error = f"{type(exc).__name__}: {exc}"[:500]


async def run_load(args: argparse.Namespace, url: str, model: str,
                   prompts: list[str]) -> tuple[list[RequestResult], float]:
    """Run every prompt through ``args.concurrency`` concurrent clients; returns the results
    and the run's wall time in seconds (first send to last stream end)."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=args.api_key or "EMPTY",
                                max_retries=0, timeout=args.timeout)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(prompts)):
        queue.put_nowait(i)
    results = [RequestResult(i) for i in range(len(prompts))]
    t0 = time.perf_counter()

    async def worker() -> None:
        while not queue.empty():
            i = queue.get_nowait()
            await one_request(client, args, model, prompts[i], results[i], t0)

    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    wall = time.perf_counter() - t0
    await client.close()
    return results, wall


# --------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------

def dist(values: list[float]) -> dict[str, float]:
    """Count, mean and p50/p90/p99 (linear interpolation) of ``values`` (NaN when empty)."""
    out: dict[str, float] = {"count": float(len(values))}
    out["mean"] = float(np.mean(values)) if values else math.nan
    for q in sm.QUANTILES:
        out[f"p{round(q * 100)}"] = float(np.percentile(values, q * 100)) if values else math.nan
    return out


def client_summary(results: list[RequestResult], wall_s: float,
                   max_tokens: int) -> dict[str, Any]:
    """Throughput (req/s, tokens/s), latency distributions (s) and token sums of the
    requests that succeeded; the failed ones are counted in ``errors``."""
    ok = [r for r in results if r.error is None]
    prompt = sum(r.prompt_tokens for r in ok)
    gen = sum(r.completion_tokens for r in ok)
    return {
        "requests": len(results),
        "succeeded": len(ok),
        "errors": len(results) - len(ok),
        "error_messages": sorted({r.error for r in results if r.error}),
        "short_outputs": sum(r.completion_tokens != max_tokens for r in ok),
        "timed_token_mismatches": sum(len(r.token_times) != r.completion_tokens for r in ok),
        "wall_s": wall_s,
        "prompt_tokens": prompt,
        "generation_tokens": gen,
        "request_throughput_rps": len(ok) / wall_s,
        "output_throughput_tps": gen / wall_s,
        "total_throughput_tps": (prompt + gen) / wall_s,
        "latency": {
            "ttft_s": dist([r.ttft for r in ok]),
            "itl_s": dist([x for r in ok for x in r.itls]),
            "e2e_s": dist([r.e2e for r in ok]),
        },
    }


def _rel(client: float, server: float) -> float:
    if not client or math.isnan(client) or math.isnan(server):
        return math.nan
    return (server - client) / client


def comparison(client: dict[str, Any], server: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows ``{metric, client, server, rel_diff}`` (rel_diff = server / client - 1)."""
    rows = [("requests succeeded", client["succeeded"], server["requests_succeeded"]),
            ("prompt tokens", client["prompt_tokens"], server["prompt_tokens"]),
            ("generation tokens", client["generation_tokens"], server["generation_tokens"])]
    for key in sm.HISTOGRAMS:
        c, s = client["latency"][key], server["latency"][key]
        rows.append((f"{key} count", c["count"], s["count"]))
        rows += [(f"{key} {stat}", c[stat], s[stat]) for stat in ("mean", "p50", "p90", "p99")]
    return [{"metric": m, "client": float(c), "server": float(s), "rel_diff": _rel(c, s)}
            for m, c, s in rows]


def format_report(client: dict[str, Any], server: dict[str, Any],
                  rows: list[dict[str, Any]]) -> str:
    """The human-readable report: throughput, client vs server table, retro families."""
    lines = [f"requests {client['succeeded']}/{client['requests']} ok, errors "
             f"{client['errors']}, wall {client['wall_s']:.2f} s",
             f"throughput: {client['request_throughput_rps']:.3f} req/s, "
             f"{client['output_throughput_tps']:.2f} output tok/s, "
             f"{client['total_throughput_tps']:.1f} total tok/s", "",
             f"{'metric':<22}{'client':>14}{'server':>14}{'rel diff':>10}"]
    for r in rows:
        diff = "" if math.isnan(r["rel_diff"]) else f"{100 * r['rel_diff']:+.1f}%"
        lines.append(f"{r['metric']:<22}{r['client']:>14.4g}{r['server']:>14.4g}{diff:>10}")
    lines += ["", "server latency percentiles are interpolated within histogram buckets", "",
              "retro (server deltas):"]
    lines += [f"  {k:<22}{v:>14.4g}" for k, v in server["retro"].items()]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Server scraping
# --------------------------------------------------------------------------------------------

def scrape(url: str) -> sm.Samples:
    """The parsed samples of ``/metrics``."""
    r = httpx.get(url + "/metrics", timeout=30)
    r.raise_for_status()
    return sm.parse(r.text)


def scrape_settled(url: str, settle_s: float, max_wait_s: float = 10.0) -> sm.Samples:
    """``/metrics`` once its counters have stopped changing: the engine reports the last
    step's stats shortly after the last token. Waits ``settle_s`` seconds between scrapes."""
    deadline = time.monotonic() + max_wait_s
    time.sleep(settle_s)
    prev = scrape(url)
    while time.monotonic() < deadline:
        time.sleep(settle_s)
        cur = scrape(url)
        if sm.counters_of(cur) == sm.counters_of(prev):
            return cur
        prev = cur
    return prev


def first_model(url: str, headers: dict[str, str]) -> str:
    """The first model id listed by ``/v1/models``."""
    r = httpx.get(url + "/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


# --------------------------------------------------------------------------------------------
# Plot
# --------------------------------------------------------------------------------------------

def plot(results: list[RequestResult], server: dict[str, Any], title: str, path: Path) -> None:
    """Client latency CDFs (TTFT, ITL, e2e) with the server's bucket-interpolated
    p50/p90/p99 marked, to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.error is None]
    data = {"ttft_s": [r.ttft for r in ok], "itl_s": [x for r in ok for x in r.itls],
            "e2e_s": [r.e2e for r in ok]}
    names = {"ttft_s": "time to first token", "itl_s": "inter-token latency",
             "e2e_s": "end-to-end latency"}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (key, values) in zip(axes, data.items(), strict=True):
        xs = np.sort(np.asarray(values))
        ax.step(xs, np.arange(1, len(xs) + 1) / max(1, len(xs)), where="post",
                label=f"client (n={len(xs)})")
        srv = server["latency"][key]
        for q, style in zip(sm.QUANTILES, (":", "--", "-."), strict=True):
            v = srv[f"p{round(q * 100)}"]
            if not math.isnan(v):
                ax.axvline(v, color="C1", ls=style, label=f"server p{round(q * 100)}")
        ax.set(title=names[key], xlabel="seconds", ylabel="fraction of samples",
               ylim=(0, 1.02))
        if key == "itl_s" and len(xs) and xs[0] > 0:
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    """The command-line options (arguments after ``--`` are split off before parsing)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 usage="%(prog)s [options] [-- vllm-retro serve options]")
    ap.add_argument("--url", default=DEFAULT_URL, help="server base URL (without /v1)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--model", default=None, help="default: the first of /v1/models")
    ap.add_argument("--api", choices=("completions", "chat"), default="completions")
    ap.add_argument("--concurrency", type=int, default=4, help="concurrent clients")
    ap.add_argument("--requests", type=int, default=8, help="requests in all")
    ap.add_argument("--prompt-tokens", type=int, default=3000, help="approximate prompt length")
    ap.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    ap.add_argument("--settle", type=float, default=0.5,
                    help="seconds between the settling /metrics scrapes after the run")
    ap.add_argument("--label", default="run", help="names the default output files")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON path (default bench/results/serve_load_<label>.json); the PNG "
                         "goes next to it")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--spawn-server", metavar="MODEL_DIR", default=None,
                    help="start vllm-retro serve MODEL_DIR on a free port (options after --), "
                         "run the load, stop it with SIGTERM; --url is ignored")
    ap.add_argument("--ready-timeout", type=float, default=600.0,
                    help="seconds to wait for a spawned server's /health")
    return ap


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv`` split at the first ``--``: (bench options, serve options)."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def run_against(args: argparse.Namespace, url: str) -> dict[str, Any]:
    """Scrape, run the load, scrape again; returns the report dict (also printed)."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or first_model(url, headers)
    cpt = chars_per_token(url, headers, model)
    prompts = build_prompts(args.requests, args.prompt_tokens, cpt, args.seed)
    before = scrape(url)
    results, wall = asyncio.run(run_load(args, url, model, prompts))
    after = scrape_settled(url, args.settle)
    client = client_summary(results, wall, args.max_tokens)
    server = sm.server_summary(before, after)
    rows = comparison(client, server)
    print(format_report(client, server, rows), flush=True)
    return {"model": model, "chars_per_token": cpt, "client": client, "server": server,
            "comparison": rows,
            "per_request": [asdict(r) | {"n_timed_tokens": len(r.token_times)}
                            for r in results],
            "_results": results}


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_jsonable(v) for v in x]
    return x


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the bench; returns the report written to the JSON file (NaN as null)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    mine, serve_args = split_argv(argv)
    args = build_parser().parse_args(mine)
    out = args.out or RESULTS / f"serve_load_{args.label}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    server = None
    url = args.url.rstrip("/")
    if args.spawn_server:
        log = Path(tempfile.mkdtemp(prefix="serve_load_")) / "server.log"
        server = ServerProcess.start([args.spawn_server, *serve_args], log,
                                     {"VLLM_CPU_KVCACHE_SPACE": os.environ.get(
                                         "VLLM_CPU_KVCACHE_SPACE", "2")})
    try:
        if server is not None:
            server.wait_ready(args.ready_timeout)
            url = server.url
        report = run_against(args, url)
    finally:
        stopped_s = server.stop(30.0) if server is not None else None
    results = report.pop("_results")
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                if k != "api_key"}
    report = {"command": shlex.join(["python", "-m", "bench.serve_load", *argv]),
              "settings": settings | {"serve_args": serve_args, "url": url},
              "server_stop_s": stopped_s, **report}
    report = _jsonable(report)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    if not args.no_plot:
        png = out.with_suffix(".png")
        plot(results, _server_for_plot(report),
             f"{report['model']}: {args.requests} requests, concurrency {args.concurrency}, "
             f"~{args.prompt_tokens} prompt tokens, {args.max_tokens} output tokens", png)
        print(f"wrote {png}")
    return report


def _server_for_plot(report: dict[str, Any]) -> dict[str, Any]:
    """The server side of ``report`` with nulls back to NaN (for :func:`plot`)."""
    lat = {k: {s: math.nan if v is None else v for s, v in d.items()}
           for k, d in report["server"]["latency"].items()}
    return {"latency": lat}


if __name__ == "__main__":
    main()
