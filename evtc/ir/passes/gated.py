"""Gated epilogues (SwiGLU, GeGLU, ReGLU): from the graph the user wrote to the one the kernel runs.

The user splits the accumulator's N into two halves, ``gate, up = acc.chunk(2, dim=-1)``, with the
ordinary weight ``[W_gate; W_up]``. The kernel computes a 128-wide accumulator tile whose first half
is a block of gate columns and whose second half the matching block of up columns (it loads both
blocks of B into one tile), so each thread holds gate column j and up column j side by side in
registers, and the epilogue writes a half-width output tile.

:func:`split_halves` rewrites the graph into those coordinates:

* every value as wide as the accumulator (N along its last dim: acc, operands such as a bias of the
  GEMM's width, and what is computed from them before the chunk) becomes two values, its gate half
  and its up half; an operand ``bias`` becomes two operands ``bias.gate`` and ``bias.up`` (the
  kernel reads them as views of the user's tensor, no copy);
* ``x.chunk(2, -1)[i]`` becomes half ``i`` of ``x``;
* every shape is rewritten so that N is the output's width (the user's N/2).

Values as wide as the accumulator may only flow into the chunk: an output or a reduction of one
needs the two halves side by side, which the split kernel does not produce; those are rejected here
with the user's line.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import sympy

from ...errors import ReductionError, ShapeError
from ..graph import Graph, GraphBuilder, Node, Operand, replace_nodes
from ..shapes import HALF_N, N, Shape

HALF_NAMES = ("gate", "up")


def is_gated(graph: Graph) -> bool:
    """True when the epilogue splits the accumulator with ``chunk(2, dim=-1)``."""
    return any(n.op == "half" for n in graph.nodes)


def _to_output_width(value: Any) -> Any:
    """A size expression in the user's coordinates (N = the GEMM's width) in the kernel's (N = the
    output's width, half the GEMM's)."""
    return sympy.sympify(value).subs(N, 2 * N)


def _shape(shape: Shape) -> Shape:
    return tuple(_to_output_width(d) for d in shape)


def _half_shape(shape: Shape) -> Shape:
    return (*shape[:-1], N)


def _is_full_width(node: Node) -> bool:
    return bool(node.shape) and node.shape[-1] == N


def _check_full_width_uses(graph: Graph, full: set[int]) -> None:
    users = graph.users()
    for node in graph.nodes:
        if node.id not in full:
            continue
        for user in users[node.id]:
            if user.op == "store":
                raise ShapeError(
                    "this gated epilogue returns a value as wide as the accumulator (N); after "
                    "acc.chunk(2, dim=-1) the kernel computes the gate and up halves side by side, so "
                    "every output must be half as wide (N/2): return values computed from the halves",
                    user.loc,
                )
            if user.op == "reduce":
                raise ReductionError(
                    "a reduction of a value as wide as the accumulator in a gated epilogue: reduce "
                    "values computed from the gate and up halves instead",
                    user.loc,
                )


def split_halves(graph: Graph) -> Graph:
    """The kernel's graph of a gated epilogue (see the module docstring); others are returned as
    they are."""
    if not is_gated(graph):
        return graph
    full = {n.id for n in graph.nodes if _is_full_width(n)}
    _check_full_width_uses(graph, full)
    builder = GraphBuilder(graph.batched)
    halves: dict[int, tuple[Node, Node]] = {}
    mapped: dict[int, Node] = {}
    operands: dict[str, Operand] = {}
    for name, operand in graph.operands.items():
        if operand.shape and operand.shape[-1] == N:
            for i, suffix in enumerate(HALF_NAMES):
                half_name = f"{name}.{suffix}"
                operands[half_name] = Operand(half_name, operand.kind, operand.dtype,
                                              _half_shape(operand.shape), operand.batched, (name, i))
        else:
            operands[name] = Operand(operand.name, operand.kind, operand.dtype, _shape(operand.shape),
                                     operand.batched)

    def value(node: Node, half: int) -> Node:
        return halves[node.id][half] if node.id in halves else mapped[node.id]

    for node in graph.nodes:
        if node.id in full:
            pair = []
            for i, suffix in enumerate(HALF_NAMES):
                attrs = dict(node.attrs)
                if node.op == "acc":
                    attrs["half"] = i
                elif node.op == "load":
                    attrs["name"] = f"{node.attrs['name']}.{suffix}"
                    attrs["shape"] = _half_shape(node.attrs["shape"])
                    attrs["half_of"] = (node.attrs["name"], i)
                inputs = tuple(value(x, i) for x in node.inputs)
                pair.append(builder.add(node.op, inputs, attrs, loc=node.loc, dtype=node.dtype,
                                        shape=_half_shape(node.shape)))
            halves[node.id] = (pair[0], pair[1])
        elif node.op == "half":
            mapped[node.id] = halves[node.inputs[0].id][node.attrs["index"]]
        else:
            attrs = dict(node.attrs)
            if "value" in attrs:
                attrs["value"] = _to_output_width(attrs["value"])
            if "shape" in attrs:
                attrs["shape"] = _shape(attrs["shape"])
            inputs = tuple(mapped[x.id] for x in node.inputs)
            mapped[node.id] = builder.add(node.op, inputs, attrs, loc=node.loc, dtype=node.dtype,
                                          shape=_shape(node.shape))
    return dataclasses.replace(replace_nodes(graph, builder.nodes), operands=operands, gated=True)


def kernel_graph(graph: Graph) -> Graph:
    """The graph evtc.compile generates code from: an optimized graph (:func:`evtc.trace`), split into
    halves when gated, fused again and validated."""
    if not is_gated(graph):
        _refuse_dead_halves(graph)
        return graph
    from .fusion import fuse_elementwise
    from .validate import validate

    split = fuse_elementwise(split_halves(graph)).graph
    validate(split, lowered=True)
    return split


def join_halves(graph: Graph) -> Graph:
    """The inverse of :func:`split_halves`: a kernel's split graph back in the user's coordinates
    (N the GEMM's width), with the accumulator and each split operand whole and ``half`` nodes
    taking their halves. What the backward of a gated kernel's custom operator is derived from
    (:meth:`evtc.Kernel.backward_graph`), since the split graph has no whole accumulator to
    differentiate by. Graphs that are not split are returned as they are."""
    if not graph.gated:
        return graph
    builder = GraphBuilder(graph.batched)
    operands: dict[str, Operand] = {}
    for name, operand in graph.operands.items():
        if operand.half_of is None:
            operands[name] = Operand(name, operand.kind, operand.dtype, _user_shape(operand.shape),
                                     operand.batched)
        else:
            user = operand.half_of[0]
            operands.setdefault(user, Operand(user, operand.kind, operand.dtype, _whole_shape(operand.shape),
                                              operand.batched))
    whole: dict[str, Node] = {}  # "acc" or an operand's name -> its whole value
    mapped: dict[int, Node] = {}
    for node in graph.nodes:
        half = node.attrs.get("half") if node.op == "acc" else None
        half_of = node.attrs.get("half_of") if node.op == "load" else None
        if half is not None or half_of is not None:
            key, index = ("acc", half) if half is not None else half_of
            if key not in whole:
                attrs = {k: v for k, v in node.attrs.items() if k not in ("half", "half_of")}
                if half_of is not None:
                    attrs["name"] = key
                    attrs["shape"] = _whole_shape(node.attrs["shape"])
                whole[key] = builder.add(node.op, (), attrs, loc=node.loc, dtype=node.dtype,
                                         shape=_whole_shape(node.shape))
            mapped[node.id] = builder.add("half", (whole[key],), {"index": index}, loc=node.loc,
                                          dtype=node.dtype, shape=_user_shape(node.shape))
            continue
        attrs = dict(node.attrs)
        if "value" in attrs:
            attrs["value"] = sympy.sympify(attrs["value"]).subs(N, N / 2)
        if "shape" in attrs:
            attrs["shape"] = _user_shape(attrs["shape"])
        mapped[node.id] = builder.add(node.op, tuple(mapped[x.id] for x in node.inputs), attrs, loc=node.loc,
                                      dtype=node.dtype, shape=_user_shape(node.shape))
    return dataclasses.replace(replace_nodes(graph, builder.nodes), operands=operands, gated=False)


def _user_shape(shape: Shape) -> Shape:
    """A shape in the kernel's coordinates (N = the output's width) in the user's (N = the GEMM's)."""
    return tuple(sympy.sympify(d).subs(N, N / 2) for d in shape)


def _whole_shape(shape: Shape) -> Shape:
    """The user's shape of the whole value whose half has ``shape`` (kernel coordinates): as wide
    as the GEMM along its last dim."""
    return (*_user_shape(shape[:-1]), N)


def _refuse_dead_halves(graph: Graph) -> None:
    """An epilogue that split the accumulator but whose outputs read neither half (``gate, up =
    acc.chunk(2, -1); return C * 2``) still has values half as wide as the GEMM, which no kernel
    computes from: refused by name (it crashed deep in the launcher)."""
    # The values the outputs are computed from (an unused operand that happens to be N/2 wide is
    # not one: it is never loaded).
    widths = [d for n in graph.nodes for d in (n.shape or ())]
    if any(sympy.sympify(d) == HALF_N for d in widths):
        store = next((n for n in graph.nodes if n.op == "store"), None)
        raise ShapeError("the epilogue splits the accumulator into halves (chunk or split), but no "
                         "output reads either half: its outputs are half as wide as the GEMM without "
                         "coming from it. Return a value computed from the halves, or drop the split",
                         store.loc if store is not None else None)


__all__ = ["HALF_NAMES", "is_gated", "join_halves", "kernel_graph", "split_halves"]

