"""Shape and dtype rules for every node, shared by the tracer, the passes and validation."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..errors import ReductionError, ShapeError, SourceLoc
from .ops import ELEMENTWISE
from .shapes import HALF_N, ONE, L, M, N, Shape, broadcast, format_shape, problem_shape, varying_dims

if TYPE_CHECKING:
    from .graph import Node


def reduced_shape(shape: Shape, axis: str, keepdim: bool) -> Shape:
    """Shape of a reduction of a full-tile value over `axis` (row / col / batch / all)."""
    lead, (m, n) = shape[:-2], shape[-2:]
    if axis == "row":
        return (*lead, m, ONE) if keepdim else (*lead, m)
    if axis == "col":
        return (*lead, ONE, n) if keepdim else (*lead, n)
    if axis == "batch":
        return (*lead, ONE, ONE) if keepdim else lead
    if axis == "all":
        return tuple(ONE for _ in shape) if keepdim else ()
    raise ValueError(f"unknown reduction axis {axis!r}")


def infer_shape(
    op: str, inputs: tuple[Node, ...], attrs: dict[str, Any], batched: bool, loc: SourceLoc | None
) -> Shape:
    if op == "acc":
        return problem_shape(batched)
    if op == "load":
        return attrs["shape"]
    if op in ("arg", "literal"):
        return ()
    if op in ("cast", "store"):
        return inputs[0].shape
    if op == "half":
        shape = inputs[0].shape
        if not shape or shape[-1] != N:
            raise ShapeError(
                f"chunk(2, dim=-1) of a value of shape {format_shape(shape)}: only values as wide as "
                "the accumulator (N along the last dim) split into gate and up halves",
                loc,
            )
        return (*shape[:-1], HALF_N)
    if op == "reduce":
        shape = inputs[0].shape
        if len(shape) < 2 or not {M, N} <= varying_dims(shape):
            raise ReductionError(
                f"cannot reduce a value of shape {format_shape(shape)}: reductions apply to values "
                "that vary over the whole (M, N) tile",
                loc,
            )
        return reduced_shape(shape, attrs["axis"], attrs["keepdim"])
    if op in ELEMENTWISE:
        shapes = [i.shape for i in inputs]
        result = broadcast(shapes)
        if result is None:
            listed = ", ".join(format_shape(s) for s in shapes)
            raise ShapeError(
                f"{op}: shapes {listed} do not broadcast for every problem size "
                f"(symbols L, M, N stand for independent sizes)",
                loc,
            )
        if batched and len(result) > 3 or not batched and len(result) > 2:
            raise ShapeError(f"{op}: result of rank {len(result)} is above the accumulator's", loc)
        return result
    raise ValueError(f"unknown op {op!r}")


def promotion_stand_in(dtype: torch.dtype, python_number: bool, zero_dim: bool) -> Any:
    """A value that torch.result_type ranks as it ranks a value of ``dtype`` that is a Python number,
    a 0-dim tensor (which promotes like a number of its category) or a tensor with dims."""
    if python_number:
        if dtype == torch.bool:
            return True
        return 1.0 if dtype.is_floating_point else 1
    return torch.empty(() if zero_dim else (1,), dtype=dtype)


def promote(inputs: tuple[Node, ...] | list[Node]) -> torch.dtype:
    """The dtype torch gives an op on one or two values of these kinds (its promotion rules)."""
    dummies = [promotion_stand_in(i.dtype, i.is_python_scalar, len(i.shape) == 0) for i in inputs]
    if len(dummies) == 1:
        only = dummies[0]
        return only.dtype if isinstance(only, torch.Tensor) else inputs[0].dtype
    first, second = dummies
    if not isinstance(first, torch.Tensor) and not isinstance(second, torch.Tensor):
        # Arithmetic between Python numbers: a Python number again, computed in float32.
        return torch.float32
    return torch.result_type(first, second)


def infer_dtype(op: str, inputs: tuple[Node, ...], attrs: dict[str, Any]) -> torch.dtype:
    if op == "acc":
        return torch.float32
    if op == "load":
        return attrs["dtype"]
    if op in ("arg", "literal"):
        return torch.float32
    if op in ("cast", "store"):
        return attrs["dtype"]
    if op in ("reduce", "half"):
        return inputs[0].dtype
    definition = ELEMENTWISE[op]
    if definition.boolean:
        return torch.bool
    if op == "where":
        return promote(inputs[1:])
    dtype = promote(inputs)
    if dtype == torch.bool:
        # Arithmetic on masks (mask * 2, -mask) is promoted by torch to an integer or float dtype;
        # in the epilogue every such value computes as float32.
        return torch.float32
    return dtype


__all__ = ["infer_dtype", "infer_shape", "promote", "reduced_shape", "L", "M", "N"]
