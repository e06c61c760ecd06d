"""bench/decode_launches.py without a GPU: each candidate handle launches exactly its configuration
(A's rows trimmed as a CTA of its cluster can), and the default kernel's own launch is untouched."""

from __future__ import annotations

import pytest
import torch
from bench_modules import bench_module

import evtc


@pytest.fixture(scope="module")
def bench():
    with bench_module("decode_launches") as module:
        yield module


def _identity(acc):
    return acc


def test_each_handle_launches_its_candidate(bench, tmp_path):
    meta = {"a": torch.empty(8, 64, dtype=torch.bfloat16, device="meta"),
            "b": torch.empty(64, 64, dtype=torch.bfloat16, device="meta").t()}
    kernel = evtc.compile(_identity, meta, arch="sm_90a", cache_dir=tmp_path)
    before = kernel.launch_for(1, 4608, 3584)
    default, handles = bench.pinned(kernel, 1, 4608, 3584)
    assert default == before[0]
    assert len(handles) == len(bench.CANDIDATES)
    for (tile_n, cluster, ab), handle in zip(bench.CANDIDATES, handles.values(), strict=True):
        config, splits = handle.launch_for(1, 4608, 3584)
        assert (config.tile_n, config.cluster, config.ab_stages, splits) == (tile_n, cluster, ab, 1)
        assert config.a_rows == 8 * cluster[1]  # the fewest rows a CTA of the cluster can load
    # Taller than any tile: whole tiles.
    _, taller = bench.pinned(kernel, 129, 4608, 3584)
    assert all(h.launch_for(129, 4608, 3584)[0].a_rows is None for h in taller.values())
    assert kernel.launch_for(1, 4608, 3584) == before


def test_candidates_parse_tiles_stages_and_splits(bench, tmp_path):
    parsed = bench.parse_candidates("64:1x4,64x32:1x1:10,64:1x1::2,128x48:1x1:8:3")
    assert parsed == [(64, (1, 4), None, None, 1, None, None), (32, (1, 1), 10, 64, 1, None, None),
                      (64, (1, 1), None, None, 2, None, None), (48, (1, 1), 8, 128, 3, None, None)]
    # subtile width and C's load stages: the fifth and sixth fields
    assert bench.parse_candidates("64:1x1:13::16:4") == [(64, (1, 1), 13, None, 1, 16, 4)]
    meta = {"a": torch.empty(8, 64, dtype=torch.bfloat16, device="meta"),
            "b": torch.empty(64, 64, dtype=torch.bfloat16, device="meta").t()}
    kernel = evtc.compile(_identity, meta, arch="sm_90a", cache_dir=tmp_path)
    _, handles = bench.pinned(kernel, 1, 4096, 14336, parsed[2:3])
    (label, handle), = handles.items()
    config, splits = handle.launch_for(1, 4096, 14336)
    assert (config.tile_n, config.cluster, config.a_rows, splits) == (64, (1, 1), 8, 2)
    assert label.endswith(" s2")
