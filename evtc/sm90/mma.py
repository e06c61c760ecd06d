"""The kernel's warpgroup MMA: the DSL's own for 16-bit and float8 A and B, ours for tf32.

The CuTe DSL 4.8.1 exposes the SM90 wgmma for f16/bf16, float8 and int8 operands only, but the MLIR
type under them (``MmaAtomSM90Type``) also takes tf32, which PTX offers as
``wgmma.mma_async.m64nNk8.f32.tf32.tf32``. :class:`MmaTF32Op` builds that atom the way the DSL's
own operations build theirs; it depends on DSL internals, which the exact pin of
nvidia-cutlass-dsl keeps still (``test_k_major_float32_compiles_to_the_tf32_wgmma`` in
tests/test_tf32.py would catch a change).

The tf32 wgmma reads both operands from shared memory as stored, float32 bit patterns, and uses
their top 19 bits (sign, exponent, 10 mantissa bits): each element is rounded toward zero to tf32.
Both operands must be K-major.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass._mlir.dialects.cute_nvgpu as _cute_nvgpu_ir
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.atom import make_atom
from cutlass.cute.core import _pack_shape
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.cute.nvgpu.warpgroup.mma import MmaF16BF16Trait, MmaOp
from cutlass.cutlass_dsl import Boolean

#: K of one tf32 wgmma instruction (32 bytes of each operand row, as the 16-bit one's k16).
TF32_INSTRUCTION_K = 8


@dataclass(frozen=True)
class MmaTF32Op(MmaOp):
    """``wgmma.mma_async.m64nNk8.f32.tf32.tf32``, A and B from shared memory, both K-major."""

    descriptive_name = "warpgroup TF32 MMA Operation"

    def __init__(self, tile_n: int) -> None:
        super().__init__(cutlass.TFloat32, cutlass.TFloat32, cutlass.Float32,
                         (64, tile_n, TF32_INSTRUCTION_K), warpgroup.OperandSource.SMEM,
                         OperandMajorMode.K, OperandMajorMode.K)

    def _make_trait(self, *, loc=None, ip=None, **kwargs) -> MmaF16BF16Trait:
        shape_mnk = _pack_shape(self.shape_mnk, loc=loc, ip=ip)
        ty = _cute_nvgpu_ir.MmaAtomSM90Type.get(
            shape_mnk.type.attribute,
            self.a_major_mode._to_ir(),
            self.b_major_mode._to_ir(),
            self.a_dtype.mlir_type,
            self.b_dtype.mlir_type,
            self.acc_dtype.mlir_type,
            self.a_src._to_ir(),
        )
        # The trait only carries the ACCUMULATE field, which every SM90 MMA atom has.
        return MmaF16BF16Trait(make_atom(ty, [Boolean(False).ir_value(loc=loc, ip=ip)], loc=loc, ip=ip))


def make_tiled_mma(a_dtype, b_dtype, a_major, b_major, acc_dtype, atom_layout_mnk, tiler_mn) -> cute.TiledMma:
    """The tiled warpgroup MMA for A and B of these dtypes and majors (``OperandMajorMode``),
    ``atom_layout_mnk`` m64 atoms per tile and ``tiler_mn`` = (64, tile_n) per atom. float32 A and B
    run as tf32 and must both be K-major (the config's validation says so first)."""
    if a_dtype == cutlass.Float32:
        if b_dtype != cutlass.Float32:
            raise TypeError(f"float32 A takes float32 B, got {b_dtype}")
        if (a_major, b_major) != (OperandMajorMode.K, OperandMajorMode.K):
            raise TypeError("the tf32 wgmma reads A and B K-major only")
        return cute.make_tiled_mma(cute.make_mma_atom(MmaTF32Op(tiler_mn[1])), atom_layout_mnk)
    return sm90_utils.make_trivial_tiled_mma(a_dtype, b_dtype, a_major, b_major, acc_dtype, atom_layout_mnk,
                                             tiler_mn=tiler_mn)


__all__ = ["TF32_INSTRUCTION_K", "MmaTF32Op", "make_tiled_mma"]
