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


def _scaled_bias_relu(acc, bias, row_scale):
    return torch.relu(acc * row_scale + bias).to(acc.dtype)  # 16-bit D, whatever the operands' dtypes


@pytest.mark.parametrize("m,n,k,width", [
    (512, 3584, 1024, 112), (512, 4608, 512, 144), (512, 6144, 640, 192), (300, 8192, 520, 192),
    (512, 8192, 1024, 256),
    (512, 4096, 1000, 128),  # with row and column vectors, 128 x 128 gains a stage too
])
def test_one_tile_per_cta_runs_the_one_wave_twin(cache, m, n, k, width):
    """Where each CTA runs one tile, the selector launches the tile with fewer D buffers and one
    more A/B stage (evtc.plan.selector.one_wave_twins); the results match float64, ragged K
    included."""
    x, w, g = linear_inputs(m, n, k, seed=m + n + k)
    bias = torch.randn(n, device="cuda", generator=g)
    row_scale = torch.rand(m, 1, device="cuda", generator=g) + 0.5
    kernel = evtc.compile(_scaled_bias_relu, {"a": x, "b": w.t(), "bias": bias, "row_scale": row_scale},
                          cache_dir=cache)
    config, splits = kernel.launch_for(m, n, k)
    assert (config.schedule, config.tile_n, splits) == ("cooperative", width, 1), config.short_name()
    assert config.epi_stages is not None, config.short_name()
    acc = x.double() @ w.double().t()
    assert_close(kernel(x, w.t(), bias=bias, row_scale=row_scale),
                 torch.relu(acc * row_scale.double() + bias.double()))


def _residual(acc, C):
    return acc + C


@pytest.mark.parametrize("m,n,k,width", [(512, 3584, 4200, 112), (512, 4608, 4096, 144),
                                         (512, 6144, 4160, 192), (384, 6144, 4100, 144)])
def test_a_residual_twin_stages_c_in_a_ring(cache, m, n, k, width):
    """The residual's twin (K >= 4096) stages C 2-3 deep (not the whole tile, which held D) and
    writes D to buffers of its own: every subtile of C still reaches its D, ragged K included."""
    x, w, g = linear_inputs(m, n, k, seed=m + n + k + 1)
    C = torch.randn(m, n, device="cuda", generator=g).to(torch.bfloat16)
    kernel = evtc.compile(_residual, {"a": x, "b": w.t(), "C": C}, cache_dir=cache)
    config, _ = kernel.launch_for(m, n, k)
    assert config.tile_n == width and config.load_stages < config.num_subtiles, config.short_name()
    assert config.epi_stages is not None, config.short_name()
    assert_close(kernel(x, w.t(), C=C), x.double() @ w.double().t() + C.double())
