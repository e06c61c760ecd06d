"""CPU: the checking helpers of the kind matrix and the fuzzer (tests/epilogue_cases.py)."""

from __future__ import annotations

import torch
from epilogue_cases import FLOAT8_ACC_NOISE, acc_noise_reference

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
