"""Autograd for ``evtc.linear``: the backward of ``fn(x @ weight.t(), **operands)``.

The forward runs the fused kernel. The backward evaluates the epilogue's backward graph
(:mod:`evtc.ir.autodiff`, derived once per :class:`evtc.Linear`) on the recomputed accumulator, which
gives ``dZ = df/dacc * dY`` and the operands' gradients, then ``dx = dZ @ weight`` and
``dweight = dZ^T @ x``. Nothing but the inputs is saved.

This is the reference backward: the backward graph runs as torch operations through the IR's
interpreter in float32, on the accumulator recomputed by a GEMM (in 16-bit with float32 accumulation
for 16-bit inputs on the GPU, with dZ rounded to 16 bits for dx and dweight, as eager autograd
does; in float32 otherwise: :func:`evtc.runtime.op_autograd.gemm_epilogue_backward`). Fused
backward kernels (dZ in the epilogue of the GEMM that makes dY) are the next step of issue
"Training".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from evtc.linear import Linear


class LinearFunction(torch.autograd.Function):
    """``LinearFunction.apply(lin, x, weight, names, *values)``: the outputs of ``lin`` as a tuple in
    the order of its output names, differentiable in ``x``, ``weight`` and the tensor operands."""

    @staticmethod
    def forward(ctx, lin: Linear, x: torch.Tensor, weight: torch.Tensor, names: tuple[str, ...],
                *values: Any) -> tuple[torch.Tensor, ...]:
        operands = dict(zip(names, values, strict=True))
        result = lin._call(x, weight, None, operands)
        leaves = lin._output_leaves(result)
        ctx.lin, ctx.names = lin, names
        ctx.tensor_slots = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
        ctx.others = [None if isinstance(v, torch.Tensor) else v for v in values]
        ctx.save_for_backward(x, weight, *[values[i] for i in ctx.tensor_slots])
        outputs = tuple(leaves[name] for name in lin.output_names)
        ctx.mark_non_differentiable(*[t for t in outputs if not t.dtype.is_floating_point])
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs: torch.Tensor | None):
        x, weight, *tensors = ctx.saved_tensors
        values = list(ctx.others)
        for slot, t in zip(ctx.tensor_slots, tensors, strict=True):
            values[slot] = t
        operands = dict(zip(ctx.names, values, strict=True))
        grads = dict(zip(ctx.lin.output_names, grad_outputs, strict=True))
        dx, dweight, d_operands = ctx.lin._gradients(x, weight, operands, grads)
        needs = ctx.needs_input_grad
        operand_grads = [d_operands.get(name) if needs[4 + i] else None for i, name in enumerate(ctx.names)]
        return (None, dx if needs[1] else None, dweight if needs[2] else None, None, *operand_grads)


def backward_of_linear(lin: Linear, x: torch.Tensor, weight: torch.Tensor, operands: dict[str, Any],
                       grads: dict[str, torch.Tensor | None]):
    """(dx, dweight, {operand: gradient}) of ``lin``'s call on ``x``, ``weight``, ``operands``
    given the outputs' gradients ``grads`` by output name (None for outputs that received none):
    the GEMM epilogue's backward with a = x (flattened) and b = weight^T."""
    from evtc.linear import _flatten_like
    from evtc.runtime.op_autograd import gemm_epilogue_backward

    lead = tuple(x.shape[:-1])
    names = list(operands)
    flat = [_flatten_like(operands[name], lead) for name in names]
    da, db, *d_flat = gemm_epilogue_backward(lin.backward_graph(), x.reshape(-1, x.shape[-1]), weight.t(),
                                             names, flat, grads)
    d_operands = {name: d.reshape(operands[name].shape) for name, d in zip(names, d_flat, strict=True)
                  if d is not None}
    return da.reshape(x.shape), db.t(), d_operands


__all__ = ["LinearFunction", "backward_of_linear"]
