"""The wave index: segmented clustering, meta index, tripartite attention, updates."""

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
    "cluster_block",
    "sparse_attention",
    "spherical_kmeans",
]
