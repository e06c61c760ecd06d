"""Vector norms in epilogues on the GPU: each order of tests/test_norms.py through the kernel (per-tile
partial sums of squares or of magnitudes, or extrema of magnitudes, finished with the square root),
at a tile-sized, a decode and a batched problem, against torch's norm in float64."""

from __future__ import annotations

import math

import pytest
import torch

import evtc

pytestmark = pytest.mark.gpu

NORMS = {
    "row 2-norm": (lambda y: y.norm(dim=-1), lambda y: torch.linalg.vector_norm(y, 2, dim=-1)),
    "column 2-norm": (lambda y: torch.norm(y, dim=-2), lambda y: torch.linalg.vector_norm(y, 2, dim=-2)),
    "Frobenius": (lambda y: y.norm(), lambda y: torch.linalg.vector_norm(y)),
    "row 1-norm": (lambda y: y.norm(1, dim=-1), lambda y: torch.linalg.vector_norm(y, 1, dim=-1)),
    "row inf-norm": (lambda y: torch.linalg.vector_norm(y, math.inf, dim=-1),
                     lambda y: torch.linalg.vector_norm(y, math.inf, dim=-1)),
}
PROBLEMS = {"tiles": (None, 384, 512, 256), "decode": (None, 3, 4096, 1024), "batched": (3, 136, 264, 128)}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("problem", sorted(PROBLEMS))
@pytest.mark.parametrize("order", sorted(NORMS))
def test_norms_through_the_kernel(order, problem, dtype, tmp_path):
    norm, reference = NORMS[order]
    batch, m, n, k = PROBLEMS[problem]
    lead = () if batch is None else (batch,)
    g = torch.Generator(device="cuda").manual_seed(m + n)
    a = torch.randn(*lead, m, k, device="cuda", generator=g).to(dtype)
    w = torch.randn(*lead, n, k, device="cuda", generator=g).to(dtype)
    bias = torch.randn(n, device="cuda", generator=g).to(dtype)

    def epilogue(acc, bias):
        y = acc + bias
        return y, norm(y)

    kernel = evtc.compile(epilogue, {"a": a, "b": w.transpose(-1, -2), "bias": bias}, cache_dir=tmp_path)
    y, got = kernel(a, w.transpose(-1, -2), bias=bias)
    torch_y, torch_norm = epilogue(a @ w.transpose(-1, -2), bias)
    assert (got.shape, got.dtype) == (torch_norm.shape, torch_norm.dtype)
    exact = a.double() @ w.double().transpose(-1, -2) + bias.double()
    unit = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}[dtype]
    # The float32 accumulator's error, scaled by the problem's magnitudes, besides one rounding.
    scale = (a.double().abs() @ w.double().abs().transpose(-1, -2)).max().item()
    # Rounded to the output's dtype, as torch rounds it: a float16 1-norm of 4096 values of about
    # 30 is past 65504, inf in torch and here.
    torch.testing.assert_close(got.double(), reference(exact).to(dtype).double(), rtol=2 * unit,
                               atol=4 * k * 2.0 ** -24 * scale)
    torch.testing.assert_close(y.double(), exact, rtol=unit, atol=4 * k * 2.0 ** -24 * scale)
