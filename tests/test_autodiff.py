"""Backward epilogues derived from the IR (evtc.ir.autodiff) against torch.autograd on the same
function, both in float64 through the interpreter: every catalogue epilogue and random programs.
Also a derivative rule for every IR op, and clear errors where no backward graph is derived."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from compile_catalogue import CATALOGUE, make_inputs
from epilogue_cases import make_inputs as case_inputs
from epilogue_cases import random_case

import evtc
from evtc.ir.autodiff import NO_GRADIENT, RULES, BackwardError, backward
from evtc.ir.interpreter import accumulator, evaluate
from evtc.ir.ops import ELEMENTWISE
from evtc.ir.shapes import L, M, N, evaluate_shape

F64 = torch.float64


def _round_straight_through(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The interpreter's rounding cast with the gradient passed through unrounded (torch's own
    ``.to(float16)`` would round the gradient to float16 on its way back), float8 saturation kept."""
    if dtype == values.dtype:
        return values
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        limit = torch.finfo(dtype).max
        values = values.clamp(-limit, limit)
    return values + (values.to(dtype).to(values.dtype) - values).detach()


@pytest.fixture(autouse=True)
def _reference_casts(monkeypatch):
    import evtc.ir.interpreter as interpreter

    monkeypatch.setattr(interpreter, "round_to", _round_straight_through)


def _leaves(graph, result) -> dict[str, torch.Tensor]:
    tree = graph.outputs
    if tree.kind == "single":
        return {tree.names[0]: result}
    if tree.kind == "tuple":
        return dict(zip(tree.names, result, strict=True))
    return {name: result[key] for name, key in zip(tree.names, tree.keys, strict=True)}


def check_gradients(fn, inputs: dict, out_dtypes=None, seed: int = 0) -> int:
    """Trace ``fn``, derive its backward graph and compare it with autograd; returns how many
    gradients were compared (zero ones included)."""
    graph = evtc.trace(fn, inputs, out_dtypes=out_dtypes)
    back = backward(graph)
    g = torch.Generator().manual_seed(seed)
    acc = accumulator(inputs["a"], inputs["b"], F64).detach().requires_grad_()
    operands = {}
    for name, value in inputs.items():
        if name in ("a", "b"):
            continue
        if isinstance(value, torch.Tensor) and value.dtype.is_floating_point:
            operands[name] = value.to(F64).detach().requires_grad_()
        else:
            operands[name] = value
    outputs = _leaves(graph, evaluate(graph, {graph.acc_name: acc, **operands}, compute_dtype=F64,
                                      cast_outputs=False))
    differentiable = {name: out for name, out in outputs.items()
                      if name in back.output_grads and out.requires_grad}
    upstream = {name: torch.randn(out.shape, generator=g, dtype=F64) for name, out in differentiable.items()}
    wrt_names = [graph.acc_name] + [n for n, v in operands.items()
                                    if isinstance(v, torch.Tensor) and v.requires_grad]
    wrt = [acc] + [operands[n] for n in wrt_names[1:]]
    want = torch.autograd.grad(list(differentiable.values()), wrt,
                               [upstream[n] for n in differentiable], allow_unused=True)
    want = dict(zip(wrt_names, want, strict=True))

    sizes = {M: acc.shape[-2], N: acc.shape[-1] // (2 if graph.gated else 1),
             L: acc.shape[0] if acc.dim() == 3 else 1}
    feeds = {graph.acc_name: acc.detach(), **{n: (v.detach() if isinstance(v, torch.Tensor) else v)
                                              for n, v in operands.items()}}
    for name, grad_name in back.output_grads.items():
        # An output that depends on no input (a constant, a mask) gets a gradient that goes nowhere.
        incoming = upstream.get(name, torch.randn(outputs[name].shape, generator=g, dtype=F64))
        feeds[grad_name] = incoming.reshape(evaluate_shape(back.grad_shapes[grad_name], sizes))
    got = evaluate(back.graph, feeds, compute_dtype=F64, cast_outputs=False)

    compared = 0
    for name, reference in want.items():
        for key, ref in [(name, reference)]:
            if ref is None or not ref.abs().sum():  # no gradient (piecewise constant, unused)
                assert key not in got or not got[key].abs().sum(), key
                compared += 1
                continue
            assert key in got, f"no gradient for {key}"
            value = got[key]
            value = value.expand(ref.shape) if value.numel() != ref.numel() else value.reshape(ref.shape)
            scale = ref.abs().max().clamp_min(1e-12)
            err = ((value - ref).abs().max() / scale).item()
            assert err < 1e-7, f"{key}: relative error {err:.3g}"
            compared += 1
    return compared


@pytest.mark.parametrize("entry", CATALOGUE, ids=lambda e: e.name)
def test_catalogue_gradients_equal_autograd(entry):
    inputs = make_inputs(entry, 24, 40, 16, 3 if entry.batched else None, torch.float32, "cpu", seed=1)
    try:
        compared = check_gradients(entry.fn, inputs, entry.out_dtypes)
    except BackwardError as exc:
        pytest.fail(f"no backward graph: {exc}")
    assert compared >= 1


def _random_program(index: int):
    """Fuzzer case ``index`` of seed 11 with float32 inputs on the CPU: (case, inputs)."""
    case = random_case(11, index)
    m, n, k = 20, 24 * (2 if case.gated else 1), 16
    inputs = case_inputs(case, m, n, k, device="cpu", seed=index)
    return case, {name: (v.float() if isinstance(v, torch.Tensor) and v.dtype.is_floating_point else v)
                  for name, v in inputs.items()}


@pytest.mark.parametrize("index", range(60))
def test_random_program_gradients_equal_autograd(index):
    case, inputs = _random_program(index)
    try:
        check_gradients(case.function(), inputs, case.output_dtypes(), seed=index)
    except evtc.EpilogueError as exc:
        if isinstance(exc, BackwardError):
            raise
        pytest.skip(f"evtc refuses this program: {exc}")


def test_every_op_has_a_rule_or_none():
    for name in ELEMENTWISE:
        assert (name in RULES) != (name in NO_GRADIENT), name


@pytest.mark.parametrize("act", [F.relu, F.gelu, F.silu, torch.tanh, torch.sigmoid, F.mish, F.hardswish,
                                 F.hardsigmoid, F.softplus, lambda x: F.elu(x, 0.7),
                                 lambda x: F.gelu(x, approximate="tanh"), lambda x: F.leaky_relu(x, 0.2),
                                 torch.erf, torch.sin, torch.cos, torch.exp, torch.expm1, torch.exp2,
                                 lambda x: torch.log(x.abs() + 1), lambda x: torch.log2(x.abs() + 1),
                                 lambda x: torch.log1p(x.abs()), lambda x: torch.sqrt(x.abs() + 1),
                                 lambda x: torch.rsqrt(x.abs() + 1), lambda x: torch.reciprocal(x.abs() + 1),
                                 lambda x: x.abs() ** 1.5, lambda x: 2.0 ** x,
                                 lambda x: torch.maximum(x, -x * 0.5), lambda x: torch.minimum(x, x * x),
                                 lambda x: torch.where(x > 0, x * 3, -x),
                                 torch.round, torch.floor, torch.ceil, torch.trunc, torch.frac, torch.sign,
                                 lambda x: torch.round(x, decimals=1), lambda x: F.threshold(x, 0.1, 2.0),
                                 F.hardshrink, F.softshrink, F.tanhshrink,
                                 lambda x: torch.logaddexp(x, x * 0.5),
                                 lambda x: torch.logaddexp2(x * 0.5, x),
                                 lambda x: torch.xlogy(x, x.abs() + 1),
                                 lambda x: torch.fmax(x, -x * 0.5), lambda x: torch.fmin(x, x * x),
                                 torch.deg2rad, torch.sinh, torch.cosh, lambda x: torch.sinh(x * 12.0),
                                 lambda x: torch.cosh(x * 12.0), lambda x: torch.tan(x * 0.4),
                                 lambda x: torch.log10(x.abs() + 1), lambda x: torch.logit(torch.sigmoid(x)),
                                 lambda x: torch.logit(torch.sigmoid(x), eps=0.3), torch.sinc])
def test_activation_rules_with_operands(act):
    def epilogue(acc, C, bias, scale, s):
        return act(acc * scale + bias) * s + C

    g = torch.Generator().manual_seed(3)
    inputs = {"a": torch.randn(16, 8, generator=g), "b": torch.randn(8, 32, generator=g),
              "C": torch.randn(16, 32, generator=g), "bias": torch.randn(32, generator=g),
              "scale": torch.rand(16, 1, generator=g) + 0.5, "s": torch.randn(1, generator=g)}
    assert check_gradients(epilogue, inputs) == 5


def test_hyperbolic_gradients_are_torchs_in_float32():
    """sinh and cosh switch formulas at |x| = 20, and each branch sees 0 where it is not taken: the
    backward graph, run in float32 as the kernel runs it, gives torch's gradient, inf where
    cosh(x) overflows (|x| = 100) rather than inf * 0 = NaN from the branch not taken, whose e^|x|
    overflows from |x| = 88.7. (Within ln 2 of the overflow, |x| = 88.8-89.4, the product of the
    two halves' gradients overflows where torch's gradient is still finite; docs/epilogues.md.)"""
    def epilogue(acc, C, D):
        return torch.sinh(acc * 0.0 + C), torch.cosh(acc * 0.0 + D)

    C = torch.tensor([[100.0, -100.0, 88.0, -60.0, 30.0, -20.5, 19.5, 0.0, 1e-4, -3.0]]).repeat(2, 1)
    a, b = torch.randn(2, 3), torch.randn(3, C.shape[1])
    graph = evtc.trace(epilogue, {"a": a, "b": b, "C": C, "D": C})
    back = backward(graph)
    upstream = torch.rand(2, *C.shape) + 0.5
    feeds = {graph.acc_name: a @ b, "C": C, "D": C}
    for (_, grad_name), up in zip(back.output_grads.items(), upstream, strict=True):
        feeds[grad_name] = up
    got = evaluate(back.graph, feeds, compute_dtype=torch.float32, cast_outputs=False)
    x, y = C.clone().requires_grad_(), C.clone().requires_grad_()
    want = torch.autograd.grad(epilogue(torch.zeros_like(C), x, y), (x, y), list(upstream))
    for name, expected in zip("CD", want, strict=True):
        value = got[name]
        assert not value.isnan().any(), name
        assert torch.equal(value.isinf(), expected.isinf()) and torch.equal(value.sign(), expected.sign())
        finite = expected.isfinite()
        torch.testing.assert_close(value[finite], expected[finite], rtol=1e-5, atol=1e-6)


def test_sinc_gradient_at_zero_is_torchs():
    """sinc is 1 at 0, where its quotient would be 0 / 0: the quotient sees 1 there, so the gradient
    at 0 is torch's 0, not NaN, in float32 as the kernel computes it. (Near 0, at |x| ~ 1e-3, the
    quotient rule cancels in float32, torch's backward formula and ours alike, each a few percent
    off in its own way: not compared.)"""
    def epilogue(acc, C):
        return torch.sinc(acc * 0.0 + C)

    C = torch.tensor([[0.0, -0.0, 0.5, -1.5, 0.3, 2.0]]).repeat(2, 1)
    a, b = torch.randn(2, 3), torch.randn(3, C.shape[1])
    graph = evtc.trace(epilogue, {"a": a, "b": b, "C": C})
    back = backward(graph)
    upstream = torch.rand(*C.shape) + 0.5
    (grad_name,) = back.output_grads.values()
    got = evaluate(back.graph, {graph.acc_name: a @ b, "C": C, grad_name: upstream},
                   compute_dtype=torch.float32, cast_outputs=False)["C"]
    x = C.clone().requires_grad_()
    want = torch.autograd.grad(torch.sinc(x), x, upstream)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_prelu_gives_its_weight_a_gradient():
    """F.prelu's weight of N values is a row vector: its gradient sums over M, as autograd's."""
    def epilogue(acc, w, s):
        return F.prelu(acc, w) + F.prelu(acc * 0.5, s)

    g = torch.Generator().manual_seed(5)
    inputs = {"a": torch.randn(16, 8, generator=g), "b": torch.randn(8, 32, generator=g),
              "w": torch.rand(32, generator=g), "s": torch.rand(1, generator=g)}
    assert check_gradients(epilogue, inputs) == 3


def test_reductions_and_their_finish():
    def epilogue(acc, bias):
        y = torch.relu(acc + bias)
        return y, y.sum(-1), y.amax(0), torch.sqrt(y.square().mean(-1) + 1e-6), y.sum()

    g = torch.Generator().manual_seed(4)
    inputs = {"a": torch.randn(12, 8, generator=g), "b": torch.randn(8, 20, generator=g),
              "bias": torch.randn(20, generator=g)}
    assert check_gradients(epilogue, inputs) == 2


def test_batched_operands_shared_and_per_batch():
    def epilogue(acc, bias, shared_c, per_batch_scale):
        return torch.tanh(acc + bias) * per_batch_scale + shared_c

    g = torch.Generator().manual_seed(5)
    inputs = {"a": torch.randn(3, 10, 8, generator=g), "b": torch.randn(3, 8, 12, generator=g),
              "bias": torch.randn(12, generator=g), "shared_c": torch.randn(10, 12, generator=g),
              "per_batch_scale": torch.randn(3, 1, 1, generator=g)}
    assert check_gradients(epilogue, inputs) == 4


def test_swiglu_gives_both_halves_of_the_accumulator():
    def epilogue(acc, bias):
        gate, up = (acc + bias).chunk(2, dim=-1)
        return F.silu(gate) * up

    g = torch.Generator().manual_seed(6)
    inputs = {"a": torch.randn(12, 8, generator=g), "b": torch.randn(8, 32, generator=g),
              "bias": torch.randn(32, generator=g)}
    back = backward(evtc.trace(epilogue, inputs))
    assert set(back.input_grads) == {"acc", "bias"}
    assert check_gradients(epilogue, inputs) == 2


def test_a_split_gated_graph_is_refused():
    from evtc.ir.passes.gated import kernel_graph

    def epilogue(acc):
        gate, up = acc.chunk(2, dim=-1)
        return F.silu(gate) * up

    inputs = {"a": torch.randn(12, 8), "b": torch.randn(8, 32)}
    with pytest.raises(BackwardError, match="before the kernel's split"):
        backward(kernel_graph(evtc.trace(epilogue, inputs)))


def test_simplified_backward_of_the_identity_is_the_incoming_gradient():
    inputs = {"a": torch.randn(8, 4), "b": torch.randn(4, 16)}
    back = backward(evtc.trace(lambda acc: acc, inputs))
    assert [n.op for n in back.graph.nodes] == ["load", "store"]
    assert back.output_grads == {"D": "grad_D"} and back.input_grads == {"acc": "grad_acc"}
    unsimplified = backward(evtc.trace(lambda acc: acc * 1.0 + 0.0, inputs), simplify=False)
    assert len(unsimplified.graph.nodes) > 2


# ---- what the forward saves ------------------------------------------------------------------------
def check_save_plan(fn, inputs: dict, out_dtypes=None, seed: int = 0):
    """The forward with its saved output computes the same outputs; the backward from the saved
    value (the accumulator replaced by NaN, so that any use of it shows) equals the backward that
    recomputes everything. Returns the plan."""
    from evtc.ir.autodiff import plan_saves

    graph = evtc.trace(fn, inputs, out_dtypes=out_dtypes)
    back = backward(graph)
    plan = plan_saves(graph, back)
    g = torch.Generator().manual_seed(seed)
    acc = accumulator(inputs["a"], inputs["b"], F64)
    operands = {k: v for k, v in inputs.items() if k not in ("a", "b")}
    before = _leaves(graph, evaluate(graph, {graph.acc_name: acc, **operands}, compute_dtype=F64,
                                     cast_outputs=False))
    after = _leaves(plan.forward, evaluate(plan.forward, {graph.acc_name: acc, **operands},
                                           compute_dtype=F64, cast_outputs=False))
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    sizes = {M: acc.shape[-2], N: acc.shape[-1], L: acc.shape[0] if acc.dim() == 3 else 1}
    feeds = dict(operands)
    for grad_name in back.output_grads.values():
        feeds[grad_name] = torch.randn(evaluate_shape(back.grad_shapes[grad_name], sizes), generator=g,
                                       dtype=F64)
    want = evaluate(back.graph, {graph.acc_name: acc, **feeds}, compute_dtype=F64, cast_outputs=False)
    nan_acc = torch.full_like(acc, float("nan"))
    extra = {} if plan.saved is None else {plan.saved: after[plan.saved]}
    got = evaluate(plan.backward, {graph.acc_name: nan_acc, **feeds, **extra}, compute_dtype=F64,
                   cast_outputs=False)
    assert got.keys() == want.keys()
    for key in want:
        assert torch.allclose(got[key], want[key], rtol=1e-12, atol=1e-12, equal_nan=False), key
    return plan


def test_save_plans_of_the_catalogue():
    saved = 0
    for entry in CATALOGUE:
        inputs = make_inputs(entry, 24, 40, 16, 3 if entry.batched else None, torch.float32, "cpu", seed=2)
        plan = check_save_plan(entry.fn, inputs, entry.out_dtypes)
        saved += plan.saved is not None
    assert saved >= 40  # most epilogues are nonlinear in acc


@pytest.mark.parametrize("index", range(30))
def test_save_plans_of_random_programs(index):
    case, inputs = _random_program(index)
    check_save_plan(case.function(), inputs, case.output_dtypes(), seed=index)


def test_what_is_saved():
    g = torch.Generator().manual_seed(7)
    inputs = {"a": torch.randn(12, 8, generator=g), "b": torch.randn(8, 32, generator=g),
              "bias": torch.randn(32, generator=g), "C": torch.randn(12, 32, generator=g)}
    acc = accumulator(inputs["a"], inputs["b"], F64)

    def saved_value(fn, operands):
        plan = check_save_plan(fn, {"a": inputs["a"], "b": inputs["b"], **operands})
        if plan.saved is None:
            return None
        out = evaluate(plan.forward, {"acc": acc, **operands}, compute_dtype=F64, cast_outputs=False)
        return out[-1] if isinstance(out, tuple) else out[plan.saved]

    # Linear in acc: nothing to save.
    assert saved_value(lambda acc, bias, C: acc * 2 + bias + C, {"bias": inputs["bias"], "C": inputs["C"]}) \
        is None
    # gelu(acc + bias): every use goes through gelu'(acc + bias), which the forward computes while
    # the values are in registers; the backward is then dY * saved.
    pre = (acc + inputs["bias"].double()).requires_grad_()
    (slope,) = torch.autograd.grad(F.gelu(pre).sum(), [pre])
    assert torch.allclose(saved_value(lambda acc, bias: F.gelu(acc + bias), {"bias": inputs["bias"]}), slope)

    # SwiGLU with a bias: the value both halves come from.
    def swiglu_bias(acc, bias):
        gate, up = (acc + bias).chunk(2, dim=-1)
        return F.silu(gate) * up

    # SwiGLU: both halves need values of their own: the pre-activation they come from.
    assert torch.allclose(saved_value(swiglu_bias, {"bias": inputs["bias"]}), acc + inputs["bias"].double())


def _grads_through_kernel(fn, b_values, **operands):
    """Gradients of sum(fn(acc, ...)) by evtc (a compiled kernel on CPU tensors: its autograd
    formula evaluates the derived backward graph) and by torch.autograd, at acc = b exactly
    (a = I), so the values sit exactly on the kinks."""
    a = torch.eye(b_values.shape[0])
    b = b_values.clone().requires_grad_()
    ops = {k: v.clone().requires_grad_() for k, v in operands.items()}
    k = evtc.compile(fn, {"a": a, "b": b, **ops})
    got = torch.autograd.grad(k(a, b, **ops).float().sum(), [b, *ops.values()])
    b2 = b_values.clone().requires_grad_()
    ops2 = {k: v.clone().requires_grad_() for k, v in operands.items()}
    want = torch.autograd.grad(fn(a @ b2, **ops2).float().sum(), [b2, *ops2.values()])
    return got, want


@pytest.mark.parametrize("name,fn", [
    ("clamp tensor bounds", lambda acc, lo, hi: acc.clamp(lo, hi)),
    ("clamp_min tensor", lambda acc, lo, hi: torch.clamp_min(acc, lo) + hi),
    ("clip numbers", lambda acc, lo, hi: acc.clip(0.0, 1.0) + lo + hi),
    ("relu6", lambda acc, lo, hi: F.relu6(acc) + lo + hi),
    ("hardtanh", lambda acc, lo, hi: F.hardtanh(acc, -1.0, 1.0) + lo + hi),
    ("hardswish", lambda acc, lo, hi: F.hardswish(acc) + lo + hi),
    ("relu", lambda acc, lo, hi: torch.relu(acc) + lo + hi),
])
def test_gradients_at_the_kinks_follow_torch(name, fn):
    """At a bound exactly (padding rows with a zero bias reach them): clamp gives the input the
    whole gradient and its tensor bound none; hardtanh and relu6 give none at either bound;
    hardswish's pieces at -3 and 3 are torch's."""
    b = torch.tensor([[0.0, 1.0, 6.0, -1.0, 3.0, -3.0], [0.5, -0.5, 7.0, 1.0, 2.0, 0.0]])
    lo = torch.tensor([0.0, 0.0, 6.0, 0.0, 3.0, -3.0])
    # (Not lo == hi with x below both: torch then gives neither bound a gradient, evtc gives lo one.)
    hi = torch.tensor([1.0, 1.0, 6.0, 1.0, 4.0, 0.0])
    got, want = _grads_through_kernel(fn, b, lo=lo, hi=hi)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, msg=name)


def test_maximum_and_minimum_with_nan_and_ties_follow_torch():
    def fn(acc, lo, hi):
        return torch.maximum(acc, acc * 0.5) + torch.minimum(acc, lo) + hi

    b = torch.tensor([[float("nan"), 1.0, 0.0, -2.0], [3.0, float("nan"), -1.0, 0.0]])
    got, want = _grads_through_kernel(fn, b, lo=torch.tensor([0.0, 1.0, 0.0, -3.0]),
                                      hi=torch.zeros(4))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, equal_nan=True)


def test_a_saturating_float8_cast_passes_the_gradient_as_torch_does():
    def fn(acc):
        return (acc * 100.0).to(torch.float8_e4m3fn).float()

    got, want = _grads_through_kernel(fn, torch.tensor([[1.0, 3.0, 5.0, -6.0, -2.0]]))
    torch.testing.assert_close(got[0], want[0])


def test_a_reduction_times_a_one_element_operand_has_a_backward():
    """y.sum(-1) * scale with scale of shape (1,): as () works, so does (1,) (torch broadcasts it)."""
    def fn(acc, scale):
        return acc.sum(-1) * scale

    got, want = _grads_through_kernel(fn, torch.randn(4, 6), scale=torch.tensor([0.5]))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
