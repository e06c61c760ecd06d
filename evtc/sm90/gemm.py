"""Warp-specialized persistent GEMM for SM90 (H100), D = epilogue(A @ B), in the CuTe DSL.

Roles of the 384 threads of a CTA:

* warpgroup 0, the producer (registers cut to 40 with setmaxnreg):
    - warp 0 loads A and B tiles by TMA into a ring of ``ab_stages`` shared-memory stages
      (multicast to the other CTA of a 2x1 / 1x2 cluster), and with them, for float8 with
      1 x 128 block scales (``GemmConfig.stages_a_scales``), A's scales of the K tile (TMA) and
      B's (one cp.async per column chunk, lanes 0.., tracked by the stage's full barrier);
    - warp 1 loads the epilogue visitor's full-tile inputs (C, ...) by TMA into a ring of
      ``load_stages`` subtile buffers, ahead of the consumers, so their latency hides behind the
      mainloop of the same tile;
* warpgroups 1 and 2, the consumers (registers raised to 232): each runs wgmma on 64 rows of the
  128 x tile_n output tile, then both run the epilogue on the whole tile: per subtile the visitor's
  hooks, then registers -> stmatrix -> shared memory -> fence -> named barrier -> TMA store of D,
  paced by a PipelineTmaStore so stores of one subtile overlap the next.  When the visitor offers
  its C buffers (``GemmConfig.shares_d_with_load``), D is written where C was read and the store
  warp hands those stages back to warp 1 during the next tile's mainloop (_release_load_ring).

All roles walk the same persistent tile sequence (:mod:`evtc.sm90.scheduler`).  The problem
shape (M, N, K, L) and the visitor's scalars are runtime values: one compile serves every size.

Tensors seen by the kernel are in the CuTe GEMM convention: A (M, K, L), B (N, K, L), D (M, N, L).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Int32
from cutlass._mlir.dialects import nvvm
from cutlass.cute.nvgpu import cpasync, warp, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
from cutlass.tensor_utils import LayoutEnum

from evtc.plan.config import (
    A_SCALE_BYTES,
    CONSUMER_REGS,
    NUM_THREADS,
    PRODUCER_REGS,
    SCALE_BLOCK,
    GemmConfig,
)
from evtc.sm90.dtypes import cutlass_dtype, narrow
from evtc.sm90.mma import make_tiled_mma
from evtc.sm90.scheduler import TileScheduler
from evtc.sm90.visitor import EpilogueContext, EpilogueShape, EpilogueVisitor

# Named barrier ids (0 is __syncthreads).  The visitor gets EPILOGUE through ctx.barrier.
# Pingpong: consumer warpgroup w (0 or 1) has epilogue barrier EPILOGUE_BARRIER_ID + w, and waits
# for its mainloop turn on ORDER_BARRIER_ID + w.
EPILOGUE_BARRIER_ID = 1
ORDER_BARRIER_ID = 3
WARPGROUP_THREADS = 128
MAINLOOP_WARP = 0
EPILOGUE_LOAD_WARP = 1
# Warp of the consumers that issues the D TMA stores (first warp of warpgroup 1).
STORE_WARP = 4
BUFFER_ALIGN = 1024
# Split-K: float4 vectors of a partial loaded at once per thread before they are added (64
# registers beside the accumulator's 128).
SPLIT_K_LOAD_VECTORS = 16
# L2 eviction policies of B's TMA loads (the operand of PTX's .L2::cache_hint, as createpolicy
# .fractional with fraction 1.0 encodes them). Where the problem has one row of cluster tiles
# (decode, small batches) every B tile is read once: EVICT_FIRST lets the streamed weight leave L2
# before A and the epilogue's data; with more rows the other rows' CTAs read it again, so it keeps
# the normal policy. On the H100, 0-3% faster where it applies (docs/performance.md, "An L2
# eviction hint on the weight's loads").
L2_EVICT_FIRST = 0x12F0000000000000
L2_EVICT_NORMAL = 0x1000000000000000


class Sm90GemmKernel:
    """One compiled kernel: a :class:`GemmConfig` plus an :class:`EpilogueVisitor`.

    ``__call__`` is the ``@cute.jit`` launch function; :mod:`evtc.runtime.build` compiles it behind
    the entry point of :mod:`evtc.sm90.launch`.
    """

    def __init__(self, config: GemmConfig, visitor: EpilogueVisitor):
        self.config = config.validate()
        self.visitor = visitor
        cfg = self.config
        self.ab_dtype = cutlass_dtype(cfg.ab_dtype)  # A's (and B's, unless b_dtype differs)
        self.b_dtype = cutlass_dtype(cfg.b_element)
        self.d_dtype = cutlass_dtype(cfg.d_dtype)
        self.acc_dtype = cutlass.Float32
        self.a_layout = LayoutEnum.ROW_MAJOR if cfg.a_major == "k" else LayoutEnum.COL_MAJOR
        self.b_layout = LayoutEnum.ROW_MAJOR if cfg.b_major == "k" else LayoutEnum.COL_MAJOR
        self.d_layout = LayoutEnum.ROW_MAJOR if cfg.d_major == "n" else LayoutEnum.COL_MAJOR
        self.tile_shape_mnk = cfg.tile_shape_mnk
        self.tile_k = cfg.tile_k
        self.promotes = cfg.promotes
        self.promotes_in_pairs = cfg.promotes_in_pairs
        # Block scales (float8): rows of A per scale (1 or 128; B's blocks are 128 x 128), 0 for none.
        self.block_scales = cfg.block_scales
        # 1 x 128 block scales of A brought by TMA with each A/B stage (GemmConfig.stages_a_scales).
        self.stages_a_scales = cfg.stages_a_scales
        # With them, B's scales of the K tile (one per column chunk, GemmConfig.b_scale_chunks) come
        # with the stage too: the producer warp copies them by cp.async, tracked by the stage's barrier.
        self.b_scale_chunks = cfg.b_scale_chunks if cfg.stages_a_scales else 0
        self.tile_m = cfg.tile_m
        self.pingpong = cfg.schedule == "pingpong"
        # Gated (SwiGLU): B comes as two halves; tile n of the output loads block n of each into
        # the two halves of one B tile, and each output subtile reads two accumulator subtiles.
        self.gated = cfg.gated
        if getattr(visitor, "gated", False) != cfg.gated:
            raise ValueError(f"visitor gated={getattr(visitor, 'gated', False)} but config gated={cfg.gated}")
        self.acc_subtiles = cfg.tile_n // cfg.epi_tile_n
        # Only reductions: no D tile is written (mD is then a placeholder of the problem's shape).
        self.store_d = cfg.store_d
        if getattr(visitor, "stores_d", True) != cfg.store_d:
            raise ValueError(f"visitor stores_d={getattr(visitor, 'stores_d', True)} but config "
                             f"store_d={cfg.store_d}")
        self.cluster = tuple(cfg.cluster)
        # Split-K: the split count is a runtime argument (see _split_k_combine).
        self.split_k = cfg.split_k
        # A is shared by the CTAs of a cluster row (same m, different n), B by a cluster column.
        self.a_mcast = self.cluster[1]
        # Rows of A each stage loads (GemmConfig.a_rows): the tile's, or fewer for short problems.
        self.a_rows = cfg.a_box_rows
        self.b_mcast = self.cluster[0]
        # Epilogue-load stages of one ring.  Pingpong: one ring per consumer warpgroup (ring w is
        # stages [w * load_stages, (w + 1) * load_stages) of one pipeline and of the visitor's buffers).
        self.load_stages = cfg.c_stages
        self.load_buffers = self.load_stages * cfg.epi_groups
        self.load_bytes = visitor.load_bytes(cfg)
        self.has_epi_loads = self.load_bytes > 0
        visitor_smem = visitor.smem_bytes(cfg, self.load_buffers)
        # D staged in the visitor's C buffers (cooperative, whole-tile loads): no D buffers of our
        # own, and no wait for a D store anywhere in the epilogue (see _release_load_ring).
        self.d_in_load_buffers = self.has_epi_loads and cfg.shares_d_with_load(
            visitor.offers_d_buffer(cfg)
        )
        self.ab_stages, self.d_stages = cfg.plan_stages(visitor_smem, self.d_in_load_buffers)
        self.shape = EpilogueShape(
            config=cfg,
            tile=(self.tile_m, cfg.out_tile_n),
            epi_tile=cfg.epi_tile,
            num_subtiles=cfg.num_subtiles,
            load_stages=self.load_buffers,
            # Pingpong: the two warpgroups' D buffers, WG w owning [w * d_stages, (w + 1) * d_stages).
            store_stages=self.d_stages * cfg.epi_groups,
            acc_dtype=self.acc_dtype,
            d_dtype=self.d_dtype,
            d_layout=self.d_layout,
            num_threads=cfg.epilogue_threads,
        )

    # ------------------------------------------------------------------------------------------
    # Host side (traced once per compile)
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,
        mB: cute.Tensor,
        mD: cute.Tensor,
        epi_args: tuple,
        max_clusters: Int32,
        stream,
        split: tuple = (),
        scales: tuple = (),
    ):
        """Launch on ``stream``.  mA (M,K,L), mB (N,K,L), mD (M,N,L); ``epi_args`` is the visitor's
        runtime tuple; ``max_clusters`` caps the persistent grid (clusters resident at once).
        Gated: ``mB`` is the pair (gate half, up half) of B, each (N,K,L) with N the output's width.
        Split-K: ``split`` is (splits, partials, counters), see :meth:`_split_k_combine`.
        Block scales: ``scales`` is (A's (M or M/128, K/128, L), B's (N/128, K/128, L)) float32
        tensors, see :meth:`_load_block_factors`; gated, B's scales cover both halves (N the GEMM's)
        and the columns of a half follow."""
        b_halves = mB if cutlass.const_expr(self.gated) else (mB,)
        if cutlass.const_expr(self.block_scales and self.gated):
            scales = (*scales, b_halves[0].shape[0])  # where the up half's columns start in B
        if cutlass.const_expr(mA.element_type != self.ab_dtype
                              or any(h.element_type != self.b_dtype for h in b_halves)):
            raise TypeError(f"A must be {self.ab_dtype} and B {self.b_dtype}")
        if cutlass.const_expr(mD.element_type != self.d_dtype):
            raise TypeError(f"D must be {self.d_dtype}, got {mD.element_type}")

        tiled_mma = make_tiled_mma(
            self.ab_dtype,
            self.b_dtype,
            self.a_layout.sm90_mma_major_mode(),
            self.b_layout.sm90_mma_major_mode(),
            self.acc_dtype,
            # cooperative: two consumer warpgroups stacked along M; pingpong: one warpgroup per
            # tile, its partition of the tile has tile_m / 64 m64 atoms along M (MMA_M = 2 or 1)
            (1, 1, 1) if self.pingpong else (2, 1, 1),
            tiler_mn=(64, self.tile_shape_mnk[1]),
        )
        a_smem_staged = sm90_utils.make_smem_layout_a(
            self.a_layout, self.tile_shape_mnk, self.ab_dtype, self.ab_stages
        )
        b_smem_staged = sm90_utils.make_smem_layout_b(
            self.b_layout, self.tile_shape_mnk, self.b_dtype, self.ab_stages
        )
        d_smem_staged = sm90_utils.make_smem_layout_epi(
            self.d_dtype, self.d_layout, self.shape.epi_tile, self.shape.store_stages
        )

        # A's loads: the whole tile_m x 64 block, or (a_rows) its first rows only, laid out as the
        # first swizzle atoms of the stage.
        a_box_staged = a_smem_staged if cutlass.const_expr(self.a_rows == self.tile_m) else (
            sm90_utils.make_smem_layout_a(
                self.a_layout, (self.a_rows, self.tile_shape_mnk[1], self.tile_k), self.ab_dtype,
                self.ab_stages,
            )
        )
        tma_atom_a, tma_a = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp() if self.a_mcast == 1
            else cpasync.CopyBulkTensorTileG2SMulticastOp(),
            mA,
            cute.slice_(a_box_staged, (None, None, 0)),
            (self.a_rows, self.tile_k),
            num_multicast=self.a_mcast,
        )
        # One TMA per B block: the whole tile, or (gated) a half tile from each half of B. The two
        # halves of a B stage are contiguous blocks laid out like a half-wide tile's stage.
        b_block_n = self.tile_shape_mnk[1] // len(b_halves)
        b_block_staged = sm90_utils.make_smem_layout_b(
            self.b_layout, (self.tile_m, b_block_n, self.tile_k), self.b_dtype, self.ab_stages
        )
        b_atoms = []
        for half in b_halves:
            b_atoms.append(cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp() if self.b_mcast == 1
                else cpasync.CopyBulkTensorTileG2SMulticastOp(),
                half,
                cute.slice_(b_block_staged, (None, None, 0)),
                (b_block_n, self.tile_k),
                num_multicast=self.b_mcast,
            ))
        tma_atom_b = tuple(atom for atom, _ in b_atoms)
        tma_b = tuple(t for _, t in b_atoms)
        tma_atom_d, tma_d = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(),
            mD,
            cute.slice_(d_smem_staged, (None, None, 0)),
            self.shape.epi_tile,
        )
        epi_params = self.visitor.setup(self.shape, epi_args)
        if cutlass.const_expr(self.stages_a_scales):
            # A's scales, (M, KB, L) with M contiguous: one tile_m x 1 box per stage. Rows past M
            # come in as zeros (their products are never stored).
            a_scales_atom, a_scales_tma = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), scales[0], cute.make_layout((self.tile_m, 1)),
                (self.tile_m, 1),
            )
            scales = (*scales, a_scales_atom, a_scales_tma)  # the last two, after a gated kernel's n_half

        # Persistent grid: one z-slice per cluster, never more clusters than work units.
        sched = TileScheduler.for_problem(
            mD.shape[0], mD.shape[1], mD.shape[2], self.shape.tile, self.cluster,
            self.config.raster == "m", self.config.swizzle,
            split[0] if cutlass.const_expr(self.split_k) else None, max_clusters,
        )
        num_clusters = cutlass.min(sched.num_work_units(), max_clusters)

        self.shared_storage = self._shared_storage(a_smem_staged, b_smem_staged, d_smem_staged)

        self.kernel(
            tiled_mma,
            tma_atom_a,
            tma_a,
            tma_atom_b,
            tma_b,
            tma_atom_d,
            tma_d,
            a_smem_staged,
            b_smem_staged,
            d_smem_staged,
            epi_params,
            split,
            scales,
        ).launch(
            grid=(self.cluster[0], self.cluster[1], num_clusters),
            block=[NUM_THREADS, 1, 1],
            cluster=(self.cluster[0], self.cluster[1], 1),
            min_blocks_per_mp=1,
            stream=stream,
            use_pdl=self.config.pdl,
        )

    def _shared_storage(self, a_smem_staged, b_smem_staged, d_smem_staged):
        """The kernel's own shared memory: pipeline barriers, A/B stages and (unless D is staged in
        the visitor's load buffers) D stages.  Plain Python: the struct's fields are static."""
        fields = {
            "ab_barriers": cute.struct.MemRange[cutlass.Int64, self.ab_stages * 2],
            "load_barriers": cute.struct.MemRange[cutlass.Int64, self.load_buffers * 2],
        }
        if self.stages_a_scales:
            # Before sA: in the room its 1024-byte alignment leaves after the barriers
            # (A_SCALES_ALIGN_SLACK covers the rest).
            fields["sA_scales"] = cute.struct.Align[
                cute.struct.MemRange[cutlass.Float32, self.tile_m * self.ab_stages], 128
            ]
            fields["sB_scales"] = cute.struct.Align[
                cute.struct.MemRange[cutlass.Float32, self.b_scale_chunks * self.ab_stages], 16
            ]
        fields |= {
            "sA": cute.struct.Align[
                cute.struct.MemRange[self.ab_dtype, cute.cosize(a_smem_staged)], BUFFER_ALIGN
            ],
            "sB": cute.struct.Align[
                cute.struct.MemRange[self.b_dtype, cute.cosize(b_smem_staged)], BUFFER_ALIGN
            ],
        }
        if not self.d_in_load_buffers:
            fields["sD"] = cute.struct.Align[
                cute.struct.MemRange[self.d_dtype, cute.cosize(d_smem_staged)], BUFFER_ALIGN
            ]
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    # ------------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def _release_load_ring(self, load_pipeline):
        """Store warp, D staged in the load buffers: once every D store issued so far has read its
        stage out of shared memory, hand all stages of the tile back to the epilogue-load warp.

        Called during the next tile's mainloop (or after the last tile), never in the epilogue, so
        that no epilogue waits for a store: the stores drain while the tensor cores work, and the
        next tile's C loads land in the stages before its epilogue needs them."""
        cute.arch.cp_async_bulk_wait_group(0, read=True)
        # The lane that issued the stores waited above; lane 0 signals the empty barriers.
        cute.arch.sync_warp()
        for i in cutlass.range_constexpr(self.load_buffers):
            load_pipeline.consumer_release(
                pipeline.PipelineState(self.load_buffers, Int32(0), Int32(i), Int32(0))
            )

    @cute.jit
    def _release_ring_at(self, load_pipeline, is_store_warp, tiles_done: Int32, k: Int32, release_k: Int32):
        """D staged in the load buffers: the store warp hands the previous tile's load stages back
        at K tile ``release_k`` (at least 1) of this tile's mainloop; see ``ring_release_k``."""
        if cutlass.const_expr(self.d_in_load_buffers):
            if is_store_warp:
                if tiles_done > 0:
                    if k > 0:
                        if k == release_k:
                            self._release_load_ring(load_pipeline)

    @cute.jit
    def _skip_tile(self, k_tiles: Int32, read_state, release_state):
        """Pingpong: step this warpgroup's A/B pipeline states over the other warpgroup's tile (its
        ``k_tiles`` stages).  Safe with parity waits only because of the order barriers: a
        warpgroup starts a mainloop after the other has waited on every stage of the previous tile,
        so the fill before the one it waits for has always completed.

        One arithmetic step (index and phase from a division by the constant stage count), not a
        loop of single steps: that loop cost about 29 cycles a K tile, and after a CTA's last tile
        it kept the CTA resident for them (1.7k cycles at K = 3584, 6.4k at K = 14336: 0.9 and
        3.3 us added to every decode launch, measured with timestamps in the kernel)."""
        read_state.advance(Int32(k_tiles))
        release_state.advance(Int32(k_tiles))
        return read_state, release_state

    def _subtile_map(self, acc_shape, frag_shape) -> list[list[int]]:
        """Pingpong: for each subtile, the index into the retiled accumulator (shape ((V, NC), M,
        1)) of each value of the subtile fragment (shape (V, M, Nsub)), both indexed in cute's
        colexicographic order."""
        v_size = cute.size(frag_shape, mode=[0])
        m_size = cute.size(frag_shape, mode=[1])
        n_sub = cute.size(frag_shape, mode=[2])
        chunks = cute.size(acc_shape, mode=[0]) // v_size
        if (cute.size(acc_shape, mode=[1]) != m_size or cute.size(acc_shape, mode=[2]) != 1
                or chunks * v_size != cute.size(acc_shape, mode=[0])
                or chunks != n_sub * self.acc_subtiles):
            raise ValueError(f"pingpong epilogue: unexpected accumulator {acc_shape} / fragment "
                             f"{frag_shape} shapes")
        return [
            [v + v_size * (e * n_sub + n) + v_size * chunks * m
             for n in range(n_sub) for m in range(m_size) for v in range(v_size)]
            for e in range(self.acc_subtiles)
        ]

    def _read_subtile(self, frag, tRS_acc, acc_map, subtile: int, frag_size: int) -> None:
        """Copy accumulator subtile ``subtile`` (a Python int) into ``frag``, traced inline."""
        if self.pingpong:
            for v in range(frag_size):
                frag[v] = tRS_acc[acc_map[subtile][v]]
        else:
            for v in range(frag_size):
                frag[v] = tRS_acc[subtile * frag_size + v]

    def _ring_state(self, ring, count, position, producer: bool):
        """Pingpong: the load-pipeline state of ``position`` (subtiles loaded before, counted in
        ``ring``'s own order) in ``ring``, whose stages start at ``ring * load_stages``."""
        lap = position // self.load_stages
        phase = (lap % 2) ^ 1 if producer else lap % 2
        return pipeline.PipelineState(
            self.load_buffers, count, ring * self.load_stages + position % self.load_stages, phase
        )

    def _subtile_inputs(self, ctx, vstate, epi_idx: int, load_pipeline, load_state, tiles_done, wg):
        """Consumers: wait for subtile ``epi_idx``'s epilogue loads and run the visitor's previsit on
        them, then hand the stage back (unless D is staged in it).  Plain Python, traced inline;
        returns ``load_state`` advanced (assigned by the caller so the tile loop carries it)."""
        if not self.has_epi_loads:
            self.visitor.previsit(ctx, vstate, epi_idx, None)
        elif self.pingpong:
            # Our own ring: this warpgroup's tiles_done-th tile, subtile epi_idx.
            position = tiles_done * self.shape.num_subtiles + epi_idx
            ring_state = self._ring_state(wg, position, position, False)
            load_pipeline.consumer_wait(ring_state)
            self.visitor.previsit(ctx, vstate, epi_idx, ring_state.index)
            cute.arch.fence_view_async_shared()
            load_pipeline.consumer_release(ring_state)
        else:
            load_pipeline.consumer_wait(load_state)
            self.visitor.previsit(ctx, vstate, epi_idx, load_state.index)
            if not self.d_in_load_buffers:
                # Order our generic-proxy reads before the next TMA write into the stage.
                cute.arch.fence_view_async_shared()
                load_pipeline.consumer_release(load_state)
            load_state.advance()
        return load_state

    def _k_range(self, sched, work, k_tiles):
        """(first K tile, K tiles) of work unit ``work``: all of K without split-K."""
        if cutlass.const_expr(self.split_k):
            return sched.k_range(work, k_tiles)
        return Int32(0), k_tiles

    def _runs_epilogue(self, sched, work):
        """Whether work unit ``work`` runs the epilogue: every unit, or (split-K) a whole tile or the
        last split of a split one. A Python ``True`` without split-K, so no branch is emitted."""
        if cutlass.const_expr(self.split_k):
            return sched.runs_epilogue(work)
        return True

    def _load_tile_inputs(self, sched, work, cta_in_cluster, epi_params, visitor_storage, load_pipeline,
                          state):
        """Epilogue-load warp (cooperative): the visitor's loads of one tile, subtile by subtile, into
        the load ring. Returns the advanced ring state (assigned by the caller, so a branch around
        the call carries it)."""
        tile_coord = sched.cta_tile(work, cta_in_cluster)
        lstate = self.visitor.load_tile(self.shape, epi_params, visitor_storage, tile_coord)
        for epi_idx in range(self.shape.num_subtiles):  # plain Python: unrolled as it is traced
            load_pipeline.producer_acquire(state)
            self.visitor.load_subtile(
                self.shape, epi_params, visitor_storage, lstate, epi_idx, state.index,
                load_pipeline.producer_get_barrier(state),
            )
            load_pipeline.producer_commit(state)
            state.advance()
        return state

    def _partials_of(self, partials, slot, epi_tidx, acc_size: int, batch: int):
        """This thread's values of partial ``slot`` in the split-K workspace, as (4, batch, J /
        batch): vector j of thread t at ((slot J + j) T + t) 4 floats, so a warp's vector stores
        and loads are contiguous (T: the epilogue's threads; every split's thread t holds the same
        accumulator positions, so no layout but the thread's own is needed)."""
        threads = self.shape.num_threads
        vectors = acc_size // 4
        whole = cute.make_tensor(
            partials.iterator,
            cute.make_layout((4, batch, vectors // batch, threads, 1 << 30),
                             stride=(1, 4 * threads, 4 * threads * batch, 4, acc_size * threads)),
        )
        return whole[(None, None, None, epi_tidx, slot)]

    @cute.jit
    def _split_k_combine(self, acc, split: tuple, sched, work, cta_in_cluster, epi_tidx, epi_barrier):
        """Split-K, after a unit's mainloop. Splits 0 .. S-2 of a split tile store their float32
        accumulator in the partials workspace and count themselves in the tile's counter; split S-1
        waits for the count S-1, resets it to 0 for the next launch, and adds the partials in split
        order (a fixed order, so the result is the same bit for bit on every run) before it runs the
        epilogue. A whole tile (the rounds before a split tail) does neither. ``split`` is (splits,
        partials, counters): partials hold S-1 tile-sized slots per split CTA tile, counters one
        int32 per split CTA tile (zero between launches)."""
        _, partials, counters = split
        s = sched.split_of(work)
        last = sched.last_split(work)
        tile = sched.split_slot(work, cta_in_cluster)
        acc_size = cute.size(acc)
        # Partials are read back ``batch`` vectors at a time: all loads of a batch are issued before
        # any add waits (one memory latency per batch, not per vector), in registers that fit
        # beside the accumulator.
        # The batch divides the thread's vectors (tile_n = 192 gives 24 of them per thread: batches
        # of 12), so that no vector is left out of the store or the sum.
        vectors = acc_size // 4
        batch = max(d for d in range(1, min(vectors, SPLIT_K_LOAD_VECTORS) + 1) if vectors % d == 0)
        flat = cute.make_tensor(acc.iterator, cute.make_layout(
            (4, batch, acc_size // (4 * batch)), stride=(1, 4, 4 * batch)))
        counter = counters.iterator + tile
        if s < last:
            cute.autovec_copy(flat, self._partials_of(partials, tile * last + s, epi_tidx, acc_size, batch))
            # Every thread's stores reach the GPU scope before the one release that counts them.
            cute.arch.fence_acq_rel_gpu()
            epi_barrier.arrive_and_wait()
            if epi_tidx == 0:
                cute.arch.atomic_add(counter, Int32(1), sem="release", scope="gpu")
        elif last > 0:
            if epi_tidx == 0:
                arrived = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
                while arrived < last:
                    arrived = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
                cute.arch.store(counter, Int32(0))
            epi_barrier.arrive_and_wait()
            cute.arch.fence_acq_rel_gpu()
            chunk = cute.make_rmem_tensor((4, batch), self.acc_dtype)
            for p in cutlass.range(last, unroll=1):
                part = self._partials_of(partials, tile * last + p, epi_tidx, acc_size, batch)
                for j in cutlass.range_constexpr(acc_size // (4 * batch)):
                    cute.autovec_copy(part[(None, None, j)], chunk)
                    mine = flat[(None, None, j)]
                    mine.store(mine.load() + chunk.load())

    def _scale_slots(self, tiled_mma, threads: int) -> tuple[tuple[int, ...], int, tuple[int, ...]]:
        """Block scales: where a consumer thread's accumulator values lie, as (the distinct row
        offsets from its first value's row, the number of column chunks, the factor slot of each
        value: row slot x chunks + chunk).

        A chunk is ``GemmConfig.scale_chunk`` columns, each in one 128-column block of B: a plain
        128 x 192 tile spans three 64-column chunks, in two B blocks; a gated one's gate half is its
        first 96 columns and its up half the next 96, three 32-column chunks each.
        Plain Python on static thread indices: the wgmma layout gives every thread the same offsets
        and the same chunk per value (checked on a sample of threads here, at compile time), so each
        K tile loads one A scale per row slot and one B scale per chunk."""
        chunk = self.config.scale_chunk
        identity = cute.make_identity_tensor(self.tile_shape_mnk[:2])

        def layout_of(thread: int) -> tuple[list[int], list[int]]:
            coords = tiled_mma.get_slice(thread).partition_C(identity)
            values = [coords[i] for i in range(cute.size(coords))]
            rows = [int(m) for m, _ in values]
            return [r - rows[0] for r in rows], [int(n) // chunk for _, n in values]

        offsets, chunks = layout_of(0)
        for t in (1, 2, 3, 4, 5, 8, 31, 32, 33, 64, 100, threads - 1):
            if layout_of(t) != (offsets, chunks):
                raise AssertionError(f"accumulator of thread {t} is not laid out like thread 0's")
        distinct = tuple(sorted(set(offsets)))
        n_chunks = self.config.b_scale_chunks  # the chunks the producer copies B's scales of
        return distinct, n_chunks, tuple(distinct.index(o) * n_chunks + c for o, c in zip(offsets, chunks,
                                                                                         strict=True))

    @cute.jit
    def _load_block_factors(self, factors: cute.Tensor, scales: tuple, tile_coord, kb: Int32,
                            first_row: Int32, row_offsets: tuple, n_chunks: int, staged=None, stage=None):
        """Block scales: into ``factors``, the factor of each slot (:meth:`_scale_slots`) for K block
        ``kb`` of the tile at ``tile_coord``: A's scale of the row (1 x 128 blocks) or of the tile's
        128-row block, times B's scale of the chunk's 128 x 128 block. A gated tile's chunks are
        its gate half's columns of B, then its up half's, ``n_half`` (B's columns per half)
        further along B. Where the A/B stages bring the scales (``stages_a_scales``), both come from
        ``staged`` (A's and B's scales in shared memory, by TMA and by the producer warp's
        cp.async) at ``stage``, the K tile's A/B stage.

        Every index is clamped to the last scale: a tile's rows past M, a chunk past N (the last
        128 x 192 tile of N = 4096 reaches column 4224) and whole tiles past the problem (the last
        cluster of a ragged grid) read a scale that exists; their values are never stored."""
        m_scales = scales[0]
        m, n, batch = tile_coord
        last_a = m_scales.shape[0] - 1
        b_scales = []
        for c in cutlass.range_constexpr(n_chunks):
            if cutlass.const_expr(self.stages_a_scales):
                b_scales.append(staged[1][(c, stage)])
            else:
                b_scales.append(scales[1][self._b_scale_coord(scales, tile_coord, c, kb)])
        if cutlass.const_expr(self.block_scales == SCALE_BLOCK):
            a_scale = m_scales[(cutlass.min((m * self.tile_m) // SCALE_BLOCK, last_a), kb, batch)]
            for c in cutlass.range_constexpr(n_chunks):
                factors[c] = a_scale * b_scales[c]
        else:
            for r in cutlass.range_constexpr(len(row_offsets)):
                if cutlass.const_expr(self.stages_a_scales):
                    a_scale = staged[0][(first_row + row_offsets[r], 0, stage)]
                else:
                    row = cutlass.min(m * self.tile_m + first_row + row_offsets[r], last_a)
                    a_scale = m_scales[(row, kb, batch)]
                for c in cutlass.range_constexpr(n_chunks):
                    factors[r * n_chunks + c] = a_scale * b_scales[c]

    def _b_scale_coord(self, scales: tuple, tile_coord, c, kb):
        """Where B's scale of column chunk ``c`` (static or dynamic) of the tile at ``tile_coord``
        lies for K block ``kb``: (128-column block, kb, batch), clamped to the last block (see
        :meth:`_load_block_factors`)."""
        n, batch = tile_coord[1], tile_coord[2]
        out_tile_n = self.shape.tile[1]
        chunk = self.config.scale_chunk
        column = n * out_tile_n + c * chunk
        if cutlass.const_expr(self.gated):
            # The up half's chunks: its columns of B start n_half (scales[2]) further along.
            if cutlass.const_expr(isinstance(c, int)):
                if cutlass.const_expr(c * chunk >= out_tile_n):
                    column = column + scales[2] - out_tile_n
            else:
                column = cutlass.select_(c * chunk >= out_tile_n, column + scales[2] - out_tile_n, column)
        return (cutlass.min(column // SCALE_BLOCK, scales[1].shape[0] - 1), kb, batch)

    @cute.jit
    def _copy_b_scales(self, scales: tuple, sB_scales: cute.Tensor, tile_coord, kb: Int32, stage: Int32,
                       barrier) -> None:
        """Producer warp: lane c copies B's scale of column chunk c for K block ``kb`` into stage
        ``stage`` of ``sB_scales`` by cp.async (4 bytes: any strides and alignment do), and the
        stage's full barrier tracks the copy (cp.async.mbarrier.arrive without .noinc adds one
        pending arrival and makes it when the copy lands, so the barrier's count is unchanged).
        Called before this stage's TMAs are issued: until they are, the barrier's transaction
        count keeps its phase open, so the added arrival always belongs to this phase. Consumers
        then read B's scales from shared memory before the wgmma fence; a global load there held
        the fence up until it landed (about 10% of a 128 x 128 tile's time, docs/performance.md)."""
        lane = cute.arch.lane_idx()
        if lane < self.b_scale_chunks:
            source = scales[1]
            offset = cute.crd2idx(self._b_scale_coord(scales, tile_coord, lane, kb), source.layout)
            src = cute.make_tensor(source.iterator + offset, cute.make_layout(1))
            dst = cute.make_tensor(sB_scales.iterator + (lane + stage * self.b_scale_chunks),
                                   cute.make_layout(1))
            atom = cute.make_copy_atom(cpasync.CopyG2SOp(), cutlass.Float32, num_bits_per_copy=32)
            cute.copy(atom, src, dst)
            nvvm.cp_async_mbarrier_arrive(barrier.llvm_ptr)

    def _promote(self, acc: cute.Tensor, partial: cute.Tensor, factors, factor_slot) -> None:
        """Add one K tile's float8 products ``partial`` into the float32 ``acc``: each value times
        its block scales' factor (``factors[factor_slot[i]]``), or as it is without block scales
        (``factors`` is then None). Plain Python, unrolled as the kernel is traced."""
        if self.block_scales:
            for i in range(cute.size(acc)):
                acc[i] = acc[i] + partial[i] * factors[factor_slot[i]]
        else:
            acc.store(acc.load() + partial.load())

    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        tma_atom_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_atom_b: tuple,
        mB: tuple,
        tma_atom_d: cute.CopyAtom,
        mD: cute.Tensor,
        a_smem_staged: cute.ComposedLayout,
        b_smem_staged: cute.ComposedLayout,
        d_smem_staged: cute.ComposedLayout,
        epi_params: tuple,
        split: tuple,
        scales: tuple,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warp_group = cute.arch.make_warp_uniform(tidx // WARPGROUP_THREADS)

        if warp_idx == MAINLOOP_WARP:
            cpasync.prefetch_descriptor(tma_atom_a)
            for atom in tma_atom_b:
                cpasync.prefetch_descriptor(atom)
            cpasync.prefetch_descriptor(tma_atom_d)
            if cutlass.const_expr(self.stages_a_scales):
                cpasync.prefetch_descriptor(scales[-2])

        # ---- cluster position and multicast masks -------------------------------------------
        cluster_layout = cute.make_layout((self.cluster[0], self.cluster[1], 1))
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cta_coord = cluster_layout.get_flat_coord(cta_rank)
        a_mask = None
        b_mask = None
        if cutlass.const_expr(self.a_mcast > 1):
            a_mask = cute.make_layout_image_mask(cluster_layout, cta_coord, mode=1)
        if cutlass.const_expr(self.b_mcast > 1):
            b_mask = cute.make_layout_image_mask(cluster_layout, cta_coord, mode=0)

        # ---- shared memory and pipelines ------------------------------------------------------
        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        visitor_storage = self.visitor.allocate(self.shape, epi_params, smem)

        a_stage_layout = cute.slice_(a_smem_staged, (None, None, 0))
        b_stage_layout = cute.slice_(b_smem_staged, (None, None, 0))
        ab_tx_bytes = cute.size_in_bytes(self.ab_dtype, a_stage_layout) * self.a_rows // self.tile_m + (
            cute.size_in_bytes(self.b_dtype, b_stage_layout)
        ) + (self.tile_m * A_SCALE_BYTES if self.stages_a_scales else 0)
        # Every consumer warp releases a stage to each CTA that multicast into it (itself included).
        # A stage is read by both consumer warpgroups (cooperative) or by one (pingpong).
        consumer_warps = 4 if self.pingpong else 8
        mcast_peers = self.a_mcast + self.b_mcast - 1
        ab_pipeline = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_barriers.data_ptr(),
            num_stages=self.ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, mcast_peers * consumer_warps),
            tx_count=ab_tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, *cluster_layout.shape)),
            defer_sync=True,
        )
        load_pipeline = None
        if cutlass.const_expr(self.has_epi_loads):
            # CTA-local: epilogue inputs are not multicast.  One release per epilogue warp, or one by
            # the store warp when D is staged in the load buffers.
            load_pipeline = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.load_barriers.data_ptr(),
                num_stages=self.load_buffers,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(
                    pipeline.Agent.Thread, 1 if self.d_in_load_buffers else consumer_warps
                ),
                tx_count=self.load_bytes,
                cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
                defer_sync=True,
            )
        # Barrier inits must be visible cluster-wide before any peer multicasts into this CTA.
        pipeline_init_arrive(cluster_shape_mn=cluster_layout, is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
        sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
        if cutlass.const_expr(self.d_in_load_buffers):
            sD = self.visitor.d_buffer(self.shape, visitor_storage)
        else:
            sD = storage.sD.get_tensor(d_smem_staged.outer, swizzle=d_smem_staged.inner)

        # ---- global tiles and TMA partitions --------------------------------------------------
        # (bM, bK, tiles_m, tiles_k, L) and (bN, bK, tiles_n, tiles_k, L)
        # (a_rows, bK, row blocks, tiles_k, L): tile m starts at row block m * tile_m / a_rows
        gA = cute.local_tile(mA, (self.a_rows, self.tile_k), (None, None, None))
        a_blocks_per_tile = self.tile_m // self.a_rows
        b_block_n = self.tile_shape_mnk[1] // len(mB)
        # (bN, bK, tiles_n, tiles_k, L) of each B block (gated: N tiles of the output's width)
        gBs = [cute.local_tile(half, (b_block_n, self.tile_k), (None, None, None)) for half in mB]
        # (bM, bN, tiles_m, tiles_n, L)
        gD = cute.local_tile(mD, self.shape.tile, (None, None, None))
        k_tiles = cute.size(gA, mode=[3])

        tAsA, tAgA = cpasync.tma_partition(
            tma_atom_a,
            cta_coord[1],
            cute.make_layout(self.cluster[1]),
            cute.group_modes(sA, 0, 2) if cutlass.const_expr(self.a_rows == self.tile_m)
            else cute.zipped_divide(sA, (self.a_rows, self.tile_k))[(None, (0, 0, None))],
            cute.group_modes(gA, 0, 2),
        )
        # Each B block goes to its own part of the stage: the whole stage, or (gated) its first or
        # second half along N.
        sB_blocks = cute.zipped_divide(sB, (b_block_n, self.tile_k))  # ((bN', bK), (blocks, 1, stages))
        b_parts = []
        for i, (atom, gB) in enumerate(zip(tma_atom_b, gBs, strict=True)):
            b_parts.append(cpasync.tma_partition(
                atom,
                cta_coord[0],
                cute.make_layout(self.cluster[0]),
                sB_blocks[(None, (i, 0, None))],
                cute.group_modes(gB, 0, 2),
            ))

        # A's block scales: stage s of sA_scales holds the tile_m scales of the K tile in A/B stage s.
        sA_scales = sB_scales = tSs_scales = tSg_scales = None
        if cutlass.const_expr(self.stages_a_scales):
            sA_scales = storage.sA_scales.get_tensor(cute.make_layout((self.tile_m, 1, self.ab_stages)))
            # B's: stage s holds the K tile's scale of each column chunk.
            sB_scales = storage.sB_scales.get_tensor(cute.make_layout((self.b_scale_chunks, self.ab_stages)))
            # (bM, 1, tiles_m, KB, L)
            g_scales = cute.local_tile(scales[-1], (self.tile_m, 1), (None, None, None))
            tSs_scales, tSg_scales = cpasync.tma_partition(
                scales[-2], 0, cute.make_layout(1),
                cute.group_modes(sA_scales, 0, 2), cute.group_modes(g_scales, 0, 2),
            )
        # What the consumers read each K tile's scales from (_load_block_factors).
        staged_scales = (sA_scales, sB_scales)
        _, _, first_work = cute.arch.block_idx()
        _, _, work_stride = cute.arch.grid_dim()
        # The grid is the clusters that run at once wherever split-K splits only the tail, so the
        # scheduler finds the same whole tiles as the host did (see TileScheduler).
        sched = TileScheduler.for_problem(
            mD.shape[0], mD.shape[1], mD.shape[2], self.shape.tile, self.cluster,
            self.config.raster == "m", self.config.swizzle,
            split[0] if cutlass.const_expr(self.split_k) else None, work_stride,
        )
        num_work = sched.num_work_units()
        cta_in_cluster = (cta_coord[0], cta_coord[1])

        pipeline_init_wait(cluster_shape_mn=cluster_layout)
        if cutlass.const_expr(self.config.pdl):
            # Programmatic dependent launch: everything above (barrier init, descriptor prefetch)
            # ran while the previous kernel of the stream was finishing; nothing in global memory
            # is touched before that kernel has completed and flushed. Then the next kernel may be
            # scheduled at once: its CTAs take SMs as ours leave and wait in this same place.
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()

        # ======================================================================================
        # Producer warpgroup
        # ======================================================================================
        if warp_group == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)

            if warp_idx == MAINLOOP_WARP:
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
                b_policy = cutlass.Int64(cutlass.select_(sched.clusters_m == Int32(1),
                                                         cutlass.Int64(L2_EVICT_FIRST),
                                                         cutlass.Int64(L2_EVICT_NORMAL)))
                work = Int32(first_work)
                while work < num_work:
                    m, n, batch = sched.cta_tile(work, cta_in_cluster)
                    tAgA_tile = tAgA[(None, m * a_blocks_per_tile, None, batch)]
                    k_first, k_count = self._k_range(sched, work, k_tiles)
                    for kk in cutlass.range(k_count, unroll=1):
                        k = k_first + kk
                        ab_pipeline.producer_acquire(state)
                        barrier = ab_pipeline.producer_get_barrier(state)
                        if cutlass.const_expr(self.stages_a_scales):
                            self._copy_b_scales(scales, sB_scales, (m, n, batch), k, state.index, barrier)
                        cute.copy(tma_atom_a, tAgA_tile[(None, k)], tAsA[(None, state.index)],
                                  tma_bar_ptr=barrier, mcast_mask=a_mask)
                        if cutlass.const_expr(self.stages_a_scales):
                            # Not multicast: each CTA of the cluster loads its own 512 bytes.
                            cute.copy(scales[-2], tSg_scales[(None, m, k, batch)],
                                      tSs_scales[(None, state.index)], tma_bar_ptr=barrier)
                        for atom, (tBsB, tBgB) in zip(tma_atom_b, b_parts, strict=True):
                            cute.copy(atom, tBgB[(None, n, k, batch)], tBsB[(None, state.index)],
                                      tma_bar_ptr=barrier, mcast_mask=b_mask, cache_policy=b_policy)
                        ab_pipeline.producer_commit(state)
                        state.advance()
                    work += work_stride
                # Do not exit while peers may still release stages into our barriers.
                ab_pipeline.producer_tail(state)

            if cutlass.const_expr(self.has_epi_loads):
                if cutlass.const_expr(self.pingpong):
                    if warp_idx == EPILOGUE_LOAD_WARP:
                        # Tile t of the CTA goes to ring t % 2 (warpgroup t % 2's own stages), so each
                        # ring is an ordinary one-consumer pipeline: no skipping, no parity aliasing.
                        # Split-K: only units that run the epilogue (the last split of a tile) load,
                        # and each ring counts its own (loaded[r]: tiles loaded into ring r).
                        work = Int32(first_work)
                        tiles = Int32(0)
                        loaded0 = Int32(0)
                        loaded1 = Int32(0)
                        while work < num_work:
                            ring = tiles % 2
                            if self._runs_epilogue(sched, work):
                                tile_coord = sched.cta_tile(work, cta_in_cluster)
                                lstate = self.visitor.load_tile(
                                    self.shape, epi_params, visitor_storage, tile_coord
                                )
                                base = (loaded0 + ring * (loaded1 - loaded0)) * self.shape.num_subtiles
                                for epi_idx in cutlass.range_constexpr(self.shape.num_subtiles):
                                    state = self._ring_state(ring, base + epi_idx, base + epi_idx, True)
                                    load_pipeline.producer_acquire(state)
                                    self.visitor.load_subtile(
                                        self.shape, epi_params, visitor_storage, lstate, epi_idx,
                                        state.index, load_pipeline.producer_get_barrier(state),
                                    )
                                    load_pipeline.producer_commit(state)
                                loaded0 = loaded0 + 1 - ring
                                loaded1 = loaded1 + ring
                            tiles += 1
                            work += work_stride
                        # Tail: every stage of both rings handed back before the warp exits.
                        for ring in cutlass.range_constexpr(2):
                            base = (loaded1 if ring else loaded0) * self.shape.num_subtiles
                            for i in cutlass.range_constexpr(self.load_stages):
                                state = self._ring_state(ring, base + i, base + i, True)
                                load_pipeline.sync_object_empty.wait(state.index, state.phase)
                else:
                    if warp_idx == EPILOGUE_LOAD_WARP:
                        state = pipeline.make_pipeline_state(
                            pipeline.PipelineUserType.Producer, self.load_stages
                        )
                        work = Int32(first_work)
                        while work < num_work:
                            if self._runs_epilogue(sched, work):
                                state = self._load_tile_inputs(sched, work, cta_in_cluster, epi_params,
                                                               visitor_storage, load_pipeline, state)
                            work += work_stride
                        load_pipeline.producer_tail(state)

        # ======================================================================================
        # Consumer warpgroups: MMA, then the epilogue
        # ======================================================================================
        if warp_group > 0:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            # Pingpong: wg is this consumer warpgroup (0 or 1); it owns every other tile of the CTA.
            wg = warp_group - 1
            if cutlass.const_expr(self.pingpong):
                epi_tidx = tidx - warp_group * WARPGROUP_THREADS
                thr_mma = tiled_mma.get_slice(0)
            else:
                epi_tidx = tidx - WARPGROUP_THREADS
                # wgmma partitions are per warpgroup: slice the tiled MMA at the warpgroup's first thread.
                thr_mma = tiled_mma.get_slice((warp_group - 1) * WARPGROUP_THREADS)
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
            # The MMA tile (gated: twice as wide as the output tile gD is cut into).
            acc_shape = thr_mma.partition_C(cute.make_identity_tensor(self.tile_shape_mnk[:2])).shape
            acc = cute.make_rmem_tensor(acc_shape, self.acc_dtype)
            # Promoting float8 partial sums: the wgmma's accumulator of one K tile.
            acc_k = cute.make_rmem_tensor(acc_shape, self.acc_dtype) if cutlass.const_expr(self.promotes) \
                else None
            # Small promoting tiles: a second one, the two taking turns (GemmConfig.promotes_in_pairs).
            acc_k2 = cute.make_rmem_tensor(acc_shape, self.acc_dtype) \
                if cutlass.const_expr(self.promotes_in_pairs) else None
            k_blocks = cute.size(tCrA, mode=[2])
            factors = factors2 = factor_slot = None
            if cutlass.const_expr(self.block_scales):
                # Each K tile's products are scaled per row slot before they join the accumulator.
                row_offsets, n_chunks, factor_slot = self._scale_slots(tiled_mma, self.shape.num_threads)
                if cutlass.const_expr(self.block_scales == SCALE_BLOCK):
                    row_offsets = (0,)  # one A scale per tile and K tile: its 128-row block's
                    factor_slot = tuple(slot % n_chunks for slot in factor_slot)
                first_row = tiled_mma.get_slice(epi_tidx).partition_C(
                    cute.make_identity_tensor(self.tile_shape_mnk[:2]))[0][0]
                factors = cute.make_rmem_tensor((len(row_offsets) * n_chunks,), self.acc_dtype)
                # In pairs, each scratch accumulator has its own factors, loaded while its wgmma
                # runs and read a K tile later, after the wait.
                factors2 = cute.make_rmem_tensor((len(row_offsets) * n_chunks,), self.acc_dtype) \
                    if cutlass.const_expr(self.promotes_in_pairs) else None

            # ---- epilogue plumbing (built once, reused for every tile) --------------------------
            tiled_copy_c_atom = cute.make_tiled_copy_C_atom(
                cute.make_copy_atom(warp.StMatrix8x8x16bOp(self.d_layout.is_m_major_c(), 4),
                                    cutlass.Float16),
                tiled_mma,
            )
            r2s_atom = sm90_utils.get_smem_store_op(self.d_layout, self.d_dtype, self.acc_dtype)
            tiled_copy_r2s = cute.make_tiled_copy_S(r2s_atom, tiled_copy_c_atom)
            thr_copy_r2s = tiled_copy_r2s.get_slice(epi_tidx)
            tRS_sD = thr_copy_r2s.partition_D(sD)  # (R2S, R2S_M, R2S_N, stage)
            tRS_acc = tiled_copy_r2s.retile(acc)  # accumulator seen subtile by subtile
            frag_shape = cute.shape(thr_copy_r2s.partition_S(sD))[:3]
            frag_layout = cute.make_layout(frag_shape)
            frag = cute.make_rmem_tensor(frag_shape, self.acc_dtype)
            frag_up = cute.make_rmem_tensor(frag_shape, self.acc_dtype)  # gated: the up half
            frag_out = cute.make_rmem_tensor(frag_shape, self.d_dtype)
            frag_size = cute.size(frag)
            acc_map = None
            if cutlass.const_expr(self.pingpong):
                # With two m64 atoms along M the accumulator seen by the D copy is ((V, NC), 2, 1):
                # V values of one 16-column chunk, NC chunks along N, then the atom along M; a
                # subtile fragment is (V, 2, Nsub).  Subtile e is chunks [e * Nsub, (e + 1) * Nsub)
                # of both M halves, so it is not a contiguous run of tRS_acc (as it is at MMA_M = 1).
                acc_map = self._subtile_map(tRS_acc.shape, frag.shape)

            if cutlass.const_expr(self.pingpong):
                epi_barrier = pipeline.NamedBarrier(
                    barrier_id=EPILOGUE_BARRIER_ID + wg, num_threads=WARPGROUP_THREADS
                )
            else:
                epi_barrier = pipeline.NamedBarrier(
                    barrier_id=EPILOGUE_BARRIER_ID, num_threads=2 * WARPGROUP_THREADS
                )
            ctx = EpilogueContext(self.shape, epi_tidx, tiled_mma, tiled_copy_c_atom, tiled_copy_r2s,
                                  frag_layout, epi_barrier, wg if self.pingpong else 0)
            store_pipeline = pipeline.PipelineTmaStore.create(
                num_stages=self.d_stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.shape.num_threads),
            )
            if cutlass.const_expr(self.pingpong):
                # The first warp of each consumer warpgroup stores that warpgroup's tiles.
                is_store_warp = warp_idx == warp_group * 4
            else:
                is_store_warp = warp_idx == STORE_WARP
            num_subtiles = self.shape.num_subtiles

            read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
            release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
            load_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.load_stages)
            tiles_done = Int32(0)  # units this warpgroup ran (pingpong: orders the mainloops)
            epi_done = Int32(0)  # units that ran the epilogue (all but split-K's first splits)
            # D staged in the load buffers: the mainloop iteration at which the store warp hands the
            # previous tile's stages back (halfway: its stores have drained by then, and the C loads
            # of this tile still have half a mainloop to land).  0: after the mainloop.
            ring_release_k = k_tiles // 2

            work = Int32(first_work)
            work_step = work_stride
            if cutlass.const_expr(self.pingpong):
                # The CTA's tiles alternate between the warpgroups: WG 1 starts at the second one,
                # and both skip the other's A/B stages in the shared A/B ring (epilogue loads come
                # through per-warpgroup rings, see _ring_state).
                work = first_work + wg * work_stride
                work_step = 2 * work_stride
                d_base = wg * self.d_stages
                if wg > 0:
                    _, first_count = self._k_range(sched, first_work, k_tiles)
                    read_state, release_state = self._skip_tile(first_count, read_state, release_state)
            while work < num_work:
                tile_coord = sched.cta_tile(work, cta_in_cluster)
                k_first, k_count = self._k_range(sched, work, k_tiles)

                if cutlass.const_expr(self.pingpong):
                    # Our mainloop turn: after the other warpgroup has issued the previous tile's.
                    if wg + tiles_done > 0:
                        cute.arch.barrier(barrier_id=ORDER_BARRIER_ID + wg,
                                          number_of_threads=2 * WARPGROUP_THREADS)

                if cutlass.const_expr(self.promotes_in_pairs):
                    acc.fill(0.0)
                    # ---- float8 mainloop, small tiles (GemmConfig.promotes_in_pairs): two scratch
                    # accumulators take turns, K tiles 0, 2, 4... into acc_k and 1, 3, 5... into
                    # acc_k2. Each K tile's wgmmas are issued before the previous tile's are waited
                    # for and added into acc, so one batch is always in flight. The first and last
                    # K tiles are written out beside the loop of pairs: the same loop with each
                    # issue under a runtime `if k_tile < k_count` ran 23% slower on the H100 (our
                    # reading, not profiled: wgmma in conditional code is serialised), and helper
                    # methods cannot carry tiled_mma's accumulate flag across the DSL's loops.
                    ab_pipeline.consumer_wait(read_state)
                    if cutlass.const_expr(self.stages_a_scales):
                        self._load_block_factors(factors, scales, tile_coord, k_first, first_row,
                                                 row_offsets, n_chunks, staged_scales, read_state.index)
                    warpgroup.fence()
                    tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
                    for kb in cutlass.range_constexpr(k_blocks):
                        coord = (None, None, kb, read_state.index)
                        cute.gemm(tiled_mma, acc_k, tCrA[coord], tCrB[coord], acc_k)
                        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                    warpgroup.commit_group()
                    if cutlass.const_expr(self.block_scales and not self.stages_a_scales):
                        self._load_block_factors(factors, scales, tile_coord, k_first, first_row,
                                                 row_offsets, n_chunks)
                    read_state.advance()
                    for pair in cutlass.range(0, (k_count - 1) // 2, unroll=1):
                        for half in cutlass.range_constexpr(2):
                            scratch, previous = (acc_k2, acc_k) if half == 0 else (acc_k, acc_k2)
                            scratch_factors, previous_factors = \
                                (factors2, factors) if half == 0 else (factors, factors2)
                            ab_pipeline.consumer_wait(read_state)
                            if cutlass.const_expr(self.stages_a_scales):
                                self._load_block_factors(scratch_factors, scales, tile_coord,
                                                         k_first + 2 * pair + 1 + half, first_row,
                                                         row_offsets, n_chunks, staged_scales,
                                                         read_state.index)
                            warpgroup.fence()
                            tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
                            for kb in cutlass.range_constexpr(k_blocks):
                                coord = (None, None, kb, read_state.index)
                                cute.gemm(tiled_mma, scratch, tCrA[coord], tCrB[coord], scratch)
                                tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                            warpgroup.commit_group()
                            if cutlass.const_expr(self.block_scales and not self.stages_a_scales):
                                self._load_block_factors(scratch_factors, scales, tile_coord,
                                                         k_first + 2 * pair + 1 + half, first_row,
                                                         row_offsets, n_chunks)
                            read_state.advance()
                            self._release_ring_at(load_pipeline, is_store_warp, tiles_done,
                                                  2 * pair + 1 + half, ring_release_k)
                            warpgroup.wait_group(1)  # the previous K tile's batch is done
                            ab_pipeline.consumer_release(release_state)
                            release_state.advance()
                            self._promote(acc, previous, previous_factors, factor_slot)
                    if k_count % 2 == 0:
                        # The last K tile (odd) into acc_k2; then both retire.
                        ab_pipeline.consumer_wait(read_state)
                        if cutlass.const_expr(self.stages_a_scales):
                            self._load_block_factors(factors2, scales, tile_coord, k_first + k_count - 1,
                                                     first_row, row_offsets, n_chunks, staged_scales,
                                                     read_state.index)
                        warpgroup.fence()
                        tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
                        for kb in cutlass.range_constexpr(k_blocks):
                            coord = (None, None, kb, read_state.index)
                            cute.gemm(tiled_mma, acc_k2, tCrA[coord], tCrB[coord], acc_k2)
                            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                        warpgroup.commit_group()
                        if cutlass.const_expr(self.block_scales and not self.stages_a_scales):
                            self._load_block_factors(factors2, scales, tile_coord, k_first + k_count - 1,
                                                     first_row, row_offsets, n_chunks)
                        read_state.advance()
                        self._release_ring_at(load_pipeline, is_store_warp, tiles_done, k_count - 1,
                                              ring_release_k)
                        warpgroup.wait_group(1)
                        ab_pipeline.consumer_release(release_state)
                        release_state.advance()
                        self._promote(acc, acc_k, factors, factor_slot)
                        warpgroup.wait_group(0)
                        ab_pipeline.consumer_release(release_state)
                        release_state.advance()
                        self._promote(acc, acc_k2, factors2, factor_slot)
                    else:
                        warpgroup.wait_group(0)
                        ab_pipeline.consumer_release(release_state)
                        release_state.advance()
                        self._promote(acc, acc_k, factors, factor_slot)
                    if cutlass.const_expr(self.pingpong):
                        if work + work_stride < num_work:
                            cute.arch.barrier_arrive(barrier_id=ORDER_BARRIER_ID + 1 - wg,
                                                     number_of_threads=2 * WARPGROUP_THREADS)
                elif cutlass.const_expr(self.promotes):
                    acc.fill(0.0)
                    # ---- float8 mainloop: the wgmma sums each K tile's products in acc_k (with
                    # fewer mantissa bits than float32), which is then added into acc in float32
                    # (GemmConfig.fast_accum). The wait for each K tile's wgmma before the add is
                    # the cost; for these larger tiles the other consumer warpgroup fills it, and two
                    # scratch accumulators taking turns measured slower (docs/fp8.md).
                    for _k in cutlass.range(0, k_count, unroll=1):
                        ab_pipeline.consumer_wait(read_state)
                        if cutlass.const_expr(self.stages_a_scales):
                            # The scales from the stage: read before the wgmma is issued, while the
                            # shared memory is not yet busy with its operands (after the issue they
                            # queue behind them).
                            self._load_block_factors(factors, scales, tile_coord, k_first + _k, first_row,
                                                     row_offsets, n_chunks, staged_scales, read_state.index)
                        warpgroup.fence()
                        tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
                        for kb in cutlass.range_constexpr(k_blocks):
                            coord = (None, None, kb, read_state.index)
                            cute.gemm(tiled_mma, acc_k, tCrA[coord], tCrB[coord], acc_k)
                            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                        warpgroup.commit_group()
                        if cutlass.const_expr(self.block_scales and not self.stages_a_scales):
                            # Loaded while the wgmma runs: issued before it, the loads would hold up
                            # the wgmma fence until they land (1.5x the tensorwise kernel's time;
                            # loading them a K tile ahead measured slower again, docs/fp8.md).
                            self._load_block_factors(factors, scales, tile_coord, k_first + _k, first_row,
                                                     row_offsets, n_chunks)
                        self._release_ring_at(load_pipeline, is_store_warp, tiles_done, _k, ring_release_k)
                        warpgroup.wait_group(0)
                        ab_pipeline.consumer_release(release_state)
                        release_state.advance()
                        read_state.advance()
                        self._promote(acc, acc_k, factors, factor_slot)
                    if cutlass.const_expr(self.pingpong):
                        if work + work_stride < num_work:
                            cute.arch.barrier_arrive(barrier_id=ORDER_BARRIER_ID + 1 - wg,
                                                     number_of_threads=2 * WARPGROUP_THREADS)
                else:
                    # ---- mainloop: keep one wgmma batch in flight, release stages one behind -----
                    # The first K tile overwrites acc instead of adding to zeros: zeroing acc with
                    # register moves made ptxas wait for wgmmas at each tile's start.  Every unit
                    # has a K tile (the host clamps split counts to K's tiles; K = 0 takes torch).
                    ab_pipeline.consumer_wait(read_state)
                    warpgroup.fence()
                    tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
                    for kb in cutlass.range_constexpr(k_blocks):
                        coord = (None, None, kb, read_state.index)
                        cute.gemm(tiled_mma, acc, tCrA[coord], tCrB[coord], acc)
                        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                    warpgroup.commit_group()
                    read_state.advance()
                    for _k in cutlass.range(1, k_count, unroll=1):
                        ab_pipeline.consumer_wait(read_state)
                        warpgroup.fence()
                        for kb in cutlass.range_constexpr(k_blocks):
                            coord = (None, None, kb, read_state.index)
                            cute.gemm(tiled_mma, acc, tCrA[coord], tCrB[coord], acc)
                        warpgroup.commit_group()
                        self._release_ring_at(load_pipeline, is_store_warp, tiles_done, _k, ring_release_k)
                        # The batch issued one iteration ago is done: its stage can be refilled.
                        warpgroup.wait_group(1)
                        ab_pipeline.consumer_release(release_state)
                        release_state.advance()
                        read_state.advance()
                    if cutlass.const_expr(self.pingpong):
                        # Hand the tensor cores to the other warpgroup if the CTA has a next tile (so
                        # arrivals and waits on each order barrier pair up exactly).
                        if work + work_stride < num_work:
                            cute.arch.barrier_arrive(barrier_id=ORDER_BARRIER_ID + 1 - wg,
                                                     number_of_threads=2 * WARPGROUP_THREADS)
                    warpgroup.wait_group(0)
                    ab_pipeline.consumer_release(release_state)
                    release_state.advance()
                if cutlass.const_expr(self.d_in_load_buffers):
                    if is_store_warp:
                        if tiles_done > 0:
                            if ring_release_k < 1:
                                self._release_load_ring(load_pipeline)

                if cutlass.const_expr(self.split_k):
                    self._split_k_combine(acc, split, sched, work, cta_in_cluster, epi_tidx, epi_barrier)

                # ---- epilogue (split-K: the last split of the tile only) -------------------------
                if self._runs_epilogue(sched, work):
                    m, n, batch = tile_coord
                    gD_epi = cute.zipped_divide(gD[(None, None, m, n, batch)], self.shape.epi_tile)
                    bSG_sD, bSG_gD = cpasync.tma_partition(
                        tma_atom_d, 0, cute.make_layout(1), cute.group_modes(sD, 0, 2), gD_epi
                    )
                    vstate = self.visitor.begin(ctx, epi_params, visitor_storage, tile_coord)
                    for epi_idx in cutlass.range_constexpr(num_subtiles):
                        if cutlass.const_expr(epi_idx == 0):
                            self.visitor.begin_loop(ctx, vstate, 0)
                            load_state = self._subtile_inputs(ctx, vstate, 0, load_pipeline, load_state,
                                                              epi_done, wg)
                        self._read_subtile(frag, tRS_acc, acc_map, epi_idx, frag_size)
                        if cutlass.const_expr(self.gated):
                            # Output subtile i: gate columns in accumulator subtile i, the matching
                            # up columns half a tile further along N.
                            self._read_subtile(frag_up, tRS_acc, acc_map, epi_idx + self.shape.num_subtiles,
                                               frag_size)
                            values = self.visitor.visit(ctx, vstate, epi_idx, (frag.load(), frag_up.load()))
                        else:
                            values = self.visitor.visit(ctx, vstate, epi_idx, frag.load())
                        if cutlass.const_expr(epi_idx + 1 < num_subtiles):
                            # The next subtile's inputs now, so that their shared-memory reads (and a
                            # load still landing) overlap this subtile's barriers and D store.
                            self.visitor.begin_loop(ctx, vstate, epi_idx + 1)
                            load_state = self._subtile_inputs(ctx, vstate, epi_idx + 1, load_pipeline,
                                                              load_state, epi_done, wg)

                        if cutlass.const_expr(self.store_d):
                            d_stage = (epi_done * num_subtiles + epi_idx) % self.d_stages
                            if cutlass.const_expr(self.pingpong):
                                d_stage = d_base + d_stage
                            # D's buffer: its own stage, or the load stage subtile epi_idx of C was in (stage
                            # epi_idx of a whole-tile ring, read out by every thread before the barrier).
                            d_buf = d_stage
                            if cutlass.const_expr(self.d_in_load_buffers):
                                d_buf = epi_idx
                            # The D buffer about to be written must have been read out by its TMA store.
                            if cutlass.const_expr(not self.d_in_load_buffers):
                                if is_store_warp:
                                    store_pipeline.producer_acquire()
                            epi_barrier.arrive_and_wait()
                            self.visitor.reduce(ctx, vstate, epi_idx, sD[(None, None, d_buf)])
                            frag_out.store(narrow(values, self.d_dtype))
                            cute.copy(tiled_copy_r2s, frag_out, tRS_sD[(None, None, None, d_buf)])
                            self.visitor.postreduce(ctx, vstate, epi_idx, d_stage)
                            # stmatrix writes through the generic proxy, TMA reads through the async proxy.
                            cute.arch.fence_view_async_shared()
                            epi_barrier.arrive_and_wait()
                            if is_store_warp:
                                cute.copy(tma_atom_d, bSG_sD[(None, d_buf)],
                                          bSG_gD[(None, self.shape.subtile_coord(epi_idx))])
                                self.visitor.tma_store(ctx, vstate, epi_idx, d_stage)
                                store_pipeline.producer_commit()
                        self.visitor.end_loop(ctx, vstate, epi_idx)
                    self.visitor.end(ctx, vstate)
                    epi_done += 1

                tiles_done += 1
                work += work_step
                if cutlass.const_expr(self.pingpong):
                    # The other warpgroup's next unit (the one after ours in the CTA's sequence).
                    _, other_count = self._k_range(sched, work - work_stride, k_tiles)
                    read_state, release_state = self._skip_tile(other_count, read_state, release_state)

            if cutlass.const_expr(self.d_in_load_buffers):
                # The last tile's stages: the epilogue-load warp waits for them before it exits.
                if is_store_warp:
                    if tiles_done > 0:
                        self._release_load_ring(load_pipeline)
            # Shared memory must stay alive until the last TMA store has read it.
            if cutlass.const_expr(self.store_d):
                if is_store_warp:
                    store_pipeline.producer_tail()
