"""bench/sweep_configs.py without a GPU: every candidate configuration of every set is one the kernel
takes (a sweep stops at the first that does not validate). Nothing here compiles or times."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from evtc.plan.config import GemmConfig

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def sweep():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import sweep_configs
    finally:
        sys.path.pop(0)
    return sweep_configs


def test_every_candidate_validates(sweep):
    # The sweep compiles every candidate for a bf16 identity with an nn.Linear weight (K-major b).
    for name, candidates in sweep.CANDIDATE_SETS.items():
        assert candidates, name
        for knobs in candidates:
            GemmConfig(ab_dtype="bfloat16", d_dtype="bfloat16", b_major="k", **knobs).validate()
