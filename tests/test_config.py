"""vllm_retro.config: defaults from the design, validation naming field, value and range."""

import os

import pytest

from vllm_retro.config import FLAGS, ConfigError, GraphConfig, PQConfig, RetroConfig


def test_shortest_indexed_context_is_the_steady_zone_and_an_update_block():
    """The defaults themselves are pinned below (:data:`ANSWER_DEFAULTS`)."""
    assert RetroConfig().min_indexed_context == 4 + 64 + 1024


@pytest.mark.parametrize("field,value,accepted", [
    ("cluster_size", 0, "an integer in [1, 4096]"),
    ("cluster_size", 2.5, "an integer in [1, 4096]"),
    ("segment_size", 8, "an integer in [16, 1048576]"),
    ("kmeans_iters", -1, "an integer in [0, 100]"),
    ("kmeans_tol", -0.1, "a number in [0.0, 0.5]"),
    ("kmeans_tol", 0.9, "a number in [0.0, 0.5]"),
    ("sink_tokens", -4, "an integer in [0, 65536]"),
    ("local_window", 0, "an integer in [1, 65536]"),
    ("retrieval_budget", 0.0, "a number in (0.0, 1.0]"),
    ("retrieval_budget", float("nan"), "a number in (0.0, 1.0]"),
    ("min_retrieval_clusters", -1, "an integer in [0, 1048576]"),
    ("estimation_budget", -0.1, "a number in [0.0, 1.0]"),
    ("estimation_budget", 0.99, "[0, 0.982] so that retrieval_budget"),
    ("update_segment", 8, "an integer in [16, 1048576]"),
    ("update_clusters", 2000, "an integer in [1, 1024]"),
    ("page_size", 0, "an integer in [1, 1024]"),
    ("cache_fraction", 1.5, "a number in [0.0, 1.0]"),
    ("cache_pages", -1, "an integer in [0,"),
    ("build_steps", -1, "an integer in [0, 65536]"),
    ("build_steps", 1.5, "an integer in [0, 65536]"),
    ("table_threads", 0, "an integer in [1, 1024]"),
    ("cache_policy", "lfu", "one of 'lru'"),
    ("kernel_backend", "cuda", "one of 'auto', 'torch', 'triton'"),
    ("device_resident", "yes", "one of 'auto', 'on', 'in_place', 'off'"),
    ("estimator", "paper", "one of 'tilted', 'centroid', 'auto'"),
    ("enabled", "yes", "true or false"),
    ("retrieval_budget", True, "a number in (0.0, 1.0]"),
    # a policy group's fields are named by their flat keys, as users set them
    ("pq_bits", 9, "an integer in [1, 8]"),
    ("pq_token_ratio", 0.0, "a number in (0.0, 1.0]"),
    ("saap_probes", 0, "an integer in [1, 65536]"),
    ("saap_file", "", "a file path (a non-empty string)"),
    ("graph_degree", 1, "an integer in [2, 256]"),
    ("quest_page_size", 0, "an integer in [1, 65536]"),
    ("streaming_tokens", -1, "an integer in [0, 1073741824]"),
])
def test_bad_values_name_field_value_and_range(field, value, accepted):
    with pytest.raises(ConfigError) as err:
        RetroConfig(**{field: value})
    msg = str(err.value)
    assert f"{field}={value!r}" in msg and accepted in msg, msg


def test_segment_smaller_than_cluster_rejected():
    with pytest.raises(ConfigError, match=r"segment_size=32 is invalid; accepted: >= cluster_size"):
        RetroConfig(cluster_size=64, segment_size=32)


def test_from_dict_and_unknown_keys():
    assert RetroConfig.from_dict({"retrieval_budget": 0.05}).retrieval_budget == 0.05
    assert RetroConfig.from_dict(None) == RetroConfig()
    with pytest.raises(ConfigError, match=r"unknown key\(s\) 'retreival_budget'; accepted keys:"):
        RetroConfig.from_dict({"retreival_budget": 0.05})
    c = RetroConfig()
    assert RetroConfig.from_dict(c.to_dict()) == c


def test_policy_settings_are_grouped_and_set_by_their_flat_names():
    """Each policy's settings live in its group (``cfg.pq.bits``); users set them by the flat
    names they always had (``pq_bits``), which round-trip through the flat dict."""
    flat = {"pq_bits": 4, "pq_block_tokens": 64, "graph_top_k": 50, "saap_probes": 8,
            "quest_page_size": 8, "quest_token_budget": 512, "streaming_tokens": 256}
    c = RetroConfig.from_dict(flat)
    assert c.pq == PQConfig(bits=4, block_tokens=64)
    assert c.graph == GraphConfig(top_k=50)
    assert c.saap.probes == 8 and c.saap.file is None
    assert (c.pages.page_tokens, c.pages.quest_tokens, c.pages.streaming_tokens) == (8, 512, 256)
    assert {k: c.to_dict()[k] for k in flat} == flat and RetroConfig.from_dict(c.to_dict()) == c
    assert set(FLAGS) <= set(RetroConfig.flat_names())
    assert not {"pq", "saap", "graph", "pages"} & set(c.to_dict())  # groups never flat keys
    # a whole group, with flat names given alongside overriding its fields
    assert RetroConfig(pq=PQConfig(bits=3), pq_subspaces=4).pq == PQConfig(subspaces=4, bits=3)
    assert c.replace(pq_bits=5).pq == PQConfig(bits=5, block_tokens=64)
    assert c.replace(cluster_size=8).pages == c.pages
    with pytest.raises(ConfigError, match=r"pq=4 is invalid; accepted: a PQConfig"):
        RetroConfig(pq=4)
    with pytest.raises(TypeError, match="'pq_bitz'"):
        RetroConfig(pq_bitz=4)


def test_budget_counts():
    c = RetroConfig()
    assert (c.num_retrieval(0), c.num_estimation(0)) == (0, 0)
    assert (c.num_retrieval(1), c.num_estimation(1)) == (1, 0)
    assert (c.num_retrieval(500), c.num_estimation(500)) == (32, 116)
    assert RetroConfig(min_retrieval_clusters=0).num_retrieval(500) == 9
    # the floor binds up to min_retrieval_clusters / retrieval_budget clusters (~28K tokens)
    assert RetroConfig(min_retrieval_clusters=0).num_retrieval(1777) == 32
    assert (c.num_retrieval(1777), c.num_retrieval(1778)) == (32, 33)
    assert RetroConfig(min_retrieval_clusters=16).num_retrieval(889) == 17
    assert (c.num_retrieval(10), c.num_estimation(10)) == (10, 0)
    full = RetroConfig(retrieval_budget=1.0, estimation_budget=0.0)
    assert (full.num_retrieval(37), full.num_estimation(37)) == (37, 0)
    half = RetroConfig(retrieval_budget=0.5, estimation_budget=0.5, min_retrieval_clusters=0)
    assert half.num_estimation(3) == 1


def test_the_device_cache_keeps_the_papers_ratio_to_the_retrieval_zone():
    """cache_fraction of the tokens (5%, the paper's), never less than 5/1.8 times the
    retrieval zone's floor of 32 clusters x 16 tokens (1423 tokens), never more than all."""
    c = RetroConfig()
    assert c.cache_tokens(4096) == 1423  # 5% would be 205, less than the zone's 512
    assert (c.cache_tokens(28460), c.cache_tokens(28461)) == (1423, 1424)  # 5% again
    assert c.cache_tokens(131072) == 6554
    assert c.cache_tokens(500) == 500 and c.cache_tokens(0) == 0
    assert RetroConfig(min_retrieval_clusters=0).cache_tokens(4096) == 205
    assert RetroConfig(cache_fraction=0.0).cache_tokens(4096) == 0
    assert RetroConfig(cache_pages=10).cache_tokens(4096) == 80
    for tokens in (2048, 4096, 8192, 13000, 26000):  # the ratio to the zone the cache serves
        zone = c.num_retrieval(tokens // c.cluster_size) * c.cluster_size
        assert c.cache_tokens(tokens) / zone == pytest.approx(0.05 / 0.018, rel=0.01)


def test_table_threads_default_depends_on_the_device():
    assert RetroConfig().table_threads_on("cpu") == 1
    cuda = RetroConfig().table_threads_on("cuda")
    assert 1 <= cuda <= 8 and cuda == max(1, min(8, len(os.sched_getaffinity(0)) // 2))
    assert RetroConfig(table_threads=3).table_threads_on("cpu") == 3


def test_build_steps_default_depends_on_the_device():
    assert RetroConfig().build_steps_on("cuda") == 16
    assert RetroConfig().build_steps_on("cpu") == 0
    assert RetroConfig(build_steps=5).build_steps_on("cpu") == 5
    assert RetroConfig(build_steps=0).build_steps_on("cuda") == 0


#: Every default that changes what a decode step selects, estimates or computes, as served.
#: Issue 40: ``kmeans_tol`` went from 0 to 0.01 inside a commit about the buffer's cache state
#: (3570cca, 2026-11-23) with an attention-level check only; it is the one change since then
#: that changed end-to-end answers at 4K in fp32 (bench/README, "The 4K regression hunt").
#: Changing one of these needs end-to-end answers before and after in one run
#: (``python -m bench.accuracy --configs <old> <new> ...``) in bench/results, then its entry here.
ANSWER_DEFAULTS = {
    "enabled": True, "index": "wave",
    "cluster_size": 16, "segment_size": 8192, "kmeans_iters": 10, "kmeans_tol": 0.01,
    "sink_tokens": 4, "local_window": 64, "retrieval_budget": 0.018, "estimation_budget": 0.232,
    # 0 -> 16: bench/results/accuracy_*_retrieval_floor.json; 16 -> 32:
    # accuracy_{4096,8192}_5samples_floor32.json, accuracy_16384_floor32.json
    "min_retrieval_clusters": 32,
    "estimator": "tilted",
    "update_segment": 1024, "update_clusters": 64, "update_rounds_per_step": 1,
    "build_steps": None,
    "pq_subspaces": 2, "pq_bits": 6, "pq_token_ratio": 0.2, "pq_block_tokens": 128,
    "saap_file": None, "saap_probes": 16,
    "graph_top_k": 100, "graph_search_ef": 128, "graph_degree": 16, "graph_knn": 100,
    "graph_train_queries": 4096, "graph_block_tokens": 128,
    "quest_page_size": 16, "quest_token_budget": 1024, "streaming_tokens": 1024,
    "block_recompute_tokens": 0,  # retro_blocks requests only: bench/results/block_accuracy_*
}
#: Defaults that change where and how fast tokens are read, never which or what is computed
#: (the serving path equals the per-row reference whatever they are: tests/vllm).
PLACEMENT_DEFAULTS = {
    "page_size": 8, "cache_fraction": 0.05, "cache_pages": None, "cache_policy": "lru",
    "async_updates": True, "table_threads": None, "host_memory_gb": None,
    "kernel_backend": "auto", "device_resident": "auto",
    "block_cache_gb": 2.0,  # passages loaded instead of prefilled: bench/results/block_ttft_*
}
PINNED = {**ANSWER_DEFAULTS, **PLACEMENT_DEFAULTS}


def test_every_default_is_classified():
    """A new field is placed on one side: changes answers (pinned below) or only placement."""
    names = set(RetroConfig.flat_names())
    assert set(ANSWER_DEFAULTS).isdisjoint(PLACEMENT_DEFAULTS)
    assert names == set(PINNED), (
        f"unclassified: {sorted(names - set(PINNED))}; gone: {sorted(set(PINNED) - names)}")


@pytest.mark.parametrize("name", sorted(PINNED))
def test_defaults_change_only_with_their_measurement(name):
    """A default changes visibly: an answer-changing one with its end-to-end A/B (see
    :data:`ANSWER_DEFAULTS`), a placement one with its benchmark."""
    pinned = PINNED[name]
    got = RetroConfig().get(name)
    assert got == pinned, (
        f"RetroConfig.{name} default is {got!r}, pinned {pinned!r}: "
        + ("an answer-changing default needs end-to-end answers before/after in one run "
           "(python -m bench.accuracy --configs ...) in bench/results, then its pin here"
           if name in ANSWER_DEFAULTS else "record the benchmark that chose it, then the pin"))
