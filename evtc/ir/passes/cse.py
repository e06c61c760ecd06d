"""Common-subexpression elimination: one node per distinct computation.

All nodes are pure, so two nodes with the same op, attributes and inputs compute the same value;
inputs of commutative ops are compared as a set.
"""

from __future__ import annotations

import sympy

from ..graph import Graph, GraphBuilder, Node, rewrite
from ..ops import ELEMENTWISE
from .result import graph_pass


def _key(node: Node, inputs: tuple[Node, ...]) -> tuple:
    ids = [i.id for i in inputs]
    definition = ELEMENTWISE.get(node.op)
    if definition is not None and definition.commutative:
        ids.sort()
    attrs = []
    for k, v in sorted(node.attrs.items()):
        if k == "implicit":
            continue  # a cast is the same cast whoever wrote it
        if isinstance(v, sympy.Basic):
            # 1.0 and 1 are the same constant; sympy hashes them apart.
            v = float(v) if v.is_Number else sympy.srepr(v)
        elif isinstance(v, tuple):
            v = tuple(str(x) for x in v)
        elif isinstance(v, float):
            v = repr(v)  # -0.0 and 0.0 compare equal, but hardtanh(x, -0.0, 1) is not hardtanh(x, 0.0, 1)
        attrs.append((k, v))
    return (node.op, tuple(ids), tuple(attrs), node.dtype, node.shape)


@graph_pass
def eliminate_common_subexpressions(graph: Graph) -> Graph:
    seen: dict[tuple, Node] = {}

    def visit(node: Node, inputs: tuple[Node, ...], builder: GraphBuilder) -> Node | None:
        if node.op == "store":
            return None
        key = _key(node, inputs)
        existing = seen.get(key)
        if existing is not None:
            return existing
        new = builder.add(node.op, inputs, node.attrs, loc=node.loc, dtype=node.dtype,
                          shape=node.shape)
        seen[key] = new
        return new

    return rewrite(graph, visit)
