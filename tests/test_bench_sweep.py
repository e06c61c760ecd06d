"""bench/sweep_configs.py without a GPU: its candidate sets and the names its tables print."""

from __future__ import annotations

import pytest
from bench_modules import bench_module

from evtc.plan.config import CLUSTERS, GemmConfig
from evtc.plan.selector import FAMILY


@pytest.fixture(scope="module")
def sweep():
    with bench_module("sweep_configs") as module:  # sweep_configs imports bench/shapes.py as `shapes`
        yield module


def test_the_family_set_is_every_launch_the_selector_can_choose(sweep):
    family = sweep.CANDIDATE_SETS["family"]
    assert {(c["schedule"], c["tile_m"], c["tile_n"]) for c in family} == set(FAMILY)
    for c in family:
        GemmConfig(ab_dtype="bfloat16", d_dtype="bfloat16", b_major="k", **c).validate()
    # Each tile shape in every cluster shape that validates (ping-pong 128-row tiles in all three).
    pp128 = [c for c in family if (c["schedule"], c["tile_m"], c["tile_n"]) == ("pingpong", 128, 128)]
    assert len(pp128) == len(CLUSTERS)


def test_names_show_what_differs(sweep):
    base = {"tile_m": 64, "tile_n": 64, "cluster": (1, 2), "schedule": "pingpong"}
    assert sweep.name_of(base, 1) == "pp 64x64 1x2 S1"
    assert sweep.name_of({**base, "a_rows": 16}, 1) == "pp 64x64 1x2 a16 S1"
    assert sweep.name_of({**base, "raster": "n", "swizzle": 4}, 2) == "pp 64x64 1x2 rn4 S2"
    assert sweep.name_of({**base, "epi_stages": 2}, 1) == "pp 64x64 1x2 d2 S1"  # a one-wave twin


def test_every_candidate_of_every_set_validates(sweep):
    # The sweep compiles every candidate for a bf16 identity with an nn.Linear weight (K-major b):
    # a set naming a configuration the kernel no longer takes stops the sweep at it.
    for name, candidates in sweep.CANDIDATE_SETS.items():
        assert candidates, name
        for knobs in candidates:
            knobs = {key: value for key, value in knobs.items() if key != "launch"}
            GemmConfig(ab_dtype="bfloat16", d_dtype="bfloat16", b_major="k", **knobs).validate()


def test_launch_candidates_are_tiles_of_the_default_family(sweep):
    # A launch candidate runs the default kernel's own tile (sweep_configs.launch_twin): one the
    # family lacks would be skipped, and the sweep would silently time less than it says.
    launches = [c for cs in sweep.CANDIDATE_SETS.values() for c in cs if c.get("launch")]
    assert launches
    for c in launches:
        assert (c["schedule"], c["tile_m"], c["tile_n"]) in set(FAMILY), c


def test_the_past_m_family_reaches_past_the_tiles(sweep):
    shapes = [tuple(int(x) for x in s.split("x")) for s in sweep.FAMILIES["past_m"]]
    assert all(32 < m <= 128 for m, _, _ in shapes)
    assert sum(m % 64 != 0 for m, _, _ in shapes) > len(shapes) // 2


def test_launch_candidates_trim_a_as_the_selector_does(sweep, tmp_path):
    import torch

    import evtc

    meta = {"a": torch.empty(8, 64, dtype=torch.bfloat16, device="meta"),
            "b": torch.empty(64, 64, dtype=torch.bfloat16, device="meta").t()}
    auto = evtc.compile(lambda acc: acc, meta, arch="sm_90a", cache_dir=tmp_path)
    co = {"tile_m": 128, "tile_n": 64, "schedule": "cooperative", "launch": True}
    # 72 rows in 128-row tiles: the multiple of 16 that holds them, whole 8-row atoms per CTA.
    assert sweep.launch_config(auto, {**co, "cluster": (1, 1)}, 72).a_rows == 80
    assert sweep.launch_config(auto, {**co, "cluster": (1, 4)}, 72).a_rows == 96
    assert sweep.launch_config(auto, {**co, "cluster": (1, 2)}, 1).a_rows == 16
    # A problem as tall as the tile, or taller, loads whole tiles.
    assert sweep.launch_config(auto, {**co, "cluster": (1, 1)}, 128).a_rows is None
    pp = {"tile_m": 64, "tile_n": 64, "schedule": "pingpong", "cluster": (2, 1), "launch": True}
    assert sweep.launch_config(auto, pp, 72).a_rows is None
    # A tile the default kernel's family lacks is no launch of it.
    assert sweep.launch_config(auto, {**co, "tile_n": 48, "cluster": (1, 1)}, 72) is None


def test_launch_handles_and_their_split_counts(sweep, tmp_path):
    import torch

    import evtc

    meta = {"a": torch.empty(8, 64, dtype=torch.bfloat16, device="meta"),
            "b": torch.empty(64, 64, dtype=torch.bfloat16, device="meta").t()}
    auto = evtc.compile(lambda acc: acc, meta, arch="sm_90a", cache_dir=tmp_path)
    pp = {"tile_m": 64, "tile_n": 64, "schedule": "pingpong", "cluster": (1, 1), "launch": True}
    # 56 tiles: 2 splits fit one wave of 132, 3 do not (unless multi-wave splits are asked for).
    assert sweep.timed_splits(pp, 1, 3584, [1, 2, 3], 132) == [1, 2]
    assert sweep.timed_splits(pp, 1, 3584, [1, 2, 3], 132, multi_wave=True) == [1, 2, 3]
    handles = sweep.launch_handles(auto, "1x3584x18944", [pp, {**pp, "launch": False}], [1, 2, 3], 132)
    assert list(handles) == ["pp 64x64 1x1 a8 S1", "pp 64x64 1x1 a8 S2"]  # pins are not handles
    for label, handle in handles.items():
        config, splits = handle.launch_for(1, 3584, 18944)
        assert (config.tile_n, config.cluster, config.a_rows, splits) == (64, (1, 1), 8, int(label[-1]))
    assert auto.launch_for(1, 3584, 18944)[0].a_rows == 8  # the default kernel's own choice stays


def test_build_variants_builds_each_variant_once(tmp_path):
    import torch
    from bench_modules import bench_module

    import evtc
    from evtc.runtime.invoke import built_config

    with bench_module("shapes") as shapes:
        shapes.load_torch()
        meta = {"a": torch.empty(8, 64, dtype=torch.bfloat16, device="meta"),
                "b": torch.empty(64, 64, dtype=torch.bfloat16, device="meta").t()}
        kernel = evtc.compile(lambda acc: acc, meta, arch="sm_90a", cache_dir=tmp_path)
        # Two sizes of one launch and a third of another: two variants, each built by one process.
        sizes = [(1, 4096, 4096), (2, 4096, 4096), (1, 64, 64)]
        configs = {built_config(*kernel.launch_for(*size)) for size in sizes}
        assert len(configs) == 2
        count, processes = shapes.build_variants([(kernel, sizes)], workers=4)
        assert (count, processes) == (2, 2)
        # Built in the background into the disk cache: loading them now compiles nothing.
        for config in configs - {kernel.config}:
            assert kernel._variant(config).origin == "disk"
