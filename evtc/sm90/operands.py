"""Epilogue operands: each kind of input or output owns its resources and its part of every hook.

A generated visitor (:class:`evtc.sm90.fused.FusedVisitor`) lists its operands; the visitor's
hooks call the same hook of each operand. An operand owns its TMA atom, its shared memory and its
registers, so a new kind joins without touching the kernel or the other kinds.

Kinds, and the global-memory views the launcher (:mod:`evtc.sm90.launch`) hands to ``setup``:

===============  ======================  ==========================================================
kind             view                    how it reaches the fragment
===============  ======================  ==========================================================
TileLoad         (M, N[, L])             TMA, one subtile per load stage, read like the accumulator
RowVector        (N[, L])                TMA of the subtile's epi_n values per load stage, read
                                         through a (128, epi_n) view with stride 0 along M
ColVector        (M[, L])                TMA of the tile's 128 values per load stage, read through
                                         a (128, epi_n) view with stride 0 along N
DeviceScalar     (1,) or (L,)            one global load per tile (at the tile's batch), by every
                                         epilogue thread
ArgScalar        a Float32 argument      passed through
TileStore        (M, N[, L])             own staged buffer, written in postreduce, TMA store
ReductionOverN   (L, n tiles, M)         one value per row (sum, max or min over N): per-tile
                                         partials, stored by lane; the host finishes them
ReductionOverM   (L, m tiles, N)         one value per column (over M): per-tile partials
KernelFinish     counters, outputs       the block's last tile combines the partials and runs
                                         the visitor's finish method (else the host finishes)
===============  ======================  ==========================================================

``[, L]`` is there when the operand varies along the batch: one shared by all batches has no L
mode and is read at batch 0 for every batch.
"""

from __future__ import annotations

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync
from cutlass.tensor_utils import LayoutEnum

from evtc.ir.dtypes import MASK_STORAGE_NAME
from evtc.plan.smem import (
    COLUMN_REDUCTION_WARP_ROWS,
    FINISH_FLAGS,
    TWO_LEVEL_FINISH_AXES,
    VECTOR_ALIGN,
    column_reduction_columns,
    finish_smem_bytes,
    input_load_bytes,
    input_smem_bytes,
    reduction_smem_bytes,
    store_smem_bytes,
    vector_stage_elems,
)
from evtc.sm90.dtypes import cutlass_dtype, narrow
from evtc.sm90.visitor import (
    EpilogueContext,
    EpilogueShape,
    allocate_staged,
    make_epi_smem_layout,
    operand_layout,
)

# Swizzled buffers are 1024 B aligned (128 B swizzle atoms) and multiples of 1024 B; the visitor
# allocates them first, right after the kernel's own 1024 B aligned buffers, so they waste nothing.
# Vector buffers come last, 128 B aligned; each declares its alignment as slack.


def dsl_dtype(name: str):
    if name == "bool":  # a mask's bytes, written through float8 stores (MASK_STORAGE_NAME)
        name = MASK_STORAGE_NAME
    if name == "float8_e4m3fn":
        return cutlass.Float8E4M3FN
    if name == "float8_e5m2":
        return cutlass.Float8E5M2
    return cutlass_dtype(name)


class Operand:
    """Base: an input of the epilogue (its value reaches ``fragment``) or an extra output."""

    kind = "operand"
    #: True when the epilogue-load warp loads it by TMA, subtile by subtile.
    loads = False
    #: True for 1024 B aligned (swizzled) shared-memory buffers: allocated before the others.
    swizzled = False

    def __init__(self, name: str, dtype: str = "float32", *, batched: bool = False):
        self.name = name
        self.dtype_name = dtype
        self.batched = batched

    @property
    def dtype(self):
        return dsl_dtype(self.dtype_name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.dtype_name!r}, batched={self.batched})"

    # host
    def smem_bytes(self, shape_tile: tuple[int, int], epi_tile: tuple[int, int], load_stages: int,
                   store_stages: int) -> int:
        return 0

    def load_bytes(self, epi_tile: tuple[int, int]) -> int:
        return 0

    # host, traced
    def setup(self, shape: EpilogueShape, arg):
        return arg

    # device
    def allocate(self, shape: EpilogueShape, params, smem):
        return None

    def load_tile(self, shape: EpilogueShape, params, storage, tile_coord):
        return None

    def load_subtile(self, shape: EpilogueShape, params, storage, lstate, epi_idx: int, stage, barrier):
        pass

    def begin(self, ctx: EpilogueContext, params, storage, tile_coord):
        return SimpleNamespace(value=None)

    def previsit(self, ctx: EpilogueContext, state, epi_idx: int, load_stage) -> None:
        pass


def _subtile_tma(op, arg, staged, epi_tile) -> tuple:
    """(TMA atom, TMA tensor) moving one epilogue subtile of ``arg`` to or from a stage of the
    staged shared-memory layout ``staged`` (``op``: a G2S load or an S2G store)."""
    return cpasync.make_tiled_tma_atom(op, arg, cute.slice_(staged, (None, None, 0)), epi_tile)


def _coords(tile_coord, batched: bool):
    m, n, batch = tile_coord
    return (m, n, batch) if batched else (m, n)


class TileLoad(Operand):
    """A full (M, N) input tile (the "C" of a GEMM): TMA into staged shared memory, one subtile per
    load stage, read into registers so that value i lines up with the accumulator's value i."""

    kind = "tile"
    loads = True
    swizzled = True

    def __init__(self, name: str, dtype: str = "float16", *, major: str = "n", batched: bool = False):
        super().__init__(name, dtype, batched=batched)
        self.major = major

    def __repr__(self) -> str:
        return (f"TileLoad({self.name!r}, {self.dtype_name!r}, major={self.major!r}, "
                f"batched={self.batched})")

    @property
    def layout(self) -> LayoutEnum:
        return operand_layout(self.major)

    def _staged(self, shape: EpilogueShape):
        return make_epi_smem_layout(self.dtype, self.layout, shape, shape.load_stages)

    def smem_bytes(self, shape_tile, epi_tile, load_stages, store_stages) -> int:
        return input_smem_bytes(self.kind, self.dtype_name, epi_tile, load_stages)

    def load_bytes(self, epi_tile) -> int:
        return input_load_bytes(self.kind, self.dtype_name, epi_tile)

    def setup(self, shape, arg):
        return _subtile_tma(cpasync.CopyBulkTensorTileG2SOp(), arg, self._staged(shape), shape.epi_tile)

    def allocate(self, shape, params, smem):
        return allocate_staged(smem, self.dtype, self._staged(shape))

    def load_tile(self, shape, params, storage, tile_coord):
        atom, tma_tensor = params
        g_tile = cute.local_tile(tma_tensor, shape.tile, _coords(tile_coord, self.batched))
        g_epi = cute.zipped_divide(g_tile, shape.epi_tile)
        s_part, g_part = cpasync.tma_partition(
            atom, 0, cute.make_layout(1), cute.group_modes(storage, 0, 2), g_epi
        )
        return SimpleNamespace(s=s_part, g=g_part)

    def load_subtile(self, shape, params, storage, lstate, epi_idx, stage, barrier):
        atom, _ = params
        cute.copy(atom, lstate.g[(None, shape.subtile_coord(epi_idx))], lstate.s[(None, stage)],
                  tma_bar_ptr=barrier)

    def begin(self, ctx, params, storage, tile_coord):
        return SimpleNamespace(value=None, reader=ctx.smem_reader(storage, self.layout))

    def previsit(self, ctx, state, epi_idx, load_stage):
        state.value = state.reader.load(load_stage)


class _VectorLoad(Operand):
    """A vector broadcast over one tile dim, loaded by TMA into a small staged buffer and read
    through a subtile-shaped view with stride 0 along the broadcast dim."""

    loads = True

    def _box(self, shape_tile, epi_tile) -> int:  # elements TMA loads per stage
        raise NotImplementedError

    def _view_stride(self, epi_tile) -> tuple[int, int]:  # (m, n) strides of the subtile view
        raise NotImplementedError

    def _tile_coord(self, tile_coord):
        raise NotImplementedError

    def _stage_elems(self, epi_tile) -> int:
        """Elements from one stage to the next: the box rounded up so that every stage starts on a
        128 B boundary, as TMA requires of its shared-memory destination (an f16 row slice of a
        128x32 subtile is only 64 B)."""
        return vector_stage_elems(self._box((0, 0), epi_tile), self.dtype_name)

    def smem_bytes(self, shape_tile, epi_tile, load_stages, store_stages) -> int:
        return input_smem_bytes(self.kind, self.dtype_name, epi_tile, load_stages)

    def load_bytes(self, epi_tile) -> int:
        return input_load_bytes(self.kind, self.dtype_name, epi_tile)

    def setup(self, shape, arg):
        box = self._box(shape.tile, shape.epi_tile)
        atom, tma_tensor = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), arg, cute.make_layout(box), (box,)
        )
        return (atom, tma_tensor)

    def allocate(self, shape, params, smem):
        box = self._box(shape.tile, shape.epi_tile)
        layout = cute.make_layout((box, shape.load_stages), stride=(1, self._stage_elems(shape.epi_tile)))
        return smem.allocate_tensor(self.dtype, layout, VECTOR_ALIGN)

    def load_tile(self, shape, params, storage, tile_coord):
        atom, tma_tensor = params
        box = self._box(shape.tile, shape.epi_tile)
        if cutlass.const_expr(self.batched):
            tma_tensor = tma_tensor[(None, tile_coord[2])]
        span = self._span(shape)
        g_tile = cute.local_tile(tma_tensor, (span,), (self._tile_coord(tile_coord),))
        g_boxes = cute.zipped_divide(g_tile, (box,))
        s_part, g_part = cpasync.tma_partition(
            atom, 0, cute.make_layout(1), cute.group_modes(storage, 0, 1), g_boxes
        )
        return SimpleNamespace(s=s_part, g=g_part)

    def _span(self, shape) -> int:
        raise NotImplementedError

    def _box_index(self, epi_idx: int) -> int:
        raise NotImplementedError

    def load_subtile(self, shape, params, storage, lstate, epi_idx, stage, barrier):
        atom, _ = params
        cute.copy(atom, lstate.g[(None, self._box_index(epi_idx))], lstate.s[(None, stage)],
                  tma_bar_ptr=barrier)

    def begin(self, ctx, params, storage, tile_coord):
        epi_m, epi_n = ctx.shape.epi_tile
        layout = cute.make_layout((epi_m, epi_n, ctx.shape.load_stages),
                                  stride=(*self._view_stride(ctx.shape.epi_tile),
                                          self._stage_elems(ctx.shape.epi_tile)))
        view = cute.make_tensor(storage.iterator, layout)
        src = ctx.tiled_copy_r2s.get_slice(ctx.tidx).partition_S(view)
        return SimpleNamespace(value=None, src=src, frag=ctx.make_fragment(self.dtype))

    def previsit(self, ctx, state, epi_idx, load_stage):
        src = state.src[(None, None, None, load_stage)]
        for i in range(cute.size(state.frag)):
            state.frag[i] = src[i]
        state.value = state.frag.load().to(Float32)


class RowVector(_VectorLoad):
    """An (N,) vector broadcast over rows (a bias): per subtile, its epi_n values."""

    kind = "row"

    def _box(self, shape_tile, epi_tile) -> int:
        return epi_tile[1]

    def _span(self, shape) -> int:
        return shape.tile[1]

    def _tile_coord(self, tile_coord):
        return tile_coord[1]

    def _box_index(self, epi_idx: int) -> int:
        return epi_idx

    def _view_stride(self, epi_tile):
        return (0, 1)


class ColVector(_VectorLoad):
    """An (M, 1) vector broadcast over columns (a per-row scale): the tile's 128 values, loaded
    again with every subtile (512 B at most: cheaper than a second synchronisation scheme)."""

    kind = "col"

    def _box(self, shape_tile, epi_tile) -> int:
        return epi_tile[0]

    def _span(self, shape) -> int:
        return shape.tile[0]

    def _tile_coord(self, tile_coord):
        return tile_coord[0]

    def _box_index(self, epi_idx: int) -> int:
        return 0

    def _view_stride(self, epi_tile):
        return (1, 0)


class DeviceScalar(Operand):
    """A scalar in global memory (an FP8 scale): read once per tile by every thread. A per-batch
    scalar (an (L, 1, 1) tensor) arrives as an (L,) view and is read at the tile's batch."""

    kind = "scalar"

    def begin(self, ctx, params, storage, tile_coord):
        index = tile_coord[2] if cutlass.const_expr(self.batched) else 0
        return SimpleNamespace(value=params[index].to(Float32))


class ArgScalar(Operand):
    """A Python number passed at every call as a float32 kernel argument (no recompile)."""

    kind = "arg"

    def __init__(self, name: str):
        super().__init__(name, "float32", batched=False)

    def __repr__(self) -> str:
        return f"ArgScalar({self.name!r})"

    def begin(self, ctx, params, storage, tile_coord):
        return SimpleNamespace(value=params)


class TileStore(Operand):
    """An extra full-tile output: converted in registers, copied into its own staged buffer in
    postreduce (stage = the kernel's D stage) and written by TMA in tma_store, in D's bulk group."""

    kind = "store"
    swizzled = True
    layout = LayoutEnum.ROW_MAJOR

    def _staged(self, shape: EpilogueShape):
        return sm90_utils.make_smem_layout_epi(self.dtype, self.layout, shape.epi_tile, shape.store_stages)

    def smem_bytes(self, shape_tile, epi_tile, load_stages, store_stages) -> int:
        return store_smem_bytes(self.dtype_name, epi_tile, store_stages)

    def setup(self, shape, arg):
        return _subtile_tma(cpasync.CopyBulkTensorTileS2GOp(), arg, self._staged(shape), shape.epi_tile)

    def allocate(self, shape, params, smem):
        return allocate_staged(smem, self.dtype, self._staged(shape))

    def begin(self, ctx, params, storage, tile_coord):
        atom, tma_tensor = params
        shape = ctx.shape
        store_atom = sm90_utils.get_smem_store_op(self.layout, self.dtype, Float32)
        tiled_copy = cute.make_tiled_copy_S(store_atom, ctx.tiled_copy_c_atom)
        frag = ctx.make_fragment(self.dtype)
        g_tile = cute.local_tile(tma_tensor, shape.tile, _coords(tile_coord, self.batched))
        s_part, g_part = cpasync.tma_partition(
            atom, 0, cute.make_layout(1), cute.group_modes(storage, 0, 2),
            cute.zipped_divide(g_tile, shape.epi_tile),
        )
        return SimpleNamespace(
            tiled_copy=tiled_copy,
            dst=tiled_copy.get_slice(ctx.tidx).partition_D(storage),
            frag=frag,
            frag_view=tiled_copy.retile(frag),
            s=s_part,
            g=g_part,
            atom=atom,
        )

    def postreduce(self, ctx, state, epi_idx, store_stage, value) -> None:
        state.frag.store(narrow(value, self.dtype))
        cute.copy(state.tiled_copy, state.frag_view, state.dst[(None, None, None, store_stage)])

    def tma_store(self, ctx, state, epi_idx, store_stage) -> None:
        cute.copy(state.atom, state.s[(None, store_stage)], state.g[(None, ctx.shape.subtile_coord(epi_idx))])


def _pow2_padded(values: list, keys: list, identity) -> tuple[list, list]:
    """Pads slot lists to a power of two with identity values whose key (-1) marks "no slot"."""
    size = 1
    while size < len(values):
        size *= 2
    pad = size - len(values)
    return values + [identity] * pad, keys + [-1] * pad


def _reduce_scatter(values: list, keys: list, lane, offsets: tuple[int, ...], combine) -> tuple[list, list]:
    """Combines slot values across the lanes that differ in the bits of ``offsets``.

    While a lane holds several slots, each step halves them: the lane keeps one half (its bit of the
    offset says which), sends the other to its partner, and combines what it receives into the half
    it kept. ``keys`` (which slot a value belongs to) ride along. Once one slot is left, the remaining
    steps combine it whole (every lane of the pair then holds the same value). Compared with every
    lane reducing every slot, this needs S - 1 shuffles for S slots instead of S per step.
    """
    for offset in offsets:
        if len(values) > 1:
            half = len(values) // 2
            upper = (lane & offset) != 0
            kept_values, kept_keys = [], []
            for i in range(half):
                low, high = values[i], values[i + half]
                send = cutlass.select_(upper, low, high)
                keep = cutlass.select_(upper, high, low)
                received = cute.arch.shuffle_sync_bfly(send, offset=offset)
                kept_values.append(combine(keep, received))
                kept_keys.append(cutlass.select_(upper, Int32(keys[i + half]), Int32(keys[i])))
            values, keys = kept_values, kept_keys
        else:
            values = [combine(v, cute.arch.shuffle_sync_bfly(v, offset=offset)) for v in values]
    return values, keys


class _Reduction(Operand):
    """Partials of a reduction (``sum``, ``max`` or ``min``) of a tile value, written per tile to a
    float32 workspace that the host finishes (:mod:`evtc.runtime.reductions`: a fixed order, deterministic).

    Values outside the problem (rows past M, columns past N of ragged tiles) count as the
    reduction's identity (0 or -/+inf), never as whatever the accumulator or TMA put there. Stores
    have no branch (this code is traced into the kernel, not preprocessed DSL source): a thread with
    nothing to write stores to the workspace's spare last element.
    """

    kind = "reduction"
    IDENTITY = {"sum": 0.0, "max": float("-inf"), "min": float("inf")}  # the IR's reduce kinds

    def __init__(self, name: str, op: str, *, batched: bool = False):
        super().__init__(name, "float32", batched=batched)
        if op not in self.IDENTITY:
            raise ValueError(f"{type(self).__name__}: op must be one of {sorted(self.IDENTITY)}, got {op!r}")
        self.op = op

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.op!r}, batched={self.batched})"

    def _combine(self, x, y):
        if self.op == "sum":
            return x + y
        # NaN-propagating (FMNMX.NaN), as torch.amax: the plain form drops a NaN for the other operand.
        if self.op == "max":
            return cute.arch.fmax(x, y, nan=True)
        return cute.arch.fmin(x, y, nan=True)

    def _identity(self):
        return Float32(self.IDENTITY[self.op])

    def begin(self, ctx, params, storage, tile_coord):
        workspace, m_size, n_size, tiles_m, tiles_n = params
        return SimpleNamespace(workspace=workspace, m_size=m_size, n_size=n_size, tiles_m=tiles_m,
                               tiles_n=tiles_n, pattern=ctx.fragment_pattern(), tile=tile_coord,
                               value=ctx.make_fragment(Float32),
                               spare=cute.size(workspace) - 1)


class ReductionOverN(_Reduction):
    """Per-tile partials of a reduction over N: the workspace holds (L, n tiles, M) values.

    Each thread folds its fragment into a fragment-shaped register tensor, subtile after subtile
    (value ``k`` stays in its row as the subtile moves along N). At the end of the tile it folds its
    values row by row (its rows are known when tracing, see ``fragment_pattern``), the 4 lanes of a
    quad, which hold the same rows, combine them (each lane ends with one row), and each lane
    stores its row's partial at (batch, n tile, row).
    """

    def begin(self, ctx, params, storage, tile_coord):
        state = super().begin(ctx, params, storage, tile_coord)
        state.partial = ctx.make_fragment(Float32)
        state.partial.fill(self.IDENTITY[self.op])
        corners = state.pattern.corners
        if any(corners[t][0] != corners[t - t % 4][0] for t in corners):
            raise AssertionError("ReductionOverN: the lanes of a quad do not share rows")
        return state

    def accumulate(self, ctx, state, epi_idx: int, value) -> None:
        state.value.store(value)
        pattern = state.pattern
        first_col = state.tile[1] * ctx.shape.tile[1] + epi_idx * ctx.shape.epi_tile[1] + pattern.base_col
        room = state.n_size - first_col  # columns left in the problem, from this thread's first
        inside = {c: c < room for c in sorted(set(pattern.cols))}
        identity = self._identity()
        for k in range(cute.size(state.partial)):  # unrolled at trace time
            masked = cutlass.select_(inside[pattern.cols[k]], state.value[k], identity)
            state.partial[k] = self._combine(state.partial[k], masked)

    def end(self, ctx, state) -> None:
        pattern = state.pattern
        row_offsets = sorted(set(pattern.rows))
        totals = []
        for r in row_offsets:
            ks = [k for k, rk in enumerate(pattern.rows) if rk == r]
            total = state.partial[ks[0]]
            for k in ks[1:]:
                total = self._combine(total, state.partial[k])
            totals.append(total)
        totals, keys = _pow2_padded(totals, row_offsets, self._identity())
        totals, keys = _reduce_scatter(totals, keys, cute.arch.lane_idx(), (2, 1), self._combine)
        m = state.tile[0] * ctx.shape.tile[0] + pattern.base_row + keys[0]
        base = state.m_size * (state.tile[1] + state.tiles_n * state.tile[2])
        index = cutlass.select_(m < state.m_size, base + m, state.spare)
        # Tiles of a cluster that overhangs the problem along N still run: not theirs to write.
        index = cutlass.select_(state.tile[1] < state.tiles_n, index, state.spare)
        index = cutlass.select_(Int32(keys[0]) >= 0, index, state.spare)
        state.workspace[index] = totals[0]


class ReductionOverM(_Reduction):
    """Per-tile partials of a reduction over M: the workspace holds (L, m tiles, N) values.

    Per subtile, each thread folds its values column by column (rows past M masked) and keeps the
    column totals in registers. At the end of the tile the 8 lanes of a warp that hold the same
    columns (lanes equal mod 4) combine the totals of every subtile at once (three rounds of
    independent shuffles; each lane ends with an eighth of its columns) and write them to shared
    memory, one row of the tile's columns per warp. After a barrier, each thread adds up one column
    over the warps, in a fixed order, and stores the tile's partial; a second barrier keeps the
    buffer until every thread has read it. The host reduces over the m tiles.
    """

    #: Warp rows of the shared buffer: 4 warps x 2 warpgroups (pingpong) or 8 warps (cooperative).
    WARP_ROWS = COLUMN_REDUCTION_WARP_ROWS

    def _columns(self, tile_n: int) -> int:
        return column_reduction_columns(tile_n)  # the last column: where padding slots write (never read)

    def smem_bytes(self, shape_tile, epi_tile, load_stages, store_stages) -> int:
        return reduction_smem_bytes("ReductionOverM", shape_tile[1])

    def allocate(self, shape, params, smem):
        columns = self._columns(shape.config.tile_n)
        layout = cute.make_layout((columns, self.WARP_ROWS), stride=(1, columns))
        return smem.allocate_tensor(Float32, layout, VECTOR_ALIGN)

    def begin(self, ctx, params, storage, tile_coord):
        state = super().begin(ctx, params, storage, tile_coord)
        corners = state.pattern.corners
        if any(corners[t][1] != corners[t % 4][1] for t in corners):
            raise AssertionError("ReductionOverM: lanes equal mod 4 do not share columns")
        warps = ctx.shape.num_threads // 32
        if warps * ctx.shape.config.epi_groups != self.WARP_ROWS:
            raise AssertionError(f"ReductionOverM: {warps} warps x {ctx.shape.config.epi_groups} epilogues")
        # Rows past M (ragged or overhanging tiles): masked once per tile, for every subtile.
        pattern = state.pattern
        room = state.m_size - (state.tile[0] * ctx.shape.tile[0] + pattern.base_row)
        state.row_inside = {r: r < room for r in sorted(set(pattern.rows))}
        state.buffer = storage
        state.first_row = ctx.group * warps  # this epilogue's rows of the shared buffer
        state.warp = ctx.tidx // 32
        # Column totals of the subtiles so far (Python lists of traced values: the subtile loop is
        # unrolled), keyed by the column's offset in the tile from this thread's first column.
        state.totals, state.keys = [], []
        return state

    def accumulate(self, ctx, state, epi_idx: int, value) -> None:
        state.value.store(value)
        pattern = state.pattern
        identity = self._identity()
        for c in sorted(set(pattern.cols)):
            total = identity
            for k, ck in enumerate(pattern.cols):
                if ck == c:
                    masked = cutlass.select_(state.row_inside[pattern.rows[k]], state.value[k], identity)
                    total = self._combine(total, masked)
            state.totals.append(total)
            state.keys.append(epi_idx * ctx.shape.epi_tile[1] + c)

    def end(self, ctx, state) -> None:
        tile_n = ctx.shape.tile[1]
        spare_column = self._columns(ctx.shape.config.tile_n) - 1
        totals, keys = _pow2_padded(state.totals, state.keys, self._identity())
        totals, keys = _reduce_scatter(totals, keys, cute.arch.lane_idx(), (16, 8, 4), self._combine)
        row = state.first_row + state.warp
        for total, key in zip(totals, keys, strict=True):
            column = cutlass.select_(Int32(key) >= 0, state.pattern.base_col + key, Int32(spare_column))
            state.buffer[column, row] = total
        ctx.barrier.arrive_and_wait()
        # Each thread: one column of the tile (more where the tile is wider than the threads).
        threads = ctx.shape.num_threads
        warps = threads // 32
        n0 = state.tile[1] * tile_n
        base = (state.tile[2] * state.tiles_m + state.tile[0]) * state.n_size
        for first in range(0, tile_n, threads):
            column = ctx.tidx + first
            inside = column < tile_n
            read = cutlass.select_(inside, column, Int32(0))
            total = state.buffer[read, state.first_row]
            for w in range(1, warps):  # a fixed order: deterministic
                total = self._combine(total, state.buffer[read, state.first_row + w])
            n = n0 + column
            index = cutlass.select_(n < state.n_size, base + n, state.spare)
            index = cutlass.select_(inside, index, state.spare)
            # Tiles of a cluster that overhangs the problem along M still run: not theirs to write.
            index = cutlass.select_(state.tile[0] < state.tiles_m, index, state.spare)
            state.workspace[index] = total
        ctx.barrier.arrive_and_wait()  # the buffer is free for the next tile


class KernelFinish(Operand):
    """The kernel's own finish of the reductions along one axis, and of the outputs computed from
    them by the visitor's ``method`` (see :class:`evtc.codegen.emit.FinishPlan`). Axes: ``row`` (the
    reductions over N, one value per row), ``col`` (over M, one value per column), ``batch`` (one
    value per batch) and ``all`` (one value).

    Every tile counts itself in an int32 counter per block of rows (a row of tiles) or of columns
    once its partials are stored (a barrier, then one acquire-release atomic by one thread). The
    tile that brings the count to the number of tiles in the block is the last: it combines the
    block's partials, tile after tile in a fixed order (the result is the same bit for bit on every
    run), then

    * ``row`` / ``col``: runs ``method`` on each row's (column's) totals and the per-tile values it
      reads, and stores the outputs;
    * ``batch`` / ``all`` (reductions over N whose rows are reduced too): combines its block's row
      totals across the threads in a fixed order (shuffles within a warp, then the warps in order
      through shared memory), stores the block's value in the reduction's workspace after the
      partials, and counts the block in a second counter, per batch or one for everything. The
      block that completes it combines the blocks' values the same way, and one thread runs
      ``method`` and stores the outputs.

    Every last tile sets its counter back to 0 for the next launch. The counters are laid out as
    (L, m tiles) for rows, then (L, n tiles) for columns, then the two levels of ``batch``, (L, m
    tiles) and (L), then those of ``all``, (L, m tiles) and (1).

    Kernel parameters: (counters, outputs (flat, one value per row, column or batch, or one), M, N,
    m tiles, n tiles, L). A single counter turns the finish off for the launch (the host then
    finishes from the partials, see :mod:`evtc.runtime.reductions`).
    """

    kind = "finish"
    #: Tiles' partials each thread loads per step before it combines them: loads in flight, not one
    #: at a time.
    UNROLL = 8
    AXES = ("row", "col", *TWO_LEVEL_FINISH_AXES)
    #: Consumer warps' rows of the shared buffer through which a block's rows are combined.
    WARP_ROWS = COLUMN_REDUCTION_WARP_ROWS

    def __init__(self, axis: str, method: str, reductions: tuple[str, ...], params: tuple[str, ...],
                 outputs: tuple[str, ...]):
        super().__init__(f"finish_{axis}")
        if axis not in self.AXES:
            raise ValueError(f"KernelFinish: axis must be one of {self.AXES}, got {axis!r}")
        self.axis = axis
        self.two_level = axis in TWO_LEVEL_FINISH_AXES
        self.method = method
        self.reductions = tuple(reductions)
        self.params = tuple(params)
        self.outputs = tuple(outputs)

    def __repr__(self) -> str:
        return (f"KernelFinish({self.axis!r}, {self.method!r}, {self.reductions!r}, {self.params!r}, "
                f"{self.outputs!r})")

    def smem_bytes(self, shape_tile, epi_tile, load_stages, store_stages) -> int:
        return finish_smem_bytes(self.axis, len(self.reductions))

    def allocate(self, shape, params, smem):
        if not self.two_level:
            return smem.allocate_tensor(Int32, cute.make_layout(FINISH_FLAGS), 16)
        flags = smem.allocate_tensor(Int32, cute.make_layout(2 * FINISH_FLAGS), 16)
        rows = cute.make_layout((self.WARP_ROWS, len(self.reductions)), stride=(len(self.reductions), 1))
        return flags, smem.allocate_tensor(Float32, rows, VECTOR_ALIGN)

    def begin(self, ctx, params, storage, tile_coord):
        counters, outputs, m_size, n_size, tiles_m, tiles_n, batches = params
        flags, warp_rows = storage if self.two_level else (storage, None)
        return SimpleNamespace(value=None, counters=counters, outputs=outputs, m_size=m_size,
                               n_size=n_size, tiles_m=tiles_m, tiles_n=tiles_n, batches=batches,
                               flags=flags, warp_rows=warp_rows, tile=tile_coord)

    def _two_level_counters(self, state):
        """Where this finish's counters start: after the rows' (L x m tiles) and the columns' (L x n
        tiles); a finish per batch first, (L x m tiles) then (L), then one over everything, (L x m
        tiles) then (1)."""
        start = state.batches * (state.tiles_m + state.tiles_n)
        if cutlass.const_expr(self.axis == "all"):
            start = start + state.batches * (state.tiles_m + 1)
        return start

    @cute.jit
    def _count(self, ctx, state, counter, arrivals, inside, flag: int):
        """Counts this tile (block) in ``counter`` if ``inside``; every thread of the epilogue then
        learns from ``state.flags[flag]`` whether it was the last of ``arrivals``."""
        if ctx.tidx == 0:
            last = Int32(0)
            if inside:
                before = cute.arch.atomic_add(state.counters.iterator + counter, Int32(1), sem="acq_rel",
                                              scope="gpu")
                if before == arrivals - 1:
                    last = Int32(1)
            state.flags[flag] = last
        ctx.barrier.arrive_and_wait()

    def _across_threads(self, ctx, state, reductions: list, mine):
        """Every reduction's values of this epilogue's threads (``mine``) combined in a fixed
        order: the 32 lanes of each warp by butterfly shuffles (every lane ends with the same
        bits), then the warps in order through shared memory. Every thread gets the totals."""
        warps = ctx.shape.num_threads // 32
        first_row = ctx.group * warps
        for i, r in enumerate(reductions):
            value = mine[i]
            for offset in (16, 8, 4, 2, 1):
                value = r._combine(value, cute.arch.shuffle_sync_bfly(value, offset=offset))
            state.warp_rows[first_row + ctx.tidx // 32, i] = value  # every lane: the same value
        ctx.barrier.arrive_and_wait()
        totals = cute.make_rmem_tensor((len(reductions),), Float32)
        for i, r in enumerate(reductions):
            total = state.warp_rows[first_row, i]
            for w in range(1, warps):
                total = r._combine(total, state.warp_rows[first_row + w, i])
            totals[i] = total
        return totals

    @cute.jit
    def finish(self, ctx, state, reductions: list, reduction_states: list, compute, values: list):
        """After this tile's partials of ``reductions`` (this axis's, with their states) are stored:
        count the tile, and if it is its block's last, finish the block (``compute``: the
        visitor's finish method; ``values``: the per-tile values it takes after the totals)."""
        m_tile, n_tile, batch = state.tile
        threads = ctx.shape.num_threads
        if cutlass.const_expr(self.axis == "col"):
            block = state.batches * state.tiles_m + batch * state.tiles_n + n_tile
            arrivals = state.tiles_m
            extent = ctx.shape.tile[1]
            first = n_tile * extent
            size = state.n_size
            stride = state.n_size
        else:
            # Blocks of rows: per row, or the first level of a finish per batch or over everything
            # (its own counters, after the rows' and the columns').
            block = batch * state.tiles_m + m_tile
            if cutlass.const_expr(self.two_level):
                block = block + self._two_level_counters(state)
            arrivals = state.tiles_n  # tiles per block of rows
            extent = ctx.shape.tile[0]
            first = m_tile * extent
            size = state.m_size
            stride = state.m_size  # from one tile's partials of a row to the next tile's
        # Tiles of a cluster that overhangs the problem run but are not counted (nor stored). A
        # launch whose reductions the host finishes passes one counter (a real launch has at least
        # two blocks): then no tile counts or finishes.
        inside = (m_tile < state.tiles_m) & (n_tile < state.tiles_n) & (cute.size(state.counters) > 1)
        # The barrier orders every thread's partials before thread 0's count, whose release (at GPU
        # scope, cumulative) publishes them all: no fence per thread on every tile.
        ctx.barrier.arrive_and_wait()
        self._count(ctx, state, block, arrivals, inside, ctx.group)
        if state.flags[ctx.group] != 0:
            cute.arch.fence_acq_rel_gpu()  # the other tiles' partials, as they published them
            mine = cute.make_rmem_tensor((len(reductions),), Float32)  # two levels: my rows' totals
            for i, r in enumerate(reductions):
                mine[i] = r._identity()
            for start in cutlass.range_constexpr(0, extent, threads):
                offset = start + ctx.tidx
                index = first + offset
                if (offset < extent) & (index < size):
                    if cutlass.const_expr(self.axis == "col"):
                        base = state.n_size * state.tiles_m * batch + index
                    else:
                        base = state.m_size * state.tiles_n * batch + index
                    # One pass over the tiles for every reduction at once: their loads are
                    # independent, so each unrolled step has UNROLL x reductions of them in flight.
                    totals = cute.make_rmem_tensor((len(reductions),), Float32)
                    for i, r in enumerate(reductions):
                        totals[i] = r._identity()
                    for t in cutlass.range(arrivals, unroll=self.UNROLL):
                        for i, (r, rs) in enumerate(zip(reductions, reduction_states, strict=True)):
                            totals[i] = r._combine(totals[i], rs.workspace[base + t * stride])
                    if cutlass.const_expr(self.two_level):
                        for i, r in enumerate(reductions):
                            mine[i] = r._combine(mine[i], totals[i])
                    else:
                        results = compute(*[totals[i] for i in range(len(reductions))], *values)
                        for out, value in zip(state.outputs, results, strict=True):
                            out[batch * size + index] = narrow(value, out.element_type)
            if cutlass.const_expr(self.two_level):
                self._second_level(ctx, state, reductions, reduction_states, compute, values, mine)
            if ctx.tidx == 0:
                state.counters[block] = Int32(0)  # every tile of the block has counted: reuse it

    @cute.jit
    def _second_level(self, ctx, state, reductions: list, reduction_states: list, compute, values: list,
                      mine):
        """The last tile of a block of rows, for a finish per batch or over everything: its block's
        value, then the second count, and the finish if this block completes it."""
        m_tile, _, batch = state.tile
        threads = ctx.shape.num_threads
        block_totals = self._across_threads(ctx, state, reductions, mine)
        # The blocks' values: after the partials in each reduction's workspace, (L, m tiles).
        values_at = state.m_size * state.tiles_n * state.batches
        counter = self._two_level_counters(state) + state.batches * state.tiles_m
        if cutlass.const_expr(self.axis == "batch"):
            counter = counter + batch
            blocks = state.tiles_m
            first = batch * state.tiles_m
        else:
            blocks = state.batches * state.tiles_m
            first = 0
        if ctx.tidx == 0:
            for i, rs in enumerate(reduction_states):
                rs.workspace[values_at + batch * state.tiles_m + m_tile] = block_totals[i]
        # Thread 0 wrote the block's values before its own count releases them.
        self._count(ctx, state, counter, blocks, True, FINISH_FLAGS + ctx.group)
        if state.flags[FINISH_FLAGS + ctx.group] != 0:
            cute.arch.fence_acq_rel_gpu()  # the other blocks' values
            totals = cute.make_rmem_tensor((len(reductions),), Float32)
            for i, r in enumerate(reductions):
                totals[i] = r._identity()
            # A fixed share of the blocks per thread, in order (unrolled: loads in flight).
            for j in cutlass.range(ctx.tidx, blocks, threads, unroll=self.UNROLL):
                for i, (r, rs) in enumerate(zip(reductions, reduction_states, strict=True)):
                    totals[i] = r._combine(totals[i], rs.workspace[values_at + first + j])
            totals = self._across_threads(ctx, state, reductions, totals)
            if ctx.tidx == 0:
                results = compute(*[totals[i] for i in range(len(reductions))], *values)
                if cutlass.const_expr(self.axis == "batch"):
                    at = batch
                else:
                    at = Int32(0)
                for out, value in zip(state.outputs, results, strict=True):
                    out[at] = narrow(value, out.element_type)
                state.counters[counter] = Int32(0)


def construct(texts: list[str]) -> list[Operand]:
    """Operand objects from the constructor expressions the code generator writes into a visitor's
    source (:func:`evtc.codegen.emit.operand_constructors`)."""
    return [eval(text, dict(globals())) for text in texts]  # noqa: S307 - evtc's own generated text


__all__ = [
    "ArgScalar",
    "ColVector",
    "DeviceScalar",
    "KernelFinish",
    "Operand",
    "ReductionOverM",
    "ReductionOverN",
    "RowVector",
    "TileLoad",
    "TileStore",
    "construct",
    "dsl_dtype",
]

