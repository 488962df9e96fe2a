"""Per-layer attention error of the wave index on a real model's own decode steps.

Two phases, so index variants can be compared on exactly the same data:

- ``--record FILE``: serves prompts through a vLLM engine with retro at default settings
  (Qwen2.5-Coder-0.5B-Instruct, fp32, common-words prompts of ``--tokens`` tokens from the
  accuracy harness) and records, for each request and retro layer, the prompt's K/V as the
  index build read it and every decode step's query, key and value (post-RoPE), as the
  layer's forward received them. It also checks, on the way, that the engine's output equals
  a per-row reference :class:`WaveIndex` built from the recorded K/V (worst relative error
  printed).
- evaluation (default): for each ``--config`` (JSON of :class:`RetroConfig` fields), builds
  each recorded layer's index from its prompt K/V, replays the decode steps and prints the
  mean relative error of every layer's output against dense attention over the same K/V;
  ``--out`` writes them as JSON.

    .venv/bin/python bench/layer_error.py --record /tmp/rec.pt --samples 3
    .venv/bin/python bench/layer_error.py --data /tmp/rec.pt \\
        --config '{}' '{"estimator": "centroid"}' '{"estimation_budget": 0.0}'
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
from typing import Any

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vllm_retro.config import RetroConfig  # noqa: E402
from vllm_retro.index.evaluate import exact_attention  # noqa: E402
from vllm_retro.index.wave_index import WaveIndex  # noqa: E402


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per query head ``|out - ref| / |ref|`` (fp64, [Hq])."""
    return (out.double() - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-12)


def layer_errors(data: dict[str, Any], config: RetroConfig) -> dict[int, float]:
    """Mean relative error vs dense of each recorded layer (mean over requests and decode
    steps of the mean over query heads) for indexes built at ``config``."""
    scale = data["scale"]
    per: dict[int, list[float]] = {}
    for layers in data["requests"].values():
        for name, d in layers.items():
            k, v, p, q = d["k"], d["v"], d["prompt_tokens"], d["q"]
            index = WaveIndex.build(k[:, :p].clone(), v[:, :p].clone(), config)
            errs = []
            for i in range(q.shape[1]):
                t = p + i
                index.append(k[:, t:t + 1].clone(), v[:, t:t + 1].clone())
                out = index.decode(q[:, i], scale).output
                dense, _ = exact_attention(q[:, i], k[:, :t + 1], v[:, :t + 1], scale)
                errs.append(relative_error(out, dense).mean().item())
            per.setdefault(int(name.split(".")[2]), []).append(statistics.mean(errs))
    return {layer: statistics.mean(v) for layer, v in sorted(per.items())}


def record(path: str, samples: int, tokens: int, max_tokens: int) -> None:
    """Serve ``samples`` common-words prompts under retro (default settings, fp32) and save
    every retro layer's prompt K/V and decode Q/K/V per request to ``path``."""
    from vllm import SamplingParams

    from bench.accuracy.runner import engine, tokenizer_fns
    from bench.accuracy.tasks import common_words
    from vllm_retro.models import ensure_qwen_coder
    from vllm_retro.vllm import route
    from vllm_retro.vllm.route import RetroMetadata

    rec: dict[str, dict[str, dict[str, Any]]] = {}
    worst = [0.0]
    scales: set[float] = set()
    serving = route.RouteImplMixin.forward

    def forward(self, layer, query, key, value, kv_cache, md, output, *args, **kwargs):
        if not isinstance(md, RetroMetadata):
            return serving(self, layer, query, key, value, kv_cache, md, output, *args,
                           **kwargs)
        name = layer.layer_name
        scales.add(self.scale)
        for b in md.plan.builds:
            k, v = self.read_kv(layer, kv_cache, b.block_ids, b.num_tokens)
            rec.setdefault(b.request_id, {})[name] = {
                "k": [k.float()], "v": [v.float()], "q": [], "prompt_tokens": k.shape[1],
                "ref": WaveIndex.build(k.float().clone(), v.float().clone(),
                                       md.runtime.config)}
        res = serving(self, layer, query, key, value, kv_cache, md, output, *args, **kwargs)
        out = output.view(output.shape[0], self.num_heads, self.head_size)
        for col in md.plan.columns:
            members = range(len(md.plan.decodes)) if col.members is None else col.members
            rows = (range(col.part.start, col.part.stop) if col.part is not None
                    else col.tokens.tolist())
            for j, t in zip(members, rows, strict=True):
                r = rec.get(md.plan.decodes[j].request_id, {}).get(name)
                if r is None:
                    continue
                kt, vt = key[t].float()[:, None], value[t].float()[:, None]
                r["k"].append(kt)
                r["v"].append(vt)
                r["q"].append(query[t].float())
                r["ref"].append(kt.clone(), vt.clone())
                ref = r["ref"].decode(query[t].float(), self.scale).output
                worst[0] = max(worst[0], relative_error(out[t], ref).max().item())
        return res

    model = ensure_qwen_coder()
    render, count = tokenizer_fns(model)
    prompts = [common_words(tokens, s, render, count).prompt for s in range(samples)]
    route.RouteImplMixin.forward = forward
    try:
        with engine(model, {}, tokens + max_tokens + 64, "float32") as llm:
            llm.generate(prompts, [SamplingParams(max_tokens=max_tokens, temperature=0.0)]
                         * samples, use_tqdm=False)
    finally:
        route.RouteImplMixin.forward = serving
    if len(scales) != 1:
        raise SystemExit(f"layer_error: expected one softmax scale over the retro layers, "
                         f"got {sorted(scales)}")
    data: dict[str, Any] = {"requests": {}, "scale": scales.pop()}
    for rid, layers in rec.items():
        for name, r in layers.items():
            data["requests"].setdefault(rid, {})[name] = {
                "k": torch.cat(r["k"], 1), "v": torch.cat(r["v"], 1),
                "q": torch.stack(r["q"], 1), "prompt_tokens": r["prompt_tokens"]}
    torch.save(data, path)
    print(f"recorded {len(rec)} requests to {path}; engine output vs per-row reference: "
          f"worst relative error {worst[0]:.2e}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--record", metavar="FILE", help="serve prompts and record to FILE")
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=4096, help="prompt length, tokens")
    ap.add_argument("--max-tokens", type=int, default=40, help="decode steps per request")
    ap.add_argument("--data", help="a FILE written by --record, to evaluate")
    ap.add_argument("--config", nargs="+", default=["{}"],
                    help="RetroConfig fields as JSON, one per configuration")
    ap.add_argument("--out", help="JSON path for the evaluation's per-layer errors")
    args = ap.parse_args(argv)
    if args.record:
        record(args.record, args.samples, args.tokens, args.max_tokens)
        return
    if not args.data:
        ap.error("give --record FILE or --data FILE")
    data = torch.load(args.data)
    results = {}
    for spec in args.config:
        errs = layer_errors(data, RetroConfig(**json.loads(spec)))
        results[spec] = {"layers": errs, "mean": statistics.mean(errs.values())}
        cells = "  ".join(f"L{layer} {e:.4f}" for layer, e in errs.items())
        print(f"{spec}: mean {results[spec]['mean']:.4f}\n   {cells}")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
