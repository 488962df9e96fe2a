"""kernels.gather: execution-buffer assembly from runs, Triton vs torch reference vs the
definition."""

import pytest
import torch

from vllm_retro.kernels.gather import gather_runs_ref, gather_runs_triton


def _runs(n_runs: int, rows: int, cap: int, dev_rows: int, host_rows: int,
          rng: torch.Generator) -> torch.Tensor:
    """Random runs [n_runs, 3] over destination rows 0 .. rows * cap - 1, none overlapping:
    lengths 1-40 (some longer than the kernel's 16-row tile), each from the device pool
    (count > 0) or the host pool (count < 0), in range."""
    out = []
    free = torch.randperm(rows * cap // 48, generator=rng)[:n_runs] * 48  # 48-row slots
    for dst in free.tolist():
        n = int(torch.randint(1, 41, (1,), generator=rng))
        hit = bool(torch.randint(0, 2, (1,), generator=rng))
        pool = dev_rows if hit else host_rows
        src = int(torch.randint(0, pool - n + 1, (1,), generator=rng))
        out.append([dst, src, n if hit else -n])
    return torch.tensor(out, dtype=torch.int64).reshape(-1, 3)


@pytest.mark.parametrize("rows,cap,d,n_runs", [(1, 48, 32, 1), (2, 96, 64, 3),
                                               (4, 240, 128, 12), (3, 144, 80, 5),
                                               (2, 480, 256, 9), (2, 96, 64, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_matches_ref(rows, cap, d, n_runs, dtype, rng, triton_device):
    dev_rows, host_rows = 64, 300
    dev_k, dev_v = (torch.randn(dev_rows, d, generator=rng).to(dtype) for _ in range(2))
    host_k, host_v = (torch.randn(host_rows, d, generator=rng).to(dtype) for _ in range(2))
    runs = _runs(n_runs, rows, cap, dev_rows, host_rows, rng)
    ref_k, ref_v = (torch.full((rows, cap, d), 7.0, dtype=dtype) for _ in range(2))
    gather_runs_ref(ref_k, ref_v, dev_k, dev_v, host_k, host_v, runs)
    # the reference against the definition, row by row
    want_k, want_v = (torch.full((rows * cap, d), 7.0, dtype=dtype) for _ in range(2))
    for dst, src, n in runs.tolist():
        pk, pv = (dev_k, dev_v) if n > 0 else (host_k, host_v)
        for i in range(abs(n)):
            want_k[dst + i], want_v[dst + i] = pk[src + i], pv[src + i]
    assert torch.equal(ref_k.view(-1, d), want_k) and torch.equal(ref_v.view(-1, d), want_v)
    got_k, got_v = (torch.full((rows, cap, d), 7.0, dtype=dtype, device=triton_device)
                    for _ in range(2))
    to = lambda x: x.to(triton_device)  # noqa: E731
    if triton_device == "cuda":  # the kernel reads the host pool through pinned memory
        host_k, host_v = host_k.pin_memory(), host_v.pin_memory()
    gather_runs_triton(got_k, got_v, to(dev_k), to(dev_v), host_k, host_v, runs)
    assert torch.equal(got_k.cpu(), ref_k) and torch.equal(got_v.cpu(), ref_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_rows_are_copied_where_their_runs_go_and_nowhere_else(dtype, rng, triton_device):
    """A NaN row of either pool lands, bit for bit, where its run puts it, and no other
    destination row changes (compared as bits: NaN never equals itself)."""
    rows, cap, d = 2, 96, 64
    dev_k, dev_v = (torch.randn(64, d, generator=rng).to(dtype) for _ in range(2))
    host_k, host_v = (torch.randn(300, d, generator=rng).to(dtype) for _ in range(2))
    dev_k[10, 3] = dev_v[11] = float("nan")
    host_k[200] = host_v[201, 63] = float("nan")
    runs = torch.tensor([[0, 8, 5], [50, 198, -6], [100, 0, 3]], dtype=torch.int64)
    ref_k, ref_v = (torch.full((rows, cap, d), 7.0, dtype=dtype) for _ in range(2))
    gather_runs_ref(ref_k, ref_v, dev_k, dev_v, host_k, host_v, runs)
    nan_rows = {int(i) for i in ref_k.view(-1, d).isnan().any(1).nonzero()} | \
        {int(i) for i in ref_v.view(-1, d).isnan().any(1).nonzero()}
    assert nan_rows == {2, 3, 52, 53}  # dev rows 10, 11 and host rows 200, 201
    got_k, got_v = (torch.full((rows, cap, d), 7.0, dtype=dtype, device=triton_device)
                    for _ in range(2))
    if triton_device == "cuda":
        host_k, host_v = host_k.pin_memory(), host_v.pin_memory()
    gather_runs_triton(got_k, got_v, dev_k.to(triton_device), dev_v.to(triton_device),
                       host_k, host_v, runs)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for got, ref in ((got_k, ref_k), (got_v, ref_v)):
        assert torch.equal(got.cpu().view(bits), ref.view(bits))


def test_bad_runs_are_clear_errors():
    x = torch.zeros(2, 8, 16)
    with pytest.raises(ValueError, match=r"runs must be \[N, 3\], got \[4\]"):
        gather_runs_triton(x, x, x[0], x[0], x[0], x[0], torch.zeros(4, dtype=torch.int64))
