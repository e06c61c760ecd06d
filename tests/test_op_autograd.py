"""A compiled kernel and its custom operator are differentiable: gradients of a, b and the tensor
operands against torch.autograd of the same function, eagerly and under torch.compile (the
operator's autograd formula, traced by AOTAutograd), on CPU through the torch path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from several_outputs import four_outputs, gated_with_stats, tile_and_pre_residual, tile_and_row_sums

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


# ---- the backward's dZ in the epilogue of the forward's GEMM run again (evtc.dz_pass) -----------

def _every_operand_kind(acc, colscale, C, s, bias, alpha: float):
    return F.gelu(acc * colscale + bias) * C * alpha + s


def _linear_in_acc(acc, bias, C):
    return acc + bias + C


def _spy_on_the_recomputing_kernel(monkeypatch):
    """The results of evtc.dz_pass.recomputed_gradients (None where it did not apply), with the
    kernel forced on CPU tensors, where it runs as its torch path."""
    from evtc import dz_pass

    monkeypatch.setattr(dz_pass, "recompute_applies", lambda a, b: True)
    ran = []
    real = dz_pass.recomputed_gradients
    monkeypatch.setattr(dz_pass, "recomputed_gradients", lambda *a: ran.append(real(*a)) or ran[-1])
    return ran


_OPERAND_CASES = [
    (bias_gelu, (), 24, {"bias": lambda g, lead: torch.randn(24, generator=g)}, {}),
    (bias_gelu, (3,), 24, {"bias": lambda g, lead: torch.randn(24, generator=g)}, {}),
    (swiglu, (), 32, {}, {}),
    (swiglu, (3,), 32, {}, {}),
    (_every_operand_kind, (), 16, {"colscale": lambda g, lead: torch.rand(10, 1, generator=g) + 0.5,
                                   "C": lambda g, lead: torch.randn(10, 16, generator=g),
                                   "s": lambda g, lead: torch.randn((), generator=g),
                                   "bias": lambda g, lead: torch.randn(16, generator=g)}, {"alpha": 0.7}),
]


@pytest.mark.parametrize("fn, lead, n, operands, scalars", _OPERAND_CASES)
@pytest.mark.parametrize("trained", [False, True])
def test_operator_backward_recomputes_with_dz_as_its_epilogue(monkeypatch, fn, lead, n, operands, scalars,
                                                              trained):
    """A kernel's operator saved no accumulator: its backward runs the forward's GEMM again with dZ
    as the epilogue (on the GPU for 16-bit inputs; here forced on CPU), the trained operands'
    gradients (a bias's summed over the rows, a per-row scale's over the columns, a scalar's over
    the tile, a tile's elementwise) from the same kernel. Every gradient equals torch autograd's in
    float64, and the kernel ran, except for a batched call with trained operands, whose gradients
    also sum over the batch: the reference runs that."""
    ran = _spy_on_the_recomputing_kernel(monkeypatch)
    g = torch.Generator().manual_seed(4)
    a = torch.randn(*lead, 10, 16, generator=g).requires_grad_()
    b = torch.randn(*lead, 16, n, generator=g).requires_grad_()
    ops = {name: make(g, lead).requires_grad_(trained) for name, make in operands.items()}
    k = evtc.compile(fn, {"a": a, "b": b, **ops, **scalars})
    y = k(a, b, **ops, **scalars)
    wide = {name: v.detach().double().requires_grad_() for name, v in ops.items()}
    ad, bd = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    want_y = fn(ad @ bd, **wide, **scalars)
    dy = torch.randn(want_y.shape, generator=g, dtype=torch.float64)
    mine = torch.autograd.grad(y, [a, b, *(ops.values() if trained else ())], dy.float())
    want = torch.autograd.grad(want_y, [ad, bd, *(wide.values() if trained else ())], dy)
    for name, got, ref in zip(["a", "b", *(ops if trained else ())], mine, want, strict=True):
        assert got.shape == ref.shape and got.dtype == torch.float32, name
        _close(got.double(), ref, name)
    assert len(ran) == 1
    if lead and trained and ops:
        assert ran == [None], "a batched operand's gradient is the reference's"
        return
    assert ran[0] is not None, "the recomputing dZ kernel did not run"
    needed = tuple(ops) if trained else ()
    # Kernels of one function and examples are one object within a process: the other tests' entries
    # may be there too, keyed by the gradients each gives.
    dz_kernel, epilogue = next(state for key, state in k.recomputed_dz.items() if key[0] == needed)
    assert epilogue.reads_acc and epilogue.operand_grads == needed
    assert epilogue.fn.__code__.co_varnames[:2] == ("acc", "grad") and not epilogue.saved
    assert ("acc_gate, acc_up = acc.chunk(2, dim=-1)" in epilogue.source) == k.plan.gated


def test_operator_backward_reads_no_gemm_where_dz_needs_no_accumulator(monkeypatch):
    """An epilogue linear in acc (a bias and a residual): dZ is the incoming gradient, read by no
    GEMM, so no kernel is built and the reference gives the gradients."""
    ran = _spy_on_the_recomputing_kernel(monkeypatch)
    g = torch.Generator().manual_seed(6)
    a = torch.randn(10, 16, generator=g, requires_grad=True)
    b = torch.randn(16, 24, generator=g, requires_grad=True)
    ops = {"bias": torch.randn(24, generator=g, requires_grad=True),
           "C": torch.randn(10, 24, generator=g, requires_grad=True)}
    k = evtc.compile(_linear_in_acc, {"a": a, "b": b, **ops})
    y = k(a, b, **ops)
    dy = torch.randn(y.shape, generator=g)
    inputs = [a, b, *ops.values()]
    mine = torch.autograd.grad(y, inputs, dy)
    want = torch.autograd.grad(_linear_in_acc(a @ b, **ops), inputs, dy)
    for name, got, ref in zip(["a", "b", *ops], mine, want, strict=True):
        _close(got, ref, name)
    assert ran == [None] and set(k.recomputed_dz.values()) == {False}


def test_operator_backward_recomputing_in_bfloat16(monkeypatch):
    """bfloat16 inputs, as the kernel runs on the GPU (its 16-bit GEMMs forced on CPU too): the
    incoming gradient is bfloat16, the kernel is compiled for it and runs, and every gradient is
    within bfloat16's rounding of torch autograd's in float64."""
    from evtc.runtime import op_autograd

    ran = _spy_on_the_recomputing_kernel(monkeypatch)
    monkeypatch.setattr(op_autograd, "low_precision", lambda a, b: a.dtype == b.dtype == torch.bfloat16)
    g = torch.Generator().manual_seed(7)
    a = torch.randn(10, 16, generator=g).bfloat16().requires_grad_()
    b = (torch.randn(16, 32, generator=g) * 0.25).bfloat16().requires_grad_()
    scale = (torch.rand(10, 1, generator=g) + 0.5).bfloat16().requires_grad_()

    def swiglu_scaled(acc, scale):
        gate, up = acc.chunk(2, dim=-1)
        return F.silu(gate) * up * scale

    k = evtc.compile(swiglu_scaled, {"a": a, "b": b, "scale": scale})
    y = k(a, b, scale=scale)
    dy = torch.randn(y.shape, generator=g).bfloat16()
    mine = torch.autograd.grad(y, [a, b, scale], dy)
    wide = [t.detach().double().requires_grad_() for t in (a, b, scale)]
    want = torch.autograd.grad(swiglu_scaled(wide[0] @ wide[1], wide[2]), wide, dy.double())
    assert ran[0] is not None, "the recomputing dZ kernel did not run"
    dz_kernel, _ = next(state for key, state in k.recomputed_dz.items() if key[0] == ("scale",))
    assert dz_kernel.call_spec.operand_dtypes["grad"] == torch.bfloat16
    for name, got, ref in zip(["a", "b", "scale"], mine, want, strict=True):
        assert got.dtype == torch.bfloat16, name
        err = ((got.double() - ref).norm() / ref.norm()).item()
        assert err < 2e-2, f"{name}: relative error {err:.3g} by norm"


def test_operator_backward_of_one_row_then_many(monkeypatch):
    """A decode step's call (M = 1) and then a prefill's (M = 10) of one kernel: each gets a
    recomputing kernel of its own (an example of one row compiles the incoming gradient as a row
    vector, which a call of ten rows would be refused), both run, and both give autograd's
    gradients."""
    ran = _spy_on_the_recomputing_kernel(monkeypatch)
    g = torch.Generator().manual_seed(10)
    b = torch.randn(16, 24, generator=g, requires_grad=True)
    bias = torch.randn(24, generator=g, requires_grad=True)
    # The forward compiled from an example of many rows (its operands' kinds are the example's).
    k = evtc.compile(_scaled_bias_gelu, {"a": torch.randn(10, 16), "b": b, "bias": bias,
                                         "scale": torch.rand(10, 1)})
    for rows in (1, 10, 1):
        a = torch.randn(rows, 16, generator=g, requires_grad=True)
        scale = (torch.rand(rows, 1, generator=g) + 0.5).requires_grad_()
        y = k(a, b, bias=bias, scale=scale)
        dy = torch.randn(y.shape, generator=g)
        inputs = [a, b, bias, scale]
        mine = torch.autograd.grad(y, inputs, dy)
        want = torch.autograd.grad(_scaled_bias_gelu(a @ b, bias, scale), inputs, dy)
        for name, got, ref in zip(["a", "b", "bias", "scale"], mine, want, strict=True):
            _close(got, ref, f"{name} at M = {rows}")
    assert len(ran) == 3 and None not in ran, "the recomputing dZ kernel did not run"
    built = [state for key, state in k.recomputed_dz.items() if key[0] == ("bias", "scale")]
    assert len(built) == 2 and all(built), "one kernel for one row, one for many"


def _scaled_bias_gelu(acc, bias, scale):
    return F.gelu(acc + bias) * scale


def test_operator_backwards_in_threads_build_one_kernel(monkeypatch):
    """Backwards in several threads that want the same recomputing kernel: one thread builds it,
    the others wait for it (not compile it again), and every thread's gradients are autograd's."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from evtc import dz_pass

    ran = _spy_on_the_recomputing_kernel(monkeypatch)
    builds = []
    real_build = dz_pass._build_recomputed

    def slow_build(*args):
        builds.append(threading.get_ident())
        time.sleep(0.2)  # long enough for the other threads to ask meanwhile
        return real_build(*args)

    monkeypatch.setattr(dz_pass, "_build_recomputed", slow_build)
    g = torch.Generator().manual_seed(12)
    b = torch.randn(16, 24, generator=g)
    k = evtc.compile(_scaled_bias_gelu, {"a": torch.randn(9, 16), "b": b, "bias": torch.randn(24),
                                         "scale": torch.rand(9, 1)})
    k.recomputed_dz.clear()  # one kernel object per function and examples in a process: built afresh
    cases = []
    for _ in range(4):
        a = torch.randn(9, 16, generator=g, requires_grad=True)
        bias = torch.randn(24, generator=g, requires_grad=True)
        scale = (torch.rand(9, 1, generator=g) + 0.5).requires_grad_()
        cases.append((a, bias, scale, torch.randn(9, 24, generator=g)))
    bw = b.clone().requires_grad_()

    def step(case):
        a, bias, scale, dy = case
        return torch.autograd.grad(k(a, bw, bias=bias, scale=scale), [a, bw, bias, scale], dy)

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(step, cases))
    assert len(builds) == 1, f"the kernel was built {len(builds)} times"
    assert len(ran) == 4 and None not in ran
    for (a, bias, scale, dy), mine in zip(cases, results, strict=True):
        want = torch.autograd.grad(_scaled_bias_gelu(a @ bw, bias, scale), [a, bw, bias, scale], dy)
        for name, got, ref in zip(["a", "b", "bias", "scale"], mine, want, strict=True):
            _close(got, ref, name)


_SEVERAL_OUTPUT_CASES = [
    (four_outputs, 16, {"scale": lambda g: torch.rand(16, generator=g),
                         "C": lambda g: torch.randn(16, 16, generator=g)}, {}),
    (tile_and_pre_residual, 16, {"bias": lambda g: torch.randn(16, generator=g),
                           "C": lambda g: torch.randn(16, 16, generator=g)}, {"alpha": 0.7}),
    (gated_with_stats, 32, {"scale": lambda g: torch.rand(16, 1, generator=g) + 0.5}, {}),
]


@pytest.mark.parametrize("fn, n, operands, scalars", _SEVERAL_OUTPUT_CASES)
@pytest.mark.parametrize("trained", [False, True])
def test_operator_backward_of_several_outputs_recomputes_dz_as_its_epilogue(monkeypatch, fn, n, operands,
                                                                            scalars, trained):
    """An epilogue of several outputs (a tile, a per-row sum, a per-column sum and a total; a
    function that returns a tile and its pre-residual value; a gated one's dict): each output's
    incoming gradient is an operand of its own of the recomputing kernel, in the shape the output
    has ((M, 1) for the per-row sum: with M = N = 16 here, a bare (M,) would read as a row
    vector), and every gradient equals torch autograd's in float64."""
    ran = _spy_on_the_recomputing_kernel(monkeypatch)
    g = torch.Generator().manual_seed(13)
    a = torch.randn(16, 8, generator=g).requires_grad_()
    b = torch.randn(8, n, generator=g).requires_grad_()
    ops = {name: make(g).requires_grad_(trained) for name, make in operands.items()}
    k = evtc.compile(fn, {"a": a, "b": b, **ops, **scalars})
    got = k(a, b, **ops, **scalars)
    wide = {name: v.detach().double().requires_grad_() for name, v in ops.items()}
    ad, bd = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    want = fn(ad @ bd, **wide, **scalars)
    got, want = (list(got.values()), list(want.values())) if isinstance(want, dict) else (got, want)
    dys = [torch.randn(w.shape, generator=g, dtype=torch.float64) for w in want]
    mine = torch.autograd.grad(got, [a, b, *(ops.values() if trained else ())], [d.float() for d in dys])
    ref = torch.autograd.grad(want, [ad, bd, *(wide.values() if trained else ())], dys)
    for name, x, r in zip(["a", "b", *(ops if trained else ())], mine, ref, strict=True):
        assert x.shape == r.shape, name
        _close(x.double(), r, name)
    assert len(ran) == 1 and ran[0] is not None, "the recomputing dZ kernel did not run"
    _, epilogue = next(state for key, state in k.recomputed_dz.items()
                       if key[0] == (tuple(ops) if trained else ()) and state)
    assert len(epilogue.grads) == len(want) and epilogue.fn.__code__.co_varnames[0] == "acc"


def _rows_of_tanh(acc, scale):
    return (torch.tanh(acc) * scale).sum(-1)


@pytest.mark.parametrize("m", [16, 12])
def test_operator_backward_of_a_per_row_sum_when_m_equals_n(monkeypatch, m):
    """A per-row sum's incoming gradient is (M,): the recomputing kernel takes it as the (M, 1)
    column it is. (It took a bare (M,) for a row vector where M equals N, and gave wrong gradients
    of a and b; at M != N its compile failed and the reference ran.)"""
    ran = _spy_on_the_recomputing_kernel(monkeypatch)
    g = torch.Generator().manual_seed(14)
    a = torch.randn(m, 8, generator=g, requires_grad=True)
    b = torch.randn(8, 16, generator=g, requires_grad=True)
    scale = torch.rand(16, generator=g)
    k = evtc.compile(_rows_of_tanh, {"a": a, "b": b, "scale": scale})
    y = k(a, b, scale=scale)
    dy = torch.randn(y.shape, generator=g)
    mine = torch.autograd.grad(y, [a, b], dy)
    want = torch.autograd.grad(_rows_of_tanh(a @ b, scale), [a, b], dy)
    for name, x, r in zip("ab", mine, want, strict=True):
        _close(x, r, name)
    assert ran[0] is not None, "the recomputing dZ kernel did not run"


def test_operator_backward_with_an_output_unused(monkeypatch):
    """A loss that reads one output of two: the other's gradient is zeros (or none), and the
    gradients equal autograd's."""
    _spy_on_the_recomputing_kernel(monkeypatch)
    g = torch.Generator().manual_seed(15)
    a = torch.randn(12, 8, generator=g, requires_grad=True)
    b = torch.randn(8, 16, generator=g, requires_grad=True)
    bias, C = torch.randn(16, generator=g), torch.randn(12, 16, generator=g)
    k = evtc.compile(tile_and_pre_residual, {"a": a, "b": b, "bias": bias, "C": C, "alpha": 0.5})
    for index in (0, 1):
        mine = torch.autograd.grad(k(a, b, bias=bias, C=C, alpha=0.5)[index].square().sum(), [a, b])
        want = torch.autograd.grad(tile_and_pre_residual(a @ b, bias, C, 0.5)[index].square().sum(), [a, b])
        for name, x, r in zip("ab", mine, want, strict=True):
            _close(x, r, f"{name}, loss on output {index}")


def test_batched_operator_backward_of_several_outputs(monkeypatch):
    """A batch of 3 (a and b batched): the per-row sums' incoming gradient is (3, M) and reaches the
    recomputing kernel as (3, M, 1) per-batch columns; gradients equal autograd's in float64."""
    ran = _spy_on_the_recomputing_kernel(monkeypatch)
    g = torch.Generator().manual_seed(16)
    a = torch.randn(3, 16, 8, generator=g, requires_grad=True)
    b = torch.randn(3, 8, 16, generator=g, requires_grad=True)
    bias = torch.randn(16, generator=g)
    k = evtc.compile(tile_and_row_sums, {"a": a, "b": b, "bias": bias})
    y, s = k(a, b, bias=bias)
    assert s.shape == (3, 16)
    ad, bd = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    wy, ws = tile_and_row_sums(ad @ bd, bias.double())
    dy, ds = torch.randn(wy.shape, generator=g, dtype=torch.float64), torch.randn(ws.shape, generator=g,
                                                                                  dtype=torch.float64)
    mine = torch.autograd.grad([y, s], [a, b], [dy.float(), ds.float()])
    want = torch.autograd.grad([wy, ws], [ad, bd], [dy, ds])
    for name, x, r in zip("ab", mine, want, strict=True):
        _close(x.double(), r, name)
    assert ran[0] is not None, "the recomputing dZ kernel did not run"


def _swiglu_with_a_wide_bias(acc, bias):
    gate, up = (acc + bias).chunk(2, dim=-1)
    return F.silu(gate) * up


def _gelu_and_row_means(acc, bias):
    y = F.gelu(acc + bias)
    return y, y.mean(-1)


@pytest.mark.parametrize("fn, n", [(_swiglu_with_a_wide_bias, 32), (_gelu_and_row_means, 24)])
@pytest.mark.parametrize("trained", [False, True])
def test_operator_backward_recomputes_wide_operands_and_sizes(monkeypatch, fn, n, trained):
    """The recomputing kernel runs the forward's GEMM whole, so it takes what the elementwise pass
    over saved halves cannot: a gated epilogue's operand as wide as its GEMM (``(acc + bias)``
    split as the forward splits it) and the forward's sizes (a row mean's 1/N, read from ``acc``).
    A trained wide bias's gradient is the column sums of dZ's joined halves: two half-wide sums,
    joined. Every gradient equals torch autograd's in float64, and the kernel ran."""
    ran = _spy_on_the_recomputing_kernel(monkeypatch)
    g = torch.Generator().manual_seed(17)
    a = torch.randn(10, 16, generator=g, requires_grad=True)
    b = torch.randn(16, n, generator=g, requires_grad=True)
    bias = torch.randn(n, generator=g).requires_grad_(trained)
    k = evtc.compile(fn, {"a": a, "b": b, "bias": bias})
    got = k(a, b, bias=bias)
    got = got if isinstance(got, tuple) else (got,)
    ad, bd = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    biasd = bias.detach().double().requires_grad_(trained)
    want = fn(ad @ bd, biasd)
    want = want if isinstance(want, tuple) else (want,)
    dys = [torch.randn(w.shape, generator=g, dtype=torch.float64) for w in want]
    inputs, ref_inputs = [a, b, *([bias] if trained else [])], [ad, bd, *([biasd] if trained else [])]
    mine = torch.autograd.grad(got, inputs, [d.float() for d in dys])
    ref = torch.autograd.grad(want, ref_inputs, dys)
    for name, x, r in zip(["a", "b", "bias"], mine, ref, strict=False):
        _close(x.double(), r, name)
    assert ran[0] is not None, "the recomputing dZ kernel did not run"
    if trained and fn is _swiglu_with_a_wide_bias:
        _, epilogue = next(state for key, state in k.recomputed_dz.items() if key[0] == ("bias",) and state)
        assert epilogue.split_grads == ("bias",)


def _outputs_named_alike(acc, bias):
    y = F.gelu(acc + bias)
    return {"\ufb01": y, "fi": y.sum(-1)}  # two keys that Python reads as one identifier


def test_operator_backward_of_outputs_whose_names_python_reads_as_one(monkeypatch):
    """Output names that are one identifier to Python (NFKC: the ligature "\ufb01" is "fi") would be
    one parameter of the generated dZ twice: the reference takes that backward, with autograd's
    gradients (it raised a SyntaxError)."""
    ran = _spy_on_the_recomputing_kernel(monkeypatch)
    g = torch.Generator().manual_seed(18)
    a = torch.randn(12, 8, generator=g, requires_grad=True)
    b = torch.randn(8, 16, generator=g, requires_grad=True)
    bias = torch.randn(16, generator=g)
    k = evtc.compile(_outputs_named_alike, {"a": a, "b": b, "bias": bias})
    got = k(a, b, bias=bias)
    want = _outputs_named_alike(a @ b, bias)
    dys = {name: torch.randn(v.shape, generator=g) for name, v in want.items()}
    mine = torch.autograd.grad([got[n] for n in dys], [a, b], list(dys.values()))
    ref = torch.autograd.grad([want[n] for n in dys], [a, b], list(dys.values()))
    for name, x, r in zip("ab", mine, ref, strict=True):
        _close(x, r, name)
    assert ran == [None]


def test_operator_backward_traced_with_symbolic_sizes(monkeypatch):
    """make_fx with symbolic sizes traces the operator's backward: the recomputing kernel steps
    aside for sizes it cannot key a kernel by (it raised a TypeError), and the reference's trace
    gives autograd's gradients."""
    from torch.fx.experimental.proxy_tensor import make_fx

    ran = _spy_on_the_recomputing_kernel(monkeypatch)
    g = torch.Generator().manual_seed(19)
    a, b = torch.randn(16, 8, generator=g), torch.randn(8, 16, generator=g)
    bias = torch.randn(16, generator=g)
    k = evtc.compile(tile_and_row_sums, {"a": a, "b": b, "bias": bias})

    def step(a, b, bias):
        a, b = a.detach().requires_grad_(), b.detach().requires_grad_()
        y, s = k(a, b, bias=bias)
        return torch.autograd.grad([y, s], [a, b], [torch.ones_like(y), torch.ones_like(s)])

    traced = make_fx(step, tracing_mode="symbolic")(a, b, bias)
    assert ran == [None]
    a2, b2 = torch.randn(12, 8, generator=g), torch.randn(8, 24, generator=g)
    bias2 = torch.randn(24, generator=g)
    ad, bd = a2.clone().requires_grad_(), b2.clone().requires_grad_()
    y, s = tile_and_row_sums(ad @ bd, bias2)
    want = torch.autograd.grad([y, s], [ad, bd], [torch.ones_like(y), torch.ones_like(s)])
    for name, x, r in zip("ab", traced(a2, b2, bias2), want, strict=True):
        _close(x, r, name)


def _swiglu_over_a_bias(acc, bias):
    gate, up = (acc + bias).chunk(2, dim=-1)
    return F.silu(gate) * up


def test_a_create_graph_backward_leaves_the_recomputing_dz_kernel_on(monkeypatch, tmp_path):
    """A backward with create_graph=True through a kernel's operator (grad mode on, a and b
    requiring grad) takes the reference, the differentiable path: the recomputing dZ kernel, which
    refuses out= there, was tried, and its refusal was cached, turning it off for every later
    backward. Both backwards give float64 autograd's gradients, and the kernel is built and kept
    by the plain one (bfloat16 16-bit GEMMs forced on CPU, where the kernel runs its torch path)."""
    from evtc.runtime import op_autograd

    monkeypatch.setattr(op_autograd, "low_precision", lambda a, b: a.dtype == b.dtype == torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(8, 16, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(16, 24, generator=g) * 0.25).bfloat16().requires_grad_()
    bias = torch.randn(24, generator=g).bfloat16().requires_grad_()
    k = evtc.compile(_swiglu_over_a_bias, {"a": a, "b": w, "bias": bias}, cache_dir=tmp_path)
    wide = [t.detach().double().requires_grad_() for t in (a, w, bias)]
    want = torch.autograd.grad(_swiglu_over_a_bias(wide[0] @ wide[1], wide[2]), wide,
                               torch.ones(8, 12, dtype=torch.float64))
    for create_graph in (True, False):
        y = k(a, w, bias=bias)
        got = torch.autograd.grad(y, [a, w, bias], torch.ones_like(y), create_graph=create_graph)
        for name, mine, ref in zip("a w bias".split(), got, want, strict=True):
            err = ((mine.double() - ref).norm() / ref.norm()).item()
            assert err < 2e-2, f"{name} (create_graph={create_graph}): {err:.3g}"
        if create_graph:
            assert not any(v is False for v in k.recomputed_dz.values()), k.recomputed_dz
    assert [v for v in k.recomputed_dz.values() if v], "the plain backward did not build the dZ kernel"
