"""GPU: evtc.nn.MLP's fused backward (the first layer's dZ in the epilogue of the GEMM dZ2 @ W2)
against torch.autograd of the same block in float32, compared by norm, and against the unfused
backward of the same block."""

from __future__ import annotations

import pytest
import torch
from mlp_cases import (
    add_residual,
    bias_gelu,
    compiled_step,
    geglu_tanh,
    relu_squared,
    residual_bias,
    swiglu,
    swiglu_bias,
)

import evtc

pytestmark = pytest.mark.gpu


def _norm_error(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)).item()


def _reference(block, x, activation, output, operands):
    """The block in float32 through torch ops, on float32 copies of its parameters."""
    params = {name: p.detach().float().requires_grad_() for name, p in block.named_parameters()}
    xr = x.detach().float().requires_grad_()
    acc = xr @ params["up.weight"].t()
    h = activation(acc, params["up.bias"]) if "up.bias" in params else activation(acc)
    out = h @ params["down.weight"].t()
    kw = {k: (xr if v is x else v.float()) for k, v in operands.items()}
    if "down.bias" in params:
        kw["bias"] = params["down.bias"]
    y = output(out, **kw) if output is not None else out
    return y, xr, params


def _run(block, activation, output, lead, in_features, seed=0, freeze_bias=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    if freeze_bias:
        for p in (block.up.bias, block.down.bias):
            p.requires_grad_(False)
    x = (torch.randn(*lead, in_features, device="cuda", generator=g)).bfloat16().requires_grad_()
    operands = {"residual": x} if output is not None else {}
    y = block(x, **operands)
    want, xr, params = _reference(block, x, activation, output, operands)
    assert _norm_error(y, want) < 2e-2
    dy = torch.randn(want.shape, device="cuda", generator=g).bfloat16()
    trained = [(n, p) for n, p in block.named_parameters() if p.requires_grad]
    mine = torch.autograd.grad(y, [x, *[p for _, p in trained]], dy)
    theirs = torch.autograd.grad(want, [xr, *[params[n] for n, _ in trained]], dy.float())
    for name, a, b in zip(["x", *[n for n, _ in trained]], mine, theirs, strict=True):
        assert a.dtype == torch.bfloat16, name
        assert _norm_error(a, b) < 2e-2, f"{name}: {_norm_error(a, b):.3g}"
    return x, dy, mine


def _fused_kernels(block) -> list:
    return [v for v in block._dz.values() if v]


@pytest.mark.parametrize("activation, output, hidden", [
    (swiglu, add_residual, 96),
    (swiglu, add_residual, 100),   # halves of 200 bytes: dZ's halves are not 16-byte aligned (staged)
    (geglu_tanh, None, 64),
    (relu_squared, add_residual, 80),
])
def test_fused_backward_against_autograd_and_the_unfused_one(activation, output, hidden):
    torch.manual_seed(0)
    block = evtc.nn.MLP(128, hidden, activation, output, device="cuda", dtype=torch.bfloat16)
    x, dy, fused = _run(block, activation, output, (3, 70), 128)
    assert _fused_kernels(block), "the fused backward kernel was not used"
    # The unfused backward of the same block gives the same gradients, up to rounding.
    block.dz_kernel = lambda *args: None
    operands = {"residual": x} if output is not None else {}
    unfused = torch.autograd.grad(block(x, **operands), [x, *block.parameters()], dy)
    for a, b in zip(fused, unfused, strict=True):
        assert _norm_error(a, b) < 1e-2


def test_frozen_bias_is_an_operand_of_the_fused_kernel():
    """A frozen first bias: an operand of the fused kernel, which gives no gradient for it."""
    torch.manual_seed(0)
    block = evtc.nn.MLP(128, 96, bias_gelu, residual_bias, bias=True, device="cuda", dtype=torch.bfloat16)
    _run(block, bias_gelu, residual_bias, (150,), 128, freeze_bias=True)
    (fused,) = _fused_kernels(block)
    assert "bias" in fused[1].operands


@pytest.mark.parametrize("activation, hidden", [(bias_gelu, 96), (swiglu_bias, 96), (swiglu_bias, 100)])
@pytest.mark.parametrize("freeze", [False, True])
def test_first_bias_in_the_fused_kernel(activation, hidden, freeze):
    """A first layer with a bias (GELU's, or SwiGLU's as wide as the GEMM: read as its halves): the
    fused kernel takes it, trained (its gradient a column sum in the same kernel) or frozen, and
    the gradients match float32 autograd and the unfused backward of the same block."""
    torch.manual_seed(0)
    block = evtc.nn.MLP(128, hidden, activation, residual_bias, bias=True, device="cuda",
                        dtype=torch.bfloat16)
    x, dy, fused = _run(block, activation, residual_bias, (150,), 128, freeze_bias=freeze)
    ((kernel, epilogue),) = _fused_kernels(block)
    assert epilogue.operand_grads == (() if freeze else ("bias",))
    if block.gated:
        assert {operand for _, operand, _ in epilogue.halves} == {"bias"}
    else:
        assert "bias" in epilogue.operands
    block.dz_kernel = lambda *args: None
    trained = [p for p in block.parameters() if p.requires_grad]
    unfused = torch.autograd.grad(block(x, residual=x), [x, *trained], dy)
    for a, b in zip(fused, unfused, strict=True):
        assert _norm_error(a, b) < 1e-2


def _llama_block(hidden: int = 128, inter: int = 96):
    """(block, norm, layer): evtc.nn.MLP with a residual after an RMS scaling in torch."""
    torch.manual_seed(0)
    block = evtc.nn.MLP(hidden, inter, swiglu, add_residual, device="cuda", dtype=torch.bfloat16)
    norm = torch.nn.Parameter(torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5)

    def layer(x):
        rstd = torch.rsqrt(x.float().square().mean(-1, keepdim=True) + 1e-6)
        return block((x.float() * rstd).to(x.dtype) * norm, residual=x)
    return block, norm, layer


def _check_llama_block(y, mine, params, dy) -> None:
    """``y`` and the gradients ``mine`` of (x, norm, up.weight, down.weight) against float32 autograd."""
    ref = [p.detach().float().requires_grad_() for p in params]
    xr, nr, w1, w2 = ref
    h = xr * torch.rsqrt(xr.square().mean(-1, keepdim=True) + 1e-6) * nr
    want = swiglu(h @ w1.t()) @ w2.t() + xr
    assert y.shape == xr.shape and _norm_error(y, want) < 2e-2
    theirs = torch.autograd.grad(want, ref, dy.float())
    for name, a, b in zip(["x", "norm", "up.weight", "down.weight"], mine, theirs, strict=True):
        assert _norm_error(a, b) < 2e-2, f"{name}: {_norm_error(a, b):.3g}"


def test_block_under_torch_compile_matches_autograd():
    """A Llama-style block (RMS scaling in torch, then evtc.nn.MLP with a residual) compiled by
    torch.compile, as bench/train.py's "evtc+compile" runs it: the torch ops are compiled around the
    evtc kernels, and the output and every gradient match float32 autograd of the same block."""
    hidden = 128
    block, norm, layer = _llama_block(hidden)
    compiled = torch.compile(layer)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(200, hidden, device="cuda", generator=g).bfloat16().requires_grad_()
    dy = torch.randn(200, hidden, device="cuda", generator=g).bfloat16()
    params = [x, norm, block.up.weight, block.down.weight]
    for _ in range(2):  # the first call builds the kernels, the second runs them as built
        y = compiled(x)
        mine = torch.autograd.grad(y, params, dy)
    # Each layer's kernel (or the twin that also stores the accumulator) ran, and none took the
    # torch path (a Linear that dynamo's tracing built may never run: its path stays empty).
    paths = {name: [k.last_path for lin in part._compiled.values() for k in (lin.kernel, lin._saving) if k]
             for name, part in (("up", block.up), ("down", block.down))}
    assert all("kernel" in p and "torch" not in p for p in paths.values()), paths
    assert _fused_kernels(block), "the fused backward kernel was not used"
    _check_llama_block(y, mine, params, dy)


def test_block_in_one_fullgraph_compile_keeps_the_fused_backward():
    """After an eager call, a Llama-style block compiles with fullgraph=True: evtc.nn.MLP runs as its
    forward and backward operators (evtc.mlp_op), no graph break, and its backward still computes
    the first layer's dZ in the epilogue of dZ2 @ W2 (counted: the fused kernel runs on every
    compiled step). Outputs and gradients match float32 autograd."""
    hidden = 128
    block, norm, layer = _llama_block(hidden)
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(4, 50, hidden, device="cuda", generator=g).bfloat16().requires_grad_()
    dy = torch.randn(4, 50, hidden, device="cuda", generator=g).bfloat16()
    params = [x, norm, block.up.weight, block.down.weight]
    torch.autograd.grad(layer(x), params, dy)  # eager: kernels built, operators registered
    (fused,) = _fused_kernels(block)
    runs = []
    original = fused[0].__class__.__call__

    def counting(self, *args, **kwargs):
        if self is fused[0]:
            runs.append(1)
        return original(self, *args, **kwargs)

    compiled = torch.compile(layer, fullgraph=True)
    try:
        fused[0].__class__.__call__ = counting
        for _ in range(2):
            y = compiled(x)
            mine = torch.autograd.grad(y, params, dy)
    finally:
        fused[0].__class__.__call__ = original
    assert len(runs) == 2, runs
    _check_llama_block(y, mine, params, dy)


def test_block_under_dynamic_shapes():
    """evtc.nn.MLP compiled with fullgraph=True and dynamic=True: its operators' fake shapes follow
    a symbolic token count; gradients at three counts match float32 autograd."""
    torch.manual_seed(0)
    block = evtc.nn.MLP(128, 96, swiglu, add_residual, device="cuda", dtype=torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(3)
    warm = torch.randn(40, 128, device="cuda", generator=g).bfloat16().requires_grad_()
    block(warm, residual=warm).sum().backward()  # eager: kernels built, operators registered
    compiled = torch.compile(lambda x: block(x, residual=x), fullgraph=True, dynamic=True)
    params = [block.up.weight, block.down.weight]
    for m in (200, 33, 513):
        y, mine, ref, dy = compiled_step(compiled, params, m, 128, g)
        want = swiglu(ref[0] @ ref[1].t()) @ ref[2].t() + ref[0]
        assert y.shape == (m, 128) and _norm_error(y, want) < 2e-2
        theirs = torch.autograd.grad(want, ref, dy.float())
        for name, a, b in zip(["x", "up.weight", "down.weight"], mine, theirs, strict=True):
            assert _norm_error(a, b) < 2e-2, f"{name} at M={m}: {_norm_error(a, b):.3g}"


def test_an_expert_with_no_tokens():
    """An MoE expert that receives no tokens: FusedLinear and MLP forward and backward on 0 rows
    (and the next call with rows) give empty outputs and zero weight gradients, as nn.Linear does."""
    torch.manual_seed(0)
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    block = evtc.nn.MLP(128, 96, swiglu, add_residual, **kw)
    layer = evtc.nn.FusedLinear(128, 64, swiglu, bias=False, **kw)
    for m in (0, 37, 0):
        x = torch.randn(m, 128, **kw).requires_grad_()
        y = block(x, residual=x)
        z = layer(x)
        assert y.shape == (m, 128) and z.shape == (m, 32)
        block.zero_grad(set_to_none=True)
        layer.zero_grad(set_to_none=True)
        (y.float().sum() + z.float().sum()).backward()
        grads = [block.up.weight.grad, block.down.weight.grad, layer.weight.grad, x.grad]
        assert all(g is not None and torch.isfinite(g.float()).all() for g in grads)
        if m == 0:
            assert all(g.abs().sum().item() == 0 for g in grads[:3])
        else:
            assert all(g.abs().sum().item() > 0 for g in grads[:3])
