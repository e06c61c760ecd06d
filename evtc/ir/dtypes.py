"""Data types that appear in epilogue graphs.

The IR uses torch dtypes directly: they are what users write, and torch's promotion rules decide the
dtype of every traced value, so that a graph means exactly what the same function means on tensors.
"""

from __future__ import annotations

import math

import torch

#: All compute nodes take and produce this (or bool): explicit casts are the only dtype changers.
COMPUTE_DTYPE = torch.float32

#: Dtypes an epilogue operand tensor may have in memory.
OPERAND_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: Dtypes of the GEMM inputs a and b, all of which the SM90 kernel takes. float32 runs as tf32, and
#: only where torch allows tf32 for float32 matmuls; otherwise it takes the torch path
#: (evtc.runtime.fallback).
GEMM_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2)

#: Dtypes a value may be cast to with `.to(dtype)`, and an output may be stored as.
CAST_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)

FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

#: What an output may be stored as: the cast dtypes, and bool for a mask (``acc > 0`` returned is
#: a bool tensor, as torch gives it; the kernel writes its bytes as 0 and 1).
STORE_DTYPES = (*CAST_DTYPES, torch.bool)

#: What the kernel stores a bool output as: float8_e4m3fn, whose values 0 and 2^-9 are encoded as
#: the bytes 0 and 1 (torch's False and True). The kernel is handed float8 views of bool tensors.
MASK_STORAGE = torch.float8_e4m3fn
MASK_STORAGE_NAME = "float8_e4m3fn"
# What explain() and `python -m evtc cache list` add to a configuration whose D is a mask (its
# d_dtype names the storage).
MASK_D_NOTE = "D is a torch.bool mask, stored as its bytes through float8_e4m3fn stores"


def as_kernel_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the compiled function takes it: a bool tensor as a float8 view of its bytes."""
    return t.view(MASK_STORAGE) if t.dtype == torch.bool else t

_SHORT_NAMES = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float8_e4m3fn: "e4m3",
    torch.float8_e5m2: "e5m2",
    torch.bool: "bool",
}


def eager_acc_dtype(ab_dtype: torch.dtype) -> torch.dtype:
    """The dtype ``acc`` has for torch's promotion rules (and ``acc.dtype`` inside an epilogue):
    a's, as torch's ``a @ b`` gives it; float32 for float8 a and b, which torch multiplies only
    through ``torch._scaled_mm(..., out_dtype=...)``."""
    return torch.float32 if ab_dtype in FLOAT8_DTYPES else ab_dtype


def variant_name(dtype: torch.dtype, zero_dim: bool) -> str:
    """An operand's dtype and whether it is 0-dim, as a kernel's plan lists the ones a call may
    pass (``"bf16"``, ``"f32/0-dim"``): those that leave every output's dtype as compiled."""
    return short_name(dtype) + ("/0-dim" if zero_dim else "")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype that a kernel plan names as text (``"float16"``, ``"float8_e4m3fn"``,
    ``"bool"``): the one table between the plan's JSON and torch."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def short_name(dtype: torch.dtype) -> str:
    """A compact name for printing: f32, bf16, e4m3, ..."""
    return _SHORT_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def is_float8(dtype: torch.dtype) -> bool:
    return dtype in FLOAT8_DTYPES


def round_to(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round `values` to `dtype` and return them in their original dtype (a rounding cast).

    As torch rounds: float8_e5m2 overflows to infinity, and float8_e4m3fn, which has no infinity,
    saturates to its largest finite value (448). That is torch 2.12's rule and the kernel's
    saturating conversion; torch 2.11 and earlier gave NaN beyond 464 in eager mode (a torch bug
    since fixed; torch.compile saturated all along).
    """
    if dtype == values.dtype:
        return values
    if dtype == torch.float8_e4m3fn:
        limit = torch.finfo(dtype).max
        values = values.clamp(-limit, limit)
    return values.to(dtype).to(values.dtype)


#: The largest finite float32 value.
FLOAT32_MAX = torch.finfo(torch.float32).max


def as_float32_literal(value: float) -> float:
    """A Python number as a float32 literal takes it: +-inf beyond float32's range, as torch
    makes a number it combines with a float32 tensor (``acc * 1e39``)."""
    # Round to nearest: a number overflows only from FLT_MAX plus half an ulp (2**103) on, so the
    # printed 3.4028235e38, a hair above FLT_MAX, is FLT_MAX (as torch converts it), not inf.
    if math.isfinite(value) and abs(value) >= FLOAT32_MAX + 2.0 ** 103:
        return math.copysign(math.inf, value)
    if math.isfinite(value) and abs(value) > FLOAT32_MAX:
        return math.copysign(FLOAT32_MAX, value)
    return value


def beyond_int64(value: object) -> bool:
    """Whether ``value`` is a Python int that torch refuses as a scalar (it reads ints as int64)."""
    return isinstance(value, int) and not -(1 << 63) <= value < (1 << 63)
