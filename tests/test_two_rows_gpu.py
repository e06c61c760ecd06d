"""GPU: problems of 112 to 128 rows that run two rows of ping-pong 64-row tiles of the two-row widths
(64 x 80, 64 x 96, 64 x 160 in 2x1 clusters, evtc.plan.selector.TWO_ROW_WIDTHS), against torch in
float64: the identity, a fused residual with vectors along M and N, reductions over M, N and
everything, and batches."""

from __future__ import annotations

import pytest
import torch
from linear_cases import (
    assert_close,
    check_plain_and_fused,
    check_reductions,
    identity,
    linear_inputs,
    with_reductions,
)

import evtc
from evtc.plan.selector import TWO_ROW_ONLY

pytestmark = pytest.mark.gpu


def _two_rows(width):
    return lambda c: (c.schedule, c.tile_m, c.tile_n, c.cluster) == ("pingpong", 64, width, (2, 1))


def _no_op():
    pass


@pytest.mark.parametrize("m, n, k, width", [(128, 4608, 3584, 80), (120, 6144, 3072, 96),
                                            (113, 10240, 4096, 160), (128, 4600, 3100, 80)])
def test_identity_and_fused_operands(cache, m, n, k, width):
    check_plain_and_fused(cache, m, n, k, m + width, _two_rows(width), _no_op)


def test_reductions(cache):
    m, n, k = 128, 4608, 3584
    x, w, g = linear_inputs(m, n, k, seed=7)
    bias = torch.randn(n, device="cuda", generator=g)
    kernel = evtc.compile(with_reductions, {"a": x, "b": w.t(), "bias": bias}, cache_dir=cache)
    config, _ = kernel.launch_for(m, n, k)
    assert (config.schedule, config.tile_m, config.tile_n) in TWO_ROW_ONLY, config.short_name()
    check_reductions(kernel, x, w, bias)


def test_batched(cache):
    x, w, _ = linear_inputs(128, 2304, 3584, seed=11, batches=2)
    kernel = evtc.compile(identity, {"a": x, "b": w.mT}, cache_dir=cache)
    assert _two_rows(80)(kernel.launch_for(128, 2304, 3584, 2)[0])
    assert_close(kernel(x, w.mT), x.double() @ w.double().mT)
