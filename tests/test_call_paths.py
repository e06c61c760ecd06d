"""CPU tests of the call paths besides the plain kernel launch (docs/compile.md, "Call paths"):

- the staging helpers that give the kernel aligned copies of tensors TMA cannot read as they are;
- the torch path (torch.matmul, then the graph evaluated by torch): CPU tensors, float32 a and b
  compiled from examples that are not K-major (K-major ones: tests/test_tf32.py);
- every parameter of the user's function is accepted at call time (unused ones ignored,
  compile-time constants checked);
- strict=True turns every detour into an error.

The staged path itself launches the kernel: tests/test_call_paths_gpu.py runs it on the GPU.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

import evtc
from evtc.plan.tensor_spec import TensorSpec
from evtc.runtime.staging import aligned_copy, aligned_empty, layout_problem

TILE = TensorSpec("C", "float16", ("M", "N"), 1)
TILE_M_MAJOR = TensorSpec("C", "float16", ("M", "N"), 0)
BATCHED = TensorSpec("C", "float32", ("L", "M", "N"), 2)
ROW = TensorSpec("bias", "float32", ("L", "1", "N"), 2)


# ---- staging -------------------------------------------------------------------------------------


@pytest.mark.parametrize("make, spec, why", [
    (lambda: torch.randn(8, 1001).half(), TILE, "stride 1001 along M is not a multiple of 8"),
    (lambda: torch.randn(8, 64).half()[:, ::2], TILE, "not contiguous along N"),
    (lambda: torch.randn(8, 64).half(), TILE_M_MAJOR, "not contiguous along M"),
    (lambda: torch.randn(8 * 64 + 1).half()[1:].view(8, 64), TILE, "not 16-byte aligned"),
    (lambda: torch.randn(3, 5, 6), BATCHED, "stride 30 along L"),
    (lambda: torch.randn(3, 1, 5), ROW, "stride 5 along L"),
])
def test_layout_problems_are_named(make, spec, why):
    t = make()
    problem = layout_problem(t, spec)
    assert problem is not None and why in problem
    staged = aligned_copy(t, spec)
    assert layout_problem(staged, spec) is None
    assert staged.shape == t.shape and staged.dtype == t.dtype and torch.equal(staged, t)
    assert staged.data_ptr() != t.data_ptr()  # a copy: the user's tensor is never written


@pytest.mark.parametrize("spec, t", [
    (TILE, torch.randn(8, 64).half()),
    (TILE_M_MAJOR, torch.randn(64, 8).half().t()),
    (BATCHED, torch.randn(3, 5, 8)),
    (ROW, torch.randn(3, 1, 4)),  # a 1-long dim's stride never matters
    (TILE, torch.randn(1, 67).half()[:, :64]),  # one row of any pitch (the compiled function's rule)
    (TILE, torch.randn(64 * 8).half().as_strided((64, 1), (8, 5))),  # one column: any stride along N
])
def test_layouts_the_kernel_takes_pass_through(spec, t):
    assert layout_problem(t, spec) is None


@pytest.mark.parametrize("shape, spec", [((7, 1001), TILE), ((2, 3, 5), BATCHED), ((9, 3), TILE_M_MAJOR)])
def test_padded_outputs_have_the_logical_shape_and_legal_strides(shape, spec):
    dtype = torch.float16 if spec.dtype == "float16" else torch.float32
    t = aligned_empty(shape, dtype, spec, "cpu")
    assert tuple(t.shape) == shape and t.dtype == dtype
    assert layout_problem(t, spec) is None


# ---- the torch path and the call interface -------------------------------------------------------


def _inputs(m=37, n=53, k=1001, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(a=torch.randn(m, k, generator=g).to(dtype), b=torch.randn(k, n, generator=g).to(dtype),
                C=torch.randn(m, n, generator=g).to(dtype), bias=torch.randn(n, generator=g))


def residual(acc, C, bias, alpha: float, gated: bool = True):
    y = alpha * acc + bias
    return (torch.relu(y) if gated else y) + C, y.sum(-1)


def _close(got, want, dtype):
    tol = 2e-3 if dtype == torch.float16 else 2e-5
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype if dtype == torch.float32 else True
        assert g.is_contiguous()
        torch.testing.assert_close(g.float(), w.float(), rtol=tol, atol=tol * 8)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors on a machine without a GPU")
def test_cpu_tensors_take_the_torch_path(cache, caplog):
    ex = _inputs() | {"alpha": 0.5}
    k = evtc.compile(residual, ex, cache_dir=cache)
    with caplog.at_level(logging.WARNING, logger="evtc"):
        got = k(**ex)
        k(**ex)
    assert k.last_path == "torch"
    assert caplog.text.count("runs on the torch path") == 1  # once per kernel
    want = residual(ex["a"].float() @ ex["b"].float(), ex["C"].float(), ex["bias"], 0.5)
    _close(got, (want[0].half(), want[1]), torch.float16)
    # out= receives the results; the inputs are left as they were.
    before = {name: t.clone() for name, t in ex.items() if isinstance(t, torch.Tensor)}
    out = (torch.full_like(got[0], float("nan")), torch.full_like(got[1], float("nan")))
    result = k(**ex, out=out)
    assert result[0] is out[0] and result[1] is out[1]
    _close(out, got, torch.float32)
    for name, t in before.items():
        assert torch.equal(ex[name], t), name


def _operand_and_twice(acc, C):
    y = acc * 2
    return C, y, y


def test_torch_path_outputs_are_new_tensors(cache):
    """The torch path returns tensors of their own, as the kernel does: torch hands back ``C``
    itself for ``return C`` and one tensor for ``return y, y``, so that writing into one output
    changed the caller's C or the other output."""
    a, b = torch.randn(16, 8), torch.randn(8, 24)
    C = torch.randn(16, 24)
    k = evtc.compile(_operand_and_twice, {"a": a, "b": b, "C": C}, out_dtypes=torch.float32,
                     cache_dir=cache)
    kept = C.clone()
    c_out, y1, y2 = k(a, b, C=C)
    assert k.last_path == "torch"
    pointers = {t.untyped_storage().data_ptr() for t in (c_out, y1, y2, C)}
    assert len(pointers) == 4
    c_out.zero_()
    y1.zero_()
    assert torch.equal(C, kept)
    torch.testing.assert_close(y2, (a @ b) * 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors on a machine without a GPU")
def test_strict_refuses_the_torch_path(cache):
    ex = _inputs() | {"alpha": 0.5}
    k = evtc.compile(residual, ex, cache_dir=cache, strict=True)
    assert not k.interface.torch_only and k.interface.strict
    with pytest.raises(evtc.CallError, match="strict=True refuses the torch path"):
        k(**ex)
    assert evtc.compile(residual, ex, cache_dir=cache) is not k  # strict is not shared


def test_float32_a_and_b_not_k_major_take_the_torch_path(cache):
    ex = _inputs(dtype=torch.float32) | {"alpha": 2.0}
    k = evtc.compile(residual, ex, cache_dir=cache)
    assert "no SM90 kernel: float32 a and b" in k.source and "%acc = a @ b" in k.source
    assert "no SM90 kernel" in k.explain()
    got = k(**ex)
    assert k.last_path == "torch"
    want = residual(ex["a"] @ ex["b"], ex["C"], ex["bias"], 2.0)
    _close(got, want, torch.float32)
    with pytest.raises(evtc.CompileError, match="float32 a and b.*strict=True"):
        evtc.compile(residual, ex, cache_dir=cache, strict=True)


def _unused_c(acc, C, bias):
    return acc + bias


def _dead_value(acc, C, bias, s: float):
    unused = C * s  # noqa: F841 - computed, never returned: C and s are dead after the passes
    return acc + bias


def test_every_parameter_of_the_function_is_accepted(cache):
    ex = _inputs()
    for fn, extra in ((_unused_c, {}), (_dead_value, {"s": 3.0})):
        k = evtc.compile(fn, {**ex, **extra}, cache_dir=cache)
        assert k.operand_names == ["bias"]
        assert "unused parameters (accepted and ignored): " in k.explain()
        got = k(ex["a"], ex["b"], C=ex["C"], bias=ex["bias"], **extra)
        want = fn(ex["a"].float() @ ex["b"].float(), ex["C"], ex["bias"], **extra)
        _close([got], [want.half()], torch.float16)
        # Unused ones may also be left out, or be anything: the function ignores them too.
        k(ex["a"], ex["b"], bias=ex["bias"])
        k(ex["a"], ex["b"], C="not a tensor", bias=ex["bias"])
        with pytest.raises(evtc.CallError, match=r"unexpected argument\(s\) \['D'\]; the epilogue takes"):
            k(ex["a"], ex["b"], C=ex["C"], bias=ex["bias"], D=ex["C"])
        with pytest.raises(evtc.CallError, match=r"missing argument\(s\) \['bias'\]"):
            k(ex["a"], ex["b"], C=ex["C"])


def test_compile_time_constants_are_accepted_with_their_compiled_value(cache):
    ex = _inputs() | {"alpha": 0.5}
    plain = evtc.compile(residual, ex, cache_dir=cache)  # gated left to its default, True
    flagged = evtc.compile(residual, {**ex, "gated": False}, cache_dir=cache)
    for k, gated in ((plain, True), (flagged, False)):
        assert f"compile-time constants: gated={gated}" in k.explain()
        got = k(**ex, gated=gated)
        want = residual(ex["a"].float() @ ex["b"].float(), ex["C"].float(), ex["bias"], 0.5, gated)
        _close(got, (want[0].half(), want[1]), torch.float16)
        with pytest.raises(evtc.CallError, match=f"compiled with gated={gated}, a compile-time constant"):
            k(**ex, gated=not gated)
        with pytest.raises(evtc.CallError, match="compile-time constant"):
            k(**ex, gated=int(gated))


def _addmm_like(acc, C, alpha: float, beta: float = 0.0, bias=None):
    if beta == 0:  # torch.addmm ignores C when beta is 0 (NaN in C stays out)
        out = alpha * acc
    else:
        out = alpha * acc + beta * C
    return out if bias is None else out + bias


def test_a_float_constant_takes_an_equal_int_and_a_tensor_is_not_printed(cache):
    """beta=0 for a kernel compiled with beta=0.0 is the same call (Python's numeric tower, as
    torch.addmm reads beta=0); beta=1 is another value, and a tensor for a None constant is
    described, not printed (printing a GPU tensor copies it to the host)."""
    ex = _inputs()
    C = ex["C"].clone()
    C[0, 0] = float("nan")
    k = evtc.compile(_addmm_like, dict(a=ex["a"], b=ex["b"], C=C, alpha=1.5), cache_dir=cache)
    want = (1.5 * (ex["a"].float() @ ex["b"].float())).half()
    for beta in (0.0, 0, np.int64(0)):
        _close([k(ex["a"], ex["b"], C=C, alpha=1.5, beta=beta)], [want], torch.float16)
    with pytest.raises(evtc.CallError, match="compiled with beta=0.0, a compile-time constant"):
        k(ex["a"], ex["b"], C=C, alpha=1.5, beta=1)
    with pytest.raises(evtc.CallError, match="compile-time constant"):
        k(ex["a"], ex["b"], C=C, alpha=1.5, beta=False)
    with pytest.raises(evtc.CallError, match=r"bias=a tensor of shape \(53,\) \(torch.float16\): ") as err:
        k(ex["a"], ex["b"], C=C, alpha=1.5, bias=torch.randn(53).half())
    assert "tensor(" not in str(err.value)


def _scaled_residual(acc, C, alpha=1.0, *, beta: float = 0.5):
    return alpha * acc + beta * C


def test_runtime_scalars_left_out_take_their_python_defaults(cache):
    """alpha and beta were given in the examples (runtime scalars); a call may leave them out, as
    calling the function may, and gets the defaults, not the examples' values; under torch.compile
    too."""
    ex = _inputs()
    k = evtc.compile(_scaled_residual, dict(a=ex["a"], b=ex["b"], C=ex["C"], alpha=2.0, beta=3.0),
                     cache_dir=cache)
    acc = ex["a"].float() @ ex["b"].float()
    calls = [({}, (1.0, 0.5)), ({"alpha": 4.0}, (4.0, 0.5)), ({"beta": -1.0}, (1.0, -1.0))]
    for kwargs, (alpha, beta) in calls:
        want = (alpha * acc + beta * ex["C"].float()).half()
        _close([k(ex["a"], ex["b"], C=ex["C"], **kwargs)], [want], torch.float16)
    compiled = torch.compile(lambda a, b, C: k(a, b, C=C), backend="aot_eager", fullgraph=True)
    _close([compiled(ex["a"], ex["b"], ex["C"])], [(acc + 0.5 * ex["C"].float()).half()], torch.float16)
    with pytest.raises(evtc.CallError, match=r"missing argument\(s\) \['C'\]"):
        k(ex["a"], ex["b"])


def test_the_custom_operator_and_linear_accept_unused_parameters(cache):
    ex = _inputs(k=64)
    k = evtc.compile(_unused_c, ex, cache_dir=cache)
    compiled = torch.compile(lambda a, b, C, bias: k(a, b, C=C, bias=bias), backend="eager", fullgraph=True)
    got = compiled(ex["a"], ex["b"], ex["C"], ex["bias"])
    _close([got], [(ex["a"].float() @ ex["b"].float() + ex["bias"]).half()], torch.float16)

    lin = evtc.linear(_unused_c, dict(x=ex["a"], weight=ex["b"].t(), C=ex["C"], bias=ex["bias"]),
                      cache_dir=cache)
    got = lin(ex["a"], ex["b"].t(), C=ex["C"], bias=ex["bias"])
    _close([got], [(ex["a"].float() @ ex["b"].float() + ex["bias"]).half()], torch.float16)


def test_strided_and_transposed_examples_compile_to_the_nearest_layout(cache):
    ex = {name: t for name, t in _inputs(k=64).items() if name in ("a", "b")}
    rows = torch.randn(37, 106).half()[:, ::2]          # strides (106, 2): nearest is N-major
    columns = torch.randn(106, 74).half().t()[::2, ::2]  # strides (2, 148): nearest is M-major
    for C, major in ((rows, "N"), (columns, "M")):
        k = evtc.compile(lambda acc, C: acc + C, {**ex, "C": C}, cache_dir=cache)
        assert f"C: float16[M, N], {major} contiguous" in k.explain()
        if not torch.cuda.is_available():
            got = k(ex["a"], ex["b"], C=C)
            _close([got], [(ex["a"].float() @ ex["b"].float() + C.float()).half()], torch.float16)


def test_per_batch_device_scalars_are_read_at_each_batch(cache):
    def scaled(acc, C, alpha: float, alpha_dev):
        return acc + C + alpha + alpha_dev, acc * alpha_dev

    g = torch.Generator().manual_seed(3)
    ex = dict(a=torch.randn(3, 40, 24, generator=g).half(), b=torch.randn(3, 24, 48, generator=g).half(),
              C=torch.randn(3, 40, 48, generator=g).half(), alpha=0.25,
              alpha_dev=torch.randn(3, 1, 1, generator=g))
    k = evtc.compile(scaled, ex, cache_dir=cache)
    # The kernel reads the scalar at the tile's batch, through an (L,) view of the (L, 1, 1) tensor.
    assert "DeviceScalar('alpha_dev', 'float32', batched=True)" in k.source
    assert k.plan.inputs[-1].view == ("L",)
    if not torch.cuda.is_available():
        got = k(**ex)
        acc = ex["a"].float() @ ex["b"].float()
        want = (acc + ex["C"].float() + 0.25 + ex["alpha_dev"], acc * ex["alpha_dev"])
        _close(got, (want[0].half(), want[1].half()), torch.float16)


@pytest.mark.parametrize("a_shape, b_shape", [((3, 37, 24), (24, 53)), ((37, 24), (3, 24, 53)),
                                              ((1, 37, 24), (3, 24, 53)), ((3, 37, 24), (1, 24, 53))])
def test_batches_that_broadcast_take_the_torch_path(cache, a_shape, b_shape):
    """torch.matmul broadcasts a batch dim; the kernel needs both batched alike, so such examples
    compile to a torch-path kernel (strict=True refuses them)."""
    g = torch.Generator().manual_seed(5)
    ex = dict(a=torch.randn(a_shape, generator=g).half(), b=torch.randn(b_shape, generator=g).half(),
              bias=torch.randn(53, generator=g))
    k = evtc.compile(_unused_c, {**ex, "C": 1.0}, cache_dir=cache)
    assert "batch broadcast" in k.source
    got = k(**ex, C=1.0)
    assert k.last_path == "torch" and got.shape == (3, 37, 53)
    _close([got], [(ex["a"].float() @ ex["b"].float() + ex["bias"]).half()], torch.float16)
    with pytest.raises(evtc.CompileError, match="batch broadcast.*strict=True refuses"):
        evtc.compile(_unused_c, {**ex, "C": 1.0}, cache_dir=cache, strict=True)


def test_operands_of_another_float_dtype_than_compiled(cache):
    """The function widens every operand to float32, so the graph gives its result for another
    float operand dtype where torch's outputs keep their dtypes: such calls take the torch path
    (on the GPU too). Here a float32 bias makes both outputs float32 (as torch promotes them), so
    C may be any float dtype and the bias float32 or bfloat16 (float32 beside float16 a and b too);
    a float16 bias (float16 outputs in torch) and non-float dtypes are CallErrors."""
    ex = _inputs() | {"alpha": 0.5}
    k = evtc.compile(residual, ex, cache_dir=cache)
    for C, bias in [(ex["C"].float(), ex["bias"].bfloat16()), (ex["C"].bfloat16(), ex["bias"])]:
        got = k(ex["a"], ex["b"], C=C, bias=bias, alpha=0.5)
        want = residual(ex["a"].float() @ ex["b"].float(), C.float(), bias.float(), 0.5)
        assert [g.dtype for g in got] == [w.dtype for w in residual(ex["a"] @ ex["b"], C, bias, 0.5)]
        _close(got, want, torch.float32)
    with pytest.raises(evtc.CallError, match="with bias a f16 tensor, torch gives the epilogue.s outputs"):
        k(ex["a"], ex["b"], C=ex["C"], bias=ex["bias"].half(), alpha=0.5)
    with pytest.raises(evtc.CallError, match="C must be torch.float16"):
        k(ex["a"], ex["b"], C=ex["C"].double(), bias=ex["bias"], alpha=0.5)


def test_means_over_an_empty_dim_are_nan_on_the_torch_path():
    """torch's mean over an empty dim is NaN; so is the torch path's (its 1/N literal raised
    TypeError at N = 0 before: sympy's complex infinity)."""
    def means(acc):
        return acc.mean(-1), acc.mean(0)

    a, b = torch.randn(16, 32), torch.randn(32, 8)
    k = evtc.compile(means, {"a": a, "b": b})
    for m, n in [(16, 0), (0, 8)]:
        got = k(a[:m], b[:, :n])
        want = means(a[:m] @ b[:, :n])
        assert k.last_path == "torch"
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and torch.equal(g.isnan(), w.isnan()) and g.isnan().all()


def test_a_max_or_min_over_no_elements_is_refused_by_name():
    """amax / amin over an empty reduced extent has no value (torch raises IndexError or
    RuntimeError): evtc raises a CallError naming the reduction and the empty dim, on the torch path
    here and on the kernel path's empty-problem branch (tests/test_compile_gpu.py). A max over a
    dim that is not empty, of an empty problem, is an empty result as torch's."""
    def stats(acc):
        return acc.amax(-1), acc.abs().amax()

    def column_min(acc):
        return acc.amin(0)

    a, b = torch.randn(16, 32), torch.randn(32, 8)
    k = evtc.compile(stats, {"a": a, "b": b})
    with pytest.raises((IndexError, RuntimeError)):
        stats(a[:0] @ b)  # torch itself
    with pytest.raises(evtc.CallError, match=r"amax/max of the accumulator over an empty M \(L = 1, M = 0"):
        k(a[:0], b)
    with pytest.raises(evtc.CallError, match="over an empty N"):
        k(a, b[:, :0])
    c = evtc.compile(column_min, {"a": a, "b": b})
    got = c(a, b[:, :0])  # the minimum of each of no columns: empty, as torch's
    want = column_min(a @ b[:, :0])
    assert got.shape == want.shape == (0,)
    with pytest.raises(evtc.CallError, match="amin/min of the accumulator over an empty M"):
        c(a[:0], b)


def test_torch_legal_broadcasts_run_as_views_of_the_compiled_shapes():
    """A bias of (1, N) for an (N,) example, a device scalar as (1,) or (1, 1) for a 0-d one, and a
    batch of 1 beside batches of 3 on a kernel compiled with equal batches give torch's result
    (evtc.runtime.broadcasts), gradients included; broadcasts that would give torch's result more
    dims stay refused by name."""
    def scaled_bias(acc, bias, s):
        return torch.relu(acc * s + bias)

    a, b = torch.randn(16, 32), torch.randn(32, 8)
    bias, s = torch.randn(8), torch.tensor(0.5)
    k = evtc.compile(scaled_bias, {"a": a, "b": b, "bias": bias, "s": s})
    for call_bias, call_s in [(bias[None], s), (bias, s[None]), (bias[None], s.view(1, 1))]:
        got = k(a, b, bias=call_bias, s=call_s)
        want = scaled_bias(a.double() @ b.double(), call_bias.double(), call_s.double())
        assert got.shape == want.shape
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(evtc.CallError, match=r"bias must be 1-d like its example \(N\), got shape \(1, 1, "):
        k(a, b, bias=bias[None, None], s=s)  # torch's result would be (1, 16, 8)

    # Gradients come back in the caller's shapes.
    row = bias[None].clone().requires_grad_()
    k(a, b, bias=row, s=s).sum().backward()
    twin = bias[None].clone().requires_grad_()
    scaled_bias(a @ b, twin, s).sum().backward()
    assert row.grad.shape == (1, 8)
    torch.testing.assert_close(row.grad, twin.grad)

    def residual(acc, C):
        return acc + C

    A, B, C = torch.randn(3, 16, 32), torch.randn(3, 32, 8), torch.randn(3, 16, 8)
    kb = evtc.compile(residual, {"a": A, "b": B, "C": C})
    assert kb.plan.broadcast_batch is None
    # torch.matmul also broadcasts a 2-d a or b over the other's batch.
    for x, w, c in [(A, B[:1], C), (A[:1], B, C), (A, B, C[:1]), (A[:1], B[:1], C), (A, B[0], C),
                    (A[0], B, C), (A[0], B[:1], C)]:
        got = kb(x, w, C=c)
        want = residual(x.double() @ w.double(), c.double())
        assert got.shape == want.shape == (3, 16, 8)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(evtc.CallError, match="C must be 3-d"):
        kb(A, B, C=C[:1][None])
    k2 = evtc.compile(residual, {"a": a, "b": b, "C": torch.randn(16, 8)})
    with pytest.raises(evtc.CallError, match="C must be 2-d"):
        k2(a, b, C=torch.randn(1, 16, 8))  # torch's result would be (1, 16, 8)


def test_broadcasts_that_would_change_an_output_are_refused_by_name():
    """A broadcast is made into a view only where every output keeps torch's shape and values
    (evtc.runtime.broadcasts, from KernelPlan.reads): an output or a sum that reads only the expanded
    batch of 1, or a reduction whose shape takes a scalar's extra dims, is refused by name rather
    than computed over the expanded batch or in the compiled rank (which gave (3, M, N) for torch's
    (1, M, N), sums three times torch's, and () for torch's (1,))."""
    A, B, C = torch.randn(3, 16, 32), torch.randn(3, 32, 8), torch.randn(3, 16, 8)

    def with_acc(acc, C):
        return acc + C, acc

    def with_c(acc, C):
        return acc + C, C * 2

    def with_sum(acc, C):
        return acc + C, acc.sum()

    def sums_apart(acc, C):
        return (acc + C).sum() - acc.sum()

    for fn, (x, w, c) in [(with_acc, (A[:1], B[:1], C)), (with_c, (A, B, C[:1])),
                          (with_sum, (A[:1], B[:1], C)), (sums_apart, (A[:1], B[:1], C))]:
        k = evtc.compile(fn, {"a": A, "b": B, "C": C})
        kept = (x.clone(), w.clone(), c.clone())
        with pytest.raises(evtc.CallError, match="inconsistent with a and b"):
            k(x, w, C=c)
        assert all(torch.equal(t, u) for t, u in zip(kept, (x, w, c), strict=True))

    # Every output reads C (of the whole batch), the sum included: expanded, torch's result.
    def both_read_c(acc, C):
        return acc + C, (acc * C).sum()

    k = evtc.compile(both_read_c, {"a": A, "b": B, "C": C})
    got = k(A[:1], B, C=C)
    want = both_read_c(A[:1].double() @ B.double(), C.double())
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-3)

    # A scalar read by a reduction keeps its rank: torch's result would take its dims.
    a, b = torch.randn(16, 32), torch.randn(32, 8)

    def scaled_total(acc, s):
        return acc * s, acc.sum() * s

    ks = evtc.compile(scaled_total, {"a": a, "b": b, "s": torch.tensor(0.5)})
    for s in (torch.tensor([0.5]), torch.tensor([[0.5]])):
        with pytest.raises(evtc.CallError, match=r"s has shape \(1(, 1)?,?\), compiled as \(\): torch would "
                           r"broadcast it, .* pass s\.reshape\(\(\)\)"):
            ks(a, b, s=s)
    # Named after what is more basic: an unknown argument, a's dtype.
    with pytest.raises(evtc.CallError, match=r"unexpected argument\(s\) \['t'\]"):
        ks(a, b, s=torch.tensor([0.5]), t=1)
    with pytest.raises(evtc.CallError, match="a must be torch.float32"):
        ks(a.half(), b, s=torch.tensor([0.5]))

    # A scalar only full tiles read still changes rank freely, beside a reduction of acc alone.
    def total_beside(acc, s):
        return acc * s, acc.sum()

    kt = evtc.compile(total_beside, {"a": a, "b": b, "s": torch.tensor(0.5)})
    got = kt(a, b, s=torch.tensor([0.5]))
    want = total_beside(a.double() @ b.double(), torch.tensor([0.5], dtype=torch.float64))
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-3)


def test_the_operator_takes_the_compiled_batches_only():
    """``k.op`` (what torch.compile sees; its shape function takes the batch of ``a``) makes no
    batch broadcast into views: a direct call with a batch of 1 beside 3 is refused by name, while
    ``k(...)`` makes the views before it calls the operator."""
    A, B, C = torch.randn(3, 16, 32), torch.randn(3, 32, 8), torch.randn(3, 16, 8)

    def residual(acc, C):
        return acc + C

    k = evtc.compile(residual, {"a": A, "b": B, "C": C})
    with pytest.raises(evtc.CallError, match="inconsistent with a and b"):
        k.op(A[:1], B[:1], C)
    # The fake implementation (meta tensors, what torch.compile and make_fx trace) refuses what
    # the real call refuses: it returned a shape for a 2-d b, and the graph failed only when run.
    meta = [t.to("meta") for t in (A, B, C)]
    for a, b, message in [(A, B[0], "must be 3-d and 3-d as when compiled"), (A, B[:, :31], "K differs"),
                          (A[:2], B, "batch sizes 2 and 3")]:
        with pytest.raises(evtc.CallError, match=message):
            k.op(a, b, C)
        with pytest.raises(evtc.CallError, match=message):
            k.op(a.to("meta"), b.to("meta"), meta[2])
    A1 = A[:1].clone().requires_grad_()
    got = k(A1, B, C=C)  # autograd: the operator's path, views made first
    assert got.shape == (3, 16, 8)
    got.sum().backward()
    twin = A[:1].clone().requires_grad_()
    residual(twin @ B, C).sum().backward()
    torch.testing.assert_close(A1.grad, twin.grad, rtol=1e-4, atol=1e-4)


def test_empty_problems_check_their_arguments_on_the_kernel_path(tmp_path):
    """An empty problem runs no kernel, so nothing compiled checks it: the call checks its
    arguments itself (a wrong K, a bias of another N, a 3-d a for a 2-d kernel were returned
    outputs), and no layout matters (an ``out=`` of no elements in any strides, under strict too).
    The kernel path is forced, as on a Hopper GPU: an empty problem reaches no compiled function."""
    def bias_stats(acc, bias):
        y = acc + bias
        return y, y.sum(-1)

    a, b, bias = torch.randn(64, 32).half(), torch.randn(32, 128).half(), torch.randn(128).half()
    for strict in (False, True):
        k = evtc.compile(bias_stats, {"a": a, "b": b, "bias": bias}, arch="sm_90a", cache_dir=tmp_path,
                         strict=strict)
        k._kernel_runs = True
        for call, match in [((a[:0], b[:16], bias), "K differs"),
                            ((a[:0], b, bias[:64]), "bias has shape"),
                            ((a[:0].expand(3, 0, 32), b, bias), "must be 2-d"),
                            ((a[:0].float(), b, bias), "must be torch.float16")]:
            with pytest.raises(evtc.CallError, match=match):
                k(call[0], call[1], bias=call[2])
        y, sums = k(a[:0], b, bias=bias)
        assert y.shape == (0, 128) and sums.shape == (0,) and k.last_path == "kernel"
        out = (torch.empty(64, 0, dtype=torch.float16), torch.empty(64, dtype=torch.float16))  # as torch
        y, sums = k(a, b[:, :0], bias=bias[:0], out=out)  # N = 0: sums of nothing are 0
        assert y is out[0] and sums is out[1] and torch.equal(sums, torch.zeros(64, dtype=torch.float16))


def test_a_batch_of_one_beside_a_batch_of_zero_is_torchs_empty_result():
    """torch broadcasts a batch of 1 to a batch of 0; so does the call (it was refused)."""
    def residual(acc, C):
        return acc + C

    A, B, C = torch.randn(3, 16, 32), torch.randn(3, 32, 8), torch.randn(3, 16, 8)
    k = evtc.compile(residual, {"a": A, "b": B, "C": C})
    for x, w, c in [(A[:0], B[:1], C[:0]), (A[:1], B[:0], C[:0]), (A[:1], B[:1], C[:0]),
                    (A[:0], B[:0], C[:1])]:
        got = k(x, w, C=c)
        assert got.shape == residual(x @ w, c).shape == (0, 16, 8)


def test_out_of_no_elements_may_have_stride_0():
    """torch's own empty results can have strides of 0 (``torch.empty_like`` of a (2, 0, 1)
    result): an ``out=`` with no elements shares no memory and is taken."""
    def double(acc):
        return acc * 2

    A, B = torch.randn(2, 0, 32), torch.randn(2, 32, 1)
    k = evtc.compile(double, {"a": torch.randn(2, 16, 32), "b": torch.randn(2, 32, 8)})
    out = torch.empty_strided((2, 0, 1), (0, 1, 0))
    assert k(A, B, out=out) is out


def test_out_of_another_shape_is_refused_with_the_outputs_shape():
    """An out= tensor is written whole: one of another shape (a 2-d out for a batched kernel, a
    row short) is refused with the output's shape, not with the operands' advice to expand it
    (an expanded out= is refused itself: its elements share memory)."""
    def residual(acc, C):
        return acc + C

    A, B, C = torch.randn(3, 16, 32), torch.randn(3, 32, 8), torch.randn(3, 16, 8)
    k = evtc.compile(residual, {"a": A, "b": B, "C": C})
    for out in (torch.empty(16, 8), torch.empty(1, 16, 8), torch.empty(3, 15, 8)):
        with pytest.raises(evtc.CallError, match=r"out must have the output's shape \(3, 16, 8\)") as err:
            k(A, B, C=C, out=out)
        assert "expand" not in str(err.value)
    two = evtc.compile(lambda acc, C: (acc + C, acc * 2), {"a": A, "b": B, "C": C})
    with pytest.raises(evtc.CallError, match=r"out\[.*\] must have the output's shape \(3, 16, 8\)"):
        two(A, B, C=C, out=(torch.empty(3, 16, 8), torch.empty(16, 8)))
    ref = residual(A @ B, C)
    assert torch.allclose(k(A, B, C=C, out=torch.empty(3, 16, 8)), ref, atol=1e-5)


def test_out_of_memory_reaches_the_caller_as_it_is(cache, monkeypatch):
    """A CUDA out-of-memory error in the launch is the caller's to handle (free memory, a smaller
    batch): it is neither retried on staged copies, which need more memory, nor turned into a
    CallError that blames the arguments."""
    def identity(acc):
        return acc

    ex = {"a": torch.empty(8, 64, dtype=torch.bfloat16, device="meta"),
          "b": torch.empty(64, 64, dtype=torch.bfloat16, device="meta").t()}
    k = evtc.compile(identity, ex, arch="sm_90a", cache_dir=cache)
    attempts = []

    def out_of_memory(*args, stage, **kwargs):
        attempts.append(stage)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(k, "_run_kernel", out_of_memory)
    monkeypatch.setattr(k, "_kernel_runs", True)  # as on a Hopper GPU
    a = torch.randn(8, 64).bfloat16()
    b = torch.randn(64, 64).bfloat16()
    with pytest.raises(torch.OutOfMemoryError):
        k(a, b)
    assert attempts == [False]


def test_out_tensors_that_share_memory_are_refused_before_any_is_written(cache):
    """Two outputs into one tensor (or overlapping views of one buffer) would each hold whichever
    was stored last: refused by name. With an input that requires grad (the operator's path, which
    copies into out= after the kernel) a refused out= has written none of its tensors either."""
    def two(acc, C):
        return acc + C, acc * 2

    a, b, C = torch.randn(16, 32), torch.randn(32, 8), torch.randn(16, 8)
    k = evtc.compile(two, {"a": a, "b": b, "C": C}, cache_dir=cache)
    buf = torch.full((16, 16), 7.0)
    with pytest.raises(evtc.CallError, match="share memory"):
        k(a, b, C=C, out=(buf[:, :8], buf[:, 4:12]))
    assert (buf == 7).all()
    same = torch.full((16, 8), 7.0)
    with pytest.raises(evtc.CallError, match="share memory"):
        k(a, b, C=C, out=(same, same))
    assert (same == 7).all()
    first, second = buf[:, :8], buf[:, 8:]  # side by side in one buffer: taken
    k(a, b, C=C, out=(first, second))
    assert torch.allclose(first, a @ b + C, atol=1e-5) and torch.allclose(second, (a @ b) * 2, atol=1e-5)
    good, bad = torch.full((16, 8), 7.0), torch.full((16, 4), 7.0)
    with pytest.raises(evtc.CallError):
        k(a.requires_grad_(), b, C=C, out=(good, bad))
    assert (good == 7).all()


def test_operands_by_position_in_the_functions_order(tmp_path):
    """k(a, b, C, bias) passes the operands as calling the function would: by position after a
    and b, in its parameters' order; mixed with names, and refused when given twice or too many."""
    def epilogue(acc, C, bias, alpha: float = 2.0):
        return acc * alpha + C + bias

    a, b = torch.randn(16, 8), torch.randn(8, 24)
    C, bias = torch.randn(16, 24), torch.randn(24)
    k = evtc.compile(epilogue, {"a": a, "b": b, "C": C, "bias": bias, "alpha": 2.0}, arch="sm_90a",
                     cache_dir=tmp_path)
    want = epilogue(a @ b, C, bias, 0.5)
    torch.testing.assert_close(k(a, b, C, bias, 0.5), want)
    torch.testing.assert_close(k(a, b, C, bias=bias, alpha=0.5), want)
    with pytest.raises(evtc.CallError, match="multiple values for 'C'"):
        k(a, b, C, C=C, bias=bias)
    with pytest.raises(evtc.CallError, match="at most 5 positional"):
        k(a, b, C, bias, 0.5, 1.0)


def test_a_per_batch_operand_given_without_its_batch_dim_broadcasts_as_in_torch(tmp_path):
    """baddbmm's input compiled per batch ((L, 1, N), (L, M, N), (L, M, 1), (L, 1, 1)) and called
    without the batch dim ((N,), (M, N), (M, 1), ()), which torch broadcasts over the batch: the
    same result as torch's."""
    def baddbmm(acc, inp, beta: float, alpha: float):
        return beta * inp + alpha * acc

    L, M, N, K = 3, 17, 23, 33
    a, b = torch.randn(L, M, K).half(), torch.randn(L, K, N).half()
    for compiled, calls in [((L, 1, N), [(N,), (1, N)]), ((L, M, N), [(M, N)]), ((L, M, 1), [(M, 1)]),
                            ((L, 1, 1), [(), (1,)])]:
        k = evtc.compile(baddbmm, {"a": a, "b": b, "inp": torch.randn(compiled).half(), "beta": 1.0,
                                   "alpha": 1.0}, cache_dir=tmp_path)
        for shape in calls:
            inp = torch.randn(shape).half()
            got = k(a, b, inp=inp, beta=0.5, alpha=2.0)
            want = torch.baddbmm(inp.float(), a.float(), b.float(), beta=0.5, alpha=2.0)
            assert got.shape == want.shape and got.dtype == torch.float16, (compiled, shape)
            torch.testing.assert_close(got.float(), want, rtol=2e-3, atol=2e-2)


def _scaled(acc, s, C):
    return acc * s + C


def test_sparse_inputs_compute_as_torch_does_and_other_outs_are_refused(cache):
    """torch computes with a sparse operand or ``a`` as with its dense values (``acc + C`` of a
    sparse C is dense): evtc makes such a tensor dense (on the GPU the staged path; the kernel then
    runs, tests/test_call_paths_gpu.py). out= tensors that are sparse, or inference tensors outside
    inference_mode (torch refuses to update those), are refused by name, before anything runs."""
    a, b, C, s = torch.randn(16, 32), torch.randn(32, 8), torch.randn(16, 8), torch.tensor(0.5)
    k = evtc.compile(_scaled, {"a": a, "b": b, "s": s, "C": C}, cache_dir=cache)
    want = a.double() @ b.double() * 0.5 + C.double()
    for x, c in [(a, C.to_sparse()), (a.to_sparse(), C), (a, C.to_sparse_csr())]:
        got = k(x, b, s=s, C=c)
        assert got.layout == torch.strided and got.shape == want.shape
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(evtc.CallError, match=r"out is a torch.sparse_coo tensor"):
        k(a, b, s=s, C=C, out=torch.zeros(16, 8).to_sparse())
    with torch.inference_mode():
        frozen = torch.zeros(16, 8)
    with pytest.raises(evtc.CallError, match="out is an inference tensor"):
        k(a, b, s=s, C=C, out=frozen)
    assert torch.equal(frozen, torch.zeros(16, 8))
    with torch.inference_mode():  # inside inference_mode torch updates it, and so does evtc
        got = k(a, b, s=s, C=C, out=frozen)
    assert got is frozen
    torch.testing.assert_close(frozen.double(), want, rtol=1e-5, atol=1e-5)


def test_a_float64_scale_is_refused_with_what_to_pass(cache):
    """Epilogue tensors are float32, float16 or bfloat16: a 0-dim float64 scale (as
    ``torch.tensor(np.float64(x))`` makes) is named, with what to pass instead."""
    a, b, C = torch.randn(16, 32), torch.randn(32, 8), torch.randn(16, 8)
    k = evtc.compile(_scaled, {"a": a, "b": b, "s": torch.tensor(0.5), "C": C}, cache_dir=cache)
    with pytest.raises(evtc.CallError, match=r"s must be torch.float32 .*got torch.float64 .*Python number"):
        k(a, b, s=torch.tensor(0.5, dtype=torch.float64), C=C)


def test_a_number_for_a_device_scalar_names_how_it_was_compiled(cache):
    """A one-element tensor example makes a device scalar: a Python number in its place is refused
    with the way to compile a runtime scalar."""
    a, b, C = torch.randn(16, 32), torch.randn(32, 8), torch.randn(16, 8)
    k = evtc.compile(_scaled, {"a": a, "b": b, "s": torch.tensor(0.5), "C": C}, cache_dir=cache)
    with pytest.raises(evtc.CallError, match=r"s must be a torch.Tensor, got float \(s was compiled as a "
                                              r"device scalar.*Python number as its example"):
        k(a, b, s=0.5, C=C)


def test_an_example_of_one_row_names_why_a_tile_operand_became_a_row(cache):
    """An example with M = 1 (one token) classes an (M, N) operand as a row: a later call with more
    rows is refused, and the message says why and what to compile from."""
    def add_residual(acc, residual):
        return acc + residual

    a, b = torch.randn(1, 32), torch.randn(32, 16)
    k = evtc.compile(add_residual, {"a": a, "b": b, "residual": torch.randn(1, 16)}, cache_dir=cache)
    with pytest.raises(evtc.CallError, match=r"compiled as a row vector.*M = 1"):
        k(torch.randn(9, 32), b, residual=torch.randn(9, 16))


def test_a_row_or_column_operand_called_with_more_is_named_as_what_it_is(cache):
    """A column (M, 1) or a row (N,) example called with a tile: the message names the operand's
    kind (it spoke of an example with M = 1 even where the column was deliberate, and said only
    "must be 1-d" for a row)."""
    a, b = torch.randn(16, 32), torch.randn(32, 8)
    col = evtc.compile(lambda acc, x: acc * x, {"a": a, "b": b, "x": torch.randn(16, 1)}, cache_dir=cache)
    with pytest.raises(evtc.CallError, match=r"compiled as a column vector \(one value per row\), \(M, 1\)"):
        col(a, b, x=torch.randn(16, 8))
    row = evtc.compile(lambda acc, x: acc * x, {"a": a, "b": b, "x": torch.randn(8)}, cache_dir=cache)
    with pytest.raises(evtc.CallError, match=r"must be 1-d.*a row vector \(one value per column\)"):
        row(a, b, x=torch.randn(16, 8))


def _residual_bias(acc, C, bias):
    return acc + C + bias


def test_examples_of_one_batch_make_full_rank_operands_per_batch(cache):
    """a and b of batch 1 are per batch, so a (1, M, N) C beside them is too: a later call with a
    batch of 3 takes a C of its own per batch, and a shared (1, M, N) one (expanded)."""
    a, b, C, bias = torch.randn(1, 16, 32), torch.randn(1, 32, 8), torch.randn(1, 16, 8), torch.randn(8)
    k = evtc.compile(_residual_bias, {"a": a, "b": b, "C": C, "bias": bias}, cache_dir=cache)
    assert k.graph.operands["C"].batched
    a3, b3 = torch.randn(3, 16, 32), torch.randn(3, 32, 8)
    for c in (torch.randn(3, 16, 8), torch.randn(1, 16, 8)):
        got = k(a3, b3, C=c, bias=bias)
        want = (a3.double() @ b3.double()) + c.double() + bias.double()
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_an_operand_narrower_than_compiled_names_the_broadcast_and_the_way_out(cache):
    """A (M, 1), (1, N) or 0-d C where a tile was compiled: torch broadcasts it, the kernel reads
    another kind. The refusal says so, names the shape the caller passed (not a view made of it)
    and the way out, C.expand(...), which then gives torch's result."""
    a, b = torch.randn(16, 32), torch.randn(32, 8)
    k = evtc.compile(_residual_bias, {"a": a, "b": b, "C": torch.randn(16, 8), "bias": torch.randn(8)},
                     cache_dir=cache)
    bias = torch.randn(8)
    for C in (torch.randn(16, 1), torch.randn(1, 8), torch.randn(())):
        with pytest.raises(evtc.CallError, match=r"torch would broadcast it, but C was compiled as \(M, N\)"
                                                  r".*C\.expand\(16, 8\)"):
            k(a, b, C=C, bias=bias)
        got = k(a, b, C=C.expand(16, 8), bias=bias)
        want = a.double() @ b.double() + C.double() + bias.double()
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    a3, b3 = torch.randn(3, 16, 32), torch.randn(3, 32, 8)
    k3 = evtc.compile(_residual_bias, {"a": a3, "b": b3, "C": torch.randn(3, 16, 8), "bias": bias},
                      cache_dir=cache)
    with pytest.raises(evtc.CallError, match=r"got shape \(16, 1\) .*C\.expand\(3, 16, 8\)"):
        k3(a3, b3, C=torch.randn(16, 1), bias=bias)


def test_a_shared_operand_called_per_batch_names_the_batch(cache):
    """A (1, M, N) C beside a and b of batch 3, or an (N,) bias, is shared by the batches: a call
    with one of its own per batch is another operand kind, refused with the batch named (not the
    hint for examples of M = 1)."""
    a, b = torch.randn(3, 16, 32), torch.randn(3, 32, 8)
    k = evtc.compile(_residual_bias, {"a": a, "b": b, "C": torch.randn(1, 16, 8), "bias": torch.randn(8)},
                     cache_dir=cache)
    assert not k.graph.operands["C"].batched
    with pytest.raises(evtc.CallError, match=r"C was compiled as shared by all batches, from an example of "
                                              r"batch 1"):
        k(a, b, C=torch.randn(3, 16, 8), bias=torch.randn(8))
    with pytest.raises(evtc.CallError, match=r"bias has a batch of 3 .*shared by all batches"):
        k(a, b, C=torch.randn(1, 16, 8), bias=torch.randn(3, 1, 8))


def test_views_with_torchs_negative_bit(cache):
    """``z.conj().imag`` is a view whose memory holds the negation of its values (torch's negative
    bit): an operand of that kind is resolved before anything reads its memory, and an out= of that
    kind is refused by name (the GPU path: tests/test_call_paths_gpu.py)."""
    a, b = torch.randn(16, 32), torch.randn(32, 8)
    z = torch.complex(torch.randn(16, 8), torch.randn(16, 8))
    C, s = z.conj().imag, torch.complex(torch.tensor(0.0), torch.tensor(0.5)).conj().imag
    assert C.is_neg() and s.is_neg() and s.item() == -0.5
    k = evtc.compile(_scaled, {"a": a, "b": b, "s": torch.tensor(0.5), "C": torch.randn(16, 8)},
                     cache_dir=cache)
    want = a.double() @ b.double() * -0.5 - z.imag.double()
    torch.testing.assert_close(k(a, b, s=s, C=C).double(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(evtc.CallError, match="out is a view with torch's negative bit"):
        k(a, b, s=s, C=C, out=z.conj().imag)


def test_autocast_casts_nothing_and_says_so(cache):
    """Under torch.autocast a compiled kernel runs the dtypes it was compiled for: float32 a and b
    into a bfloat16 kernel are refused with a message that names autocast."""
    bf = torch.bfloat16
    a, b = torch.randn(16, 32, dtype=bf), torch.randn(32, 8, dtype=bf)
    k = evtc.compile(lambda acc: torch.relu(acc), {"a": a, "b": b}, cache_dir=cache)
    with torch.autocast("cpu", bf):
        with pytest.raises(evtc.CallError, match="a must be torch.bfloat16.*torch.autocast does not cast"):
            k(a.float(), b.float())
        got = k(a, b)
    assert got.dtype == bf
    torch.testing.assert_close(got.float(), torch.relu(a.float() @ b.float()).to(bf).float())


def test_a_2d_b_beside_a_batched_a_through_the_operator(cache):
    """The broadcast of a 2-d b (or a) over a batched other also holds where the call goes through
    the custom operator (an input that requires grad, a dispatch mode): values and gradients as
    torch's."""
    def residual(acc, C):
        return acc + C

    A, B, C = torch.randn(3, 16, 32), torch.randn(3, 32, 8), torch.randn(3, 16, 8)
    k = evtc.compile(residual, {"a": A, "b": B, "C": C}, cache_dir=cache)
    for x, w in [(A, B[0]), (A[0], B)]:
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        got = k(xg, wg, C=C)
        got.square().sum().backward()
        xt, wt = x.double().requires_grad_(), w.double().requires_grad_()
        want = residual(xt @ wt, C.double())
        want.square().sum().backward()
        assert got.shape == want.shape == (3, 16, 8)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(xg.grad.double(), xt.grad, rtol=1e-4, atol=1e-3)
        torch.testing.assert_close(wg.grad.double(), wt.grad, rtol=1e-4, atol=1e-3)


def test_sparse_and_negated_operands_under_a_dispatch_mode(cache):
    """Under a dispatch mode the call goes through the operator, which takes strided tensors: a
    sparse operand is made dense and a negative-bit view resolved there too."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    a, b, C, s = torch.randn(16, 32), torch.randn(32, 8), torch.randn(16, 8), torch.tensor(0.5)
    k = evtc.compile(_scaled, {"a": a, "b": b, "s": s, "C": C}, cache_dir=cache)
    want = a.double() @ b.double() * 0.5 + C.double()
    with Passthrough():
        sparse = k(a, b, s=s, C=C.to_sparse())
        negated = k(a, b, s=s, C=torch._neg_view(-C))
    torch.testing.assert_close(sparse.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(negated.double(), want, rtol=1e-5, atol=1e-5)


def test_a_wrong_dtype_on_meta_tensors_is_a_call_error(cache):
    h = torch.float16
    ex = {"a": torch.randn(16, 32, dtype=h), "b": torch.randn(32, 8, dtype=h)}
    k = evtc.compile(lambda acc: acc * 2, ex, cache_dir=cache)
    with pytest.raises(evtc.CallError, match="a must be torch.float16"):
        k(torch.empty(16, 32, device="meta"), torch.empty(32, 8, dtype=h, device="meta"))


def _stats(acc, C):
    return acc + C, (acc * C).sum(-1), acc.amax(0)


def test_out_of_no_elements_is_resized_as_torch_resizes_it(cache):
    """``torch.empty(0)`` for ``out=`` is resized to the output's shape, as torch's ops resize it
    (tiles, per-row and per-column reductions alike); one of another dtype, or with elements and
    another shape, is refused and left as it was."""
    a, b, C = torch.randn(16, 32), torch.randn(32, 8), torch.randn(16, 8)
    k = evtc.compile(_stats, {"a": a, "b": b, "C": C}, cache_dir=cache)
    out = (torch.empty(0), torch.empty(0), torch.empty(0))
    assert all(r is o for r, o in zip(k(a, b, C=C, out=out), out, strict=True))
    acc = a.double() @ b.double()
    for got, want in zip(out, (acc + C.double(), (acc * C.double()).sum(-1), acc.amax(0)), strict=True):
        assert got.shape == want.shape and torch.allclose(got.double(), want, atol=1e-4)
    wrong_dtype = (torch.empty(0, dtype=torch.float16), torch.empty(0), torch.empty(0))
    with pytest.raises(evtc.CallError, match=r"out\['D0'\] must be torch.float32"):
        k(a, b, C=C, out=wrong_dtype)
    assert all(t.shape == (0,) for t in wrong_dtype)
    with_elements = (torch.full((4, 8), 7.0), torch.empty(0), torch.empty(0))
    with pytest.raises(evtc.CallError, match="shape"):
        k(a, b, C=C, out=with_elements)
    assert with_elements[0].shape == (4, 8) and (with_elements[0] == 7).all()
    shared = torch.empty(0)
    with pytest.raises(evtc.CallError):
        k(a, b, C=C, out=(shared, shared, torch.empty(0)))
    assert shared.shape == (0,)


def test_linear_resizes_an_empty_out_to_xs_leading_dims(cache):
    """evtc.linear's empty ``out=`` tensors take x's leading dims where the output has rows."""
    def residual_and_norms(acc, C):
        return acc + C, (acc * acc).sum(-1)

    w = torch.randn(8, 32)
    example = {"x": torch.randn(2, 3, 32), "weight": w, "C": torch.randn(2, 3, 8)}
    lin = evtc.linear(residual_and_norms, example, cache_dir=cache)
    for lead in [(), (6,), (2, 3)]:
        x, C = torch.randn(*lead, 32), torch.randn(*lead, 8)
        out = (torch.empty(0), torch.empty(0))
        assert all(r is o for r, o in zip(lin(x, w, C=C, out=out), out, strict=True))
        y = torch.nn.functional.linear(x.double(), w.double())
        assert out[0].shape == (*lead, 8) and torch.allclose(out[0].double(), y + C.double(), atol=1e-4)
        assert out[1].shape == lead and torch.allclose(out[1].double(), (y * y).sum(-1), rtol=1e-4)


def test_an_int_scalar_beyond_int64_is_named(cache):
    """torch refuses an int scalar that does not fit in int64; so does the call, by name (the
    interpreter raised OverflowError)."""
    def scaled(acc, alpha: float):
        return acc * alpha

    a, b = torch.randn(8, 16), torch.randn(16, 8)
    k = evtc.compile(scaled, {"a": a, "b": b, "alpha": 2.0}, cache_dir=cache)
    with pytest.raises(evtc.CallError, match="does not fit in int64"):
        k(a, b, alpha=10**400)
    assert torch.allclose(k(a, b, alpha=2**62), (a @ b) * 2.0**62, rtol=1e-5)


def test_an_operand_whose_shape_the_epilogue_reads_keeps_its_compiled_shape():
    """``C.size(0)``, ``bias.dim()``, ``(C * 2).dim()``: the graph holds the sizes at the compiled
    shapes, so a call that passes such an operand in another shape torch broadcasts (or a and b
    of batch 1 where acc's shape is read) is refused by name. It was computed with the compiled
    sizes: silently not torch's values (found by a docs audit)."""
    L, M, N, K = 3, 6, 8, 4
    A, B = torch.randn(L, M, K), torch.randn(L, K, N)
    cases = [  # (function, example (a, b, C), call (a, b, C), whose shape is read)
        (lambda acc, C: acc * C.size(0) + C, (A, B, torch.randn(L, M, N)), (A, B, torch.randn(M, N)), "C"),
        (lambda acc, C: acc * C.dim() + C, (A, B, torch.randn(L, M, N)), (A, B, torch.randn(M, N)), "C"),
        (lambda acc, C: acc * C.size(0) + C, (A[0], B[0], torch.randn(N)),
         (A[0], B[0], torch.randn(1, N)), "C"),
        (lambda acc, C: acc * (C * 2).dim() + C, (A[0], B[0], torch.tensor([0.5])),
         (A[0], B[0], torch.tensor([[0.5]])), "C"),
        (lambda acc, C: acc * C.numel() + C, (A, B, torch.randn(L, 1, N)), (A, B, torch.randn(N)), "C"),
        (lambda acc, C: acc * C.shape[0] + C, (A[:1], B[:1], torch.randn(1, M, N)),
         (A, B, torch.randn(1, M, N)), "C"),
        (lambda acc, C: acc * acc.size(0) + C, (A, B, torch.randn(L, M, N)),
         (A[:1], B[:1], torch.randn(L, M, N)), "acc"),
    ]
    for fn, example, (a, b, C), name in cases:
        k = evtc.compile(fn, {"a": example[0], "b": example[1], "C": example[2]})
        kept = C.clone()
        with pytest.raises(evtc.CallError, match=rf"the epilogue reads {name}'s shape"):
            k(a, b, C=C)
        assert torch.equal(C, kept)
        # In the compiled shapes the same kernel gives torch's values.
        ea, eb, eC = example
        torch.testing.assert_close(k(ea, eb, C=eC), fn(torch.matmul(ea, eb), eC), rtol=1e-5, atol=1e-5)
    # A size of acc alone (1/N) leaves operands free to broadcast.
    k = evtc.compile(lambda acc, bias: acc / acc.shape[-1] + bias,
                     {"a": A[0], "b": B[0], "bias": torch.randn(N)})
    bias = torch.randn(1, N)
    torch.testing.assert_close(k(A[0], B[0], bias=bias), (A[0] @ B[0]) / N + bias, rtol=1e-5, atol=1e-5)


def test_rank_changes_absorbed_by_a_full_tile_are_taken():
    """A (1,) scale for a 0-d example or a (1, N) bias for an (N,) one, read by a reduction only
    through a full tile of acc (``(acc * s).abs().amax()``, ``(acc + bias).sum(-1)``): torch's
    shapes do not change, so the call runs as a view (it was refused whenever a reduction read the
    operand; found by restating TransformerEngine's (1,)-shaped scales)."""
    a, b = torch.randn(16, 32), torch.randn(32, 8)

    def scaled_amax(acc, s):
        y = acc * s
        return y, y.abs().amax()

    def bias_rowsum(acc, bias):
        y = acc + bias
        return y, y.sum(-1)

    for fn, example, given in [(scaled_amax, torch.tensor(0.5), torch.tensor([0.5])),
                               (scaled_amax, torch.tensor(0.5), torch.tensor([[0.5]])),
                               (bias_rowsum, torch.randn(8), torch.randn(1, 8))]:
        k = evtc.compile(fn, {"a": a, "b": b, ("s" if fn is scaled_amax else "bias"): example})
        got = k(a, b, given)
        want = fn(a.double() @ b.double(), given.double())
        assert [g.shape for g in got] == [w.shape for w in want]
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5)


def test_an_output_of_shared_operands_alone_lets_a_and_b_broadcast_their_batch():
    """``C * 2`` of a shared (M, N) C is the same in every batch: a 2-d a or b, or one of batch 1,
    beside a 3-d other gives torch's result, that output (M, N). It was refused (the expansion
    rule asked every output to read an input of the whole batch)."""
    def fn(acc, C):
        return acc + C, C * 2

    A, B, C = torch.randn(3, 6, 4), torch.randn(3, 4, 8), torch.randn(6, 8)
    k = evtc.compile(fn, {"a": A, "b": B, "C": C})
    for a, b in ((A[0], B), (A, B[0]), (A[:1], B), (A, B[:1])):
        got, want = k(a, b, C=C), fn(torch.matmul(a.double(), b.double()), C.double())
        assert [g.shape for g in got] == [w.shape for w in want]
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5)


def test_operands_that_lose_their_batch_dim_need_acc_to_keep_the_tile_full():
    """C and D compiled as (L, M, N) and passed as (M, N) beside a and b of batch 1: torch's
    ``C * D`` is (M, N), which no input of the kernel's keeps 3-d, so the call is refused (each
    operand's full tile counted as absorbing the other's missing dim, and evtc returned
    (1, M, N)); ``acc + C`` alone keeps torch's shape, and runs."""
    L, M, N, K = 2, 8, 12, 4
    A, B, C, D = torch.randn(L, M, K), torch.randn(L, K, N), torch.randn(L, M, N), torch.randn(L, M, N)

    def both(acc, C, D):
        return acc + C, C * D

    k = evtc.compile(both, {"a": A, "b": B, "C": C, "D": D})
    with pytest.raises(evtc.CallError, match=r"C has shape \(8, 12\), compiled as \(L, M, N\): torch "
                       r"would broadcast it, but an output or reduction .* fewer dims .* pass "
                       r"C\.expand\(1, 8, 12\)"):
        k(A[:1], B[:1], C=C[0], D=D[0])
    k2 = evtc.compile(lambda acc, C: acc + C, {"a": A, "b": B, "C": C})
    got, want = k2(A, B, C=C[0]), A @ B + C[0]
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_an_extra_dim_an_output_would_keep_is_refused_with_the_reason():
    """``C * 2`` beside batched a and b, C compiled (M, N) and passed (1, M, N): torch's second
    output is (1, M, N), which the kernel (C shared by the batch) cannot give; the refusal says
    why and how (it named only the rank), and the view it suggests runs as torch runs it."""
    L, M, N, K = 3, 5, 7, 4
    A, B, C, bias = torch.randn(L, M, K), torch.randn(L, K, N), torch.randn(M, N), torch.randn(N)

    def pair(acc, C, bias):
        return acc + bias, C * 2

    k = evtc.compile(pair, {"a": A, "b": B, "C": C, "bias": bias})
    with pytest.raises(evtc.CallError, match=r"C has shape \(1, 5, 7\), compiled as \(M, N\): torch would "
                       r"broadcast it, .* pass C.reshape\(5, 7\)"):
        k(A, B, C=C[None], bias=bias)
    # The operator's path (an input that requires grad) says the same, and like the call path
    # names a more basic problem first (it raised the rank change before any other check).
    with pytest.raises(evtc.CallError, match=r"C has shape \(1, 5, 7\), compiled as \(M, N\): .* "
                       r"pass C.reshape\(5, 7\)"):
        k(A.clone().requires_grad_(), B, C=C[None], bias=bias)
    for a in (A.half(), A.half().requires_grad_()):
        with pytest.raises(evtc.CallError, match=r"a must be torch.float32 \(as compiled\), got "):
            k(a, B.half(), C=C[None], bias=bias)
    got, want = k(A, B, C=C[None].reshape(5, 7), bias=bias), pair(A @ B, C, bias)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_a_full_output_of_narrower_operands_takes_an_extra_dim():
    """``bias * col`` is a full (M, N) output from a row and a column: a bias passed as (1, N) for
    its (N,) example leaves torch's shape as it is, and runs (it was refused)."""
    a, b = torch.randn(8, 16), torch.randn(16, 12)
    fn = lambda acc, bias, col: (acc, bias * col)  # noqa: E731
    k = evtc.compile(fn, {"a": a, "b": b, "bias": torch.randn(12), "col": torch.randn(8, 1)})
    bias, col = torch.randn(1, 12), torch.randn(8, 1)
    got, want = k(a, b, bias=bias, col=col), fn(a @ b, bias, col)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_reading_the_last_dim_leaves_operands_free_to_broadcast():
    """``y.shape[-1]`` of ``y = acc + bias`` is N whatever rank bias comes in: the call with a
    (1, N) bias runs (any read of a value's shape refused its operands' broadcasts); a leading
    size or the rank still refuses it, and a wrong width is named as such."""
    a, b = torch.randn(8, 16), torch.randn(16, 12)

    def last(acc, bias):
        y = acc + bias
        return y / y.shape[-1] + y.size(-1) + y.shape[:-1].numel()

    k = evtc.compile(last, {"a": a, "b": b, "bias": torch.randn(12)})
    with pytest.raises(evtc.CallError, match="reads bias's shape"):  # shape[:-1] reads leading sizes
        k(a, b, bias=torch.randn(1, 12))
    k = evtc.compile(lambda acc, bias: (acc + bias) / (acc + bias).shape[-1],
                     {"a": a, "b": b, "bias": torch.randn(12)})
    bias = torch.randn(1, 12)
    torch.testing.assert_close(k(a, b, bias=bias), (a @ b + bias) / 12, rtol=1e-5, atol=1e-5)
    with pytest.raises(evtc.CallError, match=r"bias must be 1-d"):
        k(a, b, bias=torch.randn(1, 13))


def test_a_shape_concatenated_counts_as_read():
    """``(C.shape + (1,))[0]`` reads C's leading size through a plain tuple: it counts as a read,
    so C keeps its compiled (1, N) shape (it was viewed from (N,), and evtc multiplied by 1 where
    torch multiplies by N; found by a second review)."""
    a, b = torch.randn(8, 16), torch.randn(16, 12)
    for fn in (lambda acc, C: (acc + C) * (C.shape + (1,))[0],
               lambda acc, C: (acc + C) * ((7,) + C.shape)[1]):
        k = evtc.compile(fn, {"a": a, "b": b, "C": torch.randn(1, 12)})
        with pytest.raises(evtc.CallError, match="reads C's shape"):
            k(a, b, C=torch.randn(12))
