"""Split-K: when to cut K, into how many splits, and the workspace that takes (pure Python).

A problem with fewer output tiles than the GPU has SMs (small M: decode, small MoE batches) leaves
most SMs idle for the whole of a long K loop. A kernel compiled with ``split_k=True`` cuts each
tile's K loop into ``splits`` units that run on different SMs; every split but the last stores its
float32 accumulator (one tile-sized slot) and the last adds them in a fixed order, then runs the
epilogue once (:meth:`evtc.sm90.gemm.Sm90GemmKernel._split_k_combine`).

The split count is a runtime argument of the kernel, so a new M never compiles anything: it is
chosen per problem size by :func:`choose_splits`, after the tile shape (:mod:`evtc.plan.selector`).
"""

from __future__ import annotations

from evtc.plan.clusters import ceil_div
from evtc.plan.config import TILE_K, GemmConfig

# At most this many splits: beyond it the last split's reads of the partials (S - 1 tile slots)
# cost more than the shorter K loop saves.
MAX_SPLITS = 16
# Fewest K tiles (of 64) a split keeps: each split costs a round trip of a float32 accumulator tile
# through memory (written by the split, read back by the last), which on the H100 only pays against
# this much streaming (fitted on bench/sweep_configs.py: 32 split 4096-long rows, which lost 3-5%;
# 40 kept 7168-long ones whole, which lost 5%).
MIN_K_TILES_PER_SPLIT = 36


def cta_tile_grid(m: int, n: int, batches: int, config: GemmConfig, cluster: tuple[int, int]) -> int:
    """CTA tiles of the problem, whole clusters included (a ragged last cluster still runs): the
    slots of split-K's counters (see :meth:`evtc.sm90.scheduler.TileScheduler.tile_index`)."""
    tiles_m = ceil_div(ceil_div(m, config.tile_m), cluster[0]) * cluster[0]
    tiles_n = ceil_div(ceil_div(n, config.out_tile_n), cluster[1]) * cluster[1]
    return tiles_m * tiles_n * batches


def workspace_numels(m: int, n: int, batches: int, config: GemmConfig, cluster: tuple[int, int],
                     splits: int) -> tuple[int, int]:
    """(float32 partials, int32 counters) that a launch with ``splits`` splits needs: S - 1 slots of
    one accumulator tile (tile_m x tile_n, the MMA's width) per CTA tile, one counter per CTA
    tile."""
    tiles = cta_tile_grid(m, n, batches, config, cluster)
    return tiles * (splits - 1) * config.tile_m * config.tile_n, tiles


def choose_splits(k: int, tiles: int, slots: int) -> int:
    """Splits of K for a problem of ``tiles`` CTA tiles on a GPU that runs ``slots`` CTAs at once:
    as many as fit in one wave with at least MIN_K_TILES_PER_SPLIT K tiles each, at most
    MAX_SPLITS, and none where the tiles alone fill half the GPU (there a split only adds the
    partials' traffic)."""
    if tiles <= 0 or tiles * 2 > slots:
        return 1
    return max(1, min(MAX_SPLITS, slots // tiles, ceil_div(k, TILE_K) // MIN_K_TILES_PER_SPLIT))


__all__ = ["MAX_SPLITS", "MIN_K_TILES_PER_SPLIT", "choose_splits", "cta_tile_grid", "workspace_numels"]
