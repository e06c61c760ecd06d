"""Edge cases of the training path on the CPU (evtc's torch path, which the GPU backward mirrors):
gradients of FusedLinear, evtc.linear and MLP against float64 torch autograd for views as inputs,
unused outputs, repeated backwards, a residual that is x itself, first calls of one row and a
float16 accumulator past its range. First written as an adversarial probe of the training path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from training_edges import (
    add_bias_residual,
    add_residual,
    assert_close,
    assert_unchanged,
    bias_gelu,
    gelu_and_row_sum,
    ref_leaf,
    scaled_tile,
    snapshot,
    swiglu_bias,
)

import evtc

TOL = 1e-5  # float32 against float64


def test_noncontiguous_x_and_a_weight_view():
    """A transposed-view 3-D x and a weight that is a slice of a larger parameter: gradients reach
    the bases, which are not modified."""
    torch.manual_seed(0)
    W = torch.randn(64, 40, requires_grad=True)
    b = torch.randn(40, requires_grad=True)
    base = torch.randn(3, 2, 24, requires_grad=True)
    x, w = base.transpose(0, 1), W[:40, :24]
    lin = evtc.linear(bias_gelu, {"x": x.detach(), "weight": w.detach(), "bias": b.detach()})
    before = snapshot(base, W, b)
    y = lin(x, w, bias=b)
    dy = torch.randn_like(y)
    y.backward(dy)
    assert_unchanged(before, [base, W, b])
    Br, Wr, br = ref_leaf(base), ref_leaf(W), ref_leaf(b)
    bias_gelu(Br.transpose(0, 1) @ Wr[:40, :24].t(), br).backward(dy.double())
    for name, t, r in (("x", base, Br), ("W", W, Wr), ("b", b, br)):
        assert_close(t.grad, r.grad, name, TOL)


@pytest.mark.parametrize("used", [0, 1])
def test_several_outputs_one_unused(used):
    """(y, y.sum(-1)) with only one output in the loss: None incoming gradient for the other."""
    torch.manual_seed(1)
    x, w, b = (torch.randn(2, 5, 24, requires_grad=True), torch.randn(40, 24, requires_grad=True),
               torch.randn(40, requires_grad=True))
    lin = evtc.linear(gelu_and_row_sum, {"x": x.detach(), "weight": w.detach(), "bias": b.detach()})
    out = lin(x, w, bias=b)
    weight = torch.randn_like(out[used])
    (out[used] * weight).sum().backward()
    refs = [ref_leaf(t) for t in (x, w, b)]
    (gelu_and_row_sum(refs[0] @ refs[1].t(), refs[2])[used] * weight.double()).sum().backward()
    for name, t, r in zip("xwb", (x, w, b), refs, strict=True):
        assert_close(t.grad, r.grad, name, TOL)


def test_gated_bias_retain_graph_twice():
    """SwiGLU with a wide bias, backward twice with retain_graph: 2x torch's gradients."""
    torch.manual_seed(2)
    layer = evtc.nn.FusedLinear(24, 80, swiglu_bias, bias=True)
    x = torch.randn(2, 3, 24, requires_grad=True)
    y = layer(x)
    dy = torch.randn_like(y)
    y.backward(dy, retain_graph=True)
    y.backward(dy)
    xr, wr, br = ref_leaf(x), ref_leaf(layer.weight), ref_leaf(layer.bias)
    swiglu_bias(xr @ wr.t(), br).backward(2 * dy.double())
    for name, t, r in (("x", x, xr), ("w", layer.weight, wr), ("b", layer.bias, br)):
        assert_close(t.grad, r.grad, name, TOL)


def test_residual_is_x_leaves_the_incoming_gradient_alone():
    """residual=x (N == K): x.grad = dy @ W + dy, accumulated over two steps, dy never modified."""
    torch.manual_seed(3)
    layer = evtc.nn.FusedLinear(24, 24, add_residual, bias=False)
    x = torch.randn(2, 5, 24, requires_grad=True)
    dy = torch.randn(2, 5, 24)
    kept = dy.clone()
    for _ in range(2):
        layer(x, residual=x).backward(dy)
        assert torch.equal(dy, kept)
    xr, wr = ref_leaf(x), ref_leaf(layer.weight)
    (xr @ wr.t() + xr).backward(2 * dy.double())
    assert_close(x.grad, xr.grad, "x", TOL)
    assert_close(layer.weight.grad, wr.grad, "w", TOL)


def test_one_row_first_then_many_trained_tile_and_column():
    """A first call of one row, then 5, then one: trained tile C and per-row scale."""
    torch.manual_seed(4)
    layer = evtc.nn.FusedLinear(24, 40, scaled_tile, bias=False)
    for rows in (1, 5, 1):
        layer.zero_grad(set_to_none=True)
        x, scale, C = (torch.randn(rows, 24, requires_grad=True), torch.randn(rows, 1, requires_grad=True),
                       torch.randn(rows, 40, requires_grad=True))
        y = layer(x, scale=scale, C=C)
        dy = torch.randn_like(y)
        y.backward(dy)
        refs = [ref_leaf(t) for t in (x, layer.weight, scale, C)]
        scaled_tile(refs[0] @ refs[1].t(), refs[2], refs[3]).backward(dy.double())
        for name, t, r in zip(["x", "w", "scale", "C"], (x, layer.weight, scale, C), refs, strict=True):
            assert_close(t.grad, r.grad, f"{name} M={rows}", TOL)


def test_mlp_gated_biases_residual_is_x():
    """MLP(SwiGLU with a wide bias, bias + residual, bias=True) on 3-D x with residual=x."""
    torch.manual_seed(5)
    blk = evtc.nn.MLP(24, 20, swiglu_bias, add_bias_residual, bias=True)
    x = torch.randn(2, 3, 24, requires_grad=True)
    y = blk(x, residual=x)
    dy = torch.randn_like(y)
    y.backward(dy)
    p = {n: ref_leaf(t) for n, t in blk.named_parameters()}
    xr = ref_leaf(x)
    h = swiglu_bias(xr @ p["up.weight"].t(), p["up.bias"])
    add_bias_residual(h @ p["down.weight"].t(), p["down.bias"], xr).backward(dy.double())
    assert_close(x.grad, xr.grad, "x", TOL)
    for n, t in blk.named_parameters():
        assert_close(t.grad, p[n].grad, n, TOL)


def _small_gelu(acc, bias):
    return F.gelu(acc * 1e-3 + bias)


def test_fp16_accumulator_beyond_the_float16_range():
    """float16 x, weight with |x @ w.T| ~ 1e5 and an epilogue that scales it down: finite forward,
    so gradients should be finite and torch's."""
    torch.manual_seed(6)
    x = (torch.randn(4, 64) * 80).half().requires_grad_()
    w = (torch.randn(40, 64) * 80).half().requires_grad_()
    b = torch.randn(40).half().requires_grad_()
    lin = evtc.linear(_small_gelu, {"x": x.detach(), "weight": w.detach(), "bias": b.detach()})
    y = lin(x, w, bias=b)
    assert torch.isfinite(y).all()
    y.float().sum().backward()
    refs = [ref_leaf(t) for t in (x, w, b)]
    _small_gelu(refs[0] @ refs[1].t(), refs[2]).sum().backward()
    for name, t, r in zip("xwb", (x, w, b), refs, strict=True):
        assert_close(t.grad, r.grad, name, 6e-3)
