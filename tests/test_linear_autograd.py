"""evtc.linear is differentiable: gradients of x, the weight and the tensor operands against
torch.autograd on the same function, on CPU through the reference path (float32 a and b run there
as torch.matmul and the epilogue graph)."""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F
from several_outputs import four_outputs, gated_with_stats, tile_and_pre_residual

import evtc


def bias_gelu(acc, bias):
    return F.gelu(acc + bias)


def residual_scaled(acc, residual, scale, alpha: float):
    return acc * scale * alpha + residual


def swiglu(acc):
    gate, up = acc.chunk(2, dim=-1)
    return F.silu(gate) * up


def with_stats(acc, bias):
    y = torch.tanh(acc + bias)
    return y, y.square().sum(-1), y.amax(0)


def _close(got, want, what):
    err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()
    assert err < 1e-4, f"{what}: relative error {err:.3g}"


def _check(fn, lead, k, n, operands, weight_rows=None, **scalars):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*lead, k, generator=g).requires_grad_()
    w = torch.randn(weight_rows or n, k, generator=g).requires_grad_()
    ops = {name: make(g).requires_grad_() for name, make in operands.items()}
    lin = evtc.linear(fn, {"x": x, "weight": w, **ops, **scalars})
    got = lin(x, w, **ops, **scalars)
    want = fn(x @ w.t(), **ops, **scalars)
    got_leaves = got if isinstance(got, tuple) else (got,)
    want_leaves = want if isinstance(want, tuple) else (want,)
    upstream = [torch.randn(t.shape, generator=g) for t in want_leaves]
    inputs = [x, w, *ops.values()]
    mine = torch.autograd.grad(got_leaves, inputs, upstream)
    ref = torch.autograd.grad(want_leaves, inputs, upstream)
    for name, a, b in zip(["x", "weight", *ops], mine, ref, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        _close(a, b, name)


def test_bias_gelu():
    _check(bias_gelu, (6,), 16, 24, {"bias": lambda g: torch.randn(24, generator=g)})


def _squared_against_a_detached_copy(acc, bias):
    y = acc + bias
    return y * y.detach()  # d/dy is y, not 2y: no gradient flows through the detached copy


def _fake_quant_straight_through(acc, bias):
    y = acc + bias
    q = torch.round(y * 4.0) / 4.0  # no gradient of its own, as in torch
    return y + (q - y).detach()      # the straight-through estimator: forward q, backward y's


def _prelu_learned_slope(acc, slope):
    return F.prelu(acc, slope)


def _gate_under_no_grad(acc, bias):
    with torch.no_grad():  # torch records no gradient for the gate
        gate = torch.sigmoid(acc + bias)
    return (acc + bias) * gate


def _scale_with_grad_disabled(acc, bias):
    with torch.set_grad_enabled(False):
        scale = F.softplus(acc) + 1.0
    with torch.inference_mode():
        shift = acc * 0.5
    return (acc + bias) * scale + shift


@pytest.mark.parametrize("fn, operands", [
    (_gate_under_no_grad, {"bias": lambda g: torch.randn(24, generator=g)}),
    (_scale_with_grad_disabled, {"bias": lambda g: torch.randn(24, generator=g)}),
    (_squared_against_a_detached_copy, {"bias": lambda g: torch.randn(24, generator=g)}),
    (_fake_quant_straight_through, {"bias": lambda g: torch.randn(24, generator=g)}),
    (_prelu_learned_slope, {"slope": lambda g: torch.rand(24, generator=g)}),
])
def test_detach_rounding_and_prelu_follow_torch_autograd(fn, operands):
    """detach and the epilogue's own no_grad blocks stop the gradient (both had been traced as the
    values themselves: y * y.detach() got 2y), torch.round passes none, and prelu's weight gets its
    row reduction."""
    _check(fn, (6,), 16, 24, operands)


def test_leading_dims_and_operands_shaped_like_the_output():
    _check(residual_scaled, (2, 3), 16, 24,
           {"residual": lambda g: torch.randn(2, 3, 24, generator=g),
            "scale": lambda g: torch.rand(2, 3, 1, generator=g) + 0.5}, alpha=0.7)


def test_swiglu_weight_gets_both_halves():
    _check(swiglu, (5,), 16, 12, {}, weight_rows=24)


def test_several_outputs_with_reductions():
    _check(with_stats, (7,), 16, 20, {"bias": lambda g: torch.randn(20, generator=g)})


def test_only_some_inputs_require_grad_and_no_grad_mode():
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(12, 8)
    bias = torch.randn(12)
    lin = evtc.linear(bias_gelu, {"x": x, "weight": w, "bias": bias})
    y = lin(x, w, bias=bias)
    assert y.requires_grad
    (dx,) = torch.autograd.grad(y.sum(), [x])
    x_ref = x.detach().clone().requires_grad_()
    (want,) = torch.autograd.grad(bias_gelu(x_ref @ w.t(), bias).sum(), [x_ref])
    _close(dx, want, "x")
    with torch.no_grad():
        assert not lin(x, w, bias=bias).requires_grad
    with pytest.raises(evtc.CallError, match="out= is not differentiable"):
        lin(x, w, bias=bias, out=torch.empty(4, 12))


def test_fused_linear_module_trains_like_nn_linear():
    from evtc.nn import FusedLinear

    torch.manual_seed(0)
    fused = FusedLinear(16, 24, bias_gelu)
    plain = torch.nn.Linear(16, 24)
    plain.load_state_dict({"weight": fused.weight.detach().clone(), "bias": fused.bias.detach().clone()})
    assert {name for name, _ in fused.named_parameters()} == {"weight", "bias"}
    assert "epilogue=bias_gelu" in repr(fused)
    x = torch.randn(3, 5, 16)
    for module in (fused, plain):
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
        for _ in range(3):
            optimizer.zero_grad()
            out = module(x) if module is fused else F.gelu(module(x))
            out.square().mean().backward()
            optimizer.step()
    _close(fused.weight.detach(), plain.weight.detach(), "weight after 3 steps")
    _close(fused.bias.detach(), plain.bias.detach(), "bias after 3 steps")


def test_fused_linear_without_bias_and_a_clear_error():
    from evtc.nn import FusedLinear

    gated = FusedLinear(8, 12, swiglu, bias=False)
    x = torch.randn(4, 8, requires_grad=True)
    y = gated(x)
    assert y.shape == (4, 6)
    y.sum().backward()
    assert gated.weight.grad is not None and x.grad is not None
    with pytest.raises(evtc.CallError, match="no parameter named 'bias'"):
        FusedLinear(8, 12, swiglu)


def bias_residual(acc, bias, residual, alpha: float):
    return acc * alpha + bias + residual


def gelu_parts(accumulator, bias):
    y = F.gelu(accumulator + bias)
    return {"y": y, "pre_sum": (accumulator + bias).sum(-1)}


@pytest.mark.parametrize("fn, rows, operands", [
    (bias_residual, 24, {"bias": (24,), "residual": (6, 24), "alpha": 0.7}),  # reads no acc
    (bias_gelu, 24, {"bias": (24,)}),             # saves acc as an extra output
    (swiglu, 48, {}),                             # gated: saves both halves
    (with_stats, 24, {"bias": (24,)}),            # a tuple with reductions
    (gelu_parts, 24, {"bias": (24,)}),            # a dict, acc under another name
])
def test_the_backward_recomputes_no_accumulator(monkeypatch, fn, rows, operands):
    """A differentiable call's backward reads the accumulator that the forward stored beside the
    outputs (or none, where the backward never reads it): it runs no GEMM to recompute it, which
    would cost a training step one more forward GEMM per layer."""
    import evtc.ir.interpreter as interpreter

    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 16, generator=g, requires_grad=True)
    w = torch.randn(rows, 16, generator=g, requires_grad=True)
    ops = {k: (torch.randn(*v, generator=g).requires_grad_() if isinstance(v, tuple) else v)
           for k, v in operands.items()}
    lin = evtc.linear(fn, {"x": x, "weight": w, **ops})
    got = lin(x, w, **ops)  # the forward (torch path on CPU)
    want = fn(x @ w.t(), **ops)

    def refuse(*args, **kwargs):
        raise AssertionError("the accumulator was recomputed")

    monkeypatch.setattr(interpreter, "accumulator", refuse)
    leaves = lambda v: list(v.values()) if isinstance(v, dict) else list(v) if isinstance(v, tuple) else [v]  # noqa: E731
    got_leaves, want_leaves = leaves(got), leaves(want)
    for a, b in zip(got_leaves, want_leaves, strict=True):
        _close(a.detach(), b.detach(), "forward")
    upstream = [torch.randn(t.shape, generator=g) for t in want_leaves]
    inputs = [x, w, *[v for v in ops.values() if isinstance(v, torch.Tensor)]]
    mine = torch.autograd.grad(got_leaves, inputs, upstream)
    ref = torch.autograd.grad(want_leaves, inputs, upstream)
    for a, b in zip(mine, ref, strict=True):
        _close(a, b, fn.__name__)


def test_a_twin_that_does_not_compile_falls_back_to_recomputing(monkeypatch, caplog):
    """Where the kernel that also stores the accumulator does not compile (one more output may not
    fit a pinned configuration's shared memory), the backward recomputes the accumulator: the
    gradients stay right, and the log says why."""
    import importlib

    linear_module = importlib.import_module("evtc.linear")  # the module (evtc.linear is the function)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 16, generator=g, requires_grad=True)
    w = torch.randn(24, 16, generator=g, requires_grad=True)
    bias = torch.randn(24, generator=g, requires_grad=True)
    lin = evtc.linear(bias_gelu, {"x": x, "weight": w, "bias": bias})

    def no_twin(fn, *args, **kwargs):
        raise evtc.errors.CompileError("configuration: shared memory does not fit (simulated)")

    monkeypatch.setattr(linear_module, "_compile_kernel", no_twin)
    with caplog.at_level("WARNING", logger="evtc"):
        y = lin(x, w, bias=bias)
    assert "recomputes it" in caplog.text and "simulated" in caplog.text
    dy = torch.randn(6, 24, generator=g)
    mine = torch.autograd.grad(y, [x, w, bias], dy)
    want = torch.autograd.grad(bias_gelu(x @ w.t(), bias), [x, w, bias], dy)
    for name, a, b in zip(["x", "weight", "bias"], mine, want, strict=True):
        _close(a, b, name)


def test_layers_under_torch_compile_fullgraph(monkeypatch):
    """FusedLinear layers in one torch.compile(fullgraph=True) graph, after an eager call has built
    their kernels: each runs as its kernel's custom operator (the twin that also stores the
    accumulator, or its gate and up halves), the gradients match torch.autograd, and no backward
    recomputes an accumulator. (evtc.nn.MLP: the next test.)"""
    import evtc.ir.interpreter as interpreter

    torch.manual_seed(0)
    first = evtc.nn.FusedLinear(64, 96, bias_gelu)
    gated = evtc.nn.FusedLinear(96, 160, swiglu, bias=False)
    x = torch.randn(3, 20, 64, requires_grad=True)

    def block(x):
        return gated(first(x))

    block(x).square().mean().backward()  # builds the kernels and the twins
    twins = [lin._saving for part in (first, gated) for lin in part._compiled.values()]
    assert len(twins) == 2 and all(isinstance(t, evtc.Kernel) for t in twins)

    def refuse(*args, **kwargs):
        raise AssertionError("the accumulator was recomputed")

    monkeypatch.setattr(interpreter, "accumulator", refuse)
    for t in twins:
        t.last_path = ""
    compiled = torch.compile(lambda x: block(x).square().mean(), backend="aot_eager", fullgraph=True)
    params = [x, first.weight, first.bias, gated.weight]
    mine = torch.autograd.grad(compiled(x), params)
    assert all(t.last_path for t in twins)  # the twins' operators ran
    want = swiglu(F.gelu(x @ first.weight.t() + first.bias) @ gated.weight.t()).square().mean()
    for name, a, b in zip(["x", "weight", "bias", "gated weight"], mine,
                          torch.autograd.grad(want, params), strict=True):
        _close(a, b, name)


def test_activation_checkpointing_under_one_fullgraph_compile():
    """torch.compile(fullgraph=True) around torch.utils.checkpoint of a FusedLinear, the usual
    setup of large-model training: dynamo refuses any side effect inside the checkpoint, and each
    call rebound the kernel's operator in a global dict ("Unsafe side effect"). Gradients of x and
    the parameters as torch's, for one row too (a kernel served for M = 1 is noted outside
    compile only)."""
    from torch.utils.checkpoint import checkpoint

    layer = evtc.nn.FusedLinear(32, 48, bias_gelu)
    for shape in [(2, 5, 32), (1, 1, 32)]:
        x = torch.randn(*shape, requires_grad=True)
        layer(x).sum().backward()  # eager first: builds the kernel
        layer.zero_grad()
        torch._dynamo.reset()
        compiled = torch.compile(lambda t: checkpoint(layer, t, use_reentrant=False).sum(),
                                 backend="aot_eager", fullgraph=True)
        params = [x, layer.weight, layer.bias]
        mine = torch.autograd.grad(compiled(x), params)
        want = F.gelu(x @ layer.weight.t() + layer.bias).sum()
        for name, a, b in zip(["x", "weight", "bias"], mine, torch.autograd.grad(want, params),
                              strict=True):
            _close(a, b, f"{name} {shape}")


def _residual_scaled(acc, residual, alpha: float):
    return acc * alpha + residual, acc.sum(-1)


def test_mlp_block_under_torch_compile_fullgraph():
    """evtc.nn.MLP in one torch.compile(fullgraph=True) graph after an eager call: its forward and
    backward run as the block's two custom operators (evtc.mlp_op), and the outputs (a tile and a
    per-row sum, with x's leading dims) and every gradient match torch.autograd. A signature no eager
    call registered is a clear error, not a graph break."""
    torch.manual_seed(0)
    block = evtc.nn.MLP(32, 24, swiglu, _residual_scaled)
    x = torch.randn(2, 7, 32, requires_grad=True)
    residual = torch.randn(2, 7, 32, requires_grad=True)

    def loss(x, residual):
        y, rows = block(x, residual=residual, alpha=0.5)
        return y.square().mean() + rows.mean(), y.shape, rows.shape

    loss(x, residual)[0].backward()  # eager: builds the kernels and registers the operators
    assert len(block._operators) == 1
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    value, y_shape, rows_shape = compiled(x, residual)
    assert (y_shape, rows_shape) == ((2, 7, 32), (2, 7))
    params = [x, residual, block.up.weight, block.down.weight]
    mine = torch.autograd.grad(value, params)
    xr, rr, w1, w2 = (p.detach().double().requires_grad_() for p in params)
    h = swiglu(xr @ w1.t())
    acc = h @ w2.t()
    want = (acc * 0.5 + rr).square().mean() + acc.sum(-1).mean()
    for name, a, b in zip(["x", "residual", "up.weight", "down.weight"], mine,
                          torch.autograd.grad(want, [xr, rr, w1, w2]), strict=True):
        _close(a, b, name)
    assert abs(value.item() - want.item()) <= 1e-4 * abs(want.item())

    with pytest.raises(Exception, match="call the block once eagerly"):  # noqa: B017 - dynamo's error
        torch.compile(loss, backend="aot_eager", fullgraph=True)(x[0], residual[0])


def _masked(acc, mask):
    return torch.where(mask > 0, acc, 0.0)


def test_mlp_operand_without_a_gradient_under_torch_compile():
    """A second-layer operand that requires grad but that the epilogue reads only through a
    comparison: its backward operator returned an empty placeholder where its fake promised a
    tensor of the operand's shape, and the compiled backward failed. Now zeros (torch's eager
    gradient is None: the where's condition has none)."""
    torch.manual_seed(0)
    block = evtc.nn.MLP(16, 12, F.gelu, _masked)
    x = torch.randn(6, 16, requires_grad=True)
    mask = torch.randn(6, 16, requires_grad=True)

    def loss(x, mask):
        return block(x, mask=mask).square().sum()

    loss(x, mask).backward()  # eager: builds the kernels and registers the operators
    xr, mr = x.detach().double().requires_grad_(), mask.detach().double().requires_grad_()
    w1, w2 = block.up.weight.detach().double(), block.down.weight.detach().double()
    want = torch.autograd.grad(_masked(F.gelu(xr @ w1.t()) @ w2.t(), mr).square().sum(), [xr])[0]
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    dx, dmask = torch.autograd.grad(compiled(x, mask), [x, mask], allow_unused=True)
    _close(dx, want, "x")
    assert dmask is None or (dmask.shape == mask.shape and not dmask.any())


def _rows_max(acc, bias):
    y = torch.tanh(acc + bias)
    return y, y.amax(0)


def _positional_sum(acc):
    return acc, acc.sum(1)


def _all_rows(acc, bias):
    y = acc + bias
    return y, y.sum(-1), y.sum(dim=tuple(range(y.dim() - 1))), y.amax()


@pytest.mark.parametrize("fn, what", [(_rows_max, "output 1"), (_positional_sum, "output 1")])
def test_leading_dims_that_flattening_would_change_are_refused(fn, what):
    """x with leading dims is flattened into M. Where that changes what the function returns in
    PyTorch (a reduction over one leading dim, a dim read by position), evtc.linear refuses with
    the shapes both would give, at compile time and at a call with another number of dims."""
    x3 = torch.randn(2, 6, 16)
    w = torch.randn(24, 16)
    ops = {"bias": torch.randn(24)} if fn is _rows_max else {}
    with pytest.raises(evtc.CallError, match=rf"{what} .* has shape .* in PyTorch, but evtc.linear flattens"):
        evtc.linear(fn, {"x": x3, "weight": w, **ops})
    lin = evtc.linear(fn, {"x": x3.reshape(12, 16), "weight": w, **ops})  # 2-d x: exact
    got = lin(x3.reshape(12, 16), w, **ops)
    for a, b in zip(got, fn(x3.reshape(12, 16) @ w.t(), **ops), strict=True):
        _close(a, b, "2-d x")
    with pytest.raises(evtc.CallError, match="flattens the leading dims into M"):
        lin(x3, w, **ops)
    # 1-d x: PyTorch reduces the one row's N values (amax(0)) or fails (sum(1)).
    with pytest.raises(evtc.CallError, match="with a 1-d x, .* has shape .* in PyTorch|fails in PyTorch"):
        lin(torch.randn(16), w, **ops)


def test_one_dimensional_x_gets_pytorch_shapes():
    """A 1-d x is one row: outputs come back without the row dim, as PyTorch returns them."""
    def per_row(acc, bias):
        y = F.gelu(acc + bias)
        return y, y.square().sum(-1)

    w, bias, x = torch.randn(24, 16), torch.randn(24), torch.randn(16)
    lin = evtc.linear(per_row, {"x": x, "weight": w, "bias": bias})
    for a, b in zip(lin(x, w, bias=bias), per_row(x @ w.t(), bias), strict=True):
        assert a.shape == b.shape
        _close(a, b, "1-d x")


def test_one_dimensional_x_beside_an_operand_with_a_row_dim_is_refused_with_a_way_out():
    """With a 1-d x, an operand of (1, N) broadcasts PyTorch's output to (1, N), where evtc.linear
    returns (N,) as F.linear does: refused, naming the shape and the way out (x.unsqueeze(0)),
    which then gives PyTorch's values."""
    def residual(acc, C):
        return acc + C

    w, x, C = torch.randn(24, 16), torch.randn(16), torch.randn(1, 24)
    lin = evtc.linear(residual, {"x": torch.randn(4, 16), "weight": w, "C": torch.randn(4, 24)})
    refusal = (r"with a 1-d x, the epilogue's output has shape \(1, 24\) in PyTorch, .* would return "
               r"\(24,\); an operand .* x.unsqueeze\(0\)")
    with pytest.raises(evtc.CallError, match=refusal):
        lin(x, w, C=C)
    _close(lin(x.unsqueeze(0), w, C=C), residual(x @ w.t(), C), "x.unsqueeze(0)")


def test_one_dimensional_x_takes_operands_of_its_one_row():
    """With x of (in_features,), operands shaped (*lead, N) = (N,) and (*lead, 1) = (1,) are that
    row's (torch broadcasts them so), for a Linear compiled from leading dims, where the residual is
    a tile and the scale a column; values and gradients are torch's. They were refused as not 2-d."""
    def gated_residual(acc, res, c):
        return torch.tanh(acc + res) * c

    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(2, 6, 32, generator=g), torch.randn(48, 32, generator=g)
    lin = evtc.linear(gated_residual, dict(x=x, weight=w, res=torch.randn(2, 6, 48), c=torch.randn(2, 6, 1)))
    inputs = [torch.randn(32, generator=g), w, torch.randn(48, generator=g), torch.randn(1, generator=g)]
    ours = [t.clone().requires_grad_() for t in inputs]
    theirs = [t.clone().requires_grad_() for t in inputs]
    y = lin(ours[0], ours[1], res=ours[2], c=ours[3])
    want = gated_residual(F.linear(theirs[0], theirs[1]), theirs[2], theirs[3])
    assert y.shape == want.shape == (48,)
    _close(y, want, "forward")
    grad = torch.randn(48, generator=g)
    y.backward(grad)
    want.backward(grad)
    for name, a, b in zip(("x", "weight", "res", "c"), ours, theirs, strict=True):
        _close(a.grad, b.grad, f"{name} gradient")


def test_linear_messages_say_how_x_and_the_operands_were_flattened():
    """The kernel's checks name a, b and flattened shapes; evtc.linear's call says how they came
    about, and a mixed-dtype example is refused as F.linear refuses it."""
    x, w = torch.randn(2, 5, 32).bfloat16(), torch.randn(48, 32).bfloat16()
    lin = evtc.linear(lambda acc, bias: acc + bias, dict(x=x, weight=w, bias=torch.randn(48).bfloat16()))
    flattened = (r"^evtc.linear \(x \(2, 5, 32\) runs as a = x.reshape\(10, 32\), operands with x's "
                 r"leading dims flattened alike, weight as b = weight.t\(\)\): bias must be 1-d like its")
    with pytest.raises(evtc.CallError, match=flattened):
        lin(x, w, bias=torch.randn(2, 1, 48).bfloat16())
    with pytest.raises(evtc.CallError, match=r"^evtc.linear \(x runs as a, weight as b = weight.t\(\)\): "
                                             r"a must be torch.bfloat16"):
        lin(x[0].float(), w, bias=torch.randn(48).bfloat16())
    with pytest.raises(evtc.CallError, match="example x is torch.float32 and weight torch.bfloat16; they"):
        evtc.linear(lambda acc: acc, dict(x=x.float(), weight=w))


def _by_row_count(acc):
    return acc / acc.shape[-2]


def _by_first_size(acc):
    return acc * acc.size(0)


def _by_rank(acc):
    return acc * 2.0 if acc.dim() == 3 else acc


def _last_size_and_rank_arithmetic(acc):
    *_, n = acc.shape
    return acc / n * acc.size(-1), acc.sum(dim=tuple(range(acc.dim() - 1)))


@pytest.mark.parametrize("fn", [_by_row_count, _by_first_size, _by_rank])
def test_a_leading_size_or_a_branch_on_the_rank_is_refused(fn, tmp_path):
    """A leading size read by position (``acc.shape[-2]``, ``acc.size(0)``) or a branch on the rank
    changes the values, not only the shapes, when x's leading dims are flattened into M: refused
    (they were computed silently from M and rank 2), for evtc.linear and FusedLinear alike; the
    last dim and arithmetic on the rank are exact."""
    from evtc.nn import FusedLinear

    x, w = torch.randn(2, 5, 16), torch.randn(24, 16)
    with pytest.raises(evtc.CallError, match="leading size|its rank"):
        evtc.linear(fn, {"x": x, "weight": w}, cache_dir=tmp_path)
    with pytest.raises(evtc.CallError, match="leading size|its rank"):
        FusedLinear(16, 24, fn, bias=False, cache_dir=tmp_path)(x)
    lin = evtc.linear(_last_size_and_rank_arithmetic, {"x": x, "weight": w}, cache_dir=tmp_path)
    for a, b in zip(lin(x, w), _last_size_and_rank_arithmetic(x @ w.t()), strict=True):
        _close(a, b, "last size and rank arithmetic")


def _by_rank_value(acc):
    return acc * acc.dim()


def _by_rank_less_one(acc):
    return acc * (acc.ndim - 1)


@pytest.mark.parametrize("fn", [_by_rank_value, _by_rank_less_one])
def test_the_rank_as_a_value_is_refused(fn, tmp_path):
    """``acc * acc.dim()`` is x's rank in torch and 2 in the flattened kernel: refused for 3-d and
    1-d x (it was computed with 2: silently not torch's values; found by a docs audit)."""
    w = torch.randn(24, 16)
    lin = evtc.linear(fn, {"x": torch.randn(5, 16), "weight": w}, cache_dir=tmp_path)
    x2 = torch.randn(5, 16)
    _close(lin(x2, w), fn(x2 @ w.t()), "2-d")
    for x in (torch.randn(2, 5, 16), torch.randn(16)):
        with pytest.raises(evtc.CallError, match="its rank as a value"):
            lin(x, w)


def test_a_one_row_x_refuses_dims_read_from_the_front(tmp_path):
    """With a 1-d x torch's acc is (N,) and the kernel's (1, N): ``acc.size(0)``, ``acc.shape[0]``
    differ (N against 1) and are refused; dims read from the end are the same."""
    w = torch.randn(24, 16)
    x = torch.randn(16)
    for fn in (lambda acc: acc * acc.size(0), lambda acc: acc * acc.shape[0]):
        lin = evtc.linear(fn, {"x": torch.randn(5, 16), "weight": w}, cache_dir=tmp_path)
        with pytest.raises(evtc.CallError, match="1-d x"):
            lin(x, w)
    lin = evtc.linear(lambda acc: acc / acc.shape[-1], {"x": torch.randn(5, 16), "weight": w},
                      cache_dir=tmp_path)
    _close(lin(x, w), (x @ w.t()) / 24, "last dim")


def test_an_operand_reshaped_for_the_kernel_keeps_its_shape_reads(tmp_path):
    """An operand flattened or expanded with x's leading dims reaches the kernel in another shape:
    where the epilogue reads its shape (``R.size(0)``, ``R.numel()``) the values would differ, so
    the call is refused (they were computed from the kernel's shapes: silently wrong)."""
    w = torch.randn(24, 16)
    x = torch.randn(2, 5, 16)
    for fn, shape in [(lambda acc, R: acc * R.size(0) + R, (1, 5, 1)),
                      (lambda acc, R: acc * R.numel() + R, (2, 1, 24)),
                      (lambda acc, R: acc * R.dim() + R, (2, 5, 24))]:
        R = torch.randn(*shape)
        lin = evtc.linear(fn, {"x": torch.randn(10, 16), "weight": w, "R": torch.randn(10, shape[-1])},
                          cache_dir=tmp_path)
        with pytest.raises(evtc.CallError, match="reads R's shape|its rank as a value"):
            lin(x, w, R=R)
    # In the shapes the kernel sees, the same layer gives torch's values.
    R = torch.randn(10, 24)
    _close(lin(x.reshape(10, 16), w, R=R), (x.reshape(10, 16) @ w.t()) * 2 + R, "2-d")


def test_a_one_row_verdict_is_kept_per_operand_shape(tmp_path):
    """Whether a 1-d x keeps torch's shapes depends on the operands too: a (1, N) tile operand makes
    torch's output (1, N). After a call with an (N,) operand passed, the same call with a (1, N)
    one was accepted and returned (N,) (the verdict was kept per rank of x alone)."""
    w = torch.randn(24, 16)
    lin = evtc.linear(lambda acc, R: acc + R, {"x": torch.randn(5, 16), "weight": w, "R": torch.randn(5, 24)},
                      cache_dir=tmp_path)
    x = torch.randn(16)
    R = torch.randn(24)
    _close(lin(x, w, R=R), x @ w.t() + R, "(N,) operand")
    with pytest.raises(evtc.CallError, match="with a 1-d x"):
        lin(x, w, R=R[None])


_PROBES_MEET = threading.Barrier(2, timeout=30)


def _reads_a_leading_size_after_the_other_probe_started(acc):
    if acc.device.type == "meta":
        _PROBES_MEET.wait()  # both threads' probes have started: the other's start is behind us
    return acc * acc.size(0)


def _reads_no_size_beside_the_other_probe(acc):
    if acc.device.type == "meta":
        _PROBES_MEET.wait()
    return acc * 2.0


def test_layers_probed_in_two_threads_at_once_keep_their_own_notes(tmp_path):
    """The probe of x's leading dims notes what each function reads per thread: two layers first
    called with 3-d x in two threads at once each get their own verdict (with one note for the
    process, the layer that reads no size was refused for the other's read, and one probe's start
    could erase the other's note: a silently wrong result)."""
    x2, w = torch.randn(5, 16), torch.randn(24, 16)
    reads = evtc.linear(_reads_a_leading_size_after_the_other_probe_started, {"x": x2, "weight": w},
                        cache_dir=tmp_path)
    plain = evtc.linear(_reads_no_size_beside_the_other_probe, {"x": x2, "weight": w},
                        cache_dir=tmp_path)
    x = torch.randn(2, 5, 16)

    def call(lin):
        try:
            return lin(x, w)
        except evtc.CallError as err:
            return err

    with ThreadPoolExecutor(2) as pool:
        refused, result = pool.map(call, [reads, plain])
    assert isinstance(refused, evtc.CallError) and "leading size" in str(refused), refused
    assert isinstance(result, torch.Tensor), result
    _close(result, (x @ w.t()) * 2.0, "the layer that reads no size")


def test_leading_dims_that_flatten_exactly_are_accepted():
    """Per-row reductions, reductions over all leading dims and over everything give the same
    results flattened: accepted, with PyTorch's shapes and values, for 2-, 3- and 4-d x."""
    w = torch.randn(24, 16)
    bias = torch.randn(24)
    lin = evtc.linear(_all_rows, {"x": torch.randn(2, 6, 16), "weight": w, "bias": bias})
    for shape in [(2, 6, 16), (3, 2, 4, 16), (5, 16)]:
        x = torch.randn(*shape)
        got = lin(x, w, bias=bias)
        want = _all_rows(x @ w.t(), bias)
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape, (shape, a.shape, b.shape)
            _close(a, b, str(shape))


def test_modules_follow_autocast():
    """Under torch.autocast, FusedLinear and MLP take float32 parameters and inputs as nn.Linear
    does: in the autocast dtype (bfloat16 here), through differentiable casts, so the outputs are
    bfloat16 and the parameters get float32 gradients, equal to nn.Linear's under the same
    autocast up to rounding. Outside autocast they stay float32."""
    torch.manual_seed(0)
    layer = evtc.nn.FusedLinear(32, 48, bias_gelu)
    reference = torch.nn.Linear(32, 48)
    with torch.no_grad():
        reference.weight.copy_(layer.weight)
        reference.bias.copy_(layer.bias)
    x = torch.randn(5, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
        want = F.gelu(reference(x))
    assert y.dtype == want.dtype == torch.bfloat16
    assert layer.weight.dtype == torch.float32  # the parameters are not converted
    dy = torch.randn(y.shape)
    mine = torch.autograd.grad(y, [x, layer.weight, layer.bias], dy.bfloat16())
    theirs = torch.autograd.grad(want, [x, reference.weight, reference.bias], dy.bfloat16())
    for name, a, b in zip(["x", "weight", "bias"], mine, theirs, strict=True):
        assert a.dtype == torch.float32, name
        assert ((a - b).norm() / b.norm()).item() < 2e-2, name
    assert layer(x).dtype == torch.float32  # autocast off again

    block = evtc.nn.MLP(32, 24, swiglu, _residual_scaled)
    residual = torch.randn(5, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, rows = block(x, residual=residual, alpha=0.5)
    # A bfloat16 layer output plus a float32 residual is float32, as torch promotes it.
    assert out.dtype == torch.float32 and block.up.weight.dtype == torch.float32
    (out.float().square().mean() + rows.float().mean()).backward()
    assert block.up.weight.grad.dtype == torch.float32 and block.down.weight.grad is not None
    h = swiglu(x.detach().bfloat16().float() @ block.up.weight.detach().bfloat16().float().t())
    acc = h.bfloat16().float() @ block.down.weight.detach().bfloat16().float().t()
    assert ((out.float() - (acc * 0.5 + residual)).norm() / (acc * 0.5 + residual).norm()).item() < 2e-2


def test_used_modules_deepcopy_and_pickle():
    """copy.deepcopy (an EMA model, say) and torch.save of whole modules after they have compiled
    kernels: the copies keep the parameters, compile again on their first call, give the same
    results and train on their own."""
    import copy
    import io

    torch.manual_seed(0)
    layer = evtc.nn.FusedLinear(32, 48, bias_gelu)
    block = evtc.nn.MLP(32, 24, swiglu, _residual_scaled)
    x = torch.randn(4, 32, requires_grad=True)
    layer(x).sum().backward()
    block(x, residual=x, alpha=0.5)[0].sum().backward()
    buffer = io.BytesIO()
    torch.save(block, buffer)
    buffer.seek(0)
    copies = [(layer, copy.deepcopy(layer)), (block, copy.deepcopy(block)),
              (block, torch.load(buffer, weights_only=False))]
    for original, twin in copies:
        assert twin is not original
        for p, q in zip(original.parameters(), twin.parameters(), strict=True):
            assert torch.equal(p, q) and p.data_ptr() != q.data_ptr()
        args = {} if original is layer else {"residual": x, "alpha": 0.5}
        mine, theirs = twin(x, **args), original(x, **args)
        mine, theirs = (mine, theirs) if original is layer else (mine[0], theirs[0])
        assert torch.allclose(mine, theirs)
        twin.zero_grad(set_to_none=True)
        mine.sum().backward()
        assert all(q.grad is not None for q in twin.parameters())


def test_out_is_written_whatever_its_leading_strides():
    """``out=`` of (batch, seq, N) that is a slice of a longer cache, or a transposed (seq, batch)
    buffer, cannot be flattened into (M, N) without a copy: the results are copied into it, and
    the call returns ``out`` itself. The other outputs of a tuple get theirs the same way."""
    def with_row_sums(acc, bias):
        y = torch.tanh(acc + bias)
        return y, y.square().sum(-1)

    w, bias = torch.randn(24, 16), torch.randn(24)
    x = torch.randn(2, 5, 16)
    lin = evtc.linear(with_row_sums, {"x": x, "weight": w, "bias": bias})
    want_y, want_s = with_row_sums(x @ w.t(), bias)
    cache = torch.full((2, 9, 24), float("nan"))
    rows = torch.full((2, 9), float("nan"))
    out = (cache[:, :5], rows[:, :5])  # leading strides (216, 24) and (9, 1): no (M, N) view
    with torch.no_grad():
        got = lin(x, w, bias=bias, out=out)
    assert got[0] is out[0] and got[1] is out[1]
    _close(cache[:, :5], want_y, "sliced cache")
    _close(rows[:, :5], want_s, "sliced rows")
    assert cache[:, 5:].isnan().all() and rows[:, 5:].isnan().all()  # nothing past the slice
    seq_major = torch.full((5, 2, 24), float("nan")).transpose(0, 1)
    seq_rows = torch.full((5, 2), float("nan")).t()
    with torch.no_grad():
        lin(x, w, bias=bias, out=(seq_major, seq_rows))
    _close(seq_major, want_y, "transposed buffer")
    _close(seq_rows, want_s, "transposed rows")
    with pytest.raises(evtc.CallError, match="out 'D1' must be|leading dims are not x's"):
        with torch.no_grad():
            lin(x, w, bias=bias, out=(cache[:, :5], torch.empty(2, 9)[:, :4]))
    # A flattenable out is written in place too, and returned as given.
    flat = torch.empty(2, 5, 24)
    with torch.no_grad():
        got = lin(x, w, bias=bias, out=(flat, torch.empty(2, 5)))
    assert got[0] is flat
    _close(flat, want_y, "contiguous out")


def test_out_copied_into_refuses_shared_targets():
    """On the copy path (an ``out=`` whose leading dims no stride spans), two targets that share
    memory are refused before anything is written, as on the kernel path: each would otherwise
    hold whichever output was copied last."""
    def two_tiles(acc):
        return torch.relu(acc), acc * 2

    w, x = torch.randn(24, 16), torch.randn(2, 5, 16)
    lin = evtc.linear(two_tiles, {"x": x, "weight": w})
    shared = torch.full((5, 2, 24), float("nan")).transpose(0, 1)
    with pytest.raises(evtc.CallError, match="share memory"):
        with torch.no_grad():
            lin(x, w, out=(shared, shared))
    assert shared.isnan().all()  # refused before any copy
    other = torch.full((5, 2, 24), float("nan")).transpose(0, 1)
    with torch.no_grad():
        lin(x, w, out=(shared, other))
    want = x @ w.t()
    _close(shared, torch.relu(want), "first target")
    _close(other, want * 2, "second target")


def test_fused_linear_compiles_per_operand_kind():
    """One module called with a tile, a column, a row and a scalar operand of the same rank: each is
    another kernel (the operand's kind), each with PyTorch's values and gradients."""
    def scaled(acc, bias, s):
        return torch.tanh(acc * s + bias)

    layer = evtc.nn.FusedLinear(6, 8, scaled)
    x = torch.randn(5, 6)
    for shape in [(5, 8), (5, 1), (1, 8), (8,), (1,)]:
        s = (torch.rand(shape) + 0.5).requires_grad_()
        got = layer(x, s=s)
        (g,) = torch.autograd.grad(got.sum(), [s])
        s2 = s.detach().requires_grad_()
        want = scaled(x @ layer.weight.detach().t(), layer.bias.detach(), s2)
        (w,) = torch.autograd.grad(want.sum(), [s2])
        _close(got, want, str(shape))
        _close(g, w, f"grad {shape}")


def test_fused_linear_compiles_for_a_k_major_x_whatever_the_first_call():
    """A first call with a transposed x compiled an M-major a (float32: never a kernel), and every
    later call of that module took the torch path: the module compiles for K-major x, as nn.Linear
    inputs are, and still takes the transposed one (staged on the GPU)."""
    def gelu_bias(acc, bias):
        return F.gelu(acc + bias)

    layer = evtc.nn.FusedLinear(32, 16, gelu_bias)
    x_t = torch.randn(32, 8).t()
    got = layer(x_t)
    (lin,) = layer._compiled.values()
    assert lin.kernel.plan.a.contiguous == 1 and lin.kernel.interface.torch_only is None
    want = F.gelu(x_t.double() @ layer.weight.detach().double().t() + layer.bias.detach().double())
    _close(got, want, "transposed x")


def test_mlp_under_torch_compile_takes_an_int_where_a_float_was_registered():
    """The block's operator takes its scalars as floats: alpha=1 after an eager call with
    alpha=0.5 is the same operator (it was refused as a signature no eager call registered)."""
    torch.manual_seed(0)
    block = evtc.nn.MLP(32, 24, swiglu, _residual_scaled)
    x = torch.randn(7, 32, requires_grad=True)
    residual = torch.randn(7, 32)
    block(x, residual=residual, alpha=0.5)[0].sum().backward()  # registers the operator
    compiled = torch.compile(lambda x, r: block(x, residual=r, alpha=1)[0], backend="aot_eager",
                             fullgraph=True)
    got = compiled(x, residual)
    w1, w2 = block.up.weight.detach().double(), block.down.weight.detach().double()
    acc = swiglu(x.detach().double() @ w1.t()) @ w2.t()
    _close(got, acc * 1 + residual.double(), "alpha=1")


def _two_residuals(acc, r1, r2):
    return acc + r1 + r2


def test_operand_gradients_have_memory_of_their_own(tmp_path):
    """A residual's gradient is the incoming gradient unchanged: returned as that tensor, autograd
    accumulated the second micro-batch into it in place, changing the caller's gradient and the
    other residual's (the same tensor)."""
    m = evtc.nn.FusedLinear(16, 24, _two_residuals, bias=False, cache_dir=tmp_path)
    x = torch.randn(4, 16)
    r1, r2 = torch.randn(4, 24, requires_grad=True), torch.randn(4, 24, requires_grad=True)
    g = torch.randn(4, 24)
    kept = g.clone()
    for _ in range(2):  # gradient accumulation
        m(x, r1=r1, r2=r2).backward(g)
    assert torch.equal(g, kept)
    torch.testing.assert_close(r1.grad, 2 * kept)
    torch.testing.assert_close(r2.grad, 2 * kept)
    assert r1.grad.data_ptr() != r2.grad.data_ptr()


def test_a_bias_operand_does_not_replace_the_modules_bias(tmp_path):
    m = evtc.nn.FusedLinear(16, 24, lambda acc, bias: acc + bias, cache_dir=tmp_path)
    with pytest.raises(evtc.CallError, match="own parameter"):
        m(torch.randn(4, 16), bias=torch.randn(24))


def test_second_derivatives_are_refused_not_wrong(tmp_path):
    """The saved accumulator is not differentiable: backward(create_graph=True) through the layer
    would drop every term through it (a gradient penalty off by up to 0.9), so it raises, also where
    the incoming gradient does not require grad (``y.sum()``: once_differentiable alone returned a
    gradient with no graph, and the penalty's own gradient silently missed it)."""
    m = evtc.nn.FusedLinear(16, 24, lambda acc, bias: F.gelu(acc + bias), cache_dir=tmp_path)
    x = torch.randn(4, 16, requires_grad=True)
    for loss in (lambda y: y.square().sum(), lambda y: y.sum()):
        with pytest.raises(RuntimeError, match="second derivative"):
            torch.autograd.grad(loss(m(x)), x, create_graph=True)  # a gradient penalty
        with pytest.raises(RuntimeError, match="second derivative"):
            loss(m(x)).backward(create_graph=True)
    lin = evtc.linear(lambda acc, bias: acc + bias,
                      dict(x=torch.randn(4, 16), weight=torch.randn(24, 16), bias=torch.randn(24)),
                      cache_dir=tmp_path)
    w = torch.randn(24, 16, requires_grad=True)
    with pytest.raises(RuntimeError, match="second derivative"):
        torch.autograd.grad(lin(x, w, bias=torch.randn(24)).sum(), w, create_graph=True)
    mlp = evtc.nn.MLP(16, 32, lambda acc: F.relu(acc), lambda acc: acc, cache_dir=tmp_path)
    with pytest.raises(RuntimeError, match="second derivative"):
        torch.autograd.grad(mlp(x).sum(), x, create_graph=True)
    # First derivatives are as before.
    (dx,) = torch.autograd.grad(m(x).sum(), x)
    assert dx.shape == x.shape


def test_fused_linear_under_fullgraph_compile_says_to_call_it_eagerly_first(tmp_path):
    m = evtc.nn.FusedLinear(16, 24, lambda acc, bias: acc + bias, cache_dir=tmp_path)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="call the layer once eagerly"):
        torch.compile(m, backend="eager", fullgraph=True)(torch.randn(4, 16))


def test_fused_linear_takes_no_input_features_and_names_bad_x(tmp_path):
    """in_features = 0 gives the bias broadcast, as nn.Linear does; an x that is not a tensor of at
    least one dim is a CallError, not an error from deep inside."""
    m = evtc.nn.FusedLinear(0, 4, lambda acc, bias: acc + bias, cache_dir=tmp_path)
    y = m(torch.randn(3, 0))
    torch.testing.assert_close(y, m.bias.detach().expand(3, 4))
    for bad in (torch.tensor(1.0), [1.0, 2.0]):
        with pytest.raises(evtc.CallError, match="x must be a"):
            m(bad)


@pytest.mark.parametrize("x_lead, residual_shape", [
    ((3, 5), (1, 5, 24)), ((3, 5), (5, 24)), ((3, 5), (3, 1, 24)), ((3, 5), (3, 1, 1)), ((3, 5), (1, 1, 24)),
    ((2, 4), (4, 24)), ((2, 7), (7, 1)), ((2, 3, 4), (3, 4, 24)), ((2, 3, 4), (3, 1, 24))])
def test_operands_that_broadcast_over_some_leading_dims(x_lead, residual_shape, tmp_path):
    """An operand that torch broadcasts over some of x's leading dims ((S, N) beside x of (B, S, K))
    is expanded to them: values and gradients (summed over the broadcast) are torch's; they were
    refused as having more dims than the flattened accumulator, and (S, N) with an S other than
    the leading-dims probe's sizes as failing in PyTorch."""
    m = evtc.nn.FusedLinear(16, 24, lambda acc, residual: acc + residual, bias=False, cache_dir=tmp_path)
    x = torch.randn(*x_lead, 16, requires_grad=True)
    r = torch.randn(residual_shape, requires_grad=True)
    y = m(x, residual=r)
    xr, rr = x.detach().clone().requires_grad_(), r.detach().clone().requires_grad_()
    want = F.linear(xr, m.weight) + rr
    _close(y, want, "forward")
    g = torch.randn_like(want)
    y.backward(g)
    want.backward(g)
    _close(r.grad, rr.grad, "residual gradient")
    _close(x.grad, xr.grad, "x gradient")


def test_operands_that_do_not_broadcast_against_the_leading_dims_are_refused(tmp_path):
    """A (B*S, N) operand beside x of (B, S, K) fails in torch; it is refused, not read as rows of
    the flattened x."""
    m = evtc.nn.FusedLinear(16, 24, lambda acc, residual: acc + residual, bias=False, cache_dir=tmp_path)
    x = torch.randn(3, 5, 16)
    m(x, residual=torch.randn(5, 24))
    with pytest.raises(evtc.CallError, match="does not broadcast"):
        m(x, residual=torch.randn(15, 24))


def _add_bias_residual(acc, bias, residual):
    return acc + bias + residual


def test_a_batch_or_sequence_of_one_is_the_same_layer(tmp_path):
    """The layer's cache key reads operands as the kernel gets them, x's leading dims flattened: a
    batch of 1 or a sequence of 1 builds no other kernel (it built one per pattern of 1s, and
    torch.compile(fullgraph=True), warmed up at batch 2, failed at batch 1), and M = 1 (one
    token) is served by the kernel of the (M, N) residual, which broadcasts alike there."""
    m = evtc.nn.FusedLinear(16, 24, _add_bias_residual, cache_dir=tmp_path).eval()
    with torch.no_grad():
        for lead in [(2, 5), (1, 5), (2, 1), (1, 1), (4, 3), (1,)]:
            x = torch.randn(*lead, 16)
            r = torch.randn(*lead, 24)
            _close(m(x, residual=r), F.linear(x, m.weight, m.bias) + r, f"x of {lead}")
        assert len(m._compiled) == 1
        # A one-token first call compiles from its (1, N) operands; the (M, N) call then compiles
        # the tile kernel, and one token after that is served by either.
        fresh = evtc.nn.FusedLinear(16, 24, _add_bias_residual, cache_dir=tmp_path).eval()
        for lead in [(1, 1), (3, 5), (1, 1)]:
            x, r = torch.randn(*lead, 16), torch.randn(*lead, 24)
            _close(fresh(x, residual=r), F.linear(x, fresh.weight, fresh.bias) + r, f"fresh {lead}")
        assert len(fresh._compiled) == 2
        # A (1, 1, N) operand beside many tokens is a row, not the tile: the one-token kernel,
        # compiled from a (1, N) residual, read it as one.
        x, row = torch.randn(3, 5, 16), torch.randn(1, 1, 24)
        _close(fresh(x, residual=row), F.linear(x, fresh.weight, fresh.bias) + row, "row")
        assert len(fresh._compiled) == 2
        other = evtc.nn.FusedLinear(16, 24, _add_bias_residual, cache_dir=tmp_path).eval()
        other.load_state_dict(fresh.state_dict())
        other(torch.randn(3, 5, 16), residual=torch.randn(3, 5, 24))
        _close(other(x, residual=row), F.linear(x, fresh.weight, fresh.bias) + row, "row, other")
        assert len(other._compiled) == 2


def _sigmoid_scaled(acc, alpha=2.0):
    return torch.sigmoid(acc) * alpha


def test_a_runtime_scalar_left_out_reads_its_default_in_the_backward_too():
    w = torch.randn(16, 8)
    lin = evtc.linear(_sigmoid_scaled, {"x": torch.randn(4, 8), "weight": w, "alpha": 0.5})
    x, wr = torch.randn(3, 4, 8, requires_grad=True), w.clone().requires_grad_()
    xr = x.detach().clone().requires_grad_()
    y, want = lin(x, wr), _sigmoid_scaled(F.linear(xr, w))
    _close(y, want, "forward")
    y.sum().backward()
    want.sum().backward()
    _close(x.grad, xr.grad, "x gradient")


def _scaled_gate(acc, bias, scale: float, gate=None):
    y = acc + bias
    return y * scale if gate is None else y * scale * gate


def test_one_token_calls_with_numbers_and_optional_operands(tmp_path):
    """At M = 1 a layer compiled at M > 1 serves the call whatever else its operands are (a Python
    number, an optional tensor left out): the lookup compared them as tensors and failed."""
    m = evtc.nn.FusedLinear(16, 24, _scaled_gate, cache_dir=tmp_path).eval()
    with torch.no_grad():
        for lead, gate in [((4,), True), ((1,), False), ((1,), True), ((2, 3), False)]:
            x = torch.randn(*lead, 16)
            ops = {"scale": 0.5, **({"gate": torch.randn(*lead, 24)} if gate else {})}
            _close(m(x, **ops), _scaled_gate(F.linear(x, m.weight), m.bias, **ops), f"{lead} {gate}")
    assert len(m._compiled) == 2  # with and without the gate


def test_a_layer_warmed_at_one_batch_compiles_and_exports_with_dynamic_dims(tmp_path):
    m = evtc.nn.FusedLinear(16, 24, _add_bias_residual, cache_dir=tmp_path).eval()

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = m

        def forward(self, x):
            return self.proj(x, residual=x[..., :8].repeat(1, 1, 3))

    block = Block()
    with torch.no_grad():
        block(torch.randn(2, 5, 16))
        compiled = torch.compile(block, fullgraph=True, dynamic=True, backend="aot_eager")
        for lead in [(3, 7), (1, 7), (2, 1)]:
            x = torch.randn(*lead, 16)
            _close(compiled(x), block(x), f"compiled at {lead}")
        batch, seq = torch.export.Dim("batch", min=2), torch.export.Dim("seq", min=2)
        exported = torch.export.export(block, (torch.randn(2, 5, 16),),
                                       dynamic_shapes={"x": {0: batch, 1: seq}})
        x = torch.randn(3, 4, 16)
        _close(exported.module()(x), block(x), "exported")
    assert len(m._compiled) == 1


@evtc.epilogue
def decorated_bias_relu(acc, bias):
    return torch.relu(acc + bias)


def test_a_module_with_a_decorated_epilogue_saves_and_loads():
    """torch.save of a module whose epilogue is an @evtc.epilogue function (pickled by reference,
    as functions are: its name holds the decorator's wrapper)."""
    import io

    layer = evtc.nn.FusedLinear(16, 8, decorated_bias_relu)
    x = torch.randn(3, 16)
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.epilogue is decorated_bias_relu
    assert torch.equal(loaded(x), layer(x))


def test_mlp_runs_hooked_or_replaced_layers_as_themselves():
    """A forward hook on a layer, pruning (a pre-hook that recomputes the weight from weight_orig)
    and a layer wrapped by another module: the block calls its layers, with grad on as with it
    off, and trains as the same block of nn.Linear layers does."""
    import torch.nn.utils.prune as prune

    torch.manual_seed(0)
    block = evtc.nn.MLP(16, 12, swiglu)
    x = torch.randn(5, 16, requires_grad=True)
    handle = block.up.register_forward_hook(lambda module, args, out: out * 0)
    assert torch.equal(block(x), torch.zeros(5, 16))
    handle.remove()

    reference = torch.nn.ModuleDict({"up": torch.nn.Linear(16, 24, bias=False),
                                     "down": torch.nn.Linear(12, 16, bias=False)})
    with torch.no_grad():
        reference.up.weight.copy_(block.up.weight)
        reference.down.weight.copy_(block.down.weight)
    for model in (block, reference):
        prune.l1_unstructured(model.up, "weight", amount=0.5)
    mine = torch.optim.SGD(block.parameters(), lr=0.1)
    theirs = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):  # each step's forward must see the pruned, updated weight
        y = block(x)
        want = reference.down(swiglu(reference.up(x)))
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
        for opt, out in ((mine, y), (theirs, want)):
            opt.zero_grad()
            out.square().sum().backward()
            opt.step()
    torch.testing.assert_close(block.up.weight_orig, reference.up.weight_orig, rtol=1e-5, atol=1e-5)

    class Scaled(torch.nn.Module):  # an adapter around the second layer
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, h):
            return 2 * self.inner(h)

    wrapped = evtc.nn.MLP(16, 12, swiglu)
    plain = wrapped.down(wrapped.up(x))
    wrapped.down = Scaled(wrapped.down)
    y = wrapped(x)
    torch.testing.assert_close(y, 2 * plain)
    y.sum().backward()
    assert wrapped.down.inner.weight.grad is not None


def test_modules_on_meta_tensors_under_autocast_and_jit():
    """Meta inputs give meta outputs (shape inference), as nn.Linear; a float16 x under a bfloat16
    autocast is cast as nn.Linear's is; TorchScript is refused by name."""
    layer = evtc.nn.FusedLinear(16, 8, bias_gelu, device="meta")
    assert layer(torch.randn(3, 16, device="meta")).shape == (3, 8)
    block = evtc.nn.MLP(16, 12, swiglu, device="meta")
    assert block(torch.randn(2, 3, 16, device="meta")).shape == (2, 3, 16)

    layer = evtc.nn.FusedLinear(16, 8, bias_gelu)
    reference = torch.nn.Linear(16, 8)
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(3, 16, dtype=torch.float16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = layer(x), F.gelu(reference(x))
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)

    with pytest.raises(evtc.CallError, match="torch.jit.script"):
        torch.jit.script(layer)
    with pytest.raises(evtc.CallError, match="torch.jit.trace"):
        torch.jit.trace(layer, (torch.randn(3, 16),))


def test_out_of_other_leading_dims_or_expanded_is_refused():
    """out= whose leading dims are not x's ((S, B, N) or (1, B*S, N) for x of (B, S, K)) would be
    filled row by row in another order: refused by name, as an expanded out= (its elements share
    memory), before anything is written."""
    w, bias = torch.randn(24, 16), torch.randn(24)
    x = torch.randn(3, 5, 16)
    lin = evtc.linear(lambda acc, bias: acc + bias, {"x": x, "weight": w, "bias": bias})
    for shape in ((5, 3, 24), (1, 15, 24), (15, 1, 24)):
        out = torch.full(shape, 7.0)
        with torch.no_grad(), pytest.raises(evtc.CallError, match="leading dims are not x's"):
            lin(x, w, bias=bias, out=out)
        assert (out == 7).all()
    expanded = torch.full((1, 5, 24), 7.0).expand(3, 5, 24)
    with torch.no_grad(), pytest.raises(evtc.CallError, match="share memory"):
        lin(x, w, bias=bias, out=expanded)
    assert (expanded == 7).all()


_SCALE = 2.0


def _scaled_gelu(acc, bias):
    return F.gelu(acc * _SCALE + bias)


def test_gradients_of_a_function_changed_since_are_refused(tmp_path, monkeypatch):
    """The backward is derived on the first differentiable call. If a global the epilogue reads
    changed after evtc.linear, the function as it is now is not the kernel's: an error, never the
    gradients of another function than the one the forward computes."""
    x = torch.randn(8, 16).requires_grad_()
    w, bias = torch.randn(24, 16), torch.randn(24)
    lin = evtc.linear(_scaled_gelu, dict(x=x, weight=w, bias=bias), cache_dir=tmp_path)
    monkeypatch.setitem(globals(), "_SCALE", 3.0)
    with pytest.raises(evtc.CompileError, match="no longer traces to the graph"):
        lin(x, w, bias=bias)
    monkeypatch.setitem(globals(), "_SCALE", 2.0)  # the function as compiled: gradients as torch's
    y = lin(x, w, bias=bias)
    y.sum().backward()
    xe = x.detach().clone().requires_grad_()
    _scaled_gelu(xe @ w.t(), bias).sum().backward()
    _close(x.grad, xe.grad, "x.grad")


def test_fused_linear_in_float64_passes_gradcheck_and_a_replaced_epilogue_is_used(tmp_path):
    """nn.Linear's .double() and torch.autograd.gradcheck: no kernel multiplies float64, so the
    layer runs its epilogue on torch's product (an MLP likewise); an epilogue replaced on the module
    is the one the next call runs; evtc.linear names an input dtype it cannot multiply."""
    from evtc.nn import MLP, FusedLinear

    torch.manual_seed(0)
    layer = FusedLinear(6, 5, bias_gelu, cache_dir=tmp_path).double()
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    assert layer(x).dtype == torch.float64
    assert torch.autograd.gradcheck(lambda x, w, b: bias_gelu(F.linear(x, w), b),
                                    (x, layer.weight, layer.bias))
    assert torch.autograd.gradcheck(lambda x: layer(x), (x,))
    mlp = MLP(6, 8, F.gelu, cache_dir=tmp_path).double()
    torch.testing.assert_close(mlp(x), mlp.down(mlp.up(x)))

    layer = FusedLinear(6, 5, bias_gelu, cache_dir=tmp_path)
    x32 = torch.randn(3, 6)
    torch.testing.assert_close(layer(x32), F.gelu(F.linear(x32, layer.weight, layer.bias)))
    layer.epilogue = evtc.epilogue(lambda acc, bias: torch.tanh(acc + bias))
    torch.testing.assert_close(layer(x32), torch.tanh(F.linear(x32, layer.weight, layer.bias)))

    with pytest.raises(evtc.CallError, match="x has dtype torch.int64"):
        evtc.linear(bias_gelu, dict(x=torch.ones(2, 6, dtype=torch.long), weight=torch.randn(5, 6),
                                    bias=torch.randn(5)), cache_dir=tmp_path)


def test_no_input_features_backward_as_nn_linear(tmp_path):
    """nn.Linear(0, n): y is the bias, x.grad is (rows, 0), the bias gets the summed gradient."""
    from evtc.nn import FusedLinear

    layer = FusedLinear(0, 7, bias_gelu, cache_dir=tmp_path)
    x = torch.randn(2, 3, 0, requires_grad=True)
    layer(x).sum().backward()
    xe = x.detach().clone().requires_grad_()
    be = layer.bias.detach().clone().requires_grad_()
    bias_gelu(F.linear(xe, layer.weight.detach()), be).sum().backward()
    assert x.grad.shape == (2, 3, 0)
    _close(layer.bias.grad, be.grad, "bias.grad")


def _add_residual(acc, residual):
    return acc + residual


def _changed_in_place(y):
    y.mul_(2)
    y[0] = 0
    return torch.relu_(y)


@pytest.mark.parametrize("lead", [(4,), (2, 3)])
def test_outputs_take_in_place_changes_as_nn_linears_do(lead, tmp_path):
    """A layer's outputs may be changed in place while autograd records (``y.mul_(2)``, ``y[0] = 0``,
    ``nn.ReLU(inplace=True)`` after the layer), with gradients as torch's: they were views made
    inside an autograd Function, which torch refuses to change in place."""
    from evtc.nn import MLP, FusedLinear

    torch.manual_seed(0)
    x = torch.randn(*lead, 16)
    fused = FusedLinear(16, 24, bias_gelu, cache_dir=tmp_path)
    plain = torch.nn.Linear(16, 24)
    plain.load_state_dict(fused.state_dict())
    _changed_in_place(fused(x)).square().sum().backward()
    _changed_in_place(F.gelu(plain(x))).square().sum().backward()
    _close(fused.weight.grad, plain.weight.grad, "weight")
    _close(fused.bias.grad, plain.bias.grad, "bias")

    block = MLP(16, 12, swiglu, _add_residual, cache_dir=tmp_path)
    _changed_in_place(block(x, residual=x)).square().sum().backward()
    up, down = block.up.weight.detach().requires_grad_(), block.down.weight.detach().requires_grad_()
    _changed_in_place(swiglu(x @ up.t()) @ down.t() + x).square().sum().backward()
    _close(block.up.weight.grad, up.grad, "MLP up")
    _close(block.down.weight.grad, down.grad, "MLP down")


def test_reductions_cut_from_one_allocation_take_in_place_changes(tmp_path):
    """A per-row reduction (a piece of one allocation with the others) changed in place, gradients
    as torch's (torch's amax saves its result, so its in-place change is torch's error)."""
    g = torch.Generator().manual_seed(1)
    x, bias = torch.randn(6, 16, generator=g), torch.randn(24, generator=g)
    w = torch.randn(24, 16, generator=g, requires_grad=True)
    lin = evtc.linear(with_stats, {"x": x, "weight": w, "bias": bias}, cache_dir=tmp_path)
    w_ref = w.detach().clone().requires_grad_()
    for outputs in (lin(x, w, bias=bias), with_stats(x @ w_ref.t(), bias)):
        y, sums, maxima = outputs
        sums.mul_(3)
        (y.square().sum() + sums.sum() + maxima.square().sum()).backward()
    _close(w.grad, w_ref.grad, "weight")


def test_torch_func_transforms_are_refused_by_name_and_vmap_without_grad_runs(tmp_path):
    """torch.func's grad, vjp and vmap while autograd records cannot run evtc's autograd: a CallError
    that says what to use instead (torch's own was about an autograd.Function's setup_context);
    vmap of the forward under no_grad runs, one call per sample."""
    from evtc.nn import MLP, FusedLinear

    torch.manual_seed(0)
    x, xs = torch.randn(4, 16), torch.randn(3, 4, 16)
    layer = FusedLinear(16, 24, bias_gelu, cache_dir=tmp_path)
    block = MLP(16, 12, swiglu, _add_residual, cache_dir=tmp_path)
    a, b, bias = torch.randn(8, 16), torch.randn(16, 24), torch.randn(24)
    k = evtc.compile(bias_gelu, {"a": a, "b": b, "bias": bias}, cache_dir=tmp_path)
    params = dict(layer.named_parameters())
    attempts = [
        lambda: torch.func.grad(lambda p: torch.func.functional_call(layer, p, (x,)).sum())(params),
        lambda: torch.func.vjp(layer, x)[1](torch.ones(4, 24)),
        lambda: torch.func.vmap(layer)(xs),
        lambda: torch.func.grad(lambda xx: block(xx, residual=xx).sum())(x),
        lambda: torch.func.grad(lambda aa: k(aa, b, bias=bias).sum())(a),
    ]
    for attempt in attempts:
        with pytest.raises(evtc.CallError, match="torch.func transforms"):
            attempt()
    with torch.no_grad():
        got = torch.func.vmap(layer)(xs)
        torch.testing.assert_close(got, F.gelu(xs @ layer.weight.t() + layer.bias), rtol=1e-5, atol=1e-5)
        got = torch.func.vmap(lambda aa: k(aa, b, bias=bias))(xs[:, :, :16].repeat(1, 2, 1))
        torch.testing.assert_close(got, bias_gelu(xs.repeat(1, 2, 1) @ b, bias), rtol=1e-5, atol=1e-5)


def test_a_frozen_weight_or_an_input_without_grad_costs_no_gemm(tmp_path, monkeypatch):
    """LoRA's frozen base layer: the backward makes no weight gradient (a GEMM as large as the
    forward's), and no input gradient where x needs none; what is wanted still matches torch."""
    import evtc.runtime.op_autograd as op_autograd

    calls = []
    real_weight, real_input = op_autograd.weight_gradient, op_autograd.input_gradients
    monkeypatch.setattr(op_autograd, "weight_gradient", lambda *a: calls.append("dW") or real_weight(*a))

    def counted_input(d, a, b, *, need_a=True, need_b=True):
        calls.extend(["dA"] * need_a + ["dB"] * need_b)
        return real_input(d, a, b, need_a=need_a, need_b=need_b)

    monkeypatch.setattr(op_autograd, "input_gradients", counted_input)
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(2, 5, 16, generator=g), torch.randn(24, 16, generator=g)
    bias = torch.randn(24, generator=g)
    lin = evtc.linear(bias_gelu, {"x": x, "weight": w, "bias": bias}, cache_dir=tmp_path)
    xg = x.clone().requires_grad_()
    lin(xg, w, bias=bias).square().sum().backward()
    assert calls == ["dA"]
    xr = x.clone().requires_grad_()
    bias_gelu(xr @ w.t(), bias).square().sum().backward()
    _close(xg.grad, xr.grad, "x")
    calls.clear()
    wg = w.clone().requires_grad_()
    lin(x, wg, bias=bias).square().sum().backward()
    assert calls == ["dW"]
    wr = w.clone().requires_grad_()
    bias_gelu(x @ wr.t(), bias).square().sum().backward()
    _close(wg.grad, wr.grad, "weight")
    calls.clear()
    a, b = torch.randn(8, 16, generator=g), torch.randn(16, 24, generator=g)
    k = evtc.compile(bias_gelu, {"a": a, "b": b, "bias": bias}, cache_dir=tmp_path)
    ag = a.clone().requires_grad_()
    k(ag, b, bias=bias).square().sum().backward()
    assert calls == ["dA"]
    ar = a.clone().requires_grad_()
    bias_gelu(ar @ b, bias).square().sum().backward()
    _close(ag.grad, ar.grad, "a")


def test_what_the_backward_never_reads_is_not_saved(tmp_path):
    """A residual (its gradient is the incoming one) and x beside a frozen weight are not saved for
    the backward: changing them in place between forward and backward is legal, as in eager torch,
    and the gradients are torch's; an operand the backward reads (a scale) is still guarded."""
    from evtc.nn import MLP

    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(4, 16, generator=g, requires_grad=True), torch.randn(24, 16, generator=g)
    r = torch.randn(4, 24, generator=g)
    lin = evtc.linear(_add_residual, {"x": x, "weight": w, "residual": r}, cache_dir=tmp_path)
    wg = w.clone().requires_grad_()
    y = lin(x, wg, residual=r)
    r.add_(1.0)
    y.square().sum().backward()
    wr, xr = w.clone().requires_grad_(), x.detach().clone().requires_grad_()
    (F.linear(xr, wr) + r - 1.0).square().sum().backward()
    _close(wg.grad, wr.grad, "weight")
    _close(x.grad, xr.grad, "x")

    h = x.detach() * 1.0
    y = lin(h, wg, residual=r)  # h needs no gradient: x is saved only for the weight's
    frozen = lin(h.requires_grad_(), w, residual=r)  # a frozen weight: x is not saved
    with torch.no_grad():
        h.add_(1.0)
    frozen.sum().backward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()

    scaled = evtc.linear(residual_scaled, {"x": x, "weight": w, "residual": r, "scale": torch.ones(24),
                                           "alpha": 0.5}, cache_dir=tmp_path)
    scale = torch.randn(24, generator=g)
    y = scaled(x, w, residual=r, scale=scale, alpha=0.5)
    scale.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()

    block = MLP(16, 12, swiglu, _add_residual, cache_dir=tmp_path)
    residual = torch.randn(4, 16, generator=g)
    out = block(x.detach(), residual=residual)
    residual.add_(1.0)
    out.square().sum().backward()
    up, down = block.up.weight.detach().requires_grad_(), block.down.weight.detach().requires_grad_()
    (swiglu(x.detach() @ up.t()) @ down.t() + residual - 1.0).square().sum().backward()
    _close(block.up.weight.grad, up.grad, "MLP up")
    _close(block.down.weight.grad, down.grad, "MLP down")


def test_mlp_names_an_activation_that_is_no_tile_and_an_x_that_is_no_tensor(tmp_path):
    from evtc.nn import MLP

    with pytest.raises(evtc.CallError, match=r"activation must return one tensor, an \(M, hidden\) tile"):
        MLP(32, 64, lambda acc: acc.amax(), cache_dir=tmp_path)
    block = MLP(32, 64, torch.relu, cache_dir=tmp_path)
    for x in (None, [1.0, 2.0], torch.tensor(1.0)):
        with pytest.raises(evtc.CallError, match="x must be a"):
            block(x)


def test_a_sparse_x_computes_as_f_linear_does(tmp_path):
    from evtc.nn import FusedLinear

    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(8, 16, generator=g), torch.randn(24, 16, generator=g)
    bias = torch.randn(24, generator=g)
    lin = evtc.linear(bias_gelu, {"x": x, "weight": w, "bias": bias}, cache_dir=tmp_path)
    _close(lin(x.to_sparse(), w, bias=bias), F.gelu(F.linear(x.to_sparse(), w) + bias), "sparse x")
    layer = FusedLinear(16, 24, bias_gelu, cache_dir=tmp_path)
    _close(layer(x.to_sparse()), bias_gelu(x @ layer.weight.t(), layer.bias), "FusedLinear")


def test_linear_takes_operands_by_position(tmp_path):
    """lin(x, w, C, alpha) passes the operands in the order of the epilogue's parameters, as
    calling the function would and as a kernel's call does; too many, or one twice, is named."""
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(2, 3, 16, generator=g), torch.randn(24, 16, generator=g)
    residual, scale = torch.randn(2, 3, 24, generator=g), torch.randn(24, generator=g)
    lin = evtc.linear(residual_scaled, {"x": x, "weight": w, "residual": residual, "scale": scale,
                                        "alpha": 0.5}, cache_dir=tmp_path)
    want = residual_scaled(x @ w.t(), residual, scale, 0.5)
    _close(lin(x, w, residual, scale, 0.5), want, "by position")
    _close(lin(x, w, residual, scale=scale, alpha=0.5), want, "by position and name")
    with pytest.raises(evtc.CallError, match="at most 5 positional arguments"):
        lin(x, w, residual, scale, 0.5, 1.0)
    with pytest.raises(evtc.CallError, match="multiple values for 'residual'"):
        lin(x, w, residual, residual=residual, scale=scale, alpha=0.5)


def _geglu(acc):
    gate, up = acc.chunk(2, dim=-1)
    return F.gelu(gate) * up


def _plus_residual(acc, residual):
    return acc + residual


def test_mlp_fused_backward_step_follows_a_replaced_activation():
    """The fused backward step (dZ1 in the epilogue of dZ2 @ W2) was kept per dtypes and operand
    kinds only: after ``block.up.epilogue = geglu`` it still differentiated SwiGLU (18% off). It is
    now kept per first layer too, and computes the new activation's dZ1 (its generated kernel runs
    on the torch path here)."""
    block = evtc.nn.MLP(16, 24, swiglu, _plus_residual, dtype=torch.bfloat16)
    x = torch.randn(2, 5, 16, dtype=torch.bfloat16)
    w1, w2 = block.up.weight.detach(), block.down.weight.detach()
    x2, dz2 = x.reshape(-1, 16), torch.randn(10, 16, dtype=torch.bfloat16)
    old, _ = block.dz_kernel(block.first_linear(x, {}, w1), dz2, w2, {})
    block.up.epilogue = _geglu
    first = block.first_linear(x, {}, w1)
    new, _ = block.dz_kernel(first, dz2, w2, {})
    assert new is not old
    acc = x2.float() @ w1.float().t()
    gate, up = (h.clone().requires_grad_() for h in acc.chunk(2, -1))
    (F.gelu(gate) * up).backward(dz2.float() @ w2.float())
    want = torch.cat([gate.grad, up.grad], -1)
    got = torch.empty(10, 48, dtype=torch.bfloat16)
    saved = {name: half.bfloat16() for name, half in zip(["saved_gate", "saved_up"], acc.chunk(2, -1),
                                                          strict=True)}
    assert set(new.operand_names) == set(saved), new.operand_names
    new(dz2, w2, **saved, out=(got[:, :24], got[:, 24:]))
    error = ((got.float() - want).norm() / want.norm()).item()
    assert error < 1e-2, f"dZ1 of the new activation: relative error {error:.3g} (bfloat16 output)"


def test_mlp_runs_a_layer_whose_forward_is_patched_on_the_instance():
    """An adapter patches a layer's forward on the instance (types.MethodType, as PEFT and offload
    hooks do): MLP honoured it under no_grad only, and with grad ran the fused pair, which reads
    the parameters past the patch. Both modes now run the patched forward."""
    import types

    block = evtc.nn.MLP(16, 24, swiglu, _plus_residual)
    delta = torch.randn(48, 16) * 0.1

    def patched(self, x, **operands):
        return swiglu(F.linear(x, self.weight + delta))

    block.up.forward = types.MethodType(patched, block.up)
    x = torch.randn(2, 5, 16, requires_grad=True)
    want = swiglu(F.linear(x, block.up.weight + delta)) @ block.down.weight.t() + x
    with torch.no_grad():
        _close(block(x, residual=x), want, "no_grad")
    got = block(x, residual=x)
    _close(got, want, "with grad")
    mine = torch.autograd.grad(got.sum(), [x, block.up.weight])
    for name, a, b in zip(["x", "up weight"], mine, torch.autograd.grad(want.sum(), [x, block.up.weight]),
                          strict=True):
        _close(a, b, name)


def test_a_one_row_call_while_another_thread_adds_a_kernel(monkeypatch):
    """A one-row call looks for a compiled kernel that serves it among the layer's kernels while
    another thread's first call may add one: it iterated the dict itself ('dictionary changed size
    during iteration'). Simulated by an addition while the first candidate is examined."""
    from evtc import nn as evtc_nn

    layer = evtc.nn.FusedLinear(16, 24, _plus_residual, bias=False)
    layer(torch.randn(3, 16), residual=torch.randn(3, 24))  # a (M, N) residual's kernel
    examine = evtc_nn._serves

    def meanwhile(*args):
        if ("another thread's kernel",) in layer._compiled:
            return examine(*args)
        layer._compiled[("another thread's kernel",)] = None
        return False  # this candidate does not serve: the search goes on

    monkeypatch.setattr(evtc_nn, "_serves", meanwhile)
    x, residual = torch.randn(1, 16), torch.randn(1, 24)
    _close(layer(x, residual=residual), x @ layer.weight.t() + residual, "one row")


def test_compiling_under_no_grad_changes_no_gradient():
    """Inference code compiles under torch.no_grad(); the trace runs with gradients enabled all the
    same, so the kernel's backward is the function's (no value is taken as detached)."""
    x = torch.randn(6, 16).half()
    w = torch.randn(24, 16).half()
    bias = torch.randn(24).half()  # widened to float32 as it is loaded: that cast is evtc's, before the call
    with torch.no_grad():
        graph = evtc.trace(bias_gelu, {"a": x, "b": w.t(), "bias": bias})
    assert not [n for n in graph if n.op == "detach"]
    with torch.inference_mode():
        graph = evtc.trace(bias_gelu, {"a": x, "b": w.t(), "bias": bias})
    assert not [n for n in graph if n.op == "detach"]


def _tanh_scaled_times_tile(acc, C, alpha: float):
    return torch.tanh(acc * alpha) * C


def _applies_on_cpu(x, weight, saved):
    """evtc.dz_pass.applies without its GPU and 16-bit conditions."""
    return bool(saved)


def _silu(acc):
    return F.silu(acc)


def _every_operand_kind(acc, colscale, C, s, bias):
    return F.gelu(acc * colscale + bias) * C + s


def _swiglu_with_a_bias_as_wide_as_the_gemm(acc, bias):
    gate, up = (acc + bias).chunk(2, dim=-1)
    return F.silu(gate) * up


def _spy_on_the_dz_pass(monkeypatch):
    """The results of evtc.dz_pass.gradients (None where it did not apply), with the pass forced on
    CPU tensors, where its kernel runs as its torch path."""
    from evtc import dz_pass

    monkeypatch.setattr(dz_pass, "applies", _applies_on_cpu)
    ran = []
    real = dz_pass.gradients
    monkeypatch.setattr(dz_pass, "gradients", lambda *a: ran.append(real(*a)) or ran[-1])
    return ran


@pytest.mark.parametrize("fn, lead, n, operands, scalars", [
    (swiglu, (6,), 2 * 12, {}, {}),
    (bias_gelu, (2, 3), 24, {"bias": lambda g: torch.randn(24, generator=g)}, {}),
    (_tanh_scaled_times_tile, (7,), 16, {"C": lambda g: torch.randn(7, 16, generator=g)}, {"alpha": 0.7}),
    (_silu, (2, 5), 8, {}, {}),
    (_every_operand_kind, (2, 3), 16, {"colscale": lambda g: torch.randn(2, 3, 1, generator=g),
                                       "C": lambda g: torch.randn(2, 3, 16, generator=g),
                                       "s": lambda g: torch.randn((), generator=g),
                                       "bias": lambda g: torch.randn(16, generator=g)}, {}),
])
@pytest.mark.parametrize("trained", [False, True])
def test_dz_as_one_kernel_gives_autograds_gradients(monkeypatch, tmp_path, fn, lead, n, operands, scalars,
                                                    trained):
    """The backward's dZ as one elementwise kernel over the saved accumulator (evtc.dz_pass; on the
    GPU for 16-bit inputs, here forced on CPU, where the kernel runs as its torch path), with the
    gradients of the operands that need one (``trained``: a bias's summed over the rows, a per-row
    scale's over the columns, a scalar's over the tile, a tile's elementwise) from the same kernel:
    every gradient equals torch autograd's in float64, and the pass ran."""
    ran = _spy_on_the_dz_pass(monkeypatch)
    g = torch.Generator().manual_seed(1)
    k = 16
    x = torch.randn(*lead, k, generator=g).requires_grad_()
    w = torch.randn(n, k, generator=g).requires_grad_()
    ops = {name: make(g).requires_grad_(trained) for name, make in operands.items()}
    lin = evtc.linear(fn, {"x": x, "weight": w, **ops, **scalars}, cache_dir=tmp_path)
    got = lin(x, w, **ops, **scalars)
    wide = {name: v.detach().double().requires_grad_() for name, v in ops.items()}
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want = fn(xd @ wd.t(), **wide, **scalars)
    upstream = torch.randn(want.shape, generator=g, dtype=torch.float64)
    inputs = [x, w, *(ops.values() if trained else ())]
    mine = torch.autograd.grad(got, inputs, upstream.float())
    ref = torch.autograd.grad(want, [xd, wd, *(wide.values() if trained else ())], upstream)
    for name, a, b in zip(["x", "weight", *(ops if trained else ())], mine, ref, strict=True):
        assert a.shape == b.shape and a.dtype == torch.float32, name
        _close(a.double(), b, name)
    assert len(ran) == 1 and ran[0] is not None, "the dZ pass did not run"
    needed = tuple(ops) if trained else ()
    kernel, epilogue = lin._dz_passes[needed]
    assert epilogue.operand_grads == needed
    assert epilogue.saved and epilogue.fn.__code__.co_varnames[:2] == ("acc", "grad")


@pytest.mark.parametrize("fn, operands", [
    (swiglu, {}),
    (bias_gelu, {"bias": lambda g: torch.randn(24, generator=g)}),
    (_every_operand_kind, {"colscale": lambda g: torch.randn(2, 3, 1, generator=g),
                           "C": lambda g: torch.randn(2, 3, 24, generator=g),
                           "s": lambda g: torch.randn((), generator=g),
                           "bias": lambda g: torch.randn(24, generator=g)}),
])
def test_dz_as_one_kernel_in_bfloat16_as_on_the_gpu(monkeypatch, tmp_path, fn, operands):
    """bfloat16 inputs, as the pass runs on the GPU (its 16-bit GEMMs forced on CPU too): the
    incoming gradient is bfloat16, the kernel is compiled for it and runs (a kernel compiled for
    another dtype would be skipped, silently slow), and every gradient is within bfloat16's rounding
    of torch autograd's in float64."""
    from evtc.runtime import op_autograd

    ran = _spy_on_the_dz_pass(monkeypatch)
    monkeypatch.setattr(op_autograd, "low_precision", lambda a, b: a.dtype == b.dtype == torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 16, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(24, 16, generator=g) * 0.25).bfloat16().requires_grad_()
    ops = {name: make(g).bfloat16().requires_grad_() for name, make in operands.items()}
    lin = evtc.linear(fn, {"x": x, "weight": w, **ops}, cache_dir=tmp_path)
    y = lin(x, w, **ops)
    assert y.dtype == torch.bfloat16
    dy = torch.randn(y.shape, generator=g).bfloat16()
    mine = torch.autograd.grad(y, [x, w, *ops.values()], dy)
    wide = [t.detach().double().requires_grad_() for t in (x, w, *ops.values())]
    want = torch.autograd.grad(fn(wide[0] @ wide[1].t(), **dict(zip(ops, wide[2:], strict=True))),
                               wide, dy.double())
    assert len(ran) == 1 and ran[0] is not None, "the dZ pass did not run"
    kernel, epilogue = lin._dz_passes[tuple(ops)]
    assert kernel.call_spec.operand_dtypes["grad"] == torch.bfloat16
    # dZ and a tile operand's gradient leave the kernel in bfloat16; the sums in float32.
    # (The kernel writes its outputs in its output order, the epilogue returns them in its own.)
    written = dict(zip(kernel.plan.output_order, (dt for _, dt in kernel.output_meta(6, 24, 1)), strict=True))
    returned = [written[name] for name in kernel.plan.structure.names]
    tiles = {name for name, v in ops.items() if v.dim() >= 2 and v.shape[-1] == 24 and v.shape[-2] > 1}
    assert returned == [torch.bfloat16] * (2 if epilogue.gated else 1) + [
        torch.bfloat16 if name in tiles else torch.float32 for name in epilogue.operand_grads]
    for name, a, b in zip(["x", "weight", *ops], mine, want, strict=True):
        assert a.dtype == torch.bfloat16, name
        err = ((a.double() - b).norm() / b.norm()).item()
        assert err < 2e-2, f"{name}: relative error {err:.3g} by norm"


def _gelu_masked_by(acc, C):
    return torch.where(C > 0, F.gelu(acc), acc * 0.5)


def test_dz_as_one_kernel_steps_aside_where_it_cannot_give_an_operands_gradient(monkeypatch, tmp_path):
    """An operand that requires grad but gets none from the graph (a mask: ``C > 0``): the pass
    cannot give it one, so the reference backward runs, and every gradient matches torch's."""
    ran = _spy_on_the_dz_pass(monkeypatch)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 16, generator=g).requires_grad_()
    w = torch.randn(12, 16, generator=g).requires_grad_()
    C = torch.randn(5, 12, generator=g).requires_grad_()
    lin = evtc.linear(_gelu_masked_by, {"x": x, "weight": w, "C": C}, cache_dir=tmp_path)
    got = lin(x, w, C=C)
    xd, wd, cd = (t.detach().double().requires_grad_() for t in (x, w, C))
    want = _gelu_masked_by(xd @ wd.t(), cd)
    upstream = torch.randn(want.shape, generator=g, dtype=torch.float64)
    mine = torch.autograd.grad(got, [x, w, C], upstream.float(), allow_unused=True, materialize_grads=True)
    ref = torch.autograd.grad(want, [xd, wd, cd], upstream, allow_unused=True, materialize_grads=True)
    for name, a, b in zip(["x", "weight"], mine, ref, strict=False):
        _close(a.double(), b, name)
    assert not mine[2].any() and not ref[2].any()
    assert ran == [None] and lin._dz_passes[("C",)] is False


def test_dz_kernel_takes_its_streaming_tile_or_the_selectors(monkeypatch, tmp_path):
    """The dZ kernel is pinned to cooperative 128 x 128 tiles without clusters (evtc.dz_pass.PASS_CONFIG);
    where that configuration does not compile it is compiled with the selector's choices instead."""
    from evtc import dz_pass

    meta = {"device": "meta", "dtype": torch.bfloat16}
    example = {"x": torch.empty(64, 32, **meta), "weight": torch.empty(2 * 48, 32, **meta)}
    lin = evtc.linear(swiglu, example, arch="sm_90a", cache_dir=tmp_path)
    kernel, epilogue = dz_pass.build(lin)
    config, _ = kernel.launch_for(4096, 48, dz_pass.PASS_K)
    got = (config.schedule, config.tile_m, config.tile_n, config.cluster)
    assert got == ("cooperative", 128, 128, (1, 1))
    assert epilogue.gated and epilogue.saved == ("saved_gate", "saved_up")
    monkeypatch.setattr(dz_pass, "PASS_CONFIG", {"tile_n": 7})  # refused by the configuration's checks
    lin = evtc.linear(swiglu, example, arch="sm_90a", cache_dir=tmp_path)
    kernel, _ = dz_pass.build(lin)
    assert kernel.launch_for(4096, 48, dz_pass.PASS_K)[0].tile_n != 7


def _gelu_in_float32(acc):
    return F.gelu(acc).float()


def test_dz_kernel_of_a_float32_output_takes_a_float32_incoming_gradient(monkeypatch, tmp_path):
    """An epilogue returning float32 from bfloat16 inputs receives a float32 incoming gradient: the
    dZ kernel is compiled for it, and the gradients match torch's."""
    from evtc import dz_pass
    from evtc.runtime import op_autograd

    monkeypatch.setattr(dz_pass, "applies", _applies_on_cpu)
    # 16-bit GEMMs after a 16-bit dZ, as on the GPU (the CPU reference runs float32 ones).
    monkeypatch.setattr(op_autograd, "low_precision", lambda a, b: a.dtype == b.dtype == torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, 16, generator=g).bfloat16().requires_grad_()
    w = torch.randn(24, 16, generator=g).bfloat16().requires_grad_()
    lin = evtc.linear(_gelu_in_float32, {"x": x, "weight": w}, cache_dir=tmp_path)
    y = lin(x, w)
    assert y.dtype == torch.float32
    dy = torch.randn(y.shape, generator=g)
    gx, gw = torch.autograd.grad(y, [x, w], dy)
    kernel, _ = lin._dz_passes[()]
    assert kernel.call_spec.operand_dtypes["grad"] == torch.float32
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want = torch.autograd.grad(_gelu_in_float32(xd @ wd.t()).double(), [xd, wd], dy.double())
    for name, a, b in zip(["x", "weight"], (gx, gw), want, strict=True):
        assert a.dtype == torch.bfloat16, name
        err = ((a.double() - b).norm() / b.norm()).item()
        assert err < 1e-2, f"{name}: relative error {err:.3g} by norm"


def test_dz_as_one_kernel_takes_a_bias_of_another_rank(monkeypatch, tmp_path):
    """A (1, N) bias beside an (N,) example is a view the forward takes, and the pass's kernel too
    (the bias meets dZ's full tile before its column sum, so the rank changes no shape; the pass
    refused it before, and the reference backward ran): every gradient matches torch's, the
    bias's in its own (1, N) shape."""
    ran = _spy_on_the_dz_pass(monkeypatch)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(6, 16, generator=g).requires_grad_()
    w = torch.randn(24, 16, generator=g).requires_grad_()
    example = {"x": x, "weight": w, "bias": torch.randn(24, generator=g)}
    lin = evtc.linear(bias_gelu, example, cache_dir=tmp_path)
    b = torch.randn(1, 24, generator=g).requires_grad_()
    mine = torch.autograd.grad(lin(x, w, bias=b).sum(), [x, w, b])
    xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, b))
    want = torch.autograd.grad(bias_gelu(xd @ wd.t(), bd).sum(), [xd, wd, bd])
    for name, a, r in zip(["x", "weight", "bias"], mine, want, strict=True):
        assert a.shape == r.shape, name
        _close(a.double(), r, name)
    assert len(ran) == 1 and ran[0] is not None


def _gelu_plus_bias_in_bf16(acc, bias):
    return (F.gelu(acc) + bias).to(torch.bfloat16)


def test_dz_kernel_sums_operand_gradients_in_float32(monkeypatch, tmp_path):
    """A float32 bias added after the activation of bf16 inputs: its gradient, the incoming bf16
    gradient summed over the rows, is summed and returned in float32, not rounded to bf16."""
    from evtc.runtime import op_autograd

    ran = _spy_on_the_dz_pass(monkeypatch)
    monkeypatch.setattr(op_autograd, "low_precision", lambda a, b: a.dtype == b.dtype == torch.bfloat16)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 16, generator=g).bfloat16().requires_grad_()
    w = torch.randn(24, 16, generator=g).bfloat16().requires_grad_()
    bias = torch.randn(24, generator=g).requires_grad_()
    lin = evtc.linear(_gelu_plus_bias_in_bf16, {"x": x, "weight": w, "bias": bias}, cache_dir=tmp_path)
    dy = torch.randn(64, 24, generator=g).bfloat16()
    (gb,) = torch.autograd.grad(lin(x, w, bias=bias), [bias], dy)
    assert ran and ran[-1] is not None, "the dZ pass did not run"
    want = dy.double().sum(0)
    assert gb.dtype == torch.float32
    assert ((gb.double() - want).norm() / want.norm()).item() < 1e-6


def _gelu_bias_times_row(acc, C, bias):
    return F.gelu(acc + bias) * C


@pytest.mark.parametrize("lead", [(), (1,)])
def test_dz_kernel_of_a_one_row_example(monkeypatch, tmp_path, lead):
    """A layer built from a one-row example (x of shape (K,) or (1, K): a decode step) compiles its
    dZ kernel for tiles of incoming gradient and saved accumulator (an example of one row would
    make them row vectors, and the build fail), keeps the kinds the forward gave the operands (C,
    of shape (N,) or (1, N), a row vector), and gives autograd's gradients on one-row calls."""
    ran = _spy_on_the_dz_pass(monkeypatch)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(*lead, 16, generator=g).requires_grad_()
    w = torch.randn(24, 16, generator=g).requires_grad_()
    C = torch.randn(*lead, 24, generator=g)
    bias = torch.randn(24, generator=g).requires_grad_()
    lin = evtc.linear(_gelu_bias_times_row, {"x": x, "weight": w, "C": C, "bias": bias}, cache_dir=tmp_path)
    got = lin(x, w, C=C, bias=bias)
    xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, bias))
    want = _gelu_bias_times_row(xd @ wd.t(), C.double(), bd)
    upstream = torch.randn(want.shape, generator=g, dtype=torch.float64)
    mine = torch.autograd.grad(got, [x, w, bias], upstream.float())
    ref = torch.autograd.grad(want, [xd, wd, bd], upstream)
    for name, a, b in zip(["x", "weight", "bias"], mine, ref, strict=True):
        assert a.shape == b.shape, name
        _close(a.double(), b, name)
    assert len(ran) == 1 and ran[0] is not None, "the dZ pass did not run"


def test_dz_kernel_multiplies_zeros_kept_between_calls(monkeypatch, tmp_path):
    """The pass's GEMM multiplies zeros kept per device and dtype (grown for a larger call, never
    written): two backwards of different row counts give autograd's gradients, and the zeros they
    shared are still zeros and large enough for both."""
    from evtc import dz_pass

    ran = _spy_on_the_dz_pass(monkeypatch)
    monkeypatch.setattr(dz_pass, "_ZEROS", {})
    g = torch.Generator().manual_seed(9)
    w = torch.randn(24, 16, generator=g).requires_grad_()
    bias = torch.randn(24, generator=g)
    lin = None
    for rows in (5, 40):
        x = torch.randn(rows, 16, generator=g).requires_grad_()
        lin = lin or evtc.linear(bias_gelu, {"x": x, "weight": w, "bias": bias}, cache_dir=tmp_path)
        got = lin(x, w, bias=bias)
        xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        want = bias_gelu(xd @ wd.t(), bias.double())
        upstream = torch.randn(want.shape, generator=g, dtype=torch.float64)
        mine = torch.autograd.grad(got, [x, w], upstream.float())
        ref = torch.autograd.grad(want, [xd, wd], upstream)
        for name, a, b in zip(["x", "weight"], mine, ref, strict=True):
            _close(a.double(), b, name)
    assert len(ran) == 2 and None not in ran, "the dZ pass did not run"
    ((key, zeros),) = dz_pass._ZEROS.items()
    assert key == (torch.device("cpu"), torch.float32)
    assert zeros.numel() >= 40 * dz_pass.PASS_K and not zeros.any()


def _gelu_and_row_means(acc, bias):
    y = F.gelu(acc + bias)
    return y, y.mean(-1)  # a size of the forward in dZ: its 1/N


def _rows_of_tanh(acc):
    return torch.tanh(acc).sum(-1)


@pytest.mark.parametrize("fn, n, operands, scalars", [
    (four_outputs, 16, {"scale": lambda g: torch.rand(16, generator=g),
                         "C": lambda g: torch.randn(16, 16, generator=g)}, {}),
    (tile_and_pre_residual, 16, {"bias": lambda g: torch.randn(16, generator=g),
                                  "C": lambda g: torch.randn(16, 16, generator=g)}, {"alpha": 0.7}),
    (gated_with_stats, 32, {"scale": lambda g: torch.rand(16, 1, generator=g) + 0.5}, {}),
    (_rows_of_tanh, 16, {}, {}),
    (_gelu_and_row_means, 16, {"bias": lambda g: torch.randn(16, generator=g)}, {}),
])
@pytest.mark.parametrize("trained", [False, True])
def test_dz_as_one_kernel_of_several_outputs(monkeypatch, tmp_path, fn, n, operands, scalars, trained):
    """Epilogues of several outputs, and one whose output is a per-row sum: each output's incoming
    gradient is an operand of the dZ kernel of its own, in the shape the output has (a per-row sum's
    as (M, 1), with M = N = 16 here; the kernel took one incoming gradient as a tile, and a per-row
    sum's (M,) failed to reshape to it), and every gradient equals torch autograd's in float64."""
    ran = _spy_on_the_dz_pass(monkeypatch)
    g = torch.Generator().manual_seed(21)
    x = torch.randn(16, 8, generator=g).requires_grad_()
    w = torch.randn(n, 8, generator=g).requires_grad_()
    ops = {name: make(g).requires_grad_(trained) for name, make in operands.items()}
    lin = evtc.linear(fn, {"x": x, "weight": w, **ops, **scalars}, cache_dir=tmp_path)
    got = lin(x, w, **ops, **scalars)
    wide = {name: v.detach().double().requires_grad_() for name, v in ops.items()}
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want = fn(xd @ wd.t(), **wide, **scalars)
    if isinstance(want, dict):
        got, want = list(got.values()), list(want.values())
    elif not isinstance(want, tuple):
        got, want = (got,), (want,)
    dys = [torch.randn(v.shape, generator=g, dtype=torch.float64) for v in want]
    mine = torch.autograd.grad(got, [x, w, *(ops.values() if trained else ())], [d.float() for d in dys])
    ref = torch.autograd.grad(want, [xd, wd, *(wide.values() if trained else ())], dys)
    for name, a, b in zip(["x", "weight", *(ops if trained else ())], mine, ref, strict=True):
        assert a.shape == b.shape, name
        _close(a.double(), b, name)
    assert len(ran) == 1 and ran[0] is not None, "the dZ pass did not run"
    _, epilogue = lin._dz_passes[tuple(ops) if trained else ()]
    assert len(epilogue.grads) == len(want)


def _swiglu_times_a_wide_scale(acc, scale):
    gate, up = (acc * scale).chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("fn", [_swiglu_with_a_bias_as_wide_as_the_gemm, _swiglu_times_a_wide_scale])
@pytest.mark.parametrize("trained", [False, True])
def test_dz_pass_of_a_gated_epilogue_with_a_wide_operand(monkeypatch, tmp_path, fn, trained):
    """A gated epilogue over ``acc + bias`` or ``acc * scale``, the operand as wide as the GEMM: the
    pass computes each half from the saved halves and the operand's halves (views passed as
    ``bias_gate``, ``bias_up``), dZ after the join too (``acc * scale``: the joined halves'
    gradients times the scale, half by half), and a trained operand's gradient as its two halves'
    column sums, joined. Gradients equal torch autograd's in float64, and the pass ran."""
    ran = _spy_on_the_dz_pass(monkeypatch)
    g = torch.Generator().manual_seed(22)
    x = torch.randn(2, 5, 16, generator=g, requires_grad=True)
    w = torch.randn(48, 16, generator=g, requires_grad=True)
    operand = (torch.rand(48, generator=g) + 0.5).requires_grad_(trained)
    name = "bias" if fn is _swiglu_with_a_bias_as_wide_as_the_gemm else "scale"
    lin = evtc.linear(fn, {"x": x, "weight": w, name: operand}, cache_dir=tmp_path)
    got = lin(x, w, **{name: operand})
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    od = operand.detach().double().requires_grad_(trained)
    want = fn(xd @ wd.t(), od)
    dy = torch.randn(want.shape, generator=g, dtype=torch.float64)
    mine = torch.autograd.grad(got, [x, w, *([operand] if trained else [])], dy.float())
    ref = torch.autograd.grad(want, [xd, wd, *([od] if trained else [])], dy)
    for what, a, b in zip(["x", "weight", name], mine, ref, strict=False):
        _close(a.double(), b, what)
    assert ran[0] is not None, "the dZ pass did not run"
    _, epilogue = lin._dz_passes[(name,) if trained else ()]
    assert [(operand, index) for _, operand, index in epilogue.halves] == [(name, 0), (name, 1)]
    assert epilogue.split_grads == ((name,) if trained else ())
    assert f"{name}_gate" in epilogue.source and ".chunk(" not in epilogue.source


def _bias_gelu(acc, bias):
    return F.gelu(acc + bias)


def _bias_residual(acc, bias, residual):
    return acc + bias + residual


@pytest.mark.parametrize("activation, output, hidden", [
    (_bias_gelu, _bias_residual, 24),
    (_swiglu_with_a_bias_as_wide_as_the_gemm, _bias_residual, 12),
])
@pytest.mark.parametrize("trained", [False, True])
def test_mlp_fused_step_gives_the_first_bias_gradient(monkeypatch, tmp_path, activation, output, hidden,
                                                        trained):
    """evtc.nn.MLP with biases, the first layer's dZ in the epilogue of dZ2 @ W2 (on the GPU for
    16-bit inputs; here forced on CPU, where the kernel runs as its torch path): a trained first
    bias's gradient comes from that kernel (a column sum of dZ1; a gated layer's bias, as wide as
    its GEMM, from dZ1's two halves), and every gradient equals torch autograd's in float64."""
    from evtc import mlp_autograd

    monkeypatch.setattr(mlp_autograd, "fused_applies", lambda x, w1, w2: True)
    g = torch.Generator().manual_seed(7)
    torch.manual_seed(7)
    block = evtc.nn.MLP(16, hidden, activation, output, bias=True, cache_dir=tmp_path)
    block.up.bias.requires_grad_(trained)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    x = torch.randn(2, 5, 16, generator=g).requires_grad_()
    y = block(x, residual=x)
    dy = torch.randn(y.shape, generator=g, dtype=torch.float64)
    params = [p for p in block.parameters() if p.requires_grad]
    mine = torch.autograd.grad(y, [x, *params], dy.float())
    wide = {n: p.detach().double().requires_grad_(p.requires_grad) for n, p in block.named_parameters()}
    xd = x.detach().double().requires_grad_()
    h = activation(xd @ wide["up.weight"].t(), wide["up.bias"])
    want_y = output(h @ wide["down.weight"].t(), wide["down.bias"], xd)
    want = torch.autograd.grad(want_y, [xd, *(v for v in wide.values() if v.requires_grad)], dy)
    names = ["x", *(n for n, p in block.named_parameters() if p.requires_grad)]
    assert ("up.bias" in names) == trained
    for name, a, b in zip(names, mine, want, strict=True):
        assert a.shape == b.shape, name
        _close(a.double(), b, name)
    (fused,) = [v for v in block._dz.values() if v]
    kernel, epilogue = fused
    assert epilogue.operand_grads == (("bias",) if trained else ())
    assert epilogue.fn.__code__.co_varnames[0] == "grad"
    if block.gated:
        assert {operand for _, operand, _ in epilogue.halves} == {"bias"}
        assert epilogue.split_grads == (("bias",) if trained else ())


def _scaled_down_gelu(acc, bias):
    return F.gelu(acc * 1e-3 + bias)


def _scaled_down_swiglu(acc):
    gate, up = (acc * 1e-3).chunk(2, dim=-1)
    return F.silu(gate) * up


def _float16_past_its_range(g, rows, k, n):
    """float16 x and weight whose products reach about 1e5, past float16's 65504."""
    x = (torch.randn(rows, k, generator=g) * 80).half().requires_grad_()
    w = (torch.randn(n, k, generator=g) * 80).half().requires_grad_()
    return x, w


@pytest.mark.parametrize("fn, n, operands", [
    (_scaled_down_gelu, 40, {"bias": 40}),
    (_scaled_down_swiglu, 48, {}),
])
@pytest.mark.parametrize("dz_kernel", [False, True])
def test_float16_accumulator_past_its_range_keeps_finite_gradients(monkeypatch, tmp_path, fn, n, operands,
                                                                      dz_kernel):
    """float16 inputs whose accumulator passes 65504 under an epilogue that scales it back down:
    the forward (on the float32 accumulator) is finite, and so must be the gradients. The saved
    accumulator was float16 (infinities, then NaN gradients); it is now kept in float32
    (``saved_accumulator_dtype``), for the reference backward and the dZ kernel (``dz_kernel``:
    forced on CPU, where it runs as its torch path) alike. Gradients against float64 autograd."""
    from evtc.runtime import op_autograd

    ran = None
    if dz_kernel:  # (its 16-bit GEMMs forced on CPU too, as on the GPU)
        ran = _spy_on_the_dz_pass(monkeypatch)
        monkeypatch.setattr(op_autograd, "low_precision", lambda a, b: a.dtype == b.dtype == torch.float16)
    g = torch.Generator().manual_seed(6)
    x, w = _float16_past_its_range(g, 4, 64, n)
    ops = {name: torch.randn(size, generator=g).half().requires_grad_() for name, size in operands.items()}
    lin = evtc.linear(fn, {"x": x, "weight": w, **ops}, cache_dir=tmp_path)
    y = lin(x, w, **ops)
    wide = [t.detach().double().requires_grad_() for t in (x, w, *ops.values())]
    acc = wide[0] @ wide[1].t()
    assert acc.abs().max() > 65504
    want_y = fn(acc, **dict(zip(ops, wide[2:], strict=True)))
    assert torch.isfinite(y).all()
    dy = torch.randn(want_y.shape, generator=g, dtype=torch.float64)
    mine = torch.autograd.grad(y, [x, w, *ops.values()], dy.half())
    want = torch.autograd.grad(want_y, wide, dy.half().double())
    for name, a, b in zip(["x", "weight", *ops], mine, want, strict=True):
        assert torch.isfinite(a).all(), f"{name}: non-finite gradient"
        err = ((a.double() - b).norm() / b.norm()).item()
        assert err < 5e-3, f"{name}: relative error {err:.3g}"
    if dz_kernel:
        assert ran and ran[0] is not None, "the dZ pass did not run"


def _plus_bias(acc, bias):
    return acc + bias


def test_mlp_float16_accumulator_past_its_range_keeps_finite_gradients(monkeypatch, tmp_path):
    """evtc.nn.MLP in float16 with a first accumulator past 65504 scaled back down by its
    activation: the fused step (forced on CPU, its kernel's torch path) reads the first layer's
    accumulator saved in float32, and every gradient is finite and float64 autograd's."""
    from evtc import mlp_autograd
    from evtc.runtime import op_autograd

    monkeypatch.setattr(mlp_autograd, "fused_applies", lambda x, w1, w2: True)
    # (Its 16-bit GEMMs forced on CPU too, as on the GPU: dZ2 in float16.)
    monkeypatch.setattr(op_autograd, "low_precision", lambda a, b: a.dtype == b.dtype == torch.float16)
    g = torch.Generator().manual_seed(8)
    block = evtc.nn.MLP(64, 24, _scaled_down_gelu, _plus_bias, bias=True, dtype=torch.float16,
                        cache_dir=tmp_path)
    x, w1 = _float16_past_its_range(g, 6, 64, 24)
    with torch.no_grad():
        block.up.weight.copy_(w1)
        block.down.weight.copy_(torch.randn(64, 24, generator=g).half())
        for bias in (block.up.bias, block.down.bias):
            bias.copy_(torch.randn(bias.shape, generator=g).half())
    y = block(x)
    params = list(block.parameters())
    wide = [t.detach().double().requires_grad_() for t in (x, *params)]
    xd, w1d, b1d, w2d, b2d = wide
    want_y = _scaled_down_gelu(xd @ w1d.t(), b1d) @ w2d.t() + b2d
    assert (xd @ w1d.t()).abs().max() > 65504
    dy = torch.randn(want_y.shape, generator=g, dtype=torch.float64).half()
    mine = torch.autograd.grad(y, [x, *params], dy)
    want = torch.autograd.grad(want_y, wide, dy.double())
    for name, a, b in zip(["x", "up.weight", "up.bias", "down.weight", "down.bias"], mine, want, strict=True):
        assert torch.isfinite(a).all(), f"{name}: non-finite gradient"
        err = ((a.double() - b).norm() / b.norm()).item()
        assert err < 5e-3, f"{name}: relative error {err:.3g}"
    (fused,) = [v for v in block._dz.values() if v]
    assert fused[0].call_spec.operand_dtypes["saved"] == torch.float32


def test_mlp_builds_no_fused_kernel_inside_a_cuda_graph_capture(monkeypatch, tmp_path):
    """evtc.nn.MLP's fused step is compiled on first use: a first use inside a CUDA graph capture
    (a build launches work a capture refuses) takes the unfused step, capture-safe, and leaves the
    build to the next backward outside a capture (here on CPU: the capture state patched, the
    fused step forced, its kernel running as its torch path)."""
    from evtc import mlp_autograd

    monkeypatch.setattr(mlp_autograd, "fused_applies", lambda x, w1, w2: True)
    block = evtc.nn.MLP(16, 24, _bias_gelu, _bias_residual, bias=True, cache_dir=tmp_path)
    x = torch.randn(6, 16, requires_grad=True)
    first = block.first_linear(x, {"bias": block.up.bias})
    w2, dz2 = block.down.weight.detach(), torch.randn(6, 16)
    with monkeypatch.context() as capturing:
        capturing.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda")))
        capturing.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        assert block.dz_kernel(first, dz2, w2, {"bias": block.up.bias.detach()}, ("bias",)) is None
    assert not block._dz  # nothing cached: built by the first backward outside a capture
    built = block.dz_kernel(first, dz2, w2, {"bias": block.up.bias.detach()}, ("bias",))
    assert built is not None and built[1].operand_grads == ("bias",)


def test_a_narrower_operand_hint_names_x_leading_dims(tmp_path):
    """An (N,) operand where an (M, N) tile was compiled: the kernel's hint said
    ``.expand(20, 32)`` (the flattened rows), which evtc.linear then refused; it names x's
    leading dims, and that call works."""
    w = torch.randn(32, 16)
    example = {"x": torch.randn(20, 16), "weight": w, "R": torch.randn(20, 32)}
    lin = evtc.linear(lambda acc, R: acc + R, example, cache_dir=tmp_path)
    x, R = torch.randn(2, 10, 16), torch.randn(32)
    with pytest.raises(evtc.CallError, match=r"pass R\.expand\(2, 10, 32\)"):
        lin(x, w, R=R)
    _close(lin(x, w, R=R.expand(2, 10, 32)), x @ w.t() + R, "expanded as the hint says")


def test_block_scaled_pairs_are_refused_with_the_way_to_compile_them(tmp_path):
    """evtc.linear given DeepGEMM-style (tensor, scales) pairs said only "got a tuple and a tuple"."""
    e4m3 = torch.float8_e4m3fn
    x, w = torch.randn(64, 256).to(e4m3), torch.randn(384, 256).to(e4m3)
    with pytest.raises(evtc.CallError, match=r"\(tensor, scales\) pair.*evtc\.compile.*docs/fp8\.md"):
        evtc.linear(lambda acc: acc, {"x": (x, torch.rand(64, 2)), "weight": (w, torch.rand(3, 2))},
                    cache_dir=tmp_path)


@pytest.mark.parametrize("fn", [lambda acc: acc * len(acc.shape), lambda acc: acc / acc.dim() ** 0.5,
                                lambda acc: acc * int(acc.dim())], ids=["len_shape", "pow", "int"])
def test_other_forms_of_the_rank_as_a_value_are_refused(fn, tmp_path):
    """``len(acc.shape)``, a power of the rank, ``int(acc.dim())``: x's rank in torch, 2 in the
    kernel; they escaped the probe and gave silently other values (found by a review)."""
    w = torch.randn(24, 16)
    lin = evtc.linear(fn, {"x": torch.randn(5, 16), "weight": w}, cache_dir=tmp_path)
    for x in (torch.randn(2, 5, 16), torch.randn(16)):
        with pytest.raises(evtc.CallError, match="rank as a value"):
            lin(x, w)


def test_the_leading_verdict_is_kept_per_operand_name(tmp_path):
    """Two operands with the same patterns of size-1 dims in the other order are another call:
    ``acc + T, R * 2`` with R of (B, 1, N) makes torch's second output (B, 1, N) (the verdict
    keyed by the patterns in keyword order took it for the checked call, and returned (B, S, N))."""
    w = torch.randn(12, 16)
    fn = lambda acc, T, R: (acc + T, R * 2)  # noqa: E731
    example = {"x": torch.randn(6, 16), "weight": w, "T": torch.randn(6, 12), "R": torch.randn(6, 12)}
    lin = evtc.linear(fn, example, cache_dir=tmp_path)
    x = torch.randn(2, 3, 16)
    full, row = torch.randn(2, 3, 12), torch.randn(2, 1, 12)
    for g, r in zip(lin(x, w, T=row, R=full), fn(x @ w.t(), row, full), strict=True):
        _close(g, r, "checked call")
    with pytest.raises(evtc.CallError, match="has shape"):
        lin(x, w, R=row, T=full)


def test_under_torch_compile_leading_reads_are_refused_for_other_ranks(tmp_path):
    """Nothing watches the probe's reads while dynamo traces: an epilogue that reads more than a
    last dim refuses x of other than 2 dims there (it returned the flattened kernel's values)."""
    w = torch.randn(24, 16)
    lin = evtc.linear(lambda acc: acc / acc.shape[0], {"x": torch.randn(5, 16), "weight": w},
                      cache_dir=tmp_path)
    f = torch.compile(lambda x: lin(x, w), backend="eager")
    with pytest.raises(evtc.CallError, match="under torch.compile evtc.linear cannot tell"):
        f(torch.randn(2, 5, 16))
    x = torch.randn(7, 16)
    _close(f(x), (x @ w.t()) / 7, "2-d x")


def test_a_one_row_x_refuses_a_concatenated_shape(tmp_path):
    """``(acc.shape + ())[0]`` with a 1-d x is N in torch and the kernel's one row: refused (the
    probe watched indexing and unpacking only; a second review). ``acc.shape.numel()`` is the same
    either way and runs."""
    w = torch.randn(12, 16)
    lin = evtc.linear(lambda acc: acc * (acc.shape + ())[0], {"x": torch.randn(5, 16), "weight": w},
                      cache_dir=tmp_path)
    with pytest.raises(evtc.CallError, match="1-d x"):
        lin(torch.randn(16), w)
    lin = evtc.linear(lambda acc: acc / acc.shape.numel(), {"x": torch.randn(5, 16), "weight": w},
                      cache_dir=tmp_path)
    x = torch.randn(2, 5, 16)
    _close(lin(x, w), (x @ w.t()) / 120, "numel over every dim")


def test_out_of_another_width_names_the_callers_shape():
    """An out= with x's leading dims but another width is refused with the output's shape as the
    caller sees it (the kernel's check named the flattened (rows, N), itself refused)."""
    x, w, bias = torch.randn(2, 3, 16), torch.randn(12, 16), torch.randn(12)
    lin = evtc.linear(lambda acc, bias: acc + bias, {"x": x, "weight": w, "bias": bias})
    for shape in ((2, 3, 13), (2, 3, 12, 1), (2, 3)):
        with pytest.raises(evtc.CallError, match=r"out must have the output's shape \(2, 3, 12\), got "
                           + re.escape(str(shape))):
            lin(x, w, bias=bias, out=torch.empty(shape))
    out = torch.empty(2, 3, 12)
    assert lin(x, w, bias=bias, out=out) is out
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w, bias), rtol=1e-5, atol=1e-5)
