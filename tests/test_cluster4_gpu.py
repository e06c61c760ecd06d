"""GPU: four-CTA clusters (1x4: A multicast to four CTAs along N), which the selector picks for
decode-sized problems of 33 to 64 rows, and the 2x1 clusters it picks for two rows of 64-row tiles,
against torch in float64. Each case runs where the cluster overhangs N (the last cluster's trailing
CTAs have no tile), with epilogue operands along M and N, reductions, split-K and batches. At
M <= 32 the selector runs the same tiles without a cluster, loading only A's rows: that case is
here too, on the same ragged N."""

from __future__ import annotations

import pytest
import torch
from linear_cases import (
    assert_close,
    check_plain_and_fused,
    check_reductions,
    identity,
    linear_inputs,
    residual_scaled,
    run_pinned_splits,
    with_reductions,
)

import evtc

pytestmark = pytest.mark.gpu


def _fill_free_memory_with_nan():
    """Freed blocks full of NaN: a workspace or output read before it is written shows."""
    junk = torch.full((64 << 20,), float("nan"), device="cuda")
    del junk


# N = 3648: 57 tiles of 64 columns, so the last 1x4 cluster has three CTAs past the edge.
N_RAGGED = 3648


@pytest.mark.parametrize("m", [33, 47, 64])
def test_decode_sizes_run_four_cta_clusters(cache, m):
    # K = 1000: not a multiple of the 64-wide K tile.
    check_plain_and_fused(cache, m, N_RAGGED, 1000, m, lambda c: c.cluster == (1, 4),
                          _fill_free_memory_with_nan)


@pytest.mark.parametrize("m", [1, 17, 32])
def test_fewer_rows_run_without_a_cluster(cache, m):
    check_plain_and_fused(cache, m, N_RAGGED, 1000, m,
                          lambda c: c.cluster == (1, 1) and c.a_rows is not None and m <= c.a_rows,
                          _fill_free_memory_with_nan)


@pytest.mark.parametrize("m", [40, 64])
def test_reductions_over_four_cta_clusters(cache, m):
    k = 768
    x, w, g = linear_inputs(m, N_RAGGED, k, seed=50 + m)
    bias = torch.randn(N_RAGGED, device="cuda", generator=g)
    kernel = evtc.compile(with_reductions, {"a": x, "b": w.t(), "bias": bias}, cache_dir=cache)
    assert kernel.launch_for(m, N_RAGGED, k)[0].cluster == (1, 4)
    check_reductions(kernel, x, w, bias)


@pytest.mark.parametrize("splits", [2, 3])
def test_split_k_over_four_cta_clusters(cache, splits):
    four = lambda c: c.cluster == (1, 4)  # noqa: E731
    (y, col_sums, _, total), ref = run_pinned_splits(cache, 40, 2048, 8192, 100 + splits, splits, four,
                                                     _fill_free_memory_with_nan)
    assert_close(y, ref)
    assert_close(col_sums, ref.sum(0))
    assert_close(total, ref.square().sum())


def test_batches_over_four_cta_clusters(cache):
    x, w, _ = linear_inputs(40, 1216, 640, seed=300, batches=3)  # 19 tiles of 64 columns per batch
    kernel = evtc.compile(identity, {"a": x, "b": w.mT}, cache_dir=cache)
    assert kernel.launch_for(40, 1216, 640, 3)[0].cluster == (1, 4)
    assert_close(kernel(x, w.mT), x.double() @ w.double().mT)


def test_two_rows_of_tiles_share_the_weights(cache):
    """Two rows of 64 x 64 tiles with each weight tile multicast to both (2x1), as the selector
    runs M = 96-128 where 1x4 clusters would not fit one wave; M = 96 leaves the second row
    half empty."""
    for m in (96, 128):
        n, k = 4096, 1536
        x, w, g = linear_inputs(m, n, k, seed=400 + m)
        C = torch.randn(m, n, device="cuda", generator=g).to(torch.bfloat16)
        bias = torch.randn(n, device="cuda", generator=g)
        row_scale = torch.rand(m, 1, device="cuda", generator=g) + 0.5
        kernel = evtc.compile(residual_scaled, {"a": x, "b": w.t(), "C": C, "bias": bias,
                                                "row_scale": row_scale},
                              config={"schedule": "pingpong", "tile_m": 64, "tile_n": 64, "cluster": (2, 1)},
                              cache_dir=cache)
        acc = x.double() @ w.double().t()
        assert_close(kernel(x, w.t(), C=C, bias=bias, row_scale=row_scale),
                     torch.relu(acc * row_scale.double() + C.double() + bias.double()))


@pytest.mark.parametrize("knobs", [
    {"schedule": "pingpong", "tile_m": 64, "tile_n": 64},
    {"schedule": "pingpong", "tile_m": 64, "tile_n": 128},
    {"schedule": "cooperative", "tile_m": 128, "tile_n": 64},
], ids=lambda c: f"{c['schedule']}-{c['tile_m']}x{c['tile_n']}")
def test_pinned_four_cta_clusters_over_many_rows(cache, knobs):
    """A kernel compiled with a 1x4 cluster, on a problem with several rows of tiles and clusters
    overhanging N, through the fused epilogue."""
    m, n, k = 300, 1000, 520
    x, w, g = linear_inputs(m, n, k, seed=500)
    C = torch.randn(m, n, device="cuda", generator=g).to(torch.bfloat16)
    bias = torch.randn(n, device="cuda", generator=g)
    row_scale = torch.rand(m, 1, device="cuda", generator=g) + 0.5
    kernel = evtc.compile(residual_scaled, {"a": x, "b": w.t(), "C": C, "bias": bias, "row_scale": row_scale},
                          config={**knobs, "cluster": (1, 4)}, cache_dir=cache)
    assert kernel.launch_for(m, n, k)[0].cluster == (1, 4)
    acc = x.double() @ w.double().t()
    assert_close(kernel(x, w.t(), C=C, bias=bias, row_scale=row_scale),
                 torch.relu(acc * row_scale.double() + C.double() + bias.double()))
