"""Which cluster shape a problem runs with, chosen per call without the CuTe DSL, and a model of
the order in which the persistent kernel visits its tiles."""

from __future__ import annotations


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def reference_order(tiles_m: int, tiles_n: int, batches: int, cluster, raster_m: bool, swizzle: int):
    """Pure-Python model of :meth:`evtc.sm90.scheduler.TileScheduler.cluster_tile` (for tests and
    documentation)."""
    cms, cns = ceil_div(tiles_m, cluster[0]), ceil_div(tiles_n, cluster[1])
    per_batch = cms * cns
    out = []
    for work in range(per_batch * batches):
        batch, r = divmod(work, per_batch)
        major, minor_total = (cms, cns) if raster_m else (cns, cms)
        band, in_band = divmod(r, major * swizzle)
        band_start = band * swizzle
        width = min(swizzle, minor_total - band_start)
        along, off = divmod(in_band, width)
        across = band_start + off
        out.append((along, across, batch) if raster_m else (across, along, batch))
    return out


# Relative time per tile of each cluster shape when every CTA has work, per schedule, from the H100
# measurements (docs/performance.md, "cluster shape per call").  Ping-pong 128x128 tiles: A multicast
# to a 1x2 cluster is what keeps the mainloop off the L2 bandwidth limit; 2x1 (B multicast) comes
# close, 1x1 is 20-40% slower on large problems.  Cooperative 128x256: the three within noise.
CLUSTER_COST = {
    "pingpong": {(1, 2): 1.0, (2, 1): 1.1, (1, 1): 1.25},
    "cooperative": {(1, 1): 1.0, (1, 2): 1.0, (2, 1): 1.0},
}
# The same for the other tile shapes a kernel may choose per call (evtc.plan.selector), keyed by
# (schedule, tile_m, tile_n): geomeans over a sweep of decode and prefill shapes on the H100
# (bench/sweep_configs.py, docs/performance.md "A launch per problem size").  64-row tiles share
# the weight (B) best: 2x1 clusters multicast it.
#
# The tiles of decode-sized problems stream their weights, and what a CTA loads from L2 per K step
# bounds them. Where the problem has one row of tiles, a 1x4 cluster shares A's stage among four
# CTAs; where it has two, a 2x1 cluster shares each weight tile between both rows (the overhang
# term below keeps 2x1 off problems with one row of tiles), unless 1x4 clusters fit in one wave.
# Refitted on the H100 with 13-stage 64 x 64 pipelines (docs/performance.md, "Four-CTA clusters
# and deeper pipelines at decode sizes"): at M = 64, 64 x 64 in 1x4 ran 0.91-1.08x cuBLAS against
# 0.87-1.04x in 1x2; at M = 96-128 2x1 ran 0.84-1.09x against 0.72-1.02x in 1x2, and 1x4 as fast
# or faster where its clusters fit one wave (96 x 3584 x 18944: 1.04x against 0.89x in 2x1), 20-35%
# slower where they do not (N = 4096: 128 tiles, more than the H100's resident 4-CTA clusters hold).
TILE_CLUSTER_COST = {
    ("pingpong", 128, 64): {(1, 2): 1.0, (1, 1): 1.08, (2, 1): 1.35},
    ("pingpong", 64, 256): {(2, 1): 0.965, (1, 2): 1.0, (1, 1): 1.01},
    ("pingpong", 64, 128): {(2, 1): 0.96, (1, 4): 0.965, (1, 2): 1.0, (1, 1): 1.03},
    ("pingpong", 64, 64): {(1, 4): 0.93, (2, 1): 0.94, (1, 2): 1.0, (1, 1): 1.09},
    # Two rows of tiles at M = 112-128 (evtc.plan.selector, TWO_ROW_WIDTHS): 2x1, each weight tile
    # multicast to both rows, as measured on the H200 (docs/performance.md, "Two rows of 64-row
    # tiles at M = 128"). The other shapes' costs are 64 x 64's and 64 x 128's, not measured for
    # these widths.
    ("pingpong", 64, 80): {(2, 1): 0.94, (1, 2): 1.0, (1, 1): 1.09},
    ("pingpong", 64, 96): {(2, 1): 0.94, (1, 2): 1.0, (1, 1): 1.09},
    ("pingpong", 64, 160): {(2, 1): 0.96, (1, 2): 1.0, (1, 1): 1.03},
    ("cooperative", 128, 256): {(1, 2): 1.0, (2, 1): 1.03, (1, 1): 1.08},
    # Chosen for problems of one wave (evtc.plan.selector), where B multicast (2x1) did best.
    ("cooperative", 128, 128): {(2, 1): 1.0, (1, 2): 1.01, (1, 1): 1.05},
    # 2048 x 4608 x 3584: 0.99x cuBLAS in 2x1 or 1x2 clusters against 0.96-0.97x in 1x1.
    ("cooperative", 128, 192): {(2, 1): 1.0, (1, 2): 1.0, (1, 1): 1.02},
    # Wave-fitted widths (evtc.plan.selector): B multicast did best at M = 512-1024.
    ("cooperative", 128, 112): {(2, 1): 1.0, (1, 1): 1.05, (1, 2): 1.06},
    ("cooperative", 128, 144): {(2, 1): 1.0, (1, 2): 1.01, (1, 1): 1.03},
    ("cooperative", 128, 160): {(2, 1): 1.0, (1, 2): 1.0, (1, 1): 1.03},
    ("cooperative", 128, 64): {(2, 1): 1.0, (1, 4): 1.04, (1, 1): 1.06, (1, 2): 1.08},
    # Wide ping-pong tiles (evtc.plan.selector, WIDE_PINGPONG_WIDTHS): at 512 x 28672 x 4096 128 x 176
    # ran 0.98-1.00x cuBLAS in 2x1 clusters against 0.96x in 1x2, at 2048 x 28672 x 4096 1.03-1.05x
    # against 1.04x; 128 x 192 at 512 x 37888 x 3584 1.04x against 1.01x.
    ("pingpong", 128, 176): {(2, 1): 1.0, (1, 2): 1.02, (1, 1): 1.25},
    ("pingpong", 128, 192): {(2, 1): 1.0, (1, 2): 1.02, (1, 1): 1.25},
}


# The same for 64-row ping-pong tiles that load only A's first rows (GemmConfig.a_rows: problems
# of at most 32 rows, 16-bit A and B). Sharing A's few rows saves next to nothing, and a cluster
# makes its CTAs wait for each other's consumers before any of them refills a stage. Measured on
# the H200 (docs/performance.md, "Decode tiles without clusters"), 64 x 64, 12 LLM layers at M = 1-32,
# the launch pinned (bench/decode_launches.py), 13 A/B stages, cuBLAS time over ours: 1x1
# 0.91-1.12, 1x4 0.67-1.09, 1x2 0.89-1.09, 2x1 0.65-1.11; no shape ran faster with a cluster.
TRIMMED_A_CLUSTER_COST = {
    ("pingpong", 64, 64): {(1, 1): 1.0, (1, 2): 1.04, (1, 4): 1.05, (2, 1): 1.15},
    # 64 x 128 (evtc.plan.selector.DECODE_MAX_TILE_N), same machine and bench, identity and SwiGLU
    # on weights of 14336-57344 columns at M = 1-32: 1x2 and 1x1 within 2% of each other (1x2 ahead
    # in geomean by about 0.5%), 1x4 1-6% slower on six of eight shapes.
    ("pingpong", 64, 128): {(1, 2): 1.0, (1, 1): 1.005, (1, 4): 1.05, (2, 1): 1.15},
}
# The tiles of TRIMMED_A_CLUSTER_COST measured with gated kernels (SwiGLU) too; a gated launch of
# another tile keeps the costs of whole A loads.
TRIMMED_A_GATED_TILES = frozenset({("pingpong", 64, 128)})


# Four-CTA clusters the selector leaves unplanned. Each needs four free SMs of one GPC at the same
# moment; on the H100 (33 resident per the occupancy API) launches of 32 such clusters ran 20-35%
# slower than 2-CTA clusters in back-to-back calls, where 28 ran at full speed (docs/performance.md,
# "Four-CTA clusters and deeper pipelines at decode sizes"). We read it as the next grid's clusters
# waiting for whole groups of SMs while the previous grid drains.
FOUR_CTA_CLUSTERS_HELD_BACK = 4


def planned_clusters(cluster_size: int, resident: int) -> int:
    """How many clusters of ``cluster_size`` CTAs the selector counts on, of the ``resident`` ones
    the occupancy API reports: all of them, except :data:`FOUR_CTA_CLUSTERS_HELD_BACK` fewer for
    clusters of four or more."""
    if cluster_size >= 4:
        return max(1, resident - FOUR_CTA_CLUSTERS_HELD_BACK)
    return resident


# Rows of tiles up to which a problem counts as having few (M <= 512 in 128-row tiles). The cluster
# that pays depends on it for some tiles, measured on the H100 (`bench/sweep_configs.py --candidates
# mid`, docs/performance.md "Cluster shapes by rows of tiles"):
FEW_TILE_ROWS = 4
# * few rows: every weight tile is loaded by each row of tiles, so sharing it (2x1) pays. Ping-pong
#   128 x 128 at M = 512: 512 x 28672 x 4096 0.95x cuBLAS in 2x1 against 0.93-0.94x in 1x2,
#   512 x 37888 x 3584 1.00x against 0.98x.
FEW_ROWS_CLUSTER_COST = {
    ("pingpong", 128, 128): {(2, 1): 1.0, (1, 2): 1.02, (1, 1): 1.25},
    # 512 x 8192 x 8192 and 512 x 8192 x 28672: 0.99x in 2x1 against 0.98x in 1x2.
    ("cooperative", 128, 256): {(2, 1): 1.0, (1, 2): 1.01, (1, 1): 1.08},
}
# * more rows: the 112- and 144-wide tiles run far slower in 2x1 clusters once each CTA runs several
#   tiles (2048 x 3584 x 3584 in 128 x 112: 1.04x cuBLAS in 1x2 against 0.90x in 2x1; 2048 x 3584 x
#   18944 1.06x against 0.93x; 2048 x 4608 x 3584 in 128 x 144: 0.97x against 0.93x), where at
#   M = 256-512 2x1 did best (512 x 3584 x 3584: 0.95x against 0.87x).
MANY_ROWS_CLUSTER_COST = {
    ("cooperative", 128, 112): {(1, 2): 1.0, (2, 1): 1.1, (1, 1): 1.1},
    ("cooperative", 128, 144): {(1, 2): 1.0, (2, 1): 1.02, (1, 1): 1.15},
}


# * more rows, a float8 mainloop promoting in pairs (GemmConfig.promotes_in_pairs) in cooperative
#   128 x 128 tiles (the selector's choice there, evtc.plan.selector.PROMOTING_LONG_K_WAVES): A
#   multicast (1x2) did best at M = 2048 and 8192 on 24 LLM layers, 1.00x cuBLASLt in geomean
#   against 0.97x in 2x1; at M = 512 (four rows) 2x1 did, as for 16-bit tiles (docs/performance.md,
#   "float8: small promoting tiles").
PROMOTING_MANY_ROWS_CLUSTER_COST = {
    ("cooperative", 128, 128): {(1, 2): 1.0, (2, 1): 1.03, (1, 1): 1.08},
}


def cluster_costs(schedule: str, tile_m: int, tile_n: int, tiles_m: int | None = None,
                  promotes_in_pairs: bool = False, trimmed_a: bool = False,
                  gated: bool = False) -> dict[tuple[int, int], float]:
    """Relative time per tile of each cluster shape for one tile shape (see CLUSTER_COST), for a
    problem with ``tiles_m`` rows of tiles where that is known (:data:`FEW_TILE_ROWS`);
    ``promotes_in_pairs``: a float8 mainloop promoting in pairs (:data:`PROMOTING_MANY_ROWS_CLUSTER_COST`;
    the selector passes False for block-scaled kernels, which measured faster in 2x1);
    ``trimmed_a``: a launch of 16-bit A and B that loads only the problem's rows of A, at most 32
    (:data:`TRIMMED_A_CLUSTER_COST`; ``gated``: of a gated kernel, :data:`TRIMMED_A_GATED_TILES`)."""
    key = (schedule, tile_m, tile_n)
    if trimmed_a and key in TRIMMED_A_CLUSTER_COST and (not gated or key in TRIMMED_A_GATED_TILES):
        return TRIMMED_A_CLUSTER_COST[key]
    many_rows = tiles_m is not None and tiles_m > FEW_TILE_ROWS
    if promotes_in_pairs and many_rows and key in PROMOTING_MANY_ROWS_CLUSTER_COST:
        return PROMOTING_MANY_ROWS_CLUSTER_COST[key]
    if tiles_m is not None:
        by_rows = FEW_ROWS_CLUSTER_COST if tiles_m <= FEW_TILE_ROWS else MANY_ROWS_CLUSTER_COST
        if key in by_rows:
            return by_rows[key]
    return TILE_CLUSTER_COST.get(key, CLUSTER_COST[schedule])


def padded_tiles(tiles_m: int, tiles_n: int, cluster: tuple[int, int]) -> int:
    """Tiles of one batch counted in whole clusters: a cluster that overhangs the problem's edge
    runs its idle CTAs too."""
    cm, cn = cluster
    return ceil_div(tiles_m, cm) * cm * ceil_div(tiles_n, cn) * cn


def waves(tiles_m: int, tiles_n: int, batches: int, cluster: tuple[int, int], slots: int) -> int:
    """Rounds of ``slots`` concurrent CTAs that a persistent launch needs for the problem's tiles,
    counting the idle CTAs of clusters that overhang the edge (they run, and occupy an SM)."""
    return ceil_div(padded_tiles(tiles_m, tiles_n, cluster) * batches, max(slots, 1))


def cluster_for_problem(tiles_m: int, tiles_n: int, batches: int, preferred: tuple[int, int],
                        slots_of, schedule: str, costs: dict | None = None) -> tuple[int, int]:
    """The cluster shape with the fewest expected waves, weighted by :data:`CLUSTER_COST`.

    A 1x2 cluster over a problem with one column of tiles leaves every second CTA idle, and so
    doubles the time; 2x1 or 1x1 clusters then finish sooner.  ``slots_of(cluster)`` is how many
    CTAs of that cluster shape run at once.  Ties go to ``preferred``, so problems that fit in one
    wave (whatever their shape) keep the configured kernel. ``costs``: the tile shape's
    (:func:`cluster_costs`), else the schedule's.
    """
    costs = costs or CLUSTER_COST[schedule]

    def cost(cluster):
        # Clusters that overhang the problem's edge cost more than the extra CTAs' share of a wave:
        # on the H100, 384 x 4096 x 4096 in 128 x 128 tiles (three rows) ran 0.58x cuBLAS with 2x1
        # clusters and 0.81x with 1x1 ones, both one wave. So the overhang also scales the cost.
        overhang = padded_tiles(tiles_m, tiles_n, cluster) / max(tiles_m * tiles_n, 1)
        return (waves(tiles_m, tiles_n, batches, cluster, slots_of(cluster)) * costs.get(cluster, 1.0)
                * overhang)

    best = preferred
    best_cost = cost(preferred)
    for cluster in costs:
        c = cost(cluster)
        if c < best_cost * 0.999:
            best, best_cost = cluster, c
    return best
