"""Vector norms in epilogues (``x.norm``, ``torch.norm``, ``torch.linalg.vector_norm``): written as
reductions of ``|x|`` (evtc/frontend/composites.py), against torch's own norms in float64 on the
torch path, with the kernel built for sm_90a (CPU; tests/test_norms_gpu.py runs the kernels)."""

from __future__ import annotations

import math

import pytest
import torch

import evtc

ORDERS = {  # name: (the epilogue's norm of y, the reference norm)
    "row 2-norm": (lambda y: y.norm(dim=-1), lambda y: torch.linalg.vector_norm(y, 2, dim=-1)),
    "column 2-norm, keepdim": (lambda y: torch.norm(y, dim=-2, keepdim=True),
                               lambda y: torch.linalg.vector_norm(y, 2, dim=-2, keepdim=True)),
    "Frobenius, everything": (lambda y: y.norm(), lambda y: torch.linalg.vector_norm(y)),
    "row 1-norm": (lambda y: y.norm(1, dim=-1), lambda y: torch.linalg.vector_norm(y, 1, dim=-1)),
    "row inf-norm": (lambda y: torch.linalg.vector_norm(y, math.inf, dim=-1),
                     lambda y: torch.linalg.vector_norm(y, math.inf, dim=-1)),
    "row -inf-norm": (lambda y: torch.linalg.vector_norm(y, -math.inf, dim=-1),
                      lambda y: torch.linalg.vector_norm(y, -math.inf, dim=-1)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("order", sorted(ORDERS))
def test_norms_are_torchs(order, dtype, tmp_path):
    """Each norm beside the tile: torch's shape and dtype, and torch's value within one rounding of
    the output dtype (evtc sums float32 squares of the float32 accumulator; torch's accumulator of
    16-bit a and b is rounded to 16 bits first)."""
    norm, reference = ORDERS[order]
    g = torch.Generator().manual_seed(len(order))
    a, b = torch.randn(2, 24, 40, generator=g).to(dtype), torch.randn(2, 40, 16, generator=g).to(dtype)
    bias = torch.randn(16, generator=g).to(dtype)

    def epilogue(acc, bias):
        y = acc + bias
        return y, norm(y)

    k = evtc.compile(epilogue, {"a": a, "b": b, "bias": bias}, cache_dir=tmp_path)
    assert len(k.plan.reductions) == 1
    y, got = k(a, b, bias=bias)
    torch_y, torch_norm = epilogue(a @ b, bias)
    assert (got.shape, got.dtype) == (torch_norm.shape, torch_norm.dtype) == (torch_norm.shape, dtype)
    want = reference(a.double() @ b.double() + bias.double())
    unit = {torch.float32: 2.0 ** -20, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}[dtype]
    # atol: the float32 accumulator's own error, which the smallest magnitude (-inf) may be near
    scale = (a.double().abs() @ b.double().abs()).max().item()
    torch.testing.assert_close(got.double(), want, rtol=2 * unit, atol=64 * 2.0 ** -24 * scale)


def test_dtype_keeps_the_float32_norm_and_math_may_follow(tmp_path):
    a, b = torch.randn(16, 32).half(), torch.randn(32, 8).half()

    def epilogue(acc):
        return acc.relu(), torch.linalg.vector_norm(acc, dim=-1, dtype=torch.float32) * 0.5 + 1.0

    _, got = evtc.compile(epilogue, {"a": a, "b": b}, cache_dir=tmp_path)(a, b)
    assert got.dtype == torch.float32
    want = torch.linalg.vector_norm(a.double() @ b.double(), dim=-1) * 0.5 + 1.0
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("epilogue, match", [
    (lambda acc: acc.norm(3, dim=-1), r"norm of order 3: epilogues compute the 2-norm"),
    (lambda acc: acc.norm(p="nuc"), r"norm of order 'nuc'"),
    (lambda acc: (acc > 0).norm(dim=-1), r"norm of a boolean mask"),
    (lambda acc: acc.norm(dim=-1, dtype=torch.float64), r"norm\(dtype=torch.float64\)"),
    (lambda acc: acc / acc.norm(dim=-1, keepdim=True), r"needs a second pass over the tile"),
])
def test_norms_evtc_cannot_compute_are_refused_at_the_users_line(epilogue, match, tmp_path):
    a, b = torch.randn(8, 16), torch.randn(16, 8)
    with pytest.raises(evtc.EpilogueError, match=match) as caught:
        evtc.compile(epilogue, {"a": a, "b": b}, cache_dir=tmp_path)
    assert "test_norms.py" in str(caught.value)


def test_the_norm_kernel_builds(tmp_path):
    """The row 2-norm's kernel builds for sm_90a: per-tile partial sums of squares, the square root
    where the reduction is finished."""
    a, b = torch.randn(64, 64).half(), torch.randn(64, 128).half()
    k = evtc.compile(lambda acc: (acc, acc.norm(dim=-1)), {"a": a, "b": b}, arch="sm_90a",
                     cache_dir=tmp_path)
    assert k.config is not None and "wgmma" in k.ptx
    assert [r.op for r in k.plan.reductions] == ["sum"]
