"""GPU: kernels that load only the first rows of A (GemmConfig.a_rows, chosen for problems with at
most 32 rows) against torch in float64. The accumulator rows past ``a_rows`` come from shared
memory nobody wrote for this launch, so every test checks that nothing of them reaches an output:
full tiles, vectors along M and N, reductions over M, N and everything, split-K, batches, and a
call with more rows than a launch was trimmed for."""

from __future__ import annotations

import pytest
import torch
from linear_cases import (
    assert_close,
    check_plain_and_fused,
    check_reductions,
    identity,
    linear_inputs,
    run_pinned_splits,
    with_reductions,
)

import evtc

pytestmark = pytest.mark.gpu


def _poison_shared_memory():
    """Leave NaN in the shared memory of every SM: a full-tile GEMM whose A is all NaN. A trimmed
    kernel launched next reads it as the rows it does not load."""
    x = torch.full((4096, 1024), float("nan"), device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    torch.matmul(x, w.t())


ROWS = [1, 3, 8, 15, 16, 17, 31, 32]


@pytest.mark.parametrize("m", ROWS)
def test_identity_and_operands_with_trimmed_loads(cache, m):
    # K = 1000: not a multiple of the 64-wide K tile.
    check_plain_and_fused(cache, m, 384, 1000, m,
                          lambda c: c.a_rows is not None and m <= c.a_rows < c.tile_m, _poison_shared_memory)


# Taller problems with one row of tiles: 64-row tiles loading 48 rows, cooperative 128-row tiles
# loading 80, 96 or 112, alone or four CTAs sharing A (24 rows each).
TALLER = [(40, 384, 48), (72, 8192, 80), (96, 6144, 96), (104, 8192, 112)]


@pytest.mark.parametrize("m, n, rows", TALLER)
def test_taller_problems_with_trimmed_loads(cache, m, n, rows):
    check_plain_and_fused(cache, m, n, 1000, m, lambda c: c.a_rows == rows, _poison_shared_memory)


def test_reductions_of_a_taller_trimmed_launch(cache):
    m, n, k = 96, 8192, 512
    x, w, g = linear_inputs(m, n, k, seed=96)
    bias = torch.randn(n, device="cuda", generator=g)
    kernel = evtc.compile(with_reductions, {"a": x, "b": w.t(), "bias": bias}, cache_dir=cache)
    assert kernel.launch_for(m, n, k)[0].a_rows == 96
    _poison_shared_memory()
    check_reductions(kernel, x, w, bias)


@pytest.mark.parametrize("m", [1, 5, 16, 29])
def test_reductions_ignore_the_rows_not_loaded(cache, m):
    n, k = 320, 512
    x, w, g = linear_inputs(m, n, k, seed=100 + m)
    bias = torch.randn(n, device="cuda", generator=g)
    kernel = evtc.compile(with_reductions, {"a": x, "b": w.t(), "bias": bias}, cache_dir=cache)
    assert kernel.launch_for(m, n, k)[0].a_rows is not None
    _poison_shared_memory()
    check_reductions(kernel, x, w, bias)


@pytest.mark.parametrize("splits", [2, 5])
def test_split_k_with_trimmed_loads(cache, splits):
    (y, col_sums, _, _), ref = run_pinned_splits(cache, 7, 512, 8192, 200 + splits, splits,
                                                 lambda c: c.a_rows is not None, _poison_shared_memory)
    assert_close(y, ref)
    assert_close(col_sums, ref.sum(0))


def test_batched_with_trimmed_loads(cache):
    x, w, _ = linear_inputs(3, 256, 640, seed=300, batches=4)
    kernel = evtc.compile(identity, {"a": x, "b": w.mT}, cache_dir=cache)
    assert kernel.launch_for(3, 256, 640, 4)[0].a_rows is not None
    _poison_shared_memory()
    assert_close(kernel(x, w.mT), x.double() @ w.double().mT)


def test_a_trimmed_launch_reused_for_a_taller_problem(cache):
    """The launch memo and the autotuner key problems by size: a configuration chosen for M = 2
    resolved for M = 48 must not keep its trimmed loads."""
    x, w, _ = linear_inputs(48, 256, 512, seed=500)
    kernel = evtc.compile(identity, {"a": x, "b": w.t()}, cache_dir=cache)
    config, splits = kernel.launch_for(2, 256, 512)
    assert config.a_rows in (8, 16, 32)
    fn, *_ = kernel.resolve(config, splits, 48, 256, 512, 1)
    whole, *_ = kernel.resolve(config.replace(a_rows=None), splits, 48, 256, 512, 1)
    assert fn is whole
    kernel._launch_memo[(48, 256, 512, 1, x.get_device())] = kernel.resolve(config, splits, 48, 256, 512, 1)
    _poison_shared_memory()
    assert_close(kernel(x, w.t()), x.double() @ w.double().t())
