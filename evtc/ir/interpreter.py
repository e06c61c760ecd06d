"""The reference evaluator: runs a graph node by node on torch tensors.

It is the meaning of the IR. Every pass is tested by evaluating the graph before and after it on
the same random inputs, and the whole pipeline by comparing with the epilogue run directly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sympy
import torch

from .block_scales import dequantized, is_pair, scale_problem, split_inputs
from .dtypes import COMPUTE_DTYPE, as_float32_literal, round_to
from .graph import Graph, Node
from .ops import ELEMENTWISE, REDUCE_FUNCS
from .shapes import L, M, N, evaluate_shape, evaluate_value


def accumulator(a: Any, b: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """acc = a @ b computed in `dtype` (float32 as on the tensor cores, or float64 for checks).

    Block-scaled float8 `a` and `b` come as `(tensor, scales)` pairs (:mod:`evtc.ir.block_scales`):
    acc is then the product of the dequantized tensors, computed in float64 and rounded to `dtype`."""
    if is_pair(a) or is_pair(b):
        plain, scales = split_inputs({"a": a, "b": b})
        a, b = plain["a"], plain["b"]
        problem, rows = scale_problem(a, b, scales)
        if problem is not None:
            raise ValueError(problem)
        a, b = dequantized(a, b, scales, rows, torch.float64)
        return torch.matmul(a, b).to(dtype)
    return torch.matmul(a.to(dtype), b.to(dtype))


def _reduce_dims(axis: str, rank: int) -> tuple[int, ...]:
    return {
        "row": (rank - 1,),
        "col": (rank - 2,),
        "batch": (rank - 2, rank - 1),
        "all": tuple(range(rank)),
    }[axis]


def evaluate(
    graph: Graph,
    inputs: Mapping[str, Any],
    *,
    compute_dtype: torch.dtype = COMPUTE_DTYPE,
    cast_outputs: bool = True,
) -> Any:
    """Evaluate `graph` on `inputs` (a, b or the accumulator by its parameter name, and operands).

    Arithmetic runs in `compute_dtype`; explicit casts round to their dtype. With `cast_outputs`,
    outputs come back in their store dtype, otherwise in `compute_dtype` (exactly as computed).
    Returns the outputs in the structure the epilogue returns.
    """
    try:
        return _evaluate(graph, inputs, compute_dtype, cast_outputs)
    except KeyError:
        _require_inputs(graph, inputs)  # names every input left out (off the path of a good call)
        raise


def _evaluate(graph: Graph, inputs: Mapping[str, Any], compute_dtype: torch.dtype, cast_outputs: bool) -> Any:
    if graph.acc_name in inputs:
        acc = inputs[graph.acc_name].to(compute_dtype)
    else:
        acc = accumulator(inputs["a"], inputs["b"], compute_dtype)
    # A split gated graph (evtc.ir.passes.gated) is in the output's coordinates: N is half the GEMM's.
    width = acc.shape[-1] // 2 if graph.gated else acc.shape[-1]
    sizes = {M: acc.shape[-2], N: width, L: acc.shape[0] if acc.dim() == 3 else 1}
    values: dict[int, Any] = {}
    outputs: dict[str, torch.Tensor] = {}
    for node in graph.nodes:
        result = _evaluate_node(node, values, inputs, acc, sizes, compute_dtype)
        if node.op == "store":
            stored = result
            outputs[node.attrs["name"]] = stored.to(node.dtype) if cast_outputs else stored
        values[node.id] = result
    return graph.outputs.build(outputs)


def _require_inputs(graph: Graph, inputs: Mapping[str, Any]) -> None:
    """Refuse ``inputs`` that lack one the graph reads, naming every missing one (a bare KeyError
    from deep in the evaluation would name one, as a dict lookup)."""
    needed = [node.attrs["name"] for node in graph.nodes if node.op in ("load", "arg")
              and "half_of" not in node.attrs]
    needed += [node.attrs["half_of"][0] for node in graph.nodes if "half_of" in node.attrs]
    missing = sorted({name for name in needed if name not in inputs})
    if graph.acc_name not in inputs and not {"a", "b"} <= set(inputs):
        missing = [f"{graph.acc_name} (or a and b)", *missing]
    if missing:
        from ..errors import InputError

        raise InputError(f"{graph.name!r} evaluated without its input(s) {', '.join(missing)}; it reads "
                         f"{', '.join(dict.fromkeys([graph.acc_name, *needed]))}")


def _evaluate_node(
    node: Node,
    values: dict[int, Any],
    inputs: Mapping[str, Any],
    acc: torch.Tensor,
    sizes: dict[sympy.Symbol, int],
    compute_dtype: torch.dtype,
) -> Any:
    args = [values[i.id] for i in node.inputs]
    op = node.op
    if op == "acc":
        half = node.attrs.get("half")  # a split gated graph's gate (0) or up (1) accumulator
        return acc if half is None else torch.chunk(acc, 2, dim=-1)[half]
    if op == "load":
        # Widening a stored value to the compute dtype is exact.
        if "half_of" in node.attrs:  # a half of a wide operand of a split gated graph
            source, half = node.attrs["half_of"]
            value = torch.chunk(inputs[source], 2, dim=-1)[half]
        else:
            value = inputs[node.attrs["name"]]
        return value.to(device=acc.device, dtype=compute_dtype)
    # Scalars are made on the device by a fill (torch.full), not copied from the host as
    # torch.tensor would: a copy cannot be captured in a CUDA graph (the backward of evtc.linear
    # evaluates its graph here, inside captured training steps).
    if op == "arg":
        return _scalar(float(inputs[node.attrs["name"]]), compute_dtype, acc.device)
    if op == "literal":
        return _scalar(evaluate_value(node.attrs["value"], sizes), compute_dtype, acc.device)
    if op == "cast":
        return _cast(args[0], node.dtype, compute_dtype)
    if op == "store":
        return _cast(args[0], node.dtype, compute_dtype)
    if op == "join":  # backward graphs (evtc.ir.autodiff): two halves of the last dim side by side
        return torch.cat(torch.broadcast_tensors(args[0], args[1]), dim=-1)
    if op == "half":
        return torch.chunk(args[0], 2, dim=-1)[node.attrs["index"]]
    if op == "reduce" and node.attrs["axis"] == "to_shape":
        # Backward graphs (evtc.ir.autodiff): a sum down to a shape the value was broadcast from.
        value = args[0].expand(evaluate_shape(node.inputs[0].shape, sizes))
        return value.sum_to_size(evaluate_shape(node.attrs["to_shape"], sizes))
    if op == "reduce":
        dims = _reduce_dims(node.attrs["axis"], args[0].dim())
        reduced = REDUCE_FUNCS[node.attrs["reduce"]](args[0], dim=dims, keepdim=node.attrs["keepdim"])
        return reduced
    definition = ELEMENTWISE[op]
    params = {p: node.attrs[p] for p in definition.params}
    result = definition.evaluate(*args, **params)
    if not definition.boolean:
        result = _cast(result, node.dtype, compute_dtype)
    return result


def _scalar(value: Any, compute_dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A number as a 0-d tensor of ``compute_dtype``. Beyond float32's range it is +-inf, as torch
    makes a Python number it combines with a float32 tensor (``acc * 1e39``); torch.full refuses."""
    if compute_dtype == torch.float32 and isinstance(value, float):
        value = as_float32_literal(value)
    return torch.full((), value, dtype=compute_dtype, device=device)


def _cast(value: torch.Tensor, dtype: torch.dtype, compute_dtype: torch.dtype) -> torch.Tensor:
    """A value of `dtype`, held in `compute_dtype` (rounded through `dtype` where narrower)."""
    if value.dtype == torch.bool:
        value = value.to(compute_dtype)
    if dtype in (torch.float32, compute_dtype):
        return value.to(compute_dtype)
    return round_to(value.to(compute_dtype), dtype)
