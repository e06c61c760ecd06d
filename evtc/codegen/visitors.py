"""Hand-written epilogue visitors: the first users of the protocol in :mod:`evtc.codegen.visitor`."""

from __future__ import annotations

from types import SimpleNamespace

import cutlass.cute as cute
from cutlass import Float32

from .config import DTYPE_BYTES, GemmConfig
from .dtypes import cutlass_dtype, dtype_name
from .visitor import (
    EpilogueContext,
    EpilogueShape,
    EpilogueVisitor,
    TmaTileLoad,
    allocate_staged,
    float_scalar,
    make_epi_smem_layout,
    operand_layout,
)


class Identity(EpilogueVisitor):
    """D = acc, converted to D's dtype.  No arguments, no shared memory."""

    name = "identity"


class LinearCombination(EpilogueVisitor):
    """D = alpha * acc + beta * C.

    ``c_dtype`` / ``c_major`` are static (part of the compile key); ``alpha`` and ``beta`` are runtime
    float32 scalars, ``c`` a runtime (M, N) or (L, M, N) tensor.  C is loaded by TMA one subtile at a
    time by the epilogue-load warp, ``load_stages`` subtiles ahead of the consumers.

    Call arguments: ``c=<tensor>, alpha=<float>, beta=<float>``.
    """

    name = "linear_combination"

    def __init__(self, c_dtype: str = "float16", c_major: str = "n"):
        if c_dtype not in DTYPE_BYTES:
            raise ValueError(f"LinearCombination: unsupported c_dtype {c_dtype!r}")
        if c_major not in ("n", "m"):
            raise ValueError(f"LinearCombination: c_major must be 'n' or 'm', got {c_major!r}")
        self.c_dtype_name = c_dtype
        self.c_major = c_major
        self.c_dtype = cutlass_dtype(c_dtype)
        self.c_layout = operand_layout(c_major)

    # ---- host, plain Python ----------------------------------------------------------------------
    def cache_key(self) -> tuple:
        return (type(self).__qualname__, self.c_dtype_name, self.c_major)

    def _stage_bytes(self, config: GemmConfig) -> int:
        return config.epi_tile[0] * config.epi_tile[1] * DTYPE_BYTES[self.c_dtype_name]

    def smem_bytes(self, config: GemmConfig, load_stages: int) -> int:
        return self._stage_bytes(config) * load_stages

    def load_bytes(self, config: GemmConfig) -> int:
        return self._stage_bytes(config)

    def offers_d_buffer(self, config: GemmConfig) -> bool:
        return self.c_dtype_name == config.d_dtype and self.c_major == config.d_major

    def example_args(self, config: GemmConfig) -> tuple:
        from .runtime import example_tensor

        return (example_tensor(self.c_dtype_name, self.c_major), float_scalar(1.0), float_scalar(0.0))

    def runtime_args(self, config: GemmConfig, problem, *, c=None, alpha=1.0, beta=1.0, **extra) -> tuple:
        from .runtime import operand_to_cute

        if extra:
            raise ValueError(f"{self.name}: unexpected arguments {sorted(extra)}")
        if c is None:
            raise ValueError(f"{self.name}: needs c=<tensor of shape (M, N) or (L, M, N)>")
        if dtype_name(c.dtype) != self.c_dtype_name:
            raise ValueError(f"{self.name}: c must be {self.c_dtype_name}, got {c.dtype}")
        m, n, _, batches = problem
        c_cute = operand_to_cute(c, "c", (m, n, batches), self.c_major, ("m", "n"))
        return (c_cute, float_scalar(alpha), float_scalar(beta))

    # ---- host, traced ----------------------------------------------------------------------------
    def setup(self, shape: EpilogueShape, args: tuple) -> tuple:
        c, alpha, beta = args
        staged = make_epi_smem_layout(self.c_dtype, self.c_layout, shape, shape.load_stages)
        atom, tma_c = TmaTileLoad.make(c, staged, shape)
        return (atom, tma_c, alpha, beta)

    # ---- device ----------------------------------------------------------------------------------
    def allocate(self, shape: EpilogueShape, params: tuple, smem):
        # Rebuilt here rather than kept from setup: layouts made in the host function stay there.
        staged = make_epi_smem_layout(self.c_dtype, self.c_layout, shape, shape.load_stages)
        return allocate_staged(smem, self.c_dtype, staged)

    def d_buffer(self, shape: EpilogueShape, storage):
        return storage

    def load_tile(self, shape, params, storage, tile_coord):
        atom, tma_c, _, _ = params
        return TmaTileLoad(atom, tma_c, storage, tile_coord, shape)

    def load_subtile(self, shape, params, storage, load_state, epi_idx, stage, barrier_ptr):
        load_state.copy(epi_idx, stage, barrier_ptr)

    def begin(self, ctx: EpilogueContext, params, storage, tile_coord):
        _, _, alpha, beta = params
        return SimpleNamespace(reader=ctx.smem_reader(storage, self.c_layout), c=None,
                               alpha=alpha, beta=beta)

    def previsit(self, ctx, state, epi_idx, load_stage):
        state.c = state.reader.load(load_stage)

    def visit(self, ctx, state, epi_idx, acc: cute.TensorSSA) -> cute.TensorSSA:
        return acc * Float32(state.alpha) + state.c * Float32(state.beta)
