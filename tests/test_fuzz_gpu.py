"""Random epilogue programs on the GPU (a fixed slice of the fuzzer, tests/fuzz.py, so the GPU suite
always fuzzes), and CPU checks of the generator itself: its programs trace, the traced graph equals
the function run by torch in float64, and its cases cover every operand kind, shape form, gated and
batched problems, output dtypes and reductions."""

from __future__ import annotations

import pytest
import torch
from epilogue_cases import (
    OUT_DTYPES,
    REDUCTIONS,
    case_by_name,
    check_case,
    compile_by_name,
    compile_case,
    example_inputs,
    matrix_cases,
    random_case,
)
from support import flatten, precompiled_cache

import evtc

SEED = 1234
GPU_CASES = [f"fuzz-{SEED}-{i}" for i in range(32)]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    # Refusals are expected: the test skips those cases.
    return precompiled_cache(tmp_path_factory, "evtc-fuzz-cache", compile_by_name, [(c,) for c in GPU_CASES],
                             allow_errors=True)


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_CASES)
def test_random_program_on_the_gpu(cache_dir, name):
    case = case_by_name(name)
    try:
        kernel = compile_case(case, cache_dir)
    except evtc.EpilogueError as err:
        pytest.skip(f"refused at compile time (a documented limit): {err}")
    failures = check_case(case, kernel, seed=case.seed)
    assert not failures, case.describe() + "\n" + "\n".join(failures)


def test_generated_programs_mean_what_torch_computes():
    """The IR of each generated program, evaluated in float64, equals the function in float64."""
    for index in range(200):
        case = random_case(0, index)
        fn, inputs = case.function(), example_inputs(case)
        graph = evtc.trace(fn, inputs, out_dtypes=torch.float32)
        got = flatten(graph.evaluate(inputs, compute_dtype=torch.float64, cast_outputs=False))
        want = flatten(evtc.reference(fn, inputs, dtype=torch.float64))
        assert len(got) == len(want), case.describe()
        for (_, g), (_, w) in zip(got, want, strict=True):
            assert g.shape == w.shape, case.describe()
            torch.testing.assert_close(g.double(), w.double(), rtol=1e-9, atol=1e-9,
                                       msg=lambda m, c=case: c.describe() + m)


def test_generated_cases_cover_every_axis():
    cases = [random_case(0, i) for i in range(400)]
    operands = [op for case in cases for op in case.operands]
    seen = {(op.kind, op.batched) for op in operands}
    assert {("tile", False), ("tile", True), ("row", False), ("row", True), ("col", False), ("col", True),
            ("scalar", False), ("scalar", True), ("arg", False)} <= seen
    assert {op.form for op in operands if op.kind == "row"} == {"n", "1n"}
    assert {op.form for op in operands if op.kind == "scalar"} == {"0", "1"}
    assert {op.dtype for op in operands if op.kind == "tile"} == {"float16", "bfloat16", "float32"}
    assert any(op.major == "m" for op in operands) and any(op.half for op in operands)
    assert {c.gated for c in cases} == {True, False} and {c.batches for c in cases} == {None, 2, 3, 4}
    assert {c.ab_dtype for c in cases} == {"float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2"}
    # float8 a and b are compiled K-major (tests/test_fp8.py: other examples are refused), and so are
    # float32 ones (tf32: other examples keep the torch path, tests/test_tf32.py).
    assert all((c.a_major, c.b_major) == ("k", "k") for c in cases if c.ab_dtype.startswith("float8")
               or c.ab_dtype == "float32")
    assert any(c.gated for c in cases if c.ab_dtype == "float32")
    # Block scales (docs/fp8.md) on float8 cases, gated ones too, at both granularities.
    assert {c.block_scales for c in cases} == {0, 1, 128}
    assert all(c.ab_dtype.startswith("float8") for c in cases if c.block_scales)
    assert any(c.gated for c in cases if c.block_scales)
    assert {(c.a_major, c.b_major) for c in cases} == {("k", "n"), ("k", "k"), ("m", "n"), ("m", "k")}
    assert {dt for c in cases for _, dt in c.out_dtypes} == set(OUT_DTYPES)
    for text in REDUCTIONS.values():
        assert any(text.split("{x}")[1] in c.source for c in cases), text
    odd = [c for c in cases if any(n % 8 or k % 8 for _, n, k in c.shapes)]
    assert len(odd) > 40  # the staged path is fuzzed too
    assert sum(c.call_majors is not None for c in cases) > 20


def test_matrix_covers_every_kind_form_and_batching():
    cases = matrix_cases()
    variants = {(op.kind, op.form, op.batched, op.half, c.gated) for c in cases for op in c.operands}
    for kind, form in (("tile", ""), ("row", "n"), ("row", "1n"), ("col", ""), ("scalar", "0"),
                       ("scalar", "1"), ("arg", "")):
        for gated in (False, True):
            assert any(v[0] == kind and v[1] == form and v[4] == gated for v in variants), (kind, form, gated)
            if kind != "arg":
                assert any(v[0] == kind and v[1] == form and v[2] and v[4] == gated for v in variants)
    assert {c.ab_dtype for c in cases} == {"float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float32"}
    float32 = [c for c in cases if c.ab_dtype == "float32"]  # the tf32 kernel
    assert {op.kind for c in float32 for op in c.operands} == {"tile", "row", "col", "scalar", "arg"}
    assert any(c.gated for c in float32) and any(c.batches for c in float32)
    assert all((c.a_major, c.b_major) == ("k", "k") for c in float32)
    float8 = [c for c in cases if c.ab_dtype.startswith("float8")]
    assert {op.kind for c in float8 for op in c.operands} == {"tile", "row", "col", "scalar", "arg"}
    assert {c.block_scales for c in float8} == {0, 1, 128} and any(c.gated for c in float8)
    assert {c.block_scales for c in float8 if c.gated} == {0, 1, 128}
    assert all((c.a_major, c.b_major) == ("k", "k") for c in float8)
    assert {c.a_major for c in cases} == {"k", "m"} and {c.b_major for c in cases} == {"n", "k"}
    assert {dt for c in cases for _, dt in c.out_dtypes} == set(OUT_DTYPES)
    assert any(op.kind == "tile" and op.major == "m" for c in cases for op in c.operands)
    # Each case also runs at widths that break the 16-byte rule, with a and b in other layouts.
    assert all(any(n % 16 for _, n, _ in c.shapes) for c in cases)
    assert all(c.call_majors is not None for c in cases)


def test_matrix_programs_mean_what_torch_computes():
    for case in matrix_cases():
        fn, inputs = case.function(), example_inputs(case)
        graph = evtc.trace(fn, inputs, out_dtypes=torch.float32)
        got = flatten(graph.evaluate(inputs, compute_dtype=torch.float64, cast_outputs=False))
        want = flatten(evtc.reference(fn, inputs, dtype=torch.float64))
        for (_, g), (_, w) in zip(got, want, strict=True):
            torch.testing.assert_close(g.double(), w.double(), rtol=1e-9, atol=1e-9,
                                       msg=lambda m, c=case: c.describe() + m)
