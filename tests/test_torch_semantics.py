"""The graph means what the function means in torch: the cases of tests/semantics_cases.py traced
and evaluated on the CPU against the function run by torch on the same accumulator, and the
forms torch itself refuses refused with an evtc error at the user's line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from semantics_cases import CASES, operands, torch_reference
from support import flatten

import evtc

M, N, K = 24, 32, 16


def _inputs(spec, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=g).half()
    b = torch.randn(K, N, generator=g).half()
    return a, b, operands(spec, M, N, torch.float16, "cpu", seed)


def _same(got, want):
    got, want = got.float(), want.float()
    assert got.shape == want.shape and got.dtype == want.dtype or got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan()), (got, want)
    assert torch.equal(got.isinf() & (got > 0), want.isinf() & (want > 0)), (got, want)
    assert torch.equal(got.isinf() & (got < 0), want.isinf() & (want < 0)), (got, want)
    finite = want.isfinite()
    torch.testing.assert_close(got[finite], want[finite], rtol=2e-6, atol=1e-5)


@pytest.mark.parametrize("name", sorted(CASES))
def test_graph_matches_torch(name):
    fn, spec = CASES[name]
    a, b, ops = _inputs(spec)
    graph = evtc.trace(fn, {"a": a, "b": b, **ops})
    got = graph.evaluate({"a": a, "b": b, **ops}, cast_outputs=True)
    acc = a.float() @ b.float()
    want = torch_reference(fn, acc, ops)
    for (_, g), (_, w) in zip(flatten(got), flatten(want), strict=True):
        if name == "cast_to_operand_dtype":
            # torch: float32 acc + float16 C is float32, cast back to C's float16
            assert g.dtype == torch.float16
            w = (acc + ops["C"].float()).to(torch.float16)
        _same(g, w)


def test_clamp_at_a_tie_keeps_the_signed_zero():
    """torch's clamp by a number keeps x where it equals the bound: -0.0 clamped at 0.0 stays -0.0,
    and 1 / it is -inf. The interpreter (the torch path's evaluator) must not return the bound
    there, as CPU torch's clamp by a tensor bound does on long rows; a NaN bound still gives NaN."""
    def ties(acc, C, lo: float):
        return (1.0 / C.clamp_max(0.0), 1.0 / C.clamp(min=lo), 1.0 / C.clamp_min(-0.0),
                1.0 / torch.clamp(C, 0.0, 1.0), torch.clamp(C, float("nan"), 1.0))

    a, b = torch.randn(64, 32), torch.randn(32, 64)
    C = torch.zeros(64, 64)
    C[:, ::2] = -0.0
    C[:, 1::4] = 0.5
    inputs = {"a": a, "b": b, "C": C, "lo": 0.0}
    got = evtc.trace(ties, inputs).evaluate(inputs, cast_outputs=True)
    want = ties(a @ b, C, 0.0)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.isnan(), w.isnan())
        finite = ~w.isnan()
        assert torch.equal(g[finite], w[finite]) and torch.equal(g[finite].signbit(), w[finite].signbit())


def test_half_mean_rounds_once():
    """A 16-bit mean is summed and divided in float32 and rounded once, as torch does: a sum
    rounded to float16 first overflows to inf for these rows."""
    a = torch.full((2, 4), 1.0).half()
    b = torch.full((4, 64), 1.0).half()  # acc = 4 everywhere; * 3000 = 12000, a row sums to 768000
    graph = evtc.trace(CASES["half_mean_and_float_sum"][0], {"a": a, "b": b})
    mean, total, _ = graph.evaluate({"a": a, "b": b}, cast_outputs=True)
    assert torch.equal(mean, torch.full((2,), 12000.0))
    assert torch.equal(total, torch.full((2,), 768000.0)) and total.dtype == torch.float32


def test_operand_reports_its_own_dtype():
    seen = {}

    def fn(acc, C):
        seen["dtype"] = C.dtype
        return acc + C

    a, b, ops = _inputs({"C": "MN"})
    evtc.trace(fn, {"a": a, "b": b, **ops})
    assert seen["dtype"] == torch.float16


def _refused(fn, match, **ops):
    a, b, _ = _inputs({})
    with pytest.raises(evtc.EpilogueError, match=match) as info:
        evtc.trace(fn, {"a": a, "b": b, **ops})
    assert "test_torch_semantics.py" in str(info.value)  # the user's file and line


def test_what_torch_refuses_is_refused():
    _refused(lambda acc: acc - (acc > 0), "subtraction or negation of a boolean mask")
    _refused(lambda acc: -(acc > 0), "subtraction or negation of a boolean mask")
    _refused(lambda acc: torch.sub(acc, acc > 0, alpha=0.5), "subtraction or negation of a boolean mask")
    _refused(lambda acc: (acc * 1.0).sub_(acc > 0, alpha=2), "subtraction or negation of a boolean mask")
    _refused(lambda acc: torch.add(acc > 0, acc > 1, alpha=0.5) * acc, "int alpha")
    _refused(lambda acc: torch.where(acc, acc, 0.0), "condition is torch.float32, not a boolean mask")
    _refused(lambda acc: acc & (acc > 0), "not a boolean mask")
    _refused(lambda acc: (acc > 0) ^ acc, "not a boolean mask")
    _refused(lambda acc, s: torch.add(acc, acc, alpha=s), "alpha must be a number", s=torch.tensor([0.5]))
    # Activations and abs of a mask raise in torch (other unary ops promote it to float).
    for fn in (lambda acc: F.relu(acc > 0.3) * acc, lambda acc: (acc > 0).abs(), lambda acc: F.relu6(acc > 0),
               lambda acc: F.gelu(acc > 0), lambda acc: F.silu(acc > 0), lambda acc: F.leaky_relu(acc > 0),
               lambda acc: F.hardsigmoid(acc > 0), lambda acc: F.softplus(acc > 0)):
        _refused(fn, "of a boolean mask, which torch refuses")
    a, b, _ = _inputs({})
    for fn in (lambda acc: torch.exp(acc > 0), lambda acc: torch.sigmoid(acc > 0) * acc):
        torch.testing.assert_close(evtc.trace(fn, {"a": a, "b": b}).evaluate({"a": a, "b": b}).float(),
                                   fn(a.float() @ b.float()), rtol=1e-3, atol=1e-3)


def test_unsupported_python_forms_are_named():
    _refused(lambda acc: acc // 2, "//, %")
    _refused(lambda acc: acc % 2, "//, %")
    _refused(lambda acc: round(acc), "round")
    _refused(lambda acc: torch.where(acc > 0, True, False), "Python bool True")
    _refused(lambda acc: acc * (acc.shape[-1] % 2), "only known at run time")


def test_logit_eps_must_be_a_number():
    _refused(lambda acc, s: torch.logit(acc.sigmoid(), eps=s), "eps must be a number .* runtime value",
             s=torch.tensor([0.1]))
    _refused(lambda acc, s: torch.logit(acc.sigmoid(), eps=s), "eps must be a number .* runtime value", s=0.1)
    _refused(lambda acc: torch.logit(acc.sigmoid(), eps="0.1"), "eps must be a number .*'0.1'")


def test_tensor_default_is_refused():
    def fn(acc, bias=torch.ones(N)):  # noqa: B008 (the point of the test)
        return acc + bias

    a, b, _ = _inputs({})
    with pytest.raises(evtc.InputError, match="tensor default"):
        evtc.trace(fn, {"a": a, "b": b})


def test_in_place_on_an_alias_is_refused():
    def fn(acc):
        y = acc.float()  # a float32 copy of the float16 acc
        z = y.float()  # torch: y itself
        z += 1.0
        return z * y

    _refused(fn, "value's own dtype")


def test_reference_takes_positional_only_parameters():
    fn, spec = CASES["positional_only"]
    a, b, ops = _inputs(spec)
    got = evtc.reference(fn, {"a": a, "b": b, **ops})
    want = fn(a.float() @ b.float(), ops["C"].float(), bias=ops["bias"].float())
    torch.testing.assert_close(got, want)


def test_reduction_of_a_value_shared_by_every_batch_is_refused():
    """In a batched problem, (C * 2).sum() of a C shared by every batch counts C once in torch; the
    kernel reduces per batch and would count it once per batch: refused at the user's line."""
    def shared(acc, C):
        return acc, (C * 2).sum(-1)

    ex = {"a": torch.randn(3, 8, 16).half(), "b": torch.randn(3, 16, 32).half(),
          "C": torch.randn(8, 32).half()}
    with pytest.raises(evtc.ReductionError, match="same in every batch") as info:
        evtc.trace(shared, ex)
    assert "test_torch_semantics.py" in str(info.value)
    with pytest.raises(evtc.ReductionError, match="same in every batch"):  # read through arithmetic
        evtc.trace(lambda acc, C: (acc, C.float().amax() * 3), ex)

    # One the function computes and drops is legal torch (a random-program probe found it refused).
    def dropped(acc, C):
        total = C.sum()  # noqa: F841 - computed and not returned
        return acc * 2.0

    graph = evtc.trace(dropped, ex)
    got = graph.evaluate(ex, cast_outputs=True)
    torch.testing.assert_close(got.float(), (ex["a"].float() @ ex["b"].float()) * 2, rtol=2e-3, atol=2e-3)
    # Per batch through acc it is fine.
    graph = evtc.trace(lambda acc, C: (acc * C).sum(-1), ex)
    got = graph.evaluate(ex, cast_outputs=True)
    want = ((ex["a"].float() @ ex["b"].float()) * ex["C"].float()).sum(-1)
    assert got.dtype == torch.float16  # as torch sums float16 values
    torch.testing.assert_close(got.float(), want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("fn", [
    lambda acc: torch.pow(acc, exponent=2).float(),
    lambda acc: acc.pow(exponent=3.0).float(),
    lambda acc: torch.pow(self=2.0, exponent=acc * 0.1).float(),
    lambda acc, C: torch.max(acc, other=C).float(),
    lambda acc, C: torch.min(acc, other=C).float(),
], ids=["pow_exponent", "method_pow_exponent", "pow_self", "max_other", "min_other"])
def test_keyword_spellings_torch_accepts(fn):
    """Keyword forms of torch's signatures: ``exponent=`` (and ``self=``) of pow, ``other=`` of
    max and min were refused ("argument(s) other not supported")."""
    spec = {"C": "MN"} if fn.__code__.co_argcount == 2 else {}
    a, b, ops = _inputs(spec)
    ops = {k: v.float() for k, v in ops.items()}
    graph = evtc.trace(fn, {"a": a, "b": b, **ops})
    got = graph.evaluate({"a": a, "b": b, **ops}, cast_outputs=False)
    _same(got, fn(a.float() @ b.float(), **ops))


def test_runtime_scalar_parameters_of_activations():
    """F.leaky_relu(x, s) and F.elu(x, alpha) with s, alpha passed per call compute as torch's;
    softplus's beta, which evtc takes only as a compile-time number, is refused saying so."""
    def epilogue(acc, slope: float, alpha: float):
        return F.leaky_relu(acc, slope) * 2 + F.elu(acc, alpha=alpha)

    a, b, _ = _inputs({})
    graph = evtc.trace(epilogue, {"a": a, "b": b, "slope": 0.1, "alpha": 1.0})
    for slope, alpha in ((0.3, 1.7), (-0.5, 0.25)):
        got = graph.evaluate({"a": a, "b": b, "slope": slope, "alpha": alpha}, cast_outputs=True)
        acc = a.float() @ b.float()
        want = F.leaky_relu(acc, slope) * 2 + F.elu(acc, alpha=alpha)
        torch.testing.assert_close(got, want.half())
    with pytest.raises(evtc.UnsupportedOpError, match="beta is a runtime scalar") as info:
        evtc.trace(lambda acc, beta: F.softplus(acc, beta=beta), {"a": a, "b": b, "beta": 2.0})
    assert "test_torch_semantics.py" in str(info.value)


def test_numpy_scalars_are_python_numbers():
    np = pytest.importorskip("numpy")

    def epilogue(acc, alpha: float):
        return acc * alpha

    a, b, _ = _inputs({})
    k = evtc.compile(epilogue, {"a": a, "b": b, "alpha": np.float32(0.5)}, arch="sm_90a")
    assert [i.kind for i in k.plan.inputs if i.name == "alpha"] == ["arg"]
    want = (a.float() @ b.float()) * 1.25
    for alpha in (np.float32(1.25), np.float64(1.25), 1.25):
        torch.testing.assert_close(k(a, b, alpha=alpha).float(), want.half().float())


def test_numpy_scalar_on_the_left_of_an_operator():
    """``np.float32(2) * acc``: NumPy's scalar tried to make an array of the traced value (len(),
    bool()) and the trace failed with a control-flow error naming neither; torch takes it as the
    reflected operator with a Python number, and so does evtc now: every such operator gives the
    graph, and the values, of the same function with Python numbers (whose semantics the cases
    above check against torch), and torch's own values on the float32 accumulator within the
    float16 rounding of the outputs."""
    np = pytest.importorskip("numpy")

    def with_numpy(acc, C):
        return (np.float32(2.0) * acc + np.float64(1.5) - C, np.float32(3.0) / (acc.abs() + 1),
                torch.where(np.float32(0.5) > acc, acc, C), torch.where(np.float64(-0.5) <= acc, C, acc),
                np.float32(2.0) ** (acc * 0.01),
                (np.float32(1.0) == acc).float() + (np.int64(2) != C).float())

    def with_python(acc, C):
        return (2.0 * acc + 1.5 - C, 3.0 / (acc.abs() + 1), torch.where(0.5 > acc, acc, C),
                torch.where(-0.5 <= acc, C, acc), 2.0 ** (acc * 0.01),
                (1.0 == acc).float() + (2 != C).float())

    a, b, ops = _inputs({"C": "MN"})
    feeds = {"a": a, "b": b, **ops}
    got = evtc.trace(with_numpy, feeds).evaluate(feeds, cast_outputs=True)
    same = evtc.trace(with_python, feeds).evaluate(feeds, cast_outputs=True)
    want = with_python(a.float() @ b.float(), ops["C"].float())
    for g, s, w in zip(got, same, want, strict=True):
        assert g.dtype == s.dtype and torch.equal(g, s)
        torch.testing.assert_close(g.float(), w, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("call", ["exp", "maximum", "multiply"])
def test_numpy_function_of_a_traced_value_is_refused_by_name(call):
    """``np.exp(acc)``: refused naming the NumPy function and the torch one to use, at the user's
    line (NumPy's own attempt to make an array of the value gave a control-flow error)."""
    np = pytest.importorskip("numpy")
    functions = {"exp": lambda acc: np.exp(acc), "maximum": lambda acc: np.maximum(acc, 0),
                 "multiply": lambda acc: np.multiply(acc, 2)}
    a, b, _ = _inputs({})
    message = f"numpy.{call} of a traced value.*torch.{call}"
    with pytest.raises(evtc.UnsupportedOpError, match=message) as info:
        evtc.trace(functions[call], {"a": a, "b": b})
    assert "test_torch_semantics.py" in str(info.value)


def test_numpy_scalars_as_compile_time_constants(tmp_path):
    """A NumPy flag or an unused NumPy number in the examples is the Python value it holds: the
    kernel compiles (its plan is JSON) and calls pass either form."""
    np = pytest.importorskip("numpy")

    def epilogue(acc, alpha: float, flag: bool):
        return acc * 2.0 if flag else acc

    a, b, _ = _inputs({})
    k = evtc.compile(epilogue, {"a": a.to("meta"), "b": b.to("meta"), "alpha": np.float32(0.5),
                                "flag": np.bool_(True)}, arch="sm_90a", cache_dir=tmp_path)
    want = ((a.float() @ b.float()) * 2).half()
    for alpha, flag in ((0.5, True), (np.float32(3.0), np.bool_(True))):
        torch.testing.assert_close(k(a, b, alpha=alpha, flag=flag), want)


def test_infinity_tests_see_where_a_16bit_accumulator_overflows():
    """torch's float16 a @ b is inf where the product passes float16's range; evtc holds it in
    float32, so nan_to_num and the infinity tests take the bound where torch's value overflows
    (65520: half a unit past 65504, where a tie rounds to infinity)."""
    a = torch.tensor([[256.0], [-256.0], [1.0]]).half()
    b = torch.tensor([[400.0, 255.875, 256.0, 3.0]]).half()  # 102400, 65504 (the largest), 65536, 3

    def tests(acc):
        return (torch.nan_to_num(acc), torch.nan_to_num(acc, posinf=1.0, neginf=-1.0),
                torch.isinf(acc).float(), torch.isfinite(acc).float(), torch.isposinf(acc).float(),
                torch.isneginf(acc).float())

    got = evtc.trace(tests, {"a": a, "b": b}).evaluate({"a": a, "b": b}, cast_outputs=True)
    want = tests(a @ b)  # torch's own float16 product
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w), (g, w)


def test_a_16bit_operand_compares_with_numbers_rounded_to_its_dtype():
    """torch compares a float16 C with a Python number, a 0-dim float32 tensor or a runtime scalar
    in float16: the number is rounded first (0.1 is float16's 0.0999755859375, which C holds). evtc
    loads C widened to float32, and rounds the other side as torch does."""
    a = torch.randn(8, 16).half()
    b = torch.randn(16, 12).half()
    C = torch.full((8, 12), 0.1).half()
    C[::2] = 0.2

    def compared(acc, C, s, t: float):
        return (C == 0.1).float(), (C >= s).float(), (C > t).float(), (0.1 <= C).float()

    ops = {"C": C, "s": torch.tensor(0.09999), "t": 0.09997}
    got = evtc.trace(compared, {"a": a, "b": b, **ops}).evaluate({"a": a, "b": b, **ops}, cast_outputs=True)
    want = compared(a @ b, **ops)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w), (g, w)


def test_activation_parameters_computed_from_sizes():
    """A leaky_relu slope or an elu alpha computed from the problem's sizes is known per call, as a
    runtime scalar is: traced as one; a parameter evtc takes only as a constant names the size."""
    a, b, _ = _inputs({})
    acc = a.float() @ b.float()
    for fn in (lambda acc: F.leaky_relu(acc, 1.0 / acc.shape[-1]),
               lambda acc: F.elu(acc, acc.shape[0] / 4.0)):
        got = evtc.trace(fn, {"a": a, "b": b}).evaluate({"a": a, "b": b})
        assert got.dtype == torch.float16
        torch.testing.assert_close(got, fn(acc).half(), rtol=0, atol=0)
    _refused(lambda acc: F.softplus(acc, beta=acc.shape[-1] / 4), "computed from the problem's sizes")


def test_a_long_chain_of_ops_traces_without_deep_recursion():
    """A Python loop of 1500 ops (beyond Python's recursion limit as one recursion per node) traces
    and evaluates as torch computes it."""
    def many_steps(acc, bias):
        for _ in range(1500):
            acc = acc + bias * 0.001
        return acc

    a, b, ops = _inputs({"bias": "N"})
    got = evtc.trace(many_steps, {"a": a, "b": b, **ops}).evaluate({"a": a, "b": b, **ops})
    want = many_steps(a.float() @ b.float(), ops["bias"].float())
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want.half().float(), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("fn", [
    lambda acc: torch.sign(acc),
    lambda acc: torch.sgn(acc),
    lambda acc: torch.sign(acc.bfloat16()),
    lambda acc: torch.sign(acc) * acc,
    lambda acc: torch.heaviside(acc, acc),
    lambda acc: (acc * 2.0).to(torch.sign(acc).dtype),
], ids=["sign", "sgn", "sign_bf16", "sign_times_acc", "heaviside", "dtype_read_inside"])
def test_sign_and_heaviside_keep_the_dtype_of_their_input(fn):
    """torch.sign / sgn / heaviside of a 16-bit value are 16-bit; evtc wrote them as selections of
    Python numbers, which torch's promotion reads as float32, so the output (and ``.dtype`` read
    inside the function) was float32."""
    a, b, _ = _inputs({})
    graph = evtc.trace(fn, {"a": a, "b": b})
    got = graph.evaluate({"a": a, "b": b}, cast_outputs=True)
    want = fn(a @ b)  # torch on the 16-bit accumulator: the dtype torch gives
    assert got.dtype == want.dtype
    _same(got, fn((a.float() @ b.float()).half()))


def _sixty(acc, dtype):
    return (acc * 0.0 + 60.0).to(dtype)


@pytest.mark.parametrize("fn, scalars", [
    (lambda acc: (1.1 ** _sixty(acc, torch.float16)).float(), {}),
    (lambda acc: (1.1 ** _sixty(acc, torch.bfloat16)).float(), {}),
    (lambda acc: torch.pow(1.1, _sixty(acc, torch.float16)).float(), {}),
    (lambda acc, base: (base ** _sixty(acc, torch.float16)).float(), {"base": 1.1}),
    (lambda acc: (_sixty(acc, torch.float16) ** 1.1).float(), {}),
    (lambda acc, e: torch.pow(_sixty(acc, torch.bfloat16), e).float(), {"e": 1.1}),
], ids=["literal_f16", "literal_bf16", "torch_pow", "runtime_scalar", "number_exponent",
        "runtime_exponent"])
def test_pow_of_a_16bit_value_and_a_number_rounds_the_number_to_its_dtype(fn, scalars):
    """torch's pow of a 16-bit tensor and a Python number takes the number in the tensor's dtype:
    ``1.1 ** h`` for a float16 h = 60 is 1.1 rounded to float16 (1.0996) to the 60th, 298.0, and
    ``h ** 1.1`` is 90.1875; evtc took the number in float32 (304.5 and 90.375)."""
    a, b, _ = _inputs({})
    graph = evtc.trace(fn, {"a": a, "b": b, **scalars})
    got = graph.evaluate({"a": a, "b": b, **scalars}, cast_outputs=True)
    want = fn(a.float() @ b.float(), **scalars)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_pow_of_loaded_operands_and_the_accumulator_computes_as_the_reference():
    """A loaded float16 operand and the accumulator of float16 a and b compute in float32 (docs:
    Dtypes and precision), as evtc.reference computes them: a number beside them in a power is not
    rounded to float16 (``1.1 ** C`` at C = 100 is 1.1 ** 100, where native float16 torch gives
    1.0996 ** 100, 3.6% less), so the kernel agrees with the reference."""
    a, b, _ = _inputs({})
    C = torch.full((M, N), 1000.0).half()
    fns = {"operand": lambda acc, C: (C ** 1.1).float() + acc.float() * 0,
           "operand_base": lambda acc, C: (1.1 ** (C * 0.1)).float() + acc.float() * 0,
           "accumulator": lambda acc, C: (acc.abs() ** 1.1).float()}
    for name, fn in fns.items():
        inputs = {"a": a, "b": b, "C": C}
        got = evtc.trace(fn, inputs).evaluate(inputs, cast_outputs=True)
        torch.testing.assert_close(got, evtc.reference(fn, inputs), rtol=1e-6, atol=0, msg=name)


def test_a_0dim_tensor_as_an_activation_parameter():
    """torch reads a 0-dim tensor where it takes a number (``F.leaky_relu(x, torch.tensor(0.3))``);
    evtc refused it, naming its own stand-in class. leaky_relu's slope and elu's alpha now compute
    with it as with a runtime scalar; hardtanh's bounds, which torch checks against each other, are
    refused saying it is a 0-dim tensor."""
    a, b, _ = _inputs({})
    s = torch.tensor(0.3)
    for fn in (lambda acc, s: F.leaky_relu(acc.float(), s), lambda acc, s: F.elu(acc.float(), s)):
        graph = evtc.trace(fn, {"a": a, "b": b, "s": s})
        got = graph.evaluate({"a": a, "b": b, "s": s}, cast_outputs=True)
        torch.testing.assert_close(got, fn(a.float() @ b.float(), s), rtol=1e-6, atol=1e-6)
    with pytest.raises(evtc.UnsupportedOpError, match="min_val is a 0-dim tensor") as info:
        evtc.trace(lambda acc, s: F.hardtanh(acc, min_val=s), {"a": a, "b": b, "s": s})
    assert "TracedValue" not in str(info.value) and "test_torch_semantics.py" in str(info.value)
    with pytest.raises(evtc.UnsupportedOpError, match="beta must be a Python number, got a tensor") as info:
        evtc.trace(lambda acc, C: F.softplus(acc, beta=C), {"a": a, "b": b, "C": torch.randn(M, N)})


@pytest.mark.parametrize("fn", [
    lambda acc: acc.sum(axis=-1),
    lambda acc: torch.sum(acc, axis=-1),
    lambda acc: acc.amax(axis=-2),
    lambda acc: acc.mean(axis=(-2, -1), keepdim=True),
], ids=["sum", "torch_sum", "amax", "mean"])
def test_reductions_take_numpys_axis_keyword(fn):
    """``axis`` is torch's other name for ``dim``; evtc refused it as an unknown argument."""
    a, b, _ = _inputs({})
    graph = evtc.trace(fn, {"a": a, "b": b})
    got = graph.evaluate({"a": a, "b": b}, cast_outputs=True)
    want = fn((a.float() @ b.float()).half())
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=2e-3)
    with pytest.raises(evtc.UnsupportedOpError, match="dim and axis both given"):
        evtc.trace(lambda acc: acc.sum(-1, axis=-1), {"a": a, "b": b})


@pytest.mark.parametrize("make", [lambda: torch.tensor([0.25]), lambda: torch.tensor(0.25),
                                  lambda: torch.tensor([0.25]).half()], ids=["1", "0-dim", "half"])
def test_prelu_takes_a_weight_the_function_makes(make):
    """``F.prelu(x, torch.tensor([0.25]))``: a one-element tensor made in the function is a constant,
    as elsewhere; prelu refused it as "a number" (found by a random-program probe)."""
    def fn(acc):
        w = make()
        return F.prelu(acc if w.dtype == torch.float16 else acc.float(), w)

    a, b, _ = _inputs({})
    got = evtc.trace(fn, {"a": a, "b": b}).evaluate({"a": a, "b": b}, cast_outputs=True)
    acc = a.float() @ b.float()
    want = fn(acc.half()) if make().dtype == torch.float16 else fn(acc)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-3, atol=1e-3)
    with pytest.raises(evtc.UnsupportedOpError, match="prelu's weight must be a tensor"):
        evtc.trace(lambda acc, s: F.prelu(acc, s), {"a": a, "b": b, "s": 0.3})


@pytest.mark.parametrize("fn", [
    torch.positive, F.celu, F.selu, F.hardshrink, lambda x: F.threshold(x, 0.5, 0.0),
    lambda x: torch.addcmul(x, x, x), lambda x: torch.round(x, decimals=1),
], ids=["positive", "celu", "selu", "hardshrink", "threshold", "addcmul", "round_decimals"])
def test_functions_torch_does_not_define_for_masks_refuse_them(fn):
    """torch refuses these on a bool tensor ("not implemented for 'Bool'", "+ on a bool tensor");
    evtc computed them on the mask as 0/1 (found by a random-program probe)."""
    with pytest.raises((RuntimeError, TypeError)):  # the reference: torch refuses
        fn(torch.tensor([True, False]))
    a, b, _ = _inputs({})
    with pytest.raises(evtc.DTypeError, match="boolean mask, which torch refuses") as info:
        evtc.trace(lambda acc: fn(acc > 0).float(), {"a": a, "b": b})
    assert "test_torch_semantics.py" in str(info.value)


def test_sign_of_a_16bit_value_rounds_what_follows_as_torch():
    """sign of a float16 value is a float16 value: what is computed from it rounds to float16 at
    each op, as torch's ops do (``(sign(h) * 3e-5) * 1e5`` is 2.998 in torch, not 3.0); and
    addcmul of a mask beside values promotes, as torch's does (three masks are refused)."""
    a, b, _ = _inputs({})
    fn = lambda acc: ((torch.sign(acc.half()) * 3e-5) * 1e5).float()  # noqa: E731
    got = evtc.trace(fn, {"a": a, "b": b}).evaluate({"a": a, "b": b}, cast_outputs=True)
    torch.testing.assert_close(got, fn(a.float() @ b.float()), rtol=0, atol=0)
    C = torch.randn(M, N).half()
    mixed = lambda acc, C: torch.addcmul(acc.float(), C > 0, C.float())  # noqa: E731
    got = evtc.trace(mixed, {"a": a, "b": b, "C": C}).evaluate({"a": a, "b": b, "C": C}, cast_outputs=True)
    torch.testing.assert_close(got, mixed(a.float() @ b.float(), C), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fn", [
    lambda acc, C: torch.logit(acc > C) + C,
    lambda acc, C: torch.special.logit(acc > C, eps=-1.0) * C,
    lambda acc, C: torch.logit(acc > C, eps=0.25),
    lambda acc, C: torch.nan_to_num(acc > C) * acc.float(),
    lambda acc, C: torch.nan_to_num(acc > C, nan=2.0, posinf=5.0).float() + C,
], ids=["logit", "logit_negative_eps", "logit_eps", "nan_to_num", "nan_to_num_values"])
def test_functions_torch_defines_for_masks(fn):
    """torch computes these on a bool tensor (logit in float32: +-inf without eps; nan_to_num
    returns the mask as it is); evtc refused them (a mask's subtraction; finfo of bool)."""
    a, b, _ = _inputs({})
    C = torch.randn(M, N).half()
    inputs = {"a": a, "b": b, "C": C}
    got = evtc.trace(fn, inputs).evaluate(inputs, cast_outputs=True)
    want = fn(a.float() @ b.float(), C)
    assert got.dtype == want.dtype
    _same(got, want)


def test_shape_numel_as_torch_size_gives_it():
    """``acc.shape.numel()`` (torch.Size's method): evtc's shape was a plain tuple while tracing,
    and the call raised a bare AttributeError with no file or line."""
    a, b, _ = _inputs({})
    fn = lambda acc: acc.float() / acc.shape.numel() + acc.size().numel()  # noqa: E731
    got = evtc.trace(fn, {"a": a, "b": b}).evaluate({"a": a, "b": b}, cast_outputs=True)
    _same(got, fn(a.float() @ b.float()))


def test_nan_to_num_of_a_mask_is_a_copy():
    """torch's nan_to_num returns a new tensor: an in-place op on it leaves the mask (evtc returned
    the mask itself, so ``y |= ...`` changed both)."""
    a, b, _ = _inputs({})

    def fn(acc):
        m = acc > 0
        y = torch.nan_to_num(m)
        y |= acc < -1
        return m.float(), y.float()

    got = evtc.trace(fn, {"a": a, "b": b}).evaluate({"a": a, "b": b}, cast_outputs=True)
    for g, w in zip(got, fn(a.float() @ b.float()), strict=True):
        _same(g, w)
