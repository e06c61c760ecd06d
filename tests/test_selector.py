"""CPU: the launch selector (evtc.plan.selector): which tile, cluster and split count a problem size
gets, the family of configurations a kernel carries, 64-row tiles (config checks and their PTX),
and that the runtime finishes reductions with the partials' layout of the tile it launched."""

from __future__ import annotations

import re

import pytest
import torch

import evtc
from evtc.plan.clusters import (
    FOUR_CTA_CLUSTERS_HELD_BACK,
    TRIMMED_A_CLUSTER_COST,
    TRIMMED_A_GATED_TILES,
    cluster_costs,
    planned_clusters,
)
from evtc.plan.config import ConfigError, GemmConfig
from evtc.plan.selector import (
    BIG_WEIGHT_ELEMENTS,
    BIG_WEIGHT_K,
    BIG_WEIGHT_MIN_M,
    DECODE_MAX_TILE_N,
    FILL,
    HEAVY_EPILOGUE_TILES,
    HEAVY_PINGPONG_MAX_K,
    HEAVY_PINGPONG_MIN_WAVES,
    LONG_K,
    MANY_WAVES,
    ONE_WAVE_LOADS_MIN_K,
    TWO_ROW_MIN_K,
    TWO_ROW_MIN_M,
    TWO_ROW_ONLY,
    TWO_ROW_WIDTHS,
    WAVE_FIT_ROUND_COST,
    WIDE_PINGPONG_MAX_COST,
    WIDE_PINGPONG_MIN_K_WITH_TILES,
    WIDE_PINGPONG_WIDTHS,
    choose_launch,
    choose_tile,
    is_one_wave_twin,
    light_epilogue,
    one_wave_twins,
    tile_family,
    with_a_rows_for,
    with_cluster_for,
)
from evtc.plan.split_k import (
    H200_HBM_BYTES_PER_US,
    HBM_BYTES_PER_US,
    MAX_SPLITS,
    MIN_K_TILES_PER_SPLIT,
    MIN_SPLIT_GAIN,
    choose_splits,
    cta_tile_grid,
    modelled_splits,
    modelled_time_us,
)

BASE = GemmConfig(ab_dtype="bfloat16", d_dtype="bfloat16", b_major="k")
SLOTS = 132


def _fit_all(knobs: dict) -> GemmConfig:
    # As evtc.plan.smem.fit_config: 16-column subtiles where the default 32 does not divide the tile.
    return BASE.replace(**{**({"epi_tile_n": 16} if knobs["tile_n"] % 32 else {}), **knobs})


FAMILY = tile_family(BASE, _fit_all)


def _slots(cluster):
    return SLOTS


def _launch(m, n, k, batches=1, family=FAMILY, choose_cluster=True, slots_of=None):
    return choose_launch(m, n, k, batches, family, slots_of or _slots, choose_cluster=choose_cluster)


def _tiles(m, n, config):
    return -(-m // config.tile_m) * -(-n // config.out_tile_n)


def test_family_starts_with_the_compiled_config_and_skips_what_does_not_fit():
    assert FAMILY[0] == BASE
    shapes = {(c.schedule, c.tile_m, c.tile_n) for c in FAMILY}
    assert ("pingpong", 64, 64) in shapes and ("cooperative", 128, 256) in shapes
    only_pingpong = tile_family(BASE, lambda knobs: None if knobs["schedule"] == "cooperative"
                                else _fit_all(knobs))
    assert all(c.schedule == "pingpong" for c in only_pingpong)
    assert tile_family(BASE, lambda knobs: None) == (BASE,)


@pytest.mark.parametrize("m", [1, 16, 64])
def test_decode_gets_64_row_tiles(m):
    for n, k in [(4096, 4096), (28672, 4096), (4096, 14336), (2048, 7168), (128256, 4096)]:
        config, splits = _launch(m, n, k)
        assert config.tile_m == 64, (m, n, k, config.short_name())
        assert 1 <= splits <= MAX_SPLITS
        assert cta_tile_grid(m, n, 1, config, config.cluster) * splits <= SLOTS or splits == 1


def test_few_tiles_take_the_largest_tile_that_fills_the_gpu():
    # (M = 112-128 at K >= TWO_ROW_MIN_K: test_two_rows_of_64_row_tiles_at_m_128.)
    for m, n, k in [(16, 4096, 4096), (128, 8192, 2048), (256, 4096, 4096), (100, 1000, 1000)]:
        chosen = choose_tile(m, n, k, 1, FAMILY, SLOTS)
        pingpong = [c for c in FAMILY if c.schedule == "pingpong" and (m > 64 or c.tile_m == 64)
                    and _shape(c) not in TWO_ROW_ONLY]
        filling = [c for c in pingpong if _tiles(m, n, c) >= FILL * SLOTS]
        if filling:
            assert chosen.tile_m * chosen.tile_n == max(c.tile_m * c.tile_n for c in filling), (m, n)
            assert _tiles(m, n, chosen) >= FILL * SLOTS
        else:
            assert chosen.tile_m * chosen.tile_n == min(c.tile_m * c.tile_n for c in pingpong), (m, n)


def _shape(config):
    return (config.schedule, config.tile_m, config.tile_n)


def _is_wide(config):
    return _shape(config)[:2] == ("pingpong", 128) and config.tile_n > 128


def test_one_wave_shares_each_tile_between_both_warpgroups():
    # (256 x 6144 runs 110 tiles of 128 x 112 instead: test_widths_that_make_whole_waves.)
    for m, n, k in [(256, 8192, 8192), (512, 4096, 4096), (512, 4096, 14336), (128, 16384, 4096)]:
        assert FILL * SLOTS <= _tiles(m, n, BASE) <= SLOTS, (m, n)
        config, splits = _launch(m, n, k)
        assert _shape(config) == ("cooperative", 128, 128), (m, n, k)
        # B multicast to a 2x1 cluster, unless one row of tiles would leave half of it idle.
        assert config.cluster == ((2, 1) if m > 128 else (1, 2)) and splits == 1, (m, n, k)
    # Batches count: 2 x 256 x 4096 is one wave too, 4 x 256 x 4096 is two.
    assert _shape(_launch(256, 4096, 4096, batches=2)[0]) == ("cooperative", 128, 128)
    # Two rounds of 128 x 128 tiles cost more than one of 128 x 256, in 2x1 clusters (two rows of
    # tiles share each weight tile).
    config = _launch(256, 4096, 4096, batches=4)[0]
    assert (_shape(config), config.cluster) == (("cooperative", 128, 256), (2, 1))
    # Without the cooperative member (it did not fit the epilogue), the compiled tile.
    narrow = tuple(c for c in FAMILY if c.schedule == "pingpong")
    assert _launch(256, 8192, 8192, family=narrow)[0] == BASE.replace(cluster=(2, 1))


def test_just_over_a_wave_takes_wider_tiles_that_fit_in_one():
    for m, n, k in [(512, 6144, 4096), (1024, 3072, 4096), (256, 12288, 4096)]:
        wider = next(c for c in FAMILY if _shape(c) == ("cooperative", 128, 192))
        assert _tiles(m, n, BASE) > SLOTS and FILL * SLOTS <= _tiles(m, n, wider) <= SLOTS
        assert _shape(_launch(m, n, k)[0]) == ("cooperative", 128, 192), (m, n, k)
    # 128 x 192 tiles that overflow a wave too (1024 x 4096: 176 of them): one round of 128 x 256
    # rather than two of 128 x 128.
    assert _shape(_launch(1024, 4096, 4096)[0]) == ("cooperative", 128, 256)
    # Many waves: the compiled tile.
    assert _launch(4096, 6144, 4096)[0] == BASE


def test_few_128_row_tiles_run_cooperative_and_padding_rows_count():
    # One 128 x 64 tile per CTA: cooperative, B multicast where there are two rows of tiles.
    config, _ = _launch(256, 4096, 4096)
    assert _shape(config) == ("cooperative", 128, 64) and config.cluster == (2, 1)
    config, _ = _launch(100, 6144, 4096)
    assert _shape(config) == ("cooperative", 128, 64) and config.cluster != (2, 1)
    # 64-row tiles have no cooperative form.
    assert _launch(64, 4096, 4096)[0].schedule == "pingpong"
    # M = 192: 128-row tiles would compute 256 rows; 64 x 128 ones compute 192 and fill the GPU.
    config, _ = _launch(192, 4096, 4096)
    assert _shape(config) == ("pingpong", 64, 128), config.short_name()


def test_large_problems_keep_the_compiled_tile_or_go_wide_for_long_k_or_many_waves():
    for m, n, k in [(4096, 4096, 4096), (16384, 8192, 8192), (1024, 128256, 4096), (4096, 28672, 4096)]:
        assert _launch(m, n, k) == (BASE, 1), (m, n, k)
    # Four rows of tiles or fewer: the same tile sharing each weight tile (2x1).
    assert _launch(512, 28672, 4096) == (BASE.replace(cluster=(2, 1)), 1)
    for m, n, k in [(16384, 8192, LONG_K * 2), (4096, 128256, 4096), (2048, 128256, 4096),
                    (4096, 152064, 3584), (16384, 28672, 4096)]:
        wide, splits = _launch(m, n, k)
        assert (wide.schedule, wide.tile_m, wide.tile_n, splits) == ("cooperative", 128, 256, 1), (m, n, k)
    # The boundary: MANY_WAVES waves of 128 x 128 tiles.
    rows = -(-MANY_WAVES * SLOTS // 32)  # the fewest rows of 32 tiles that make MANY_WAVES waves
    assert _launch(rows * 128, 32 * 128, 4096)[0].tile_n == 256
    assert _launch((rows - 1) * 128, 32 * 128, 4096)[0] == BASE
    # Without the wide tile in the family (it did not fit the epilogue), the compiled one.
    narrow = tuple(c for c in FAMILY if c.schedule == "pingpong")
    assert _launch(16384, 8192, LONG_K * 2, family=narrow)[0] == BASE


def test_large_weights_with_long_k_go_wide():
    """A 16-bit B of at least BIG_WEIGHT_ELEMENTS with K >= BIG_WEIGHT_K (Llama-3 70B's gate/up
    weight) runs the cooperative 128 x 256 tile from M = BIG_WEIGHT_MIN_M up (the range measured);
    half that weight, by N or by K, does not, nor does a shorter M."""
    for m in (BIG_WEIGHT_MIN_M, 2048, 3072):
        wide, splits = _launch(m, 57344, BIG_WEIGHT_K)
        assert (wide.schedule, wide.tile_n, splits) == ("cooperative", 256, 1), m
    assert _launch(BIG_WEIGHT_MIN_M - 128, 57344, BIG_WEIGHT_K)[0].tile_n == 128
    assert 57344 * BIG_WEIGHT_K >= BIG_WEIGHT_ELEMENTS > 28672 * BIG_WEIGHT_K
    for m, n, k in [(2048, 28672, 8192), (2048, 57344, 4096), (8192, 10240, 8192), (16384, 8192, 8192)]:
        assert _launch(m, n, k)[0].tile_n == 128, (m, n, k)
    # A gated weight counts both halves: the SwiGLU output of 28672 columns reads a 57344-row B.
    gated_base = BASE.replace(gated=True)
    def fit_gated(knobs):
        try:
            return gated_base.replace(**knobs).validate()
        except ConfigError:
            return None

    gated = tile_family(gated_base, fit_gated)
    wide, _ = choose_launch(2048, 28672, 8192, 1, gated, _slots, choose_cluster=True)
    assert (wide.schedule, wide.tile_n, wide.out_tile_n) == ("cooperative", 256, 128)
    assert choose_launch(2048, 14336, 8192, 1, gated, _slots, choose_cluster=True)[0].tile_n == 128


def test_a_fixed_family_keeps_its_tile_and_cluster():
    for m, n, k in [(16, 4096, 4096), (16384, 128, 64), (16384, 8192, 28672)]:
        config, _ = _launch(m, n, k, family=(BASE,), choose_cluster=False)
        assert config == BASE


def test_cluster_follows_the_waves_of_the_chosen_tile():
    # One column of 128-wide tiles, more rows than fit at once: a 1x2 cluster would idle half.
    config, _ = _launch(16384, 128, 64)
    assert config.tile_m == 128 and config.cluster == (2, 1)


def test_split_rule():
    assert choose_splits(4096, 200, SLOTS) == 1          # a wave of tiles: never
    assert choose_splits(64 * MIN_K_TILES_PER_SPLIT - 1, 32, SLOTS) == 1   # too short to split
    assert choose_splits(14336, 64, SLOTS) == 2          # one wave of units at most
    assert choose_splits(1 << 20, 1, SLOTS) == MAX_SPLITS
    for k in (64, 4096, 14336, 100000):
        for tiles in (1, 7, 32, 66):
            s = choose_splits(k, tiles, SLOTS)
            assert 1 <= s <= MAX_SPLITS and (s == 1 or (tiles * s <= SLOTS
                                                        and -(-k // 64) // s >= MIN_K_TILES_PER_SPLIT))


def test_split_model_splits_only_where_a_unit_outlasts_hbm():
    """Measured on the H100 (docs/performance.md, "Split-K where the weight streams"), 64 x 64 tiles
    in the chosen clusters: few tiles with a long K split (32 tiles at K = 14336: 0.80x cuBLAS whole,
    0.93x in 3 splits; 24 at K = 7168, M = 16: 0.75x against 0.92x); where the tiles draw most of
    HBM already they run whole (48 tiles at K = 7168: 1.03x whole, 0.98x in 2 splits; 40 at K =
    8192: 0.98x against 0.97x)."""
    for m, n, k in [(64, 1024, 8192), (64, 512, 14336), (64, 768, 16384), (16, 2048, 14336),
                    (16, 1536, 7168), (64, 2048, 7168)]:
        config, splits = _launch(m, n, k)
        assert splits >= 2, (m, n, k, config.short_name(), splits)
    for m, n, k in [(64, 2560, 8192), (16, 3072, 7168), (64, 3072, 7168), (64, 4096, 14336)]:
        config, splits = _launch(m, n, k)
        assert splits == 1, (m, n, k, config.short_name(), splits)


def test_split_model_never_exceeds_the_bounds_and_needs_a_gain():
    config = BASE.replace(tile_m=64, tile_n=64, schedule="pingpong", cluster=(1, 1))
    for most in (1, 2, 5, MAX_SPLITS):
        for n, k in [(256, 65536), (1024, 8192), (4096, 4096)]:
            s = modelled_splits(most, 64, n, k, 1, config)
            assert 1 <= s <= most
            if s > 1:
                assert (modelled_time_us(64, n, k, 1, config, s)
                        <= (1 - MIN_SPLIT_GAIN) * modelled_time_us(64, n, k, 1, config, 1))
    # A gated B streams both halves: for the same output width, more HBM time than a plain one.
    gated = BASE.replace(tile_m=64, tile_n=128, schedule="pingpong", cluster=(1, 1), gated=True)
    plain = gated.replace(gated=False)
    assert modelled_time_us(64, 2048, 7168, 1, gated, 1) > modelled_time_us(64, 2048, 7168, 1, plain, 1)
    # The model's parts: HBM grows with N, a unit's loop shrinks with the splits, each split costs.
    assert modelled_time_us(64, 8192, 8192, 1, config, 1) > modelled_time_us(64, 1024, 8192, 1, config, 1)
    assert modelled_time_us(64, 256, 65536, 1, config, 4) < modelled_time_us(64, 256, 65536, 1, config, 1)
    assert modelled_time_us(64, 256, 64, 1, config, 2) > modelled_time_us(64, 256, 64, 1, config, 1)


def test_the_h200_memory_rate_splits_where_it_measured_faster():
    # On the H200 (HBM3e) two splits beat one by 6-7% on a 3584 x 18944 weight at M = 1-64 and tied
    # on 4096 x 14336 (docs/performance.md, "Split counts on the H200"); the H100's rate keeps one.
    for m in (1, 16, 64):
        assert choose_launch(m, 3584, 18944, 1, FAMILY, _slots, choose_cluster=True)[1] == 1
        h200 = choose_launch(m, 3584, 18944, 1, FAMILY, _slots, choose_cluster=True,
                             hbm_bytes_per_us=H200_HBM_BYTES_PER_US)
        assert h200[1] == 2, (m, h200)
        assert choose_launch(m, 4096, 14336, 1, FAMILY, _slots, choose_cluster=True,
                             hbm_bytes_per_us=H200_HBM_BYTES_PER_US)[1] == 1
        # A short K keeps one split at either rate: the split's fixed cost outweighs its gain.
        assert choose_launch(m, 3584, 3584, 1, FAMILY, _slots, choose_cluster=True,
                             hbm_bytes_per_us=H200_HBM_BYTES_PER_US)[1] == 1
    # The rate only moves the split count: the tile and cluster shape stay.
    h100 = choose_launch(1, 3584, 18944, 1, FAMILY, _slots, choose_cluster=True)[0]
    h200 = choose_launch(1, 3584, 18944, 1, FAMILY, _slots, choose_cluster=True,
                         hbm_bytes_per_us=H200_HBM_BYTES_PER_US)[0]
    assert h100.replace(split_k=False) == h200.replace(split_k=False)


def test_the_memory_rate_follows_the_gpu(monkeypatch):
    from evtc.runtime import device

    monkeypatch.setattr(device.torch.cuda, "is_available", lambda: False)
    assert device.hbm_bytes_per_us() == HBM_BYTES_PER_US  # no GPU: the H100's, as every other rule
    monkeypatch.setattr(device.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(device.torch.cuda, "current_device", lambda: 0)
    for name, rate in (("NVIDIA H200", H200_HBM_BYTES_PER_US), ("NVIDIA H100 80GB HBM3", HBM_BYTES_PER_US),
                       ("NVIDIA H800", HBM_BYTES_PER_US)):
        monkeypatch.setattr(device, "_gpu", lambda index, name=name: (name, 132))
        assert device.hbm_bytes_per_us() == rate, name


def test_pdl_is_the_users_choice_for_every_launch():
    """Programmatic dependent launch is opt-in: the selector keeps what the kernel was compiled
    with, for every size."""
    sizes = [(1, 6144, 4096), (64, 4096, 4096), (64, 4096, 14336), (512, 4096, 4096), (4096, 128256, 4096)]
    assert {_launch(*size)[0].pdl for size in sizes} == {False}
    on = tile_family(BASE.replace(pdl=True), lambda knobs: _fit_all(knobs).replace(pdl=True))
    assert {_launch(*size, family=on)[0].pdl for size in sizes} == {True}
    with pytest.raises(ConfigError, match="pdl must be"):
        BASE.replace(pdl="late")


def test_tile_m_64_config_rules():
    cfg = BASE.replace(tile_m=64, tile_n=256)
    assert cfg.tile_shape_mnk == (64, 256, 64) and cfg.epi_tile == (64, 32)
    assert "64x256" in cfg.short_name()
    with pytest.raises(ConfigError, match="tile_m=64 needs schedule='pingpong'"):
        BASE.replace(tile_m=64, schedule="cooperative", tile_n=128, cluster=(1, 1))
    with pytest.raises(ConfigError, match="tile_m must be one of"):
        BASE.replace(tile_m=96)
    with pytest.raises(ConfigError, match="accumulator registers"):
        BASE.replace(tile_n=256)  # 128 x 256 per ping-pong warpgroup


def _identity(acc):
    return acc


def _row_sums(acc, bias):
    y = acc + bias
    return y, y.float().sum(-1)


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def test_tile_m_64_ptx_has_one_m64_atom_per_k_step(tmp_path):
    """A 64-row tile issues one m64nNk16 wgmma per k16 step, half of a 128-row tile's."""
    ex = {"a": _meta(8, 64), "b": _meta(64, 64).t()}
    wide = evtc.compile(_identity, ex, config={"tile_n": 128, "cluster": (1, 1)}, arch="sm_90a",
                       cache_dir=tmp_path).ptx
    short = evtc.compile(_identity, ex, config={"tile_m": 64, "tile_n": 128, "cluster": (1, 1)},
                         arch="sm_90a", cache_dir=tmp_path).ptx
    pattern = r"wgmma\.mma_async\.sync\.aligned\.m64n128k16"
    assert len(re.findall(pattern, short)) * 2 == len(re.findall(pattern, wide)) > 0


def test_pdl_ptx_waits_before_it_touches_memory(tmp_path):
    """With pdl, every thread waits for the previous grid (griddepcontrol.wait) before the roles
    split, and the next grid is released (launch_dependents) only after that; without it, neither
    instruction is there."""
    ex = {"a": _meta(8, 64), "b": _meta(64, 64).t()}
    knobs = {"tile_m": 64, "tile_n": 64, "cluster": (1, 2)}
    on = evtc.compile(_identity, ex, config={**knobs, "pdl": True}, arch="sm_90a", cache_dir=tmp_path).ptx
    off = evtc.compile(_identity, ex, config=knobs, arch="sm_90a", cache_dir=tmp_path).ptx
    assert "griddepcontrol" not in off
    wait, release = on.find("griddepcontrol.wait;"), on.find("griddepcontrol.launch_dependents;")
    assert 0 < wait < release
    # Nothing reads or writes global memory (TMA or plain) before the wait.
    head = on[:wait]
    assert not re.search(r"cp\.async\.bulk|ld\.global|st\.global|red\.global|atom\.global", head)


def test_kernel_carries_its_family_and_reports_the_launch(tmp_path):
    ex = {"a": _meta(8, 64), "b": _meta(64, 64).t()}
    auto = evtc.compile(_identity, ex, arch="sm_90a", cache_dir=tmp_path)
    config, splits = auto.launch_for(16, 4096, 14336)
    assert config.tile_m == 64 and splits >= 1
    assert "tile per call from 128x128, 64x256" in auto.explain()
    for knobs in ({"tile_n": 128}, {"cluster": (1, 2)}, {"schedule": "pingpong"}, {"tile_m": 128}):
        fixed = evtc.compile(_identity, ex, config=knobs, arch="sm_90a", cache_dir=tmp_path)
        assert fixed.launch_for(16, 4096, 14336)[0].tile_m == 128, knobs


def test_reductions_finish_with_the_launched_tile(tmp_path):
    """Row sums leave one partial per tile column: a 64 x 64 launch has twice the columns of
    partials of a 128 x 128 one, and the host finish must read them with that layout."""
    ex = {"a": _meta(8, 64), "b": _meta(64, 64).t(), "bias": _meta(64, dtype=torch.float32)}
    k = evtc.compile(_row_sums, ex, arch="sm_90a", cache_dir=tmp_path)
    m, n, kk = 16, 4096, 4096
    config, _ = k.launch_for(m, n, kk)
    assert (config.tile_m, config.out_tile_n) == (64, 64)
    *_, finisher = k._launch_choice(m, n, kk, 1)
    assert (finisher.tile_m, finisher.out_tile_n) == (64, 64)
    assert finisher.workspace_numels(m, n, 1) != k._finisher.workspace_numels(m, n, 1)


def test_a_cooperative_compiled_config_still_serves_large_problems():
    """An epilogue whose buffers only fit the cooperative schedule compiles to cooperative 128x256:
    problems with enough tiles run it, not a ping-pong member of the family."""
    coop = BASE.replace(schedule="cooperative", tile_n=256, cluster=(1, 1))
    family = tile_family(coop, _fit_all)
    assert family[0] == coop
    assert choose_tile(8192, 8192, 8192, 1, family, SLOTS) == coop


@pytest.mark.parametrize("m, n, k", [(8192, 14336, 4096), (2048, 14336, 4096), (8192, 4096, 14336),
                                     (4096, 28672, 4096)])
def test_an_epilogue_that_moves_several_tiles_runs_the_wide_cooperative_tile(m, n, k):
    """Two tile operands and a second output (a dZ epilogue): the cooperative 128 x 256 tile
    wherever it fills the GPU; the same problem with a light epilogue keeps its ping-pong tile."""
    light = choose_tile(m, n, k, 1, FAMILY, SLOTS, epilogue_tiles=1)
    heavy = choose_tile(m, n, k, 1, FAMILY, SLOTS, epilogue_tiles=HEAVY_EPILOGUE_TILES)
    assert (heavy.schedule, heavy.tile_m, heavy.tile_n) == ("cooperative", 128, 256)
    assert light.schedule == "pingpong"


@pytest.mark.parametrize("m, n, k", [(8192, 14336, 4096), (2048, 14336, 4096), (8192, 4096, 4096),
                                     (4096, 28672, 4096)])
def test_a_heavy_epilogue_over_many_waves_runs_ping_pong_on_fast_memory(m, n, k):
    """The rows measured on the H200 (bench/heavy_epilogue.py): there the ping-pong 128 x 128 tile
    beat the cooperative 128 x 256 one for epilogues that move 3 tiles; the H100's rate keeps the
    rule it was fitted with. Through choose_launch, as a kernel's call chooses."""
    heavy = {"epilogue_tiles": HEAVY_EPILOGUE_TILES, "choose_cluster": True}
    h100, _ = choose_launch(m, n, k, 1, FAMILY, lambda cluster: SLOTS, **heavy)
    h200, _ = choose_launch(m, n, k, 1, FAMILY, lambda cluster: SLOTS, hbm_bytes_per_us=H200_HBM_BYTES_PER_US,
                            **heavy)
    assert (h100.schedule, h100.tile_m, h100.tile_n) == ("cooperative", 128, 256)
    assert (h200.schedule, h200.tile_m, h200.tile_n) == ("pingpong", 128, 128)


@pytest.mark.parametrize("m, n, k", [(512, 14336, 4096), (1024, 4096, 4096), (8192, 4096, 14336)])
def test_a_heavy_epilogue_over_few_waves_or_long_k_keeps_the_wide_tile_on_fast_memory(m, n, k):
    """Fewer than HEAVY_PINGPONG_MIN_WAVES waves of the wide tile (not measured on the H200), or K
    from HEAVY_PINGPONG_MAX_K (mixed there): the rule fitted on the H100."""
    wide = FAMILY[0].replace(schedule="cooperative", tile_n=256)
    assert _tiles(m, n, wide) < HEAVY_PINGPONG_MIN_WAVES * SLOTS or k >= HEAVY_PINGPONG_MAX_K
    h200, _ = choose_launch(m, n, k, 1, FAMILY, lambda cluster: SLOTS, hbm_bytes_per_us=H200_HBM_BYTES_PER_US,
                            epilogue_tiles=HEAVY_EPILOGUE_TILES, choose_cluster=True)
    assert (h200.schedule, h200.tile_m, h200.tile_n) == ("cooperative", 128, 256)


def test_a_heavy_epilogue_on_a_small_problem_keeps_tiles_that_fill_the_gpu():
    chosen = choose_tile(512, 4096, 4096, 1, FAMILY, SLOTS, epilogue_tiles=HEAVY_EPILOGUE_TILES)
    assert _tiles(512, 4096, chosen) >= FILL * SLOTS


def test_epilogue_tiles_count_tile_operands_and_extra_outputs(tmp_path):
    def dz(grad, saved_gate, saved_up):
        return grad * saved_gate, grad * saved_up

    ex = {"a": _meta(8, 64), "b": _meta(64, 64), "saved_gate": _meta(8, 64), "saved_up": _meta(8, 64)}
    k = evtc.compile(dz, ex, arch="sm_90a", cache_dir=tmp_path)
    assert k.plan.epilogue_tiles == 3
    config, _ = k.launch_for(8192, 14336, 4096)
    assert (config.schedule, config.tile_n) == ("cooperative", 256)


def test_tiles_wider_than_the_problem_count_as_no_larger():
    """N = 128: a 64 x 256 tile is half padding; a tile that fills the GPU without padding wins."""
    chosen = choose_tile(8000, 128, 4096, 1, FAMILY, SLOTS)
    assert chosen.out_tile_n <= 128 and _tiles(8000, 128, chosen) >= FILL * SLOTS


def test_launch_tags_tell_families_apart(tmp_path):
    ex = {"a": _meta(8, 64), "b": _meta(64, 64).t()}
    auto = evtc.compile(_identity, ex, arch="sm_90a", cache_dir=tmp_path)
    fixed = evtc.compile(_identity, ex, config={"tile_m": 128}, arch="sm_90a", cache_dir=tmp_path)
    assert auto.key == fixed.key and auto.launch_tag != fixed.launch_tag
    assert auto is not fixed and auto.op is not fixed.op


def test_short_problems_load_only_their_rows_of_a():
    """Up to 32 rows, a launch loads the fewest rows of A (8, 16, 32) that hold the problem's rows,
    whole 8-row swizzle atoms for each CTA that shares A's loads; past a tile's rows, whole tiles
    (33-127 rows: test_one_row_problems_of_33_to_127_rows_trim_a_to_a_multiple_of_16)."""
    for m, n, k in [(1, 6144, 4096), (4, 4096, 14336), (16, 28672, 4096), (32, 4096, 4096)]:
        config, _ = _launch(m, n, k)
        assert config.a_rows is not None and m <= config.a_rows < config.tile_m
        assert config.a_rows % (8 * config.cluster[1]) == 0
    for m in (64, 512, 4096):
        assert _launch(m, 4096, 4096)[0].a_rows is None
    pp64 = BASE.replace(tile_m=64, tile_n=64, cluster=(1, 2))
    assert with_a_rows_for(pp64, 1).a_rows == 16  # two CTAs share A: 8 rows each
    assert with_a_rows_for(pp64.replace(cluster=(1, 1)), 1).a_rows == 8
    assert with_a_rows_for(pp64.replace(cluster=(1, 1)), 9).a_rows == 16
    assert with_a_rows_for(pp64, 17).a_rows == 32
    assert with_a_rows_for(pp64, 33).a_rows == 48
    assert with_a_rows_for(pp64, 49).a_rows is None
    assert with_a_rows_for(pp64.replace(cluster=(1, 4)), 1).a_rows == 32  # four CTAs share A
    assert with_a_rows_for(pp64.replace(a_major="m"), 1).a_rows is None
    # A kernel compiled with fixed tile knobs keeps its configuration.
    assert _launch(1, 6144, 4096, family=(pp64,))[0].a_rows is None


def test_a_rows_config_rules():
    pp64 = BASE.replace(tile_m=64, tile_n=64, cluster=(1, 2))
    assert pp64.a_box_rows == 64 and pp64.replace(a_rows=16).a_box_rows == 16
    assert "a16" in pp64.replace(a_rows=16).short_name()
    assert pp64.replace(a_rows=16).runs_rows(16) and not pp64.replace(a_rows=16).runs_rows(17)
    assert pp64.runs_rows(10**6)
    with pytest.raises(ConfigError, match="multiple of 16"):
        pp64.replace(a_rows=8)
    with pytest.raises(ConfigError, match="a_rows must be"):
        pp64.replace(a_rows=64)
    with pytest.raises(ConfigError, match="a_rows must be"):
        pp64.replace(a_rows=12, cluster=(1, 1))
    with pytest.raises(ConfigError, match="K-major A"):
        pp64.replace(a_rows=16, a_major="m")


def test_a_rows_is_not_a_compile_knob(tmp_path):
    ex = {"a": _meta(8, 64), "b": _meta(64, 64).t()}
    with pytest.raises(evtc.CompileError, match="a_rows is not a compile knob"):
        evtc.compile(_identity, ex, config={"a_rows": 16}, arch="sm_90a", cache_dir=tmp_path)


def test_trimmed_a_loads_expect_only_their_bytes(tmp_path):
    """Each stage's barrier expects the bytes its loads bring: 8 rows of A (1 KiB, in the 1x1
    cluster a 1-row problem runs with) and the 64 x 64 B block (8 KiB) for a 1-row problem, the
    whole 64-row A block (8 KiB) for 64 rows."""
    kernel = evtc.compile(_identity, {"a": _meta(1, 4096), "b": _meta(6144, 4096).t()}, arch="sm_90a",
                          cache_dir=tmp_path)
    short, _ = kernel.launch_for(1, 6144, 4096)
    whole, _ = kernel.launch_for(64, 6144, 4096)
    assert (short.a_rows, short.tile_m, short.tile_n, short.cluster) == (8, 64, 64, (1, 1))
    assert whole.a_rows is None
    assert short.replace(a_rows=None, cluster=whole.cluster) == whole
    expects = re.compile(r"\bmov\.[bu]32\s+%r\d+, (9216|16384);")
    assert set(expects.findall(kernel._variant(short).ptx)) == {"9216"}
    assert set(expects.findall(kernel._variant(whole).ptx)) == {"16384"}
    assert "8 rows of A" in kernel.explain()  # the trimmed variant is listed among those built


@pytest.mark.parametrize("m, n, k, width", [
    (128, 4608, 3584, 80), (128, 5120, 5120, 80), (128, 6144, 4096, 96), (128, 8192, 8192, 128),
    (128, 10240, 8192, 160), (128, 4096, 4096, 64), (112, 4608, 3584, 80), (120, 6144, 3072, 96),
    (128, 8192, LONG_K - 64, 128)])
def test_two_rows_of_64_row_tiles_at_m_128(m, n, k, width):
    """M = 112-128, 16-bit, TWO_ROW_MIN_K <= K < LONG_K: ping-pong 64-row tiles of the narrowest width that
    makes one wave, each weight tile multicast to both rows of tiles (2x1), one split."""
    config, splits = _launch(m, n, k)
    assert (_shape(config), splits) == (("pingpong", 64, width), 1), config.short_name()
    # (64 x 64, in the family before the two-row rule, keeps its own cluster costs.)
    assert config.cluster == (2, 1) or width == 64, config.short_name()
    assert 2 * -(-n // width) <= SLOTS < 2 * -(-n // max([w for w in TWO_ROW_WIDTHS if w < width], default=1))
    assert config.out_tile_n % config.epi_tile_n == 0


def test_the_two_row_widths_are_64_row_16_bit_ungated_tiles_only():
    pp64 = BASE.replace(tile_m=64, cluster=(2, 1), epi_tile_n=16)
    for width in (80, 96):
        assert pp64.replace(tile_n=width).tile_n == width
        for bad in ({"tile_m": 128}, {"schedule": "cooperative", "tile_m": 128},
                    {"gated": True}, {"ab_dtype": "float8_e4m3fn", "fast_accum": True}):
            with pytest.raises(ConfigError, match=f"tile_n={width} runs as a 64-row"):
                pp64.replace(tile_n=width, **bad)


def test_one_row_problems_of_33_to_127_rows_trim_a_to_a_multiple_of_16():
    """A's loads trimmed to the rows a one-row problem has (GemmConfig.a_rows), in multiples of 16
    up to 112, whole 8-row atoms per CTA sharing A; the trimmed cluster costs stay with M <= 32."""
    coop = BASE.replace(schedule="cooperative", tile_m=128, tile_n=64, cluster=(1, 1))
    assert [with_a_rows_for(coop, m).a_rows for m in (65, 80, 81, 96, 100, 112, 113, 128)] == \
        [80, 80, 96, 96, 112, 112, None, None]
    assert with_a_rows_for(coop.replace(cluster=(1, 4)), 80).a_rows == 96  # 24 rows per CTA
    assert with_a_rows_for(coop.replace(cluster=(1, 4)), 100).a_rows is None  # 128: the whole tile
    pp64 = BASE.replace(tile_m=64, tile_n=64, cluster=(1, 2))
    assert [with_a_rows_for(pp64, m).a_rows for m in (33, 48, 49, 64)] == [48, 48, None, None]
    assert with_a_rows_for(pp64.replace(cluster=(1, 4)), 40).a_rows is None
    slots = {1: SLOTS, 2: SLOTS, 4: 32 * 4}
    for m in (33, 40, 48):
        whole = with_cluster_for(pp64, m, 4096, 1, lambda c: slots[c[0] * c[1]])
        assert with_cluster_for(pp64, m, 4096, 1, lambda c: slots[c[0] * c[1]], trims_a=True) == whole, m


def test_two_rows_keep_to_their_bounds():
    """Outside M = 112-128, TWO_ROW_MIN_K <= K < LONG_K, 16-bit ungated a and b, or where no width makes one
    wave, the two-row widths do not run."""
    for m, n, k in [(TWO_ROW_MIN_M - 1, 4608, 3584), (129, 4608, 3584), (128, 7168, TWO_ROW_MIN_K - 64),
                    (128, 8192, LONG_K), (128, 8192, 28672),
                    (128, 14336, 4096), (64, 8192, 8192), (16, 8192, 8192), (256, 4608, 3584)]:
        assert _shape(_launch(m, n, k)[0]) not in TWO_ROW_ONLY, (m, n, k)
    assert _shape(_launch(128, 7168, 2048)[0]) == ("cooperative", 128, 64)
    float8 = BASE.replace(ab_dtype="float8_e4m3fn", d_dtype="bfloat16", fast_accum=True)
    for base in (BASE.replace(gated=True), float8, BASE.replace(b_major="n"), BASE.replace(a_major="m")):
        config, _ = _launch(128, 4608, 3584, family=_family_of(base))
        assert _shape(config) not in TWO_ROW_ONLY, config.short_name()


def test_a_thin_second_round_gives_way_to_one_full_round():
    """Few tiles: a tile whose count spills a second round at most half full (Qwen2.5 qkv at
    M = 128: 144 tiles of 64 x 64 on 132 SMs) gives way to a larger tile that fits one round at
    least half full; a tile that fits one round keeps it."""
    def tiles(config, m, n):
        return -(-m // config.tile_m) * -(-n // config.out_tile_n)

    # (M = 100: below TWO_ROW_MIN_M, where M = 128 runs two rows of 64 x 80 tiles instead.)
    for m, n, k in [(100, 4608, 3584), (100, 6144, 4096), (100, 10240, 8192)]:
        config, _ = _launch(m, n, k)
        assert SLOTS // 2 <= tiles(config, m, n) <= SLOTS, (m, n, k, config.short_name())
    assert (_launch(100, 4608, 3584)[0].tile_m, _launch(100, 4608, 3584)[0].tile_n) == (128, 64)
    # 72 tiles of 64 x 64 fit one round: kept.
    kept, _ = _launch(64, 4608, 3584)
    assert (kept.tile_m, kept.tile_n) == (64, 64)


def test_decode_tiles_share_their_loads_across_the_widest_useful_cluster():
    """Decode-sized problems stream their weights; the cluster shares what each CTA loads per K
    step. One row of 64 x 64 tiles at M = 33-64: A multicast to four CTAs (1x4). At M <= 32, where
    each CTA loads only A's rows, no cluster (1x1): there is little of A to share, and a cluster
    couples its CTAs' pipelines. Two rows: 1x4 where its clusters fit one wave, else each weight
    tile multicast to both rows (2x1). Where 4-CTA clusters would not all run at once, 1x2."""
    def h100(cluster):  # the occupancy API's answers on the H100: 132 CTAs, 66 pairs, 33 fours
        size = cluster[0] * cluster[1]
        return planned_clusters(size, 132 // size) * size

    def launch(m, n, k):
        return _launch(m, n, k, slots_of=h100)[0]

    for m, cluster, rows in ((1, (1, 1), 8), (16, (1, 1), 16), (32, (1, 1), 32), (33, (1, 4), None),
                             (64, (1, 4), None)):
        for n, k in [(3584, 3584), (4096, 4096), (4608, 3584), (7168, 2048)]:
            config = launch(m, n, k)
            assert (config.tile_m, config.tile_n, config.cluster, config.a_rows) == (64, 64, cluster, rows), \
                (m, n, k)
    for m in (96, 128):
        assert launch(m, 3584, 3584).cluster == (1, 4)  # 112 tiles: 28 clusters of four
        for n, k in [(4096, 4096), (4096, 14336)]:  # 128 tiles: 32 clusters of four, 29 planned
            config = launch(m, n, k)
            assert (config.tile_m, config.tile_n, config.cluster) == (64, 64, (2, 1)), (m, n, k)
    # 64 tiles of 64 x 64 need 16 four-CTA clusters: with room for only 12 the 1x2 cluster runs.
    tight = {1: 132, 2: 132, 4: 48}
    assert _launch(64, 4096, 4096, slots_of=lambda c: tight[c[0] * c[1]])[0].cluster == (1, 2)


def test_only_trimmed_16_bit_decode_tiles_drop_their_cluster():
    """The 1x1 rule for trimmed loads (TRIMMED_A_CLUSTER_COST) was measured on 16-bit A and B with a
    K-major A: an M-major A (whose loads are never trimmed) and float8 keep the cluster costs they
    had, and so does a problem whose rows a 64-row tile loads whole."""
    pp64 = BASE.replace(tile_m=64, tile_n=64, cluster=(1, 4))
    slots = {1: 132, 2: 132, 4: 116}

    def cluster(config, m, trims_a=True):
        return with_cluster_for(config, m, 4608, 1, lambda c: slots[c[0] * c[1]], trims_a=trims_a).cluster

    assert cluster(pp64, 1) == cluster(pp64, 32) == (1, 1)
    # A kernel of one tile shape loads whole tiles of A: A's multicast still pays.
    assert cluster(pp64, 1, trims_a=False) == (1, 4)
    assert cluster(pp64, 33) == cluster(pp64.replace(a_major="m"), 1) == (1, 4)
    assert cluster(pp64.replace(ab_dtype="float8_e4m3fn"), 1) == (1, 4)
    trimmed = TRIMMED_A_CLUSTER_COST[("pingpong", 64, 64)]
    assert cluster_costs("pingpong", 64, 64, 1, trimmed_a=True) == trimmed
    assert min(trimmed, key=trimmed.get) == (1, 1)
    # Tiles without a measured trimmed table keep their own.
    assert cluster_costs("pingpong", 64, 256, 1, trimmed_a=True) == cluster_costs("pingpong", 64, 256, 1)
    # Gated kernels: only the tiles measured gated take the trimmed costs.
    whole = cluster_costs("pingpong", 64, 64, 1)
    assert cluster_costs("pingpong", 64, 64, 1, trimmed_a=True, gated=True) == whole
    trimmed_128 = TRIMMED_A_CLUSTER_COST[("pingpong", 64, 128)]
    assert ("pingpong", 64, 128) in TRIMMED_A_GATED_TILES
    assert cluster_costs("pingpong", 64, 128, 1, trimmed_a=True, gated=True) == trimmed_128
    assert min(trimmed_128, key=trimmed_128.get) == (1, 2)
    gated = BASE.replace(tile_m=64, tile_n=128, cluster=(1, 4), gated=True)
    assert with_cluster_for(gated, 1, 14336, 1, lambda c: slots[c[0] * c[1]], trims_a=True).cluster == (1, 2)


def _family_of(base: GemmConfig) -> tuple[GemmConfig, ...]:
    def fit(knobs):
        try:
            return base.replace(**{**({"epi_tile_n": 16} if knobs["tile_n"] % 64 else {}), **knobs})
        except ConfigError:
            return None
    return tile_family(base, fit)


@pytest.mark.parametrize("m", [1, 16, 32, 64])
def test_decode_streams_wide_weights_in_tiles_128_wide(m):
    """At M <= 64 a 16-bit launch takes 64 x 128 tiles where they and 64 x 256 ones both fill the
    GPU (DECODE_MAX_TILE_N, measured on the H200); 64 x 256 stays for a thin last round of 64 x 128
    tiles, and float8 keeps the largest tile that fills."""
    for n, k in [(28672, 4096), (37888, 3584), (128256, 4096), (57344, 8192)]:
        config = choose_tile(m, n, k, 1, FAMILY, SLOTS)
        assert (config.tile_m, config.tile_n) == (64, DECODE_MAX_TILE_N), (m, n, config.short_name())
    # 148 tiles of 64 x 128 (a second round of 16): 74 of 64 x 256 fill one round instead.
    assert choose_tile(m, 18944, 3584, 1, FAMILY, SLOTS).tile_n == 256
    # Gated: B's columns count (both halves), 28672 of them for a 14336-wide output.
    gated = _family_of(BASE.replace(gated=True))
    assert choose_tile(m, 14336, 4096, 1, gated, SLOTS).tile_n == DECODE_MAX_TILE_N
    fp8 = _family_of(BASE.replace(ab_dtype="float8_e4m3fn", fast_accum=True))
    assert ("pingpong", 64, 256) in {_shape(c) for c in fp8}
    assert choose_tile(m, 28672, 4096, 1, fp8, SLOTS).tile_n == 256
    # Past 64 rows the rule does not apply.
    assert choose_tile(65, 28672, 4096, 1, FAMILY, SLOTS).tile_m == 128


def test_a_kernel_of_one_tile_keeps_a_multicast_at_decode_sizes(tmp_path):
    """A kernel compiled with its tile pinned chooses its cluster per call but loads whole tiles of
    A (it does not trim them): at M = 1 it keeps sharing A's 64-row loads (1x4), where a kernel that
    chooses its tile runs 1x1 with 8 rows of A."""
    ex = {"a": _meta(8, 64), "b": _meta(64, 64).t()}
    pinned = evtc.compile(_identity, ex, arch="sm_90a", cache_dir=tmp_path,
                          config={"tile_m": 64, "tile_n": 64, "schedule": "pingpong"})
    config, _ = pinned.launch_for(1, 4608, 3584)
    assert (config.cluster, config.a_rows) == ((1, 4), None) and pinned.cluster_for(1, 4608) == (1, 4)
    chooser = evtc.compile(_identity, ex, arch="sm_90a", cache_dir=tmp_path)
    config, _ = chooser.launch_for(1, 4608, 3584)
    assert (config.tile_m, config.tile_n, config.cluster, config.a_rows) == (64, 64, (1, 1), 8)


def test_four_cta_clusters_are_planned_with_some_held_back():
    assert planned_clusters(1, 132) == 132 and planned_clusters(2, 66) == 66
    assert planned_clusters(4, 33) == 33 - FOUR_CTA_CLUSTERS_HELD_BACK
    assert planned_clusters(4, 2) == 1


def test_widths_that_make_whole_waves():
    """M = 256-2048: the cooperative 128-row tile whose rounds cost least (rounds x width), where it
    beats 128 columns; the measured best on the H100 at each of these shapes."""
    def launch(m, n, k):
        config, _ = _launch(m, n, k)
        return config.schedule, config.tile_m, config.tile_n

    assert launch(512, 4608, 3584) == ("cooperative", 128, 144)    # 128 tiles: one round
    assert launch(1024, 4608, 3584) == ("cooperative", 128, 144)   # 256 tiles: two
    assert launch(512, 3584, 3584) == ("cooperative", 128, 112)    # 128 tiles, not 112 of 128 x 128
    assert launch(512, 7168, 2048) == ("cooperative", 128, 112)
    assert launch(512, 10240, 8192) == ("cooperative", 128, 160)   # 256 tiles: two rounds, not three
    assert launch(512, 6144, 4096) == ("cooperative", 128, 192)
    # Where 128 columns make whole waves, or there are many waves, the other rules choose.
    assert launch(512, 4096, 4096) == ("cooperative", 128, 128)
    assert launch(512, 8192, 8192) == ("cooperative", 128, 256)    # one round, not two of 128
    assert launch(1536, 6144, 4096) == ("cooperative", 128, 192)   # three rounds, not five of 112
    assert launch(4096, 4608, 3584) == ("pingpong", 128, 128)
    assert launch(8192, 8192, 8192) == ("pingpong", 128, 128)


def test_cluster_shape_follows_the_rows_of_tiles():
    """The cluster that pays depends on how many rows of 128-row tiles a problem has (measured on
    the H100, evtc.plan.clusters.FEW_TILE_ROWS): few rows share the weight tile (2x1); more rows run
    the 112- and 144-wide tiles in 1x2 clusters, where 2x1 ran up to 14% slower."""
    def launch(m, n, k):
        config, _ = _launch(m, n, k)
        return config.schedule, config.tile_n, config.cluster

    assert launch(512, 3584, 3584) == ("cooperative", 112, (2, 1))
    assert launch(2048, 3584, 3584) == ("cooperative", 112, (1, 2))
    assert launch(2048, 3584, 18944) == ("cooperative", 112, (1, 2))
    assert launch(2048, 4608, 3584) == ("cooperative", 192, (2, 1))
    assert launch(1024, 4608, 3584) == ("cooperative", 144, (1, 2))
    assert launch(512, 28672, 4096) == ("pingpong", 128, (2, 1))
    assert launch(2048, 28672, 4096) == ("pingpong", 128, (1, 2))
    # One row of tiles: a 2x1 cluster would leave half its CTAs idle.
    assert launch(128, 28672, 4096)[2] != (2, 1)


def test_widths_not_a_multiple_of_64_need_a_k_major_b():
    GemmConfig(b_major="k", tile_n=144, epi_tile_n=16, schedule="cooperative").validate()
    with pytest.raises(ConfigError, match="K-major B"):
        GemmConfig(b_major="n", tile_n=144, epi_tile_n=16, schedule="cooperative").validate()


def _ab_stages(config: GemmConfig) -> int:
    return config.plan_stages(0)[0]  # an identity epilogue: no visitor buffers, D in its own


def _no_c(config: GemmConfig) -> bool:
    return False  # an identity epilogue has no C to hold D


def test_one_wave_twins_only_where_two_d_buffers_buy_an_a_b_stage():
    twins = one_wave_twins(FAMILY, _ab_stages, _no_c)
    # No staged loads in an identity epilogue: the twins keep D in 2 buffers (ONE_WAVE_PLANS[0]).
    assert all(t.schedule == "cooperative" and t.epi_stages == 2 and t.load_stages is None for t in twins)
    assert all(_ab_stages(t) > _ab_stages(t.replace(epi_stages=None)) for t in twins)
    # 16-bit A and B: 112 and 144 wide (7 and 9 subtiles of D staged whole) and 192 and 256 gain a
    # stage; 128 x 128 (6 A/B stages either way), 128 x 160 and 128 x 64 do not.
    assert sorted(t.tile_n for t in twins) == [112, 144, 192, 256]
    # Twins come after the family: a tile shape finds its own configuration first.
    assert one_wave_twins(FAMILY + twins, _ab_stages, _no_c) == ()


@pytest.mark.parametrize("m,n,k,width", [(512, 3584, 18944, 112), (512, 4608, 3584, 144),
                                         (512, 6144, 4096, 192), (512, 8192, 8192, 256)])
def test_one_tile_per_cta_takes_the_one_wave_twin(m, n, k, width):
    family = FAMILY + one_wave_twins(FAMILY, _ab_stages, _no_c)
    config, splits = _launch(m, n, k, family=family)
    assert (config.schedule, config.tile_n, splits) == ("cooperative", width, 1)
    assert cta_tile_grid(m, n, 1, config, config.cluster) <= SLOTS
    assert config.epi_stages == 2, config.short_name()
    # The family without twins (a kernel of an older cache record): the same launch, D staged whole.
    plain, _ = _launch(m, n, k)
    assert plain == config.replace(epi_stages=None)


@pytest.mark.parametrize("m,n,k", [(2048, 3584, 18944), (512, 7168, 2048), (1024, 4608, 3584),
                                   (4096, 4096, 4096), (512, 10240, 8192)])
def test_more_tiles_than_ctas_or_no_gain_keep_d_staged_whole(m, n, k):
    family = FAMILY + one_wave_twins(FAMILY, _ab_stages, _no_c)
    config, _ = _launch(m, n, k, family=family)
    assert config.epi_stages is None, config.short_name()


def test_kernel_families_carry_twins_where_d_has_buffers_of_its_own(tmp_path):
    ex = {"a": _meta(8, 64), "b": _meta(64, 64).t()}
    identity = evtc.compile(_identity, ex, arch="sm_90a", cache_dir=tmp_path)
    assert identity.launch_for(512, 3584, 18944)[0].epi_stages == 2
    assert "with fewer epilogue buffers and one more A/B stage" in identity.explain()
    assert identity.launch_for(2048, 3584, 18944)[0].epi_stages is None  # several tiles per CTA


def test_a_residual_twin_stages_c_shallower_and_d_in_its_own_buffers(tmp_path):
    """A bf16 C staged for the whole tile holds D; the one-wave twin stages C 2 or 3 deep and gives
    D buffers of its own, for one more A/B stage (ONE_WAVE_PLANS)."""
    ex = {"a": _meta(8, 64), "b": _meta(64, 64).t(), "C": _meta(8, 64)}

    def residual(acc, C):
        return acc + C

    auto = evtc.compile(residual, ex, arch="sm_90a", cache_dir=tmp_path)
    for m, n, k in ((512, 3584, 18944), (512, 4608, 8192), (512, 6144, 4096)):
        config, _ = auto.launch_for(m, n, k)
        member = next(c for c in auto._family if (c.tile_n, c.epi_stages) == (config.tile_n, None))
        assert member.load_stages == member.num_subtiles  # C staged whole, holding D
        assert config.epi_stages in (1, 2) and config.load_stages in (2, 3), config.short_name()
        # Below ONE_WAVE_LOADS_MIN_K the loads that C staged whole overlaps weigh more: no twin.
        short, _ = auto.launch_for(m, n, ONE_WAVE_LOADS_MIN_K - 512)
        assert short == member.replace(cluster=short.cluster), short.short_name()
    assert auto.launch_for(2048, 3584, 18944)[0].epi_stages is None

    def stages(config: GemmConfig) -> dict:
        knobs = {f: getattr(config, f) for f in ("schedule", "tile_n", "cluster", "epi_tile_n", "load_stages",
                                                   "epi_stages") if getattr(config, f) is not None}
        return evtc.compile(residual, ex, config=knobs, arch="sm_90a", cache_dir=tmp_path).stages

    twin, _ = auto.launch_for(512, 3584, 18944)
    whole = stages(twin.replace(load_stages=None, epi_stages=None))
    assert whole["d_in_load"] and whole["load"] == twin.num_subtiles
    shallow = stages(twin)
    assert not shallow["d_in_load"] and shallow["ab"] == whole["ab"] + 1


def test_a_twin_cuts_only_the_loads_of_a_c_that_holds_d_and_never_pinned_ones(tmp_path):
    """Only a C that holds D (what was measured) is staged shallower in a twin; a float32 C (which
    D cannot share) keeps its staging, and so does a pinned load_stages."""
    ex = {"a": _meta(8, 64), "b": _meta(64, 64).t()}

    def residual(acc, C):
        return (acc + C).to(acc.dtype)  # D in a's dtype beside a float32 C (torch would give float32)

    f32 = evtc.compile(residual, {**ex, "C": _meta(8, 64, dtype=torch.float32)}, arch="sm_90a",
                       cache_dir=tmp_path)
    for twin in (c for c in f32._family if is_one_wave_twin(c, f32.family[0])):
        member = next(c for c in f32._family if (c.schedule, c.tile_n, c.epi_stages) ==
                      (twin.schedule, twin.tile_n, None))
        assert twin.load_stages == member.load_stages, twin.short_name()
    pinned = evtc.compile(residual, {**ex, "C": _meta(8, 64)}, config={"load_stages": 3}, arch="sm_90a",
                          cache_dir=tmp_path)
    config, _ = pinned.launch_for(512, 3584, 18944)
    member = next(c for c in pinned._family if (c.schedule, c.tile_n, c.epi_stages) ==
                  (config.schedule, config.tile_n, None))
    assert config.load_stages == member.load_stages, config.short_name()


def test_explain_names_only_what_a_twin_changes(tmp_path):
    ex = {"a": _meta(8, 64), "b": _meta(64, 64).t(), "C": _meta(8, 64)}
    k = evtc.compile(lambda acc, C: acc + C, ex, arch="sm_90a", cache_dir=tmp_path)
    for m, n, kk in ((512, 3584, 18944), (256, 4096, 4096), (64, 4096, 4096)):
        k._variants[k.launch_for(m, n, kk)[0]] = None  # as if built: explain lists what was
    text = k.explain()
    assert "None" not in text and "128x112 cooperative 2x1 1 D buffers, loads 2 deep" in text, text
    assert "128x64 cooperative 2x1," in text  # not a twin: nothing about its buffers


def _fit_knobs(knobs: dict) -> GemmConfig | None:
    try:
        return BASE.replace(**{**({"epi_tile_n": 16} if knobs["tile_n"] % 32 else {}), **knobs}).validate()
    except ConfigError:
        return None


WIDE_FAMILY = tile_family(BASE, _fit_knobs, wide_pingpong=True)


def _shape(config):
    return (config.schedule, config.tile_m, config.tile_n)


def _is_wide(config):
    return _shape(config)[:2] == ("pingpong", 128) and config.tile_n > 128


def test_wide_pingpong_tiles_join_a_light_epilogues_family_with_16_column_subtiles():
    wide = [c for c in WIDE_FAMILY if _is_wide(c)]
    assert [c.tile_n for c in wide] == list(WIDE_PINGPONG_WIDTHS)
    assert all((c.tile_m, c.epi_tile_n, c.epi_stages, c.cluster) == (128, 16, 2, (2, 1)) for c in wide)
    assert not any(_is_wide(c) for c in FAMILY)  # off by default
    # Only a ping-pong 128 x 128 base gets them (a cooperative or pinned tile keeps its rules).
    coop = BASE.replace(schedule="cooperative", tile_n=256)
    assert not any(_is_wide(c) for c in tile_family(coop, _fit_knobs, wide_pingpong=True))
    # Measured on 16-bit a and b only: float8 (fast accumulation) and tf32 kernels keep 128.
    for other in (BASE.replace(ab_dtype="float8_e4m3fn", fast_accum=True), BASE.replace(ab_dtype="float32")):
        def fit(knobs, other=other):
            try:
                narrow = {"epi_tile_n": 16} if knobs["tile_n"] % 32 else {}
                return other.replace(**{**narrow, **knobs}).validate()
            except ConfigError:
                return None

        assert not any(_is_wide(c) for c in tile_family(other, fit, wide_pingpong=True)), other.ab_dtype
    assert light_epilogue(0, 1, 0) and light_epilogue(1, 1, 0)
    assert not light_epilogue(2, 1, 0) and not light_epilogue(0, 2, 0) and not light_epilogue(0, 1, 1)


@pytest.mark.parametrize("m, n, k, width", [
    (512, 28672, 4096, 176),      # 5 rounds of 176 columns against 7 of 128 (measured 0.98 against 0.90)
    (2048, 28672, 4096, 176),
    (512, 152064, 3584, 192),     # an LM head at M = 512 (1.04 against 0.97)
    (2048, 128256, 4096, 192),    # many waves: before the cooperative 128 x 256 (1.05 against 1.00)
    (512, 57344, 8192, 176),      # a large weight: before 128 x 256 too (1.03 against 0.99)
    (16384, 37888, 3584, 192),
])
def test_many_tiles_take_the_wide_pingpong_width_whose_rounds_cost_least(m, n, k, width):
    config, splits = choose_launch(m, n, k, 1, WIDE_FAMILY, _slots, choose_cluster=True)
    assert _shape(config) == ("pingpong", 128, width), (m, n, k, config.short_name())

    def cost(w):
        return -(-(-(-m // 128) * -(-n // w)) // SLOTS) * (w + WAVE_FIT_ROUND_COST)

    assert cost(width) < WIDE_PINGPONG_MAX_COST * cost(128)
    assert cost(width) == min(cost(w) for w in WIDE_PINGPONG_WIDTHS)


@pytest.mark.parametrize("m, n, k, want", [
    (4096, 4096, 4096, ("pingpong", 128, 128)),  # a tie in rounds goes to 128 (1.01 against 0.97)
    (8192, 4096, 14336, ("pingpong", 128, 128)),
    (16384, 8192, LONG_K * 2, ("cooperative", 128, 256)),  # long K keeps the wide cooperative tile
    (128, 28672, 4096, None),                          # few tiles: never a wide ping-pong tile
    (512, 4608, 3584, None),                           # up to 5 waves: the wave-fitted widths
])
def test_wide_pingpong_stays_out_where_it_was_not_faster(m, n, k, want):
    config, _ = choose_launch(m, n, k, 1, WIDE_FAMILY, _slots, choose_cluster=True)
    if want is None:
        assert not _is_wide(config), config.short_name()
    else:
        assert _shape(config) == want


def _bias_row_sum(acc, bias):
    y = acc + bias
    return y, y.sum(-1)


def _two_tiles(acc, C, R):
    return acc + C + R


def _two_outputs(acc):
    return acc * 2.0, acc + 1.0


def _gated_bias(acc, bias):
    gate, up = (acc + bias).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def test_compiled_families_carry_wide_pingpong_for_light_epilogues_only(tmp_path):
    ex = {"a": _meta(8, 64), "b": _meta(256, 64).t()}
    tile = _meta(8, 256)
    row = torch.empty(256, dtype=torch.float32, device="meta")

    def widths(fn, **ops):
        k = evtc.compile(fn, {**ex, **ops}, arch="sm_90a", cache_dir=tmp_path)
        return sorted(c.tile_n for c in k.family if c.schedule == "pingpong" and c.tile_m == 128)

    assert widths(_identity) == [64, 128, 176, 192]
    assert widths(_two_tiles, C=tile, R=tile) == [64, 128]   # two tiles besides D
    assert widths(_two_outputs) == [64, 128]                  # a second output
    assert widths(_bias_row_sum, bias=row) == [64, 128]      # a reduction
    assert widths(_gated_bias, bias=row) == [64, 128, 192]   # 176's halves take no 16-column subtile


def test_wide_pingpong_ptx_has_the_wide_wgmma_atom(tmp_path):
    """A ping-pong 128 x 176 tile issues m64n176k16 wgmmas, two per k16 step (one per 64 rows)."""
    ex = {"a": _meta(8, 64), "b": _meta(64, 64).t()}
    ptx = evtc.compile(_identity, ex, config={"tile_n": 176, "epi_tile_n": 16, "epi_stages": 2,
                                              "cluster": (2, 1)}, arch="sm_90a", cache_dir=tmp_path).ptx
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n176k16", ptx)


def test_an_epilogue_that_moves_a_tile_takes_wide_pingpong_only_from_a_long_enough_k():
    """The DeepSeek-V3 expert down projection (N = 7168, K = 2048): wide for the identity, 128 x 128
    for a residual (its C moved per tile), which ran 2-4% slower wide at that K."""
    def launch(m, n, k, tiles):
        return choose_launch(m, n, k, 1, WIDE_FAMILY, _slots, choose_cluster=True, epilogue_tiles=tiles)[0]

    assert _is_wide(launch(2048, 7168, 2048, 0))
    assert _shape(launch(2048, 7168, 2048, 1)) == ("pingpong", 128, 128)
    assert _is_wide(launch(2048, 7168, WIDE_PINGPONG_MIN_K_WITH_TILES, 1))
