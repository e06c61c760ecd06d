"""Helpers and epilogues shared by tests/test_training_edges.py and its GPU twin (module level, so
that modules holding them pickle)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

TOL = {torch.bfloat16: 2.5e-2, torch.float16: 6e-3, torch.float32: 2e-3}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return ((got - want).norm() / want.norm().clamp_min(1e-12)).item()


def assert_close(got, want, what: str, tol: float) -> None:
    assert got is not None, f"{what}: no gradient"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    assert torch.isfinite(got.float()).all(), f"{what}: non-finite values"
    err = rel_err(got, want)
    assert err < tol, f"{what}: relative error {err:.3g} by norm (tol {tol})"


def ref_leaf(t: torch.Tensor) -> torch.Tensor:
    """A float64 leaf copy of ``t`` for the reference (requires grad as ``t`` does)."""
    return t.detach().double().requires_grad_(t.requires_grad)


def snapshot(*tensors):
    return [t.detach().clone() for t in tensors]


def assert_unchanged(before, tensors, what="input"):
    for i, (b, t) in enumerate(zip(before, tensors, strict=True)):
        assert torch.equal(b, t.detach()), f"{what} {i} was modified"


def cuda_generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def cuda_rand(*shape, g, dtype, scale=1.0, grad=False) -> torch.Tensor:
    """Normal values on the GPU from ``g``, scaled, in ``dtype``, a leaf requiring grad if ``grad``."""
    return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype).requires_grad_(grad)


# ---- epilogues --------------------------------------------------------------------------------

def bias_gelu(acc, bias):
    return F.gelu(acc + bias)


def swiglu(acc):
    gate, up = acc.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_bias(acc, bias):
    gate, up = (acc + bias).chunk(2, dim=-1)
    return F.silu(gate) * up


def geglu_bias(acc, bias):
    gate, up = (acc + bias).chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def add_residual(acc, residual):
    return acc + residual


def add_bias_residual(acc, bias, residual):
    return acc + bias + residual


def scaled_residual(acc, scale, C, s, alpha: float):
    """A per-row (column) scale, a tile, a 0-d scalar and a Python float."""
    return F.silu(acc * scale + C) * s * alpha


def scaled_tile(acc, scale, C):
    return F.silu(acc * scale + C)


def gelu_and_row_sum(acc, bias):
    y = F.gelu(acc + bias)
    return y, y.sum(-1)


def stats(acc, bias, residual):
    y = F.gelu(acc + bias) + residual
    return {"y": y, "mean": y.mean(-1), "sq": (y * y).sum(-1)}


def tanh_tile(acc, S):
    return torch.tanh(acc * S)
