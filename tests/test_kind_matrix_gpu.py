"""The generated GPU matrix: every operand kind (tile, row vector, column vector, device scalar,
runtime scalar) in each of its shapes, shared or per batch, full width or on gated halves, with
a and b in float16 and bfloat16 and both majors (and float8, K-major, plain, block-scaled or
gated), tiles of both majors, several outputs of every output dtype and reductions
(tests/epilogue_cases.py builds the cases). Each case runs at an aligned odd-M shape (the kernel
path) and at widths that break TMA's 16-byte rule with a and b in other layouts (the staged
path), into NaN-poisoned outputs, against the function itself in float32.

Kernels are compiled up front by a process pool into one disk cache.
"""

from __future__ import annotations

import pytest
from epilogue_cases import case_by_name, check_case, compile_by_name, compile_case, matrix_cases
from support import precompiled_cache

pytestmark = pytest.mark.gpu

CASES = [case.name for case in matrix_cases()]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return precompiled_cache(tmp_path_factory, "evtc-matrix-cache", compile_by_name, [(c,) for c in CASES])


@pytest.mark.parametrize("name", CASES)
def test_matrix_case(cache_dir, name):
    case = case_by_name(name)
    failures = check_case(case, compile_case(case, cache_dir))
    assert not failures, case.describe() + "\n" + "\n".join(failures)
