"""GPU: the cooperative 128-row tiles 112, 144 and 160 wide, which the selector runs where they make
whole waves of tiles (M = 256-2048), against torch in float64: fused operands along M and N, tile
inputs, reductions over M, N and everything, ragged sizes, and the selector's own launch."""

from __future__ import annotations

import pytest
import torch
from linear_cases import (
    assert_close,
    check_reductions,
    linear_inputs,
    residual_scaled,
    with_reductions,
)

import evtc

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("evtc-wave-widths"))


WIDTHS = [112, 144, 160]


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("cluster", [(2, 1), (1, 2), (1, 1)], ids=["c2x1", "c1x2", "c1x1"])
def test_fused_operands(cache, width, cluster):
    m, n, k = 300, 1000, 520  # ragged in M, N and K
    x, w, g = linear_inputs(m, n, k, seed=width)
    C = torch.randn(m, n, device="cuda", generator=g).to(torch.bfloat16)
    bias = torch.randn(n, device="cuda", generator=g)
    row_scale = torch.rand(m, 1, device="cuda", generator=g) + 0.5
    examples = {"a": x, "b": w.t(), "C": C, "bias": bias, "row_scale": row_scale}
    kernel = evtc.compile(residual_scaled, examples, cache_dir=cache,
                          config={"schedule": "cooperative", "tile_n": width, "cluster": cluster})
    assert kernel.launch_for(m, n, k)[0].tile_n == width
    acc = x.double() @ w.double().t()
    assert_close(kernel(x, w.t(), C=C, bias=bias, row_scale=row_scale),
                 torch.relu(acc * row_scale.double() + C.double() + bias.double()))


@pytest.mark.parametrize("width", WIDTHS)
def test_reductions(cache, width):
    m, n, k = 520, 1000, 384
    x, w, g = linear_inputs(m, n, k, seed=10 + width)
    bias = torch.randn(n, device="cuda", generator=g)
    kernel = evtc.compile(with_reductions, {"a": x, "b": w.t(), "bias": bias},
                          config={"schedule": "cooperative", "tile_n": width}, cache_dir=cache)
    check_reductions(kernel, x, w, bias)


@pytest.mark.parametrize("m,n,k,width,cluster", [
    (512, 4608, 3584, 144, (2, 1)), (512, 3584, 1024, 112, (2, 1)), (512, 10240, 1024, 160, (2, 1)),
    (2048, 3584, 1024, 112, (1, 2)),  # more rows of tiles: 1x2 (evtc.plan.clusters.FEW_TILE_ROWS)
])
def test_the_selector_runs_them(cache, m, n, k, width, cluster):
    x, w, g = linear_inputs(m, n, k, seed=m + n)
    C = torch.randn(m, n, device="cuda", generator=g).to(torch.bfloat16)
    bias = torch.randn(n, device="cuda", generator=g)
    row_scale = torch.rand(m, 1, device="cuda", generator=g) + 0.5
    kernel = evtc.compile(residual_scaled, {"a": x, "b": w.t(), "C": C, "bias": bias, "row_scale": row_scale},
                          cache_dir=cache)
    config, _ = kernel.launch_for(m, n, k)
    assert (config.schedule, config.tile_m, config.tile_n, config.cluster) == (
        "cooperative", 128, width, cluster), config.short_name()
    acc = x.double() @ w.double().t()
    assert_close(kernel(x, w.t(), C=C, bias=bias, row_scale=row_scale),
                 torch.relu(acc * row_scale.double() + C.double() + bias.double()))


def test_an_n_major_weight_keeps_widths_of_64(cache):
    """A row-major B (N contiguous) cannot take 112- or 144-wide tiles; its kernel's family leaves
    them out and the problem runs another tile."""
    m, n, k = 512, 3584, 1024
    x, w, _ = linear_inputs(m, n, k, seed=7)
    b = w.t().contiguous()  # (K, N), N contiguous
    kernel = evtc.compile(lambda acc: acc, {"a": x, "b": b}, cache_dir=cache)
    config, _ = kernel.launch_for(m, n, k)
    assert config.tile_n % 64 == 0, config.short_name()
    assert_close(kernel(x, b), x.double() @ b.double())
