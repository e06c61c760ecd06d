"""Epilogues and inputs shared by the GPU tests of launch shapes (trimmed A loads, four-CTA
clusters, wave-fitted widths): an nn.Linear-style problem x (M, K) times w (N, K)^T in bfloat16,
checked against torch in float64."""

from __future__ import annotations

import torch


def identity(acc):
    return acc


def residual_scaled(acc, C, bias, row_scale):
    return torch.relu(acc * row_scale + C + bias)


def with_reductions(acc, bias):
    y = acc + bias
    return y, y.float().sum(0), y.float().abs().amax(-1), y.float().square().sum()


def linear_inputs(m, n, k, seed, batches=None):
    """x (M, K) and w (N, K) in bfloat16, scaled so that the sums stay near 1, and the generator for
    further operands."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    lead = () if batches is None else (batches,)
    x = (torch.randn(*lead, m, k, device="cuda", generator=g) * k ** -0.25).to(torch.bfloat16)
    w = (torch.randn(*lead, n, k, device="cuda", generator=g) * k ** -0.25).to(torch.bfloat16)
    return x, w, g


def assert_close(out, ref, tol=2e-2):
    """Finite, and within ``tol`` of the float64 reference relative to its largest value."""
    assert torch.isfinite(out).all(), "non-finite values in the output"
    err = ((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
    assert err < tol, f"max error {err:.3g} relative to the largest value"


def check_reductions(kernel, x, w, bias):
    """Run a ``with_reductions`` kernel and compare all four outputs with float64."""
    y, col_sums, row_amax, total = kernel(x, w.t(), bias=bias)
    ref = x.double() @ w.double().t() + bias.double()
    assert_close(y, ref)
    assert_close(col_sums, ref.sum(0))
    assert_close(row_amax, ref.abs().amax(-1))
    assert_close(total, ref.square().sum())
