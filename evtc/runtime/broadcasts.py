"""Torch-legal broadcasts that a kernel does not take as they are, turned into views it does take.

A kernel is compiled for its examples' ranks and batch sizes. A call may still pass operands that
torch would broadcast to the same result: a bias of (1, N) where the example was (N,), a device
scalar as (1,) where it was 0-d (or the other way round), or, for a kernel compiled with equal
batches, a ``b`` or a batched operand of batch 1 beside an ``a`` of batch 3, or a 2-d ``b`` (or
``a``) beside a 3-d other, which ``torch.matmul`` broadcasts over the batch. Each of these is the
same computation on a view: size-1 leading dims dropped or added, a batch of 1 expanded (stride 0;
the staged path copies it where TMA cannot read it). The result's shape is torch's in every case
handled here. A broadcast that would change the result's shape (a ``C`` of (1, M, N) for an
(M, N) kernel makes torch's result 3-d) or an operand's kind (an (M, N) example with M = 1 was a
row vector) is left alone, and the call's checks refuse it by name.

The views are the same computation only under three conditions, read from the plan. An operand
changes rank only where no output or reduction would take its extra (or missing) leading dims
into its shape (:attr:`KernelPlan.no_more_dims`, :attr:`KernelPlan.no_fewer_dims`): extra dims
of 1 vanish in any full tile the operand meets, missing ones only in a full tile that acc (or a
full operand of an unbatched kernel) keeps full. A batch of 1 is expanded only where every output
and every reduction that reads a batched input reads one of the whole batch (:attr:`KernelPlan.reads`):
an output ``acc`` of an ``a`` and ``b`` of batch 1 beside a ``C`` of batch 3 is torch's
(1, M, N), and a sum over the expanded batch would count it three times. And no operand whose
shape the function reads beyond its last dim (``C.size(0)``, ``bias.dim()``;
:attr:`CallInterface.shape_reads`) is viewed at all: the graph holds the sizes it read at the
compiled shapes. Elsewhere nothing is viewed: a rank change that torch would broadcast but an
output would take into its shape is refused with a CallError that says so (after the call's more
basic checks, on the slow path), and the checks refuse anything else by name.

Only the slow path of a call and the custom operator's path use this: a call whose tensors the
compiled function takes as they are never gets here.
"""

from __future__ import annotations

from typing import Any

import torch

from evtc.errors import CallError
from evtc.plan.kernel_plan import KernelPlan


def _may_change_rank(plan: KernelPlan, name: str, more: bool) -> bool:
    """Whether operand ``name`` may come with more (``more``) or fewer leading size-1 dims than
    compiled: no output or reduction would take them into its shape
    (:attr:`KernelPlan.no_more_dims`, :attr:`KernelPlan.no_fewer_dims`)."""
    return name not in (plan.no_more_dims if more else plan.no_fewer_dims)


def _may_expand(plan: KernelPlan, whole: set[str]) -> bool:
    """Whether inputs of batch 1 may be expanded beside ``whole`` (those of the whole batch):
    every output and every reduction that reads a batched input reads one of ``whole`` (a sum
    over an expanded batch of 1 alone counts it again; an output of it alone is torch's batch of
    1). One that reads only inputs shared by the batches is the same in every batch, and a call
    returns it in torch's shape (:attr:`KernelPlan.batch_free`)."""
    batched = {"acc"} | {i.user for i in plan.inputs if i.spec is not None and "L" in i.spec.dims}
    return all(whole.intersection(names) for names in plan.reads if batched.intersection(names))


def _refuse_shape_read(plan: KernelPlan, name: str, given: tuple, compiled: tuple[str, ...]) -> None:
    """Raise the CallError for a view of ``name`` (as torch would broadcast it) where the function
    reads its shape: the graph holds what it read at the compiled shape."""
    if name not in plan.interface.shape_reads:
        return
    what = ("a and b of batch 1 beside operands of a larger batch make torch's acc a batch of 1"
            if name == "acc" else f"{name} has shape {given}, compiled as ({', '.join(compiled)})")
    raise CallError(f"{what}: torch would broadcast it, but the epilogue reads {name}'s shape "
                    f"({name}.shape, .size(), .dim() or .numel(), or those of a value computed from "
                    f"it), which the kernel fixed at the compiled shape; pass "
                    f"{'a and b with the batch' if name == 'acc' else name} in the compiled shape "
                    "(.expand() or .reshape())")


def _rank_change_refusal(name: str, given: tuple, dims: tuple[str, ...], viewed: tuple,
                         expanded: tuple) -> str:
    """The CallError message for ``name`` passed with leading size-1 dims more or fewer than
    compiled (``dims``; ``viewed``: its shape at that rank, ``expanded``: at the call's batch),
    where torch would broadcast it but an output or reduction may take those dims into its shape
    (:attr:`KernelPlan.no_more_dims`, :attr:`KernelPlan.no_fewer_dims`)."""
    compiled = ", ".join(dims)

    def sizes(shape: tuple) -> str:
        return ", ".join(str(size) for size in shape) or "()"  # reshape(5, 7), reshape(()) for 0-d

    if len(given) > len(dims):
        return (f"{name} has shape {given}, compiled as ({compiled}): torch would broadcast it, but an "
                f"output or reduction of the epilogue that reads {name} would then have torch's extra "
                f"leading dims of 1, where the kernel's keeps the compiled rank; pass "
                f"{name}.reshape({sizes(viewed)}) (a view), or compile from an example of this rank")
    return (f"{name} has shape {given}, compiled as ({compiled}): torch would broadcast it, but an output "
            f"or reduction of the epilogue that reads {name} may then have fewer dims in torch than in "
            f"the kernel (whether another input keeps it whole is not known when compiling); pass "
            f"{name}.expand({sizes(expanded)}) for the kernel's shapes, or compile from an example of "
            "this rank")


def _fits(t: torch.Tensor, dims: tuple[str, ...], sizes: dict) -> bool:
    """Whether ``t`` has the sizes ``dims`` say (any batch size for L)."""
    return all(d == "L" or size == sizes[d] for d, size in zip(dims, t.shape, strict=True))


def _to_rank(t: torch.Tensor, dims: tuple[str, ...], result_rank: int) -> torch.Tensor | None:
    """``t`` viewed with the rank of ``dims``, where the dims it lacks or has in excess are leading
    size-1 dims and it has no more dims than the result (more would give torch's result more
    dims); None where that is not so. A lacking batch dim (an (N,) bias where an (L, 1, N) one was
    compiled, as torch broadcasts it over the batch) becomes a batch of 1, which
    :func:`_expand_batch` then expands."""
    extra = t.dim() - len(dims)
    if 0 < extra and t.dim() <= result_rank and all(size == 1 for size in t.shape[:extra]):
        return t.reshape(t.shape[extra:])
    if extra < 0 and all(d in ("1", "L") for d in dims[:-extra]):
        return t.reshape((1,) * -extra + tuple(t.shape))
    return None


def to_compiled_shapes(plan: KernelPlan, a: Any, b: Any, operands: dict[str, Any],
                       scales: tuple | None = None, pending: dict[str, str] | None = None):
    """``(a, b, operands, scales)`` with the broadcasts this module describes made into views (a
    block-scaled ``a`` or ``b`` expanded to the batch with its scales), or None where the call makes
    none of them (the caller then goes on with what it has, and its checks name what is wrong).
    A rank change torch would broadcast but an output would take into its shape is refused with
    a CallError that says so, or, given ``pending``, its message is put there by operand name for
    the caller to raise if the checks find nothing more basic wrong first."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return None
    result_rank = 3 if 3 in (a.dim(), b.dim()) else 2
    sizes = {"M": a.shape[-2], "N": b.shape[-1] // 2 if plan.gated else b.shape[-1], "1": 1}
    changed = False
    operands = dict(operands)
    batched: list[tuple[str, int]] = []  # (operand, its batch axis)
    for kernel_input in plan.inputs:
        if kernel_input.kind in ("arg", "literal") or kernel_input.half is not None:
            continue
        t = operands.get(kernel_input.user)
        dims = kernel_input.spec.dims if kernel_input.spec is not None else None
        if not isinstance(t, torch.Tensor) or dims is None:
            continue
        if t.dim() != len(dims):
            viewed = _to_rank(t, dims, result_rank)
            if viewed is None or not _fits(viewed, dims, sizes):
                continue  # (the checks name a shape torch would not broadcast either)
            if not _may_change_rank(plan, kernel_input.user, more=t.dim() > len(dims)):
                batch = max([x.shape[0] for x in (a, b) if x.dim() == 3], default=1)
                expanded = tuple(batch if d == "L" else sizes[d] for d in dims)
                message = _rank_change_refusal(kernel_input.user, tuple(t.shape), dims, tuple(viewed.shape),
                                               expanded)
                if pending is None:
                    raise CallError(message)
                pending[kernel_input.user] = message
                continue
            _refuse_shape_read(plan, kernel_input.user, tuple(t.shape), dims)
            operands[kernel_input.user], changed = viewed, True
        if "L" in dims:
            batched.append((kernel_input.user, dims.index("L")))
    if plan.broadcast_batch is None and len(plan.a.dims) == 3 and len(plan.b.dims) == 3 \
            and sorted((a.dim(), b.dim())) == [2, 3]:
        # torch.matmul broadcasts a 2-d a or b over the other's batch: a batch of 1 here,
        # expanded to the batch below (its block scales with it).
        a, b, scales = _with_batch_of_one(a, b, scales)
        changed = True
    if plan.broadcast_batch is None and a.dim() == 3 and b.dim() == 3:
        expanded = _expand_batch(plan, a, b, operands, batched, scales)
        if expanded is not None:
            (a, b, operands, scales), changed = expanded, True
    return (a, b, operands, scales) if changed else None


def _with_batch_of_one(a, b, scales: tuple | None):
    """The 2-d one of ``a`` and ``b`` (and its block scales, where 2-d) as a batch of 1."""
    which = 0 if a.dim() == 2 else 1
    if which == 0:
        a = a.unsqueeze(0)
    else:
        b = b.unsqueeze(0)
    if scales and scales[which].dim() == 2:  # None or () without block scales
        scales = tuple(s.unsqueeze(0) if i == which else s for i, s in enumerate(scales))
    return a, b, scales


def _expand_batch(plan: KernelPlan, a, b, operands: dict, batched: list, scales: tuple | None):
    """For a kernel compiled with equal batches: a batch of 1 (of ``a``, ``b`` or a batched
    operand) beside a batch of L, expanded to L, where every output reads an input of batch L (so
    that torch's result has the batch L too); None otherwise."""
    # Compared one by one, never hashed or tested with ``in``: under torch.compile(dynamic=True)
    # the sizes are symbolic, which a set would specialise (a graph per batch size) and ``in`` gets
    # wrong (it tests identity first and finds no equal constant).
    sizes = [a.shape[0], b.shape[0], *(operands[name].shape[axis] for name, axis in batched)]
    others = [size for size in sizes if size != 1]  # a batch of 1 broadcasts to 0 too, as in torch
    if not others or len(others) == len(sizes) or any(size != others[0] for size in others[1:]):
        return None
    batches = others[0]
    whole = {name for name, axis in batched if operands[name].shape[axis] == batches}
    if a.shape[0] == batches or b.shape[0] == batches:
        whole.add("acc")
    if not _may_expand(plan, whole):
        return None
    if a.shape[0] == 1 and b.shape[0] == 1:
        _refuse_shape_read(plan, "acc", (), ())
    compiled = {i.user: i.spec.dims for i in plan.inputs if i.spec is not None}
    for name, axis in batched:
        if operands[name].shape[axis] == 1:
            _refuse_shape_read(plan, name, tuple(operands[name].shape), compiled[name])
    operands = dict(operands)
    if a.shape[0] == 1:
        a = a.expand(batches, *a.shape[1:])
    if b.shape[0] == 1:
        b = b.expand(batches, *b.shape[1:])
    for name, axis in batched:
        t = operands[name]
        if t.shape[axis] == 1:
            operands[name] = t.expand(*t.shape[:axis], batches, *t.shape[axis + 1:])
    if scales is not None:  # block scales: (L, ...) each, expanded with their tensor
        scales = tuple(s.expand(batches, *s.shape[1:]) if s.dim() == 3 and s.shape[0] == 1 else s
                       for s in scales)
    return a, b, operands, scales


__all__ = ["to_compiled_shapes"]
