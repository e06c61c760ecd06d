"""CPU: opt-in autotuning (evtc.runtime.autotune): size buckets, the candidate launches, the store of
tuned launches per GPU model, and how compile turns it on (argument, environment)."""

from __future__ import annotations

import json

import pytest
import torch

import evtc
from evtc.plan.config import GemmConfig
from evtc.plan.selector import is_one_wave_twin, tile_family
from evtc.plan.split_k import MAX_TAIL_SPLITS, cta_tile_grid
from evtc.runtime import autotune

BASE = GemmConfig(ab_dtype="bfloat16", d_dtype="bfloat16", b_major="k")
# 16-column subtiles where the default 32 does not divide the tile (as evtc.plan.smem.fit_config).
FAMILY = tile_family(BASE, lambda knobs: BASE.replace(**knobs, **({"epi_tile_n": 16} if knobs["tile_n"] % 32
                                                                  else {})))


def test_bucket_rounds_m_up_to_a_power_of_two():
    assert autotune.bucket(1, 4096, 4096, 1) == "16x4096x4096x1"
    assert autotune.bucket(17, 4096, 4096, 1) == autotune.bucket(32, 4096, 4096, 1) == "32x4096x4096x1"
    assert autotune.bucket(5000, 10, 20, 3) == "8192x10x20x3"


def test_candidates_cover_the_family_within_one_wave():
    default = (BASE, 1)
    cands = autotune.candidates(64, 4096, 14336, 1, FAMILY, lambda c: 132, True, default)
    assert cands[0] == default and len(set(cands)) == len(cands)
    shapes = {(c.schedule, c.tile_m, c.tile_n) for c, _ in cands}
    assert shapes == {(c.schedule, c.tile_m, c.tile_n) for c in FAMILY}
    for config, splits in cands:
        assert splits == 1 or cta_tile_grid(64, 4096, 1, config, config.cluster) * splits <= 132
    assert any(s > 1 for _, s in cands)
    # Past one wave, splits only where the last round is partly filled, and only as many as its
    # idle clusters take: they split that round alone.
    for m, n, kk in [(8192, 8192, 8192), (512, 10240, 8192), (4096, 4096, 4096)]:
        for config, splits in autotune.candidates(m, n, kk, 1, FAMILY, lambda c: 132, True, default)[1:]:
            ctas = config.cluster[0] * config.cluster[1]
            tiles, clusters = cta_tile_grid(m, n, 1, config, config.cluster) // ctas, 132 // ctas
            if tiles > clusters and splits > 1:
                tail = tiles % clusters
                assert tail and tail * splits <= clusters and splits <= MAX_TAIL_SPLITS, (m, config, splits)
    tails = autotune.candidates(512, 10240, 8192, 1, FAMILY, lambda c: 132, True, default)
    base = BASE.replace(cluster=(2, 1))  # four rows of tiles: 2x1 clusters share the weight tile
    assert (base, 2) in tails and (base, 3) not in tails  # 160 tiles on 66 clusters: 28 left over


def test_fastest_prefers_the_first_of_equals():
    a, b = (BASE, 1), (BASE, 2)
    assert autotune.fastest([(a, 5.0), (b, 4.0)]) == b
    assert autotune.fastest([(a, 4.0), (b, 4.0)]) == a
    with pytest.raises(ValueError):
        autotune.fastest([])


def test_store_round_trip_and_bad_files(tmp_path):
    store = autotune.Store(tmp_path, "NVIDIA H100 80GB HBM3", "k1")
    assert store.get("16x1x1x1") is None
    launch = (BASE.replace(tile_m=64, tile_n=64), 2)
    store.put("16x1x1x1", launch, {"x": 1.0})
    again = autotune.Store(tmp_path, "NVIDIA H100 80GB HBM3", "k1")
    assert again.get("16x1x1x1") == launch
    assert "H100" in str(again.path) and " " not in again.path.parent.name
    again.path.write_text("{not json")
    assert autotune.Store(tmp_path, "NVIDIA H100 80GB HBM3", "k1").get("16x1x1x1") is None
    again.path.write_text(json.dumps({"16x1x1x1": {"config": {"tile_m": 96}, "splits": 1}}))
    assert autotune.Store(tmp_path, "NVIDIA H100 80GB HBM3", "k1").get("16x1x1x1") is None


def _identity(acc):
    return acc


EX = {"a": torch.empty(8, 64, dtype=torch.bfloat16, device="meta"),
      "b": torch.empty(64, 64, dtype=torch.bfloat16, device="meta").t()}


def test_compile_turns_it_on(tmp_path, monkeypatch):
    monkeypatch.delenv(autotune.ENV, raising=False)
    plain = evtc.compile(_identity, EX, arch="sm_90a", cache_dir=tmp_path)
    tuned = evtc.compile(_identity, EX, arch="sm_90a", cache_dir=tmp_path, autotune=True)
    assert not plain.autotunes and tuned.autotunes and tuned.key == plain.key
    assert tuned is plain.autotuned() and tuned.autotuned() is tuned
    assert tuned.op is not plain.op  # operators of their own: they choose launches differently
    monkeypatch.setenv(autotune.ENV, "1")
    assert evtc.compile(_identity, EX, arch="sm_90a", cache_dir=tmp_path).autotunes
    assert not evtc.compile(_identity, EX, arch="sm_90a", cache_dir=tmp_path, autotune=False).autotunes


def test_records_outside_the_family_are_not_used(tmp_path):
    tuned = evtc.compile(_identity, EX, arch="sm_90a", cache_dir=tmp_path, autotune=True)
    member = [c for c in tuned.family if c.epi_stages is None][-1]  # the family's last tile, not a twin
    assert autotune.tunable(tuned, (member, 1), 4096)
    assert autotune.tunable(tuned, (member.replace(cluster=(1, 1)), 2), 4096)
    assert not autotune.tunable(tuned, (member.replace(epi_tile_n=16), 1), 4096)
    fixed = evtc.compile(_identity, EX, config={"cluster": (1, 2)}, arch="sm_90a", cache_dir=tmp_path,
                         autotune=True)
    # No split-K in a kernel with a pinned cluster:
    assert autotune.tunable(fixed, (fixed.config, 1), 4096)
    assert not autotune.tunable(fixed, (fixed.config, 2), 4096)
    assert not autotune.tunable(fixed, (fixed.config.replace(cluster=(2, 1)), 1), 4096)


def test_store_rejects_split_counts_out_of_range(tmp_path):
    store = autotune.Store(tmp_path, "gpu", "k")
    for splits in (0, -1, 10_000, "2"):
        store.path.parent.mkdir(parents=True, exist_ok=True)
        store.path.write_text(json.dumps({"b": {"config": {"ab_dtype": "bfloat16"}, "splits": splits}}))
        assert autotune.Store(tmp_path, "gpu", "k").get("b") is None, splits


def test_store_rejects_records_of_other_types(tmp_path):
    """2.0 and true compare equal to 2 and 1 in Python, but a record that holds them was not written
    by evtc and would name a kernel no rule builds: it is timed again, never run."""
    good = {"ab_dtype": "bfloat16", "tile_n": 128, "cluster": [1, 2], "split_k": False}
    store = autotune.Store(tmp_path, "gpu", "k")
    store.put("b", (GemmConfig(**good), 1), {})
    assert autotune.Store(tmp_path, "gpu", "k").get("b") == (GemmConfig(**good), 1)
    for bad, splits in [({"tile_n": 128.0}, 1), ({"cluster": [1, 2.0]}, 1), ({"cluster": [True, 2]}, 1),
                        ({"split_k": 0}, 1), ({"tile_m": None}, 1), ({"raster": 1}, 1), ({}, True),
                        ({}, 2.0), ({"unknown": 1}, 1)]:
        store.path.write_text(json.dumps({"b": {"config": good | bad, "splits": splits}}))
        assert autotune.Store(tmp_path, "gpu", "k").get("b") is None, (bad, splits)


def test_cache_clear_forgets_tuned_launches(tmp_path):
    from evtc.runtime.cache import DiskCache

    store = autotune.Store(tmp_path, "gpu", "k")
    store.put("b", (BASE, 1), {"x": 1.0})
    assert store.path.exists()
    DiskCache(tmp_path).clear()
    assert not store.path.exists()


def test_candidates_load_only_the_rows_a_short_problem_has():
    """At M <= 32 the rules launch tiles that load only A's rows (GemmConfig.a_rows); every
    candidate is timed that way too, and its name says so."""
    default = (BASE.replace(a_rows=16), 1)
    cands = autotune.candidates(8, 4096, 4096, 1, FAMILY, lambda c: 132, True, default)
    assert all(c.a_rows is not None and c.a_rows >= 8 for c, _ in cands if c.a_major == "k")
    names = [autotune.describe(c) for c in cands]
    assert len(names) == len(set(names)) and all(" a" in name for name in names)
    assert all(c.a_rows is None for c, _ in autotune.candidates(4096, 4096, 4096, 1, FAMILY, lambda c: 132,
                                                                True, (BASE, 1)))


def test_pinning_splits_forgets_tuned_launches(tmp_path):
    tuned = evtc.compile(_identity, EX, arch="sm_90a", cache_dir=tmp_path, autotune=True)
    size = autotune.bucket(16, 4096, 4096, 1)
    tuned.tuner.tuned[size] = (tuned.config, 1)
    assert tuned.launch_for(16, 4096, 4096) == (tuned.config, 1)  # the tuned launch is reported
    tuned.pin_splits(2)
    assert size not in tuned.tuner.tuned and tuned.launch_for(16, 4096, 4096)[1] == 2
    tuned.pin_splits(None)


def test_one_wave_twins_are_candidates_only_as_the_rules_run_them(tmp_path):
    """A twin (evtc.plan.selector.one_wave_twins) is timed only where its tiles make one wave and
    unsplit, and its name tells it from its tile's: the timings of both are kept apart."""
    k = evtc.compile(_identity, EX, arch="sm_90a", cache_dir=tmp_path)
    twins = [c for c in k._family if is_one_wave_twin(c, k.family[0])]
    assert twins

    def launches(m, n, kk):
        return autotune.candidates(m, n, kk, 1, k.family, k.slots, True, k.launch_for(m, n, kk))

    one_wave = launches(512, 3584, 18944)
    timed_twins = [(c, s) for c, s in one_wave if is_one_wave_twin(c, k.family[0])]
    assert timed_twins and all(s == 1 for _, s in timed_twins)
    names = [autotune.describe(launch) for launch in one_wave]
    assert len(names) == len(set(names)), names
    assert not [c for c, _ in launches(4096, 4096, 4096) if is_one_wave_twin(c, k.family[0])]
