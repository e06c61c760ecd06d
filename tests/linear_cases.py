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


def check_plain_and_fused(cache, m, n, k, seed, launch_ok, before_call):
    """Compile ``identity`` and ``residual_scaled`` for an (M, N, K) problem, assert
    ``launch_ok(config)`` of each kernel's launch for it, and compare both with float64, calling
    ``before_call()`` (which leaves garbage for a wrong read to find) before each launch."""
    import evtc

    x, w, g = linear_inputs(m, n, k, seed=seed)
    C = torch.randn(m, n, device="cuda", generator=g).to(torch.bfloat16)
    bias = torch.randn(n, device="cuda", generator=g)
    row_scale = torch.rand(m, 1, device="cuda", generator=g) + 0.5
    plain = evtc.compile(identity, {"a": x, "b": w.t()}, cache_dir=cache)
    fused = evtc.compile(residual_scaled, {"a": x, "b": w.t(), "C": C, "bias": bias, "row_scale": row_scale},
                         cache_dir=cache)
    for kernel in (plain, fused):
        config, _ = kernel.launch_for(m, n, k)
        assert launch_ok(config), config.short_name()
    acc = x.double() @ w.double().t()
    before_call()
    assert_close(plain(x, w.t()), acc)
    before_call()
    assert_close(fused(x, w.t(), C=C, bias=bias, row_scale=row_scale),
                 torch.relu(acc * row_scale.double() + C.double() + bias.double()))


def run_pinned_splits(cache, m, n, k, seed, splits, launch_ok, before_call):
    """A ``with_reductions`` kernel run with its split count pinned to ``splits`` (unpinned after),
    its launch asserted by ``launch_ok(config)``: returns its outputs and the float64 reference
    of ``y``."""
    import evtc

    x, w, g = linear_inputs(m, n, k, seed=seed)
    bias = torch.randn(n, device="cuda", generator=g)
    kernel = evtc.compile(with_reductions, {"a": x, "b": w.t(), "bias": bias}, cache_dir=cache)
    kernel.pin_splits(splits)
    try:
        config = kernel.launch_for(m, n, k)[0]
        assert launch_ok(config), config.short_name()
        before_call()
        outputs = kernel(x, w.t(), bias=bias)
    finally:
        kernel.pin_splits(None)
    return outputs, x.double() @ w.double().t() + bias.double()
