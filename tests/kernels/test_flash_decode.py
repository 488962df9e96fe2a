"""kernels.flash_decode: dense split-KV decode attention (the GPU benches' second dense
baseline), Triton vs the torch reference and SDPA."""

import pytest
import torch
import torch.nn.functional as F

from vllm_retro.kernels.flash_decode import flash_decode_ref, flash_decode_triton


@pytest.mark.parametrize("b,hq,h,n,d", [(1, 4, 4, 1, 32), (2, 8, 2, 300, 64),
                                        (3, 28, 4, 129, 128), (1, 16, 1, 77, 256)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_triton_matches_reference(b, hq, h, n, d, dtype, tol, splits, rng, triton_device):
    q = torch.randn(b, hq, d, generator=rng).to(dtype)
    k = torch.randn(b, h, n, d, generator=rng).to(dtype)
    v = torch.randn(b, h, n, d, generator=rng).to(dtype)
    ref = flash_decode_ref(q, k, v, d ** -0.5)
    sdpa = F.scaled_dot_product_attention(q.float()[:, :, None], k.float(), v.float(),
                                          scale=d ** -0.5, enable_gqa=True)[:, :, 0]
    torch.testing.assert_close(ref.float(), sdpa, rtol=tol, atol=tol)
    dev = triton_device
    got = flash_decode_triton(q.to(dev), k.to(dev), v.to(dev), d ** -0.5,
                              num_splits=splits).cpu()
    assert got.dtype == dtype and not got.isnan().any()
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)


def test_strided_views_and_a_nan_row(rng, triton_device):
    """Keys as a strided view of a larger buffer (as a bench's KV); a NaN in one request's
    query leaves the other requests' outputs exact."""
    buf = torch.randn(2, 2, 100, 64, generator=rng)
    k, v = buf[:, :, :70], buf.flip(2)[:, :, :70]
    q = torch.randn(2, 4, 64, generator=rng)
    q[1, 0, 3] = float("nan")
    dev = triton_device
    got = flash_decode_triton(q.to(dev), k.to(dev), v.to(dev), 0.125).cpu()
    torch.testing.assert_close(got[0], flash_decode_ref(q, k, v, 0.125)[0], rtol=1e-5,
                               atol=1e-5)
