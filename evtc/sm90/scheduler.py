"""Persistent static tile scheduler with a rasterization swizzle.

The launch has one cluster of CTAs per "persistent slot" (at most as many clusters as fit on the
GPU at once); each cluster walks the output tiles with a stride of the number of clusters.  The
scheduler is stateless: a work index goes in, tile coordinates come out.  Every role of the kernel
(A/B producer, epilogue-load warp, consumers) builds its own copy and walks the same sequence, so no
shared-memory handshake between the roles is needed.

Work units are cluster tiles: a 2x1 cluster owns two vertically adjacent CTA tiles, and each CTA of
it adds its own position in the cluster.  Output tiles past the edge of the problem (a ragged last
cluster) still run; TMA clips their loads (zero fill) and stores, so they do no harm.

Split-K (``splits`` > 1): each cluster tile is ``splits`` consecutive work units, one per range of
K, so the splits of a tile run side by side on neighbouring clusters; unit ``w`` is split
``w % splits`` of cluster tile ``w // splits``. A split waits only for splits of lower index, which
run on clusters that are resident at the same time (the grid never has more clusters than fit), so
the waits always end.

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

    _DYNAMIC = ("clusters_m", "clusters_n", "per_batch", "batches", "splits")

    def __init__(
        self,
        tiles_m: Int32,
        tiles_n: Int32,
        batches: Int32,
        cluster: tuple[int, int],
        raster_m: bool,
        swizzle: int,
        splits=None,
    ):
        self.cluster = cluster
        # Static: a kernel without split-K does no divisions by the (then 1) split count.
        self.split_k = splits is not None
        self.raster_m = raster_m
        self.swizzle = swizzle
        self.batches = Int32(batches)
        # Cluster-tile grid of one batch.
        self.clusters_m = Int32(ceil_div(tiles_m, cluster[0]))
        self.clusters_n = Int32(ceil_div(tiles_n, cluster[1]))
        self.per_batch = Int32(self.clusters_m * self.clusters_n)
        self.splits = Int32(1 if splits is None else splits)

    def __extract_mlir_values__(self):
        values = []
        for name in self._DYNAMIC:
            values += extract_mlir_values(getattr(self, name))
        return values

    def __new_from_mlir_values__(self, values):
        new = object.__new__(TileScheduler)
        new.cluster, new.raster_m, new.swizzle = self.cluster, self.raster_m, self.swizzle
        new.split_k = self.split_k
        for i, name in enumerate(self._DYNAMIC):
            setattr(new, name, new_from_mlir_values(getattr(self, name), [values[i]]))
        return new

    @staticmethod
    def for_problem(m, n, batches, tile_mn: tuple[int, int], cluster, raster_m: bool, swizzle: int,
                    splits=None):
        """Scheduler for an M x N x L output tiled by ``tile_mn``, K cut in ``splits`` (None: a kernel
        without split-K)."""
        tiles_m = ceil_div(Int32(m), tile_mn[0])
        tiles_n = ceil_div(Int32(n), tile_mn[1])
        return TileScheduler(tiles_m, tiles_n, Int32(batches), cluster, raster_m, swizzle, splits)

    def num_work_units(self) -> Int32:
        """Work units in the whole problem: cluster tiles of all batches, times the splits of K."""
        return self.per_batch * self.batches * self.splits

    def split_of(self, work: Int32) -> Int32:
        """The split of K that work unit ``work`` computes."""
        return work - (work // self.splits) * self.splits

    def k_range(self, work: Int32, k_tiles: Int32):
        """(first K tile, K tiles) of work unit ``work``: split s takes tiles [s k / S, (s + 1) k / S),
        so the splits differ by one K tile at most."""
        s = self.split_of(work)
        first = (s * k_tiles) // self.splits
        return first, ((s + 1) * k_tiles) // self.splits - first

    def tile_index(self, tile_coord) -> Int32:
        """A CTA tile's index in the padded grid of CTA tiles (whole clusters, all batches): the slot
        of its split-K counter and partials (:mod:`evtc.plan.split_k` sizes them alike)."""
        m, n, batch = tile_coord
        grid_m = self.clusters_m * self.cluster[0]
        grid_n = self.clusters_n * self.cluster[1]
        return (batch * grid_n + n) * grid_m + m

    @cute.jit
    def cluster_tile(self, work: Int32):
        """(cluster row, cluster column, batch) of work unit ``work``."""
        if cutlass.const_expr(self.split_k):
            work = work // self.splits
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
