"""Operand kinds are inferred from shapes against (L, M, N) and evaluate like torch broadcasting."""

from __future__ import annotations

import pytest
import torch
from support import SHAPES, check_epilogue, gemm_inputs, rand

import evtc


def _kind_cases(m: int, n: int, lb: int | None):
    """(shape, expected kind, expected batched) for every operand kind at this problem size."""
    cases = [
        ((m, n), "tile", False),
        ((n,), "row", False),
        ((1, n), "row", False),
        ((m, 1), "col", False),
        ((), "scalar", False),
        ((1,), "scalar", False),
        ((1, 1), "scalar", False),
    ]
    if lb is not None:
        cases += [
            ((lb, m, n), "tile", True),
            ((lb, 1, n), "row", True),
            ((lb, m, 1), "col", True),
            ((1, m, n), "tile", False),
        ]
    return cases


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(str(d) for d in s if d))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_operand_kinds(shape, dtype):
    m, n, k, lb = shape
    for i, (op_shape, kind, batched) in enumerate(_kind_cases(m, n, lb)):
        inputs = gemm_inputs(m, n, k, lb) | {"x": rand(*op_shape, dtype=dtype, seed=10 + i)}

        def epilogue(acc, x):
            return acc * x + x

        graph = check_epilogue(epilogue, inputs)
        operand = graph.operands["x"]
        assert (operand.kind, operand.batched, operand.dtype) == (kind, batched, dtype), op_shape


def test_square_problem_row_and_column_are_not_confused():
    # M == N: a 1-d vector is a row vector (torch broadcasting), an (M, 1) one a column.
    inputs = gemm_inputs(24, 24, 8, None) | {"r": rand(24, seed=1), "c": rand(24, 1, seed=2)}

    def epilogue(acc, r, c):
        return acc + r * 2 - c

    graph = check_epilogue(epilogue, inputs)
    assert graph.operands["r"].kind == "row"
    assert graph.operands["c"].kind == "col"


def test_python_scalars_are_runtime_arguments_and_flags_specialise():
    def epilogue(acc, alpha, use_relu, bias=None, eps=1e-3):
        y = alpha * acc + eps
        if bias is not None:
            y = y + bias
        return torch.relu(y) if use_relu else y

    base = gemm_inputs(16, 8, 8, None)
    with_relu = evtc.trace(epilogue, base | {"alpha": 2.0, "use_relu": True})
    without = evtc.trace(epilogue, base | {"alpha": 2.0, "use_relu": False})
    assert with_relu.operands["alpha"].kind == "arg"
    assert "use_relu" not in with_relu.operands  # a bool is a compile-time constant
    assert with_relu.count("relu") == 1 and without.count("relu") == 0
    check_epilogue(epilogue, base | {"alpha": -0.5, "use_relu": True, "bias": rand(8)})


def test_meta_tensors_are_enough_to_trace():
    inputs = {
        "a": torch.empty(64, 32, dtype=torch.bfloat16, device="meta"),
        "b": torch.empty(32, 48, dtype=torch.bfloat16, device="meta"),
        "bias": torch.empty(48, dtype=torch.bfloat16, device="meta"),
    }
    graph = evtc.trace(lambda acc, bias: acc + bias, inputs)
    assert graph.operands["bias"].kind == "row"
    assert graph.ab_dtype == torch.bfloat16


@pytest.mark.parametrize("a_batched,b_batched", [(True, False), (False, True), (True, True)])
def test_batched_gemm_inputs_follow_matmul(a_batched, b_batched):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(*((3,) if a_batched else ()), 8, 16, generator=g).half()
    b = torch.randn(*((3,) if b_batched else ()), 16, 12, generator=g).half()
    graph = check_epilogue(lambda acc: acc * 2, {"a": a, "b": b})
    assert graph.batched
