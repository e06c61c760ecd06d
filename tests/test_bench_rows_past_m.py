"""bench/rows_past_m.py without a GPU: its default sizes are problems of one or two rows of tiles
whose last row reaches past M, and every one of them has a launch."""

from __future__ import annotations

import pytest
import torch
from bench_modules import bench_module

import evtc


@pytest.fixture(scope="module")
def bench():
    with bench_module("rows_past_m") as module:
        yield module


def test_default_sizes_reach_past_m(bench):
    assert all(32 < m <= 128 for m in bench.DEFAULT_MS)
    assert sum(m % 64 != 0 for m in bench.DEFAULT_MS) > len(bench.DEFAULT_MS) // 2
    meta = {"a": torch.empty(8, 64, dtype=torch.bfloat16, device="meta"),
            "b": torch.empty(64, 64, dtype=torch.bfloat16, device="meta").t()}
    kernel = evtc.compile(bench.identity, meta, arch="sm_90a")
    for n, k in bench.DEFAULT_WEIGHTS:
        for m in bench.DEFAULT_MS:
            config, splits = kernel.launch_for(m, n, k)
            assert splits >= 1 and config.tile_m in (64, 128), (m, n, k)
    assert bench.int_list("65,96,") == [65, 96]
