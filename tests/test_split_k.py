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
    MIN_K_TILES_PER_SPLIT,
    choose_splits,
    cta_tile_grid,
    workspace_numels,
)

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
    assert workspace_numels(200, 600, 3, cfg, (1, 2), 4) == (36 * 3 * 128 * 128, 36)
    assert workspace_numels(200, 600, 3, cfg, (1, 2), 1) == (0, 36)


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
    from evtc.runtime import kernel as kernel_module

    monkeypatch.setattr(kernel_module.split_k, "partials", lambda device, n: ("partials", device, n))
    monkeypatch.setattr(kernel_module.split_k, "counters", lambda device, n: ("counters", device, n))
    calls = []
    kernel_module._invoke(lambda *args: calls.append(args), "a", "b", ("d",), ("c",), 66, None, "dev")
    kernel_module._invoke(lambda *args: calls.append(args), "a", "b", ("d",), ("c",), 66, (3, 100, 7), "dev")
    assert calls == [("a", "b", ("d",), ("c",), 66),
                     ("a", "b", ("d",), ("c",), 66, 3, ("partials", "dev", 100), ("counters", "dev", 7))]
    config = GemmConfig()
    assert kernel_module._built_config(config, 1) == config
    assert kernel_module._built_config(config, 2) == config.replace(split_k=True)
    assert kernel_module._built_config(config.replace(split_k=True), 1).split_k
