"""kernels.gather: execution-buffer assembly, Triton vs torch reference."""

import pytest
import torch

from vllm_retro.kernels.gather import gather_rows_ref, gather_rows_triton


@pytest.mark.parametrize("h,t,d,off", [(1, 1, 32, 0), (2, 77, 64, 5), (4, 200, 128, 68),
                                       (3, 33, 80, 1), (2, 50, 256, 10)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_matches_ref(h, t, d, off, dtype, rng, triton_device):
    dev_rows, host_rows, cap = 64, 300, off + t + 7
    dev_k, dev_v = (torch.randn(dev_rows, d, generator=rng).to(dtype) for _ in range(2))
    host_k, host_v = (torch.randn(host_rows, d, generator=rng).to(dtype) for _ in range(2))
    kind = torch.randint(0, 3, (h, t), generator=rng)
    src = torch.where(kind == 1, torch.randint(0, dev_rows, (h, t), generator=rng),
                      torch.randint(0, host_rows, (h, t), generator=rng))
    ref_k, ref_v = (torch.full((h, cap, d), 7.0, dtype=dtype) for _ in range(2))
    gather_rows_ref(ref_k, ref_v, off, dev_k, dev_v, host_k, host_v, kind, src)
    # the reference against the definition
    for i in range(h):
        for j in range(t):
            if kind[i, j] == 1:
                assert torch.equal(ref_k[i, off + j], dev_k[src[i, j]])
            elif kind[i, j] == 2:
                assert torch.equal(ref_v[i, off + j], host_v[src[i, j]])
            else:
                assert (ref_k[i, off + j] == 7).all()
    got_k, got_v = (torch.full((h, cap, d), 7.0, dtype=dtype, device=triton_device)
                    for _ in range(2))
    to = lambda x: x.to(triton_device)  # noqa: E731
    if triton_device == "cuda":  # the kernel reads the host pool through pinned memory
        host_k, host_v = host_k.pin_memory(), host_v.pin_memory()
    gather_rows_triton(got_k, got_v, off, to(dev_k), to(dev_v), host_k, host_v, to(kind), to(src))
    assert torch.equal(got_k.cpu(), ref_k) and torch.equal(got_v.cpu(), ref_v)
