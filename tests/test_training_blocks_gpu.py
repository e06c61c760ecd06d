"""Edge cases of evtc.nn.MLP, a kernel's own differentiable call, torch.compile(fullgraph=True)
and CUDA-graph capture of training steps, against float64 torch autograd of the same math."""

from __future__ import annotations

import pytest
import torch
from training_edges import (
    TOL,
    add_bias_residual,
    add_residual,
    assert_close,
    assert_unchanged,
    bias_gelu,
    cuda_generator,
    cuda_rand,
    geglu_bias,
    ref_leaf,
    scaled_residual,
    snapshot,
    swiglu,
    swiglu_bias,
)

import evtc

pytestmark = pytest.mark.gpu

DEV = "cuda"

_gen, _rand = cuda_generator, cuda_rand


def _mlp_ref(block, x, activation, output, residual=None):
    """float64 leaves of the block's parameters and x, and the block's output over them."""
    params = {n: ref_leaf(p) for n, p in block.named_parameters()}
    xr = ref_leaf(x)
    acc = xr @ params["up.weight"].t()
    h = activation(acc, params["up.bias"]) if "up.bias" in params else activation(acc)
    out = h @ params["down.weight"].t()
    kw = {}
    if "down.bias" in params:
        kw["bias"] = params["down.bias"]
    if residual is not None:
        kw["residual"] = xr if residual is x else ref_leaf(residual)
    y = output(out, **kw) if output is not None else out
    return y, xr, params, kw.get("residual")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mlp_gated_3d_odd_rows_residual_is_x(dtype):
    """evtc.nn.MLP(64 -> 72 -> 64, SwiGLU, add_residual) on a (3, 7, 64) x with residual=x (odd M,
    hidden 72 not a multiple of 64): output and the gradients of x and both weights equal torch's;
    the fused dZ kernel is built (dZ1 in the epilogue of dZ2 @ W2); x is not modified."""
    g = _gen(21)
    block = evtc.nn.MLP(64, 72, swiglu, add_residual, device=DEV, dtype=dtype)
    x = _rand(3, 7, 64, g=g, dtype=dtype, grad=True)
    before = snapshot(x)
    y = block(x, residual=x)
    dy = _rand(*y.shape, g=g, dtype=dtype)
    y.backward(dy)
    assert_unchanged(before, [x])
    want, xr, params, _ = _mlp_ref(block, x, swiglu, add_residual, residual=x)
    assert_close(y, want, "forward", TOL[dtype])
    want.backward(dy.double())
    assert_close(x.grad, xr.grad, "x", TOL[dtype])
    for n, p in block.named_parameters():
        assert p.grad.dtype == dtype
        assert_close(p.grad, params[n].grad, n, TOL[dtype])
    assert any(v for v in block._dz.values()), "the fused dZ kernel was not built"


@pytest.mark.parametrize("frozen", ["up_bias", "none"])
def test_mlp_gated_bias_both_layers(frozen):
    """evtc.nn.MLP(GeGLU-tanh with a wide bias, add_bias_residual, bias=True) on a 3-D x with a
    separate residual that requires grad; the up layer's bias frozen (fused dZ with the bias as an
    operand) or trained (unfused step): gradients of x, residual and every trained parameter equal
    torch's, frozen ones get none."""
    g = _gen(22)
    dt = torch.bfloat16
    block = evtc.nn.MLP(64, 40, geglu_bias, add_bias_residual, bias=True, device=DEV, dtype=dt)
    if frozen == "up_bias":
        block.up.bias.requires_grad_(False)
    x = _rand(2, 5, 64, g=g, dtype=dt, grad=True)
    r = _rand(2, 5, 64, g=g, dtype=dt, grad=True)
    y = block(x, residual=r)
    dy = _rand(*y.shape, g=g, dtype=dt)
    y.backward(dy)
    want, xr, params, rr = _mlp_ref(block, x, geglu_bias, add_bias_residual, residual=r)
    want.backward(dy.double())
    assert_close(x.grad, xr.grad, "x", TOL[dt])
    assert_close(r.grad, rr.grad, "residual", TOL[dt])
    for n, p in block.named_parameters():
        if p.requires_grad:
            assert_close(p.grad, params[n].grad, n, TOL[dt])
        else:
            assert p.grad is None, n


def test_mlp_frozen_weights_x_without_grad_one_row():
    """evtc.nn.MLP(SwiGLU, add_residual) with the up weight frozen, x without grad and one token
    (M = 1) then 5 tokens: down.weight and the residual get torch's gradients, up.weight none."""
    g = _gen(23)
    dt = torch.bfloat16
    block = evtc.nn.MLP(64, 48, swiglu, add_residual, device=DEV, dtype=dt)
    block.up.weight.requires_grad_(False)
    for rows in (1, 5):
        block.zero_grad(set_to_none=True)
        x = _rand(rows, 64, g=g, dtype=dt)
        r = _rand(rows, 64, g=g, dtype=dt, grad=True)
        y = block(x, residual=r)
        dy = _rand(*y.shape, g=g, dtype=dt)
        y.backward(dy)
        assert block.up.weight.grad is None
        want, xr, params, rr = _mlp_ref(block, x, swiglu, add_residual, residual=r)
        want.backward(dy.double())
        assert_close(block.down.weight.grad, params["down.weight"].grad, f"down.weight (M={rows})", TOL[dt])
        assert_close(r.grad, rr.grad, f"residual (M={rows})", TOL[dt])


def test_kernel_call_with_views_and_a_batched_a():
    """A compiled kernel's own call k(a, b, bias=...) is differentiable: (1) a = A.t() (an M-major
    view) and b = W.t() (K-major) with bias trained; (2) a batched (L, M, K) a beside a shared b
    with bias trained (the reference's sum over batches). Gradients equal torch's."""
    g = _gen(24)
    dt = torch.bfloat16
    A = _rand(64, 24, g=g, dtype=dt, grad=True)
    W = _rand(48, 64, g=g, dtype=dt, scale=0.125, grad=True)
    bias = _rand(48, g=g, dtype=torch.float32, grad=True)
    k = evtc.compile(bias_gelu, {"a": A.detach().t().contiguous(), "b": W.detach().t(),
                                 "bias": bias.detach()})
    y = k(A.t(), W.t(), bias=bias)
    dy = _rand(*y.shape, g=g, dtype=dt)
    y.backward(dy)
    refs = [ref_leaf(t) for t in (A, W, bias)]
    bias_gelu(refs[0].t() @ refs[1].t(), refs[2]).backward(dy.double())
    for name, t, r in zip(["A", "W", "bias"], (A, W, bias), refs, strict=True):
        assert_close(t.grad, r.grad, f"{name} (views)", TOL[dt])

    a = _rand(3, 17, 64, g=g, dtype=dt, grad=True)
    W.grad = bias.grad = None
    kb = evtc.compile(bias_gelu, {"a": a.detach(), "b": W.detach().t(), "bias": bias.detach()})
    y = kb(a, W.t(), bias=bias)
    dy = _rand(*y.shape, g=g, dtype=dt)
    y.backward(dy)
    refs = [ref_leaf(t) for t in (a, W, bias)]
    bias_gelu(refs[0] @ refs[1].t(), refs[2]).backward(dy.double())
    for name, t, r in zip(["a", "W", "bias"], (a, W, bias), refs, strict=True):
        assert_close(t.grad, r.grad, f"{name} (batched)", TOL[dt])


class _Net(torch.nn.Module):
    def __init__(self, dt):
        super().__init__()
        kw = {"device": DEV, "dtype": dt}
        self.first = evtc.nn.FusedLinear(64, 96, swiglu_bias, **kw)   # gated, wide bias
        self.second = evtc.nn.FusedLinear(48, 64, add_residual, bias=False, **kw)
        self.first.weight.requires_grad_(False)                       # frozen base weight

    def forward(self, x):
        return self.second(self.first(x), residual=x)


def test_torch_compile_fullgraph_of_fused_linears_3d():
    """torch.compile(fullgraph=True) (inductor) of two FusedLinear layers (gated SwiGLU with a wide
    trained bias and a frozen weight, then a residual of x) on 3-D x, after one eager step: the
    compiled step's gradients equal the eager step's and torch's, at two token counts."""
    g = _gen(25)
    dt = torch.bfloat16
    net = _Net(dt)
    x0 = _rand(2, 6, 64, g=g, dtype=dt, grad=True)
    net(x0).backward(_rand(2, 6, 64, g=g, dtype=dt))  # eager warm-up: builds kernels and twins
    compiled = torch.compile(net, fullgraph=True)
    for lead in ((2, 6), (3, 5)):
        net.zero_grad(set_to_none=True)
        x = _rand(*lead, 64, g=g, dtype=dt, grad=True)
        dy = _rand(*lead, 64, g=g, dtype=dt)
        compiled(x).backward(dy)
        got = [x.grad, net.first.bias.grad, net.second.weight.grad]
        xr = ref_leaf(x)
        w1, b1, w2 = ref_leaf(net.first.weight), ref_leaf(net.first.bias), ref_leaf(net.second.weight)
        want = swiglu_bias(xr @ w1.t(), b1) @ w2.t() + xr
        want.backward(dy.double())
        assert net.first.weight.grad is None
        for name, a, b in zip(["x", "first.bias", "second.weight"], got, [xr.grad, b1.grad, w2.grad],
                              strict=True):
            assert_close(a, b, f"{name} (compiled)", TOL[dt])


def test_torch_compile_fullgraph_of_an_mlp_with_trained_biases():
    """torch.compile(fullgraph=True) of evtc.nn.MLP(SwiGLU with a wide bias, add_bias_residual,
    bias=True) on a 3-D x with residual=x, after an eager step: gradients of x and every parameter
    equal torch's."""
    g = _gen(26)
    dt = torch.bfloat16
    block = evtc.nn.MLP(64, 40, swiglu_bias, add_bias_residual, bias=True, device=DEV, dtype=dt)
    x0 = _rand(2, 5, 64, g=g, dtype=dt, grad=True)
    block(x0, residual=x0).backward(_rand(2, 5, 64, g=g, dtype=dt))
    compiled = torch.compile(lambda x: block(x, residual=x), fullgraph=True)
    block.zero_grad(set_to_none=True)
    x = _rand(2, 5, 64, g=g, dtype=dt, grad=True)
    dy = _rand(2, 5, 64, g=g, dtype=dt)
    y = compiled(x)
    y.backward(dy)
    want, xr, params, _ = _mlp_ref(block, x, swiglu_bias, add_bias_residual, residual=x)
    assert_close(y, want, "forward", TOL[dt])
    want.backward(dy.double())
    assert_close(x.grad, xr.grad, "x", TOL[dt])
    for n, p in block.named_parameters():
        assert_close(p.grad, params[n].grad, n, TOL[dt])


def test_cuda_graph_step_with_trained_operands():
    """A training step of evtc.linear(silu(acc * scale + C) * s * alpha) with the per-row scale, the
    tile C and the 0-d scalar s all trained, captured whole in a CUDA graph after eager warm-up on
    a side stream, replayed on new inputs: the replayed gradients equal torch's for those inputs."""
    g = _gen(27)
    dt = torch.bfloat16
    w = _rand(48, 64, g=g, dtype=dt, scale=0.125, grad=True)
    s = torch.tensor(0.8, device=DEV, requires_grad=True)
    static = {"x": _rand(40, 64, g=g, dtype=dt, grad=True),
              "scale": _rand(40, 1, g=g, dtype=torch.float32, grad=True),
              "C": _rand(40, 48, g=g, dtype=dt, grad=True), "dy": _rand(40, 48, g=g, dtype=dt)}
    lin = evtc.linear(scaled_residual, {"x": static["x"].detach(), "weight": w.detach(),
                                        "scale": static["scale"].detach(), "C": static["C"].detach(),
                                        "s": s.detach(), "alpha": 0.5})
    leaves = [static["x"], w, static["scale"], static["C"], s]

    def step():
        for t in leaves:
            t.grad = None
        lin(static["x"], w, scale=static["scale"], C=static["C"], s=s, alpha=0.5).backward(static["dy"])

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    for t in leaves:
        t.grad = None
    with torch.cuda.graph(graph):
        lin(static["x"], w, scale=static["scale"], C=static["C"], s=s, alpha=0.5).backward(static["dy"])
    grads = [t.grad for t in leaves]
    for seed in (28, 29):
        gi = _gen(seed)
        with torch.no_grad():
            for name in ("x", "scale", "C", "dy"):
                static[name].copy_(torch.randn(static[name].shape, device=DEV, generator=gi))
        for t in grads:
            t.zero_()
        graph.replay()
        torch.cuda.synchronize()
        refs = [ref_leaf(t) for t in leaves]
        scaled_residual(refs[0] @ refs[1].t(), refs[2], refs[3], refs[4], 0.5).backward(static["dy"].double())
        for name, got, r in zip(["x", "weight", "scale", "C", "s"], grads, refs, strict=True):
            assert_close(got, r.grad, f"{name} (replay {seed})", TOL[dt])
