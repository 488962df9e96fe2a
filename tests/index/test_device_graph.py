"""vllm_retro.index.device_graph: off CUDA the step runs eagerly (the CUDA graph replay is
tested on a GPU: tests/index/test_device_layer.py::test_decode_step_on_cuda_*)."""

import pytest
import torch

from tests.helpers import random_indexes
from tests.index.test_device_layer import _cfg, _layer, _shared_steady
from vllm_retro.index.device_graph import StepGraphs
from vllm_retro.index.device_layer import decode_step


def test_off_cuda_the_step_runs_eagerly():
    g = torch.Generator().manual_seed(21)
    cfg = _cfg()
    indexes = random_indexes([400, 900], cfg, 2, 32, torch.float32, g)
    _shared_steady(indexes, cfg, [1, 0])
    layer = _layer(cfg, indexes[0])
    layer.refresh([0, 1], indexes)
    plan = layer.plan([0, 1], indexes)
    q = torch.randn(2, 4, 32, generator=g)
    graphs = StepGraphs(layer)
    torch.testing.assert_close(graphs(plan, q, 32 ** -0.5), decode_step(layer, plan, q,
                                                                        32 ** -0.5),
                               rtol=0, atol=0)
    assert graphs.captures == 0


def test_capacity_is_checked():
    g = torch.Generator().manual_seed(22)
    cfg = _cfg()
    indexes = random_indexes([400], cfg, 2, 32, torch.float32, g)
    with pytest.raises(ValueError, match=r"capacity=0; accepted: an integer >= 1"):
        StepGraphs(_layer(cfg, indexes[0]), capacity=0)
