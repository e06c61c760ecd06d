"""The dZ of a backward graph as an epilogue of the GEMM that produces its incoming gradient.

In ``Linear -> act -> Linear``, the first layer's incoming gradient dY is the second layer's
``dZ2 @ W2``: a GEMM whose accumulator *is* dY. The first layer's ``dZ = df/dacc * dY`` (from its
backward graph, :mod:`evtc.ir.autodiff`) is then an epilogue of that GEMM, reading the forward's
saved accumulator as a tile operand, and dY never goes to memory.

:func:`dz_epilogue` writes that epilogue as a plain Python function, from the part of the backward
graph that computes dZ, so that it compiles as any user epilogue does (tracing, passes, code
generation) and runs as its own reference on torch tensors. Its parameters:

* ``grad``: the accumulator of the GEMM, the incoming gradient dY;
* ``saved`` (the forward's accumulator), or ``saved_gate`` and ``saved_up`` (its halves, for a
  gated epilogue such as SwiGLU), where dZ reads them;
* the forward epilogue's operands and Python-number arguments that dZ reads, by their names.

It returns dZ rounded to ``dz_dtype``; for a gated epilogue the gate and up halves of dZ as two
outputs (the caller writes them into the halves of one tensor with ``out=``). Backward graphs whose
dZ needs more than elementwise work on the tile (a reduction of the forward inside it), or that
take the gradients of several outputs (one GEMM's accumulator is one incoming gradient), have no
such epilogue: :func:`dz_epilogue` returns None and the caller takes the unfused backward. An
operand as wide as a gated epilogue's GEMM is taken as its halves, and ``operand_grads`` adds
operands' gradients after dZ, as in the layer's form below.

With ``grad_operand`` (:mod:`evtc.dz_pass`, a layer seen alone) the signature is ``(acc, grad,
saved..., operands...)``: ``grad`` is a tile operand and ``acc`` is never read. An epilogue of
several outputs takes each output's incoming gradient that dZ reads as an operand of its own,
named as the backward graph names it (``grad_D0, grad_D1, ...``), in the shape the output has (a
per-row sum's as an (M, 1) column, a total's as a scalar); ``DzEpilogue.grads`` pairs them with
the outputs. Over a gated epilogue's saved halves, a value of the whole accumulator
(``(acc + bias).chunk(2, -1)``, ``acc * scale`` before the split, the operand as wide as the
forward's GEMM) is computed as its two halves, from the saved halves and the operand's halves,
which the caller passes as views (``DzEpilogue.halves``: ``bias_gate``, ``bias_up``); such an
operand's gradient comes back as its two halves (``DzEpilogue.split_grads``). ``operand_grads``
then adds those operands' gradients as outputs after dZ, summed in float32 over what each operand
broadcasts along (a tile operand's, summed over nothing, in its ``tile_grad_dtypes`` dtype where
given). With ``recompute`` too (a kernel's own operator, which saved no accumulator), the signature
is ``(acc, grad, operands...)`` and ``acc`` *is* the forward's accumulator, recomputed by the GEMM
under the epilogue (for a gated epilogue, split as the forward splits it): dZ is then the epilogue
of the forward's own GEMM run again, whole: a gated epilogue's values of the whole accumulator
(``(acc + bias).chunk(2, -1)``, a bias as wide as the GEMM) are split as the forward splits them.

Literals of the forward's sizes (a mean's 1/N) are written as ``size_m`` and ``size_n``, read from
the GEMM's accumulator (``acc``, or ``grad`` where that is the accumulator): its rows, and its
columns (twice them where the GEMM is as wide as a gated epilogue's halves).
"""

from __future__ import annotations

import itertools
import keyword
import linecache
import math
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sympy
import torch

from .autodiff import Backward
from .graph import Node
from .ops import ELEMENTWISE
from .shapes import M, N

# How each elementwise op is written in the generated source (the tracer maps these calls back
# onto the same ops). Ops absent here are written ``torch.<name>(...)``.
_CALLS: dict[str, Callable[[list[str], dict[str, Any]], str]] = {
    "silu": lambda a, p: f"F.silu({a[0]})",
    "mish": lambda a, p: f"F.mish({a[0]})",
    "hardswish": lambda a, p: f"F.hardswish({a[0]})",
    "hardsigmoid": lambda a, p: f"F.hardsigmoid({a[0]})",
    "gelu": lambda a, p: f"F.gelu({a[0]})",
    "gelu_tanh": lambda a, p: f"F.gelu({a[0]}, approximate='tanh')",
    "leaky_relu": lambda a, p: f"F.leaky_relu({a[0]}, {_number(p['negative_slope'])})",
    "hardtanh": lambda a, p: f"F.hardtanh({a[0]}, {_number(p['min_val'])}, {_number(p['max_val'])})",
    "elu": lambda a, p: f"F.elu({a[0]}, {_number(p['alpha'])})",
    "softplus": lambda a, p: (f"F.softplus({a[0]}, beta={_number(p['beta'])}, "
                              f"threshold={_number(p['threshold'])})"),
}

_counter = itertools.count()

# A sum over an axis of the tile, as the generated source writes it, in float32 (a sum of a 16-bit
# incoming gradient would otherwise be rounded back to 16 bits, as torch's sum does): over the rows
# (M) for a row vector's gradient, the columns (N) for a per-row
# column's, the whole tile for a scalar's.
_SUMS: dict[str, Callable[[str, bool], str]] = {
    "col": lambda v, keep: f"{v}.sum(-2, keepdim={keep}, dtype=torch.float32)",
    "row": lambda v, keep: f"{v}.sum(-1, keepdim={keep}, dtype=torch.float32)",
    "batch": lambda v, keep: f"{v}.sum((-2, -1), keepdim={keep}, dtype=torch.float32)",
}


@dataclass(frozen=True)
class DzEpilogue:
    """A generated dZ epilogue (see the module docstring)."""

    fn: Callable[..., Any]
    #: The generated Python source of ``fn``.
    source: str
    #: The saved accumulator's parameters: ``("saved",)``, ``("saved_gate", "saved_up")`` or ``()``.
    saved: tuple[str, ...]
    #: The forward's operands (tensors and Python numbers) that ``fn`` takes, by name.
    operands: tuple[str, ...]
    gated: bool
    #: The operands whose gradients ``fn`` returns after dZ, in this order (``operand_grads``).
    operand_grads: tuple[str, ...] = ()
    #: Whether dZ reads the forward's accumulator as ``acc`` (``recompute``): the GEMM under the
    #: epilogue must then be the forward's, ``a @ b``.
    reads_acc: bool = False
    #: The incoming gradients ``fn`` reads, in its parameters' order: (parameter, the forward's
    #: output whose gradient it is). ``(("grad", output),)`` for an epilogue of one output.
    grads: tuple[tuple[str, str], ...] = ()
    #: Halves of operands as wide as a gated epilogue's GEMM that ``fn`` takes (a layer's pass):
    #: (parameter, operand, 0 for the gate half or 1 for the up half). ``operands`` leaves them out.
    halves: tuple[tuple[str, str, int], ...] = ()
    #: Of ``operand_grads``, those returned as two halves (gate, then up) to join along the last
    #: dim: the gradients of operands as wide as a gated layer's GEMM.
    split_grads: tuple[str, ...] = ()


def dz_epilogue(back: Backward, dz_dtype: torch.dtype, *, name: str = "dz", grad_operand: bool = False,
                operand_grads: tuple[str, ...] = (), recompute: bool = False,
                tile_grad_dtypes: dict[str, torch.dtype] | None = None,
                compute_dtype: torch.dtype = torch.float32) -> DzEpilogue | None:
    """The epilogue computing ``back``'s dZ from the incoming gradient as the accumulator, or None
    where there is none (see the module docstring). With ``grad_operand``, the incoming gradient is
    a tile operand ``grad`` after an accumulator ``acc`` that the epilogue never reads: dZ as one
    elementwise pass over tensors in memory (:mod:`evtc.dz_pass`). ``operand_grads`` names forward
    operands whose gradients it returns too, after dZ, in float32: a row vector's
    summed over the rows (a column reduction), a per-row column's over the columns, a scalar's over
    the tile, a tile operand's elementwise (in ``tile_grad_dtypes[name]`` where given: the tile's own
    dtype, as the caller returns it). With ``recompute`` (only with ``grad_operand``) ``acc`` is the
    forward's accumulator, read where the others read ``saved`` (see the module docstring).
    ``compute_dtype``: what a cast to float32 (the kernels' compute dtype) converts to; float64
    runs the source as :func:`evtc.ir.interpreter.evaluate` runs the graph with that compute dtype
    (a check of the source against the interpreter, not a kernel)."""
    tile_grad_dtypes = tile_grad_dtypes or {}
    graph = back.graph
    grad_acc = back.input_grads.get(graph.acc_name)
    if grad_acc is None or (recompute and not grad_operand):
        return None
    if len(back.output_grads) != 1 and not grad_operand:
        return None  # the accumulator of one GEMM is one incoming gradient
    if any(op not in back.input_grads for op in operand_grads):
        return None  # an operand without a gradient in the graph (a Python number's)
    # Each output's incoming gradient, as a parameter: ``grad`` for one output, else the backward
    # graph's own names (``grad_D0``, ...), each a tile operand (or a vector's or scalar's, as the
    # output is) of its own.
    grad_params = ({name: "grad" for name in back.output_grads.values()} if len(back.output_grads) == 1
                   else {name: _identifier(name) for name in back.output_grads.values()})
    output_of = {grad: output for output, grad in back.output_grads.items()}
    grads_read: list[str] = []
    store = graph.store(grad_acc)
    by_id = {n.id: n for n in graph.nodes}
    operand_stores = [graph.store(back.input_grads[op]) for op in operand_grads]
    dz_cone = _cone(store, by_id)
    cone = dz_cone.union(*(_cone(s, by_id) for s in operand_stores))
    final = by_id[store.inputs[0].id]
    # A gated epilogue (``acc.chunk(2, -1)``): dZ is its halves' gradients joined side by side.
    # Over saved halves (a layer's pass, or the MLP's GEMM as wide as one half) dZ may also be
    # computed after the join, in halves (``(acc * scale).chunk(2, -1)`` with a wide scale: dZ is
    # the joined halves' gradients times the scale, each half on its own).
    after_join = final.op != "join" and not recompute and any(
        by_id[i].op == "join" for i in dz_cone)
    gated = final.op == "join" or after_join
    results = list(final.inputs) if final.op == "join" else [final]

    lines: list[str] = []
    names: dict[int, str] = {}
    constants: dict[int, Any] = {}
    sized: set[int] = set()  # literals of the forward's sizes (a mean's 1/N), as Python expressions
    saved: list[str] = []
    params: list[str] = []
    # A gated epilogue over saved halves (a layer's pass; the MLP's GEMM, as wide as one half): a
    # value of the whole accumulator (``acc + bias``, the bias as wide as the forward's GEMM) is
    # computed as its two halves, from the saved halves and the operand's halves (parameters
    # ``bias_gate``, ``bias_up``: views the caller passes).
    split = gated and not recompute
    halves_of: dict[int, tuple[str, str]] = {}
    half_params: list[tuple[str, str, int]] = []
    half_names: set[str] = set()  # their parameters' names
    saved_read: set[str] = set()  # the saved halves those halves read
    for node in graph.nodes:
        if node.id not in cone or node.op == "store":
            continue
        op = node.op
        if op == "acc":
            if split:
                halves_of[node.id] = ("saved_gate", "saved_up")
                continue
            # (Recomputed, a gated epilogue's whole accumulator is there, as in the forward.)
            names[node.id] = "acc" if recompute else "saved"
            saved.append(names[node.id])
            continue
        if op == "join" and (split or recompute):
            # dZ's halves, joined: the halves themselves, for the values computed after the join (a
            # wide bias's gradient, their column sums).
            if any(i.id not in names for i in node.inputs):
                return None  # a half without gradient (a constant)
            halves_of[node.id] = (names[node.inputs[0].id], names[node.inputs[1].id])
            continue
        if op == "half":
            source, index = node.inputs[0], node.attrs["index"]
            if source.id in halves_of:
                names[node.id] = halves_of[source.id][index]
                if source.op == "acc":
                    saved_read.add(names[node.id])
                continue
            if source.op == "acc":
                param = (("acc_gate", "acc_up") if recompute else ("saved_gate", "saved_up"))[index]
                names[node.id] = param
                if param not in saved:
                    saved.append(param)
                continue
            if not recompute or source.id not in names:
                # The halves of a value of the whole accumulator (``(acc + bias).chunk(2, -1)``):
                # the saved halves are the accumulator's, and the dZ pass's GEMM is half as wide.
                return None
            # Recomputed: split as the forward splits it, where the value is computed.
            pair = (f"h{source.id}_gate", f"h{source.id}_up")
            if f"{pair[0]}, {pair[1]} = {names[source.id]}.chunk(2, dim=-1)" not in lines:
                lines.append(f"{pair[0]}, {pair[1]} = {names[source.id]}.chunk(2, dim=-1)")
            names[node.id] = pair[index]
            continue
        if op == "load":
            operand = node.attrs["name"]
            if operand in grad_params:
                names[node.id] = grad_params[operand]
                if operand not in grads_read:
                    grads_read.append(operand)
                continue
            if split and any(sympy.sympify(d) == N for d in node.shape):
                # As wide as the forward GEMM, where the new GEMM is half as wide: its halves.
                halves_of[node.id] = (f"{operand}_gate", f"{operand}_up")
                for index, param in enumerate(halves_of[node.id]):
                    if param in params:
                        return None
                    params.append(param)
                    half_params.append((param, operand, index))
                    half_names.add(param)
                continue
            if operand in half_names:
                return None  # an operand named as a wide operand's half (``bias_gate``)
            names[node.id] = _param(operand, params)
            continue
        if op == "arg":
            if node.attrs["name"] in half_names:
                return None
            names[node.id] = _param(node.attrs["name"], params)
            continue
        if op == "literal":
            value = sympy.sympify(node.attrs["value"])
            if value.free_symbols:
                # A size of the forward problem (a mean's 1/N): the new GEMM's M, and its N (twice
                # it for the halves of a gated epilogue's saved accumulator or incoming gradient).
                text = _sized_literal(value)
                if text is None:
                    return None
                names[node.id] = text
                sized.add(node.id)
                continue
            constants[node.id] = float(value)
            continue
        if op == "reduce" and node.inputs[0].id in halves_of:
            # A wide operand's gradient (only: a reduction inside dZ is not one pass), summed from
            # its halves: over the rows, still as wide as the GEMM, in halves; over the columns
            # too, the two halves' sums added.
            axis, keep = node.attrs["axis"], node.attrs["keepdim"]
            if node.id in dz_cone or node.attrs["reduce"] != "sum" or axis not in _SUMS:
                return None
            if node.inputs[0].op == "acc":
                saved_read.update(halves_of[node.inputs[0].id])
            pair = tuple(_SUMS[axis](half, keep) for half in halves_of[node.inputs[0].id])
            if axis == "col":
                halves_of[node.id] = (f"v{node.id}_gate", f"v{node.id}_up")
                lines.extend(f"{name} = {text}" for name, text in zip(halves_of[node.id], pair, strict=True))
            else:
                names[node.id] = f"v{node.id}"
                lines.append(f"v{node.id} = ({pair[0]} + {pair[1]})")
            continue
        if any(i.id in halves_of for i in node.inputs):
            # A value of the whole accumulator in a layer's pass: computed as its two halves.
            if any(i.op == "acc" for i in node.inputs):
                saved_read.update(halves_of[next(i.id for i in node.inputs if i.op == "acc")])
            pair = _split_op(node, halves_of, names, constants, sized, compute_dtype)
            if pair is None:
                return None
            halves_of[node.id] = (f"v{node.id}_gate", f"v{node.id}_up")
            lines.extend(f"{name} = {text}" for name, text in zip(halves_of[node.id], pair, strict=True))
            continue
        if any(i.id not in names and i.id not in constants for i in node.inputs):
            return None  # a gated dZ's joined halves read again (by a wide operand's gradient)
        if any(i.id in sized for i in node.inputs) and not (
                op in ELEMENTWISE and ELEMENTWISE[op].infix is not None and len(node.inputs) == 2
                and not all(i.id in sized or i.id in constants for i in node.inputs)):
            return None  # a size in anything but arithmetic with a tensor: not worth writing
        args = [names[i.id] if i.id in names else constants[i.id] for i in node.inputs]
        if op == "cast":
            text = _cast_text(args[0], node.dtype, compute_dtype)
        elif op in ELEMENTWISE:
            params_of = {p: node.attrs[p] for p in ELEMENTWISE[op].params}
            if all(i.id in constants for i in node.inputs):
                constants[node.id] = _fold(op, args, params_of)
                continue
            if op == "where" and node.inputs[0].id in constants:
                # A constant condition (the autodiff's broadcasting ``where(True, g, like)``): one side.
                picked, other = node.inputs[1:] if constants[node.inputs[0].id] else node.inputs[:0:-1]
                if picked.id in constants:
                    constants[node.id] = constants[picked.id]
                    continue
                if picked.id in sized:
                    return None
                if _same_shape(picked, node):
                    names[node.id] = names[picked.id]
                    continue
                # The side broadcast to the other's shape (a scalar's gradient spread over the tile,
                # which a sum over M or N then counts M or N times): a select of that side on both
                # branches, under a condition of the other's shape.
                text = f"torch.where({names[other.id]} == {names[other.id]}, {names[picked.id]}, " \
                       f"{names[picked.id]})"
                names[node.id] = f"v{node.id}"
                lines.append(f"v{node.id} = {text}")
                continue
            if op in ("logical_and", "logical_or") and any(i.id in constants for i in node.inputs):
                # A constant side (a comparison of constants, folded to a Python bool): the op is
                # that constant or the other side, as the tracer takes no Python bool in a mask op.
                known = next(i for i in node.inputs if i.id in constants)
                other = next(i for i in node.inputs if i is not known)
                if bool(constants[known.id]) == (op == "logical_or"):
                    constants[node.id] = op == "logical_or"
                else:
                    names[node.id] = names[other.id]
                continue
            text = _call(op, [_text(a) for a in args], params_of, [i.id in constants for i in node.inputs])
        elif op == "reduce" and operand_grads and node.id not in dz_cone and isinstance(args[0], str):
            # An operand's gradient summed over what the operand broadcasts along (the reduction
            # only feeds an operand's gradient: dZ itself stays one elementwise pass).
            if node.attrs["reduce"] != "sum" or node.attrs["axis"] not in _SUMS:
                return None
            text = _SUMS[node.attrs["axis"]](args[0], node.attrs["keepdim"])
        else:
            return None  # a reduction or a join inside dZ: not one elementwise pass over the tile
        names[node.id] = f"v{node.id}"
        lines.append(f"v{node.id} = {text}")

    taken = {"grad", "saved", "saved_gate", "saved_up", "acc_gate", "acc_up", "torch", "F", "size_m",
             "size_n", *grad_params.values(), *(["acc"] if grad_operand else [])}
    taken = {_as_python_reads(t) for t in taken}
    generated = r"v\d+(_gate|_up)?|h\d+_(gate|up)"
    if any(_as_python_reads(p) in taken or re.fullmatch(generated, p) for p in params) \
            or len({_as_python_reads(g) for g in grad_params.values()}) != len(grad_params) \
            or len({_as_python_reads(p) for p in params}) != len(params):
        return None  # an operand named like a generated value: rare, and not worth renaming
    if split:
        # The saved halves that the halves of values of the whole accumulator read, in order.
        saved = [p for p in ("saved_gate", "saved_up") if p in saved_read]
    # The gradients read, in the order of the outputs (the parameters' order).
    grads_read.sort(key=list(back.output_grads.values()).index)
    outs = []
    if after_join:
        if final.id not in halves_of:
            return None
        outs.extend(f"{half}.to(torch.{_dtype(dz_dtype)})" for half in halves_of[final.id])
    for r in ([] if after_join else results):
        if r.id in constants:
            return None  # a constant half of dZ (a half without gradient): not worth a kernel
        if r.id not in names:
            return None  # dZ after the join where the GEMM is the forward's: no half outputs of it
        outs.append(f"{names[r.id]}.to(torch.{_dtype(dz_dtype)})")
    split_grads = []
    for operand, operand_store in zip(operand_grads, operand_stores, strict=True):
        value = operand_store.inputs[0]
        if value.id in constants:
            return None  # a constant gradient (an operand the output does not depend on)
        if value.id in halves_of:
            # As wide as a gated layer's GEMM (a wide bias's, summed over the rows): its two halves,
            # which the caller joins.
            texts, split_grads = list(halves_of[value.id]), [*split_grads, operand]
        elif value.id in names:
            texts = [names[value.id]]
        else:
            # A gated epilogue's operand as wide as its GEMM, whose gradient is dZ's joined halves:
            # the new GEMM is half as wide (as for such an operand's load above).
            return None
        if operand in tile_grad_dtypes and _spans_the_tile(value):
            # A tile's gradient, in the tile's own dtype: no float32 tile to write and convert after.
            outs.extend(f"{text}.to(torch.{_dtype(tile_grad_dtypes[operand])})" for text in texts)
        else:
            outs.extend(texts)
    if not grads_read:
        return None  # dZ and the operands' gradients without an incoming gradient: all zeros
    grad_args = [grad_params[name] for name in grads_read]
    fn_name = _identifier(f"{name}_dz_recomputed" if recompute else
                          f"{name}_dz_pass" if grad_operand else f"{name}_dz")
    if sized and not grad_operand:
        # The sizes are read from the accumulator ``grad``, the output's incoming gradient: it must
        # be a tile (an activation's output), not a reduction's.
        (grad_name,) = back.output_grads.values()
        dims = {sympy.sympify(d) for d in back.grad_shapes[grad_name]}
        if M not in dims or not any(N in d.free_symbols for d in dims):
            return None
    if sized:
        # The sizes, from the GEMM's own accumulator: its rows are the forward's M; its columns
        # the forward's N, or half of it where the GEMM is as wide as a gated epilogue's halves.
        tile = "acc" if grad_operand else "grad"
        lines[:0] = [f"size_m = {tile}.shape[-2]",
                     f"size_n = {'2 * ' if gated and not recompute else ''}{tile}.shape[-1]"]
    if recompute:
        if gated and {"acc_gate", "acc_up"} & set(saved):
            # The forward's split, as it wrote it; both halves named, whichever dZ reads.
            lines.insert(2 if sized else 0, "acc_gate, acc_up = acc.chunk(2, dim=-1)")
        reads_acc, saved = bool(saved), []
        signature = ", ".join(["acc", *grad_args, *params])
    else:
        reads_acc = False
        signature = ", ".join(["acc", *grad_args, *saved, *params] if grad_operand
                              else ["grad", *saved, *params])
    body = "".join(f"    {line}\n" for line in lines)
    ret = ", ".join(outs)
    source = f"def {fn_name}({signature}):\n{body}    return {ret}\n"
    filename = f"<evtc: dZ epilogue {next(_counter)} of {graph.name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    scope: dict[str, Any] = {"torch": torch, "F": torch.nn.functional}
    exec(compile(source, filename, "exec"), scope)  # noqa: S102 - our own generated source
    grads = tuple((grad_params[name], output_of[name]) for name in grads_read)
    return DzEpilogue(scope[fn_name], source, tuple(saved), tuple(p for p in params if p not in half_names),
                      gated, tuple(operand_grads), reads_acc, grads, tuple(half_params), tuple(split_grads))


def _spans_the_tile(node: Node) -> bool:
    """Whether ``node``'s value varies over both M and N (a tile operand's gradient, summed over
    nothing), not a vector's or a scalar's, however its sums were taken (an operand used twice has a
    gradient that is a sum of two reductions)."""
    dims = {sympy.sympify(d) for d in node.shape}
    return M in dims and N in dims


def _cast_text(value: Any, dtype: torch.dtype, compute_dtype: torch.dtype) -> str:
    """A cast as the source writes it: to float32, the compute dtype, to ``compute_dtype``."""
    return f"{_text(value)}.to(torch.{_dtype(compute_dtype if dtype == torch.float32 else dtype)})"


def _split_op(node: Node, halves_of: dict[int, tuple[str, str]], names: dict[int, str],
              constants: dict[int, Any], sized: set[int],
              compute_dtype: torch.dtype) -> tuple[str, str] | None:
    """An elementwise op or a cast of values of the whole accumulator, as the source of its two
    halves (each input's half, or the input itself where it broadcasts along the columns: a per-row
    column, a scalar); None where it is neither, or reads a size."""
    if any(i.id in sized or (i.id not in halves_of and i.id not in names and i.id not in constants)
           for i in node.inputs):
        return None
    if any(i.id not in halves_of and any(sympy.sympify(d) == N for d in i.shape) for i in node.inputs):
        return None  # a whole value as wide as the GEMM beside halves (recomputed: ``acc``)
    constant = [i.id in constants for i in node.inputs]
    if node.op in ("where", "logical_and", "logical_or") and any(constant):
        return None  # folded in the main loop where its operands are one tensor each
    if node.op != "cast" and node.op not in ELEMENTWISE:
        return None
    pair = []
    for side in (0, 1):
        args = [halves_of[i.id][side] if i.id in halves_of else names[i.id] if i.id in names
                else constants[i.id] for i in node.inputs]
        if node.op == "cast":
            pair.append(_cast_text(args[0], node.dtype, compute_dtype))
        else:
            params_of = {p: node.attrs[p] for p in ELEMENTWISE[node.op].params}
            pair.append(_call(node.op, [_text(a) for a in args], params_of, constant))
    return pair[0], pair[1]


def _as_python_reads(identifier: str) -> str:
    """An identifier as Python compares them, NFKC-normalised (to Python the ligature "\ufb01" is
    "fi": two output names that differ so would be one parameter)."""
    return unicodedata.normalize("NFKC", identifier)


def _sized_literal(value: sympy.Expr) -> str | None:
    """A literal of the forward's sizes M and N (a mean's 1/N) as a Python expression of
    ``size_m`` and ``size_n``, or None where it is not a plain product, quotient or sum of them and
    numbers (a batch count L, a root)."""
    if not value.free_symbols <= {M, N} or value.atoms(sympy.Function) or any(
            not p.exp.is_Integer for p in value.atoms(sympy.Pow)):
        return None
    return f"({sympy.sstr(value.subs({M: sympy.Symbol('size_m'), N: sympy.Symbol('size_n')}))})"


def _same_shape(a: Node, b: Node) -> bool:
    return [sympy.sympify(d) for d in a.shape] == [sympy.sympify(d) for d in b.shape]


def _cone(store: Node, by_id: dict[int, Node]) -> set[int]:
    """Ids of the nodes ``store`` depends on, itself included."""
    seen: set[int] = set()
    stack = [store]
    while stack:
        node = stack.pop()
        if node.id in seen:
            continue
        seen.add(node.id)
        stack.extend(by_id[i.id] for i in node.inputs)
    return seen


def _param(name: str, params: list[str]) -> str:
    if name not in params:
        params.append(name)
    return name


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _number(value: Any) -> str:
    """A number in the generated source: inf and NaN as float('inf') etc., not bare names."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"float({str(value)!r})"
    return repr(value)


def _text(value: Any) -> str:
    return _number(value) if isinstance(value, bool | float | int) else value


def _call(op: str, args: list[str], params: dict[str, Any], constant: list[bool]) -> str:
    if op in _CALLS:
        return _CALLS[op](args, params)
    infix = ELEMENTWISE[op].infix
    if infix is not None and len(args) == 2:
        # Python's operators take a number on either side, as torch's functions do not all.
        return f"({args[0]} {infix} {args[1]})"
    if op in ("maximum", "minimum") and any(constant):
        tensor, bound = (args[1], args[0]) if constant[0] else (args[0], args[1])
        return f"torch.clamp({tensor}, {'min' if op == 'maximum' else 'max'}={bound})"
    return f"torch.{op}({', '.join(args)})"


def _fold(op: str, args: list[Any], params: dict[str, Any]) -> Any:
    """An op of constants, evaluated now (float64, as exact as the literals)."""
    tensors = [torch.tensor(a, dtype=torch.float64) if not isinstance(a, bool) else torch.tensor(a)
               for a in args]
    value = ELEMENTWISE[op].evaluate(*tensors, **params)
    return bool(value) if value.dtype == torch.bool else float(value)


def _identifier(text: str) -> str:
    out = "".join(c if c.isalnum() or c == "_" else "_" for c in text)
    if not out or out[0].isdigit() or keyword.iskeyword(out):
        out = f"f_{out}"
    return out


__all__ = ["DzEpilogue", "dz_epilogue"]
