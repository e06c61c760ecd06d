"""bench/one_wave_twins.py without a GPU: its shapes parse, and every plan it times is a
configuration evtc compiles (or refuses with a CompileError, which the bench reports)."""

from __future__ import annotations

import pytest
import torch
from bench_modules import bench_module

import evtc


@pytest.fixture(scope="module")
def twins():
    with bench_module("one_wave_twins") as module:
        yield module


def test_default_shapes_parse_to_suite_widths(twins):
    shapes = twins.parse_shapes(twins.SHAPES)
    assert shapes and all(len(s) == 4 and s[3] in (112, 128, 144, 160, 192, 256) for s in shapes)


@pytest.mark.parametrize("width", [112, 144, 192])
def test_every_plan_compiles_or_is_refused_cleanly(twins, tmp_path, width):
    def meta(*shape):
        return torch.empty(*shape, dtype=torch.bfloat16, device="meta")

    ex = {"a": meta(8, 64), "b": meta(64, 64).t()}
    stages = {}
    cases = (("identity", twins.identity, {}), ("residual", twins.residual, {"C": meta(8, 64)}))
    for epilogue, fn, extra in cases:
        for plan in twins.PLANS[epilogue]:
            knobs = twins.knobs(width, plan)
            try:
                kernel = evtc.compile(fn, {**ex, **extra}, config=knobs, arch="sm_90a", cache_dir=tmp_path)
            except evtc.CompileError:
                continue
            assert (kernel.config.tile_n, kernel.config.schedule) == (width, "cooperative")
            stages[epilogue, plan] = kernel.stages["ab"]
    # The twin plans give the planned tile one more A/B stage (docs/performance.md, "One tile per CTA").
    assert stages["identity", (None, 2)] == stages["identity", (None, None)] + 1
    assert max(v for (e, p), v in stages.items() if e == "residual" and p != (None, None)) == \
        stages["residual", (None, None)] + 1
