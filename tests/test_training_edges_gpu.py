"""Edge cases of a layer seen alone, on the GPU: evtc.nn.FusedLinear and the differentiable evtc.linear
(forward through the fused kernel and its accumulator-saving twin; backward through the dZ pass
or the reference), each against float64 torch autograd of the same math."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from training_edges import (
    TOL,
    add_residual,
    assert_close,
    assert_unchanged,
    bias_gelu,
    cuda_generator,
    cuda_rand,
    gelu_and_row_sum,
    ref_leaf,
    scaled_residual,
    scaled_tile,
    snapshot,
    stats,
    swiglu,
    swiglu_bias,
)

import evtc

pytestmark = pytest.mark.gpu

DEV = "cuda"

_gen, _rand = cuda_generator, cuda_rand


def _layer_ref(layer, x, fn):
    """float64 leaves of x, weight, bias and the reference output of ``fn`` over them."""
    xr, wr = ref_leaf(x), ref_leaf(layer.weight)
    br = ref_leaf(layer.bias) if layer.bias is not None else None
    acc = xr @ wr.t()
    y = fn(acc, br) if br is not None else fn(acc)
    return y, xr, wr, br


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_noncontiguous_3d_x_odd_rows_unaligned_width(dtype):
    """A (B, S, K) x that is a transposed view of a (S, B, K) tensor, 21 rows, out_features 36 (row
    pitch 72 bytes, not 16-byte aligned) and in_features 40: FusedLinear(bias + GELU) gives torch's
    gradients for x, weight and bias, and leaves x's storage untouched (claims: any leading dims,
    layouts TMA cannot read run on copies, the dZ pass with a trained bias)."""
    g = _gen(1)
    layer = evtc.nn.FusedLinear(40, 36, bias_gelu, device=DEV, dtype=dtype)
    base = _rand(7, 3, 40, g=g, dtype=dtype, grad=True)
    x = base.transpose(0, 1)  # (3, 7, 40), not contiguous
    before = snapshot(base, layer.weight, layer.bias)
    y = layer(x)
    assert y.shape == (3, 7, 36)
    dy = _rand(3, 7, 36, g=g, dtype=dtype)
    y.backward(dy)
    assert_unchanged(before, [base, layer.weight, layer.bias])
    want, xr, wr, br = _layer_ref(layer, x, bias_gelu)
    assert_close(y, want, "forward", TOL[dtype])
    want.backward(dy.double())
    tol = TOL[dtype]
    assert_close(base.grad, xr.grad.transpose(0, 1), "x (through the transposed view)", tol)
    assert_close(layer.weight.grad, wr.grad, "weight", tol)
    assert_close(layer.bias.grad, br.grad, "bias", tol)
    assert layer.weight.grad.dtype == dtype and layer.bias.grad.dtype == dtype


def test_frozen_weight_trained_wide_bias_x_without_grad():
    """Gated SwiGLU with a bias as wide as the GEMM (hidden 40, not a multiple of 64), weight frozen
    (requires_grad=False) and x without grad: only the bias gets a gradient, equal to torch's (the
    dZ pass's wide operand, its halves' column sums joined); the weight gets none."""
    g = _gen(2)
    layer = evtc.nn.FusedLinear(64, 80, swiglu_bias, device=DEV, dtype=torch.bfloat16)
    layer.weight.requires_grad_(False)
    x = _rand(2, 9, 64, g=g, dtype=torch.bfloat16)
    y = layer(x)
    assert y.shape == (2, 9, 40) and y.requires_grad
    dy = _rand(2, 9, 40, g=g, dtype=torch.bfloat16)
    y.backward(dy)
    assert layer.weight.grad is None
    want, xr, wr, br = _layer_ref(layer, x, swiglu_bias)
    want.backward(dy.double())
    assert_close(layer.bias.grad, br.grad, "wide bias", TOL[torch.bfloat16])


@pytest.mark.parametrize("trained", ["all", "scale_only"])
def test_row_scale_tile_scalar_and_float_operands(trained):
    """silu(acc * scale + C) * s * alpha with a per-row (B, S, 1) scale, a (B, S, N) tile C, a 0-d
    float32 scalar s and a Python float alpha: each tensor operand that requires grad gets torch's
    gradient in its own shape and dtype ('all': x, weight, scale, C, s; 'scale_only': x and weight
    frozen, only the scale trained); operands are not modified."""
    g = _gen(3)
    dt = torch.bfloat16
    everything = trained == "all"
    x = _rand(2, 5, 64, g=g, dtype=dt, grad=everything)
    w = _rand(48, 64, g=g, dtype=dt, scale=64 ** -0.5, grad=everything)
    scale = _rand(2, 5, 1, g=g, dtype=torch.float32, grad=True)
    C = _rand(2, 5, 48, g=g, dtype=dt, grad=everything)
    s = torch.tensor(1.25, device=DEV, requires_grad=everything)
    lin = evtc.linear(scaled_residual, {"x": x.detach(), "weight": w.detach(), "scale": scale.detach(),
                                        "C": C.detach(), "s": s.detach(), "alpha": 0.5})
    before = snapshot(x, w, scale, C, s)
    y = lin(x, w, scale=scale, C=C, s=s, alpha=0.75)
    dy = _rand(*y.shape, g=g, dtype=dt)
    y.backward(dy)
    assert_unchanged(before, [x, w, scale, C, s])
    refs = [ref_leaf(t) for t in (x, w, scale, C, s)]
    want = scaled_residual(refs[0] @ refs[1].t(), refs[2], refs[3], refs[4], 0.75)
    assert_close(y, want, "forward", TOL[dt])
    want.backward(dy.double())
    for name, t, r in zip(["x", "weight", "scale", "C", "s"], (x, w, scale, C, s), refs, strict=True):
        if t.requires_grad:
            assert t.grad is not None and t.grad.dtype == t.dtype and t.grad.shape == t.shape, name
            assert_close(t.grad, r.grad, name, TOL[dt])
        else:
            assert t.grad is None, name


@pytest.mark.parametrize("used", ["tile", "row_sum"])
def test_several_outputs_with_one_unused(used):
    """An epilogue returning (y, y.sum(-1)) on a 3-D x where the loss uses only one output (the
    other's incoming gradient is None): gradients of x, weight and bias equal torch's."""
    g = _gen(4)
    dt = torch.bfloat16
    x = _rand(3, 5, 64, g=g, dtype=dt, grad=True)
    w = _rand(40, 64, g=g, dtype=dt, scale=64 ** -0.5, grad=True)
    b = _rand(40, g=g, dtype=dt, grad=True)
    lin = evtc.linear(gelu_and_row_sum, {"x": x.detach(), "weight": w.detach(), "bias": b.detach()})
    y, rows = lin(x, w, bias=b)
    assert rows.shape == (3, 5)
    weights = torch.linspace(-1, 1, 15, device=DEV).view(3, 5)
    dy = _rand(3, 5, 40, g=g, dtype=dt)
    loss = (y.float() * dy.float()).sum() if used == "tile" else (rows.float() * weights).sum()
    loss.backward()
    refs = [ref_leaf(t) for t in (x, w, b)]
    yr, rr = gelu_and_row_sum(refs[0] @ refs[1].t(), refs[2])
    lr = (yr * dy.double()).sum() if used == "tile" else (rr * weights.double()).sum()
    lr.backward()
    for name, t, r in zip(["x", "weight", "bias"], (x, w, b), refs, strict=True):
        assert_close(t.grad, r.grad, f"{name} ({used} used)", TOL[dt])


def test_dict_outputs_row_mean_only_in_the_loss():
    """A dict of a tile, a row mean and a row sum of squares over a 3-D x, with a residual that
    requires grad; the loss reads only the mean: gradients of x, weight, bias and residual equal
    torch's (the mean's 1/N is the forward's N)."""
    g = _gen(5)
    dt = torch.bfloat16
    x = _rand(2, 7, 64, g=g, dtype=dt, grad=True)
    w = _rand(56, 64, g=g, dtype=dt, scale=64 ** -0.5, grad=True)
    b = _rand(56, g=g, dtype=dt, grad=True)
    r = _rand(2, 7, 56, g=g, dtype=dt, grad=True)
    lin = evtc.linear(stats, {"x": x.detach(), "weight": w.detach(), "bias": b.detach(),
                              "residual": r.detach()})
    out = lin(x, w, bias=b, residual=r)
    assert out["mean"].shape == (2, 7) and out["sq"].shape == (2, 7)
    weights = torch.linspace(-2, 2, 14, device=DEV).view(2, 7)
    (out["mean"].float() * weights).sum().backward()
    refs = [ref_leaf(t) for t in (x, w, b, r)]
    o = stats(refs[0] @ refs[1].t(), refs[2], refs[3])
    assert_close(out["mean"], o["mean"], "mean forward", TOL[dt])
    (o["mean"] * weights.double()).sum().backward()
    for name, t, ref in zip(["x", "weight", "bias", "residual"], (x, w, b, r), refs, strict=True):
        assert_close(t.grad, ref.grad, name, TOL[dt])


def test_retain_graph_twice_then_accumulate_a_second_step():
    """SwiGLU FusedLinear (no bias), 3-D x: backward twice through one graph with retain_graph,
    then a second forward/backward, all accumulating into .grad: the totals are 3x torch's
    gradients (no buffer of one backward reused by the next, no gradient aliased to another)."""
    g = _gen(6)
    dt = torch.bfloat16
    layer = evtc.nn.FusedLinear(64, 96, swiglu, bias=False, device=DEV, dtype=dt)
    x = _rand(2, 11, 64, g=g, dtype=dt, grad=True)
    dy = _rand(2, 11, 48, g=g, dtype=dt)
    y = layer(x)
    y.backward(dy, retain_graph=True)
    first_w = layer.weight.grad.clone()
    y.backward(dy)
    layer(x).backward(dy)
    want, xr, wr, _ = _layer_ref(layer, x, swiglu)
    want.backward(dy.double())
    assert_close(first_w, wr.grad, "weight after one backward", TOL[dt])
    assert_close(layer.weight.grad, 3 * wr.grad, "weight after three", TOL[dt])
    assert_close(x.grad, 3 * xr.grad, "x after three", TOL[dt])


def test_gradients_of_one_step_are_not_overwritten_by_the_next():
    """The bias gradient the dZ pass computes (a column reduction) and the weight gradient of step 1
    are tensors of their own: a second step with other inputs (after zero_grad(set_to_none=True))
    leaves the tensors step 1 produced unchanged (no reused workspace or scratch buffer behind
    them)."""
    g = _gen(7)
    dt = torch.bfloat16
    layer = evtc.nn.FusedLinear(64, 72, bias_gelu, device=DEV, dtype=dt)
    x1 = _rand(33, 64, g=g, dtype=dt, grad=True)
    layer(x1).backward(_rand(33, 72, g=g, dtype=dt))
    g_bias, g_weight, g_x = layer.bias.grad, layer.weight.grad, x1.grad
    kept = snapshot(g_bias, g_weight, g_x)
    layer.zero_grad(set_to_none=True)
    x2 = _rand(33, 64, g=g, dtype=dt, scale=3.0, grad=True)
    layer(x2).backward(_rand(33, 72, g=g, dtype=dt))
    if DEV == "cuda":
        torch.cuda.synchronize()
    assert_unchanged(kept, [g_bias, g_weight, g_x], "gradient of step 1")


def test_residual_is_x_and_the_incoming_gradient_is_left_alone():
    """FusedLinear(add_residual) with residual=x (N == K): x.grad = dy @ W + dy, the caller's dy is
    not modified by the accumulation, and a second step accumulates to twice the gradient; also for
    the expanded incoming gradient of y.sum()."""
    g = _gen(8)
    dt = torch.bfloat16
    layer = evtc.nn.FusedLinear(64, 64, add_residual, bias=False, device=DEV, dtype=dt)
    x = _rand(3, 5, 64, g=g, dtype=dt, grad=True)
    dy = _rand(3, 5, 64, g=g, dtype=dt)
    kept = dy.clone()
    layer(x, residual=x).backward(dy)
    assert torch.equal(dy, kept), "the incoming gradient was modified"
    layer(x, residual=x).backward(dy)
    assert torch.equal(dy, kept), "the incoming gradient was modified"
    xr, wr = ref_leaf(x), ref_leaf(layer.weight)
    (xr @ wr.t() + xr).backward(2 * dy.double())
    assert_close(x.grad, xr.grad, "x (twice)", TOL[dt])
    assert_close(layer.weight.grad, wr.grad, "weight (twice)", TOL[dt])
    x.grad = None
    layer(x, residual=x).sum().backward()
    xr.grad = None
    (xr @ wr.t() + xr).sum().backward()
    assert_close(x.grad, xr.grad, "x (y.sum())", TOL[dt])


def test_one_row_odd_rows_and_a_decode_step():
    """One FusedLinear(bias + GELU) called with x of (77, K), (1, K), (1, 1, K), (K,), (3, 1, K) and
    an M-major (77, K) view (X.t()): each call's gradients equal torch's (a one-row call is served by
    its own or another key's kernel; an M-major x runs on a copy)."""
    g = _gen(9)
    dt = torch.bfloat16
    layer = evtc.nn.FusedLinear(64, 40, bias_gelu, device=DEV, dtype=dt)
    for shape in [(77, 64), (1, 64), (1, 1, 64), (64,), (3, 1, 64), "m-major"]:
        layer.zero_grad(set_to_none=True)
        if shape == "m-major":
            shape = (77, 64)
            x = _rand(64, 77, g=g, dtype=dt).t().requires_grad_()
        else:
            x = _rand(*shape, g=g, dtype=dt, grad=True)
        y = layer(x)
        assert y.shape == (*shape[:-1], 40)
        dy = _rand(*y.shape, g=g, dtype=dt)
        y.backward(dy)
        want, xr, wr, br = _layer_ref(layer, x, bias_gelu)
        want.backward(dy.double())
        for name, got, ref in (("x", x.grad, xr.grad), ("weight", layer.weight.grad, wr.grad),
                               ("bias", layer.bias.grad, br.grad)):
            assert_close(got, ref, f"{name} at x {shape}", TOL[dt])


def test_weight_as_a_strided_view_of_a_larger_parameter():
    """evtc.linear with weight = P[:40, 8:72] (a view with a row pitch of the larger parameter) and
    a bias that is a non-leaf view (p[10:50] * 2), float16: P and p get torch's gradients (zeros
    outside the view), and neither is modified."""
    g = _gen(10)
    dt = torch.float16
    P = _rand(48, 80, g=g, dtype=dt, scale=0.125, grad=True)
    p = _rand(64, g=g, dtype=dt, grad=True)
    x = _rand(4, 6, 64, g=g, dtype=dt, grad=True)
    w, b = P[:40, 8:72], p[10:50] * 2
    lin = evtc.linear(bias_gelu, {"x": x.detach(), "weight": w.detach(), "bias": b.detach()})
    before = snapshot(P, p, x)
    y = lin(x, w, bias=b)
    dy = _rand(*y.shape, g=g, dtype=dt)
    y.backward(dy)
    assert_unchanged(before, [P, p, x])
    Pr, pr, xr = ref_leaf(P), ref_leaf(p), ref_leaf(x)
    want = bias_gelu(xr @ Pr[:40, 8:72].t(), pr[10:50] * 2)
    assert_close(y, want, "forward", TOL[dt])
    want.backward(dy.double())
    assert_close(P.grad, Pr.grad, "P", TOL[dt])
    assert_close(p.grad, pr.grad, "p", TOL[dt])
    assert_close(x.grad, xr.grad, "x", TOL[dt])


def test_non_contiguous_incoming_gradient():
    """The loss reads y through a transpose ((y.transpose(0, 1) * z).sum()), so the incoming
    gradient is a non-contiguous view; with a trained bias and 3-D x (dZ pass with a reduction):
    gradients equal torch's."""
    g = _gen(11)
    dt = torch.bfloat16
    layer = evtc.nn.FusedLinear(64, 48, bias_gelu, device=DEV, dtype=dt)
    x = _rand(4, 6, 64, g=g, dtype=dt, grad=True)
    z = _rand(6, 4, 48, g=g, dtype=torch.float32)
    (layer(x).transpose(0, 1).float() * z).sum().backward()
    want, xr, wr, br = _layer_ref(layer, x, bias_gelu)
    (want.transpose(0, 1) * z.double()).sum().backward()
    for name, got, ref in (("x", x.grad, xr.grad), ("weight", layer.weight.grad, wr.grad),
                           ("bias", layer.bias.grad, br.grad)):
        assert_close(got, ref, name, TOL[dt])


def test_no_grad_inference_mode_then_training():
    """Calls under torch.no_grad() and torch.inference_mode() give the training call's values and no
    graph; a training call afterwards (which builds the twin) gives torch's gradients."""
    g = _gen(12)
    dt = torch.bfloat16
    layer = evtc.nn.FusedLinear(64, 96, swiglu_bias, device=DEV, dtype=dt)
    x = _rand(5, 64, g=g, dtype=dt, grad=True)
    with torch.no_grad():
        a = layer(x)
    with torch.inference_mode():
        b = layer(x.detach())
    assert a.grad_fn is None and not a.requires_grad and b.is_inference()
    y = layer(x)
    assert torch.equal(a, y.detach()) and torch.equal(b, y.detach())
    dy = _rand(*y.shape, g=g, dtype=dt)
    y.backward(dy)
    want, xr, wr, br = _layer_ref(layer, x, swiglu_bias)
    want.backward(dy.double())
    for name, got, ref in (("x", x.grad, xr.grad), ("weight", layer.weight.grad, wr.grad),
                           ("bias", layer.bias.grad, br.grad)):
        assert_close(got, ref, name, TOL[dt])


def test_autocast_float32_master_weights_gated_bias_3d():
    """float32 FusedLinear(SwiGLU with a wide bias) under torch.autocast('cuda', bfloat16) on a
    float32 3-D x: bf16 output, float32 gradients for x, weight and bias equal to torch's of the
    same math on bf16-rounded operands."""
    g = _gen(13)
    layer = evtc.nn.FusedLinear(64, 112, swiglu_bias, device=DEV)
    x = _rand(3, 7, 64, g=g, dtype=torch.float32, grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    dy = _rand(*y.shape, g=g, dtype=torch.bfloat16)
    y.backward(dy)
    xr = x.detach().bfloat16().double().requires_grad_()
    wr = layer.weight.detach().bfloat16().double().requires_grad_()
    br = layer.bias.detach().bfloat16().double().requires_grad_()
    swiglu_bias(xr @ wr.t(), br).backward(dy.double())
    for name, got, ref in (("x", x.grad, xr.grad), ("weight", layer.weight.grad, wr.grad),
                           ("bias", layer.bias.grad, br.grad)):
        assert got.dtype == torch.float32, name
        assert_close(got, ref, name, TOL[torch.bfloat16])


@pytest.mark.parametrize("tf32", [False, True])
def test_float32_module_on_the_gpu(tf32):
    """A float32 FusedLinear(bias + GELU) on the GPU, with torch's tf32 setting off (torch path) and
    on (the tf32 kernel and its twin): gradients equal float64 torch's within float32 / tf32
    precision."""
    g = _gen(14)
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        layer = evtc.nn.FusedLinear(64, 48, bias_gelu, device=DEV)
        x = _rand(2, 9, 64, g=g, dtype=torch.float32, grad=True)
        y = layer(x)
        dy = _rand(*y.shape, g=g, dtype=torch.float32)
        y.backward(dy)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    want, xr, wr, br = _layer_ref(layer, x, bias_gelu)
    tol = 1e-2 if tf32 else 1e-4
    assert_close(y, want, "forward", tol)
    want.backward(dy.double())
    for name, got, ref in (("x", x.grad, xr.grad), ("weight", layer.weight.grad, wr.grad),
                           ("bias", layer.bias.grad, br.grad)):
        assert got.dtype == torch.float32
        assert_close(got, ref, name, tol)


def test_copies_and_moves_of_a_used_module():
    """A FusedLinear used on the CPU in float32, then deepcopied, saved/loaded through state_dict,
    and moved with .to('cuda', bfloat16) / .half(): each copy trains on the GPU with torch's
    gradients, and the original's parameters are untouched by the copies' steps."""
    g = _gen(15)
    cpu = evtc.nn.FusedLinear(64, 40, bias_gelu)
    cpu(torch.randn(3, 64)).sum().backward()  # used on the CPU first
    kept = snapshot(cpu.weight, cpu.bias)
    buf = io.BytesIO()
    torch.save(cpu.state_dict(), buf)
    buf.seek(0)
    loaded = evtc.nn.FusedLinear(64, 40, bias_gelu)
    loaded.load_state_dict(torch.load(buf))
    variants = [("deepcopy bf16", copy.deepcopy(cpu).to(DEV, torch.bfloat16), torch.bfloat16),
                ("state_dict bf16", loaded.to(DEV).bfloat16(), torch.bfloat16),
                ("deepcopy half", copy.deepcopy(cpu).cuda().half(), torch.float16)]
    for what, layer, dt in variants:
        layer.zero_grad(set_to_none=True)
        x = _rand(2, 5, 64, g=g, dtype=dt, grad=True)
        y = layer(x)
        dy = _rand(*y.shape, g=g, dtype=dt)
        y.backward(dy)
        want, xr, wr, br = _layer_ref(layer, x, bias_gelu)
        want.backward(dy.double())
        for name, got, ref in (("x", x.grad, xr.grad), ("weight", layer.weight.grad, wr.grad),
                               ("bias", layer.bias.grad, br.grad)):
            assert got.dtype == dt, f"{what}: {name}"
            assert_close(got, ref, f"{what}: {name}", TOL[dt])
    assert_unchanged(kept, [cpu.weight, cpu.bias], "original parameter")


def test_out_dtypes_float32_recomputes_the_accumulator():
    """FusedLinear(bias + GELU, out_dtypes=float32) on bf16 parameters: float32 output, and the
    backward (which recomputes x @ W^T, no twin) gives torch's gradients."""
    g = _gen(16)
    dt = torch.bfloat16
    layer = evtc.nn.FusedLinear(64, 48, bias_gelu, device=DEV, dtype=dt, out_dtypes=torch.float32)
    x = _rand(3, 7, 64, g=g, dtype=dt, grad=True)
    y = layer(x)
    assert y.dtype == torch.float32
    dy = _rand(*y.shape, g=g, dtype=torch.float32)
    y.backward(dy)
    want, xr, wr, br = _layer_ref(layer, x, bias_gelu)
    want.backward(dy.double())
    for name, got, ref in (("x", x.grad, xr.grad), ("weight", layer.weight.grad, wr.grad),
                           ("bias", layer.bias.grad, br.grad)):
        assert got.dtype == dt
        assert_close(got, ref, name, TOL[dt])


def test_one_row_first_then_many_with_trained_tile_and_column():
    """FusedLinear(silu(acc * scale + C)) whose first call has one row (its kernels compiled from a
    one-row example, where a (1, N) tile and a (1, 1) column are vectors), then 5 rows, then one
    again, with x, weight, the per-row scale and the tile C all trained: every call's gradients
    equal torch's."""
    g = _gen(17)
    dt = torch.bfloat16
    layer = evtc.nn.FusedLinear(64, 40, scaled_tile, bias=False, device=DEV, dtype=dt)
    for rows in (1, 5, 1):
        layer.zero_grad(set_to_none=True)
        x = _rand(rows, 64, g=g, dtype=dt, grad=True)
        scale = _rand(rows, 1, g=g, dtype=torch.float32, grad=True)
        C = _rand(rows, 40, g=g, dtype=dt, grad=True)
        y = layer(x, scale=scale, C=C)
        dy = _rand(*y.shape, g=g, dtype=dt)
        y.backward(dy)
        refs = [ref_leaf(t) for t in (x, layer.weight, scale, C)]
        scaled_tile(refs[0] @ refs[1].t(), refs[2], refs[3]).backward(dy.double())
        for name, t, r in zip(["x", "weight", "scale", "C"], (x, layer.weight, scale, C), refs, strict=True):
            assert_close(t.grad, r.grad, f"{name} (M={rows})", TOL[dt])


def test_operand_broadcast_over_the_sequence_dim():
    """evtc.linear(silu(acc * scale + C)) on x of (B, S, K) with a per-batch row C of (B, 1, N) and a
    scale of (S, 1), both trained (expanded over x's leading dims for the kernel): their gradients
    are torch's sums over the broadcast dims, in their own shapes."""
    g = _gen(18)
    dt = torch.bfloat16
    x = _rand(2, 6, 64, g=g, dtype=dt, grad=True)
    w = _rand(40, 64, g=g, dtype=dt, scale=0.125, grad=True)
    scale = _rand(6, 1, g=g, dtype=torch.float32, grad=True)
    C = _rand(2, 1, 40, g=g, dtype=dt, grad=True)
    lin = evtc.linear(scaled_tile, {"x": x.detach(), "weight": w.detach(), "scale": scale.detach(),
                                    "C": C.detach()})
    y = lin(x, w, scale=scale, C=C)
    dy = _rand(*y.shape, g=g, dtype=dt)
    y.backward(dy)
    refs = [ref_leaf(t) for t in (x, w, scale, C)]
    scaled_tile(refs[0] @ refs[1].t(), refs[2], refs[3]).backward(dy.double())
    for name, t, r in zip(["x", "weight", "scale", "C"], (x, w, scale, C), refs, strict=True):
        assert t.grad.shape == t.shape, name
        assert_close(t.grad, r.grad, name, TOL[dt])


def _small_gelu(acc, bias):
    return F.gelu(acc * 1e-3 + bias)


def test_fp16_accumulator_beyond_the_float16_range_scaled_down():
    """float16 x and weight whose product reaches |acc| ~ 1e5 (beyond float16's 65504), epilogue
    gelu(acc * 1e-3 + bias). The forward is finite (the epilogue runs on the float32 accumulator,
    rounding only its output), so the gradients are finite and equal torch's float64 ones; the
    saving twin stored the accumulator in float16 (inf), which made evtc.linear's gradients NaN.
    The kernel's own call k(a, b) (dZ from the recomputed float32 accumulator) is checked too."""
    g = _gen(19)
    dt = torch.float16
    x = _rand(16, 64, g=g, dtype=dt, scale=80.0, grad=True)
    w = _rand(40, 64, g=g, dtype=dt, scale=80.0, grad=True)
    b = _rand(40, g=g, dtype=dt, grad=True)
    assert (x.float() @ w.float().t()).abs().max() > 65504
    k = evtc.compile(_small_gelu, {"a": x.detach(), "b": w.detach().t(), "bias": b.detach()})
    yk = k(x, w.t(), bias=b)
    dy = _rand(*yk.shape, g=g, dtype=dt)
    refs = [ref_leaf(t) for t in (x, w, b)]
    want = _small_gelu(refs[0] @ refs[1].t(), refs[2])
    want.backward(dy.double())
    got_k = torch.autograd.grad(yk, [x, w, b], dy)
    lin = evtc.linear(_small_gelu, {"x": x.detach(), "weight": w.detach(), "bias": b.detach()})
    y = lin(x, w, bias=b)
    assert_close(y, want, "forward (finite)", TOL[dt])
    got = torch.autograd.grad(y, [x, w, b], dy)
    failures = []
    for what, grads in (("k(a, b)", got_k), ("evtc.linear", got)):
        for name, t, r in zip(["x", "weight", "bias"], grads, refs, strict=True):
            try:
                assert_close(t, r.grad, f"{what}: {name}", TOL[dt])
            except AssertionError as exc:
                failures.append(str(exc).splitlines()[0])
    assert not failures, "; ".join(failures)
