"""Which kernel configuration and split count a call runs with, chosen per problem size (pure Python).

A kernel compiled without tile, schedule or cluster knobs carries a family of configurations that
fit its epilogue (:func:`tile_family`, planned once at compile time). Each call picks one by the
problem's size class, and never compiles anything for a new M beyond the first use of a
configuration. The rules are fitted to a sweep on the H100 (``bench/sweep_configs.py``, recorded in
docs/performance.md, "A launch per problem size"):

* **Enough tiles** (128 x 128 tiles fill at least :data:`FILL` of the SMs): 128 x 128 ping-pong, or
  128 x 256 cooperative where K is long (at least :data:`LONG_K`): there the epilogue's overlap is
  worth little and the wider tile halves the A traffic per FLOP (16384 x 8192 x 28672: 1.03x
  cuBLAS against 0.90x); else, for a light epilogue, a ping-pong tile 176 or 192 wide where its
  rounds of tiles cost less (:data:`WIDE_PINGPONG_WIDTHS`, :func:`_pingpong_width`: 512 x 28672 x
  4096, 0.98x against 0.90x); else the cooperative 128 x 256 where there are at least
  :data:`MANY_WAVES` waves of 128 x 128 tiles (LM heads: 4096 x 128256 x 4096, 1.01x against 0.90x)
  or for large 16-bit weights with K of 8192 or more at M >= 512 (:data:`BIG_WEIGHT_ELEMENTS`:
  2048 x 57344 x 8192, 0.95-1.00x against 0.92-0.96x).
* **One wave or just over** (128 x 128 tiles at most one per SM, or a few more): cooperative 128 x
  128, whose two consumer warpgroups share the CTA's one tile (a ping-pong CTA would leave one
  idle: 256 x 8192 x 8192, 0.96x cuBLAS against 0.89x), or cooperative 128 x 192 where its tiles
  fit one wave that 128 x 128 tiles overflow (512 x 6144 x 4096: 0.95x against 0.75x).
* **Few tiles** (decode, small MoE batches): the largest tile whose count still fills
  :data:`FILL` of the SMs, else the smallest; 64-row tiles where M <= 64 (no MMA on padding rows),
  with 16-bit a and b none wider than :data:`DECODE_MAX_TILE_N` (128) columns of B.
  A 128-row tile that leaves one tile per CTA runs cooperative (256 x 4096 x 4096 in 128 x 64
  tiles: 0.91x cuBLAS against 0.88x ping-pong in the same 2x1 clusters).
  On the H100, 64 x 64 tiles at M = 64, N = K = 4096 ran 1.3x faster than 128 x 128 ones with the
  best split count. A tile whose count spills a thin second round gives way to a larger one that
  fits one round (:func:`_without_a_thin_last_round`).
* **Then split K** while the units fit in one wave and every split keeps enough K tiles
  (:func:`evtc.plan.split_k.choose_splits`), and only where a model of the launch says it pays
  (:func:`evtc.plan.split_k.modelled_splits`): each split costs a round trip of the accumulator
  through memory, which only a K loop far longer than HBM needs for the whole problem repays.
  Past one wave, only a thin last round is split (:func:`evtc.plan.split_k.choose_tail_splits`).
* **Then the epilogue's buffers.** A cooperative launch that runs at most one tile per CTA,
  unsplit, takes its tile's one-wave twin where the family has one (:func:`one_wave_twins`): D (and
  a C that held it) staged shallower, and one more A/B stage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from evtc.plan.clusters import ceil_div, cluster_costs, cluster_for_problem
from evtc.plan.config import A_ROWS, FLOAT8_DTYPES, TWO_ROW_ONLY_TILE_NS, ConfigError, GemmConfig
from evtc.plan.split_k import (
    HBM_BYTES_PER_US,
    choose_splits,
    choose_tail_splits,
    cta_tile_grid,
    modelled_splits,
    splits_within_k,
)

# A tile shape is chosen if its tiles fill at least this share of the SMs (fitted: 0.7 picks the
# measured best or one within 3% on 30 of 36 decode and prefill shapes).
FILL = 0.7
# K (elements) from which the cooperative 128 x 256 tile beats ping-pong 128 x 128 on problems with
# a wave of tiles or more.
LONG_K = 16384
# Waves of 128 x 128 tiles from which the cooperative 128 x 256 tile runs instead, whatever K: LM
# heads and the largest prefill layers, several milliseconds of steady load each. Fitted on the H100
# (docs/performance.md): 4096 x 128256 x 4096 (243 waves) ran 1.01x cuBLAS against 0.90x, and
# 2048 x 128256 x 4096 (121 waves) 1.00x against 0.93x; 4096 x 49152 x 4096 (93 waves) was a tie
# and below that 128 x 128 ping-pong was as fast or faster (1024 x 128256 x 4096, 61 waves: 1.04x
# against 1.01x). We read it as power: the wider tile moves a quarter fewer bytes from L2 per
# FLOP, and at the H100's power limit a long run at lower power keeps higher clocks.
MANY_WAVES = 90
# Large 16-bit weights with long K loops: where K is at least BIG_WEIGHT_K, B holds at least
# BIG_WEIGHT_ELEMENTS (N x K, the GEMM's N: both halves of a gated weight) and M is at least
# BIG_WEIGHT_MIN_M (the range measured), the cooperative 128 x 256 tile runs whatever the waves.
# Fitted on the H100 (docs/performance.md, "Wide tiles for large weights"), cuBLAS / evtc, four
# runs: Llama-3 70B's gate/up weight (57344 x 8192) at M = 2048 ran 0.95-1.00x in 128 x 256 tiles
# against 0.92-0.96x in ping-pong 128 x 128, at M = 3072 1.00-1.04x against 0.92-0.93x, at M = 512
# and 1024 within 1-2% either way; half that weight, whether N (28672 x 8192) or K (57344 x 4096)
# is halved, ran as fast or faster in 128 x 128 (2048 x 57344 x 4096: 1.02-1.03x against 0.99x), as
# did 8192 x 10240 x 8192 (1.04x against 1.00-1.02x).
BIG_WEIGHT_K = 8192
BIG_WEIGHT_ELEMENTS = 1 << 28
BIG_WEIGHT_MIN_M = 512
# Tiles an epilogue moves besides D (tile operands it reads, extra full-tile outputs it writes)
# from which it runs on the cooperative 128 x 256 tile whenever that still fills the GPU. Measured
# on the H100 (docs/performance.md, bench/heavy_epilogue.py): with 3 such tiles (two tile operands
# and a second output) the cooperative 128 x 256 tile ran 1.30-1.36x faster than ping-pong
# 128 x 128 on six shapes from 2048 x 14336 x 4096 to 8192 x 4096 x 14336 (0.84-0.97x the bare
# cuBLAS GEMM against 0.62-0.73x); with one, the two tied within 2%. Two were not measured.
HEAVY_EPILOGUE_TILES = 3
# The fastest memory (bytes per us) the rule above applies on: the H100's, where it was fitted. On
# the H200 (3.5 TB/s) the kernel of 2026-11-28 ran those epilogues faster on the ping-pong 128 x 128
# tile than on the cooperative 128 x 256 on 9 of 10 rows (bench/heavy_epilogue.py, two epilogues
# that move 3 tiles on five shapes: 0.89-1.03x the bare cuBLAS GEMM against 0.97-1.04x;
# docs/performance.md, "Heavy epilogues on the H200"), so there they keep the ping-pong tile (below).
HEAVY_EPILOGUE_MAX_HBM_BYTES_PER_US = HBM_BYTES_PER_US
# Past that rate, the ping-pong tile only where the cooperative 128 x 256 tiles make at least this
# many waves (the rows measured made 6.8 to 27; fewer stay on the rule above, unmeasured), and K is
# below HEAVY_PINGPONG_MAX_K: at K = 4096 ping-pong won in two runs, at K = 14336 (8192 x 4096) it
# won one run and lost the other by 6% (docs/performance.md, "Heavy epilogues on the H200").
HEAVY_PINGPONG_MIN_WAVES = 6
HEAVY_PINGPONG_MAX_K = 8192
# Ping-pong tiles wider than 128 columns, for problems of many tiles (more than WAVE_FIT_MAX_WAVES
# waves of 128 x 128) with a light epilogue (:func:`light_epilogue`): chosen by the rounds of tiles
# each CTA runs, as :func:`_wave_fitted` chooses cooperative widths (:func:`_pingpong_width`). Each
# warpgroup's tile reads A and B once per 128 x W outputs instead of 128 x 128, which the tensor
# cores feel at these sizes: cuBLAS runs 128 x 176 ping-pong at 512 x 28672 x 4096 (nvjet
# 176x128_64x5, its M and N the other way round). They run with 16-column subtiles (the epilogue's
# registers, see evtc.plan.config.PINGPONG_ACC_REGS) and 2 D buffers, which buy a fifth A/B stage.
WIDE_PINGPONG_WIDTHS = (176, 192)
# a and b dtypes the rules for large 16-bit weights and the wide ping-pong tiles were measured with.
SIXTEEN_BIT = ("float16", "bfloat16")
# The widest 64-row tile (B's columns, both halves of a gated one) a 16-bit launch with M <= 64 takes
# by the few-tiles rule. Measured on the H200 (docs/performance.md, "Decode tiles 128 wide"),
# bench/decode_launches.py, cuBLAS / evtc: 64 x 128 beat 64 x 256 on every weight wide enough for
# both to fill the GPU, identity and SwiGLU, M = 1-64 (1 x 28672 x 4096 0.972 against 0.947,
# 1 x 37888 x 3584 1.046 against 0.957, 1 x 128256 x 4096 1.019 against 0.994; SwiGLU 1 x 14336 x
# 4096 0.976 against 0.944, 64 x 14336 x 4096 1.062 against 1.024).
DECODE_MAX_TILE_N = 128
# A wider ping-pong tile must cost (rounds x (width + WAVE_FIT_ROUND_COST)) below this share of
# 128 x 128's: the model overstates the gain at many rounds (4096 x 37888 x 3584: 4% modelled, 1%
# measured), and a tie went to 128 (4096 x 4096 x 4096: 1.03-1.05x cuBLAS in 128 x 128 against
# 0.99-1.01x in 128 x 176).
WIDE_PINGPONG_MAX_COST = 0.98
# What makes an epilogue light enough for the wide ping-pong tiles: no reductions, one output, and
# at most this many tile operands (a residual's C). With 16-column subtiles, ptxas spilled nothing
# for identity, bias, a residual, bias + GELU, relu(alpha acc + beta C + bias), a float8 output
# or SwiGLU with a bias, and nothing in 25 of 28 compiles of 18 random epilogues of the fuzzer
# (seed 3100, both widths where they fit); a second output spilled 80 bytes in 128 x 176 (case 91),
# which rules those out, and a chain of ten elementwise ops 12 bytes in 128 x 192 (case 88).
WIDE_PINGPONG_MAX_EPILOGUE_TILES = 1
# An epilogue that moves a tile takes them only from this K: the DeepSeek-V3 expert down projection
# with a residual (N = 7168, K = 2048) ran 2-4% slower in 128 x 176 than in 128 x 128 at M = 2048,
# 4096 and 16384, both dtypes, two runs each; Llama-3 70B's o_proj with one (K = 8192) 5-7% faster.
WIDE_PINGPONG_MIN_K_WITH_TILES = 4096
# A promoting float8 kernel (GemmConfig.promotes; compiled with the cooperative 128 x 192 tile) runs
# problems of many tiles in cooperative 128 x 128 tiles, whose scratch accumulators take turns
# (GemmConfig.promotes_in_pairs), except for very many waves (MANY_WAVES) and for long K loops
# (LONG_K) past this many waves of 128 x 128 tiles. Measured on the H100 against cuBLASLt
# (docs/performance.md, "float8: small promoting tiles"), 24 LLM layers at M = 2048 and 8192:
# 128 x 128 in 1x2 clusters 1.00x in geomean against 0.96x for 128 x 192 (2048 x 4096 x 14336: 1.02x
# against 0.89x); 128 x 192 kept its lead at 8192 x 57344 x 8192 (217 waves: 1.04x against 0.92x),
# 8192 x 8192 x 28672 (31 waves, 0.99x against 0.76x) and 8192 x 3584 x 18944 (14 waves, 1.02x
# against 0.97x), where 2048 x 8192 x 28672 (8 waves) ran 0.98x against 0.95x.
# Block-scaled kernels with 1 x 128 blocks of A (GemmConfig.stages_a_scales), since both tiles
# read their scales from the stage, run 128 x 128 in pairs (1x2 clusters past four rows of tiles)
# at any number of waves and K, 128 x 192 only where the wave fit (BLOCK_SCALED_WIDE_SPEED) picks
# it (docs/performance.md, "B's block scales with the stage too": pinned, 128 x 128 in 1x2 clusters
# 1.04x torch's blockwise GEMM over 42 rows of M = 512-2048 and 1.05x over 14 of M = 8192, worst
# 0.97x, against 0.86x and 0.96x for 128 x 192; at M = 8192 it won the MANY_WAVES and LONG_K rows
# too, 8192 x 3584 x 18944 1.04x against 0.90x). Those with 128 x 128 blocks of A read both
# operands' scales from global memory after the wgmma's issue, were not measured again, and keep
# the earlier rule: 128 x 128 in pairs in 2x1 clusters up to WAVE_FIT_MAX_WAVES, 128 x 192 past it
# ("Block scales in pairs").
PROMOTING_LONG_K_WAVES = 10
# Rows up to which a launch that trims A's loads takes the trimmed cluster costs
# (evtc.plan.clusters.TRIMMED_A_CLUSTER_COST, measured at M = 1-32).
TRIMMED_A_COST_MAX_M = 32
# Two rows of 64-row tiles (:func:`_two_row_tile`): problems of TWO_ROW_MIN_M to 128 rows with
# 16-bit K-major a and b (nn.Linear's layouts, the ones measured) and K from TWO_ROW_MIN_K to below
# LONG_K run ping-pong 64-row tiles, multicasting each weight tile to both rows (2x1 clusters), of
# the narrowest of TWO_ROW_WIDTHS that makes one wave. Measured
# on the H200 against the cooperative 128-row tiles the few-tiles rule took (docs/performance.md,
# "Two rows of 64-row tiles at M = 128"), cuBLAS time over ours at M = 128: 4608 x 3584 0.96x in
# 64 x 80 against 0.86x in 128 x 64; 5120 x 5120 0.98x against 0.88x; 6144 x 4096 0.95x (64 x 96)
# against 0.92x; 8192 x 8192 0.96x (64 x 128) against 0.91x; 8192 x 28672 1.00x against 0.96x;
# 10240 x 8192 0.97x (64 x 160) against 0.93x (128 x 128). At K = 2048 the cooperative tile stayed
# ahead (7168 x 2048: 0.92x against 0.90x). K from LONG_K keeps the earlier launch, unresolved: at
# 128 x 8192 x 28672 a residual ran 0.94-0.98x addmm in 64 x 128 tiles, 0.98x and (another day)
# 1.10x in cooperative 128 x 64 ones, where the identity ran 1.00x against 0.96x. Below M = 112
# the second row's tiles load too many rows past M (the TMA unit spends as long on them as on
# data): at M = 96, 4608 x 3584 ran 0.78x in 64 x 80 against 0.86x in cooperative 128 x 64 tiles
# in 1x4 clusters.
TWO_ROW_MIN_M = 112
TWO_ROW_MIN_K = 3072
TWO_ROW_WIDTHS = (64, 80, 96, 128, 160)
# The family's tiles that only _two_row_tile takes (the other rules were fitted without them): the
# widths that exist for it alone (TWO_ROW_ONLY_TILE_NS), and ping-pong 64 x 160.
TWO_ROW_ONLY = frozenset({("pingpong", 64, width) for width in (*TWO_ROW_ONLY_TILE_NS, 160)})
# Tile shapes a kernel that chooses its tiles may use: (schedule, tile_m, tile_n), largest first.
FAMILY = (
    ("pingpong", 128, 128),
    ("pingpong", 64, 256),
    ("pingpong", 128, 64),
    ("pingpong", 64, 160),
    ("pingpong", 64, 128),
    ("pingpong", 64, 96),
    ("pingpong", 64, 80),
    ("pingpong", 64, 64),
    ("cooperative", 128, 256),
    ("cooperative", 128, 192),
    ("cooperative", 128, 128),
    ("cooperative", 128, 64),
    ("cooperative", 128, 112),
    ("cooperative", 128, 144),
    ("cooperative", 128, 160),
)
# The epilogue buffers of a cooperative tile's one-wave twin (:func:`one_wave_twins`), as
# (load_stages, epi_stages), None keeping the tile's own: the first that buys an A/B stage. D is
# staged for the whole tile so that its stores drain during the next tile's mainloop, and a C that
# holds D is staged whole to land during it; a CTA with one tile has no next tile, and the shared
# memory buys an A/B stage instead where it is enough for one. Measured on the H100
# (docs/performance.md, "One tile per CTA"), against cuBLAS at M = 512, identity: 512 x 3584 x
# 18944 in 128 x 112 tiles 0.92x with 6 A/B stages and D in 7 buffers, 0.97x with 7 and 2;
# 512 x 4608 x 3584 in 128 x 144 0.94x (5 A/B stages) against 0.97x (6); 512 x 6144 x 4096 in
# 128 x 192 0.98x (4) against 0.99x (5). Against addmm, a bf16 residual (C staged whole, holding
# D): 512 x 3584 x 14336 in 128 x 112 0.89x against 0.99x with C in 2 stages and D in 1; 512 x 6144
# x 4096-14336 in 128 x 192 +1.4% to +3%; with C staged whole at K = 3584 two runs differed by 6%
# either way. With several tiles per CTA the same swap moved by -3% to +6%, so it is kept to one
# wave.
ONE_WAVE_PLANS = ((None, 2), (3, 2), (3, 1), (2, 2), (2, 1))
# K from which a twin that stages the epilogue's loads shallower runs: a C staged whole lands during
# the mainloop, which matters more the shorter it is. Measured (bf16 residual, twin against C
# staged whole): K = 14336-18944 +2% to +11%; 4096-8192 0% to +3%; 2048-3584 -6.5% to +2.4%.
ONE_WAVE_LOADS_MIN_K = 4096
# Widths of 128-row cooperative tiles compared by :func:`_wave_fitted` (those in the family).
WAVE_FIT_WIDTHS = (112, 128, 144, 160, 192, 256)
# What a round of tiles costs besides its columns, in columns: the pipeline's fill and the epilogue,
# which a cooperative CTA does not overlap with its next tile. Fitted on the H100 between 8 and 32
# (docs/performance.md, "Cluster shapes by rows of tiles"): 1536 x 6144 x 4096 ran 1.00x cuBLAS in
# three rounds of 128 x 192 against 0.91x in five of 128 x 112, and 2048 x 3584 x 3584 1.09x in four
# rounds of 128 x 112 against 1.06x in three of 128 x 160. It also gives the ties of one round of
# 256 columns against two of 128 to 256 (512 x 8192 x 28672: 1.00x against 0.96x).
WAVE_FIT_ROUND_COST = 16
# Up to this many waves of 128 x 128 tiles, a part-filled last round costs enough to choose the tile
# width by it; beyond, the rounds are many and the compiled tile (or 128 x 256) runs.
WAVE_FIT_MAX_WAVES = 5
# How fast per column a block-scaled tile with one scratch accumulator (128 x 192) runs against
# the 128 x 128 tile in pairs, for :func:`_wave_fitted`. Fitted on the H100 with both tiles reading
# A's and B's scales from the stage (docs/performance.md, "B's block scales with the stage too"):
# over 14 LLM layers at M = 512, 1024 and 2048 any factor from 0.88 to 0.95 makes the model pick
# the faster of the two on all 42 rows (1.0 misses three: 1024 x 6144 x 4096 ran 1.08x torch's
# blockwise GEMM in three rounds of 128 x 128 against 1.02x in two of 128 x 192); 128 x 192 still
# wins where it makes whole rounds (512 x 4608 x 3584: one round, 1.26x against 1.21x).
BLOCK_SCALED_WIDE_SPEED = 0.9


def light_epilogue(epilogue_tiles: int, outputs: int, reductions: int) -> bool:
    """Whether an epilogue leaves a consumer warpgroup registers for a wide ping-pong tile's
    accumulator (:data:`WIDE_PINGPONG_WIDTHS`): no reductions, one output, and at most
    :data:`WIDE_PINGPONG_MAX_EPILOGUE_TILES` tiles moved besides D (``KernelPlan.epilogue_tiles``:
    with one output, its tile operands)."""
    return reductions == 0 and outputs == 1 and epilogue_tiles <= WIDE_PINGPONG_MAX_EPILOGUE_TILES


def tile_family(base: GemmConfig, fit: Callable[[dict], GemmConfig | None], *,
                wide_pingpong: bool = False) -> tuple[GemmConfig, ...]:
    """The configurations of :data:`FAMILY` that fit the epilogue: ``fit(knobs)`` plans one (its
    epilogue loads and shared memory) or returns None where it does not fit. ``base`` (the
    configuration the kernel was compiled with) is always first. With ``wide_pingpong`` (a ping-pong
    128 x 128 base with 16-bit a and b, and a :func:`light_epilogue`), also the ping-pong tiles of
    :data:`WIDE_PINGPONG_WIDTHS`."""
    family = [base]
    shapes = [(shape, {}) for shape in FAMILY]
    if (wide_pingpong and (base.schedule, base.tile_m, base.tile_n) == ("pingpong", 128, 128)
            and base.ab_dtype in SIXTEEN_BIT):
        shapes += [(("pingpong", 128, width), {"epi_tile_n": 16, "epi_stages": 2})
                   for width in WIDE_PINGPONG_WIDTHS]
    for (schedule, tile_m, tile_n), extra in shapes:
        if (base.schedule, base.tile_m, base.tile_n) == (schedule, tile_m, tile_n):
            continue
        costs = cluster_costs(schedule, tile_m, tile_n)
        cluster = min(costs, key=costs.get)
        config = fit({"schedule": schedule, "tile_m": tile_m, "tile_n": tile_n, "cluster": cluster, **extra})
        if config is not None and config not in family:
            family.append(config)
    return tuple(family)


def _is_wide_pingpong(config: GemmConfig) -> bool:
    return config.schedule == "pingpong" and config.tile_m == 128 and config.tile_n in WIDE_PINGPONG_WIDTHS


def one_wave_twins(family: Sequence[GemmConfig], ab_stages_of: Callable[[GemmConfig], int],
                   holds_d_in_loads: Callable[[GemmConfig], bool], *,
                   loads_pinned: bool = False) -> tuple[GemmConfig, ...]:
    """For each cooperative configuration of ``family`` that stages D (or the C holding it) deeper
    than a CTA with one tile needs, its one-wave twin (see :func:`choose_launch`): the first plan of
    :data:`ONE_WAVE_PLANS` that gives it more A/B stages. ``ab_stages_of(config)``: the A/B stages
    the kernel of ``config`` gets with this epilogue (:func:`evtc.plan.smem.ab_stages_of`);
    ``holds_d_in_loads(config)``: whether it writes D into a C's load buffers
    (:func:`evtc.plan.smem.holds_d_in_loads`), the only staged loads a twin cuts (what was
    measured), and never where the user pinned ``load_stages`` (``loads_pinned``). The twins go
    after the family, so that a tile shape finds its own configuration first."""
    twins = []
    for config in family:
        if config.schedule != "cooperative" or config.epi_stages is not None or not config.store_d:
            continue
        stages = ab_stages_of(config)
        cuts_loads = not loads_pinned and config.load_stages is not None and holds_d_in_loads(config)
        for load_stages, epi_stages in ONE_WAVE_PLANS:
            if load_stages is not None and (not cuts_loads or load_stages >= config.load_stages):
                continue
            try:
                twin = config.replace(epi_stages=epi_stages,
                                      load_stages=config.load_stages if load_stages is None else load_stages)
                gains = ab_stages_of(twin) > stages
            except ConfigError:  # D's own buffers may not fit where C's held it: no twin of this plan
                continue
            if gains:
                if twin not in family and twin not in twins:
                    twins.append(twin)
                break
    return tuple(twins)


def is_one_wave_twin(config: GemmConfig, compiled: GemmConfig) -> bool:
    """Whether ``config``, of the family of a kernel compiled with ``compiled``, is a one-wave twin
    (:func:`one_wave_twins`): a cooperative tile that pins the D buffers its family's tiles leave to
    the planner (a wide ping-pong tile pins them too, and is no twin)."""
    return config.schedule == "cooperative" and config.epi_stages is not None and compiled.epi_stages is None


def _one_wave_twin(config: GemmConfig, family: Sequence[GemmConfig], k: int) -> GemmConfig:
    """``config`` with its one-wave twin's epilogue buffers, where ``family`` has that twin (one
    that stages the loads shallower only from :data:`ONE_WAVE_LOADS_MIN_K`)."""
    if config.epi_stages is not None:
        return config
    for twin in family:
        if twin.epi_stages is not None and twin.replace(
                cluster=config.cluster, a_rows=config.a_rows, split_k=config.split_k,
                load_stages=config.load_stages, epi_stages=None) == config:
            if twin.load_stages != config.load_stages and k < ONE_WAVE_LOADS_MIN_K:
                return config
            return config.replace(load_stages=twin.load_stages, epi_stages=twin.epi_stages)
    return config


def family_digest(family: Sequence[GemmConfig], chooses_cluster: bool) -> str:
    """8 hex digits naming a family and whether the cluster is chosen per call."""
    import dataclasses
    import hashlib
    import json

    text = json.dumps([[dataclasses.asdict(c) for c in family], chooses_cluster], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def _tiles(m: int, n: int, batches: int, config: GemmConfig) -> int:
    return ceil_div(m, config.tile_m) * ceil_div(n, config.out_tile_n) * batches


def choose_tile(m: int, n: int, k: int, batches: int, family: Sequence[GemmConfig], slots: int,
                epilogue_tiles: int = 0, *, heavy_rule: bool = True) -> GemmConfig:
    """The configuration of ``family`` (see :func:`tile_family`) for an (L, M, N, K) problem on a
    GPU that runs ``slots`` CTAs at once, for an epilogue that moves ``epilogue_tiles`` tiles
    besides D (see :data:`HEAVY_EPILOGUE_TILES`, applied where ``heavy_rule``)."""

    def find(schedule: str, tile_m: int, tile_n: int) -> GemmConfig | None:
        for config in family:
            if (config.schedule, config.tile_m, config.tile_n) == (schedule, tile_m, tile_n):
                return config
        return None

    chosen = _tile_by_count(m, n, k, batches, family, slots, find, epilogue_tiles, heavy_rule)
    if (chosen.schedule == "pingpong" and chosen.tile_m == 128
            and _tiles(m, n, batches, chosen) <= slots):
        # One tile per CTA: a ping-pong CTA would keep one of its two consumer warpgroups idle;
        # the cooperative schedule shares the tile between both.
        chosen = find("cooperative", 128, chosen.tile_n) or chosen
    return chosen


def _tile_by_count(m: int, n: int, k: int, batches: int, family: Sequence[GemmConfig], slots: int,
                   find: Callable[[str, int, int], GemmConfig | None], epilogue_tiles: int = 0,
                   heavy_rule: bool = True) -> GemmConfig:
    """The tile shape of :func:`choose_tile`, chosen by how many tiles the problem has."""
    heavy = epilogue_tiles >= HEAVY_EPILOGUE_TILES
    base = family[0]
    # The wide ping-pong tiles serve problems of many tiles only (_pingpong_width), the two-row
    # widths two rows of 64-row tiles only (_two_row_tile).
    shapes = [c for c in family if c.schedule == "pingpong" and not _is_wide_pingpong(c)
              and (c.schedule, c.tile_m, c.tile_n) not in TWO_ROW_ONLY] or [base]
    # The rules count 128 x 128 tiles, as they were fitted. A kernel compiled with a cooperative
    # tile (a promoting float8 kernel compiles 128 x 192) counts its family's cooperative 128 x 128:
    # counted in its own wider tiles, 512 x 3584 x 18944 in float8 fell to the few-tiles rule and
    # ran ping-pong 128 x 64 at 0.53x cuBLAS (docs/performance.md, "One tile per CTA").
    square = base if base.schedule == "pingpong" else (find("cooperative", 128, 128) or base)
    tiles = _tiles(m, n, batches, square)
    if m <= 64 and any(c.tile_m == 64 for c in shapes):
        # 128-row tiles would multiply padding rows: only 64-row ones.
        shapes = [c for c in shapes if c.tile_m == 64]
    elif tiles >= FILL * slots:
        wide = find("cooperative", 128, 256)
        if heavy and wide is not None and _tiles(m, n, batches, wide) >= slots:
            # An epilogue that moves several tiles: on the H100 two consumer warpgroups sharing its
            # stores and loads over a tile twice as wide beat ping-pong, which serialises them with
            # the mainloop; on faster memory, over many waves, the ping-pong tile wins
            # (HEAVY_EPILOGUE_MAX_HBM_BYTES_PER_US).
            if (heavy_rule or _tiles(m, n, batches, wide) < HEAVY_PINGPONG_MIN_WAVES * slots
                    or k >= HEAVY_PINGPONG_MAX_K):
                return wide
            if (base.schedule, base.tile_m) == ("pingpong", 128):
                return base
        fitted = _wave_fitted(m, n, batches, slots, find) if tiles <= WAVE_FIT_MAX_WAVES * slots else None
        if fitted is not None:
            return fitted
        if tiles <= slots:
            return square  # one wave: cooperative (choose_tile runs a ping-pong base cooperative)
        if base.schedule == "pingpong":
            # Just over a wave: a second round of a few tiles costs as much as the first. Tiles
            # 1.5x as wide may fit the problem in one round that still fills the GPU.
            wider = find("cooperative", base.tile_m, base.tile_n * 3 // 2)
            if wider is not None and FILL * slots <= _tiles(m, n, batches, wider) <= slots:
                return wider
        # Enough tiles: the configured one (whatever its schedule), or the cooperative 128 x 256 one
        # for long K loops; else a wide ping-pong tile where its rounds cost less (light epilogues
        # only); else 128 x 256 for very many tiles and for large weights.
        gemm_n = n * base.tile_n // base.out_tile_n  # a gated B has both halves
        big_weight = (k >= BIG_WEIGHT_K and gemm_n * k >= BIG_WEIGHT_ELEMENTS and m >= BIG_WEIGHT_MIN_M
                      and base.ab_dtype in SIXTEEN_BIT)
        wide_fills = wide is not None and _tiles(m, n, batches, wide) >= slots
        if k >= LONG_K and wide_fills:
            return wide
        if tiles > WAVE_FIT_MAX_WAVES * slots and not (epilogue_tiles and k < WIDE_PINGPONG_MIN_K_WITH_TILES):
            wider = _pingpong_width(m, n, batches, slots, base, family)  # base where none is wider
            if wider is not base:
                return wider
        if (tiles >= MANY_WAVES * slots or big_weight) and wide_fills:
            return wide
        long_k_waves = k >= LONG_K and tiles > PROMOTING_LONG_K_WAVES * slots
        if square.stages_a_scales:  # 1 x 128 block scales: in pairs at any waves and K
            pairs = True
        elif square.block_scales:  # 128 x 128 blocks of A, read from global memory: up to five waves
            pairs = tiles <= WAVE_FIT_MAX_WAVES * slots
        else:
            pairs = tiles < MANY_WAVES * slots and not long_k_waves
        if square.promotes_in_pairs and square is not base and pairs:
            return square
        return base
    two_rows = _two_row_tile(m, n, k, batches, base, slots, find)
    if two_rows is not None:
        return two_rows
    # Few tiles: the largest tile that still fills the GPU, counting only the rows and columns the
    # problem has (a tile wider than N is no larger for it); equal areas: 128 rows, then the
    # smaller tile. Else the smallest.

    def useful(c: GemmConfig) -> float:
        # Rows and columns the problem has, times the share of the computed rows that are not
        # padding (M = 192: 128-row tiles compute 256 rows, 64-row ones 192).
        rows = -(-m // 64) * 64
        return (min(c.tile_m, rows) * min(c.out_tile_n, -(-n // 64) * 64)
                * rows / (-(-rows // c.tile_m) * c.tile_m))

    def order(configs: Sequence[GemmConfig]) -> list[GemmConfig]:
        return sorted(configs, key=lambda c: (-useful(c), c.tile_m == 64, c.tile_m * c.tile_n))

    ordered = order(shapes)
    # At M <= 64 a 16-bit launch streams its weight in tiles at most DECODE_MAX_TILE_N wide (the
    # wider ones stay for a thin last round, below).
    narrow = [c for c in ordered if not (m <= 64 and c.tile_m == 64 and c.tile_n > DECODE_MAX_TILE_N
                                         and c.ab_dtype in SIXTEEN_BIT)] or ordered
    chosen = next((c for c in narrow if _tiles(m, n, batches, c) >= FILL * slots), narrow[-1])
    # A thin last round may also give way to the cooperative 128 x 128 tile of a float8 family
    # compiled cooperative, whose ping-pong shapes stop at 128 x 64: at 256 x 4608 x 3584 its 144
    # ping-pong 128 x 64 tiles ran 0.66x torch's blockwise GEMM, 72 cooperative 128 x 128 ones 0.90x.
    # (Not measured for 16-bit families compiled cooperative, e.g. for many float32 outputs.)
    float8_cooperative = (base.ab_dtype in FLOAT8_DTYPES and base.schedule == "cooperative"
                          and square not in shapes and m > 64)
    larger = order([*shapes, square]) if float8_cooperative else ordered
    return _without_a_thin_last_round(chosen, larger, m, n, batches, slots)


def _two_row_tile(m: int, n: int, k: int, batches: int, base: GemmConfig, slots: int,
                  find: Callable[[str, int, int], GemmConfig | None]) -> GemmConfig | None:
    """The family's ping-pong 64-row tile (``find``; ``base``: the compiled configuration) of the
    narrowest of :data:`TWO_ROW_WIDTHS` whose tiles make one wave, for a problem of
    :data:`TWO_ROW_MIN_M` to 128 rows (two rows of tiles) with 16-bit K-major a and b, not gated,
    and K from :data:`TWO_ROW_MIN_K` to below :data:`LONG_K`; None otherwise (or where no width
    makes one wave). Its cluster (2x1: each weight tile multicast to
    both rows) comes from the cluster costs."""
    if not (TWO_ROW_MIN_M <= m <= 128 and TWO_ROW_MIN_K <= k < LONG_K and base.ab_dtype in SIXTEEN_BIT
            and not base.gated and base.a_major == "k" and base.b_major == "k"):
        return None
    for width in TWO_ROW_WIDTHS:
        config = find("pingpong", 64, width)
        if config is not None and _tiles(m, n, batches, config) <= slots:
            return config
    return None


def _wave_fitted(m: int, n: int, batches: int, slots: int,
                 find: Callable[[str, int, int], GemmConfig | None]) -> GemmConfig | None:
    """The cooperative 128-row tile of :data:`WAVE_FIT_WIDTHS` whose rounds take the least time, or
    None where 128 columns are as good (the other rules then choose).

    A round of tiles of width W takes time in proportion to W (each tile's MMAs and loads scale with
    it), plus :data:`WAVE_FIT_ROUND_COST`: the launch costs rounds x (W + that), divided by
    :data:`BLOCK_SCALED_WIDE_SPEED` for a tile with 1 x 128 block scales that does not promote in
    pairs. A width must cost
    strictly less than 128 columns; among those, equal costs go to the wider tile (fewer bytes from
    L2 per FLOP). On the H100 (docs/performance.md, "Tiles that make whole waves") this picked the
    measured best at all 17 shapes of M = 256-2048 swept: 512 x 4608 x 3584 in 128 x 144 tiles (128
    tiles, one round) ran 0.95x cuBLAS against 0.78x in 96 tiles of 128 x 192; 512 x 3584 x 3584 in
    128 x 112 (128 tiles) 0.94x against 0.89x in 112 of 128 x 128."""
    best, best_cost, cost_128 = None, None, None
    for width in WAVE_FIT_WIDTHS:
        config = find("cooperative", 128, width)
        if config is None:
            continue
        cost = ceil_div(_tiles(m, n, batches, config), slots) * (config.tile_n + WAVE_FIT_ROUND_COST)
        if config.stages_a_scales and not config.promotes_in_pairs:
            cost /= BLOCK_SCALED_WIDE_SPEED
        if width == 128:
            cost_128 = cost
        if best_cost is None or cost <= best_cost:
            best, best_cost = config, cost
    if best is None or (cost_128 is not None and best_cost >= cost_128):
        return None
    return best


def _pingpong_width(m: int, n: int, batches: int, slots: int, base: GemmConfig,
                    family: Sequence[GemmConfig]) -> GemmConfig:
    """The ping-pong 128-row tile of ``family`` (``base``, 128 x 128, or one of
    :data:`WIDE_PINGPONG_WIDTHS`) whose launch costs least as rounds x (width +
    :data:`WAVE_FIT_ROUND_COST`), a round being one tile per CTA slot; a wider tile only below
    :data:`WIDE_PINGPONG_MAX_COST` of ``base``'s cost. Fitted on the H100 (docs/performance.md,
    "Wide ping-pong tiles"): 512 x 28672 x 4096 ran 1.00x cuBLAS in 128 x 176 against 0.96x in
    128 x 128 (5 rounds of 176 columns against 7 of 128), 512 x 152064 x 3584 1.02x in 128 x 192
    against 0.96x."""
    def cost(config: GemmConfig) -> int:
        return ceil_div(_tiles(m, n, batches, config), slots) * (config.tile_n + WAVE_FIT_ROUND_COST)

    best, best_cost = base, WIDE_PINGPONG_MAX_COST * cost(base)
    for config in family:
        if _is_wide_pingpong(config) and cost(config) < best_cost:
            best, best_cost = config, cost(config)
    return best


def _without_a_thin_last_round(chosen: GemmConfig, ordered: Sequence[GemmConfig], m: int, n: int,
                               batches: int, slots: int) -> GemmConfig:
    """``chosen``, unless its tiles spill a last round that is at most half full and a larger tile
    of ``ordered`` fits one round that is at least half full while loading fewer A and B rows per K
    step than ``chosen`` does over all its rounds. Few tiles are memory-bound: a round costs about
    what its tiles load, so a thin second round costs a whole one (Qwen2.5 qkv at M = 128: 144
    tiles of 64 x 64 on 132 SMs ran 0.65x cuBLAS, 72 tiles of 128 x 64 0.76-0.78x in the same run)."""
    tiles = _tiles(m, n, batches, chosen)
    rounds = ceil_div(tiles, slots)
    if rounds < 2 or tiles - (rounds - 1) * slots > slots // 2:
        return chosen
    cost = rounds * (chosen.tile_m + chosen.tile_n)
    for c in ordered:
        if slots // 2 <= _tiles(m, n, batches, c) <= slots and c.tile_m + c.tile_n < cost:
            return c
    return chosen


def with_cluster_for(config: GemmConfig, m: int, n: int, batches: int,
                     slots_of: Callable[[tuple[int, int]], int], *, trims_a: bool = False) -> GemmConfig:
    """``config`` with the cluster shape that needs the fewest waves of its tiles for an (L, M, N)
    problem (:func:`evtc.plan.clusters.cluster_for_problem`, with the tile's cluster costs).
    ``trims_a``: the launch then loads only the problem's rows of A (:func:`with_a_rows_for`, which
    kernels that choose their tile apply), whose cluster costs differ."""
    tiles_m, tiles_n = ceil_div(m, config.tile_m), ceil_div(n, config.out_tile_n)
    # Any cluster shape, 1x1 too (8 rows per CTA), then loads at most 32 rows of A per stage: the
    # trimmed cluster costs were measured there (M <= TRIMMED_A_COST_MAX_M); taller trimmed loads
    # keep the costs of whole ones.
    trimmed_a = (trims_a and config.a_major == "k" and m <= TRIMMED_A_COST_MAX_M and m < config.tile_m
                 and config.ab_dtype in SIXTEEN_BIT)
    cluster = cluster_for_problem(tiles_m, tiles_n, batches, config.cluster, slots_of, config.schedule,
                                  cluster_costs(config.schedule, config.tile_m, config.tile_n, tiles_m,
                                                # 128 x 128 blocks of A: 2x1 (PROMOTING_LONG_K_WAVES)
                                                config.promotes_in_pairs
                                                and (config.stages_a_scales or not config.block_scales),
                                                trimmed_a=trimmed_a, gated=config.gated))
    return config if cluster == config.cluster else config.replace(cluster=cluster)


def with_a_rows_for(config: GemmConfig, m: int) -> GemmConfig:
    """``config`` loading only the rows of A a problem with ``m`` rows per batch has (the fewest of
    :data:`evtc.plan.config.A_ROWS` that hold them, whole 8-row atoms per CTA sharing A), where
    that is fewer than a tile; ``config`` unchanged otherwise. See ``GemmConfig.a_rows``."""
    if config.a_major != "k":
        return config
    per_cta = 8 * config.cluster[1]
    rows = next((r for r in A_ROWS if r >= m and r % per_cta == 0 and r < config.tile_m), None)
    return config if rows is None or rows == config.a_rows else config.replace(a_rows=rows)


def with_launch_shape_for(config: GemmConfig, m: int, n: int, batches: int,
                          slots_of: Callable[[tuple[int, int]], int], *, choose_cluster: bool,
                          chooses_tile: bool) -> GemmConfig:
    """``config`` as a launch runs it on an (L, M, N) problem: its cluster shape (where
    ``choose_cluster``) and, for a kernel that chooses its tile (``chooses_tile``), only the rows of
    A the problem has, which also changes what a cluster shape costs."""
    if choose_cluster:
        config = with_cluster_for(config, m, n, batches, slots_of, trims_a=chooses_tile)
    return with_a_rows_for(config, m) if chooses_tile else config


def choose_launch(m: int, n: int, k: int, batches: int, family: Sequence[GemmConfig],
                  slots_of: Callable[[tuple[int, int]], int], *, choose_cluster: bool,
                  pinned_splits: int | None = None, epilogue_tiles: int = 0,
                  hbm_bytes_per_us: float = HBM_BYTES_PER_US) -> tuple[GemmConfig, int]:
    """(configuration, splits of K) for an (L, M, N, K) problem: the tile from ``family``, then the
    cluster shape with the fewest waves (where ``choose_cluster``), then the split count (unless
    ``pinned_splits``). ``slots_of(cluster)``: CTAs of that cluster shape that run at once.
    ``epilogue_tiles``: tiles the epilogue moves besides D (:data:`HEAVY_EPILOGUE_TILES`).
    ``hbm_bytes_per_us``: the GPU's memory rate, in the split model
    (:func:`evtc.plan.split_k.modelled_time_us`) and for the heavy epilogues' rule
    (:data:`HEAVY_EPILOGUE_MAX_HBM_BYTES_PER_US`); the H100's by default."""
    heavy_rule = hbm_bytes_per_us <= HEAVY_EPILOGUE_MAX_HBM_BYTES_PER_US
    config = (choose_tile(m, n, k, batches, family, slots_of((1, 1)), epilogue_tiles, heavy_rule=heavy_rule)
              if len(family) > 1 else family[0])
    config = with_launch_shape_for(config, m, n, batches, slots_of, choose_cluster=choose_cluster,
                                   chooses_tile=len(family) > 1)
    if pinned_splits is not None:
        splits = splits_within_k(pinned_splits, k, config.tile_k)
    elif config.block_scales and len(family) > 1:
        # Block-scaled kernels that choose their launch split K only where pinned (one compiled
        # with split_k=True and a fixed tile still chooses its split count): on the H100 (CUDA
        # graphs, 14 LLM layers at M = 128-8192; docs/performance.md, "Block scales in pairs") the
        # unsplit launch beat the split counts the rules below chose on 7 of the 8 rows that split,
        # by up to 18% (1024 x 57344 x 8192: 0.77x torch's blockwise GEMM in 4 splits, 0.90x in
        # one), and tied the eighth.
        splits = 1
    else:
        tiles, slots = cta_tile_grid(m, n, batches, config, config.cluster), slots_of(config.cluster)
        splits = modelled_splits(choose_splits(k, tiles, slots, config.tile_k), m, n, k, batches, config,
                                 hbm_bytes_per_us)
        if splits == 1:
            splits = choose_tail_splits(k, tiles, slots, config.cluster[0] * config.cluster[1], config.tile_k)
    if splits == 1 and cta_tile_grid(m, n, batches, config, config.cluster) <= slots_of(config.cluster):
        config = _one_wave_twin(config, family, k)
    return config, splits


__all__ = ["BIG_WEIGHT_ELEMENTS", "BIG_WEIGHT_K", "BIG_WEIGHT_MIN_M", "BLOCK_SCALED_WIDE_SPEED",
           "DECODE_MAX_TILE_N", "FAMILY",
           "FILL", "HEAVY_EPILOGUE_TILES", "LONG_K", "MANY_WAVES", "ONE_WAVE_LOADS_MIN_K", "ONE_WAVE_PLANS",
           "PROMOTING_LONG_K_WAVES", "TWO_ROW_MIN_K", "TWO_ROW_MIN_M", "TWO_ROW_ONLY",
           "TWO_ROW_WIDTHS",
           "WIDE_PINGPONG_MAX_COST", "WIDE_PINGPONG_MAX_EPILOGUE_TILES", "WIDE_PINGPONG_MIN_K_WITH_TILES",
           "SIXTEEN_BIT", "WIDE_PINGPONG_WIDTHS",
           "WAVE_FIT_MAX_WAVES", "WAVE_FIT_ROUND_COST", "WAVE_FIT_WIDTHS", "choose_launch", "choose_tile",
           "family_digest", "is_one_wave_twin", "light_epilogue", "one_wave_twins", "tile_family",
           "with_a_rows_for", "with_launch_shape_for",
           "with_cluster_for"]
