"""A compiled kernel and its custom operator are differentiable: gradients of a, b and the tensor
operands against torch.autograd of the same function, eagerly and under torch.compile (the
operator's autograd formula, traced by AOTAutograd), on CPU through the torch path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import evtc


def bias_gelu(acc, bias):
    return F.gelu(acc + bias)


def scaled_with_stats(acc, C, scale, alpha: float):
    y = torch.tanh(acc * scale * alpha) + C
    return y, y.sum(-1)


def _close(got, want, what):
    err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()
    assert err < 1e-4, f"{what}: relative error {err:.3g}"


def _inputs(batched=False):
    g = torch.Generator().manual_seed(0)
    lead = (3,) if batched else ()
    return {"a": torch.randn(*lead, 10, 16, generator=g).requires_grad_(),
            "b": torch.randn(*lead, 16, 24, generator=g).requires_grad_(),
            "bias": torch.randn(24, generator=g).requires_grad_()}


@pytest.mark.parametrize("batched", [False, True])
def test_eager_call_is_differentiable(batched):
    x = _inputs(batched)
    k = evtc.compile(bias_gelu, x)
    y = k(x["a"], x["b"], bias=x["bias"])
    assert y.requires_grad
    upstream = torch.randn(y.shape)
    mine = torch.autograd.grad(y, list(x.values()), upstream)
    want = torch.autograd.grad(bias_gelu(x["a"] @ x["b"], x["bias"]), list(x.values()), upstream)
    for name, got, ref in zip(x, mine, want, strict=True):
        _close(got, ref, name)


def test_several_outputs_and_a_python_scalar():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(12, 8, generator=g, requires_grad=True)
    b = torch.randn(8, 20, generator=g, requires_grad=True)
    C = torch.randn(12, 20, generator=g, requires_grad=True)
    scale = (torch.rand(12, 1, generator=g) + 0.5).requires_grad_()
    k = evtc.compile(scaled_with_stats, {"a": a, "b": b, "C": C, "scale": scale, "alpha": 0.7})
    y, s = k(a, b, C=C, scale=scale, alpha=0.7)
    dy, ds = torch.randn(y.shape, generator=g), torch.randn(s.shape, generator=g)
    inputs = [a, b, C, scale]
    mine = torch.autograd.grad([y, s], inputs, [dy, ds])
    ry, rs = scaled_with_stats(a @ b, C, scale, 0.7)
    want = torch.autograd.grad([ry, rs], inputs, [dy, ds])
    for name, got, ref in zip(["a", "b", "C", "scale"], mine, want, strict=True):
        _close(got, ref, name)


def test_under_torch_compile():
    x = _inputs()
    k = evtc.compile(bias_gelu, x)

    def step(a, b, bias):
        return k(a, b, bias=bias).square().mean()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    mine = torch.autograd.grad(compiled(*x.values()), list(x.values()))
    want = torch.autograd.grad(bias_gelu(x["a"] @ x["b"], x["bias"]).square().mean(), list(x.values()))
    for name, got, ref in zip(x, mine, want, strict=True):
        _close(got, ref, name)


def swiglu(acc):
    gate, up = acc.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_bias_scaled(acc, bias, scale):
    gate, up = (acc + bias).chunk(2, dim=-1)
    return F.silu(gate) * up * scale


@pytest.mark.parametrize("fn", [swiglu, swiglu_bias_scaled])
def test_gated_operator_is_differentiable(fn):
    """A gated kernel's graph is split into halves; its operator's backward is derived from the graph
    joined again (evtc.ir.passes.gated.join_halves): the gradients of a, b, a bias as wide as the
    GEMM and a per-row scale against torch.autograd."""
    g = torch.Generator().manual_seed(2)
    a = torch.randn(8, 16, generator=g, requires_grad=True)
    b = torch.randn(16, 32, generator=g, requires_grad=True)
    ops = {} if fn is swiglu else {"bias": torch.randn(32, generator=g).requires_grad_(),
                                   "scale": (torch.rand(8, 1, generator=g) + 0.5).requires_grad_()}
    k = evtc.compile(fn, {"a": a, "b": b, **ops})
    assert k.plan.gated
    y = k(a, b, **ops)
    dy = torch.randn(y.shape, generator=g)
    inputs = [a, b, *ops.values()]
    mine = torch.autograd.grad(y, inputs, dy)
    want = torch.autograd.grad(fn(a @ b, **ops), inputs, dy)
    for name, got, ref in zip(["a", "b", *ops], mine, want, strict=True):
        _close(got, ref, name)
