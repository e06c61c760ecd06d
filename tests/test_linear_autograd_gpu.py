"""GPU: the differentiable evtc.linear and FusedLinear in bfloat16 against torch.autograd of the same
function (the forward is the fused kernel; the backward the reference one of evtc.linear_autograd),
compared by norm: the forward rounds to bfloat16 as the kernel's output does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from mlp_cases import compiled_step
from several_outputs import four_outputs, gated_with_stats, tile_and_pre_residual, tile_and_row_sums

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


class _Block(torch.nn.Module):
    """Linear -> bias + GELU, then evtc.nn.MLP (SwiGLU, residual): every evtc autograd path."""

    def __init__(self) -> None:
        super().__init__()
        kw = {"device": "cuda", "dtype": torch.bfloat16}
        self.first = evtc.nn.FusedLinear(128, 128, bias_gelu, **kw)
        self.mlp = evtc.nn.MLP(128, 96, swiglu, _add_residual, **kw)

    def forward(self, x):
        h = self.first(x)
        return self.mlp(h, residual=h)


def _add_residual(acc, residual):
    return acc + residual


def _assert_kernels_ran(*layers):
    """Every evtc.Linear of ``layers`` ran an SM90 kernel (its own, or the twin that also stores the
    accumulator for the backward) and nothing took the torch path."""
    for layer in layers:
        for lin in layer._compiled.values():
            paths = {k.last_path for k in (lin.kernel, lin._saving) if k} - {""}
            assert paths == {"kernel"}, paths


def _step_grads(model, x, dy):
    model.zero_grad(set_to_none=True)
    x.grad = None
    model(x).backward(dy)
    return [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]


def test_training_step_captured_in_a_cuda_graph():
    """A whole training step (forward and backward through FusedLinear and MLP, their fused dZ
    kernel included) captured once in a CUDA graph and replayed on new inputs gives eager's
    gradients for those inputs."""
    torch.manual_seed(0)
    model = _Block()
    g = torch.Generator(device="cuda").manual_seed(2)
    static_x = torch.randn(200, 128, device="cuda", generator=g).bfloat16().requires_grad_()
    static_dy = torch.randn(200, 128, device="cuda", generator=g).bfloat16()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (builds every kernel) off the capture stream
        for _ in range(3):
            _step_grads(model, static_x, static_dy)
    torch.cuda.current_stream().wait_stream(side)
    _assert_kernels_ran(model.first, model.mlp.up, model.mlp.down)
    graph = torch.cuda.CUDAGraph()
    model.zero_grad(set_to_none=True)
    static_x.grad = None
    with torch.cuda.graph(graph):
        model(static_x).backward(static_dy)
    # The gradients the graph writes (the eager steps below rebind .grad to their own tensors).
    static_grads = [static_x.grad] + [p.grad for p in model.parameters()]
    for seed in (3, 4):
        g = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(200, 128, device="cuda", generator=g).bfloat16()
        dy = torch.randn(200, 128, device="cuda", generator=g).bfloat16()
        with torch.no_grad():
            static_x.copy_(x)
            static_dy.copy_(dy)
        for grad in static_grads:  # stale values must not pass for replayed ones
            grad.zero_()
        graph.replay()
        replayed = [grad.clone() for grad in static_grads]
        eager = _step_grads(model, x.clone().requires_grad_(), dy)
        for i, (a, b) in enumerate(zip(replayed, eager, strict=True)):
            _norm_close(a, b, f"gradient {i}", tol=1e-3)


def test_make_graphed_callables_on_a_fused_block():
    """torch.cuda.make_graphed_callables captures the block's forward and backward separately."""
    torch.manual_seed(0)
    model = _Block()
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(64, 128, device="cuda", generator=g).bfloat16().requires_grad_()
    graphed = torch.cuda.make_graphed_callables(model, (x,))
    _assert_kernels_ran(model.first, model.mlp.up, model.mlp.down)
    for seed in (6, 7):
        g = torch.Generator(device="cuda").manual_seed(seed)
        xi = torch.randn(64, 128, device="cuda", generator=g).bfloat16().requires_grad_()
        dy = torch.randn(64, 128, device="cuda", generator=g).bfloat16()
        model.zero_grad(set_to_none=True)
        graphed(xi).backward(dy)
        got = [xi.grad.clone()] + [p.grad.clone() for p in model.parameters()]
        want = _step_grads(model, xi.detach().clone().requires_grad_(), dy)
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            _norm_close(a, b, f"gradient {i}", tol=1e-3)


def test_fused_linears_in_one_fullgraph_compile():
    """Two FusedLinear layers (bias + GELU, then SwiGLU) in torch.compile(fullgraph=True) after an
    eager step built their kernels: each runs its twin's custom operator (the kernel that also stores
    the accumulator for the backward), and the gradients match float32 autograd."""
    torch.manual_seed(0)
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    first = evtc.nn.FusedLinear(128, 192, bias_gelu, **kw)
    gated = evtc.nn.FusedLinear(192, 256, swiglu, bias=False, **kw)
    g = torch.Generator(device="cuda").manual_seed(8)
    x = torch.randn(300, 128, device="cuda", generator=g).bfloat16().requires_grad_()
    dy = torch.randn(300, 128, device="cuda", generator=g).bfloat16()
    params = [x, first.weight, first.bias, gated.weight]
    torch.autograd.grad(gated(first(x)), params, dy)  # eager: builds the kernels and the twins
    twins = [lin._saving for part in (first, gated) for lin in part._compiled.values()]
    assert len(twins) == 2 and all(isinstance(t, evtc.Kernel) for t in twins)
    for t in twins:
        t.last_path = ""
    compiled = torch.compile(lambda x: gated(first(x)), fullgraph=True)
    y = compiled(x)
    mine = torch.autograd.grad(y, params, dy)
    assert all(t.last_path == "kernel" for t in twins), [t.last_path for t in twins]
    ref = [p.detach().float().requires_grad_() for p in params]
    want = swiglu(F.gelu(ref[0] @ ref[1].t() + ref[2]) @ ref[3].t())
    _norm_close(y, want, "forward")
    for name, a, b in zip(["x", "weight", "bias", "gated weight"], mine,
                          torch.autograd.grad(want, ref, dy.float()), strict=True):
        _norm_close(a, b, name)


def test_fused_linears_under_dynamic_shapes():
    """The same layers compiled with dynamic=True (what torch.compile turns on when the token count
    changes between calls): forward and backward traced at a symbolic M run the twins' operators at
    three token counts, with gradients that match float32 autograd at each."""
    torch.manual_seed(0)
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    first = evtc.nn.FusedLinear(128, 192, bias_gelu, **kw)
    gated = evtc.nn.FusedLinear(192, 256, swiglu, bias=False, **kw)
    g = torch.Generator(device="cuda").manual_seed(9)
    params = [first.weight, first.bias, gated.weight]
    warm = torch.randn(64, 128, device="cuda", generator=g).bfloat16().requires_grad_()
    gated(first(warm)).sum().backward()  # eager: builds the kernels and the twins
    compiled = torch.compile(lambda x: gated(first(x)), fullgraph=True, dynamic=True)
    for m in (300, 77, 1024):
        y, mine, ref, dy = compiled_step(compiled, params, m, 128, g)
        want = swiglu(F.gelu(ref[0] @ ref[1].t() + ref[2]) @ ref[3].t())
        _norm_close(y, want, f"forward at M={m}")
        for name, a, b in zip(["x", "weight", "bias", "gated weight"], mine,
                              torch.autograd.grad(want, ref, dy.float()), strict=True):
            _norm_close(a, b, f"{name} at M={m}")


def test_float32_modules_under_autocast_run_the_bf16_kernels():
    """Mixed-precision training: float32 FusedLinear and MLP parameters under
    torch.autocast("cuda", bfloat16) run evtc's bf16 kernels (not the float32 torch path), and
    their float32 gradients match nn.Linear's under the same autocast."""
    torch.manual_seed(0)
    layer = evtc.nn.FusedLinear(128, 192, bias_gelu, device="cuda")
    reference = torch.nn.Linear(128, 192, device="cuda")
    with torch.no_grad():
        reference.weight.copy_(layer.weight)
        reference.bias.copy_(layer.bias)
    g = torch.Generator(device="cuda").manual_seed(10)
    x = torch.randn(300, 128, device="cuda", generator=g, requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(x)
        want = F.gelu(reference(x))
    (lin,) = layer._compiled.values()
    assert lin.kernel.plan.a.dtype == "bfloat16" and isinstance(lin._saving, evtc.Kernel)
    assert y.dtype == torch.bfloat16 and lin._saving.last_path == "kernel"  # the differentiable call's
    dy = torch.randn(y.shape, device="cuda", generator=g).bfloat16()
    mine = torch.autograd.grad(y, [x, layer.weight, layer.bias], dy)
    theirs = torch.autograd.grad(want, [x, reference.weight, reference.bias], dy)
    for name, a, b in zip(["x", "weight", "bias"], mine, theirs, strict=True):
        assert a.dtype == torch.float32
        _norm_close(a, b, name)

    block = evtc.nn.MLP(128, 96, swiglu, _add_residual, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = block(x, residual=x)
    assert out.dtype == torch.float32  # a bf16 layer output plus a float32 residual, as in torch
    out.float().square().mean().backward()
    assert block.up.weight.grad.dtype == torch.float32
    kernels = [k for part in (block.up, block.down) for lin in part._compiled.values()
               for k in (lin.kernel, lin._saving) if isinstance(k, evtc.Kernel)]
    assert kernels and all(k.last_path in ("kernel", "") for k in kernels)
    assert any(k.last_path == "kernel" for k in kernels)


def test_out_slices_of_a_cache_are_written():
    """The kernel path of ``out=``: a (batch, seq, N) slice of a longer cache and a transposed
    buffer (copied into, no (M, N) view exists), a contiguous one (written directly); each call
    returns ``out`` and leaves the cache past the slice untouched."""
    def with_row_sums(acc, bias):
        y = torch.tanh(acc + bias)
        return y, y.float().square().sum(-1)

    w = torch.randn(256, 128, device="cuda").bfloat16()
    bias = torch.randn(256, device="cuda").bfloat16()
    x = torch.randn(3, 40, 128, device="cuda").bfloat16()
    lin = evtc.linear(with_row_sums, {"x": x, "weight": w, "bias": bias})
    want_y, want_s = with_row_sums(x.float() @ w.float().t(), bias.float())
    cache = torch.full((3, 64, 256), float("nan"), device="cuda").bfloat16()
    rows = torch.full((3, 64), float("nan"), device="cuda")
    with torch.no_grad():
        got = lin(x, w, bias=bias, out=(cache[:, :40], rows[:, :40]))
    assert got[0].data_ptr() == cache.data_ptr() and got[1].data_ptr() == rows.data_ptr()
    _norm_close(cache[:, :40], want_y, "sliced cache")
    _norm_close(rows[:, :40], want_s, "sliced rows")
    assert cache[:, 40:].isnan().all() and rows[:, 40:].isnan().all()
    seq_major = torch.full((40, 3, 256), float("nan"), device="cuda").bfloat16().transpose(0, 1)
    seq_rows = torch.full((40, 3), float("nan"), device="cuda").t()
    flat_y, flat_s = torch.empty_like(want_y, dtype=torch.bfloat16), torch.empty_like(want_s)
    with torch.no_grad():
        lin(x, w, bias=bias, out=(seq_major, seq_rows))
        assert lin(x, w, bias=bias, out=(flat_y, flat_s))[0] is flat_y
    for got_y, got_s, what in ((seq_major, seq_rows, "transposed"), (flat_y, flat_s, "contiguous")):
        _norm_close(got_y, want_y, what)
        _norm_close(got_s, want_s, what)


def _tanh_scaled_times_tile(acc, C, alpha: float):
    return torch.tanh(acc * alpha) * C


def _silu(acc):
    return F.silu(acc)


def _gelu_in_float32(acc):
    return F.gelu(acc).float()


def _every_operand_kind(acc, colscale, C, s, bias):
    return F.gelu(acc * colscale + bias) * C + s


def _swiglu_scaled(acc, colscale):
    gate, up = acc.chunk(2, dim=-1)
    return F.silu(gate) * up * colscale


_DZ_CASES = [
    (_gelu_in_float32, 72, {}, {}),
    (swiglu, 2 * 200, {}, {}),
    (bias_gelu, 136, {"bias": lambda g: torch.randn(136, device="cuda", generator=g)}, {}),
    (_tanh_scaled_times_tile, 96, {"C": lambda g: torch.randn(3, 37, 96, device="cuda", generator=g)},
     {"alpha": 0.7}),
    (_silu, 264, {}, {}),
    (_swiglu_scaled, 2 * 136,
     {"colscale": lambda g: torch.rand(3, 37, 1, device="cuda", generator=g) + 0.5}, {}),
    (_every_operand_kind, 200, {"colscale": lambda g: torch.rand(3, 37, 1, device="cuda", generator=g) + 0.5,
                                "C": lambda g: torch.randn(3, 37, 200, device="cuda", generator=g),
                                "s": lambda g: torch.randn((), device="cuda", generator=g),
                                "bias": lambda g: torch.randn(200, device="cuda", generator=g)}, {}),
]


# Each case as it is, and those with operands again with every operand trained.
_DZ_RUNS = [(*case, False) for case in _DZ_CASES] + [(*case, True) for case in _DZ_CASES if case[2]]


@pytest.mark.parametrize("fn, n, operands, scalars, trained", _DZ_RUNS)
@pytest.mark.parametrize("upstream", ["random", "sum"])
def test_dz_as_one_kernel_against_autograd(fn, n, operands, scalars, upstream, trained, monkeypatch):
    """dZ as one elementwise kernel over the saved accumulator (evtc.dz_pass: 16-bit inputs), with
    the gradients of the operands that need one (``trained``) from the same kernel; odd sizes and
    leading dims, a random incoming gradient or the expanded one of ``y.sum()``: every gradient
    against float32 autograd of the function, no less accurate than eager bfloat16 autograd, and
    the pass ran."""
    from evtc import dz_pass

    ran = []
    real = dz_pass.gradients
    monkeypatch.setattr(dz_pass, "gradients", lambda *a: ran.append(real(*a)) or ran[-1])
    g = torch.Generator(device="cuda").manual_seed(11)
    x = (torch.randn(3, 37, 96, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(n, 96, device="cuda", generator=g) * 96 ** -0.5).bfloat16().requires_grad_()
    ops = {name: make(g).bfloat16().requires_grad_(trained) for name, make in operands.items()}
    lin = evtc.linear(fn, {"x": x, "weight": w, **ops, **scalars})
    y = lin(x, w, **ops, **scalars)
    inputs = [x, w, *(ops.values() if trained else ())]
    wide = {k: v.detach().float().requires_grad_(trained) for k, v in ops.items()}
    xf, wf = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = fn(xf @ wf.t(), **wide, **scalars)
    ref_inputs = [xf, wf, *(wide.values() if trained else ())]
    eager = fn(x @ w.t(), **ops, **scalars)
    if upstream == "sum":
        mine = torch.autograd.grad(y.sum(), inputs)
        want = torch.autograd.grad(ref.sum(), ref_inputs)
        theirs = torch.autograd.grad(eager.sum(), inputs)
    else:
        dy = torch.randn(ref.shape, device="cuda", generator=g).bfloat16()
        mine = torch.autograd.grad(y, inputs, dy)
        want = torch.autograd.grad(ref, ref_inputs, dy.float())
        theirs = torch.autograd.grad(eager, inputs, dy)
    assert len(ran) == 1 and ran[0] is not None, "the dZ pass did not run"
    _no_less_accurate_than_eager(["x", "weight", *(ops if trained else ())], mine, want, theirs, inputs)


def _no_less_accurate_than_eager(names, mine, want, theirs, inputs):
    """Each of ``mine`` in its input's dtype and shape, close to ``want`` (float32 autograd) by norm,
    and no further from it than twice eager bfloat16 autograd's ``theirs`` (plus 1e-3)."""
    for name, got, exp, eager, given in zip(names, mine, want, theirs, inputs, strict=True):
        assert got.dtype == given.dtype and got.shape == exp.shape, name
        _norm_close(got, exp, name)
        err = (got.float() - exp.float()).norm() / exp.float().norm()
        err_eager = (eager.float() - exp.float()).norm() / exp.float().norm()
        assert err <= 2 * err_eager + 1e-3, f"{name}: {err:.3g} against eager's {err_eager:.3g}"


def _cuda_randn(*shape):
    return lambda g: torch.randn(shape, device="cuda", generator=g)


_RECOMPUTE_CASES = [
    # fn, lead (a batch), n, operands, scalars, b K-major (an nn.Linear weight's .t())
    (_gelu_in_float32, (), 72, {}, {}, False),
    (swiglu, (), 2 * 200, {}, {}, True),
    (swiglu, (3,), 2 * 136, {}, {}, False),
    (bias_gelu, (), 136, {"bias": _cuda_randn(136)}, {}, True),
    (bias_gelu, (2,), 136, {"bias": _cuda_randn(136)}, {}, False),
    (_swiglu_scaled, (), 2 * 136,
     {"colscale": lambda g: torch.rand(111, 1, device="cuda", generator=g) + 0.5}, {}, True),
    (_tanh_scaled_times_tile, (), 96, {"C": _cuda_randn(111, 96)}, {"alpha": 0.7}, False),
    (_every_operand_kind, (), 200,
     {"colscale": lambda g: torch.rand(111, 1, device="cuda", generator=g) + 0.5,
      "C": _cuda_randn(111, 200), "s": _cuda_randn(), "bias": _cuda_randn(200)}, {}, True),
]
# Each case as it is, and those with operands again with every operand trained.
_RECOMPUTE_RUNS = ([(*case, False) for case in _RECOMPUTE_CASES]
                   + [(*case, True) for case in _RECOMPUTE_CASES if case[3]])


@pytest.mark.parametrize("fn, lead, n, operands, scalars, k_major, trained", _RECOMPUTE_RUNS)
@pytest.mark.parametrize("upstream", ["random", "sum"])
def test_operator_backward_recomputes_dz_against_autograd(fn, lead, n, operands, scalars, k_major, trained,
                                                          upstream, monkeypatch):
    """A kernel's own operator (``k(a, b, ...)`` with inputs that require grad) saved no
    accumulator: its backward runs the forward's GEMM again with dZ (and the trained operands'
    gradients) as its epilogue (evtc.dz_pass.recomputed_gradients). Odd sizes, a batch, a K-major
    b, a random incoming gradient or the expanded one of ``y.sum()``: every gradient against
    float32 autograd of the function, no less accurate than eager bfloat16 autograd, and the kernel
    ran where it applies (not for a batch with trained operands, which the reference sums)."""
    from evtc import dz_pass

    ran = []
    real = dz_pass.recomputed_gradients
    monkeypatch.setattr(dz_pass, "recomputed_gradients", lambda *a: ran.append(real(*a)) or ran[-1])
    g = torch.Generator(device="cuda").manual_seed(12)
    a = (torch.randn(*lead, 111, 96, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(*lead, n, 96, device="cuda", generator=g) * 96 ** -0.5).bfloat16()
    b = (w if k_major else w.contiguous()).transpose(-1, -2)
    b = (b if k_major else b.contiguous()).detach().requires_grad_()
    ops = {name: make(g).bfloat16().requires_grad_(trained) for name, make in operands.items()}
    k = evtc.compile(fn, {"a": a, "b": b, **ops, **scalars})
    y = k(a, b, **ops, **scalars)
    inputs = [a, b, *(ops.values() if trained else ())]
    wide = {name: v.detach().float().requires_grad_(trained) for name, v in ops.items()}
    af, bf = a.detach().float().requires_grad_(), b.detach().float().requires_grad_()
    ref = fn(af @ bf, **wide, **scalars)
    ref_inputs = [af, bf, *(wide.values() if trained else ())]
    eager = fn(a @ b, **ops, **scalars)
    if upstream == "sum":
        mine = torch.autograd.grad(y.sum(), inputs)
        want = torch.autograd.grad(ref.sum(), ref_inputs)
        theirs = torch.autograd.grad(eager.sum(), inputs)
    else:
        dy = torch.randn(ref.shape, device="cuda", generator=g).to(y.dtype)
        mine = torch.autograd.grad(y, inputs, dy)
        want = torch.autograd.grad(ref, ref_inputs, dy.float())
        theirs = torch.autograd.grad(eager, inputs, dy)
    assert len(ran) == 1
    if lead and trained:
        assert ran == [None]
    else:
        assert ran[0] is not None, "the recomputing dZ kernel did not run"
    _no_less_accurate_than_eager(["a", "b", *(ops if trained else ())], mine, want, theirs, inputs)


def _gelu_and_row_means(acc, bias):
    y = F.gelu(acc + bias)
    return y, y.mean(-1)


def _swiglu_with_a_wide_bias(acc, bias):
    gate, up = (acc + bias).chunk(2, dim=-1)
    return F.silu(gate) * up


def _rows_of_tanh(acc, scale):
    return (torch.tanh(acc) * scale).sum(-1)


_SEVERAL_OUTPUT_CASES = [
    # fn, M, n, operands (made for M rows), scalars
    (four_outputs, 128, 128, {"scale": lambda g, m: torch.rand(128, device="cuda", generator=g),
                               "C": lambda g, m: torch.randn(m, 128, device="cuda", generator=g)}, {}),
    (four_outputs, 111, 200, {"scale": lambda g, m: torch.rand(200, device="cuda", generator=g),
                               "C": lambda g, m: torch.randn(m, 200, device="cuda", generator=g)}, {}),
    (tile_and_pre_residual, 111, 136, {"bias": lambda g, m: torch.randn(136, device="cuda", generator=g),
                                        "C": lambda g, m: torch.randn(m, 136, device="cuda", generator=g)},
     {"alpha": 0.7}),
    (gated_with_stats, 111, 2 * 136,
     {"scale": lambda g, m: torch.rand(m, 1, device="cuda", generator=g) + 0.5}, {}),
    (_rows_of_tanh, 128, 128, {"scale": lambda g, m: torch.rand(128, device="cuda", generator=g)}, {}),
    (_gelu_and_row_means, 111, 200, {"bias": lambda g, m: torch.randn(200, device="cuda", generator=g)}, {}),
]


def _outputs(value):
    if isinstance(value, dict):
        return list(value.values())
    return list(value) if isinstance(value, tuple) else [value]


@pytest.mark.parametrize("fn, m, n, operands, scalars", _SEVERAL_OUTPUT_CASES)
@pytest.mark.parametrize("trained", [False, True])
@pytest.mark.parametrize("path", ["operator", "linear"])
def test_several_outputs_take_the_dz_kernels_against_autograd(fn, m, n, operands, scalars, trained, path,
                                                              monkeypatch):
    """Epilogues of several outputs (a tile with a per-row, a per-column and a total sum of it; a
    tile and its pre-residual value; a gated one's dict), and one whose output is a per-row sum,
    at M = N too (where a per-row sum's incoming gradient, if taken as a bare (M,), reads as a row
    vector): a kernel's operator recomputes dZ as its GEMM's epilogue, a layer takes the dZ pass,
    with each output's incoming gradient an operand of the kernel. Every gradient against float32
    autograd of the function, no less accurate than eager bfloat16 autograd, and the kernel ran."""
    from evtc import dz_pass

    ran = []
    spied = "recomputed_gradients" if path == "operator" else "gradients"
    real = getattr(dz_pass, spied)
    monkeypatch.setattr(dz_pass, spied, lambda *a: ran.append(real(*a)) or ran[-1])
    g = torch.Generator(device="cuda").manual_seed(23)
    a = (torch.randn(m, 96, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(n, 96, device="cuda", generator=g) * 96 ** -0.5).bfloat16().requires_grad_()
    ops = {name: make(g, m).bfloat16().requires_grad_(trained) for name, make in operands.items()}
    if path == "operator":
        k = evtc.compile(fn, {"a": a, "b": w.t(), **ops, **scalars})
        got = _outputs(k(a, w.t(), **ops, **scalars))
    else:
        lin = evtc.linear(fn, {"x": a, "weight": w, **ops, **scalars})
        got = _outputs(lin(a, w, **ops, **scalars))
    inputs = [a, w, *(ops.values() if trained else ())]
    wide = {k: v.detach().float().requires_grad_(trained) for k, v in ops.items()}
    af, wf = a.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = _outputs(fn(af @ wf.t(), **wide, **scalars))
    eager = _outputs(fn(a @ w.t(), **ops, **scalars))
    dys = [torch.randn(r.shape, device="cuda", generator=g) for r in ref]
    mine = torch.autograd.grad(got, inputs, [d.to(y.dtype) for d, y in zip(dys, got, strict=True)])
    want = torch.autograd.grad(ref, [af, wf, *(wide.values() if trained else ())], dys)
    theirs = torch.autograd.grad(eager, inputs, [d.to(y.dtype) for d, y in zip(dys, eager, strict=True)])
    assert len(ran) == 1 and ran[0] is not None, "the dZ kernel did not run"
    _no_less_accurate_than_eager(["a", "weight", *(ops if trained else ())], mine, want, theirs, inputs)


def test_batched_operator_of_several_outputs_against_autograd(monkeypatch):
    """A batch of 3 with odd sizes: the per-row sums' incoming gradient reaches the recomputing
    kernel as per-batch columns; gradients against float32 autograd, no less accurate than eager's,
    and the kernel ran."""
    from evtc import dz_pass

    ran = []
    real = dz_pass.recomputed_gradients
    monkeypatch.setattr(dz_pass, "recomputed_gradients", lambda *a: ran.append(real(*a)) or ran[-1])
    g = torch.Generator(device="cuda").manual_seed(24)
    a = (torch.randn(3, 111, 96, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    b = (torch.randn(3, 96, 200, device="cuda", generator=g) * 96 ** -0.5).bfloat16().requires_grad_()
    bias = torch.randn(200, device="cuda", generator=g).bfloat16()
    k = evtc.compile(tile_and_row_sums, {"a": a, "b": b, "bias": bias})
    got = k(a, b, bias=bias)
    af, bf = a.detach().float().requires_grad_(), b.detach().float().requires_grad_()
    ref = tile_and_row_sums(af @ bf, bias.float())
    eager = tile_and_row_sums(a @ b, bias)
    dys = [torch.randn(r.shape, device="cuda", generator=g) for r in ref]
    mine = torch.autograd.grad(got, [a, b], [d.to(y.dtype) for d, y in zip(dys, got, strict=True)])
    want = torch.autograd.grad(ref, [af, bf], dys)
    theirs = torch.autograd.grad(eager, [a, b], [d.to(y.dtype) for d, y in zip(dys, eager, strict=True)])
    assert len(ran) == 1 and ran[0] is not None, "the recomputing dZ kernel did not run"
    _no_less_accurate_than_eager(["a", "b"], mine, want, theirs, [a, b])


@pytest.mark.parametrize("k_major, trained", [(False, False), (True, False), (True, True)])
def test_operator_backward_of_swiglu_with_a_wide_bias(k_major, trained, monkeypatch):
    """SwiGLU over ``acc + bias`` with the bias as wide as the GEMM: the recomputing kernel splits
    ``acc + bias`` as the forward does, and gives a trained bias's gradient as the column sums of
    dZ's two halves. Gradients against float32 autograd, no less accurate than eager's, and the
    kernel ran."""
    from evtc import dz_pass

    ran = []
    real = dz_pass.recomputed_gradients
    monkeypatch.setattr(dz_pass, "recomputed_gradients", lambda *a: ran.append(real(*a)) or ran[-1])
    g = torch.Generator(device="cuda").manual_seed(25)
    a = (torch.randn(111, 96, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(2 * 136, 96, device="cuda", generator=g) * 96 ** -0.5).bfloat16()
    b = (w.t() if k_major else w.t().contiguous()).detach().requires_grad_()
    bias = torch.randn(2 * 136, device="cuda", generator=g).bfloat16().requires_grad_(trained)
    k = evtc.compile(_swiglu_with_a_wide_bias, {"a": a, "b": b, "bias": bias})
    y = k(a, b, bias=bias)
    inputs = [a, b, *([bias] if trained else [])]
    af, bf = a.detach().float().requires_grad_(), b.detach().float().requires_grad_()
    biasf = bias.detach().float().requires_grad_(trained)
    ref = _swiglu_with_a_wide_bias(af @ bf, biasf)
    eager = _swiglu_with_a_wide_bias(a @ b, bias)
    dy = torch.randn(ref.shape, device="cuda", generator=g)
    mine = torch.autograd.grad(y, inputs, dy.bfloat16())
    want = torch.autograd.grad(ref, [af, bf, *([biasf] if trained else [])], dy)
    theirs = torch.autograd.grad(eager, inputs, dy.bfloat16())
    assert len(ran) == 1 and ran[0] is not None, "the recomputing dZ kernel did not run"
    _no_less_accurate_than_eager(["a", "b", "bias"][:len(inputs)], mine, want, theirs, inputs)


def _swiglu_times_a_wide_scale(acc, scale):
    gate, up = (acc * scale).chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("fn, name", [(_swiglu_with_a_wide_bias, "bias"),
                                      (_swiglu_times_a_wide_scale, "scale")])
@pytest.mark.parametrize("trained", [False, True])
def test_dz_pass_of_a_gated_epilogue_with_a_wide_operand(fn, name, trained, monkeypatch):
    """A layer's gated epilogue with an operand as wide as its GEMM: the dZ pass takes the
    operand's halves as two operands beside the saved halves, and gives a trained one's gradient as
    its halves' column sums. Gradients against float32 autograd, no less accurate than eager's, and
    the pass ran."""
    from evtc import dz_pass

    ran = []
    real = dz_pass.gradients
    monkeypatch.setattr(dz_pass, "gradients", lambda *a: ran.append(real(*a)) or ran[-1])
    g = torch.Generator(device="cuda").manual_seed(26)
    x = (torch.randn(3, 37, 96, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(2 * 136, 96, device="cuda", generator=g) * 96 ** -0.5).bfloat16().requires_grad_()
    operand = (torch.rand(2 * 136, device="cuda", generator=g) + 0.5).bfloat16().requires_grad_(trained)
    lin = evtc.linear(fn, {"x": x, "weight": w, name: operand})
    y = lin(x, w, **{name: operand})
    inputs = [x, w, *([operand] if trained else [])]
    xf, wf = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    of = operand.detach().float().requires_grad_(trained)
    ref = fn(xf @ wf.t(), of)
    eager = fn(x @ w.t(), operand)
    dy = torch.randn(ref.shape, device="cuda", generator=g)
    mine = torch.autograd.grad(y, inputs, dy.bfloat16())
    want = torch.autograd.grad(ref, [xf, wf, *([of] if trained else [])], dy)
    theirs = torch.autograd.grad(eager, inputs, dy.bfloat16())
    assert len(ran) == 1 and ran[0] is not None, "the dZ pass did not run"
    _no_less_accurate_than_eager(["x", "weight", name][:len(inputs)], mine, want, theirs, inputs)


def _scaled_down_gelu(acc, bias):
    return F.gelu(acc * 1e-3 + bias)


def _scaled_down_swiglu(acc):
    gate, up = (acc * 1e-3).chunk(2, dim=-1)
    return F.silu(gate) * up


def _plus_bias(acc, bias):
    return acc + bias


@pytest.mark.parametrize("api", ["linear", "linear_swiglu", "operator_out_dtypes", "operator_batched", "mlp"])
def test_float16_accumulator_past_its_range_keeps_finite_gradients(api):
    """float16 inputs whose accumulator passes 65504 (about 1e5) under an epilogue that scales it
    back down: the forward reads the float32 accumulator and is finite, and so must be the
    gradients. The accumulator kept for the backward was float16 (infinity, then NaN gradients):
    saved by evtc.linear / FusedLinear's twin and read by the dZ pass, recomputed by a kernel's
    operator with out_dtypes (batched too), read by MLP's fused step. Against float64 autograd, by
    norm."""
    g = torch.Generator(device="cuda").manual_seed(2)
    m, k = 192, 128
    n = 256 if api == "linear_swiglu" else 128
    fn = _scaled_down_swiglu if api == "linear_swiglu" else _scaled_down_gelu
    x = (torch.randn(m, k, device="cuda", generator=g) * 40).half().requires_grad_()
    w = (torch.randn(n, k, device="cuda", generator=g) * 40).half().requires_grad_()
    ops = {} if api == "linear_swiglu" else {"bias": torch.randn(n, device="cuda", generator=g).half()
                                             .requires_grad_()}
    wide = {name: t.detach().double().requires_grad_() for name, t in {"x": x, "w": w, **ops}.items()}
    acc = wide["x"] @ wide["w"].t()
    assert acc.abs().max() > 65504
    if api == "mlp":
        block = evtc.nn.MLP(k, n, _scaled_down_gelu, _plus_bias, bias=True, device="cuda",
                            dtype=torch.float16)
        w2 = torch.randn(k, n, device="cuda", generator=g).half() * n ** -0.5
        with torch.no_grad():
            block.up.weight.copy_(w)
            block.up.bias.copy_(ops["bias"])
            block.down.weight.copy_(w2)
            block.down.bias.zero_()
        block.down.bias.requires_grad_(False)
        y = block(x)
        w2d = w2.double().requires_grad_()
        want_y = fn(acc, wide["bias"]) @ w2d.t()
        leaves = [x, block.up.weight, block.up.bias, block.down.weight]
        refs = [wide["x"], wide["w"], wide["bias"], w2d]
    else:
        if api.startswith("operator"):
            # (Batched: a's rows as two batches beside one b; the reference backward's recompute is
            # then a batched GEMM.)
            a = x.view(2, m // 2, k) if api == "operator_batched" else x
            kernel = evtc.compile(fn, {"a": a, "b": w.t(), **ops}, out_dtypes=torch.float32)
            y = kernel(a, w.t(), **ops)
        else:
            y = evtc.linear(fn, {"x": x, "weight": w, **ops})(x, w, **ops)
        want_y = fn(acc, **{name: wide[name] for name in ops}).view(y.shape)
        leaves = [x, w, *ops.values()]
        refs = [wide["x"], wide["w"], *(wide[name] for name in ops)]
    assert torch.isfinite(y).all()
    _norm_close(y, want_y, "forward", 1e-2)
    dy = torch.randn(want_y.shape, device="cuda", generator=g).half()
    mine = torch.autograd.grad(y, leaves, dy.to(y.dtype))
    want = torch.autograd.grad(want_y, refs, dy.double())
    for i, (a, b) in enumerate(zip(mine, want, strict=True)):
        assert torch.isfinite(a).all(), f"gradient {i}: not finite"
        _norm_close(a, b, f"gradient {i}", 1e-2)
    if api == "mlp":
        assert [v for v in block._dz.values() if v], "the fused step did not run"
