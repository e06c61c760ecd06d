"""Dtype names used in configs, and their cutlass / torch counterparts."""

from __future__ import annotations

import cutlass

_CUTLASS = {
    "float16": cutlass.Float16,
    "bfloat16": cutlass.BFloat16,
    "float32": cutlass.Float32,
}


def cutlass_dtype(name: str):
    return _CUTLASS[name]


def torch_dtype(name: str):
    import torch

    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def dtype_name(torch_dtype_) -> str:
    import torch

    names = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
    if torch_dtype_ not in names:
        raise ValueError(f"unsupported dtype {torch_dtype_}; use float16, bfloat16 or float32")
    return names[torch_dtype_]
