"""Split-K: when to cut K, into how many splits, and the workspace that takes (pure Python).

A problem with fewer output tiles than the GPU has SMs (small M: decode, small MoE batches) leaves
most SMs idle for the whole of a long K loop. A kernel compiled with ``split_k=True`` cuts each
tile's K loop into ``splits`` units that run on different SMs; every split but the last stores its
float32 accumulator (one tile-sized slot) and the last adds them in a fixed order, then runs the
epilogue once (:meth:`evtc.sm90.gemm.Sm90GemmKernel._split_k_combine`).

A problem with more tiles than fit at once splits only its tail: the tiles past the last whole
round (``T % G`` of T cluster tiles on G clusters), which alone would leave most SMs idle for a
whole round. Split S ways, that round takes about 1/S of a tile's time (512 x 10240 x 8192 in 128 x
128 tiles: 160 cluster tiles on 66 clusters, 3 rounds of which the last is 42% full). This is the
wave-quantization fix that stream-K gives, with whole K splits instead of fractional ones; see
:func:`choose_tail_splits` and :class:`evtc.sm90.scheduler.TileScheduler`.

The split count is a runtime argument of the kernel, so a new M never compiles anything: it is
chosen per problem size by :func:`choose_splits`, after the tile shape (:mod:`evtc.plan.selector`).
"""

from __future__ import annotations

from evtc.plan.clusters import ceil_div
from evtc.plan.config import DTYPE_BYTES, TILE_K, GemmConfig

# At most this many splits: beyond it the last split's reads of the partials (S - 1 tile slots)
# cost more than the shorter K loop saves.
MAX_SPLITS = 16
# Fewest K tiles (of 64) a split keeps: each split costs a round trip of a float32 accumulator tile
# through memory (written by the split, read back by the last), which on the H100 only pays against
# this much streaming (fitted on bench/sweep_configs.py: 32 split 4096-long rows, which lost 3-5%;
# 40 kept 7168-long ones whole, which lost 5%).
MIN_K_TILES_PER_SPLIT = 36


# The tail is split only where it fills less than half the clusters: a fuller last round gains less
# than a split costs (the partials' round trip, and the split-K build's own cost). At exactly half
# (the Qwen2.5 LM head at M <= 64 in 64 x 256 tiles: 33 of 66 clusters) the memory-bound last
# round already draws most of the bandwidth, and splitting it lost 1-1.6% on the H100.
TAIL_FILL = 0.45
# Fewest K tiles (of 64) a split of the tail keeps, and at most this many splits: the last split
# reads S - 1 partial tiles back, which a short K loop does not repay.
MIN_K_TILES_PER_TAIL_SPLIT = 16
MAX_TAIL_SPLITS = 4
# A tail is split only where that saves at least this share of the launch's rounds: the split-K
# build runs the whole rounds too, about 2% slower than the plain build (bench/split_overhead.py:
# 0.987 against 1.015 of cuBLAS at 4096^3 with every tile whole), and a tail is worth less the more
# rounds precede it.
MIN_TAIL_GAIN = 0.03


def cta_tile_grid(m: int, n: int, batches: int, config: GemmConfig, cluster: tuple[int, int]) -> int:
    """CTA tiles of the problem, whole clusters included (a ragged last cluster still runs)."""
    tiles_m = ceil_div(ceil_div(m, config.tile_m), cluster[0]) * cluster[0]
    tiles_n = ceil_div(ceil_div(n, config.out_tile_n), cluster[1]) * cluster[1]
    return tiles_m * tiles_n * batches


def whole_cluster_tiles(cluster_tiles: int, clusters: int) -> int:
    """Cluster tiles that run whole before the split tail: the whole rounds of ``clusters`` where
    there are more tiles than that, else none (every tile is split). The kernel's scheduler
    computes the same (:class:`evtc.sm90.scheduler.TileScheduler`)."""
    return cluster_tiles - cluster_tiles % clusters if cluster_tiles > clusters else 0


def workspace_numels(m: int, n: int, batches: int, config: GemmConfig, cluster: tuple[int, int],
                     splits: int, clusters: int) -> tuple[int, int]:
    """(float32 partials, int32 counters) that a launch with ``splits`` splits on ``clusters``
    clusters at once needs: S - 1 slots of one accumulator tile (tile_m x tile_n, the MMA's width)
    per CTA tile that is split, one counter per such CTA tile."""
    ctas = cluster[0] * cluster[1]
    cluster_tiles = cta_tile_grid(m, n, batches, config, cluster) // ctas
    split_tiles = (cluster_tiles - whole_cluster_tiles(cluster_tiles, clusters)) * ctas
    return split_tiles * (splits - 1) * config.tile_m * config.tile_n, split_tiles


def tail_split_limit(tiles: int, slots: int, ctas: int) -> int:
    """The most splits the last round of a problem of ``tiles`` CTA tiles takes on a GPU running
    ``slots`` CTAs at once in clusters of ``ctas``: the clusters it leaves idle, over its tiles
    (at most :data:`MAX_TAIL_SPLITS`); 1 where there is no partly filled round after whole ones."""
    cluster_tiles, clusters = tiles // ctas, slots // ctas
    if clusters <= 0 or cluster_tiles <= clusters or cluster_tiles % clusters == 0:
        return 1
    return min(MAX_TAIL_SPLITS, clusters // (cluster_tiles % clusters))


def choose_tail_splits(k: int, tiles: int, slots: int, ctas: int, tile_k: int = TILE_K) -> int:
    """Splits of the tail of a problem of ``tiles`` CTA tiles on a GPU running ``slots`` CTAs at once
    in clusters of ``ctas`` (1: none). Where whole rounds precede a last round that holds at most
    :data:`TAIL_FILL` of the clusters: as many splits as that round's clusters take, each keeping
    :data:`MIN_K_TILES_PER_TAIL_SPLIT` K tiles, at most :data:`MAX_TAIL_SPLITS`, if the last
    round's saving, (1 - 1/S) of a round, is at least :data:`MIN_TAIL_GAIN` of the rounds.

    Measured on the H100 (bench/split_overhead.py, graph replays, cuBLAS / evtc, 128 x 128
    ping-pong in 1x2 clusters, plain against a split tail): 512 x 10240 x 8192 0.81 -> 0.92 (S = 2),
    512 x 14336 x 4096 0.97 -> 1.01, 2048 x 4608 x 3584 0.90 -> 0.94, 8192^3 (31 whole rounds and
    2 tiles) 1.027 -> 1.044."""
    cluster_tiles, clusters = tiles // ctas, slots // ctas
    if tail_split_limit(tiles, slots, ctas) == 1 or cluster_tiles % clusters > TAIL_FILL * clusters:
        return 1
    splits = min(tail_split_limit(tiles, slots, ctas), ceil_div(k, tile_k) // MIN_K_TILES_PER_TAIL_SPLIT)
    rounds = cluster_tiles // clusters + 1
    if splits < 2 or (1 - 1 / splits) / rounds < MIN_TAIL_GAIN:
        return 1
    return splits


# A model of a one-wave launch, for whether splitting K pays (:func:`modelled_splits`), fitted on the
# H100 (bench/sweep_configs.py and a paired A/B of split counts, 64 x 64 tiles at M <= 128 in CUDA
# graphs, docs/performance.md, "Split-K where the weight streams"): a CTA's K tile takes at least
# about 0.12 us however few bytes it loads (the default 1 x 4 clusters, with A's first 32 rows or all
# 64: the same time per K tile; 0.10 us in 1 x 1 clusters), one SM takes in at most about 160 GB/s
# of A and B tiles, HBM gives about 2.9 TB/s (a device copy: 2.99), and a split launch costs about
# 3 us more than a plain one (the accumulator's round trip and the last split's wait, besides the
# partials it reads back). A 128 x 128 x 64 wgmma step takes about 0.3 us on one SM. Where HBM and
# the K loop are close to each other's limit the launch is slower than either alone: the two
# combine as a cubic soft maximum (fitted in 1 x 1 clusters, where a K tile took 0.10 us: 64 x 2048 x
# 14336 ran 27.4 us past the launch floor, against 22.9 us of K loop and 20.2 us of HBM at 2.9
# TB/s; the cube root of their cubes' sum is 27.2).
K_TILE_FLOOR_US = 0.12
SM_BYTES_PER_US = 160e3
HBM_BYTES_PER_US = 2.9e6
# The H200 has the H100's SMs with HBM3e (a device copy: 4.25 TB/s), so the K loop limits a one-wave
# launch sooner there and splits pay on more shapes. Its rate in the model is fitted to the split
# counts measured there (bench/sweep_configs.py --candidates decode_launches, docs/performance.md,
# "Split counts on the H200"): 2 splits beat 1 by 6-7% on a 3584 x 18944 weight at M = 1-64 and
# tied on 4096 x 14336; the model ranks both so for rates of 3.2-3.8 TB/s, and this is the middle.
H200_HBM_BYTES_PER_US = 3.5e6
SPLIT_COST_US = 3.0
MMA_US_PER_128X128_K_TILE = 0.3
# A split count must beat one split by this share of the modelled time.
MIN_SPLIT_GAIN = 0.05


def modelled_time_us(m: int, n: int, k: int, batches: int, config: GemmConfig, splits: int,
                     hbm_bytes_per_us: float = HBM_BYTES_PER_US) -> float:
    """Modelled microseconds of a launch whose units all run at once (one wave), K cut in
    ``splits`` (``n``: the output's width; a gated B streams twice as many columns): HBM streaming A
    and B once at ``hbm_bytes_per_us`` (the GPU's, :func:`evtc.runtime.device.hbm_bytes_per_us`)
    against one unit's K loop (each K tile bound by
    :data:`K_TILE_FLOOR_US`, the SM's intake of its A and B tiles or its MMA), combined as a cubic
    soft maximum, plus, split, :data:`SPLIT_COST_US` and the last split's reads of the others'
    float32 partials. The launch's fixed floor (about 3 us) is left out: it is the same for every
    split count."""
    elem = DTYPE_BYTES[config.ab_dtype]
    k_tiles = ceil_div(k, config.tile_k)
    per_k_tile = max(K_TILE_FLOOR_US,
                     (config.a_box_rows + config.tile_n) * config.tile_k * elem / SM_BYTES_PER_US,
                     MMA_US_PER_128X128_K_TILE * config.tile_m * config.tile_n / (128 * 128))
    unit = ceil_div(k_tiles, splits) * per_k_tile
    b_columns = 2 * n if config.gated else n  # n: the output's width; a gated B holds both halves
    hbm = batches * (m + b_columns) * k * elem / hbm_bytes_per_us
    streaming = (hbm ** 3 + unit ** 3) ** (1 / 3)
    if splits == 1:
        return streaming
    partials = (splits - 1) * config.tile_m * config.tile_n * 4 / SM_BYTES_PER_US
    return streaming + SPLIT_COST_US + partials


def modelled_splits(most: int, m: int, n: int, k: int, batches: int, config: GemmConfig,
                    hbm_bytes_per_us: float = HBM_BYTES_PER_US) -> int:
    """The split count, at most ``most`` (the bounds of :func:`choose_splits`), that
    :func:`modelled_time_us` finds fastest, if it beats one split by :data:`MIN_SPLIT_GAIN`; else 1.

    Splitting pays where one unit's K loop is far longer than HBM needs to stream the whole
    problem: few tiles, each with a long K (64 x 1024 x 8192, 16 tiles of 64 x 64: 0.71x cuBLAS
    whole, 0.84x in 4 splits). Where the tiles already draw most of HBM's bandwidth, a split only
    adds its cost (64 x 3072 x 7168, 48 tiles: 1.03x whole, 0.98x in 2 splits)."""
    if most <= 1:
        return 1
    times = {s: modelled_time_us(m, n, k, batches, config, s, hbm_bytes_per_us) for s in range(1, most + 1)}
    best = min(times, key=times.get)
    return best if times[best] <= (1 - MIN_SPLIT_GAIN) * times[1] else 1


def splits_within_k(splits: int, k: int, tile_k: int) -> int:
    """``splits`` limited to K's tiles, so that every split has at least one K tile: the kernel's
    mainloop starts each unit by overwriting its accumulator with the first K tile's product
    (no zero-fill), which is only right for a unit that has one."""
    return max(1, min(splits, ceil_div(k, tile_k)))


def choose_splits(k: int, tiles: int, slots: int, tile_k: int = TILE_K) -> int:
    """Splits of K for a problem of ``tiles`` CTA tiles on a GPU that runs ``slots`` CTAs at once:
    as many as fit in one wave with at least MIN_K_TILES_PER_SPLIT K tiles each, at most
    MAX_SPLITS, and none where the tiles alone fill half the GPU (there a split only adds the
    partials' traffic)."""
    if tiles <= 0 or tiles * 2 > slots:
        return 1
    return max(1, min(MAX_SPLITS, slots // tiles, ceil_div(k, tile_k) // MIN_K_TILES_PER_SPLIT))


__all__ = ["H200_HBM_BYTES_PER_US", "HBM_BYTES_PER_US", "K_TILE_FLOOR_US", "MAX_SPLITS", "MAX_TAIL_SPLITS",
           "MIN_K_TILES_PER_SPLIT",
           "MIN_K_TILES_PER_TAIL_SPLIT", "MIN_SPLIT_GAIN", "MIN_TAIL_GAIN", "MMA_US_PER_128X128_K_TILE",
           "SM_BYTES_PER_US", "SPLIT_COST_US", "TAIL_FILL", "choose_splits", "modelled_splits",
           "modelled_time_us", "choose_tail_splits", "cta_tile_grid",
           "splits_within_k", "tail_split_limit", "whole_cluster_tiles", "workspace_numels"]
