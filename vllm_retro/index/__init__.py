"""The wave index: segmented clustering, meta index, tripartite attention, updates."""

from vllm_retro.index.baselines import (
    baseline_attention,
    oracle_attention,
    pqcache_attention,
    quest_attention,
    streaming_attention,
)
from vllm_retro.index.clustering import Clusters, cluster_block, spherical_kmeans
from vllm_retro.index.functional import sparse_attention
from vllm_retro.index.store import ClusterStore, DenseClusterStore
from vllm_retro.index.wave_index import DecodeResult, Selection, WaveIndex

__all__ = [
    "ClusterStore",
    "Clusters",
    "DecodeResult",
    "DenseClusterStore",
    "Selection",
    "WaveIndex",
    "baseline_attention",
    "cluster_block",
    "oracle_attention",
    "pqcache_attention",
    "quest_attention",
    "sparse_attention",
    "spherical_kmeans",
    "streaming_attention",
]
