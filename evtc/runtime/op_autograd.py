"""Autograd for a kernel's custom operator (``torch.ops.evtc.*``), so that ``k(a, b, ...)`` and the
operator are differentiable, eagerly and under ``torch.compile``.

The backward is the reference one (as for ``evtc.linear``, see :mod:`evtc.linear_autograd`): the
epilogue's backward graph (:mod:`evtc.ir.autodiff`) evaluated in float32 on the recomputed
accumulator, then ``da = dZ @ b^T`` and ``db = a^T @ dZ`` (16-bit GEMMs for 16-bit inputs on the GPU,
as eager autograd runs them; float32 otherwise). It is written in torch operations only, so
``torch.compile`` traces it like any backward formula.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from evtc.ir.autodiff import Backward
    from evtc.runtime.kernel import Kernel


_LOW_PRECISION = (torch.float16, torch.bfloat16)


def op_backward(kernel: Kernel, a: torch.Tensor, b: torch.Tensor, operands: Sequence[Any],
                grads: Sequence[torch.Tensor | None]) -> tuple:
    """Gradients of (a, b, *operands) (None for Python-number operands) from the gradients of the
    kernel's outputs in its output order."""
    return gemm_epilogue_backward(kernel.backward_graph(), a, b, kernel.operand_names, operands,
                                  dict(zip(kernel.plan.output_order, grads, strict=True)))


def gemm_epilogue_backward(back: Backward, a: torch.Tensor, b: torch.Tensor, names: Sequence[str],
                           operands: Sequence[Any], by_output: dict[str, torch.Tensor | None]) -> tuple:
    """(da, db, *operand gradients) of ``epilogue(a @ b, *operands)`` with backward graph ``back``,
    given the outputs' gradients by output name (None or missing: no gradient)."""
    from evtc.ir.interpreter import accumulator
    from evtc.ir.shapes import L, M, N, evaluate_shape

    # 16-bit inputs on the GPU: the GEMMs run as eager autograd's would, on the tensor cores with
    # float32 accumulation and 16-bit results (the accumulator rounded as the 16-bit output that
    # eager autograd saves, dZ rounded before dX and dW). In float32 they would run several times
    # slower than the forward (docs/training.md). Otherwise (float32 inputs, the CPU): float32.
    low = a.dtype == b.dtype and a.dtype in _LOW_PRECISION and a.is_cuda
    acc = torch.matmul(a, b).to(torch.float32) if low else accumulator(a, b, torch.float32)
    sizes = {M: acc.shape[-2], N: acc.shape[-1], L: acc.shape[0] if acc.dim() == 3 else 1}
    feeds: dict[str, Any] = {back.graph.acc_name: acc, **dict(zip(names, operands, strict=True))}
    for name, grad_name in back.output_grads.items():
        shape = evaluate_shape(back.grad_shapes[grad_name], sizes)
        g = by_output.get(name)
        feeds[grad_name] = (torch.zeros(shape, dtype=torch.float32, device=acc.device) if g is None
                            else g.to(torch.float32).reshape(shape))
    result = back.graph.evaluate(feeds, compute_dtype=torch.float32, cast_outputs=False)
    d_acc = result.get(back.graph.acc_name)
    if d_acc is None:
        d_acc = torch.zeros_like(acc)
    if low:
        dz = d_acc.to(a.dtype)
        da, db = dz @ b.transpose(-1, -2), a.transpose(-1, -2) @ dz
    else:
        da = (d_acc @ b.to(torch.float32).transpose(-1, -2)).to(a.dtype)
        db = (a.to(torch.float32).transpose(-1, -2) @ d_acc).to(b.dtype)
    if da.shape != a.shape:  # a shared by all batches
        da = da.sum_to_size(a.shape)
    if db.shape != b.shape:
        db = db.sum_to_size(b.shape)
    d_operands = []
    for name, value in zip(names, operands, strict=True):
        if isinstance(value, torch.Tensor) and name in result:
            d_operands.append(result[name].reshape(value.shape).to(value.dtype))
        else:
            d_operands.append(None)
    return (da, db, *d_operands)


__all__ = ["gemm_epilogue_backward", "op_backward"]
