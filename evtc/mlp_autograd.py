"""Autograd for :class:`evtc.nn.MLP`: ``second(first(x))``, two fused linears seen as one pair.

Seen one at a time (:mod:`evtc.linear_autograd`), the first layer's backward receives its incoming
gradient ``dH = dZ2 @ W2`` from the second layer's as a tensor in memory, and runs its epilogue's
backward over it as torch operations. Seen as a pair, ``dH`` is the accumulator of a GEMM whose
epilogue computes the first layer's ``dZ1`` directly (:mod:`evtc.ir.backward_epilogue`), reading
the accumulator the forward saved: dH is never stored, and the elementwise backward is one pass
inside that GEMM instead of one torch kernel per operation.

The backward, for 16-bit inputs on the GPU:

1. ``dZ2`` and the second layer's operand gradients (its residual's, say) from its backward graph,
   as :func:`evtc.runtime.op_autograd.epilogue_gradients` computes them;
2. ``dW2 = dZ2^T @ H`` (torch.matmul, in the weight's layout), with ``H`` the first layer's
   output, saved;
3. ``dZ1``: the fused kernel ``dZ1 = dz(dZ2 @ W2, saved accumulator, operands)``; for a gated
   epilogue its two outputs are written into the halves of one tensor. The first layer's trained
   bias gets its gradient from the same kernel, as a column sum of dZ1 (a bias as wide as a gated
   layer's GEMM, ``(acc + bias).chunk(2, -1)``, from dZ1's two halves);
4. ``dX = dZ1 @ W1`` and ``dW1 = dZ1^T @ X`` (torch.matmul).

Where the fused kernel does not apply (float32 or CPU inputs; a first epilogue whose dZ is not one
elementwise pass, or an operand's gradient that is not one of those, see
:func:`evtc.ir.backward_epilogue.dz_epilogue`; a kernel that does not compile), step 3
is the unfused one: ``dH = dZ2 @ W2``, then the first layer's dZ (and its operands' gradients) as
one elementwise kernel over dH where :mod:`evtc.dz_pass` applies, else its backward graph as torch
operations.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.function import once_differentiable

from evtc import dz_pass
from evtc.linear_autograd import first_derivative_only, not_views, save_inputs, saved_inputs
from evtc.runtime.op_autograd import (
    epilogue_gradients,
    input_gradients,
    joined_accumulator,
    recomputed_accumulator,
    weight_gradient,
)

if TYPE_CHECKING:
    from evtc.linear import Linear

class MLPFunction(torch.autograd.Function):
    """``MLPFunction.apply(pair, x, w1, w2, names1, names2, *values)``: the second layer's outputs
    (a tuple in its output order) of ``second(first(x, w1, **operands1), w2, **operands2)``.

    ``pair`` (an :class:`evtc.nn.MLP`) provides ``first_linear(x, ops1, w1)`` and
    ``second_linear(h, ops2, w2)``, the two :class:`evtc.Linear`, and ``dz_kernel(first, dz2, w2, ops1,
    operand_grads)``, the fused kernel of step 3 and its epilogue, or None. Under ``torch.compile`` the same
    forward and backward run as custom operators instead (:mod:`evtc.mlp_op`).
    """

    @staticmethod
    def forward(ctx, pair, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                names1: tuple[str, ...], names2: tuple[str, ...], *values: Any) -> tuple[torch.Tensor, ...]:
        ops1 = dict(zip(names1, values[:len(names1)], strict=True))
        ops2 = dict(zip(names2, values[len(names1):], strict=True))
        outputs, h, saved1, saved2 = mlp_forward(pair, x, w1, w2, ops1, ops2)
        # What torch.compile runs instead (evtc.mlp_op), registered by the first eager call.
        pair.note_eager_forward(x, ops1, ops2, outputs, h, saved1, saved2)
        ctx.pair = pair
        ctx.names1, ctx.names2 = names1, names2
        ctx.counts = (len(saved1), len(saved2))
        ctx.tensor_slots = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
        ctx.others = [None if isinstance(v, torch.Tensor) else v for v in values]
        # The second layer's operands only where its backward graph loads them (a residual's
        # gradient is the incoming one: the residual is not kept alive, nor guarded against changes).
        _, loads = pair._second.backward_reads()
        first_count = len(names1)
        save_inputs(ctx, [x, w1, w2, h, *saved1, *saved2, *[values[i] for i in ctx.tensor_slots]],
                    [True] * (4 + len(saved1) + len(saved2))
                    + [i < first_count or names2[i - first_count] in loads for i in ctx.tensor_slots])
        outputs = not_views(outputs)
        ctx.mark_non_differentiable(*[t for t in outputs if not t.dtype.is_floating_point])
        return outputs

    @staticmethod
    @first_derivative_only
    @once_differentiable  # its kernels' saved accumulators are not differentiable: no create_graph
    def backward(ctx, *grad_outputs: torch.Tensor | None):
        x, w1, w2, h, *rest = saved_inputs(ctx)
        n1, n2 = ctx.counts
        saved1, saved2, tensors = rest[:n1], rest[n1:n1 + n2], rest[n1 + n2:]
        values = list(ctx.others)
        for slot, t in zip(ctx.tensor_slots, tensors, strict=True):
            values[slot] = t
        names1, names2 = ctx.names1, ctx.names2
        ops1 = dict(zip(names1, values[:len(names1)], strict=True))
        ops2 = dict(zip(names2, values[len(names1):], strict=True))
        needs = ctx.needs_input_grad
        dx, dw1, dw2, grads_ops1, grads_ops2 = mlp_backward(
            ctx.pair, x, w1, w2, h, tuple(saved1), tuple(saved2), ops1, ops2, grad_outputs,
            needs[1:4], needs[6:6 + len(names1)], needs[6 + len(names1):])
        return (None, dx, dw1, dw2, None, None, *grads_ops1, *grads_ops2)


def mlp_forward(pair, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, ops1: dict[str, Any],
                ops2: dict[str, Any]):
    """(the second layer's outputs in its output order, the first layer's output ``h``, what each
    layer's backward reads: its accumulator or nothing)."""
    first = pair.first_linear(x, ops1, w1)
    (h,), saved1 = _run_saving(first, x, w1, ops1)
    second = pair.second_linear(h, ops2, w2)
    outputs, saved2 = _run_saving(second, h, w2, ops2)
    return outputs, h, saved1, saved2


def mlp_backward(pair, x, w1, w2, h, saved1, saved2, ops1: dict[str, Any], ops2: dict[str, Any],
                 grad_outputs, need_weights: tuple[bool, bool, bool], needs1, needs2):
    """(dx, dw1, dw2, [gradients of ops1], [gradients of ops2]) from the second layer's outputs'
    gradients (steps 1 to 4 of the module's docstring); ``need_weights``: whether x, w1 and w2 need
    theirs, ``needs1`` and ``needs2`` the same per operand (None where not needed)."""
    names1, names2 = tuple(ops1), tuple(ops2)
    first, second = pair.first_linear(x, ops1, w1), pair.second_linear(h, ops2, w2)
    need_x, need_w1, need_w2 = need_weights
    from evtc.linear import _rows

    lead = tuple(x.shape[:-1])
    x2, h2 = _rows(x), _rows(h)
    # 1. The second layer's dZ and operand gradients.
    flat2 = [_flat(ops2[n], lead) for n in names2]
    grads2 = dict(zip(second.output_names, grad_outputs, strict=True))
    dz2, d_ops2 = epilogue_gradients(second.backward_graph(), h2, w2.t(), names2, flat2, grads2,
                                     acc=_joined(saved2))
    # 2. Its weight's gradient (and dZ2 @ W2 below, fused or not).
    dw2 = weight_gradient(dz2, h2, w2) if need_w2 else None
    # 3. The first layer's dZ.
    flat1 = [_flat(ops1[n], lead) for n in names1]
    fused = None
    by_name1 = dict(zip(names1, flat1, strict=True))
    wanted = tuple(n for n, need in zip(names1, needs1, strict=True) if need)
    if fused_applies(x, w1, w2):
        fused = pair.dz_kernel(first, dz2, w2, by_name1, wanted)
    d_ops1: list[torch.Tensor | None] = [None] * len(names1)
    if fused is not None:
        kernel, epilogue = fused
        dz1, by_name = _fused_dz(kernel, epilogue, dz2, w2, x2, w1, saved1, by_name1)
        d_ops1 = [by_name.get(n) for n in names1]
    else:
        dh, _ = input_gradients(dz2, h2, w2.t(), need_a=True, need_b=False)
        (out_name,) = first.output_names
        passed = None
        saved_rows = tuple(s.reshape(-1, s.shape[-1]) for s in saved1)
        if dz_pass.applies(x2, w1, saved_rows):
            # dH in memory, then dZ1 and the operands' gradients in one elementwise kernel.
            passed = dz_pass.gradients(first, x2, by_name1, {out_name: dh}, saved_rows, wanted)
        if passed is not None:
            dz1, by_name = passed
            d_ops1 = [by_name.get(n) for n in names1]
        else:
            dz1, d_ops1 = epilogue_gradients(first.backward_graph(), x2, w1.t(), names1, flat1,
                                             {out_name: dh}, acc=_joined(saved1))
    # 4. The input's and the first weight's gradients.
    dx, _ = input_gradients(dz1, x2, w1.t(), need_a=need_x, need_b=False)
    dw1 = weight_gradient(dz1, x2, w1) if need_w1 else None
    grads_ops1 = [_shaped(d, ops1[n], lead) if need else None
                  for d, n, need in zip(d_ops1, names1, needs1, strict=True)]
    grads_ops2 = [_shaped(d, ops2[n], lead) if need else None
                  for d, n, need in zip(d_ops2, names2, needs2, strict=True)]
    return None if dx is None else dx.reshape(x.shape), dw1, dw2, grads_ops1, grads_ops2


def _run_saving(lin: Linear, x, weight, operands):
    """``lin``'s outputs (a tuple in its output order) and what its backward reads: the
    accumulator (or its halves), from the kernel that also stores it, where the backward reads it."""
    saving = lin._saving_kernel()
    if saving is None:
        leaves = lin._output_leaves(lin._call(x, weight, None, operands))
        return tuple(leaves[name] for name in lin.output_names), ()
    result = lin._call_kernel(saving, x, weight, operands)
    count = len(lin.output_names)
    return tuple(result[:count]), tuple(result[count:])


def fused_applies(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether step 3 may be the fused kernel, as far as the inputs tell: 16-bit, on the GPU."""
    return x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and x.dtype == w1.dtype == w2.dtype


def _fused_dz(kernel, epilogue, dz2, w2, x2, w1, saved1,
              ops1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Step 3: (``dZ1``, {operand: gradient}) from the kernel whose accumulator is ``dZ2 @ W2``."""
    feeds = {**_saved_halves(saved1, epilogue, x2, w1), **dz_pass.operand_feeds(epilogue, ops1)}
    return dz_pass.launch(kernel, epilogue, dz2, w2, feeds, ops1, (x2.shape[0],), w1.shape[0] // 2)


def _saved_halves(saved1, epilogue, x2, w1) -> dict[str, torch.Tensor]:
    """The saved accumulator as the fused kernel's parameters (recomputed where the forward saved
    none: an epilogue with its own output dtypes)."""
    if not epilogue.saved:
        return {}
    if not saved1:
        acc = recomputed_accumulator(x2, w1.t())
        saved1 = tuple(acc.chunk(2, dim=-1)) if epilogue.gated else (acc,)
    parts = tuple(s.reshape(-1, s.shape[-1]) for s in saved1)
    if epilogue.gated:
        return {name: parts[("saved_gate", "saved_up").index(name)] for name in epilogue.saved}
    return {"saved": parts[0]}


def _joined(saved: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
    if not saved:
        return None
    return joined_accumulator(tuple(s.reshape(-1, s.shape[-1]) for s in saved))


def _flat(value: Any, lead: tuple[int, ...]) -> Any:
    from evtc.linear import _flatten_like

    return _flatten_like(value, lead)


def _shaped(grad: torch.Tensor | None, value: Any, lead: tuple[int, ...]) -> torch.Tensor | None:
    from evtc.linear import unflatten_gradient

    return unflatten_gradient(grad, value, lead)


__all__ = ["MLPFunction", "mlp_backward", "mlp_forward"]
