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


@pytest.mark.parametrize("batched", [False, True])
def test_a_transposed_weight_gets_a_contiguous_gradient(batched):
    """b passed as w.t() (an nn.Linear weight, K-major): the operator's backward makes b's gradient
    in that layout, so w's gradient is contiguous as it comes out of the backward (no copy into
    .grad per step) and equal to autograd's."""
    g = torch.Generator().manual_seed(1)
    lead = (3,) if batched else ()
    x = torch.randn(*lead, 10, 16, generator=g).requires_grad_()
    w = torch.randn(*lead, 24, 16, generator=g).requires_grad_()
    bias = torch.randn(24, generator=g)
    k = evtc.compile(bias_gelu, {"a": x, "b": w.transpose(-1, -2), "bias": bias})
    for run in (lambda x, w: k(x, w.transpose(-1, -2), bias=bias),
                torch.compile(lambda x, w: k(x, w.transpose(-1, -2), bias=bias), backend="aot_eager",
                              fullgraph=True)):
        dx, dw = torch.autograd.grad(run(x, w).square().sum(), [x, w])
        assert dw.is_contiguous() and dx.is_contiguous()
        xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        F.gelu(xr @ wr.transpose(-1, -2) + bias.double()).square().sum().backward()
        _close(dw.double(), wr.grad, "w")
        _close(dx.double(), xr.grad, "x")


def gelu_row_mean_scaled(acc, bias):
    y = F.gelu(acc + bias) * (4.0 / acc.shape[-1])
    return y, y.mean(-1)


@pytest.mark.parametrize("fn", [gelu_row_mean_scaled, swiglu_bias_scaled])
def test_backward_under_dynamic_shapes(fn):
    """torch.compile with dynamic shapes (dynamic=True, or what it switches to when sizes change)
    traces the backward at symbolic sizes: shapes such as N/2 (gated) and literals such as the
    1/N of a mean are computed from SymInts, not by sympy. Gradients at two sizes against
    torch.autograd."""
    g = torch.Generator().manual_seed(4)
    b = torch.randn(16, 32, generator=g, requires_grad=True)
    bias = torch.randn(32, generator=g).requires_grad_()
    extra = {} if fn is gelu_row_mean_scaled else {"scale": None}
    k = evtc.compile(fn, {"a": torch.randn(8, 16), "b": b, "bias": bias,
                          **({"scale": torch.rand(8, 1) + 0.5} if extra else {})})
    compiled = torch.compile(lambda a, b, ops: k(a, b, **ops), backend="aot_eager", fullgraph=True,
                             dynamic=True)
    for m in (8, 13):
        a = torch.randn(m, 16, generator=g, requires_grad=True)
        ops = {"bias": bias, **({"scale": (torch.rand(m, 1, generator=g) + 0.5).requires_grad_()}
                                if extra else {})}
        inputs = [a, b, *ops.values()]
        ys = compiled(a, b, ops)
        ys = ys if isinstance(ys, tuple) else (ys,)
        dys = [torch.randn(y.shape, generator=g) for y in ys]
        mine = torch.autograd.grad(ys, inputs, dys)
        theirs = fn(a @ b, **ops)
        want = torch.autograd.grad(theirs if isinstance(theirs, tuple) else (theirs,), inputs, dys)
        for name, got, ref in zip(["a", "b", *ops], mine, want, strict=True):
            _close(got, ref, f"{name} at M={m}")


@pytest.mark.parametrize("lead", [(), (3,)])
def test_saved_halves_join_into_the_float32_accumulator(lead):
    """A gated kernel saves its accumulator as gate and up halves; the backward reads them side by
    side, in float32: the same values as torch.cat, for 16-bit halves, batched ones and halves that
    are views (the columns of one buffer)."""
    from evtc.runtime.op_autograd import joined_accumulator

    g = torch.Generator().manual_seed(3)
    whole = torch.randn(*lead, 7, 2 * 10, generator=g).to(torch.bfloat16)
    gate, up = whole.chunk(2, dim=-1)  # strided views, not contiguous
    joined = joined_accumulator((gate, up))
    assert joined.dtype == torch.float32
    assert joined.shape == whole.shape
    assert torch.equal(joined, torch.cat([gate, up], dim=-1).float())
    assert torch.equal(whole, torch.cat([gate, up], dim=-1))  # the saved halves are left unchanged
    one = torch.randn(5, 4, generator=g)
    assert joined_accumulator((one,)) is one
