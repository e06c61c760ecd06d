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
                           operands: Sequence[Any], by_output: dict[str, torch.Tensor | None],
                           acc: torch.Tensor | None = None) -> tuple:
    """(da, db, *operand gradients) of ``epilogue(a @ b, *operands)`` with backward graph ``back``,
    given the outputs' gradients by output name (None or missing: no gradient). ``acc``: the
    accumulator as the forward saved it (any float dtype), else recomputed where the graph reads it."""
    from evtc.ir.interpreter import accumulator
    from evtc.ir.shapes import L, M, N, evaluate_shape

    # 16-bit inputs on the GPU: the GEMMs run as eager autograd's would, on the tensor cores with
    # float32 accumulation and 16-bit results (the accumulator rounded as the 16-bit output that
    # eager autograd saves, dZ rounded before dX and dW). In float32 they would run several times
    # slower than the forward (docs/training.md). Otherwise (float32 inputs, the CPU): float32.
    low = a.dtype == b.dtype and a.dtype in _LOW_PRECISION and a.is_cuda
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    acc_shape = (*batch, a.shape[-2], b.shape[-1])
    feeds: dict[str, Any] = dict(zip(names, operands, strict=True))
    # An epilogue linear in acc (bias, residual, scaling) has a backward that never reads it: no
    # GEMM to recompute it then.
    if acc is not None:
        feeds[back.graph.acc_name] = acc
    elif any(node.op == "acc" for node in back.graph.nodes):
        feeds[back.graph.acc_name] = (torch.matmul(a, b).to(torch.float32) if low
                                      else accumulator(a, b, torch.float32))
    else:  # only its sizes are read: a broadcast zero of its shape, no memory
        feeds[back.graph.acc_name] = torch.zeros((), dtype=torch.float32, device=a.device).expand(acc_shape)
    sizes = {M: acc_shape[-2], N: acc_shape[-1], L: acc_shape[0] if len(acc_shape) == 3 else 1}
    for name, grad_name in back.output_grads.items():
        shape = evaluate_shape(back.grad_shapes[grad_name], sizes)
        g = by_output.get(name)
        feeds[grad_name] = (torch.zeros(shape, dtype=torch.float32, device=a.device) if g is None
                            else g.reshape(shape))
    result = _evaluate(back, feeds, a.dtype if low else torch.float32)
    d_acc = result.get(back.graph.acc_name)
    if d_acc is None:
        d_acc = torch.zeros(acc_shape, dtype=a.dtype if low else torch.float32, device=a.device)
    elif tuple(d_acc.shape) != acc_shape:  # a gradient that broadcasts over the tile
        d_acc = d_acc.expand(acc_shape)
    if low:
        dz = d_acc  # already rounded to the inputs' dtype
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


def _evaluate(back: Backward, feeds: dict[str, Any], dz_dtype: torch.dtype) -> dict[str, Any]:
    """``back``'s graph evaluated in float32 on ``feeds`` (the accumulator and the incoming
    gradients in any float dtype), with dZ rounded to ``dz_dtype``. (Run through torch.compile, to
    fuse its elementwise steps, it made the training step of bench/train.py no faster on the H100:
    22.4 ms against 21.9 ms.)"""
    acc_name = back.graph.acc_name
    grad_names = set(back.output_grads.values())
    inputs = {k: (v.to(torch.float32) if k == acc_name or k in grad_names else v) for k, v in feeds.items()}
    result = back.graph.evaluate(inputs, compute_dtype=torch.float32, cast_outputs=False)
    if acc_name in result:
        result = {**result, acc_name: result[acc_name].to(dz_dtype)}
    return result


__all__ = ["gemm_epilogue_backward", "op_backward"]
