"""The retro KV-cache manager frees an indexed request's blocks, and only then."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry  # noqa: E402

from vllm_retro.vllm.kv_manager import (  # noqa: E402
    RetroAttentionSpec,
    RetroKVCacheManager,
    register_spec,
)

BS = 16


def _manager(num_blocks: int = 64) -> tuple[RetroKVCacheManager, BlockPool]:
    spec = RetroAttentionSpec(block_size=BS, num_kv_heads=2, head_size=32,
                              dtype=torch.float32)
    pool = BlockPool(num_blocks, enable_caching=False, hash_block_size=BS)
    return RetroKVCacheManager(spec, block_pool=pool, enable_caching=False,
                               kv_cache_group_id=0, scheduler_block_size=BS), pool


def test_registered_for_its_spec_and_grouped_with_full_attention():
    register_spec()
    register_spec()  # idempotent
    spec = RetroAttentionSpec(block_size=BS, num_kv_heads=2, head_size=32,
                              dtype=torch.float32)
    assert KVCacheSpecRegistry.get_manager_class(spec) is RetroKVCacheManager
    assert KVCacheSpecRegistry.get_uniform_type_base_spec(spec) is FullAttentionSpec
    # vLLM's own specs are still registered.
    plain = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=32,
                              dtype=torch.float32)
    assert KVCacheSpecRegistry.get_manager_class(plain) is not RetroKVCacheManager


def test_blocks_of_an_indexed_request_are_freed_once_the_build_step_ran():
    mgr, pool = _manager()
    free0 = pool.get_num_free_blocks()
    mgr.allocate_new_blocks("r", 10 * BS + 3, 10 * BS + 3)  # 11 blocks
    assert pool.get_num_free_blocks() == free0 - 11
    try:
        # Not indexed: nothing is freed, whatever the progress.
        mgr.remove_skipped_blocks("r", 10 * BS + 3, 10 * BS + 3)
        assert pool.get_num_free_blocks() == free0 - 11
        mgr.kv_cache_spec.schedule.mark_indexed("r", 10 * BS + 3)
        # The build step has not run yet (its tokens are still in flight).
        mgr.remove_skipped_blocks("r", 10 * BS, 10 * BS + 3)
        assert pool.get_num_free_blocks() == free0 - 11
        # It has: every block below the one being written goes back to the pool.
        mgr.remove_skipped_blocks("r", 10 * BS + 3, 10 * BS + 3)
        assert pool.get_num_free_blocks() == free0 - 1
        blocks = mgr.req_to_blocks["r"]
        assert all(b.is_null for b in blocks[:10]) and not blocks[10].is_null
        # Decoding on: the tail block moves, the one behind it is freed.
        mgr.allocate_new_blocks("r", 11 * BS + 1, 11 * BS + 1)
        mgr.remove_skipped_blocks("r", 11 * BS, 10 * BS + 3)
        assert pool.get_num_free_blocks() == free0 - 1
        mgr.free("r")
        assert pool.get_num_free_blocks() == free0
    finally:
        mgr.kv_cache_spec.schedule.release("r")


def test_each_spec_carries_its_own_indexed_requests():
    """The indexed-request state rides on the group's spec (the one object vLLM hands both
    the scheduler's connector and the manager), not on the process: each spec, and each
    group spec vLLM merges from layer specs, has its own; it is no part of the spec's
    equality or hash; a spec sent to another process arrives with none marked. The
    manager reads the state of the spec it was built with."""
    import copy
    import pickle

    a, b = (RetroAttentionSpec(block_size=BS, num_kv_heads=2, head_size=32,
                               dtype=torch.float32) for _ in range(2))
    assert a == b and hash(a) == hash(b) and a.schedule is not b.schedule
    a.schedule.mark_indexed("r", 40)
    assert b.schedule.indexed_at("r") is None and a == b
    merged = RetroAttentionSpec.merge([a, b])
    assert isinstance(merged, RetroAttentionSpec) and merged == a
    assert merged.schedule not in (a.schedule, b.schedule)
    assert merged.schedule.indexed_at("r") is None
    for moved in (pickle.loads(pickle.dumps(a)), copy.deepcopy(a)):
        assert moved == a and moved.schedule.num_indexed() == 0
    a.schedule.release("r", preempted=True)
    assert (a.schedule.preempted, a.schedule.preempted_indexed) == (1, 1)
    mgr, _ = _manager()
    mgr.kv_cache_spec.schedule.mark_indexed("s", 3)
    assert mgr.kv_cache_spec.schedule.indexed_at("s") == 3 and a.schedule.num_indexed() == 0
