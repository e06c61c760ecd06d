"""bench/rows_past_m.py without a GPU: its default sizes reach past M in the tiles the selector
launches for them, and its weights are the suite's layers."""

from __future__ import annotations

import pytest
import torch
from bench_modules import bench_module

import evtc


@pytest.fixture(scope="module")
def bench():
    with bench_module("rows_past_m") as module:
        yield module


def test_default_sizes_leave_rows_past_m(bench):
    meta = {"a": torch.empty(8, 64, dtype=torch.bfloat16, device="meta"),
            "b": torch.empty(64, 64, dtype=torch.bfloat16, device="meta").t()}
    kernel = evtc.compile(bench.identity, meta, arch="sm_90a")
    short = 0
    for n, k in bench.DEFAULT_WEIGHTS:
        for m in bench.DEFAULT_MS:
            config, _ = kernel.launch_for(m, n, k)
            rows = config.a_rows or config.tile_m
            short += m % rows != 0  # the last row of tiles (or the trimmed box) reaches past M
    assert short > len(bench.DEFAULT_WEIGHTS) * len(bench.DEFAULT_MS) // 2
    assert bench.int_list("65,96,") == [65, 96]
