"""GPU: the differentiable evtc.linear and FusedLinear in bfloat16 against torch.autograd of the same
function (the forward is the fused kernel; the backward the reference one of evtc.linear_autograd),
compared by norm: the forward rounds to bfloat16 as the kernel's output does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import evtc

pytestmark = pytest.mark.gpu


def bias_gelu(acc, bias):
    return F.gelu(acc + bias)


def swiglu(acc):
    gate, up = acc.chunk(2, dim=-1)
    return F.silu(gate) * up


def _norm_close(got, want, what, tol=2e-2):
    err = ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)).item()
    assert err < tol, f"{what}: relative error {err:.3g} by norm"


@pytest.mark.parametrize("fn, rows", [(bias_gelu, 256), (swiglu, 512)])
def test_gradients_against_autograd(fn, rows):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(2, 64, 128, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(rows, 128, device="cuda", generator=g) * 128 ** -0.5).bfloat16().requires_grad_()
    ops = {"bias": torch.randn(rows, device="cuda", generator=g).requires_grad_()} if fn is bias_gelu else {}
    lin = evtc.linear(fn, {"x": x, "weight": w, **ops})
    y = lin(x, w, **ops)
    ref = fn((x.float() @ w.float().t()), **{k: v.float() for k, v in ops.items()})
    _norm_close(y, ref, "forward")
    dy = torch.randn(ref.shape, device="cuda", generator=g).bfloat16()
    inputs = [x, w, *ops.values()]
    mine = torch.autograd.grad(y, inputs, dy)
    want = torch.autograd.grad(ref, inputs, dy.float())
    for name, a, b in zip(["x", "weight", *ops], mine, want, strict=True):
        assert a.dtype == b.dtype == inputs[["x", "weight", *ops].index(name)].dtype
        _norm_close(a, b, name)
    # No less accurate than eager autograd in bfloat16 (16-bit GEMMs, as the backward runs them).
    eager = fn(x @ w.t(), **{k: v.bfloat16() for k, v in ops.items()})
    theirs = torch.autograd.grad(eager, inputs, dy)
    for name, a, t, b in zip(["x", "weight", *ops], mine, theirs, want, strict=True):
        err = (a.float() - b.float()).norm() / b.float().norm()
        err_eager = (t.float() - b.float()).norm() / b.float().norm()
        assert err <= 2 * err_eager + 1e-3, f"{name}: {err:.3g} against eager's {err_eager:.3g}"


def test_fused_linear_module_on_gpu():
    layer = evtc.nn.FusedLinear(128, 256, bias_gelu, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    y.float().square().mean().backward()
    ref = F.linear(x.detach().float(), layer.weight.detach().float(), layer.bias.detach().float())
    _norm_close(y.detach(), F.gelu(ref), "forward")
    assert layer.weight.grad is not None and layer.bias.grad is not None and x.grad is not None
    assert torch.isfinite(layer.weight.grad.float()).all()


def test_kernel_call_is_differentiable_on_gpu():
    g = torch.Generator(device="cuda").manual_seed(1)
    a = (torch.randn(256, 128, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    b = (torch.randn(128, 192, device="cuda", generator=g) * 128 ** -0.5).bfloat16().requires_grad_()
    bias = torch.randn(192, device="cuda", generator=g).requires_grad_()
    k = evtc.compile(bias_gelu, {"a": a, "b": b, "bias": bias})
    y = k(a, b, bias=bias)
    ref = bias_gelu(a.float() @ b.float(), bias)
    _norm_close(y, ref, "forward")
    dy = torch.randn(ref.shape, device="cuda", generator=g)
    mine = torch.autograd.grad(y, [a, b, bias], dy.bfloat16())
    want = torch.autograd.grad(ref, [a, b, bias], dy)
    for name, got, exp in zip(["a", "b", "bias"], mine, want, strict=True):
        _norm_close(got, exp, name)
