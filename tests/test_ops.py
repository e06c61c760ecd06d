"""Every supported op, traced, optimized and evaluated, equals the function run on real tensors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support import SHAPES, check_epilogue, gemm_inputs, rand

import evtc

# Each entry: name -> epilogue of (acc, C) where C is a full tile. Inputs are scaled where an op
# needs a domain (log, sqrt) so that results are finite and comparisons meaningful.
OPS = {
    "add": lambda acc, C: acc + C,
    "add_scalar_left": lambda acc, C: 2.5 + acc,
    "sub": lambda acc, C: acc - C,
    "rsub_scalar": lambda acc, C: 1.0 - acc,
    "mul": lambda acc, C: acc * C,
    "mul_scalar_left": lambda acc, C: 3 * acc,
    "div": lambda acc, C: acc / (C.abs() + 1),
    "rdiv_scalar": lambda acc, C: 1.0 / (acc.abs() + 1),
    "div_scalar": lambda acc, C: acc / 3.0,
    "torch_add_alpha": lambda acc, C: torch.add(acc, C, alpha=0.5),
    "torch_sub_mul_div": lambda acc, C: torch.div(torch.mul(torch.sub(acc, C), 2), 7),
    "neg": lambda acc, C: -acc,
    "abs": lambda acc, C: acc.abs(),
    "pow2": lambda acc, C: acc ** 2,
    "pow3": lambda acc, C: torch.pow(acc, 3),
    "pow_half": lambda acc, C: acc.abs() ** 0.5,
    "pow_neg_half": lambda acc, C: (acc.abs() + 1) ** -0.5,
    "pow_neg_one": lambda acc, C: (acc.abs() + 1) ** -1,
    "pow_1_5": lambda acc, C: acc.abs().pow(1.5),
    "rpow": lambda acc, C: 2 ** (acc * 0.1),
    "rpow_3": lambda acc, C: 3.0 ** (acc * 0.1),
    "square": lambda acc, C: torch.square(acc),
    "sqrt": lambda acc, C: torch.sqrt(acc.abs()),
    "rsqrt": lambda acc, C: torch.rsqrt(acc.abs() + 0.5),
    "reciprocal": lambda acc, C: (acc.abs() + 1).reciprocal(),
    "exp": lambda acc, C: torch.exp(acc * 0.1),
    "exp2": lambda acc, C: torch.exp2(acc * 0.1),
    "expm1": lambda acc, C: torch.expm1(acc * 0.1),
    "log": lambda acc, C: torch.log(acc.abs() + 1e-3),
    "log2": lambda acc, C: torch.log2(acc.abs() + 1e-3),
    "log1p": lambda acc, C: torch.log1p(acc.abs()),
    "sin": lambda acc, C: torch.sin(acc),
    "cos": lambda acc, C: acc.cos(),
    "tanh": lambda acc, C: torch.tanh(acc),
    "F_tanh": lambda acc, C: F.tanh(acc),
    "erf": lambda acc, C: torch.erf(acc * 0.3),
    "sigmoid": lambda acc, C: torch.sigmoid(acc),
    "F_sigmoid": lambda acc, C: F.sigmoid(acc),
    "relu": lambda acc, C: torch.relu(acc),
    "F_relu": lambda acc, C: F.relu(acc),
    "relu_method": lambda acc, C: acc.relu(),
    "leaky_relu": lambda acc, C: F.leaky_relu(acc, 0.2),
    "leaky_relu_default": lambda acc, C: F.leaky_relu(acc),
    "elu": lambda acc, C: F.elu(acc, alpha=0.7),
    "gelu": lambda acc, C: F.gelu(acc),
    "gelu_tanh": lambda acc, C: F.gelu(acc, approximate="tanh"),
    "silu": lambda acc, C: F.silu(acc),
    "softplus": lambda acc, C: F.softplus(acc),
    "softplus_beta": lambda acc, C: F.softplus(acc, beta=2.0, threshold=5.0),
    "mish": lambda acc, C: F.mish(acc),
    "hardswish": lambda acc, C: F.hardswish(acc),
    "hardsigmoid": lambda acc, C: F.hardsigmoid(acc),
    "relu6": lambda acc, C: F.relu6(acc),
    "hardtanh": lambda acc, C: F.hardtanh(acc, -2.0, 2.0),
    "clamp": lambda acc, C: torch.clamp(acc, -1.0, 2.0),
    "clamp_min": lambda acc, C: acc.clamp(min=0.5),
    "clamp_max_method": lambda acc, C: acc.clamp_max(0.5),
    "clip_tensor_bounds": lambda acc, C: torch.clip(acc, min=-C.abs(), max=C.abs()),
    "minimum": lambda acc, C: torch.minimum(acc, C),
    "maximum": lambda acc, C: torch.maximum(acc, C),
    "torch_max_binary": lambda acc, C: torch.max(acc, C),
    "torch_min_binary": lambda acc, C: torch.min(acc, C),
    "gt_where": lambda acc, C: torch.where(acc > C, acc, C),
    "ge_where": lambda acc, C: torch.where(acc >= 0, acc, 0.1 * acc),
    "lt_where": lambda acc, C: torch.where(acc < 0.5, 1.0, acc),
    "le_where": lambda acc, C: torch.where(acc <= C, C, 0.0),
    "eq_ne": lambda acc, C: torch.where((acc == acc) & (acc != C), acc, C),
    "mask_arith": lambda acc, C: (acc > 0).float() * acc + (acc > 1) * 2.0,
    "logical_ops": lambda acc, C: torch.where(~(acc > 0) | (C > 0), acc, C),
    "where_method": lambda acc, C: acc.where(acc > 0, C),
    "to_float16": lambda acc, C: acc.to(torch.float16),
    "to_bfloat16_then_compute": lambda acc, C: acc.to(torch.bfloat16) * 2 + C,
    "narrow_chain": lambda acc, C: acc.bfloat16() * 3.0 + 1.0,
    "half_method": lambda acc, C: acc.half(),
    "to_float32": lambda acc, C: (acc * C).to(dtype=torch.float32),
    "to_e4m3": lambda acc, C: (acc * 0.5).to(torch.float8_e4m3fn),
    "to_e5m2": lambda acc, C: (acc * 0.5).to(torch.float8_e5m2),
    "composite": lambda acc, C: torch.relu(1.5 * acc + 0.5 * C) - torch.sigmoid(C) / 2,
}


@pytest.mark.parametrize("name", list(OPS))
def test_op_matches_torch(name):
    fn = OPS[name]
    m, n, k, lb = SHAPES[1]
    inputs = gemm_inputs(m, n, k, lb) | {"C": rand(m, n, dtype=torch.float16, seed=2)}

    def epilogue(acc, C):
        return fn(acc, C)

    check_epilogue(epilogue, inputs)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(str(d) for d in s if d))
def test_every_op_in_one_graph_across_shapes(shape):
    """All ops at once, at every shape: square, odd, batched."""
    m, n, k, lb = shape
    lead = () if lb is None else (lb,)
    inputs = gemm_inputs(m, n, k, lb, dtype=torch.bfloat16) | {
        "C": rand(*lead, m, n, dtype=torch.bfloat16, seed=3)
    }

    def everything(acc, C):
        return tuple(fn(acc, C) for fn in OPS.values())

    graph = check_epilogue(everything, inputs)
    assert len(graph.stores) == len(OPS)


SCALAR_OPS = {
    "mul_arg": lambda acc, s: s * acc,
    "arg_arith": lambda acc, s: acc * (s * 2 + 1) / s,
    "arg_power": lambda acc, s: acc ** 2 * s,
    "rsub_arg": lambda acc, s: s - acc,
    "where_arg": lambda acc, s: torch.where(acc > s, acc, s),
    "clamp_arg": lambda acc, s: torch.clamp(acc, max=s),
}


@pytest.mark.parametrize("name", list(SCALAR_OPS))
@pytest.mark.parametrize("value", [0.75, -2.0, 3])
def test_runtime_scalar_ops(name, value):
    fn = SCALAR_OPS[name]
    inputs = gemm_inputs(16, 24, 8, None) | {"s": value}

    def epilogue(acc, s):
        return fn(acc, s)

    graph = check_epilogue(epilogue, inputs)
    # A new value is a runtime argument: the same graph evaluates it, nothing is baked in.
    other = dict(inputs, s=1.25)
    torch.testing.assert_close(graph.evaluate(other).float(),
                               evtc.reference(epilogue, other).half().float(), rtol=2e-3, atol=2e-3)


def test_helper_functions_loops_and_closures_are_traced():
    scale = 0.25

    def act(x):
        return F.silu(x) * scale

    def epilogue(acc, bias):
        y = acc
        for i in range(3):
            y = act(y + bias) + i
        return y

    inputs = gemm_inputs(20, 12, 8, None) | {"bias": rand(12, seed=4)}
    graph = check_epilogue(epilogue, inputs)
    assert graph.count("silu") == 3


def test_inplace_on_intermediates_follows_torch_aliasing():
    def epilogue(acc, C):
        y = acc * 2
        alias = y
        y += C
        y.relu_()
        y.mul_(0.5)
        return alias

    inputs = gemm_inputs(16, 16, 8, None) | {"C": rand(16, 16, seed=5)}
    check_epilogue(epilogue, inputs)


def test_shape_arithmetic_stays_symbolic():
    def epilogue(acc):
        return acc.sum(-1) / acc.shape[-1], acc.sum() / acc.numel()

    for m, n in ((16, 24), (40, 8)):
        check_epilogue(epilogue, gemm_inputs(m, n, 8, None))
    graph = evtc.trace(epilogue, gemm_inputs(16, 24, 8, None))
    assert "(1/N)" in str(graph)


def test_powers_of_sizes_stay_symbolic():
    """``acc.shape[-1] ** -0.5`` (an attention-style scale) and other powers of sizes are literals
    of the size, as sums and quotients are; they raised a raw TypeError from the tracer before."""
    def epilogue(acc):
        return acc * acc.shape[-1] ** -0.5, acc.sum(-1) * (acc.shape[-2] ** 0.5), acc * 2 ** acc.shape[-2]

    for m, n in ((4, 24), (6, 8)):
        check_epilogue(epilogue, gemm_inputs(m, n, 8, None))
    kernel = evtc.compile(epilogue, gemm_inputs(4, 24, 8, None), arch="sm_90a")
    for m, n in ((4, 24), (6, 8)):  # another size than the example's: the literal follows it
        inputs = gemm_inputs(m, n, 8, None)
        got = kernel(inputs["a"], inputs["b"])
        want = epilogue(inputs["a"].double() @ inputs["b"].double())
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g.double(), w, rtol=2e-2, atol=2e-2)


def test_constant_tensors_made_in_the_epilogue_are_literals():
    def epilogue(acc):
        return acc * torch.tensor(0.5) + torch.tensor([2.0])

    graph = check_epilogue(epilogue, gemm_inputs(16, 8, 8, None))
    assert graph.count("load") == 0


@pytest.mark.filterwarnings("ignore:To copy construct")  # torch's, from the reference run
def test_tensors_made_from_traced_values():
    """torch.tensor / torch.as_tensor of an epilogue value (a runtime scalar, acc) are that value
    (torch.tensor a copy that in-place ops may change without touching acc); torch.max of a
    value and a made tensor is the elementwise maximum."""
    def epilogue(acc, alpha: float):
        scaled = acc * torch.tensor(alpha) + torch.as_tensor(acc)
        copy = torch.tensor(acc)
        copy.mul_(2.0)
        return torch.max(scaled + copy, torch.tensor(0.0)) + acc * torch.tensor(alpha, dtype=torch.bfloat16)

    graph = check_epilogue(epilogue, gemm_inputs(16, 8, 8, None) | {"alpha": 0.3})
    assert graph.count("load") == 0


def test_copies_of_traced_values_are_new_values():
    """copy.copy / copy.deepcopy of an epilogue value is a new value (a new tensor in torch): an
    in-place op on the copy leaves the original, acc included, as it was."""
    import copy

    def epilogue(acc):
        y = copy.deepcopy(acc)
        y.mul_(2.0)
        return y + acc + copy.copy(acc * 3.0)

    check_epilogue(epilogue, gemm_inputs(16, 8, 8, None))


def test_signed_zero_parameters_are_not_merged():
    """hardtanh(y, -0.0, 1) and hardtanh(y, 0.0, 1) are two ops (their zeros differ in sign):
    common-subexpression elimination compared the parameters with ==."""
    def epilogue(acc):
        y = acc * 0.0 - 0.5
        return 1.0 / F.hardtanh(y, -0.0, 1.0) + 1.0 / F.hardtanh(y, 0.0, 1.0)

    graph = check_epilogue(epilogue, gemm_inputs(16, 8, 8, None, dtype=torch.float32))
    assert graph.count("hardtanh") == 2


def test_made_tensors_and_sizes_on_either_side_of_an_operator():
    def epilogue(acc):
        return (torch.tensor(3.0) * acc + torch.tensor(1.0) - acc + (torch.tensor(2.0) > acc) * 1.0
                + acc * -acc.shape[-1] + abs(acc.shape[-2]) * torch.tensor(acc.shape[-1]))

    check_epilogue(epilogue, gemm_inputs(16, 8, 8, None, dtype=torch.float32))


def _float64_equal(fn, inputs):
    """The traced graph, evaluated in float64, equals the function run in float64 (casts included)."""
    graph = evtc.trace(fn, inputs, out_dtypes=torch.float32)
    got = graph.evaluate(inputs, compute_dtype=torch.float64, cast_outputs=False)
    want = evtc.reference(fn, inputs, dtype=torch.float64)
    torch.testing.assert_close(got.double(), want.double(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fn", [
    lambda acc: torch.add(acc, acc.to(torch.float16), alpha=0.3),
    lambda acc: torch.sub(acc * 0.5, acc.to(torch.bfloat16), alpha=0.7),
])
def test_add_with_alpha_does_not_round_alpha_times_other(fn):
    """torch computes input + alpha * other without rounding alpha * other to other's 16-bit dtype.
    (With both 16-bit, torch on the CPU rounds alpha itself to that dtype, which CUDA does not:
    not tested.)"""
    _float64_equal(fn, gemm_inputs(16, 24, 8, None))


def test_in_place_on_a_16_bit_value_keeps_its_dtype():
    def epilogue(acc):
        v = acc.half() * 2.0
        v += acc  # torch writes the float32 sum into v's float16
        w = acc.bfloat16()
        w.mul_(acc)
        return v + w

    _float64_equal(epilogue, gemm_inputs(16, 24, 8, None))
