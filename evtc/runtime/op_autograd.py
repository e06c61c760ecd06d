"""Autograd for a kernel's custom operator (``torch.ops.evtc.*``), so that ``k(a, b, ...)`` and the
operator are differentiable, eagerly and under ``torch.compile``.

The reference backward (as for ``evtc.linear``, see :mod:`evtc.linear_autograd`): the epilogue's
backward graph (:mod:`evtc.ir.autodiff`) evaluated in float32 on the recomputed accumulator, then
``da = dZ @ b^T`` and ``db = a^T @ dZ`` (16-bit GEMMs for 16-bit inputs on the GPU, as eager autograd
runs them; float32 otherwise). It is written in torch operations only, so ``torch.compile`` traces
it like any backward formula.

Eagerly, for 16-bit inputs on the GPU, dZ (and the trained operands' gradients) come instead from
one evtc kernel that runs the forward's GEMM again with dZ as its epilogue
(:func:`evtc.dz_pass.recomputed_gradients`, the training layer's; imported on first use), where it
applies; the two GEMMs of da and db follow as above.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from evtc.runtime.out_aliasing import distinct_outputs

if TYPE_CHECKING:
    from evtc.ir.autodiff import Backward
    from evtc.runtime.kernel import Kernel


_LOW_PRECISION = (torch.float16, torch.bfloat16)


def op_backward(kernel: Kernel, a: torch.Tensor, b: torch.Tensor, operands: Sequence[Any],
                grads: Sequence[torch.Tensor | None], acc: torch.Tensor | None = None, *,
                need_a: bool = True, need_b: bool = True,
                need_operands: Sequence[bool] | None = None) -> tuple:
    """Gradients of (a, b, *operands) (None for Python-number operands) from the gradients of the
    kernel's outputs in its output order; ``acc``: the accumulator the forward stored, if it did;
    ``need_a``, ``need_b``: whether a's and b's are wanted (a GEMM each, skipped where not);
    ``need_operands``: whether each operand's is (None: all; those not wanted may come back None).

    Where the forward stored no accumulator and the inputs are 16-bit on the GPU, dZ and the wanted
    operands' gradients come from one kernel that runs the forward's GEMM again with dZ as its
    epilogue (:func:`evtc.dz_pass.recomputed_gradients`), where it applies."""
    names = kernel.operand_names
    by_output = dict(zip(kernel.plan.output_order, grads, strict=True))
    if acc is None and need_operands is not None:
        # The training layer's module, imported here on first use (evtc.dz_pass compiles kernels).
        from evtc import dz_pass

        needed = tuple(name for name, value, need in zip(names, operands, need_operands, strict=True)
                       if need and isinstance(value, torch.Tensor))
        fused = dz_pass.recomputed_gradients(kernel, a, b, dict(zip(names, operands, strict=True)),
                                             by_output, needed)
        if fused is not None:
            d_acc, by_name = fused
            da, db = input_gradients(d_acc, a, b, need_a=need_a, need_b=need_b)
            return (da, db, *(by_name.get(name) for name in names))
    return gemm_epilogue_backward(kernel.backward_graph(), a, b, names, operands, by_output, acc,
                                  need_a=need_a, need_b=need_b)


def gemm_epilogue_backward(back: Backward, a: torch.Tensor, b: torch.Tensor, names: Sequence[str],
                           operands: Sequence[Any], by_output: dict[str, torch.Tensor | None],
                           acc: torch.Tensor | None = None, *, need_a: bool = True,
                           need_b: bool = True) -> tuple:
    """(da, db, *operand gradients) of ``epilogue(a @ b, *operands)`` with backward graph ``back``,
    given the outputs' gradients by output name (None or missing: no gradient). ``acc``: the
    accumulator as the forward saved it (any float dtype), else recomputed where the graph reads it.
    da and db are None where not needed (a frozen weight: no GEMM for its gradient)."""
    d_acc, d_operands = epilogue_gradients(back, a, b, names, operands, by_output, acc)
    da, db = input_gradients(d_acc, a, b, need_a=need_a, need_b=need_b)
    return (da, db, *d_operands)


def input_gradients(d_acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, need_a: bool = True,
                    need_b: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(d_acc @ b^T, a^T @ d_acc)``, the gradients of ``a`` and ``b`` in ``acc = a @ b`` (None
    where not needed): 16-bit GEMMs for 16-bit inputs on the GPU (``d_acc`` in their dtype, from
    :func:`epilogue_gradients`), float32 ones otherwise; summed over batches ``a`` or ``b`` shares.

    A K-major ``b`` (an ``nn.Linear`` weight passed as ``w.t()``) gets its gradient in its own
    layout, ``(d_acc^T @ a)^T``: the transpose's backward then hands the weight a contiguous
    gradient, where ``a^T @ d_acc`` would reach it strided and cost a copy (or a strided add into
    ``.grad``) on every step, as :func:`weight_gradient` explains."""
    da = db = None
    low = low_precision(a, b)
    if need_a:
        da = d_acc @ b.transpose(-1, -2) if low else \
            (d_acc @ b.to(torch.float32).transpose(-1, -2)).to(a.dtype)
    if need_b:
        wide_a = a if low else a.to(torch.float32)
        if b.dim() >= 2 and b.stride(-2) == 1 and b.stride(-1) != 1:
            db = (d_acc.transpose(-1, -2) @ wide_a).transpose(-1, -2)
        else:
            db = wide_a.transpose(-1, -2) @ d_acc
        db = db if low else db.to(b.dtype)
    if da is not None and da.shape != a.shape:  # a shared by all batches
        da = da.sum_to_size(a.shape)
    if db is not None and db.shape != b.shape:
        db = db.sum_to_size(b.shape)
    return da, db


def epilogue_gradients(back: Backward, a: torch.Tensor, b: torch.Tensor, names: Sequence[str],
                       operands: Sequence[Any], by_output: dict[str, torch.Tensor | None],
                       acc: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """(dZ, [operand gradients]) of ``epilogue(a @ b, *operands)``: the epilogue's part of
    :func:`gemm_epilogue_backward`, without its GEMMs. dZ has the accumulator's shape, in the inputs'
    16-bit dtype for 16-bit inputs on the GPU (as the GEMMs that follow take it), else float32."""
    from evtc.ir.interpreter import accumulator
    from evtc.ir.shapes import L, M, N, evaluate_shape

    # 16-bit inputs on the GPU: the GEMMs run as eager autograd's would, on the tensor cores with
    # float32 accumulation and 16-bit results (the accumulator rounded as the 16-bit output that
    # eager autograd saves, but float16's kept in float32, saved_accumulator_dtype; dZ rounded
    # before dX and dW). In float32 they would run several times slower than the forward
    # (docs/training.md). Otherwise (float32 inputs, the CPU): float32.
    low = low_precision(a, b)
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    acc_shape = (*batch, a.shape[-2], b.shape[-1])
    feeds: dict[str, Any] = dict(zip(names, operands, strict=True))
    # An epilogue linear in acc (bias, residual, scaling) has a backward that never reads it: no
    # GEMM to recompute it then.
    if acc is not None:
        feeds[back.graph.acc_name] = acc
    elif any(node.op == "acc" for node in back.graph.nodes):
        feeds[back.graph.acc_name] = (recomputed_accumulator(a, b).to(torch.float32) if low
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
    d_operands: list[torch.Tensor | None] = []
    for name, value in zip(names, operands, strict=True):
        grad = result.get(name) if isinstance(value, torch.Tensor) else None
        d_operands.append(None if grad is None else grad.reshape(value.shape).to(value.dtype))
    # Each gradient in memory of its own: a residual's is the incoming gradient itself (and two
    # residuals' the same tensor), which autograd would then accumulate into in place, changing
    # the caller's gradient and each other's.
    d_operands = distinct_outputs(d_operands, [g for g in by_output.values() if g is not None])
    return d_acc, d_operands


def joined_accumulator(halves: Sequence[torch.Tensor]) -> torch.Tensor:
    """The accumulator a kernel saved for the backward, from its pieces (a gated kernel's gate and
    up halves, side by side along the last dim; one piece is returned as it is). The halves are
    converted straight into a float32 tensor, the dtype the backward's interpreter computes in:
    ``torch.cat`` in their 16-bit dtype and then the interpreter's conversion would copy the whole
    accumulator twice (0.47 ms of a training step at 8192 x 28672, bench/train.py's layers)."""
    if len(halves) == 1:
        return halves[0]
    first = halves[0]
    joined = first.new_empty((*first.shape[:-1], sum(h.shape[-1] for h in halves)), dtype=torch.float32)
    start = 0
    for half in halves:
        joined[..., start:start + half.shape[-1]].copy_(half)
        start += half.shape[-1]
    return joined


def _passthrough(back: Backward) -> dict[str, str] | None:
    """{input: incoming gradient's name} where each of ``back``'s gradients is an incoming gradient
    unchanged (a store of a load), else None."""
    graph = back.graph
    grads = set(back.output_grads.values())
    by_output = dict(zip(graph.outputs.names, graph.outputs.keys or graph.outputs.names, strict=True))
    passed = {}
    for store in graph.stores:
        value = store.inputs[0]
        if value.op != "load" or value.attrs["name"] not in grads:
            return None
        passed[by_output[store.attrs["name"]]] = value.attrs["name"]
    return passed


def weight_gradient(d_acc: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``d_acc^T @ x``: the gradient of an ``nn.Linear`` weight (``acc = x @ weight.t()``, ``x`` and
    ``d_acc`` 2-d), made in the weight's own (out, in) layout. (``(x^T @ d_acc).t()`` is the same
    values transposed: a strided gradient that makes every accumulation into ``.grad`` a slow
    strided add.) Precision as :func:`input_gradients`."""
    if low_precision(x, weight):
        return d_acc.t() @ x
    return (d_acc.to(torch.float32).t() @ x.to(torch.float32)).to(weight.dtype)


def saved_accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype in which the backward keeps an accumulator of ``dtype`` inputs (saved by the
    forward, or recomputed): the inputs' own, as eager autograd saves a linear's output, except
    float16's. Its largest value is 65504: an accumulator past it would be saved as infinity while
    the forward's epilogue read it in float32 (``gelu(acc * 1e-3 + bias)`` finite), and every
    gradient would turn NaN. bfloat16 has float32's range."""
    return torch.float32 if dtype == torch.float16 else dtype


def recomputed_accumulator(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` on the tensor cores, in :func:`saved_accumulator_dtype`: float16 inputs give
    float32 results (torch's ``out_dtype`` GEMM on the GPU, batched as ``bmm``; a float32 GEMM
    where torch has none)."""
    if saved_accumulator_dtype(a.dtype) == a.dtype:
        return torch.matmul(a, b)
    global _OUT_DTYPE_GEMM
    if a.is_cuda and _OUT_DTYPE_GEMM and a.dim() <= 3 and b.dim() <= 3:
        try:
            if a.dim() == b.dim() == 2:
                return torch.mm(a, b, out_dtype=torch.float32)
            batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
            return torch.bmm(a.expand(*batch, *a.shape[-2:]), b.expand(*batch, *b.shape[-2:]),
                             out_dtype=torch.float32)
        except (TypeError, NotImplementedError):
            _OUT_DTYPE_GEMM = False  # a torch without the float32-output GEMMs (before 2.8)
    return torch.matmul(a.float(), b.float())


#: Whether torch has ``mm`` / ``bmm`` with ``out_dtype`` (found out on first use).
_OUT_DTYPE_GEMM = True


def low_precision(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a GEMM of ``a`` and ``b`` runs in 16 bits here: both of one 16-bit dtype, on the GPU
    (the backward's GEMMs then run as eager autograd's, and the dZ kernels may run)."""
    return a.dtype == b.dtype and a.dtype in _LOW_PRECISION and a.is_cuda


def _evaluate(back: Backward, feeds: dict[str, Any], dz_dtype: torch.dtype) -> dict[str, Any]:
    """``back``'s graph evaluated in float32 on ``feeds`` (the accumulator and the incoming
    gradients in any float dtype), with dZ rounded to ``dz_dtype``. (Run through torch.compile, to
    fuse its elementwise steps, it made the training step of bench/train.py no faster on the H100:
    22.4 ms against 21.9 ms.)"""
    acc_name = back.graph.acc_name
    grad_names = set(back.output_grads.values())
    passed = _passthrough(back)
    if passed is not None:
        # Every gradient is an incoming one as it is (a residual, an added bias of the same
        # shape): no float32 round trip through the interpreter, which would cost two copies each.
        result = {name: feeds[grad] for name, grad in passed.items()}
        if acc_name in result:
            result[acc_name] = result[acc_name].to(dz_dtype)
        return result
    inputs = {k: (v.to(torch.float32) if k == acc_name or k in grad_names else v) for k, v in feeds.items()}
    result = back.graph.evaluate(inputs, compute_dtype=torch.float32, cast_outputs=False)
    if acc_name in result:
        result = {**result, acc_name: result[acc_name].to(dz_dtype)}
    return result


__all__ = [
    "epilogue_gradients", "gemm_epilogue_backward", "input_gradients", "joined_accumulator", "low_precision",
    "op_backward", "weight_gradient",
]
