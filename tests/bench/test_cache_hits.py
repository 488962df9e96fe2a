"""bench/cache_hits.py on a small synthetic recording: a query that repeats hits every
cluster after the first step; random queries keep the ratios in range."""

import torch

from bench import cache_hits


def _recording(path, same_query: bool):
    g = torch.Generator().manual_seed(0)
    h, n, d, steps, p = 2, 1500, 32, 6, 1494
    q = torch.randn(h * 4, 1, d, generator=g).expand(-1, steps, -1).contiguous() \
        if same_query else torch.randn(h * 4, steps, d, generator=g)
    layer = {"k": torch.randn(h, n, d, generator=g), "v": torch.randn(h, n, d, generator=g),
             "q": q, "prompt_tokens": p}
    torch.save({"requests": {"r0": {"model.layers.3.self_attn.attn": layer}},
                "scale": d ** -0.5}, path)


def test_a_repeated_query_hits_every_cluster_after_the_first_step(tmp_path):
    _recording(tmp_path / "rec.pt", same_query=True)
    # the retrieval zone by its fraction (2 of ~93 clusters) fits the 20% cache; the
    # 16-cluster floor of short contexts would not, and would miss every step
    res = cache_hits.main(["--data", str(tmp_path / "rec.pt"), "--cache", "0.2:32",
                           "--config", '{"segment_size": 512, "min_retrieval_clusters": 0}',
                           "--out", str(tmp_path / "out.json")])
    s = res["settings"]["0.2:32"]
    assert s["cluster_hit_ratio_warm"] == 1.0 and 0 < s["token_hit_ratio_warm"] <= 1.0
    assert s["cluster_hit_ratio"] < 1.0  # the first step fills a cold cache
    assert s["worst_rel_err_vs_reference"] < 1e-4
    assert list(s["layers"]) == [3] and (tmp_path / "out.json").exists()


def test_random_queries_give_ratios_in_range(tmp_path):
    _recording(tmp_path / "rec.pt", same_query=False)
    res = cache_hits.main(["--data", str(tmp_path / "rec.pt"), "--cache", "0.05:20",
                           "--config", '{"segment_size": 512}'])
    s = res["settings"]["0.05:20"]
    assert 0.0 <= s["token_hit_ratio"] <= 1.0 and 0.0 <= s["cluster_hit_ratio"] <= 1.0
