"""Static configuration of the SM90 GEMM kernel, and the shared-memory budget that follows from it.

Everything in a :class:`GemmConfig` is baked into the compiled kernel; everything else (M, N, K, L,
pointers, strides, epilogue scalars) is a runtime argument.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Names we accept for dtypes.  Strings keep the config hashable, printable and free of any import of
# cutlass or torch; :mod:`evtc.sm90.dtypes` maps them to both.
# float32 A and B run as tf32 (the tf32 wgmma, evtc.sm90.mma); the call path takes them only where
# torch allows tf32 for float32 matmuls.
AB_DTYPES = ("float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2")
D_DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
FLOAT8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
# Block-scaled float8: elements of K (and columns of B) per scale; rows of A per scale.
SCALE_BLOCK = 128
BLOCK_SCALE_ROWS = (1, 128)
# Block scales with a gated B: columns of a half that share one scale of B (GemmConfig.scale_chunk).
# 32 keeps the factors few (6 per row slot in a 128 x 192 tile) and takes every N/2 that is a multiple
# of 32; N/2 of other sizes take the torch path.
GATED_SCALE_CHUNK = 32
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
               "int32": 4,  # int32: the counters of a kernel that finishes its own reductions
               "bool": 1}  # a mask output, stored by the kernel as float8_e4m3fn bytes (0 and 1)

TILE_M = 128  # the default: two consumer warpgroups, 64 rows each (cooperative schedule)
# Rows of an output tile.  64 only under ping-pong: one m64 wgmma atom per consumer warpgroup, for
# problems with few rows (decode, small MoE batches), where 128-row tiles would multiply half their
# rows by zero padding and spill twice the split-K partials.
TILE_MS = (64, 128)
# Ping-pong schedule: each consumer warpgroup owns a whole tile_m x tile_n tile (one m64nN wgmma
# atom along M per k16 step for each 64 rows, as CUTLASS's ping-pong kernels). Its fp32 accumulator
# takes tile_m * tile_n / 128 registers per thread, of the 232 a consumer thread gets: up to 192
# (tile_n up to 192 at tile_m = 128, 256 at tile_m = 64). Past 128 the epilogue's own registers run
# short: 128 x 192 with 32-column subtiles spilled 8-92 bytes for bias + GELU or a residual, where
# 16-column subtiles and 128 x 176 did not (ptxas, CUTE_DSL_ARCH=sm_90a). The selector runs those
# wide tiles with 16-column subtiles and for light epilogues only (evtc.plan.selector,
# WIDE_PINGPONG_WIDTHS); cuBLAS runs 128 x 176 ping-pong at 512 x 28672 x 4096.
PINGPONG_ACC_REGS = 192
# A mainloop that promotes float8 partial sums (GemmConfig.fast_accum) keeps a scratch accumulator
# beside the tile's: two of at most 96 registers per thread (cooperative 128 x 192, its default:
# the 8-bit wgmma reads its operands from shared memory fast enough that 128 x 128 tiles are
# bound by shared-memory bandwidth; 0.65x cuBLASLt against 0.99x at 8192 x 8192 x 28672).
PROMOTING_ACC_REGS = 96
# Promoting tiles of at most this many accumulator registers per thread keep two scratch
# accumulators that take turns (GemmConfig.promotes_in_pairs): K tile k + 1's wgmma is issued before
# tile k's is waited for, so the tensor cores do not drain between K tiles. Small tiles (the
# selector's choice at small M) are latency-bound there: a K tile's wgmma is short and the wait for
# it dominates (docs/fp8.md). Larger tiles have the other consumer warpgroup to fill that gap, and
# three accumulators of 72-96 registers would not fit beside the epilogue's in a consumer thread's
# 232; three of 64 (128 x 128) compile with no spills.
PROMOTE_IN_PAIRS_MAX_ACC_REGS = 64
PINGPONG_TILE_N = 128
SCHEDULES = ("cooperative", "pingpong")
# The default: ping-pong, 128x128 per warpgroup, clusters of 1x2 CTAs (A multicast to both).  On the
# H100 it is the fastest configuration of ours at all three reference shapes (docs/performance.md,
# "ping-pong becomes the default"); without multicast the 128x128 tiles are L2-bound.
DEFAULT_SCHEDULE = "pingpong"
DEFAULT_CLUSTER = {"pingpong": (1, 2), "cooperative": (1, 1)}
# Rows of A a stage may load when a problem has fewer rows than a tile (GemmConfig.a_rows). The
# TMA unit spends on the rows of a box past M about what it spends on data (docs/performance.md,
# "Rows of A past M"), so a one-row problem of 33-127 rows loads the multiple of 16 that holds it.
A_ROWS = (8, 16, 32, 48, 64, 80, 96, 112)
# K of one pipeline stage for 16-bit A and B: four k16 wgmma steps, 128 bytes of K, one full
# swizzle row. 8-bit A and B take 128 (four k32 steps, the same 128 bytes): GemmConfig.tile_k.
TILE_K = 64
# 112, 144 and 160 (cooperative, K-major B) let a problem's 128-row tiles make whole waves: 512 x
# 4608 in 128 x 144 tiles is 128 tiles on 132 SMs, one round, where 128 x 128 tiles take two
# (evtc.plan.selector, "wave-fitted widths").
# 176: ping-pong tiles for problems of many tiles whose width 176 makes whole rounds (28672 columns
# are 163 of them; evtc.plan.selector, WIDE_PINGPONG_WIDTHS).
# 80 and 96 (ping-pong 64-row tiles, K-major B): two rows of tiles that make one wave at M = 112-128
# (evtc.plan.selector, TWO_ROW_WIDTHS; 4608 columns are 58 tiles of 80).
TILE_NS = (64, 80, 96, 112, 128, 144, 160, 176, 192, 256)
TWO_ROW_ONLY_TILE_NS = (80, 96)
EPI_TILE_NS = (16, 32, 64)
# (1, 4): A multicast to four CTAs along N. It pays only where the kernel streams weights (few
# 64-row tiles, M <= 64): each CTA then loads a quarter of A's stage instead of half
# (docs/performance.md, "Four-CTA clusters and deeper pipelines at decode sizes").
CLUSTERS = ((1, 1), (2, 1), (1, 2), (1, 4))

# H100: 227 KiB of shared memory per block (opt-in maximum).
SM90_SMEM_BYTES = 232448
# Room for the mbarriers of every pipeline plus alignment slack between the buffers.  Each buffer is
# aligned to 1024 B (the 128 B swizzle repeats every 1024 B), so a few hundred bytes may be lost per
# buffer; 2 KiB covers A, B, D and two visitor buffers comfortably.
SMEM_RESERVED_BYTES = 2048
# Block-scaled float8 with A's scales staged (GemmConfig.stages_a_scales): float32 per row and K
# tile, and the alignment slack of their buffer.
A_SCALE_BYTES = 4
A_SCALES_ALIGN_SLACK = 1024
MIN_AB_STAGES = 2
# Only 64 x 64 tiles reach it (13 stages of 16 KiB). At decode sizes a CTA streams its weights
# through the pipeline, and the loads it keeps in flight bound its bandwidth: 13 stages instead of 8
# ran 64 x 4096 x 7168 at 1.04x cuBLAS instead of 0.97x (cuBLAS's own decode kernels keep 13 to 16).
MAX_AB_STAGES = 16
# The A/B bytes in flight that epilogue staging may bring the pipeline down to (and no further).  At
# small K the epilogue's own memory traffic (D stores, C loads) is what costs, so deeper epilogue
# buffers pay, but only while the mainloop keeps enough loads in flight to hide their latency.  On
# the H100: 3 stages of 128x256x64 (144 KiB) were as fast as 4, and 5 stages of 128x128x64 (160 KiB)
# were 2-3% faster than 4 with a fused epilogue (docs/performance.md).  See
# GemmConfig.overlap_ab_stages.
OVERLAP_AB_BYTES = 144 * 1024

# Threads: one producer warpgroup (warp 0: A/B loads; warp 1: epilogue loads) + two consumer
# warpgroups.  Register budgets are moved with setmaxnreg: 40 * 128 + 232 * 256 = 64512 <= 65536.
NUM_THREADS = 384
PRODUCER_REGS = 40
CONSUMER_REGS = 232


class ConfigError(ValueError):
    """A GemmConfig (or a problem handed to a compiled kernel) that the engine does not support."""



#: The knobs a user may set in ``evtc.compile(config=...)``, and what each takes.
USER_KNOBS = {
    "tile_m": "int", "tile_n": "int", "cluster": "pair", "epi_tile_n": "int", "epi_stages": "int?",
    "load_stages": "int?", "ab_stages": "int?", "raster": "str", "swizzle": "int", "schedule": "str",
    "split_k": "bool", "pdl": "bool", "fast_accum": "bool", "d_major": "str",
    "a_rows": "int?", "block_scales": "int",  # refused by compile with their own reasons
}
#: Fields evtc sets from the example inputs and the epilogue.
DERIVED_FIELDS = ("ab_dtype", "d_dtype", "b_dtype", "a_major", "b_major", "gated", "store_d")


def check_user_knobs(knobs: Mapping[str, Any]) -> None:
    """Refuse a knob ``evtc.compile(config=...)`` does not take, or a value of the wrong type,
    naming it (a float tile_n passed ``128.0 in TILE_NS`` and failed deep in the DSL)."""
    for name, value in knobs.items():
        kind = USER_KNOBS.get(name)
        if name in DERIVED_FIELDS:
            raise ConfigError(f"{name} is not a knob: evtc sets it from the example inputs and the epilogue")
        if kind is None:
            raise ConfigError(f"unknown knob {name!r}; the knobs are {', '.join(sorted(USER_KNOBS))}")
        if kind == "int?" and value is None:
            continue
        if kind in ("int", "int?"):
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif kind == "bool":
            ok = isinstance(value, bool)
        elif kind == "str":
            ok = isinstance(value, str)
        else:  # a pair of ints
            ok = isinstance(value, tuple | list) and len(value) == 2 and all(
                isinstance(v, int) and not isinstance(v, bool) for v in value)
        if not ok:
            want = {"int": "an int", "int?": "an int or None", "bool": "True or False", "str": "a string",
                    "pair": "a pair of ints, e.g. (1, 2)"}[kind]
            raise ConfigError(f"knob {name} must be {want}, got {value!r}")


@dataclass(frozen=True)
class GemmConfig:
    """Static choices of one compiled GEMM kernel.

    Majors use the BLAS naming of the problem D[M, N] = A[M, K] @ B[K, N]:

    * ``a_major``: ``"k"`` (A row-major, K contiguous) or ``"m"`` (A column-major).
    * ``b_major``: ``"n"`` (B row-major, N contiguous) or ``"k"`` (B column-major, i.e. B = Bt.T with
      Bt[N, K] row-major, the usual weight layout of a linear layer).
    * ``d_major``: ``"n"`` (D row-major) or ``"m"`` (D column-major).

    ``schedule``: ``"pingpong"`` (the default: each consumer warpgroup computes its own 128 x tile_n
    tile, and one warpgroup's epilogue runs while the other's MMAs do) or ``"cooperative"`` (both
    warpgroups on one 128 x tile_n tile).  ``tile_n=None`` and ``cluster=None`` take the schedule's
    defaults: 128 and 1x2 (pingpong), 256 and 1x1 (cooperative).

    ``ab_stages=None`` picks the largest number of A/B pipeline stages that fits in shared memory
    after the epilogue's buffers (D staging and whatever the visitor declares).

    ``gated``: a gated epilogue (SwiGLU): B is given as its two halves (gate and up), each
    tile_n / 2 wide per tile, loaded side by side into one tile_n-wide B tile; the output tile is
    ``out_tile_n = tile_n / 2`` wide (see :mod:`evtc.ir.passes.gated`).

    ``store_d=False``: an epilogue whose outputs are all reductions; the kernel writes no D (the D
    buffers shrink to one unused stage).

    ``split_k``: the kernel can split K. The number of splits is then a runtime argument (1 runs
    like a kernel without the knob): each output tile becomes ``splits`` work units over
    consecutive ranges of K; every split but the last writes its float32 accumulator to a
    workspace, and the last adds them in split order (fixed: bit-for-bit deterministic) and runs
    the epilogue once on the full sum. For problems with too few tiles to fill the GPU (small M);
    see :mod:`evtc.plan.split_k`.

    ``a_rows``: rows of A that each pipeline stage loads, for problems with fewer rows than a tile
    (decode). ``None`` loads the whole tile_m x 64 block. 8, 16 or 32 (a multiple of 8 per CTA
    that shares A's load in the cluster, K-major A only) loads just that many rows: the TMA unit
    spends L2 bandwidth on the rows of a box that lie past M as if they were data, so a 64-row box
    over a 1-row A reads 64 times what it needs, from the few L2 slices that hold that row. The
    accumulator rows past ``a_rows`` come from shared memory nobody wrote and are never stored or
    reduced; a call with more than ``a_rows`` rows runs the kernel built with ``a_rows=None``
    (the runtime's choice, see :meth:`evtc.runtime.kernel.Kernel.resolve`).

    ``pdl``: launch with programmatic dependent launch (opt-in). The kernel's set-up (barrier init,
    descriptor prefetch) then overlaps the end of the previous kernel in the stream, and it waits
    for that kernel to complete before it touches global memory; the next kernel may be scheduled
    as soon as this one starts. Only what runs before that wait overlaps, so results are the same
    with or without it. Off by default: on the H100 it made some decode launches 10% faster and
    others up to 25% slower (docs/performance.md).

    ``fast_accum`` (float8 A and B only): the H100's 8-bit wgmma adds its products into the
    accumulator with fewer mantissa bits than float32. By default (False) each K tile's products
    (128 K elements, four k32 wgmma steps) are summed by the wgmma into a scratch accumulator that
    the consumer then adds into a float32 one, the promotion of DeepSeek-V3's recipe. It costs the
    scratch accumulator's registers (tiles of at most PROMOTING_ACC_REGS per thread) and a wait for
    each K tile's wgmma before its add. True keeps every product in the wgmma's own
    accumulator: faster, less precise (torch._scaled_mm's ``use_fast_accum=True``). 16-bit
    wgmma accumulates in full float32 either way.

    ``block_scales`` (float8 A and B only; set from the example inputs, not a knob): 0 for none;
    otherwise the rows of A that share one float32 scale per 128 elements of K (1: DeepSeek-V3's
    1 x 128 activation blocks; 128: 128 x 128 blocks), B being scaled per 128 x 128 block. Each K
    tile's products are multiplied by their blocks' scales as the promoting mainloop adds them into
    the accumulator, so it needs ``fast_accum=False`` and tiles of a multiple of 64 columns (each
    64-column chunk of a tile in one B block); gated, output tiles of a multiple of
    :data:`GATED_SCALE_CHUNK` columns (see :attr:`scale_chunk`).
    """

    ab_dtype: str = "float16"
    d_dtype: str = "float16"
    # B's dtype where it differs from A's: float8 A and B may mix e4m3 and e5m2 (None: ab_dtype).
    b_dtype: str | None = None
    a_major: str = "k"
    b_major: str = "n"
    d_major: str = "n"
    tile_n: int | None = None  # None: 256 (cooperative) or 128 (pingpong)
    tile_m: int = TILE_M
    cluster: tuple[int, int] | None = None  # None: DEFAULT_CLUSTER of the schedule
    epi_tile_n: int = 32
    epi_stages: int | None = None
    load_stages: int | None = None
    ab_stages: int | None = None
    raster: str = "m"
    swizzle: int = 8
    schedule: str = DEFAULT_SCHEDULE
    gated: bool = False
    store_d: bool = True
    split_k: bool = False
    a_rows: int | None = None
    pdl: bool = False
    fast_accum: bool = False
    block_scales: int = 0

    def __post_init__(self) -> None:
        if self.tile_n is None:
            object.__setattr__(self, "tile_n", PINGPONG_TILE_N if self.schedule == "pingpong" else 256)
        if self.cluster is None:
            object.__setattr__(self, "cluster", DEFAULT_CLUSTER.get(self.schedule, (1, 1)))
        else:
            object.__setattr__(self, "cluster", tuple(self.cluster))

    # ---- derived shapes -------------------------------------------------------------------------
    @property
    def epi_groups(self) -> int:
        """Epilogues that run at once, each with its own D (and extra-output) staging buffers:
        1 (cooperative) or 2 (pingpong, one per consumer warpgroup)."""
        return 2 if self.schedule == "pingpong" else 1

    @property
    def epilogue_threads(self) -> int:
        """Threads of one epilogue (one tile): a consumer warpgroup under pingpong, both under
        cooperative."""
        return 128 * (2 // self.epi_groups)

    @property
    def promotes(self) -> bool:
        """Whether the mainloop promotes float8 partial sums into a float32 accumulator after each
        K tile (see ``fast_accum``)."""
        return self.ab_dtype in FLOAT8_DTYPES and not self.fast_accum

    @property
    def promotes_in_pairs(self) -> bool:
        """Whether the promoting mainloop alternates two scratch accumulators (tiles of at most
        :data:`PROMOTE_IN_PAIRS_MAX_ACC_REGS` registers per thread)."""
        return self.promotes and self.acc_regs <= PROMOTE_IN_PAIRS_MAX_ACC_REGS

    @property
    def stages_a_scales(self) -> bool:
        """Whether each A/B stage also brings A's 1 x 128 block scales for its K tile (one float32
        per row of the tile, by TMA), read from shared memory before the K tile's wgmma fence:
        every kernel with 1 x 128 blocks. Per-row scales loaded from global memory cost about 9%
        of the kernel's time at large M, where one scratch accumulator waits for them, and held up
        the next K tile's fence where two take turns (docs/performance.md, "A's block scales with
        the A/B stage")."""
        return self.block_scales == 1

    @property
    def acc_regs(self) -> int:
        """Accumulator registers per consumer thread (a warpgroup's share of the tile)."""
        return self.tile_m * self.tile_n // (128 * (2 // self.epi_groups))

    @property
    def b_element(self) -> str:
        """B's dtype: ``b_dtype``, or A's."""
        return self.b_dtype or self.ab_dtype

    @property
    def tile_shape_mnk(self) -> tuple[int, int, int]:
        return (self.tile_m, self.tile_n, self.tile_k)

    @property
    def tile_k(self) -> int:
        """K of one pipeline stage: 128 bytes of A's and B's rows (64 16-bit or 128 8-bit
        elements), one full 128-byte swizzle row."""
        return 128 // DTYPE_BYTES[self.ab_dtype]

    @property
    def epi_tile(self) -> tuple[int, int]:
        return (self.tile_m, self.epi_tile_n)

    @property
    def out_tile_n(self) -> int:
        """Columns of one output tile: tile_n, or half of it when gated."""
        return self.tile_n // 2 if self.gated else self.tile_n

    @property
    def num_subtiles(self) -> int:
        """Epilogue subtiles of one output tile (a gated one reads two accumulator subtiles each)."""
        return self.out_tile_n // self.epi_tile_n

    @property
    def c_stages(self) -> int:
        """Staged buffers for epilogue loads (C and friends); used only by visitors that load.

        Up to 4 subtiles in flight (as CUTLASS), at most 32 KiB of 16-bit data so that the A/B
        pipeline keeps its depth, at least 2 so a load can land while the previous one is read.
        Pingpong: stages of each warpgroup's own ring (``epi_groups`` rings share the 32 KiB)."""
        if self.load_stages is not None:
            return self.load_stages
        by_bytes = (32 * 1024) // (self.epi_groups * self.tile_m * self.epi_tile_n * 2)
        return max(1, min(self.num_subtiles, max(2, min(4, by_bytes))))

    def d_bytes_per_stage(self) -> int:
        """D staging bytes of one stage of every concurrent epilogue (``epi_groups`` of them)."""
        return self.epi_groups * self.tile_m * self.epi_tile_n * DTYPE_BYTES[self.d_dtype]

    @property
    def a_box_rows(self) -> int:
        """Rows of A one pipeline stage loads (see ``a_rows``)."""
        return self.tile_m if self.a_rows is None else self.a_rows

    def runs_rows(self, m: int) -> bool:
        """Whether a problem with ``m`` rows per batch may run this configuration's kernel: always,
        unless ``a_rows`` trims A's loads to fewer rows than ``m``."""
        return self.a_rows is None or m <= self.a_rows

    def ab_bytes_per_stage(self) -> int:
        scales = (self.tile_m + self.b_scale_chunks) * A_SCALE_BYTES if self.stages_a_scales else 0
        return (self.tile_m + self.tile_n) * self.tile_k * DTYPE_BYTES[self.ab_dtype] + scales

    def overlap_ab_stages(self) -> int:
        """The fewest A/B stages that epilogue buffers may leave: enough to hold OVERLAP_AB_BYTES
        (3 stages of a 128x256 tile, 5 of a 128x128 one, in 16-bit inputs)."""
        return max(MIN_AB_STAGES, -(-OVERLAP_AB_BYTES // self.ab_bytes_per_stage()))

    def shares_d_with_load(self, visitor_offers: bool) -> bool:
        """Whether D is staged in the epilogue-load buffers of a tile input (C) instead of its own.

        Only when the visitor offers such a buffer (same dtype and major as D, no staged outputs of
        its own), under the cooperative schedule, with the loads staged for the whole tile: subtile
        ``i`` of D is then written into the stage that held subtile ``i`` of C, and the stage goes
        back to the loader once the D store has read it (during the next tile's mainloop).  The
        tile then needs one set of buffers for both, so C loads and D stores both overlap the
        mainloop.
        """
        # Not with split-K: a tile's stages would be handed back during the mainloop of the next
        # unit that runs an epilogue, which need not be the next unit.
        return (visitor_offers and self.store_d and self.schedule == "cooperative"
                and self.c_stages == self.num_subtiles and not self.split_k)

    def plan_stages(self, visitor_smem_bytes: int = 0, d_in_load_buffers: bool = False) -> tuple[int, int]:
        """(A/B stages, D stages) for a visitor that needs ``visitor_smem_bytes`` of shared memory.

        The epilogue's buffers are reserved first and the A/B pipeline gets what is left.  When
        ``epi_stages`` is not set, D gets 2 buffers (one draining while the next is written) and then
        more, up to one per subtile (the whole tile; two tiles when gated), for as long as the A/B
        pipeline keeps
        :meth:`overlap_ab_stages` (or what it had with 2 D buffers, if that is fewer).

        ``d_in_load_buffers`` (see :meth:`shares_d_with_load`): D takes no shared memory of its own;
        the D stage count returned is then that of the (unused) store ring, ``epi_stages`` or 2.
        """
        free = SM90_SMEM_BYTES - SMEM_RESERVED_BYTES - visitor_smem_bytes
        if self.stages_a_scales:
            free -= A_SCALES_ALIGN_SLACK  # the scales' buffer sits between the barriers and sA
        d_bytes = 0 if d_in_load_buffers else self.d_bytes_per_stage()

        def ab_fit(d_stages: int) -> int:
            return (free - d_stages * d_bytes) // self.ab_bytes_per_stage()

        if not self.store_d:
            d_stages = 1  # allocated (the epilogue's copy layouts come from it), never written
        elif d_in_load_buffers:
            d_stages = self.epi_stages if self.epi_stages is not None else 2
        elif self.epi_stages is not None:
            d_stages = self.epi_stages
        else:
            d_stages = 2
            keep = min(ab_fit(2), self.overlap_ab_stages())
            # A gated tile has half the output subtiles; up to two tiles' worth of D buffers keeps
            # its A/B pipeline at the usual depth: with the shared memory in a sixth A/B stage
            # instead, SwiGLU at 8192 x 2*8192 x 8192 measured 9% slower on the H100 (3.96 vs
            # 3.62 ms; the plain GEMM with that plan also lost 3%).
            most = self.num_subtiles * (2 if self.gated else 1)
            while d_stages < most and ab_fit(d_stages + 1) >= keep:
                d_stages += 1
        fit = ab_fit(d_stages)
        if self.ab_stages is not None:
            if self.ab_stages > fit:
                raise ConfigError(
                    f"ab_stages={self.ab_stages} needs {self.ab_stages * self.ab_bytes_per_stage()} B of "
                    f"shared memory but only {free - d_stages * d_bytes} B are left after "
                    f"the epilogue (D staging {d_stages} x {d_bytes} B, visitor "
                    f"{visitor_smem_bytes} B)"
                )
            return self.ab_stages, d_stages
        ab = min(fit, MAX_AB_STAGES)
        if ab < MIN_AB_STAGES:
            raise ConfigError(
                f"only {max(fit, 0)} A/B pipeline stage(s) fit in shared memory with tile_n={self.tile_n}, "
                f"D staging {d_stages} x {d_bytes} B and visitor buffers "
                f"{visitor_smem_bytes} B; use a smaller tile_n, epi_tile_n or epi_stages"
            )
        return ab, d_stages

    # ---- validation ----------------------------------------------------------------------------
    def validate(self) -> GemmConfig:
        def bad(msg: str) -> None:
            raise ConfigError(f"GemmConfig: {msg}")

        if self.ab_dtype not in AB_DTYPES:
            bad(f"ab_dtype must be one of {AB_DTYPES}, got {self.ab_dtype!r}")
        if self.b_dtype is not None and self.b_dtype != self.ab_dtype and not (
                self.ab_dtype in FLOAT8_DTYPES and self.b_dtype in FLOAT8_DTYPES):
            bad(f"b_dtype={self.b_dtype!r} differs from ab_dtype={self.ab_dtype!r}: only float8 A and B "
                f"may mix formats ({FLOAT8_DTYPES})")
        if self.d_dtype not in D_DTYPES:
            bad(f"d_dtype must be one of {D_DTYPES}, got {self.d_dtype!r}")
        if self.d_dtype in FLOAT8_DTYPES and self.d_major != "n":
            bad(f"a {self.d_dtype} D must be row-major (d_major='n'): 8-bit elements are stored by "
                "rows of the epilogue subtile")
        if self.ab_dtype in (*FLOAT8_DTYPES, "float32") and (self.a_major, self.b_major) != ("k", "k"):
            what = "tf32" if self.ab_dtype == "float32" else "8-bit"
            bad(f"{self.ab_dtype} A and B must both be K-major (a_major='k', b_major='k'), got "
                f"a_major={self.a_major!r}, b_major={self.b_major!r}: the H100's {what} wgmma reads "
                "both operands along K")
        if self.a_major not in ("k", "m"):
            bad(f"a_major must be 'k' or 'm', got {self.a_major!r}")
        if self.b_major not in ("k", "n"):
            bad(f"b_major must be 'k' or 'n', got {self.b_major!r}")
        if self.d_major not in ("n", "m"):
            bad(f"d_major must be 'n' or 'm', got {self.d_major!r}")
        if self.tile_n not in TILE_NS:
            bad(f"tile_n must be one of {TILE_NS}, got {self.tile_n}")
        if self.tile_n in TWO_ROW_ONLY_TILE_NS and (self.tile_m != 64 or self.gated
                                                    or self.ab_dtype not in ("float16", "bfloat16")):
            bad(f"tile_n={self.tile_n} runs as a 64-row ping-pong tile of 16-bit a and b, not gated (the "
                f"selector's two rows of tiles at M = 112-128, the only way it is tested); got "
                f"tile_m={self.tile_m}, ab_dtype={self.ab_dtype!r}, gated={self.gated}")
        if self.b_major == "n" and self.tile_n % 64:
            bad(f"tile_n={self.tile_n} needs a K-major B (b_major='k'): an N-major B tile is loaded as "
                f"whole 128-byte swizzled rows of 64 elements along N; use a multiple of 64")
        if tuple(self.cluster) not in CLUSTERS:
            bad(f"cluster must be one of {CLUSTERS}, got {self.cluster}")
        if self.epi_tile_n not in EPI_TILE_NS:
            bad(f"epi_tile_n must be one of {EPI_TILE_NS}, got {self.epi_tile_n}")
        if self.out_tile_n % self.epi_tile_n:
            what = f"half of tile_n={self.tile_n} (gated)" if self.gated else f"tile_n={self.tile_n}"
            bad(f"epi_tile_n={self.epi_tile_n} must divide {what}")
        if self.epi_stages is not None and not 1 <= self.epi_stages <= 16:
            bad(f"epi_stages must be in [1, 16], got {self.epi_stages}")
        if self.load_stages is not None and not 1 <= self.load_stages <= 16:
            bad(f"load_stages must be in [1, 16], got {self.load_stages}")
        if self.ab_stages is not None and not MIN_AB_STAGES <= self.ab_stages <= MAX_AB_STAGES:
            bad(f"ab_stages must be in [{MIN_AB_STAGES}, {MAX_AB_STAGES}], got {self.ab_stages}")
        if self.raster not in ("m", "n"):
            bad(f"raster must be 'm' or 'n', got {self.raster!r}")
        if not 1 <= self.swizzle <= 64:
            bad(f"swizzle must be in [1, 64], got {self.swizzle}")
        if self.schedule not in SCHEDULES:
            bad(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.pdl not in (True, False):
            bad(f"pdl must be True or False, got {self.pdl!r}")
        if self.ab_dtype == "float32" and self.out_tile_n % 32:
            # The DSL aborts the process (not a Python error) building the tiles' TMA for float32 B
            # blocks of 112 or 144 columns; 64, 128, 160, 192 and 256 compile and run.
            bad(f"float32 (tf32) B blocks must be multiples of 32 columns wide, got {self.out_tile_n} "
                f"(tile_n={self.tile_n})")
        if self.gated and self.b_major == "n" and self.out_tile_n * DTYPE_BYTES[self.ab_dtype] % 128:
            bad(f"a gated kernel with an N-major B loads each half of a B tile as whole 128-byte "
                f"swizzled rows: tile_n={self.tile_n} gives halves of {self.out_tile_n} columns, "
                f"not a multiple of {128 // DTYPE_BYTES[self.ab_dtype]}; use tile_n = 128 or 256, or a "
                f"K-major B")
        if self.a_rows is not None:
            per_cta = 8 * self.cluster[1]  # whole 8-row swizzle atoms for each CTA that shares A
            if self.a_rows not in A_ROWS or self.a_rows >= self.tile_m or self.a_rows % per_cta:
                bad(f"a_rows must be None or one of {A_ROWS}, below tile_m={self.tile_m} and a multiple "
                    f"of {per_cta} (8 rows per CTA of the cluster's {self.cluster[1]} that share A's "
                    f"loads), got {self.a_rows!r}")
            if self.a_major != "k":
                bad("a_rows needs a K-major A (a_major='k'): an M-major A's rows are its contiguous "
                    "dimension, loaded as whole 128-byte swizzled rows")
        if self.tile_m not in TILE_MS:
            bad(f"tile_m must be one of {TILE_MS}, got {self.tile_m!r}")
        if self.tile_m != TILE_M and self.schedule != "pingpong":
            bad(f"tile_m={self.tile_m} needs schedule='pingpong' (the cooperative schedule stacks its "
                f"two consumer warpgroups along M, 64 rows each: 128 rows)")
        if self.promotes and self.acc_regs > PROMOTING_ACC_REGS:
            bad(f"promoting float8 partial sums keeps a scratch accumulator beside the tile's: a "
                f"{self.schedule} {self.tile_m} x {self.tile_n} tile needs {self.acc_regs} registers per "
                f"thread for each, more than {PROMOTING_ACC_REGS}; use cooperative 128 x 192 or 128 x 128, "
                "ping-pong 128 x 64 or 64 x 128, or fast_accum=True")
        if self.fast_accum not in (True, False):
            bad(f"fast_accum must be True or False, got {self.fast_accum!r}")
        if self.fast_accum and self.ab_dtype not in FLOAT8_DTYPES:
            bad(f"fast_accum=True is for float8 a and b; {self.ab_dtype} a and b accumulate in full "
                "float32 already")
        if self.block_scales:
            self._check_block_scales(bad)
        acc_regs = self.acc_regs
        if self.schedule == "pingpong" and acc_regs > PINGPONG_ACC_REGS:
            bad(f"schedule='pingpong' computes a {self.tile_m} x tile_n tile per consumer warpgroup: "
                f"tile_n={self.tile_n} needs {acc_regs} accumulator registers per thread, too many with "
                f"the epilogue's (at most {PINGPONG_ACC_REGS}: tile_n <= "
                f"{PINGPONG_ACC_REGS * 128 // self.tile_m})")
        return self

    def _check_block_scales(self, bad) -> None:
        if self.block_scales not in BLOCK_SCALE_ROWS:
            bad(f"block_scales must be 0 or one of {BLOCK_SCALE_ROWS} (rows of A per scale), got "
                f"{self.block_scales!r}")
        if self.ab_dtype not in FLOAT8_DTYPES:
            bad(f"block scales scale float8 a and b, not {self.ab_dtype}")
        if self.fast_accum:
            bad("block scales are applied as each K tile's products are promoted into the float32 "
                "accumulator: fast_accum=True (no promotion) cannot apply them")
        if self.tile_k != SCALE_BLOCK:
            bad(f"block scales apply one scale per {SCALE_BLOCK} elements of K, one K tile of the "
                f"mainloop: tile_k is {self.tile_k}")
        if self.gated and self.out_tile_n % GATED_SCALE_CHUNK:
            bad(f"block scales with a gated B need halves of a multiple of {GATED_SCALE_CHUNK} columns (each "
                f"{GATED_SCALE_CHUNK}-column chunk of a half in one 128-row block of the weight), got "
                f"tile_n={self.tile_n}")
        if not self.gated and self.tile_n % 64:
            bad(f"block scales need tiles of a multiple of 64 columns (each 64-column chunk of a tile in "
                f"one 128-column block of B), got tile_n={self.tile_n}")

    @property
    def scale_chunk(self) -> int:
        """Block scales: columns of a tile that share B's scale (each lies in one 128-column block
        of B). A plain tile starts on a multiple of gcd(tile_n, 128), so chunks of that size do. A
        gated tile's up half starts N/2 columns into B, which need not be a multiple of 128: its
        chunks are :data:`GATED_SCALE_CHUNK` columns, and calls need N/2 to be a multiple of that."""
        return GATED_SCALE_CHUNK if self.gated else math.gcd(self.tile_n, SCALE_BLOCK)

    @property
    def b_scale_chunks(self) -> int:
        """Block scales: the tile's column chunks (:attr:`scale_chunk` columns each, both halves of
        a gated tile), each with one B scale per K tile; 0 without block scales."""
        return self.tile_n // self.scale_chunk if self.block_scales else 0

    def replace(self, **changes) -> GemmConfig:
        return dataclasses.replace(self, **changes).validate()

    def short_name(self) -> str:
        """A compact, readable identifier (bench tables, test ids)."""
        ab = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float8_e4m3fn": "e4m3",
              "float8_e5m2": "e5m2"}
        inputs = ab[self.ab_dtype] if self.b_element == self.ab_dtype else \
            f"{ab[self.ab_dtype]}x{ab[self.b_element]}"
        name = (
            f"{inputs}{' fast' if self.fast_accum and self.ab_dtype in FLOAT8_DTYPES else ''}"
            f"->{ab[self.d_dtype]} A{self.a_major}B{self.b_major}D{self.d_major} "
            f"{self.tile_m}x{self.tile_n} c{self.cluster[0]}x{self.cluster[1]} "
            f"epi{self.tile_m}x{self.epi_tile_n}"
        )
        name = name + " gated" if self.gated else name
        name = name if self.store_d else name + " no-D"
        name = name + " split-k" if self.split_k else name
        name = name + f" a{self.a_rows}" if self.a_rows is not None else name
        name = name + f" d{self.epi_stages}" if self.epi_stages is not None else name
        name = name + " pdl" if self.pdl else name
        name = name + f" blockscaled{self.block_scales}x128" if self.block_scales else name
        return name + " pingpong" if self.schedule == "pingpong" else name
