"""Dtype names used in configs, and their cutlass / torch counterparts."""

from __future__ import annotations

import cutlass

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
