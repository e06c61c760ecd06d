"""Persistent static tile scheduler with a rasterization swizzle.

The launch has one cluster of CTAs per "persistent slot" (at most as many clusters as fit on the
GPU at once); each cluster walks the output tiles with a stride of the number of clusters.  The
scheduler is stateless: a work index goes in, tile coordinates come out.  Every role of the kernel
(A/B producer, epilogue-load warp, consumers) builds its own copy and walks the same sequence, so no
shared-memory handshake between the roles is needed.

Work units are cluster tiles: a 2x1 cluster owns two vertically adjacent CTA tiles, and each CTA of
it adds its own position in the cluster.  Output tiles past the edge of the problem (a ragged last
cluster) still run; TMA clips their loads (zero fill) and stores, so they do no harm.

Rasterization: consecutive work units go down a band of ``swizzle`` cluster columns (raster "m") or
across a band of ``swizzle`` cluster rows (raster "n").  The tiles that run at the same time then
share a few rows of A and columns of B, which keeps them in L2.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cutlass_dsl import extract_mlir_values, new_from_mlir_values


def ceil_div(a, b):
    return (a + b - 1) // b


class TileScheduler:
    """Maps a linear work index to (m, n, l) CTA tile coordinates.

    Built inside the kernel (or the jit host function) from the dynamic problem shape.  Its runtime
    fields are ``Int32``; it implements the DSL's value protocol so that it may live across dynamic
    ``if`` / ``while`` regions.
    """

    _DYNAMIC = ("clusters_m", "clusters_n", "per_batch", "batches")

    def __init__(
        self,
        tiles_m: Int32,
        tiles_n: Int32,
        batches: Int32,
        cluster: tuple[int, int],
        raster_m: bool,
        swizzle: int,
    ):
        self.cluster = cluster
        self.raster_m = raster_m
        self.swizzle = swizzle
        self.batches = Int32(batches)
        # Cluster-tile grid of one batch.
        self.clusters_m = Int32(ceil_div(tiles_m, cluster[0]))
        self.clusters_n = Int32(ceil_div(tiles_n, cluster[1]))
        self.per_batch = Int32(self.clusters_m * self.clusters_n)

    def __extract_mlir_values__(self):
        values = []
        for name in self._DYNAMIC:
            values += extract_mlir_values(getattr(self, name))
        return values

    def __new_from_mlir_values__(self, values):
        new = object.__new__(TileScheduler)
        new.cluster, new.raster_m, new.swizzle = self.cluster, self.raster_m, self.swizzle
        for i, name in enumerate(self._DYNAMIC):
            setattr(new, name, new_from_mlir_values(getattr(self, name), [values[i]]))
        return new

    @staticmethod
    def for_problem(m, n, batches, tile_mn: tuple[int, int], cluster, raster_m: bool, swizzle: int):
        """Scheduler for an M x N x L output tiled by ``tile_mn``."""
        tiles_m = ceil_div(Int32(m), tile_mn[0])
        tiles_n = ceil_div(Int32(n), tile_mn[1])
        return TileScheduler(tiles_m, tiles_n, Int32(batches), cluster, raster_m, swizzle)

    def num_work_units(self) -> Int32:
        """Cluster tiles in the whole problem (all batches)."""
        return self.per_batch * self.batches

    @cute.jit
    def cluster_tile(self, work: Int32):
        """(cluster row, cluster column, batch) of work unit ``work``."""
        batch = work // self.per_batch
        r = work - batch * self.per_batch
        # Band along the "slow" dimension; the last band may be narrower.
        if cutlass.const_expr(self.raster_m):
            major, minor_total = self.clusters_m, self.clusters_n
        else:
            major, minor_total = self.clusters_n, self.clusters_m
        band_size = major * self.swizzle
        band = r // band_size
        in_band = r - band * band_size
        band_start = band * self.swizzle
        width = cutlass.min(Int32(self.swizzle), minor_total - band_start)
        along = in_band // width  # position along the rasterized dimension
        across = band_start + (in_band - along * width)  # position inside the band
        cm = Int32(0)
        cn = Int32(0)
        if cutlass.const_expr(self.raster_m):
            cm = along
            cn = across
        else:
            cm = across
            cn = along
        return cm, cn, batch

    @cute.jit
    def cta_tile(self, work: Int32, cta_in_cluster: tuple):
        """(m, n, l) tile coordinates of this CTA for work unit ``work``."""
        cm, cn, batch = self.cluster_tile(work)
        return (
            cm * self.cluster[0] + cta_in_cluster[0],
            cn * self.cluster[1] + cta_in_cluster[1],
            batch,
        )


def reference_order(tiles_m: int, tiles_n: int, batches: int, cluster, raster_m: bool, swizzle: int):
    """Pure-Python model of :meth:`TileScheduler.cluster_tile` (for tests and documentation)."""
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


# ---- choosing a cluster shape per problem (host side) ---------------------------------------------

# Relative time per tile of each cluster shape when every CTA has work, per schedule, from the H100
# measurements (docs/performance.md, "cluster shape per call").  Ping-pong 128x128 tiles: A multicast
# to a 1x2 cluster is what keeps the mainloop off the L2 bandwidth limit; 2x1 (B multicast) comes
# close, 1x1 is 20-40% slower on large problems.  Cooperative 128x256: the three within noise.
CLUSTER_COST = {
    "pingpong": {(1, 2): 1.0, (2, 1): 1.1, (1, 1): 1.25},
    "cooperative": {(1, 1): 1.0, (1, 2): 1.0, (2, 1): 1.0},
}


def waves(tiles_m: int, tiles_n: int, batches: int, cluster: tuple[int, int], slots: int) -> int:
    """Rounds of ``slots`` concurrent CTAs that a persistent launch needs for the problem's tiles,
    counting the idle CTAs of clusters that overhang the edge (they run, and occupy an SM)."""
    cm, cn = cluster
    padded = ceil_div(tiles_m, cm) * cm * ceil_div(tiles_n, cn) * cn * batches
    return ceil_div(padded, max(slots, 1))


def cluster_for_problem(tiles_m: int, tiles_n: int, batches: int, preferred: tuple[int, int],
                        slots_of, schedule: str) -> tuple[int, int]:
    """The cluster shape with the fewest expected waves, weighted by :data:`CLUSTER_COST`.

    A 1x2 cluster over a problem with one column of tiles leaves every second CTA idle, and so
    doubles the time; 2x1 or 1x1 clusters then finish sooner.  ``slots_of(cluster)`` is how many
    CTAs of that cluster shape run at once.  Ties go to ``preferred``, so problems that fit in one
    wave (whatever their shape) keep the configured kernel.
    """
    costs = CLUSTER_COST[schedule]

    def cost(cluster):
        return waves(tiles_m, tiles_n, batches, cluster, slots_of(cluster)) * costs.get(cluster, 1.0)

    best = preferred
    best_cost = cost(preferred)
    for cluster in costs:
        c = cost(cluster)
        if c < best_cost * 0.999:
            best, best_cost = cluster, c
    return best
