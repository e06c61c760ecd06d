"""Property test: random epilogue DAGs built from the supported ops. Tracing, the pass pipeline and
IR evaluation must equal the same function run directly on tensors (both in float64)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import SHAPES, flatten, gemm_inputs, rand

import evtc

# Ops that work the same on real tensors and on traced values; domains kept safe so that values stay
# finite and comparisons exact up to float64 rounding.
UNARY = [
    ("neg", lambda x: -x),
    ("abs", torch.abs),
    ("sqrt_abs", lambda x: torch.sqrt(x.abs())),
    ("exp_clamped", lambda x: torch.exp(torch.clamp(x, -4.0, 4.0))),
    ("tanh", torch.tanh),
    ("sigmoid", torch.sigmoid),
    ("relu", F.relu),
    ("gelu", F.gelu),
    ("gelu_tanh", lambda x: F.gelu(x, approximate="tanh")),
    ("silu", F.silu),
    ("leaky", lambda x: F.leaky_relu(x, 0.1)),
    ("softplus", F.softplus),
    ("square", lambda x: x * x),
    ("pow2", lambda x: x ** 2),
    ("scale", lambda x: x * 1.5),
    ("shift", lambda x: x + 0.25),
    ("div_const", lambda x: x / 3.0),
    ("clamp", lambda x: x.clamp(-2.0, 2.0)),
    ("mul_one_add_zero", lambda x: x * 1.0 + 0.0),
    ("hardswish", F.hardswish),
    ("sin", torch.sin),
]
BINARY = [
    ("add", lambda x, y: x + y),
    ("sub", lambda x, y: x - y),
    ("mul", lambda x, y: x * y),
    ("safe_div", lambda x, y: x / (y.abs() + 1.0)),
    ("maximum", torch.maximum),
    ("minimum", torch.minimum),
    ("where_gt", lambda x, y: torch.where(x > y, x, y * 0.5)),
]
REDUCTIONS = [
    ("row_sum", lambda x: x.sum(-1)),
    ("col_max", lambda x: x.amax(-2)),
    ("all_min", lambda x: x.amin()),
    ("row_mean_keep", lambda x: x.mean(-1, keepdim=True)),
    ("abs_amax", lambda x: x.abs().amax()),
]

step = st.one_of(
    st.tuples(st.just("u"), st.integers(0, len(UNARY) - 1), st.integers(0, 1000)),
    st.tuples(st.just("b"), st.integers(0, len(BINARY) - 1), st.integers(0, 1000), st.integers(0, 1000)),
)


def build(program, outputs, reductions):
    """An epilogue that runs `program` (ops on earlier values) and returns some values."""

    def epilogue(acc, C, bias, col, s):
        values = [acc, C, bias, col, acc * s]
        for instr in program:
            if instr[0] == "u":
                _, op, i = instr
                values.append(UNARY[op][1](values[i % len(values)]))
            else:
                _, op, i, j = instr
                values.append(BINARY[op][1](values[i % len(values)], values[j % len(values)]))
        # Outputs must be full tiles: add acc to anything that might be a vector.
        result = [values[k % len(values)] + acc for k in outputs]
        result += [REDUCTIONS[r][1](values[k % len(values)] + acc) for r, k in reductions]
        return tuple(result)

    return epilogue


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    program=st.lists(step, min_size=1, max_size=12),
    outputs=st.lists(st.integers(0, 1000), min_size=1, max_size=3),
    reductions=st.lists(st.tuples(st.integers(0, len(REDUCTIONS) - 1), st.integers(0, 1000)), max_size=2),
    shape_index=st.integers(0, len(SHAPES) - 1),
    scalar=st.floats(-2.0, 2.0, allow_nan=False),
)
def test_random_dag_pipeline_equals_torch(program, outputs, reductions, shape_index, scalar):
    m, n, k, lb = SHAPES[shape_index]
    lead = () if lb is None else (lb,)
    inputs = gemm_inputs(m, n, k, lb) | {
        "C": rand(*lead, m, n, seed=1),
        "bias": rand(n, dtype=torch.bfloat16, seed=2),
        "col": rand(m, 1, seed=3),
        "s": scalar,
    }
    fn = build(program, outputs, reductions)
    graph = evtc.trace(fn, inputs, out_dtypes=torch.float32)
    got = flatten(graph.evaluate(inputs, compute_dtype=torch.float64, cast_outputs=False))
    want = flatten(evtc.reference(fn, inputs, dtype=torch.float64))
    assert len(got) == len(want)
    for (_, g), (_, w) in zip(got, want, strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9, equal_nan=True)
