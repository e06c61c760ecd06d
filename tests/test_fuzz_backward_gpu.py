"""Random epilogue programs differentiated on the GPU: a compiled kernel called with 16-bit a and b
that require grad (and, in every other case, its float operands too) takes its operator's backward,
where dZ is the epilogue of the forward's GEMM run again (evtc.dz_pass.recomputed_gradients) for
most programs, several outputs included, and the reference backward for the rest. Every gradient
against float32 torch autograd of the function on the same inputs, and no further from it than
eager 16-bit autograd is (or a floor)."""

from __future__ import annotations

import os

import pytest
import torch
from epilogue_cases import DTYPES, compile_case, make_inputs, random_case

import evtc

pytestmark = pytest.mark.gpu

# A wider run: EVTC_FUZZ_BACKWARD_SEED=... EVTC_FUZZ_BACKWARD_CASES=100 python3 -m pytest -m gpu ...
SEED = int(os.environ.get("EVTC_FUZZ_BACKWARD_SEED", "4321"))
#: How far a gradient may be from float32 autograd's by norm: twice eager 16-bit autograd's
#: distance, or this floor (bf16's own rounding of a 16-bit gradient is about 4e-3 by norm).
FLOOR = 3e-2


def _differentiable_cases(count: int) -> list[str]:
    """The first ``count`` programs of SEED with 16-bit a and b (the backward's GEMMs and the
    recomputing kernel are 16-bit ones) and no float8 output (no float8 incoming gradient)."""
    names = []
    for index in range(20 * count):
        case = random_case(SEED, index)
        if case.ab_dtype not in ("float16", "bfloat16") or case.block_scales:
            continue
        if any(dt.startswith("float8") for _, dt in case.out_dtypes):
            continue
        names.append(case.name)
        if len(names) == count:
            break
    return names


CASES = _differentiable_cases(int(os.environ.get("EVTC_FUZZ_BACKWARD_CASES", "24")))


def _leaves(value) -> list[torch.Tensor]:
    if isinstance(value, dict):
        return list(value.values())
    return list(value) if isinstance(value, tuple | list) else [value]


def _operands(inputs: dict) -> dict:
    return {key: v for key, v in inputs.items() if key not in ("a", "b")}


def _distance(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm().clamp_min(1e-6)).item()


@pytest.mark.parametrize("name", CASES)
def test_random_program_gradients_on_the_gpu(name, tmp_path):
    index = int(name.rsplit("-", 1)[1])
    case = random_case(SEED, index)
    try:
        kernel = compile_case(case, tmp_path)
    except evtc.EpilogueError as err:
        pytest.skip(f"refused at compile time (a documented limit): {err}")
    m, n, k = case.shapes[0]
    inputs = make_inputs(case, m, n, k, "cuda", seed=index)
    trained = index % 2 == 1
    names = ["a", "b"] + [op.name for op in case.operands if op.kind != "arg" and trained
                          and DTYPES[op.dtype].is_floating_point]
    for key in names:
        inputs[key] = inputs[key].detach().requires_grad_()
    fn = case.function()
    outputs = [y for y in _leaves(kernel(**inputs)) if y.dtype.is_floating_point]
    wide = {key: (v.detach().float().requires_grad_(key in names) if isinstance(v, torch.Tensor) else v)
            for key, v in inputs.items()}
    ref = [y for y in _leaves(fn(wide["a"] @ wide["b"], **_operands(wide))) if y.dtype.is_floating_point]
    eager = [y for y in _leaves(fn(inputs["a"] @ inputs["b"], **_operands(inputs)))
             if y.dtype.is_floating_point]
    assert len(outputs) == len(ref) == len(eager), case.describe()
    g = torch.Generator(device="cuda").manual_seed(index)
    dys = [torch.randn(r.shape, device="cuda", generator=g) for r in ref]
    mine = torch.autograd.grad(outputs, [inputs[key] for key in names],
                               [d.to(y.dtype) for d, y in zip(dys, outputs, strict=True)], allow_unused=True)
    want = torch.autograd.grad(ref, [wide[key] for key in names], dys, allow_unused=True)
    theirs = torch.autograd.grad(eager, [inputs[key] for key in names],
                                 [d.to(y.dtype) for d, y in zip(dys, eager, strict=True)], allow_unused=True)
    for key, got, exp, base in zip(names, mine, want, theirs, strict=True):
        if exp is None:
            assert got is None or not got.abs().any(), f"{key}: a gradient where autograd has none"
            continue
        assert got is not None and got.shape == inputs[key].shape and got.dtype == inputs[key].dtype, key
        err = _distance(got, exp)
        err_eager = _distance(base, exp) if base is not None else 0.0
        assert err <= max(2 * err_eager, FLOOR), (
            f"{key}: {err:.3g} from float32 autograd, eager 16-bit autograd {err_eager:.3g}\n"
            + case.describe())
