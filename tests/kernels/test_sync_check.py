"""vllm_retro.kernels.sync_check: the checking mode refuses what would wait for a CUDA device
and counts launches, not views or allocations."""

import pytest
import torch

from vllm_retro.kernels.sync_check import HostSyncError, SyncCheck


@pytest.mark.parametrize("op,why", [
    (lambda t: t.sum().item(), "device scalar"),
    (lambda t: bool(t.sum() > 0), "device scalar"),
    (lambda t: t.nonzero(), "nonzero"),
    (lambda t: t[t > 0], "boolean mask"),
    (lambda t: t.masked_select(t > 0), "masked_select"),
    (lambda t: torch.unique(t), "unique"),
    (lambda t: t.long().abs().repeat_interleave(t.long().abs()), "output_size"),
    (lambda t: t.tolist(), "tolist"),
    (lambda t: t.cpu(), "cpu"),
    (lambda t: t.numpy(), "numpy"),
    (lambda t: torch.tensor([1, 2]) + t[:2], "host data"),
])
def test_sync_check_refuses_what_would_wait_for_the_device(op, why):
    t = torch.arange(6.0) - 2
    with pytest.raises(HostSyncError, match=why), SyncCheck():
        op(t)
    assert t.tolist() == [-2.0, -1.0, 0.0, 1.0, 2.0, 3.0]  # the patches are undone


def test_sync_check_counts_launches_not_views():
    t = torch.randn(4, 6)
    with SyncCheck() as check:
        u = t.view(6, 4).transpose(0, 1)[:2]
        (u * 2).sum(1)
        t.long().repeat_interleave(2, dim=0, output_size=8)
    assert check.ops["mul"] == 1 and check.ops["sum"] == 1
    assert "view" not in check.ops and "transpose" not in check.ops
    assert check.launches == sum(check.ops.values())
    with SyncCheck() as check:
        torch.empty(3), torch.empty_like(t)
    assert check.launches == 0 and check.ops["empty"] == 1
