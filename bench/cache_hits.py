"""Hit ratio of the in-place device step's cluster cache on a real model's own decode steps.

Read in place (KV in the wave buffer's pinned host tier, only the meta index on the device),
every retrieved token a cluster cache on the device does not hold crosses PCIe, ~80x slower
per byte than device memory: the hit ratio decides the step's speed (DESIGN.md, "The GPU
decode step"). The ratio depends only on which clusters consecutive decode steps retrieve,
so it is measured here, on the CPU, from a recording of a real engine's decode steps
(``bench/layer_error.py --record``: Qwen2.5-Coder-0.5B-Instruct's prompt K/V and every
decode step's Q/K/V per retro layer): each recorded (request, layer) is indexed over a wave
buffer store, loaded into an in-place :class:`~vllm_retro.index.device_layer.DeviceLayer`
with a cluster cache and its decode steps replayed through
:func:`~vllm_retro.index.device_layer.decode_step` (the torch path; the output is checked
against the per-row :meth:`WaveIndex.decode` on the way). Per ``--cache`` setting
(``FRACTION:BLOCK_TOKENS``; serving's is ``cache_fraction`` and
:func:`~vllm_retro.index.device_layer.cache_block_size`, 0.05:20 by default) it prints the
token and cluster hit ratios over all steps and over the steps after the first (a cold cache
fills at the first), per layer and overall.

    .venv/bin/python bench/layer_error.py --record /tmp/rec.pt --samples 2 --tokens 16384
    .venv/bin/python bench/cache_hits.py --data /tmp/rec.pt --cache 0.05:20 0.05:32 0.1:20
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vllm_retro.buffer import WaveBufferManager  # noqa: E402
from vllm_retro.config import RetroConfig  # noqa: E402
from vllm_retro.index.device_layer import (  # noqa: E402
    DeviceLayer,
    cache_blocks_for,
    decode_step,
    round_up,
)
from vllm_retro.index.meta_pool import MetaPool  # noqa: E402
from vllm_retro.index.steady import SteadyPool, ring_size  # noqa: E402
from vllm_retro.index.wave_index import WaveIndex  # noqa: E402


def replay(data: dict[str, Any], config: RetroConfig, fraction: float, block: int
           ) -> dict[str, Any]:
    """Counts ([4]: cached tokens, tokens read in place, hit clusters, missed clusters) per
    layer over all steps and over the steps after the first, and the worst relative error
    of the step against :meth:`WaveIndex.decode`."""
    scale = data["scale"]
    cfg = RetroConfig(**{**config.to_dict(), "cache_fraction": fraction})
    per: dict[int, dict[str, torch.Tensor]] = {}
    worst = 0.0
    manager = WaveBufferManager(cfg)
    try:
        for rid, layers in data["requests"].items():
            for name, d in layers.items():
                k, v, p, q = d["k"], d["v"], d["prompt_tokens"], d["q"]
                h, dim = k.shape[0], k.shape[2]
                store = manager.store(f"{rid}-{name}", h, dim, k.dtype, "cpu", layer=name)
                index = WaveIndex.build(k[:, :p].clone(), v[:, :p].clone(), cfg, store=store)
                pool = SteadyPool(h, dim, cfg.sink_tokens,
                                  ring_size(cfg.local_window, cfg.update_segment), k.dtype,
                                  "cpu", slots=1, zeroed=True)
                index.adopt_steady(pool, 0)
                meta = MetaPool(*index.meta_pool_layout())  # the layer's, as served
                index.adopt_meta(meta)
                layer = DeviceLayer(cfg, h, dim, k.dtype, "cpu", slots=1,
                                    max_clusters=round_up(2 * index.num_clusters),
                                    max_tokens=0, rank=index.residuals.rank, meta=meta,
                                    in_place=True,
                                    cache_blocks=cache_blocks_for(cfg, k.shape[1], block),
                                    cache_block_tokens=block)
                first = None
                for i in range(q.shape[1]):
                    t = p + i
                    index.append(k[:, t:t + 1].clone(), v[:, t:t + 1].clone())
                    layer.refresh([0], [index])
                    plan = layer.plan([0], [index])
                    out = decode_step(layer, plan, q[:, i][None], scale)[0]
                    ref = index.decode(q[:, i], scale).output
                    err = ((out - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-12)).max()
                    worst = max(worst, float(err))
                    if i == 0:
                        first = layer.cache.counts.sum(0).clone()
                total = layer.cache.counts.sum(0)
                acc = per.setdefault(int(name.split(".")[2]), {
                    "all": torch.zeros(4, dtype=torch.int64),
                    "warm": torch.zeros(4, dtype=torch.int64)})
                acc["all"] += total
                acc["warm"] += total - first
                index.free()
    finally:
        manager.close()
    return {"layers": per, "worst_rel_err_vs_reference": worst}


def ratios(c: torch.Tensor) -> tuple[float, float]:
    """(token hit ratio, cluster hit ratio) of counts [4]."""
    c = c.tolist()
    return c[0] / max(c[0] + c[1], 1), c[2] / max(c[2] + c[3], 1)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="a FILE written by layer_error.py --record")
    ap.add_argument("--cache", nargs="+", default=["0.05:20"],
                    help="FRACTION:BLOCK_TOKENS settings (cache_fraction, tokens per block)")
    ap.add_argument("--config", default="{}", help="RetroConfig fields as JSON")
    ap.add_argument("--out", help="JSON path for the results")
    args = ap.parse_args(argv)
    data = torch.load(args.data)
    config = RetroConfig(**json.loads(args.config))
    n_req = len(data["requests"])
    some = next(iter(data["requests"].values()))
    first = next(iter(some.values()))
    print(f"{n_req} requests x {len(some)} layers, prompt {first['prompt_tokens']} tokens, "
          f"{first['q'].shape[1]} decode steps each")
    results: dict[str, Any] = {"data": str(args.data), "config": json.loads(args.config),
                               "requests": n_req, "prompt_tokens": first["prompt_tokens"],
                               "decode_steps": first["q"].shape[1], "settings": {}}
    for spec in args.cache:
        fraction, block = float(spec.split(":")[0]), int(spec.split(":")[1])
        res = replay(data, config, fraction, block)
        all_ = sum(v["all"] for v in res["layers"].values())
        warm = sum(v["warm"] for v in res["layers"].values())
        tok, clu = ratios(all_)
        wtok, wclu = ratios(warm)
        print(f"cache {fraction:.3f} of the KV, blocks of {block} tokens: token hits {tok:.3f} "
              f"(after the first step {wtok:.3f}), cluster hits {clu:.3f} ({wclu:.3f}); "
              f"step vs reference: worst relative error {res['worst_rel_err_vs_reference']:.1e}")
        cells = "  ".join(f"L{layer} {ratios(v['warm'])[0]:.2f}"
                          for layer, v in sorted(res["layers"].items()))
        print(f"   token hits after the first step, per layer: {cells}")
        results["settings"][spec] = {
            "cache_fraction": fraction, "block_tokens": block,
            "token_hit_ratio": tok, "cluster_hit_ratio": clu,
            "token_hit_ratio_warm": wtok, "cluster_hit_ratio_warm": wclu,
            "worst_rel_err_vs_reference": res["worst_rel_err_vs_reference"],
            "layers": {layer: {"token_hit_ratio_warm": ratios(v["warm"])[0],
                               "cluster_hit_ratio_warm": ratios(v["warm"])[1]}
                       for layer, v in sorted(res["layers"].items())}}
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
