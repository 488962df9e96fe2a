"""vllm_retro.config: defaults from the design, validation naming field, value and range."""

import os

import pytest

from vllm_retro.config import ConfigError, RetroConfig


def test_defaults_follow_the_paper():
    c = RetroConfig()
    assert (c.cluster_size, c.segment_size, c.kmeans_iters) == (16, 8192, 10)
    assert (c.retrieval_budget, c.estimation_budget) == (0.018, 0.232)
    assert (c.sink_tokens, c.local_window) == (4, 64)
    assert (c.update_segment, c.update_clusters, c.page_size) == (1024, 64, 8)
    assert (c.cache_fraction, c.cache_policy, c.enabled) == (0.05, "lru", True)
    assert c.min_indexed_context == 4 + 64 + 1024


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
    ("cache_policy", "fifo", "one of 'lru', 'lfu'"),
    ("kernel_backend", "cuda", "one of 'auto', 'torch', 'triton'"),
    ("device_resident", "yes", "one of 'auto', 'on', 'in_place', 'off'"),
    ("estimator", "paper", "one of 'tilted', 'centroid', 'auto'"),
    ("enabled", "yes", "true or false"),
    ("retrieval_budget", True, "a number in (0.0, 1.0]"),
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


def test_budget_counts():
    c = RetroConfig()
    assert (c.num_retrieval(0), c.num_estimation(0)) == (0, 0)
    assert (c.num_retrieval(1), c.num_estimation(1)) == (1, 0)
    assert (c.num_retrieval(500), c.num_estimation(500)) == (9, 116)
    full = RetroConfig(retrieval_budget=1.0, estimation_budget=0.0)
    assert (full.num_retrieval(37), full.num_estimation(37)) == (37, 0)
    assert RetroConfig(retrieval_budget=0.5, estimation_budget=0.5).num_estimation(3) == 1


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
