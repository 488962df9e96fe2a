"""vllm_retro.index.pages: Quest and StreamingLLM as serving indexes, against plain-torch
references of their selection written from the papers, full budgets equal to full
attention, batched decode equal to each row alone, bad options, freed memory."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import batched_equals_alone, decode_steps
from vllm_retro.buffer import WaveBufferManager
from vllm_retro.config import ConfigError, RetroConfig
from vllm_retro.index.pages import QuestIndex, StreamingIndex

H, G, D, PAGE = 2, 4, 64, 16
CFG = RetroConfig(kernel_backend="torch", sink_tokens=4, local_window=32, update_segment=128,
                  update_clusters=8, quest_page_size=PAGE, quest_token_budget=96,
                  streaming_tokens=64)
SCALE = D ** -0.5


def page_ranges(index) -> list[tuple[int, int]]:
    """(first, last + 1) position of every page, in page order: pages are consecutive
    positions from the sinks on, a block's last page possibly shorter."""
    sizes = index.sizes[0].tolist()
    out, start = [], index.num_sinks
    for s in sizes:
        out.append((start, start + s))
        start += s
    return out


def quest_pages(q: torch.Tensor, keys: torch.Tensor, ranges, k: int) -> list[set[int]]:
    """Quest (Tang et al. 2024, Alg. 1) per KV head, in float64: each page's per-dimension
    min and max of its keys; a query head's criticality of a page is
    sum_d max(q_d * min_d, q_d * max_d); a GQA group's pages ranked by the sum over its
    heads of the softmax of (scale x criticality); the top k."""
    out = []
    for h in range(H):
        crit = torch.zeros(G, len(ranges), dtype=torch.float64)
        for p, (a, b) in enumerate(ranges):
            kp = keys[h, a:b].double()
            lo, hi = kp.min(0).values, kp.max(0).values
            qg = q[h * G:(h + 1) * G].double()
            crit[:, p] = torch.maximum(qg * lo, qg * hi).sum(-1)
        score = torch.softmax(crit * SCALE, dim=-1).sum(0)
        out.append(set(torch.topk(score, min(k, len(ranges))).indices.tolist()))
    return out


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, index, pages
           ) -> torch.Tensor:
    """Exact attention over the steady zone and ``pages[h]`` of each KV head."""
    ranges = page_ranges(index)
    n = keys.shape[1]
    out = torch.empty(H * G, D)
    for h in range(H):
        pos = list(range(index.num_sinks)) + list(range(index.window_start, n))
        for p in pages[h]:
            pos += list(range(*ranges[p]))
        kk, vv = keys[h, sorted(pos)].double(), values[h, sorted(pos)].double()
        qg = q[h * G:(h + 1) * G].double()
        out[h * G:(h + 1) * G] = (torch.softmax(qg @ kk.T * SCALE, -1) @ vv).float()
    return out



@pytest.mark.parametrize("kind", ["quest", "streaming"])
def test_decode_is_the_papers_selection_and_exact_attention(kind):
    gen = torch.Generator().manual_seed(1)
    keys, values = torch.randn(H, 1000, D, generator=gen), torch.randn(H, 1000, D, generator=gen)
    mgr = WaveBufferManager(CFG)
    cls = QuestIndex if kind == "quest" else StreamingIndex
    index = cls.build(keys, values, CFG, store=mgr.store("r", H, D, torch.float32, "cpu"))
    k = 96 // PAGE if kind == "quest" else 64 // PAGE
    assert index.num_pages == k

    def check(kk, vv, q):
        sel = index.select(q, SCALE).retrieval_ids
        ranges = page_ranges(index)
        if kind == "quest":
            want = quest_pages(q, kk, ranges, k)
        else:  # StreamingLLM: the most recent pages
            want = [set(range(len(ranges) - k, len(ranges)))] * H
        assert [set(s.tolist()) for s in sel] == want
        torch.testing.assert_close(index.decode(q, SCALE).output, attend(q, kk, vv, index, want),
                                   atol=1e-5, rtol=1e-5)

    # two update blocks of 128 tokens
    decode_steps(index, keys, values, H * G, 300, gen, check, every=5)
    assert index.num_updates == 2
    index.store.check_invariants()
    index.free()
    mgr.close()
    assert mgr.host_bytes() == 0


@pytest.mark.parametrize("kind", ["quest", "streaming"])
def test_a_budget_of_every_token_is_full_attention(kind):
    cfg = CFG.replace(quest_token_budget=1 << 20, streaming_tokens=1 << 20)
    gen = torch.Generator().manual_seed(2)
    keys, values = torch.randn(H, 700, D, generator=gen), torch.randn(H, 700, D, generator=gen)
    mgr = WaveBufferManager(cfg)
    cls = QuestIndex if kind == "quest" else StreamingIndex
    index = cls.build(keys, values, cfg, store=mgr.store("r", H, D, torch.float32, "cpu"))

    def full(kk, vv, q):
        k2, v2 = kk.repeat_interleave(G, 0), vv.repeat_interleave(G, 0)
        p = torch.softmax(torch.einsum("hd,hnd->hn", q, k2) * SCALE, dim=-1)
        torch.testing.assert_close(index.decode(q, SCALE).output,
                                   torch.einsum("hn,hnd->hd", p, v2), atol=1e-5, rtol=1e-5)

    decode_steps(index, keys, values, H * G, 150, gen, full, every=3)
    assert index.num_updates == 1
    index.free()
    mgr.close()
    assert mgr.host_bytes() == 0


@pytest.mark.parametrize("kind", ["quest", "streaming"])
@pytest.mark.parametrize("path", ["fused", "padded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_decode_equals_each_request_decoding_alone(kind, path, dtype):
    """A layer's page indexes decoded at once (Quest's pages scored in the fused CPU kernel;
    streaming's chosen row by row, then one fused call with them given; or the exec-buffer
    path over one layer pool) give each request's own output, across update blocks, rows of
    different lengths and a dense one."""
    from vllm_retro.index.batched import fused_supported
    from vllm_retro.kernels import cpu_ext

    if path == "fused" and not cpu_ext.available():
        pytest.skip("the fused CPU kernel is not built")
    cfg = CFG.replace(kernel_backend="auto" if path == "fused" else "torch")
    cls = QuestIndex if kind == "quest" else StreamingIndex
    gen = torch.Generator().manual_seed(3)
    mgr = WaveBufferManager(cfg)
    indexes = []
    for r, n in enumerate((1500, 900, 120)):  # the last one dense at first
        k = torch.randn(H, n, D, generator=gen).to(dtype)
        v = torch.randn(H, n, D, generator=gen).to(dtype)
        st = mgr.store(f"r{r}", H, D, dtype, "cpu", layer="L")
        indexes.append(cls.build(k, v, cfg, store=st))
    query = torch.empty(1, H * G, D, dtype=dtype)
    assert all(fused_supported(i, query) for i in indexes) == (
        path == "fused" and kind == "quest")
    # the first row crosses an update block; the last, dense at first, gets indexed
    batched_equals_alone(indexes, mgr, gen, H * G,
                         check=lambda ix: ix[0].num_updates >= 1 and not ix[2].is_dense,
                         tol=1e-5 if dtype == torch.float32 else 1e-2)


def test_quest_keeps_two_rows_per_page_and_reads_its_budget():
    keys, values = torch.randn(H, 2000, D), torch.randn(H, 2000, D)
    index = QuestIndex.build(keys, values, CFG)
    pages = index.num_clusters
    assert index.page_min.shape == index.page_max.shape == (H, pages, D)
    assert index.meta_nbytes() >= 2 * H * pages * D * 4
    n = index.decode(torch.randn(H * G, D), SCALE).n_exact
    steady = index.num_sinks + index.num_tokens - index.window_start
    assert n.tolist() == [steady + 96] * H
    index.set_token_budget(40)  # the attention-level comparison's matched budgets
    assert index.num_pages == 2


@pytest.mark.parametrize("name,value,accepted", [
    ("quest_page_size", 0, r"an integer in \[1, 65536\]"),
    ("quest_token_budget", -1, r"an integer in \[0, 1073741824\]"),
    ("streaming_tokens", 1.5, r"an integer in \[0, 1073741824\]"),
    ("index", "fifo", "'quest', 'streaming'"),
])
def test_bad_options_name_the_value_and_the_range(name, value, accepted):
    with pytest.raises(ConfigError, match=rf"{name}={value!r} is invalid; accepted: .*{accepted}"):
        RetroConfig(**{name: value})
