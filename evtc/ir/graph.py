"""The epilogue DAG: nodes, the graph that holds them in topological order, and a builder.

Vocabulary (small on purpose; see docs/ir.md):

=========  ==========================================================================
op          meaning
=========  ==========================================================================
acc         the GEMM accumulator a @ b, float32, shape (L,) M, N
load        an operand tensor: attrs name, kind (tile / row / col / scalar), batched
arg         a Python-scalar runtime argument: attrs name
literal     a constant: attrs value (a sympy expression, possibly of L, M, N)
<op>        an elementwise op of :mod:`evtc.ir.ops` (add, gelu, where, ...)
cast        a rounding conversion: attrs dtype
reduce      attrs reduce (sum / max / min), axis (row / col / batch / all), keepdim
store       an output: attrs name, dtype; its input is the value stored
=========  ==========================================================================

Nodes are immutable once built; passes build new graphs (see :func:`rewrite`), which keeps every
pass easy to check: evaluate the graph before and after on the same inputs.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch

from ..errors import SourceLoc
from .ops import ELEMENTWISE
from .shapes import Shape

LOAD_OPS = frozenset({"acc", "load", "arg", "literal"})

#: Operand kinds, named by which of (M, N) the operand varies along.
OPERAND_KINDS = ("tile", "row", "col", "scalar")


@dataclass(frozen=True)
class Operand:
    """An epilogue input other than acc: a tensor operand or a Python-scalar runtime argument."""

    name: str
    #: "tile", "row", "col", "scalar" (a device scalar) for tensors; "arg" for Python scalars.
    kind: str
    dtype: torch.dtype
    #: The symbolic shape the tensor has in memory (as the user passes it); () for args.
    shape: Shape = ()
    #: Whether the tensor varies along the batch dim L.
    batched: bool = False
    #: In a split gated graph (see :mod:`evtc.ir.passes.gated`): (the user's operand, 0 or 1) for
    #: the gate (0) or up (1) half of an operand as wide as the accumulator.
    half_of: tuple[str, int] | None = None

    def describe(self) -> str:
        from .dtypes import short_name
        from .shapes import format_shape

        if self.kind == "arg":
            return f"{self.name}: runtime scalar"
        batch = ", per batch" if self.batched else ""
        return f"{self.name}: {short_name(self.dtype)}{format_shape(self.shape)} {self.kind}{batch}"


class Node:
    """One value of the epilogue: a load, an elementwise op, a cast, a reduction or a store."""

    __slots__ = ("id", "op", "inputs", "attrs", "dtype", "shape", "loc", "stage", "group")

    def __init__(
        self,
        id: int,
        op: str,
        inputs: tuple[Node, ...],
        attrs: dict[str, Any],
        dtype: torch.dtype,
        shape: Shape,
        loc: SourceLoc | None,
    ) -> None:
        self.id = id
        self.op = op
        self.inputs = inputs
        self.attrs = attrs
        self.dtype = dtype
        self.shape = shape
        self.loc = loc
        #: Set by the fusion pass: "uniform" (once per kernel), "tile" (per element) or
        #: "final" (after reductions complete).
        self.stage: str | None = None
        #: Set by the fusion pass: the id of the fused unit this compute node belongs to.
        self.group: int | None = None

    @property
    def category(self) -> str:
        """load / compute / reduction / store: the four kinds of node."""
        if self.op in LOAD_OPS:
            return "load"
        if self.op == "reduce":
            return "reduction"
        if self.op == "store":
            return "store"
        return "compute"

    @property
    def is_elementwise(self) -> bool:
        return self.op in ELEMENTWISE or self.op == "cast"

    @property
    def is_python_scalar(self) -> bool:
        """True for values that behave as Python numbers in torch's type promotion."""
        return self.attrs.get("python_scalar", False)

    def key(self) -> tuple:
        """Structural identity, used by CSE: two nodes with equal keys compute the same value."""
        attrs = tuple(sorted((k, _hashable(v)) for k, v in self.attrs.items()))
        return (self.op, tuple(i.id for i in self.inputs), attrs, self.dtype)

    def __repr__(self) -> str:
        return f"Node(%{self.id} {self.op})"


def _hashable(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted(value.items()))
    if isinstance(value, list):
        return tuple(value)
    return value


@dataclass
class OutputTree:
    """The structure of what the epilogue returns: a single value, a tuple or a dict of outputs.

    Leaves are output names (the `name` attribute of store nodes).
    """

    kind: str  # "single" | "tuple" | "list" | "dict"
    names: list[str]
    keys: list[str] | None = None

    def build(self, values: dict[str, Any]) -> Any:
        if self.kind == "single":
            return values[self.names[0]]
        if self.kind == "tuple":
            return tuple(values[n] for n in self.names)
        if self.kind == "list":
            return [values[n] for n in self.names]
        assert self.keys is not None
        return {k: values[n] for k, n in zip(self.keys, self.names, strict=True)}


@dataclass
class Graph:
    """An epilogue DAG in topological order, with its interface (operands, outputs)."""

    name: str
    nodes: list[Node]
    #: Operands in the order of the epilogue's parameters (acc excluded).
    operands: dict[str, Operand]
    outputs: OutputTree
    #: Whether the problem has a batch dim L (acc is (L, M, N)).
    batched: bool
    #: Name of the epilogue's first parameter, for printing.
    acc_name: str = "acc"
    #: dtype of the GEMM input a (full-tile outputs default to it).
    ab_dtype: torch.dtype = torch.float16
    #: Fused units, filled by the fusion pass: group id -> ordered node list.
    groups: dict[int, list[Node]] = field(default_factory=dict)
    #: True for a gated graph split into halves (:mod:`evtc.ir.passes.gated`): N is then the
    #: output's width, half the GEMM's, and acc is two nodes (attrs half 0 and 1).
    gated: bool = False
    #: The GEMM's N where the function fixes it (``acc.split(14336, -1)``: two halves of 14336
    #: only where N is 28672; torch fails for another N, so calls of another N are refused).
    fixed_n: int | None = None
    #: Per tensor operand whose dtype changes an output's dtype in torch (a float32 bias makes
    #: acc + bias float32): the dtypes (and 0-dim or not) a call may pass, by
    #: :func:`evtc.ir.dtypes.variant_name`. Unlisted operands take any float dtype.
    operand_variants: tuple[tuple[str, tuple[str, ...]], ...] = ()
    #: The inputs ("acc" for the accumulator, else operand names) that a shape, size or rank the
    #: function read is computed from (``C.size(0)``, ``bias.dim()``, ``(acc + C).shape[-1]``): the
    #: graph holds what they were at the compiled shapes, so a call may not pass them in another
    #: shape even where torch would broadcast it.
    shape_reads: frozenset[str] = frozenset()
    #: The inputs any of whose sizes the function read, the last dim included (an operand read
    #: only so, which the kernel then does not take, is refused at compile time).
    size_reads: frozenset[str] = frozenset()

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def stores(self) -> list[Node]:
        return [n for n in self.nodes if n.op == "store"]

    def store(self, name: str) -> Node:
        for n in self.stores:
            if n.attrs["name"] == name:
                return n
        raise KeyError(name)

    def users(self) -> dict[int, list[Node]]:
        """Map node id -> the nodes that use it."""
        result: dict[int, list[Node]] = {n.id: [] for n in self.nodes}
        for n in self.nodes:
            for i in n.inputs:
                result[i.id].append(n)
        return result

    def count(self, op: str) -> int:
        return sum(1 for n in self.nodes if n.op == op)

    def __str__(self) -> str:
        from .printer import format_graph

        return format_graph(self)

    def to_dot(self) -> str:
        """The DAG in Graphviz dot, nodes coloured by category and labelled with expressions."""
        from .printer import graph_to_dot

        return graph_to_dot(self)

    def render(self, path: Any, *, engine: str = "auto") -> Any:
        """Write a picture of the DAG (.svg, .png or .dot): Graphviz when installed, else a
        built-in SVG layout. See :func:`evtc.ir.picture.render`."""
        from .picture import render

        return render(self, path, engine=engine)

    def evaluate(self, inputs: dict[str, Any], *, compute_dtype: torch.dtype = torch.float32,
                 cast_outputs: bool = True) -> Any:
        """Run the graph on tensors: see :func:`evtc.ir.interpreter.evaluate`."""
        from .interpreter import evaluate

        return evaluate(self, inputs, compute_dtype=compute_dtype, cast_outputs=cast_outputs)


class GraphBuilder:
    """Appends nodes in topological order, inferring each node's shape and dtype."""

    def __init__(self, batched: bool) -> None:
        self.batched = batched
        self.nodes: list[Node] = []
        self._ids = itertools.count()

    def add(
        self,
        op: str,
        inputs: tuple[Node, ...] = (),
        attrs: dict[str, Any] | None = None,
        *,
        loc: SourceLoc | None = None,
        dtype: torch.dtype | None = None,
        shape: Shape | None = None,
    ) -> Node:
        from .infer import infer_dtype, infer_shape

        attrs = dict(attrs or {})
        if shape is None:
            shape = infer_shape(op, inputs, attrs, self.batched, loc)
        if dtype is None:
            dtype = infer_dtype(op, inputs, attrs)
        if op in ELEMENTWISE and inputs and all(i.is_python_scalar for i in inputs):
            attrs["python_scalar"] = True
        node = Node(next(self._ids), op, tuple(inputs), attrs, dtype, shape, loc)
        self.nodes.append(node)
        return node

    def literal(self, value: Any, loc: SourceLoc | None = None) -> Node:
        if isinstance(value, float) and value == 0 and math.copysign(1.0, value) < 0:
            # sympy has no negative zero; -(+0.0) keeps its sign everywhere (1 / -0.0 is -inf).
            zero = self.add("literal", (), {"value": sympy.Integer(0), "python_scalar": True}, loc=loc)
            return self.add("neg", (zero,), {}, loc=loc)
        return self.add("literal", (), {"value": sympy.sympify(value), "python_scalar": True}, loc=loc)


def upstream(*nodes: Node) -> Iterator[Node]:
    """``nodes`` and every node they are computed from, each once (in no particular order)."""
    seen: set[int] = set()
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node.id in seen:
            continue
        seen.add(node.id)
        yield node
        stack.extend(node.inputs)


def rewrite(
    graph: Graph,
    visit: Callable[[Node, tuple[Node, ...], GraphBuilder], Node | None],
) -> Graph:
    """Rebuild `graph` node by node.

    `visit(old_node, new_inputs, builder)` returns the node that replaces `old_node` (built with
    `builder`, or an existing new node), or None to copy it unchanged onto the new inputs.
    """
    builder = GraphBuilder(graph.batched)
    mapping: dict[int, Node] = {}
    for node in graph.nodes:
        new_inputs = tuple(mapping[i.id] for i in node.inputs)
        replacement = visit(node, new_inputs, builder)
        if replacement is None:
            replacement = builder.add(
                node.op, new_inputs, node.attrs, loc=node.loc, dtype=node.dtype, shape=node.shape
            )
        mapping[node.id] = replacement
    return replace_nodes(graph, builder.nodes)


def replace_nodes(graph: Graph, nodes: list[Node]) -> Graph:
    """A copy of `graph` with another node list (annotations of the fusion pass are dropped)."""
    return Graph(
        name=graph.name,
        nodes=nodes,
        operands=graph.operands,
        outputs=graph.outputs,
        batched=graph.batched,
        acc_name=graph.acc_name,
        ab_dtype=graph.ab_dtype,
        gated=graph.gated,
        fixed_n=graph.fixed_n,
        operand_variants=graph.operand_variants,
        shape_reads=graph.shape_reads,
        size_reads=graph.size_reads,
    )
