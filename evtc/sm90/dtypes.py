"""Dtype names used in configs, and their cutlass / torch counterparts."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

_CUTLASS = {
    "float16": cutlass.Float16,
    "bfloat16": cutlass.BFloat16,
    "float32": cutlass.Float32,
    "float8_e4m3fn": cutlass.Float8E4M3FN,
    "float8_e5m2": cutlass.Float8E5M2,
    "int32": cutlass.Int32,
}


def cutlass_dtype(name: str):
    return _CUTLASS[name]


def torch_dtype(name: str):
    import torch

    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
            "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}[name]


def dtype_name(torch_dtype_) -> str:
    import torch

    names = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
             torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2"}
    if torch_dtype_ not in names:
        raise ValueError(f"unsupported dtype {torch_dtype_}; use float16, bfloat16, float32 or float8")
    return names[torch_dtype_]


#: From here on torch rounds a float32 value to float8_e5m2's infinity: the largest finite value,
#: 57344, plus half its spacing (4096), a tie that rounds to the even neighbour, infinity.
E5M2_OVERFLOW = 61440.0


def narrow(values, dtype):
    """float32 ``values`` (a fragment or one value) converted to the storage ``dtype`` as torch's
    ``.to(dtype)`` rounds them.

    The hardware's float8 conversion (``cvt.rn.satfinite``) saturates. That is torch's rule for
    float8_e4m3fn (which has no infinity), but torch rounds float8_e5m2 overflow to infinity, so
    values at or beyond :data:`E5M2_OVERFLOW` (infinities included) are replaced by a signed
    infinity after the conversion.
    """
    narrowed = values.to(dtype)
    if dtype is not cutlass.Float8E5M2:
        return narrowed
    if isinstance(values, cute.TensorSSA):
        positive = cute.full_like(narrowed, float("inf"), dtype)
        negative = cute.full_like(narrowed, float("-inf"), dtype)
        narrowed = cute.where(values >= E5M2_OVERFLOW, positive, narrowed)
        return cute.where(values <= -E5M2_OVERFLOW, negative, narrowed)
    narrowed = cutlass.select_(values >= E5M2_OVERFLOW, dtype(float("inf")), narrowed)
    return cutlass.select_(values <= -E5M2_OVERFLOW, dtype(float("-inf")), narrowed)
