"""CPU: the checking helpers of the kind matrix and the fuzzer (tests/epilogue_cases.py)."""

from __future__ import annotations

import torch
from epilogue_cases import (
    FLOAT8_ACC_NOISE,
    SUM_ORDER_ACC_NOISE,
    TILE_TOL,
    acc_noise_reference,
    relative_error,
)

import evtc


def row_sum(acc):
    return acc * 2.0, (acc + acc).sum(-1)


def test_acc_noise_moves_a_sum_by_its_terms_not_by_its_value():
    """The allowance for cancelling float8 reductions scales with the terms summed: a sum near
    zero of order-1 terms may move by about FLOAT8_ACC_NOISE of their norm, far more than the
    same fraction of the sum itself, and a dropped term still moves it far more than that."""
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(4, 128, generator=g) / 128 ** 0.5).to(torch.float8_e5m2)
    b = torch.randn(128, 256, generator=g).to(torch.float8_e5m2)
    inputs = {"a": a, "b": b}
    tile, total = evtc.reference(row_sum, inputs)
    noisy_tile, noisy_total = acc_noise_reference(row_sum, inputs, seed=1)
    acc = a.float() @ b.float()
    # Each element moves by exactly the noise's fraction of itself.
    assert torch.allclose((noisy_tile - tile).abs(), FLOAT8_ACC_NOISE * tile.abs(), rtol=1e-3, atol=1e-6)
    moved = torch.linalg.vector_norm(noisy_total - total)
    terms = 2 * torch.linalg.vector_norm(acc)  # the norm of every term summed
    assert 0.2 * FLOAT8_ACC_NOISE * terms < moved < 2 * FLOAT8_ACC_NOISE * terms
    # Dropping one column of terms from each sum is well outside twice that movement.
    dropped = total - 2 * acc[:, -1]
    assert torch.linalg.vector_norm(dropped - total) > 4 * moved


def rounding_residuals(acc):
    rounded = acc.to(torch.bfloat16)
    residual = torch.maximum(-rounded, rounded) + acc  # |bf16(acc)| + acc: ~0 where acc < 0
    return residual.amin(-2), residual.sum(-1)


def test_sum_order_noise_covers_a_rounding_flip_and_not_a_dropped_row():
    """16-bit a and b: an acc summed in another order (float32 against float64 here, as the kernel
    against torch) rounds some elements to the other bfloat16 neighbour. A column minimum of rounding
    residuals then misses the reduction tolerance (1e-3) although nothing is wrong, and
    SUM_ORDER_ACC_NOISE allows it; a row left out of a sum is still far outside the allowance."""
    g = torch.Generator().manual_seed(2)
    a = torch.randn(4, 440, 480, generator=g).half()
    b = torch.randn(4, 480, 360, generator=g).half()
    inputs = {"a": a, "b": b}
    want_min, want_sum = evtc.reference(rounding_residuals, inputs)
    other_order = (a.double() @ b.double()).float()
    got_min, got_sum = rounding_residuals(other_order)
    noisy_min, noisy_sum = acc_noise_reference(rounding_residuals, inputs, seed=3, noise=SUM_ORDER_ACC_NOISE)
    assert relative_error(got_min, want_min) > 1e-3  # the false alarm this allowance is for
    assert torch.linalg.vector_norm(got_min - want_min) <= 2 * torch.linalg.vector_norm(noisy_min - want_min)
    moved = torch.linalg.vector_norm(noisy_sum - want_sum)
    acc = a.float() @ b.float()
    residual = torch.maximum(-acc.to(torch.bfloat16), acc.to(torch.bfloat16)) + acc
    last_column_left_out = want_sum - residual[..., -1]
    assert torch.linalg.vector_norm(last_column_left_out - want_sum) > 10 * moved


def rounding_residual_tile(acc):
    return (acc.to(torch.bfloat16) - (acc + acc) + acc).to(torch.bfloat16)


def test_float8_noise_covers_a_tile_of_rounding_residuals_and_not_a_wrong_edge():
    """float8 a and b: the tensor cores' acc is a few 1e-4 off float64, and a tile that is nothing
    but bfloat16 rounding residuals (fuzz seed 2039, case 130) then misses the tile tolerance by
    norm while nothing is wrong. FLOAT8_ACC_NOISE allows it; a tile whose last row or column holds
    acc rather than its residual is outside the allowance, and an ordinary tile is not loosened."""
    g = torch.Generator().manual_seed(5)
    a = (torch.randn(4, 211, 112, generator=g) * 2).to(torch.float8_e5m2)
    b = (torch.randn(4, 112, 208, generator=g) * 2).to(torch.float8_e5m2)
    inputs = {"a": a, "b": b}
    want = evtc.reference(rounding_residual_tile, inputs)
    acc = a.double() @ b.double()
    # The tensor cores' error, as measured (3e-4 of each element by norm, random signs).
    signs = torch.randint(0, 2, acc.shape, generator=torch.Generator().manual_seed(6)) * 2 - 1
    got = rounding_residual_tile((acc * (1 + 3e-4 * signs)).float())
    noisy = acc_noise_reference(rounding_residual_tile, inputs, seed=7)
    moved = torch.linalg.vector_norm(noisy.float() - want.float())
    assert relative_error(got, want) > TILE_TOL  # the false alarm the allowance is for
    assert torch.linalg.vector_norm(got.float() - want.float()) <= 2 * moved
    # Residuals are noise: the allowance is of their own size, and one column of wrong residuals
    # would pass. What a kernel bug leaves behind is larger: here the last column or row holding
    # acc plus its residual (a ragged edge that skipped part of the program).
    wrong = got.clone()
    wrong[..., -1] = (acc[..., -1] + got[..., -1].double()).to(torch.bfloat16)
    assert torch.linalg.vector_norm(wrong.float() - want.float()) > 10 * moved
    rows = got.clone()
    rows[..., -1, :] = acc[..., -1, :].to(torch.bfloat16)
    assert torch.linalg.vector_norm(rows.float() - want.float()) > 10 * moved

    def scaled(acc):
        return acc * 2.0

    plain = evtc.reference(scaled, inputs)
    noisy_plain = acc_noise_reference(scaled, inputs, seed=7)
    # A tile that does not cancel moves by the noise's fraction of itself: twice that is far below
    # the tile tolerance, so the allowance never loosens it.
    assert 2 * relative_error(noisy_plain, plain) < TILE_TOL / 5


def test_reference_on_a_given_accumulator():
    """evtc.reference(..., acc=) evaluates the epilogue on that accumulator instead of a @ b, in
    float32 (or the dtype asked for), and refuses one of another shape."""
    import pytest

    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(3, 8, 16, generator=g), torch.randn(3, 16, 24, generator=g)
    bias = torch.randn(24, generator=g).half()

    def fn(acc, bias):
        return torch.relu(acc + bias), (acc * acc).sum(-1)

    acc = torch.randn(3, 8, 24, generator=g, dtype=torch.float64)
    tile, total = evtc.reference(fn, {"a": a, "b": b, "bias": bias}, acc=acc)
    want = acc.float()
    assert torch.equal(tile, torch.relu(want + bias.float())) and torch.allclose(total, (want * want).sum(-1))
    assert evtc.reference(fn, {"bias": bias}, acc=acc, dtype=torch.float64)[0].dtype == torch.float64
    with pytest.raises(evtc.InputError, match=r"acc= has shape \(3, 8, 23\); a @ b is \(3, 8, 24\)"):
        evtc.reference(fn, {"a": a, "b": b, "bias": bias}, acc=acc[..., :23])
    with pytest.raises(evtc.InputError, match="missing input"):
        evtc.reference(fn, {"bias": bias})
