"""Autograd for ``evtc.linear``: the backward of ``fn(x @ weight.t(), **operands)``.

The forward runs the fused kernel. The backward evaluates the epilogue's backward graph
(:mod:`evtc.ir.autodiff`, derived once per :class:`evtc.Linear`) on the recomputed accumulator, which
gives ``dZ = df/dacc * dY`` and the operands' gradients, then ``dx = dZ @ weight`` and
``dweight = dZ^T @ x``. Nothing but the inputs is saved.

This is the reference backward: the backward graph runs as torch operations through the IR's
interpreter, and the accumulator is recomputed in float32. Fused backward kernels (dZ in the
epilogue of the GEMM that makes dY) are the next step of issue "Training".
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
    given the outputs' gradients ``grads`` (None for outputs that received none)."""
    from evtc.ir.interpreter import accumulator
    from evtc.ir.shapes import L, M, N, evaluate_shape
    from evtc.linear import _flatten_like

    back = lin.backward_graph()
    lead = tuple(x.shape[:-1])
    x2 = x.reshape(-1, x.shape[-1])
    acc = accumulator(x2, weight.t(), torch.float32)
    sizes = {M: acc.shape[0], N: acc.shape[1], L: 1}  # the traced graph is not split: N is acc's
    flat = {name: _flatten_like(v, lead) for name, v in operands.items()}
    feeds: dict[str, Any] = {back.graph.acc_name: acc, **flat}
    for name, grad_name in back.output_grads.items():
        shape = evaluate_shape(back.grad_shapes[grad_name], sizes)
        g = grads.get(name)
        g = torch.zeros(shape, dtype=torch.float32, device=acc.device) if g is None else \
            g.to(torch.float32).reshape(shape)
        feeds[grad_name] = g
    result = back.graph.evaluate(feeds, compute_dtype=torch.float32, cast_outputs=False)
    d_acc = result.get(back.graph.acc_name)
    if d_acc is None:
        d_acc = torch.zeros_like(acc)
    dx = (d_acc @ weight.to(torch.float32)).to(x.dtype).reshape(x.shape)
    dweight = (d_acc.t() @ x2.to(torch.float32)).to(weight.dtype)
    d_operands = {}
    for name, value in operands.items():
        if isinstance(value, torch.Tensor) and name in result:
            d_operands[name] = result[name].reshape(value.shape).to(value.dtype)
    return dx, dweight, d_operands


__all__ = ["LinearFunction", "backward_of_linear"]
