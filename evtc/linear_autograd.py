"""Autograd for ``evtc.linear``: the backward of ``fn(x @ weight.t(), **operands)``.

The forward runs the fused kernel, or where the backward reads the accumulator its twin that also
stores it (:meth:`evtc.Linear._saving_kernel`). The backward evaluates the epilogue's backward graph
(:mod:`evtc.ir.autodiff`, derived once per :class:`evtc.Linear`) on that accumulator, which gives
``dZ = df/dacc * dY`` and the operands' gradients, then ``dx = dZ @ weight`` and
``dweight = dZ^T @ x``.

For 16-bit inputs on the GPU with a saved accumulator, dZ and the wanted operands' gradients are
one elementwise evtc kernel (:mod:`evtc.dz_pass`). Elsewhere the reference backward runs: the
backward graph as torch operations through the IR's interpreter in float32. The GEMMs (dx,
dweight, and an accumulator recomputed where none was saved) run in 16 bits with float32
accumulation for 16-bit inputs on the GPU, with dZ rounded to 16 bits, as eager autograd runs them
(a float16 accumulator, saved or recomputed, is kept in float32: its range), and in float32
otherwise (:func:`evtc.runtime.op_autograd.gemm_epilogue_backward`). dZ in the
epilogue of the GEMM that makes dY needs both layers: :mod:`evtc.mlp_autograd`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.function import once_differentiable

from evtc.runtime.op_autograd import joined_accumulator

if TYPE_CHECKING:
    from evtc.linear import Linear


def not_views(outputs: tuple) -> tuple:
    """``outputs`` with each view (x's leading dims put back on a kernel's flat output, a reduction
    cut from one allocation) made a tensor of its own over the same memory, without a copy: an
    autograd Function's outputs that are views refuse in-place changes (``y.mul_(2)``,
    ``nn.ReLU(inplace=True)`` after the layer), which nn.Linear's outputs take."""
    unsafe_view = torch.ops.aten._unsafe_view
    return tuple(unsafe_view(t, t.shape) if isinstance(t, torch.Tensor) and t._is_view() else t
                 for t in outputs)


def backward_reads(back) -> tuple[bool, frozenset[str]]:
    """What the backward graph ``back`` reads besides the incoming gradients: whether the
    accumulator's values, and the names it loads (operands; incoming gradients too)."""
    nodes = back.graph.nodes
    return (any(node.op == "acc" for node in nodes),
            frozenset(node.attrs["name"] for node in nodes if node.op == "load"))


def save_inputs(ctx, tensors: list[torch.Tensor], needed: list[bool]) -> None:
    """Save ``tensors`` for the backward where ``needed``; of the others only their shape, dtype
    and device (:func:`saved_inputs` gives a stand-in of no memory): a tensor the backward never
    reads is neither kept alive nor guarded by its version counter (changing a residual in place
    between forward and backward is legal in eager torch)."""
    ctx.save_for_backward(*[t for t, keep in zip(tensors, needed, strict=True) if keep])
    ctx.absent = [None if keep else (t.shape, t.dtype, t.device)
                  for t, keep in zip(tensors, needed, strict=True)]


def saved_inputs(ctx) -> list[torch.Tensor]:
    """The tensors :func:`save_inputs` was given, those not saved as zero-strided stand-ins of their
    shape, dtype and device (their values are never read)."""
    saved = iter(ctx.saved_tensors)
    return [next(saved) if meta is None else torch.zeros((), dtype=meta[1], device=meta[2]).expand(meta[0])
            for meta in ctx.absent]


def first_derivative_only(backward):
    """``backward`` (a ``torch.autograd.Function``'s, already ``once_differentiable``) refusing
    ``backward(create_graph=True)``: ``once_differentiable`` raises only where the incoming gradients
    require grad, so a gradient penalty (``autograd.grad(y.sum(), x, create_graph=True)``) would get
    a gradient with no graph, and the penalty's own gradient would silently miss it."""
    def checked(ctx, *grad_outputs):
        if torch.is_grad_enabled():  # autograd runs a backward with grad mode = create_graph
            raise RuntimeError(
                "a second derivative (backward(create_graph=True), autograd.grad(..., create_graph=True)) "
                "through evtc's fused layers is not supported: their backward is differentiated once "
                "only. Compute a gradient penalty through the plain torch layers")
        return backward(ctx, *grad_outputs)

    checked.__doc__ = backward.__doc__
    return checked


class LinearFunction(torch.autograd.Function):
    """``LinearFunction.apply(lin, x, weight, names, *values)``: the outputs of ``lin`` as a tuple in
    the order of its output names, differentiable in ``x``, ``weight`` and the tensor operands."""

    @staticmethod
    def forward(ctx, lin: Linear, x: torch.Tensor, weight: torch.Tensor, names: tuple[str, ...],
                *values: Any) -> tuple[torch.Tensor, ...]:
        operands = dict(zip(names, values, strict=True))
        saving = lin._saving_kernel()
        if saving is None:
            leaves = lin._output_leaves(lin._call(x, weight, None, operands))
            outputs, saved_acc = tuple(leaves[name] for name in lin.output_names), ()
        else:
            # The epilogue's outputs, then the accumulator (or its halves) for the backward.
            result = lin._call_kernel(saving, x, weight, operands)
            count = len(lin.output_names)
            outputs, saved_acc = tuple(result[:count]), tuple(result[count:])
        ctx.lin, ctx.names, ctx.saved_count = lin, names, len(saved_acc)
        ctx.tensor_slots = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
        ctx.others = [None if isinstance(v, torch.Tensor) else v for v in values]
        # Only what the backward reads: x for the weight's gradient, the weight for x's, both to
        # recompute the accumulator, and the operands its graph loads (a residual's gradient is
        # the incoming one: the residual itself is not kept alive, nor guarded against changes).
        reads_acc, loads = lin.backward_reads()
        recompute = reads_acc and not saved_acc
        needs = ctx.needs_input_grad
        save_inputs(ctx, [x, weight, *saved_acc, *[values[i] for i in ctx.tensor_slots]],
                    [needs[2] or recompute, needs[1] or recompute, *[True] * len(saved_acc),
                     *[names[i] in loads for i in ctx.tensor_slots]])
        outputs = not_views(outputs)
        ctx.mark_non_differentiable(*[t for t in outputs if not t.dtype.is_floating_point])
        return outputs

    @staticmethod
    @first_derivative_only
    @once_differentiable  # its kernels' saved accumulators are not differentiable: no create_graph
    def backward(ctx, *grad_outputs: torch.Tensor | None):
        x, weight, *tensors = saved_inputs(ctx)
        saved_acc, tensors = tensors[:ctx.saved_count], tensors[ctx.saved_count:]
        values = list(ctx.others)
        for slot, t in zip(ctx.tensor_slots, tensors, strict=True):
            values[slot] = t
        operands = dict(zip(ctx.names, values, strict=True))
        grads = dict(zip(ctx.lin.output_names, grad_outputs, strict=True))
        needs = ctx.needs_input_grad
        wanted = tuple(name for name, need in zip(ctx.names, needs[4:], strict=True) if need)
        dx, dweight, d_operands = ctx.lin._gradients(x, weight, operands, grads, tuple(saved_acc),
                                                     need_x=needs[1], need_weight=needs[2],
                                                     need_operands=wanted)
        operand_grads = [d_operands.get(name) if needs[4 + i] else None for i, name in enumerate(ctx.names)]
        return (None, dx if needs[1] else None, dweight if needs[2] else None, None, *operand_grads)


def backward_of_linear(lin: Linear, x: torch.Tensor, weight: torch.Tensor, operands: dict[str, Any],
                       grads: dict[str, torch.Tensor | None], saved: tuple[torch.Tensor, ...] = (), *,
                       need_x: bool = True, need_weight: bool = True,
                       need_operands: tuple[str, ...] | None = None):
    """(dx, dweight, {operand: gradient}) of ``lin``'s call on ``x``, ``weight``, ``operands``
    given the outputs' gradients ``grads`` by output name (None for outputs that received none):
    the GEMM epilogue's backward with a = x (flattened) and b = weight^T. ``saved``: the accumulator
    the forward saved (its gate and up halves for a gated epilogue; with x's leading dims), else
    recomputed where the backward reads it. dx and dweight are None where not needed (``need_x``,
    ``need_weight``): a frozen weight (LoRA's base layer) or an input without a gradient costs no
    GEMM. ``need_operands``: the operands whose gradients are wanted (None: all). With it, dZ and
    those gradients may come from one elementwise kernel (:mod:`evtc.dz_pass`) instead of torch
    operations; an operand not in it may then get none."""
    from evtc import dz_pass
    from evtc.linear import _flatten_like, _rows, unflatten_gradient
    from evtc.runtime.op_autograd import epilogue_gradients, input_gradients, weight_gradient

    lead = tuple(x.shape[:-1])
    names = list(operands)
    flat = [_flatten_like(operands[name], lead) for name in names]
    x2 = _rows(x)  # also with no input features (reshape(-1, 0) cannot tell the rows)
    saved_rows = tuple(_rows(piece) for piece in saved)
    passed = None
    if need_operands is not None and dz_pass.applies(x2, weight, saved_rows):
        passed = dz_pass.gradients(lin, x2, dict(zip(names, flat, strict=True)), grads, saved_rows,
                                   need_operands)
    if passed is not None:
        dz, d_flat_by_name = passed
        d_operands = {name: unflatten_gradient(d, operands[name], lead) for name, d in d_flat_by_name.items()}
    else:
        acc = joined_accumulator(saved_rows) if saved_rows else None
        dz, d_flat = epilogue_gradients(lin.backward_graph(), x2, weight.t(), names, flat, grads, acc=acc)
        d_operands = {name: unflatten_gradient(d, operands[name], lead)
                      for name, d in zip(names, d_flat, strict=True) if d is not None}
    dx, _ = input_gradients(dz, x2, weight.t(), need_a=need_x, need_b=False)
    return (dx.reshape(x.shape) if dx is not None else None,
            weight_gradient(dz, x2, weight) if need_weight else None, d_operands)


__all__ = ["LinearFunction", "backward_of_linear"]
