"""The torch path: ``torch.matmul``, then the epilogue evaluated by torch from the graph.

Calls the SM90 kernel cannot run at all take this path instead of failing: tensors on the CPU, a
machine without a Hopper GPU, float32 ``a`` and ``b`` while torch's tf32 setting is off (the kernel
multiplies them as tf32) or where they were compiled other than K-major, K = 0.
It is the definition of the result (the interpreter is the meaning of the IR), so it is right
wherever torch is; it is not fused, so it is as slow as eager PyTorch.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from evtc.ir.block_scales import is_pair
from evtc.ir.graph import Graph
from evtc.ir.interpreter import accumulator, evaluate


def accumulate(a: Any, b: Any) -> torch.Tensor:
    """``a @ b`` in float32, as the kernel's accumulator holds it.

    16-bit inputs are widened first (a float32 product of float16 values is exact, so only the
    summation order differs from the tensor cores'). float32 inputs go to ``torch.matmul`` as they
    are, so ``torch.backends.cuda.matmul.allow_tf32`` decides their precision, as it does for
    torch's own matmul. Block-scaled ``(tensor, scales)`` pairs: the interpreter's product of the
    dequantized tensors (in float64, whatever the TF32 setting)."""
    if is_pair(a) or is_pair(b):
        return accumulator(a, b, torch.float32)
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        return torch.matmul(a, b)
    return torch.matmul(a.float(), b.float())


def run(graph: Graph, a: Any, b: Any, operands: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The outputs of ``graph`` for ``a @ b`` and ``operands``, by output name, in their dtypes.

    Outside any ``torch.autocast`` region of the caller: autocast would run the float32 product and
    the epilogue's ops in 16 bits, where the kernel computes in float32 (the kernel's dtypes are
    the compiled ones, autocast or not)."""
    device = (a[0] if is_pair(a) else a).device.type
    with torch.autocast(device, enabled=False) if device in ("cpu", "cuda") else contextlib.nullcontext():
        values = {graph.acc_name: accumulate(a, b), **operands}
        result = evaluate(graph, values)
    names = graph.outputs.names
    if graph.outputs.kind == "single":
        return {names[0]: result}
    if graph.outputs.kind in ("tuple", "list"):
        return dict(zip(names, result, strict=True))
    return {name: result[key] for name, key in zip(names, graph.outputs.keys, strict=True)}


def run_call(spec, graph: Graph, a: Any, b: Any, out, operands: dict[str, Any],
             scales=None) -> list[torch.Tensor]:
    """A call on the torch path: its outputs in kernel order (``spec``: the kernel's
    :class:`evtc.runtime.call_spec.CallSpec`), laid out as the kernel would lay them out, or
    copied into ``out``'s tensors when given."""
    from evtc.runtime.call_checks import copy_into_given
    from evtc.runtime.out_aliasing import distinct_outputs
    from evtc.runtime.staging import empty_in_layout

    if scales is not None:  # block-scaled float8: the pairs, as the interpreter takes them
        a, b = (a, scales[0]), (b, scales[1])
    results = run(graph, a, b, operands)
    # Tensors of their own, as the kernel writes: torch returns an input itself for `return C`,
    # and one tensor for `return y, y`.
    inputs = [t for v in (a, b, *operands.values()) for t in (v if isinstance(v, tuple) else (v,))]
    values = distinct_outputs([results[name].contiguous() for name in spec.kernel_order], inputs)
    if spec.d_by_m:  # the layout the kernel would give
        d, d_spec = values[0], spec.plan.outputs[0]
        values[0] = empty_in_layout(tuple(d.shape), d.dtype, d_spec, d.device).copy_(d)
    if out is None:
        return values
    return copy_into_given(spec, out, spec.kernel_order, values)


__all__ = ["accumulate", "run", "run_call"]
