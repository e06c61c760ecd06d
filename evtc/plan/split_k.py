"""Split-K: when to cut K, into how many splits, and the workspace that takes (pure Python).

A problem with fewer output tiles than the GPU has SMs (small M: decode, small MoE batches) leaves
most SMs idle for the whole of a long K loop. A kernel compiled with ``split_k=True`` cuts each
tile's K loop into ``splits`` units that run on different SMs; every split but the last stores its
float32 accumulator (one tile-sized slot) and the last adds them in a fixed order, then runs the
epilogue once (:meth:`evtc.sm90.gemm.Sm90GemmKernel._split_k_combine`).

The split count is a runtime argument of the kernel, so a new M never compiles anything: it is
chosen per problem size by :func:`choose_splits` from a model of tensor-core time per SM against the
time HBM needs to stream the operands.
"""

from __future__ import annotations

from evtc.plan.clusters import ceil_div
from evtc.plan.config import TILE_K, GemmConfig

# At most this many splits: beyond it the last split's reads of the partials (S - 1 tile slots)
# cost more than the shorter K loop saves.
MAX_SPLITS = 16
# Below this many K tiles per split a split is all prologue and epilogue.
MIN_K_TILES_PER_SPLIT = 4
# The model's two rates, from the H100 (docs/performance.md, "split-K"): the tensor-core rate of one
# SM on 16-bit inputs (989 TFLOP/s dense over 132 SMs, less the clock lost at the power limit), and
# the HBM bandwidth a streaming GEMM reaches (cuBLAS streams decode-sized weights at 2.3-2.5 TB/s).
SM_FLOPS = 6.5e12
HBM_BYTES_PER_S = 2.5e12

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


def choose_splits(m: int, n: int, k: int, tiles: int, slots: int, config: GemmConfig) -> int:
    """The split count for an (M, N, K) problem of ``tiles`` CTA tiles on ``slots`` concurrent CTAs.

    A problem whose tiles fill fewer SMs than the GPU has runs at the speed of one SM's tensor cores
    over its whole K loop, not at the speed of memory: each tile's K loop takes ``k_tiles`` times
    the MMA time of one K tile. Splitting K shortens it; it pays until a split's loop is no longer
    than the time HBM needs to stream A and B at all (the problem is then memory-bound, and more
    splits only add partial traffic). So: the fewest splits whose loop fits in that time, with
    every split on an SM of its own (one wave), at least MIN_K_TILES_PER_SPLIT K tiles each, and at
    most MAX_SPLITS. 1 for problems with a wave of tiles or more."""
    k_tiles = ceil_div(k, TILE_K)
    if tiles <= 0 or tiles * 2 > slots:
        return 1
    elem = 1 if config.ab_dtype.startswith("float8") else 2
    k_tile_s = 2 * config.tile_m * config.tile_n * TILE_K / SM_FLOPS
    stream_s = (m + (2 if config.gated else 1) * n) * k * elem / HBM_BYTES_PER_S
    most = max(1, min(MAX_SPLITS, slots // tiles, k_tiles // MIN_K_TILES_PER_SPLIT))
    for splits in range(1, most + 1):
        if ceil_div(k_tiles, splits) * k_tile_s <= stream_s:
            return splits
    return most


__all__ = ["MAX_SPLITS", "choose_splits", "cta_tile_grid", "workspace_numels"]
