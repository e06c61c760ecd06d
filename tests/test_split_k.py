"""CPU: split-K's plan (when to split, the workspace sizes), its knobs, and the PTX of a split-K
kernel (the partials' vector stores and loads, the release count and the acquire wait)."""

from __future__ import annotations

import re

import pytest
import torch

import evtc
from evtc.plan.config import GemmConfig
from evtc.plan.split_k import (
    MAX_SPLITS,
    MAX_TAIL_SPLITS,
    MIN_K_TILES_PER_SPLIT,
    MIN_K_TILES_PER_TAIL_SPLIT,
    MIN_TAIL_GAIN,
    TAIL_FILL,
    choose_splits,
    choose_tail_splits,
    cta_tile_grid,
    whole_cluster_tiles,
    workspace_numels,
)
from evtc.runtime import autotune

BF16 = GemmConfig(ab_dtype="bfloat16", d_dtype="bfloat16", b_major="k")


def _splits(m, n, k, slots=132, config=BF16, cluster=(1, 2)):
    return choose_splits(k, cta_tile_grid(m, n, 1, config, cluster), slots)


def test_large_problems_never_split():
    for m, n, k in [(4096, 4096, 4096), (8192, 8192, 1024), (16384, 8192, 28672), (64, 128256, 4096)]:
        assert _splits(m, n, k) == 1, (m, n, k)


def test_decode_with_long_k_splits_within_bounds():
    """A decode-sized down projection (32 tiles of 128x128, 224 K tiles) leaves most SMs idle
    without a split: it splits, into at most one wave of units."""
    s = _splits(64, 4096, 14336)
    assert 2 <= s <= MAX_SPLITS
    assert cta_tile_grid(64, 4096, 1, BF16, (1, 2)) * s <= 132


def test_short_k_does_not_split():
    # 2 K tiles: a split would hold less than MIN_K_TILES_PER_SPLIT K tiles.
    assert _splits(64, 4096, 128) == 1


@pytest.mark.parametrize("m,n,k", [(1, 4096, 8192), (64, 2048, 7168), (100, 1000, 30000)])
def test_splits_respect_every_bound(m, n, k):
    tiles = cta_tile_grid(m, n, 1, BF16, (1, 2))
    s = _splits(m, n, k)
    assert 1 <= s <= MAX_SPLITS
    assert tiles * s <= 132
    assert -(-k // 64) // s >= MIN_K_TILES_PER_SPLIT or s == 1


def test_workspace_sizes():
    """Partials: S - 1 slots of a 128 x tile_n float32 tile per CTA tile of whole clusters; counters:
    one per CTA tile (a 1x2 cluster over 5 columns of tiles runs 6)."""
    cfg = BF16.replace(tile_n=128)
    assert cta_tile_grid(200, 600, 3, cfg, (1, 2)) == 2 * 6 * 3
    # 18 cluster tiles on 66 clusters: one round, every tile split.
    assert workspace_numels(200, 600, 3, cfg, (1, 2), 4, 66) == (36 * 3 * 128 * 128, 36)
    assert workspace_numels(200, 600, 3, cfg, (1, 2), 1, 66) == (0, 36)
    # On 4 clusters: 16 cluster tiles run whole in 4 rounds, the last 2 (4 CTA tiles) are split.
    assert workspace_numels(200, 600, 3, cfg, (1, 2), 4, 4) == (4 * 3 * 128 * 128, 4)
    # Whole rounds only (18 tiles on 6 or 9 clusters): nothing is split.
    assert workspace_numels(200, 600, 3, cfg, (1, 2), 4, 9) == (0, 0)


def test_whole_tiles_are_the_full_rounds():
    assert whole_cluster_tiles(160, 66) == 132
    assert whole_cluster_tiles(66, 66) == 0  # one round: every tile may split
    assert whole_cluster_tiles(40, 66) == 0
    assert whole_cluster_tiles(132, 66) == 132


@pytest.mark.parametrize("tiles,clusters,k,expect", [
    (160, 66, 8192, 2),    # 512 x 10240 x 8192 in 128 x 128 tiles, 1x2 clusters: 28 tiles left over
    (288, 66, 3584, 2),    # 2048 x 4608 x 3584: 24 left over
    (133, 66, 8192, 4),    # one tile left over: as many splits as allowed
    (133, 66, 1024, 1),    # ... but K too short for two splits of 16 K tiles
    (133, 66, 2048, 2),
    (100, 66, 8192, 1),    # last round more than half full
    (132, 66, 8192, 1),    # whole rounds
    (60, 66, 8192, 1),     # one round: choose_splits' business
    (2048, 66, 8192, 1),   # 8192^3: 31 whole rounds, 2 tiles left: a 1.6% saving at most
    (332, 66, 8192, 4),    # 5 whole rounds, 2 tiles left: (3/4) / 6 of the time
])
def test_tail_splits(tiles, clusters, k, expect):
    # Cluster tiles on clusters of one CTA, and the same in CTA counts for 2-CTA clusters.
    assert choose_tail_splits(k, tiles, clusters, 1) == expect
    assert choose_tail_splits(k, 2 * tiles, 2 * clusters, 2) == expect
    s = choose_tail_splits(k, tiles, clusters, 1)
    assert s <= MAX_TAIL_SPLITS
    if s > 1:
        tail = tiles % clusters
        assert tail <= TAIL_FILL * clusters and tail * s <= clusters
        assert -(-k // 64) // s >= MIN_K_TILES_PER_TAIL_SPLIT
        assert (1 - 1 / s) / (tiles // clusters + 1) >= MIN_TAIL_GAIN


def test_split_k_config():
    cfg = BF16.replace(split_k=True, schedule="cooperative")
    assert "split-k" in cfg.short_name()
    # D is never staged in C's buffers under split-K (see GemmConfig.shares_d_with_load).
    assert not cfg.shares_d_with_load(True)
    # ... which the same configuration without split-K does when its loads cover the whole tile.
    assert cfg.replace(split_k=False, load_stages=cfg.num_subtiles).shares_d_with_load(True)


def test_pin_splits_rejects_bad_values(tmp_path):
    def identity(acc):
        return acc

    ex = {"a": torch.empty(8, 64, dtype=torch.bfloat16, device="meta"),
          "b": torch.empty(64, 64, dtype=torch.bfloat16, device="meta").t()}
    k = evtc.compile(identity, ex, config={"split_k": True}, arch="sm_90a", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="splits must be"):
        k.pin_splits(0)
    fixed = evtc.compile(identity, ex, config={"cluster": (1, 1)}, arch="sm_90a", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="without split-K"):
        fixed.pin_splits(2)
    fixed.pin_splits(1)  # one split is every kernel's own loop
    assert fixed.splits_for(64, 4096, 14336) == 1


def test_a_pin_applies_to_every_handle_of_one_kernel(tmp_path):
    """evtc.compile returns one Kernel per function, example inputs and options in a process, so a
    pin set through one handle shows through the other (as pin_splits documents); a differently
    named function is another kernel and stays unpinned."""
    def identity(acc):
        return acc

    def identity_too(acc):
        return acc

    ex = {"a": torch.empty(8, 64, dtype=torch.bfloat16, device="meta"),
          "b": torch.empty(64, 64, dtype=torch.bfloat16, device="meta").t()}
    first = evtc.compile(identity, ex, arch="sm_90a", cache_dir=tmp_path)
    second = evtc.compile(identity, ex, arch="sm_90a", cache_dir=tmp_path)
    other = evtc.compile(identity_too, ex, arch="sm_90a", cache_dir=tmp_path)
    first.pin_splits(3)
    try:
        assert second is first and second.pinned_splits == 3 and second.splits_for(64, 1024, 8192) == 3
        assert other is not first and other.pinned_splits is None
        # The autotuned handle is the same kernel: one pin for both, set through either.
        tuned = first.autotuned()
        assert tuned.pinned_splits == 3 and tuned.splits_for(64, 1024, 8192) == 3
        tuned.pin_splits(2)
        assert first.pinned_splits == 2 and first.splits_for(64, 1024, 8192) == 2
        assert other.pinned_splits is None
    finally:
        first.pin_splits(None)
    assert first.autotuned().pinned_splits is None


def test_split_launches_run_on_the_clusters_they_were_planned_for(tmp_path, monkeypatch):
    """Four-CTA clusters: the selector counts on fewer than the occupancy API reports
    (evtc.plan.clusters.planned_clusters), and a split launch's tiles and waits assume that grid, so
    the kernel gets that grid; an unsplit launch keeps every resident cluster."""
    from evtc.plan.clusters import planned_clusters
    from evtc.runtime import kernel as kernel_module

    def identity(acc):
        return acc

    ex = {"a": torch.empty(8, 64, dtype=torch.bfloat16, device="meta"),
          "b": torch.empty(64, 64, dtype=torch.bfloat16, device="meta").t()}
    k = evtc.compile(identity, ex, config={"cluster": (1, 4), "split_k": True}, arch="sm_90a",
                     cache_dir=tmp_path)
    monkeypatch.setattr(kernel_module, "max_active_clusters", lambda size, root: 33)
    monkeypatch.setattr(k, "_variant", lambda config: k)
    assert k.slots((1, 4)) == 4 * planned_clusters(4, 33) < 4 * 33
    tile_k = k.config.tile_k
    _, clusters, split, _ = k.resolve(k.config, 4, 512, 4096, 64 * tile_k, 1)
    assert split[0] == 4 and clusters == planned_clusters(4, 33)
    plain = evtc.compile(identity, ex, config={"cluster": (1, 4)}, arch="sm_90a", cache_dir=tmp_path)
    monkeypatch.setattr(plain, "_variant", lambda config: plain)
    _, clusters, split, _ = plain.resolve(plain.config, 1, 512, 4096, 64 * tile_k, 1)
    assert split is None and clusters == 33


def test_split_counts_never_exceed_k_tiles(tmp_path, monkeypatch):
    """Every unit of a launch has a K tile (the mainloop's first K tile overwrites the accumulator,
    with no zero-fill): a pinned count above K's tiles is cut to them, and Kernel.resolve, which
    every launch passes, caps whatever count it is given."""
    from evtc.plan.split_k import splits_within_k

    assert [splits_within_k(s, 200, 64) for s in (1, 3, 4, 5, 7)] == [1, 3, 4, 4, 4]
    assert splits_within_k(7, 1, 64) == 1

    def identity(acc):
        return acc

    ex = {"a": torch.empty(8, 64, dtype=torch.bfloat16, device="meta"),
          "b": torch.empty(64, 64, dtype=torch.bfloat16, device="meta").t()}
    k = evtc.compile(identity, ex, config={"split_k": True}, arch="sm_90a", cache_dir=tmp_path)
    k.pin_splits(7)
    tile_k = k.config.tile_k
    assert k.splits_for(64, 256, 3 * tile_k - 5) == 3
    assert k.splits_for(64, 256, 100 * tile_k) == 7
    # The launch tuple itself (what invoke hands the kernel), from a launch with too many splits.
    monkeypatch.setattr(k, "_variant", lambda config: k)
    _, _, split, _ = k.resolve(k.config, 7, 64, 256, 2 * tile_k, 1)
    assert split[0] == 2
    # The tuner still times launches under such a pin (their capped count matches it).
    assert autotune.tunable(k, (k.config, 2), 2 * tile_k)
    assert not autotune.tunable(k, (k.config, 3), 2 * tile_k)


@pytest.mark.parametrize("schedule", ["pingpong", "cooperative"])
def test_ptx_of_split_k(tmp_path, schedule):
    """The partials move as 128-bit vectors, each tile's count is a release atomic at GPU scope, the
    last split waits with acquire loads, and a kernel without split-K has none of it."""
    def residual(acc, C):
        return acc + C

    ex = {"a": torch.empty(8, 64, dtype=torch.bfloat16, device="meta"),
          "b": torch.empty(64, 64, dtype=torch.bfloat16, device="meta").t(),
          "C": torch.empty(8, 64, dtype=torch.bfloat16, device="meta")}
    split = evtc.compile(residual, ex, config={"split_k": True, "schedule": schedule}, arch="sm_90a",
                         cache_dir=tmp_path).ptx
    assert re.search(r"atom\.global\.release(\.gpu)?\.add", split)  # PTX's default scope is .gpu
    assert "ld.acquire.gpu" in split
    assert len(re.findall(r"st\.global\.v4\.(b32|f32)", split)) >= 16
    assert len(re.findall(r"ld\.global\.v4\.(b32|f32)", split)) >= 16
    plain = evtc.compile(residual, ex, config={"schedule": schedule}, arch="sm_90a", cache_dir=tmp_path).ptx
    assert "ld.acquire.gpu" not in plain
    assert not re.search(r"atom\.global\.release", plain)


def test_a_launch_passes_split_k_buffers_after_the_cluster_count(monkeypatch):
    from evtc.runtime import invoke as invoke_module

    monkeypatch.setattr(invoke_module.stream_buffers, "stream_key", lambda device: ("stream", device))
    monkeypatch.setattr(invoke_module.stream_buffers, "partials",
                        lambda device, n, stream: ("partials", device, n, stream))
    monkeypatch.setattr(invoke_module.stream_buffers, "counters",
                        lambda device, n, stream: ("counters", device, n, stream))
    calls = []
    invoke_module.invoke(lambda *args: calls.append(args), "a", "b", ("d",), ("c",), 66, None, "dev")
    invoke_module.invoke(lambda *args: calls.append(args), "a", "b", ("d",), ("c",), 66, (3, 100, 7), "dev")
    assert calls == [("a", "b", ("d",), ("c",), 66),
                     ("a", "b", ("d",), ("c",), 66, 3, ("partials", "dev", 100, ("stream", "dev")),
                      ("counters", "dev", 7, ("stream", "dev")))]
    config = GemmConfig()
    assert invoke_module.built_config(config, 1) == config
    assert invoke_module.built_config(config, 2) == config.replace(split_k=True)
    assert invoke_module.built_config(config.replace(split_k=True), 1).split_k


def test_captured_launches_take_counters_of_their_own_from_the_arena(monkeypatch):
    """Under CUDA graph capture each launch gets a fresh, 16-byte aligned slice of the zeroed arena
    (no captured memset), never handed out twice; with no arena, or too little left, None (the
    caller then allocates zeroed counters inside the capture)."""
    from evtc.runtime import stream_buffers

    device = torch.device("cuda", 0)
    monkeypatch.setattr(stream_buffers, "_ARENAS", {})
    assert stream_buffers.capture_counters(device, 5) is None
    arena = torch.zeros(20, dtype=torch.int32)
    stream_buffers._ARENAS[0] = [arena, 0]
    first = stream_buffers.capture_counters(device, 5)
    second = stream_buffers.capture_counters(device, 7)
    assert first.numel() == 5 and second.numel() == 7
    assert first.data_ptr() == arena.data_ptr()
    assert second.data_ptr() == arena.data_ptr() + 8 * 4  # after 5, rounded up to 8 counters
    assert stream_buffers.capture_counters(device, 5) is None  # the next slice starts at 16: 16 + 5 > 20
    assert stream_buffers.capture_counters(device, 4) is not None  # 16 + 4 = 20 still fits
    assert stream_buffers.capture_counters(device, 1) is None


def test_a_used_up_capture_arena_is_reported_once(monkeypatch, caplog):
    from evtc.runtime import stream_buffers

    monkeypatch.setattr(stream_buffers, "_ARENAS", {0: [torch.zeros(8, dtype=torch.int32), 8]})
    monkeypatch.setattr(stream_buffers, "_ARENA_SPENT", set())
    with caplog.at_level("WARNING", logger="evtc"):
        for _ in range(3):
            assert stream_buffers.capture_counters(torch.device("cuda", 0), 4) is None
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert "used up" in caplog.records[0].getMessage()


def test_split_partials_are_kept_per_stream_and_grow(monkeypatch):
    """A split call's partials: the same buffer call after call on one stream (no allocation), a
    larger one when a launch needs more, another for another stream, and a fresh one under capture
    (stream None)."""
    from evtc.runtime import stream_buffers

    monkeypatch.setattr(stream_buffers, "_PARTIALS", {})
    cpu = torch.device("cpu")  # the bookkeeping is the same; kept() allocates plainly off CUDA
    first = stream_buffers.partials(cpu, 100, ("dev0", "s1"))
    assert first.dtype == torch.float32 and first.numel() >= 100
    assert stream_buffers.partials(cpu, 50, ("dev0", "s1")) is first
    grown = stream_buffers.partials(cpu, 150, ("dev0", "s1"))
    assert grown is not first and grown.numel() >= 200  # at least doubled
    assert stream_buffers.partials(cpu, 100, ("dev0", "s2")) is not grown
    captured = stream_buffers.partials(cpu, 100, None)
    assert captured is not grown and stream_buffers.partials(cpu, 100, None) is not captured


def test_kept_buffers_grow_to_exactly_the_need_when_doubling_runs_out_of_memory():
    """Kept per-stream buffers grow by doubling; where the doubled size does not fit, the old
    buffer is freed and exactly the launch's need allocated (an out-of-memory error only when even
    that does not fit)."""
    from evtc.runtime.stream_buffers import _grown

    limit = {"numel": 1000}
    made = []

    def make(size):
        if size > limit["numel"]:
            raise torch.OutOfMemoryError(f"CUDA out of memory ({size} elements)")
        made.append(size)
        return torch.zeros(size)

    store: dict = {}
    cpu = torch.device("cpu")
    assert _grown(store, "k", cpu, 400, make).numel() == 400
    assert _grown(store, "k", cpu, 500, make).numel() == 800  # doubled
    assert _grown(store, "k", cpu, 900, make).numel() == 900  # 1600 does not fit: exactly 900
    assert made == [400, 800, 900] and store["k"].numel() == 900
    with pytest.raises(torch.OutOfMemoryError):
        _grown(store, "k", cpu, 1001, make)


def test_pinned_splits_keep_the_partials_within_32_bit_offsets(tmp_path, monkeypatch):
    """A pinned count whose partials would pass 2^31 elements (the kernel's 32-bit offsets) runs
    with as many splits as they reach."""
    from evtc.plan.split_k import workspace_numels
    from evtc.runtime import kernel as kernel_module
    from evtc.runtime.call_checks import INT32_MAX

    def identity(acc):
        return acc

    ex = {"a": torch.empty(8, 64, dtype=torch.bfloat16, device="meta"),
          "b": torch.empty(64, 64, dtype=torch.bfloat16, device="meta").t()}
    k = evtc.compile(identity, ex, config={"split_k": True}, arch="sm_90a", cache_dir=tmp_path)
    monkeypatch.setattr(kernel_module, "max_active_clusters", lambda size, root: 66)
    monkeypatch.setattr(k, "_variant", lambda config: k)
    m, n, kk = 1024, 8192, 4096 * 64
    _, clusters, split, _ = k.resolve(k.config, 4096, m, n, kk, 1)
    assert 1 < split[0] < 4096 and split[1] <= INT32_MAX
    one_more = workspace_numels(m, n, 1, k.config, k.config.cluster, split[0] + 1, clusters)[0]
    assert one_more > INT32_MAX
