"""The epilogue visitor protocol: the one seam between the GEMM kernel and what happens to its output.

The kernel (:mod:`evtc.sm90.gemm`) owns the mainloop, the D staging buffers and the D TMA
store.  Everything else about the epilogue -- extra inputs (C, vectors, scalars), the arithmetic,
extra outputs -- belongs to one :class:`EpilogueVisitor` object.  The kernel calls its hooks at fixed
points, the same points where CUTLASS's SM90 TMA warp-specialized collective epilogue calls its
fusion callbacks.  A visitor never edits the kernel, so a code generator can emit visitor classes
as plain Python source.  ``docs/kernel.md`` describes the protocol for readers; the docstrings below
are the reference.

Three kinds of hook, by where they run:

Host, plain Python (before tracing; results must be deterministic for a given visitor source):
    ``smem_bytes``, ``load_bytes``, ``offers_d_buffer``.
Host, traced (inside the ``@cute.jit`` launch function):
    ``setup`` -- turns the runtime arguments into kernel parameters (TMA atoms, tensors, scalars).
Device (inside the kernel, traced by the CuTe DSL):
    ``allocate`` (all threads), ``load_tile`` / ``load_subtile`` (epilogue-load warp),
    ``begin`` .. ``end`` (the 256 epilogue threads).

Device hooks run inside the kernel's unrolled subtile loop: ``epi_idx`` is a Python ``int``, and a
visitor may keep per-tile Python state (register fragments, partitioned tensors) in the object that
``begin`` returns.  Stage indices and tile coordinates are runtime ``Int32`` values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warp
from cutlass.tensor_utils import LayoutEnum

from evtc.plan.config import GemmConfig
from evtc.sm90.dtypes import cutlass_dtype


@dataclass(frozen=True)
class EpilogueShape:
    """Static facts about the epilogue that a visitor may rely on (host and device).

    ``tile``: output tile of one epilogue, (128, tile_n): of a CTA under the cooperative schedule,
    of one consumer warpgroup under pingpong (``num_threads`` is then 128, and ``store_stages`` and
    ``load_stages`` count both warpgroups' buffers; each uses its own half).
    ``epi_tile``: (tile rows, epi_n) subtile; the tile is walked in ``num_subtiles`` subtiles
    along N, subtile ``i`` covering columns
    ``[i * epi_n, (i + 1) * epi_n)`` of the tile.  ``load_stages``: shared-memory stages a visitor
    should give each loaded operand (the epilogue-load pipeline has this many).  ``store_stages``:
    number of D staging buffers (a visitor with extra TMA stores should stage its own outputs the
    same way: its buffer index is the ``store_stage`` the kernel passes).
    """

    config: GemmConfig
    tile: tuple[int, int]
    epi_tile: tuple[int, int]
    num_subtiles: int
    load_stages: int
    store_stages: int
    acc_dtype: type
    d_dtype: type
    d_layout: LayoutEnum
    num_threads: int = 256  # epilogue threads: the two consumer warpgroups

    def subtile_coord(self, epi_idx: int) -> tuple[int, int]:
        """(row, column) of subtile ``epi_idx`` in the grid of subtiles of one tile."""
        return (0, epi_idx)


@dataclass(frozen=True)
class FragmentPattern:
    """See :meth:`EpilogueContext.fragment_pattern`. ``corners``: the static (row, column) of value 0
    of a sample of threads (for checks of which lanes share rows or columns)."""

    rows: tuple[int, ...]
    cols: tuple[int, ...]
    base_row: Any
    base_col: Any
    corners: dict[int, tuple[int, int]]


class EpilogueContext:
    """Device-side helpers handed to every consumer hook.

    Attributes a visitor may use:

    * ``shape``: the :class:`EpilogueShape`.
    * ``tidx``: this thread's index among the ``shape.num_threads`` epilogue threads (``Int32``).
    * ``tiled_mma``: the kernel's tiled MMA (for partitioning tile-shaped data like the accumulator).
    * ``tiled_copy_r2s``: the register-to-shared copy used for D; its ``retile`` / partitions define
      where each fragment value lives in the subtile.
    * ``fragment_layout``: layout of the per-thread subtile fragment passed to ``visit``.
    * ``barrier``: a named barrier over the ``shape.num_threads`` epilogue threads
      (``arrive_and_wait()``).
    * ``group``: which of the concurrent epilogues this is (``Int32``): the consumer warpgroup under
      pingpong (each has its own share of a visitor's shared-memory scratch), 0 under cooperative.
    """

    def __init__(self, shape: EpilogueShape, tidx, tiled_mma, tiled_copy_c_atom, tiled_copy_r2s,
                 fragment_layout, barrier, group=0):
        self.shape = shape
        self.tidx = tidx
        self.group = group
        self.tiled_mma = tiled_mma
        self.tiled_copy_c_atom = tiled_copy_c_atom
        self.tiled_copy_r2s = tiled_copy_r2s
        self.fragment_layout = fragment_layout
        self.barrier = barrier

    def make_fragment(self, dtype=Float32) -> cute.Tensor:
        """A register tensor shaped like the per-thread subtile fragment."""
        return cute.make_rmem_tensor(self.fragment_layout.shape, dtype)

    def fragment_coords(self) -> tuple[list, list]:
        """(rows, cols): for each value ``k`` of the fragment given to ``visit``, its row and column
        within the subtile (``Int32``; they depend on the thread). Built like
        :class:`SmemFragmentReader`'s copy, on an identity tensor instead of shared memory."""
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=64)
        tiled_copy = cute.make_tiled_copy_S(atom, self.tiled_copy_c_atom)
        thr_copy = tiled_copy.get_slice(self.tidx)
        coords = thr_copy.partition_S(cute.make_identity_tensor(self.shape.epi_tile))
        frag_view = thr_copy.retile(self.make_fragment(Float32))
        size = cute.size(self.fragment_layout)
        rows: list = [None] * size
        cols: list = [None] * size
        for i in range(cute.size(coords)):
            k = frag_view.layout(i)  # where copy element i lands in the fragment (static)
            m, n = coords[i]
            rows[k], cols[k] = m, n
        return rows, cols

    def thread_coords(self, thread: int) -> list[tuple[int, int]]:
        """For a thread given as a Python ``int``: the (row, column) of each fragment value, as Python
        ints (the layouts are static, so this is plain arithmetic at trace time)."""
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=64)
        thr_copy = cute.make_tiled_copy_S(atom, self.tiled_copy_c_atom).get_slice(thread)
        coords = thr_copy.partition_S(cute.make_identity_tensor(self.shape.epi_tile))
        frag_view = thr_copy.retile(self.make_fragment(Float32))
        result: list = [None] * cute.size(self.fragment_layout)
        for i in range(cute.size(coords)):
            m, n = coords[i]
            result[frag_view.layout(i)] = (int(m), int(n))
        return result

    def fragment_pattern(self) -> FragmentPattern:
        """This thread's fragment as one dynamic corner plus static offsets: value ``k`` sits at
        ``(base_row + rows[k], base_col + cols[k])``, the offsets being the same for every thread.

        Reductions rely on it to group values by row or column when tracing, with no runtime
        selects. The shape is checked on a sample of threads (the wgmma accumulator layout has it);
        a layout without it fails here, at compile time."""
        first = self.thread_coords(0)
        rows = tuple(m - first[0][0] for m, _ in first)
        cols = tuple(n - first[0][1] for _, n in first)
        corners = {}
        threads = self.shape.num_threads
        sample = {t for t in (0, 1, 2, 3, 4, 5, 8, 16, 31, 32, 33, 36, 64, threads - 1) if t < threads}
        sample |= {t - t % 4 for t in sample}  # each quad's first lane, for the reductions' checks
        for t in sorted(sample):
            coords = self.thread_coords(t)
            corner = coords[0]
            if any((m - corner[0], n - corner[1]) != (r, c)
                   for (m, n), r, c in zip(coords, rows, cols, strict=True)):
                raise AssertionError(f"epilogue fragment of thread {t} is not a shifted copy of thread 0's")
            corners[t] = corner
        dyn_rows, dyn_cols = self.fragment_coords()
        return FragmentPattern(rows, cols, dyn_rows[0], dyn_cols[0], corners)

    def smem_reader(self, staged: cute.Tensor, layout: LayoutEnum) -> SmemFragmentReader:
        """A reader of a staged (epi_m, epi_n, stages) shared-memory operand into fragments that line
        up value for value with the accumulator fragment given to ``visit``."""
        return SmemFragmentReader(self, staged, layout)


class SmemFragmentReader:
    """Copies one stage of a subtile-shaped shared-memory buffer into a register fragment.

    16-bit data uses ``ldmatrix`` (transposed for M-major data), other widths plain shared loads.
    The copy is built on the same thread/value tiling as the D store (``tiled_copy_c_atom``), so the
    fragment's value ``i`` sits at the same (row, column) as value ``i`` of the accumulator fragment.
    """

    def __init__(self, ctx: EpilogueContext, staged: cute.Tensor, layout: LayoutEnum):
        dtype = staged.element_type
        epi_n = ctx.shape.epi_tile[1]
        if dtype.width == 16:
            atom = cute.make_copy_atom(
                warp.LdMatrix8x8x16bOp(layout.is_m_major_c(), 4 if epi_n % 16 == 0 else 2), dtype
            )
        else:
            atom = cute.make_copy_atom(
                cute.nvgpu.CopyUniversalOp(),
                dtype,
                num_bits_per_copy=(1 if layout.is_m_major_c() else 2) * dtype.width,
            )
        self.dtype = dtype
        self.tiled_copy = cute.make_tiled_copy_S(atom, ctx.tiled_copy_c_atom)
        thr_copy = self.tiled_copy.get_slice(ctx.tidx)
        self.src = thr_copy.partition_S(staged)
        self.frag = cute.make_rmem_tensor(ctx.fragment_layout.shape, dtype)
        self.frag_view = thr_copy.retile(self.frag)

    def load(self, stage) -> cute.TensorSSA:
        """Read stage ``stage`` and return the fragment as float32 values."""
        cute.copy(self.tiled_copy, self.src[None, None, None, stage], self.frag_view)
        return self.frag.load().to(Float32)


# ---- helpers for visitors that load full-tile operands by TMA ----------------------------------------


def operand_layout(major: str) -> LayoutEnum:
    """LayoutEnum of an (M, N) operand: ``"n"`` (row-major) or ``"m"`` (column-major)."""
    return LayoutEnum.ROW_MAJOR if major == "n" else LayoutEnum.COL_MAJOR


def make_epi_smem_layout(dtype, layout: LayoutEnum, shape: EpilogueShape, stages: int):
    """Swizzled, staged (epi_m, epi_n, stages) shared-memory layout for a subtile-shaped operand."""
    return sm90_utils.make_smem_layout_epi(dtype, layout, shape.epi_tile, stages)


def smem_layout_bytes(dtype_name: str, shape_tile: tuple[int, int], stages: int) -> int:
    from evtc.plan.config import DTYPE_BYTES

    return shape_tile[0] * shape_tile[1] * DTYPE_BYTES[dtype_name] * stages


def allocate_staged(smem, dtype, staged_layout) -> cute.Tensor:
    """Allocate a swizzled staged buffer (1024 B aligned, as the 128 B swizzle needs)."""
    return smem.allocate_tensor(dtype, staged_layout.outer, 1024, swizzle=staged_layout.inner)


class TmaTileLoad:
    """A full-tile (M, N, L) operand loaded by TMA one subtile at a time.

    Host side (``setup``): ``TmaTileLoad.make(tensor, staged_layout, shape)`` builds the TMA atom;
    its ``atom`` and ``tensor`` go into the visitor's kernel parameters.  Device side:
    ``partition(atom, tensor, smem, tile_coord, shape)`` then ``copy(epi_idx, stage, barrier)``.
    """

    @staticmethod
    def make(tensor: cute.Tensor, staged_layout, shape: EpilogueShape):
        one_stage = cute.slice_(staged_layout, (None, None, 0))
        atom, tma_tensor = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), tensor, one_stage, shape.epi_tile
        )
        return atom, tma_tensor

    def __init__(self, atom, tma_tensor: cute.Tensor, smem: cute.Tensor, tile_coord, shape: EpilogueShape):
        self.atom = atom
        g_tile = cute.local_tile(tma_tensor, shape.tile, (tile_coord[0], tile_coord[1], tile_coord[2]))
        g_epi = cute.zipped_divide(g_tile, shape.epi_tile)
        self.s_part, self.g_part = cpasync.tma_partition(
            atom, 0, cute.make_layout(1), cute.group_modes(smem, 0, 2), g_epi
        )
        self.shape = shape

    def copy(self, epi_idx: int, stage, barrier_ptr) -> None:
        cute.copy(
            self.atom,
            self.g_part[(None, self.shape.subtile_coord(epi_idx))],
            self.s_part[(None, stage)],
            tma_bar_ptr=barrier_ptr,
        )


class EpilogueVisitor:
    """Base class of every epilogue.  Each hook below has a do-nothing default.

    Subclasses set ``name`` and override what they need.  The kernel calls, for every output tile
    (consumer side, the 256 epilogue threads, all of them)::

        state = begin(ctx, params, storage, tile_coord)
        begin_loop(ctx, state, 0)
        previsit(ctx, state, 0, load_stage)            # loads of subtile 0 have landed in smem
        for epi_idx in range(num_subtiles):          # unrolled: epi_idx is a Python int
            values = visit(ctx, state, epi_idx, acc)   # float32 TensorSSA in, float32 TensorSSA out
            if epi_idx + 1 < num_subtiles:             # the next subtile's inputs, read early
                begin_loop(ctx, state, epi_idx + 1)
                previsit(ctx, state, epi_idx + 1, next_load_stage)
            # kernel: wait for the D buffer to be free, then barrier
            reduce(ctx, state, epi_idx, scratch)       # scratch: this subtile's D buffer (smem)
            # kernel: convert values to D's dtype, stmatrix into the D buffer
            postreduce(ctx, state, epi_idx, store_stage)
            # kernel: fence_view_async_shared, barrier, then in the store warp only:
            #   TMA store of D, tma_store(ctx, state, epi_idx, store_stage), commit
            end_loop(ctx, state, epi_idx)
        end(ctx, state)

    and, on the producer side (warp 1, all 32 lanes; only if ``load_bytes() > 0``)::

        lstate = load_tile(ctx, params, storage, tile_coord)
        for epi_idx in range(num_subtiles):
            # kernel: wait for a free load stage, arm its barrier with load_bytes() bytes
            load_subtile(ctx, params, storage, lstate, epi_idx, stage, barrier)
    """

    name = "visitor"

    # ---- host, plain Python --------------------------------------------------------------------
    def smem_bytes(self, config: GemmConfig, load_stages: int) -> int:
        """Shared memory the visitor allocates in ``allocate`` (bytes, including its own staging)."""
        return 0

    def load_bytes(self, config: GemmConfig) -> int:
        """Bytes that TMA writes per subtile stage in ``load_subtile`` (0: the visitor loads nothing).

        The kernel arms the epilogue-load barrier with exactly this count; a mismatch hangs."""
        return 0

    def offers_d_buffer(self, config: GemmConfig) -> bool:
        """Whether the kernel may stage D in one of this visitor's loaded tile buffers (returned by
        ``d_buffer``).  That buffer must have exactly D's staged layout (D's dtype and major,
        ``shape.load_stages`` stages of ``epi_tile``), and the visitor must stage no outputs of its
        own.  The kernel takes the offer under :meth:`GemmConfig.shares_d_with_load`: subtile ``i``
        of D is then written where subtile ``i`` of the input was, after every thread has read it,
        and the stage returns to the loader only once the D store has read it out."""
        return False

    # ---- host, traced --------------------------------------------------------------------------
    def setup(self, shape: EpilogueShape, args: tuple) -> tuple:
        """Build the kernel parameters (TMA atoms, TMA tensors, scalars) from ``args``.  Runs inside
        the jit launch function; the returned tuple reaches every device hook as ``params``."""
        return ()

    # ---- device: all threads, before the roles split ----------------------------------------------
    def allocate(self, shape: EpilogueShape, params: tuple, smem) -> Any:
        """Allocate shared memory with ``smem`` (a ``cutlass.memory.SmemAllocator``); return it.
        Must allocate no more than ``smem_bytes`` declared."""
        return None

    def d_buffer(self, shape: EpilogueShape, storage: Any) -> cute.Tensor:
        """The staged buffer offered by ``offers_d_buffer`` (called only when it returned True)."""
        raise NotImplementedError(f"{self.name}: offers_d_buffer is True but d_buffer is missing")

    # ---- device: epilogue-load warp ----------------------------------------------------------------
    def load_tile(self, shape: EpilogueShape, params: tuple, storage: Any, tile_coord) -> Any:
        """Once per output tile, before its subtiles' loads: partition global tensors for the tile."""
        return None

    def load_subtile(self, shape: EpilogueShape, params: tuple, storage: Any, load_state: Any,
                     epi_idx: int, stage: Int32, barrier_ptr) -> None:
        """Issue the TMA loads of subtile ``epi_idx`` into stage ``stage`` of the visitor's buffers,
        signalling ``barrier_ptr`` (``cute.copy(atom, src, dst, tma_bar_ptr=barrier_ptr)``)."""

    # ---- device: epilogue threads ------------------------------------------------------------------
    def begin(self, ctx: EpilogueContext, params: tuple, storage: Any, tile_coord) -> Any:
        """Once per tile, before the subtile loop.  Start per-tile work (e.g. load a row-vector slice
        from global memory) and return the per-tile state object the other hooks receive."""
        return None

    def begin_loop(self, ctx: EpilogueContext, state: Any, epi_idx: int) -> None:
        """Start of subtile ``epi_idx``, before its loads are waited for."""

    def previsit(self, ctx: EpilogueContext, state: Any, epi_idx: int, load_stage) -> None:
        """The loads of subtile ``epi_idx`` are visible in stage ``load_stage`` of the visitor's
        buffers (``None`` when the visitor loads nothing).  Copy what ``visit`` needs into registers;
        the stage is handed back to the loader right after this hook returns (when D is staged in
        the visitor's buffer, once D's store has read the stage out)."""

    def visit(self, ctx: EpilogueContext, state: Any, epi_idx: int,
              acc: cute.TensorSSA) -> cute.TensorSSA:
        """The computation.  ``acc``: this thread's float32 accumulator values of the subtile
        (layout ``ctx.fragment_layout``).  Return the values to store in D, same shape (any float
        type; the kernel converts to D's dtype)."""
        return acc

    def reduce(self, ctx: EpilogueContext, state: Any, epi_idx: int, scratch: cute.Tensor) -> None:
        """After every thread's ``visit`` and a barrier; ``scratch`` is the subtile's D staging
        buffer (free now, overwritten by D right after), usable as shared-memory scratch.  A
        reduction that uses it must end with ``ctx.barrier.arrive_and_wait()``."""

    def postreduce(self, ctx: EpilogueContext, state: Any, epi_idx: int, store_stage) -> None:
        """D has been written to its staging buffer (not yet fenced).  Write extra outputs to the
        visitor's own staging buffers, index ``store_stage``; the kernel's fence and barrier follow."""

    def tma_store(self, ctx: EpilogueContext, state: Any, epi_idx: int, store_stage) -> None:
        """Store warp only, right after the D TMA store and before the bulk-group commit: issue the
        visitor's extra TMA stores from stage ``store_stage``."""

    def end_loop(self, ctx: EpilogueContext, state: Any, epi_idx: int) -> None:
        """End of subtile ``epi_idx``."""

    def end(self, ctx: EpilogueContext, state: Any) -> None:
        """Once per tile after the last subtile (e.g. write a per-tile reduction to global memory)."""


def float_scalar(value) -> Float32:
    """A runtime float32 kernel argument (a new value needs no recompile)."""
    return Float32(float(value))


__all__ = [
    "EpilogueContext",
    "EpilogueShape",
    "EpilogueVisitor",
    "SmemFragmentReader",
    "TmaTileLoad",
    "allocate_staged",
    "cutlass_dtype",
    "float_scalar",
    "make_epi_smem_layout",
    "operand_layout",
    "smem_layout_bytes",
]
