"""Persistent static tile scheduler with a rasterization swizzle.

The launch has one cluster of CTAs per "persistent slot" (at most as many clusters as fit on the
GPU at once); each cluster walks the output tiles with a stride of the number of clusters.  The
scheduler is stateless: a work index goes in, tile coordinates come out.  Every role of the kernel
(A/B producer, epilogue-load warp, consumers) builds its own copy and walks the same sequence, so no
shared-memory handshake between the roles is needed.

Work units are cluster tiles: a 2x1 cluster owns two vertically adjacent CTA tiles, and each CTA of
it adds its own position in the cluster.  Output tiles past the edge of the problem (a ragged last
cluster) still run; TMA clips their loads (zero fill) and stores, so they do no harm.

Split-K (``splits`` > 1): a cluster tile that is split is ``splits`` consecutive work units, one per
range of K, so its splits run side by side on neighbouring clusters. Which tiles are split depends
on how many cluster tiles T the problem has against the clusters G that run at once:

* T <= G (one wave or less, decode): every tile, unit ``w`` is split ``w % splits`` of tile
  ``w // splits``;
* T > G: only the tail. The first ``W = (T // G) G`` tiles (``whole_units``) run whole, one unit
  each, in whole rounds of the grid; the last ``T % G`` tiles, which alone would leave SMs idle for
  a whole round, are split, so that the last round takes about 1 / ``splits`` of a tile's time.
  Unit ``w >= W`` is split ``(w - W) % splits`` of tile ``W + (w - W) // splits``.

``W`` is computed alike on the host (G: the clusters that fit) and in the kernel (G: the grid,
which is exactly the clusters that fit whenever T > G), see :meth:`TileScheduler.for_problem`. A
split waits only for splits of lower index, which run on clusters that are resident at the same
time (the grid never has more clusters than fit), so the waits always end.

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

    _DYNAMIC = ("clusters_m", "clusters_n", "per_batch", "batches", "splits", "whole_units")

    def __init__(
        self,
        tiles_m: Int32,
        tiles_n: Int32,
        batches: Int32,
        cluster: tuple[int, int],
        raster_m: bool,
        swizzle: int,
        splits=None,
        clusters=None,
    ):
        """``clusters``: the clusters that run at once (split-K only; see the module docstring)."""
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
        # Split-K: cluster tiles that run whole before the split tail (0: all are split).
        self.whole_units = Int32(0)
        if splits is not None:
            tiles = self.per_batch * self.batches
            self.whole_units = cutlass.select_(tiles > clusters, tiles - tiles % clusters, Int32(0))

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
                    splits=None, clusters=None):
        """Scheduler for an M x N x L output tiled by ``tile_mn``, K cut in ``splits`` (None: a kernel
        without split-K) on a grid of ``clusters`` clusters that run at once."""
        tiles_m = ceil_div(Int32(m), tile_mn[0])
        tiles_n = ceil_div(Int32(n), tile_mn[1])
        return TileScheduler(tiles_m, tiles_n, Int32(batches), cluster, raster_m, swizzle, splits, clusters)

    def num_work_units(self) -> Int32:
        """Work units in the whole problem: the whole cluster tiles, then the split ones' splits."""
        if cutlass.const_expr(not self.split_k):
            return self.per_batch * self.batches
        return self.whole_units + (self.per_batch * self.batches - self.whole_units) * self.splits

    def _split_unit(self, work: Int32):
        """(ordinal among the split tiles, split) of work unit ``work``; (0, 0) for a whole tile."""
        unit = cutlass.max(work - self.whole_units, Int32(0))
        ordinal = unit // self.splits
        return ordinal, unit - ordinal * self.splits

    def split_of(self, work: Int32) -> Int32:
        """The split of K that work unit ``work`` computes (0 for a whole tile)."""
        return self._split_unit(work)[1]

    def last_split(self, work: Int32) -> Int32:
        """The index of the last split of work unit ``work``'s tile: 0 for a whole tile."""
        return cutlass.select_(work < self.whole_units, Int32(0), self.splits - 1)

    def runs_epilogue(self, work: Int32):
        """Whether work unit ``work`` finishes its tile: a whole tile, or the last split."""
        return self.split_of(work) == self.last_split(work)

    def k_range(self, work: Int32, k_tiles: Int32):
        """(first K tile, K tiles) of work unit ``work``: all of K for a whole tile; split s of S takes
        tiles [s k / S, (s + 1) k / S), so the splits differ by one K tile at most."""
        s = self.split_of(work)
        parts = self.last_split(work) + 1
        first = (s * k_tiles) // parts
        return first, ((s + 1) * k_tiles) // parts - first

    def split_slot(self, work: Int32, cta_in_cluster: tuple) -> Int32:
        """The split-K counter (and partials block) of this CTA's tile in unit ``work``: CTA tiles of
        split cluster tiles, numbered in work order (:mod:`evtc.plan.split_k` sizes them alike)."""
        ordinal, _ = self._split_unit(work)
        rank = cta_in_cluster[1] * self.cluster[0] + cta_in_cluster[0]
        return ordinal * (self.cluster[0] * self.cluster[1]) + rank

    @cute.jit
    def cluster_tile(self, work: Int32):
        """(cluster row, cluster column, batch) of work unit ``work``."""
        if cutlass.const_expr(self.split_k):
            ordinal, _ = self._split_unit(work)
            work = cutlass.min(work, self.whole_units) + ordinal
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
