"""Shape inference: recompute every node's symbolic shape from its inputs and check broadcasts."""

from __future__ import annotations

from ..graph import Graph, GraphBuilder, Node, rewrite
from ..infer import infer_shape
from .result import graph_pass


@graph_pass
def infer_shapes(graph: Graph) -> Graph:
    """A copy of `graph` with shapes derived from the ops (raises ShapeError where none exists)."""

    def visit(node: Node, inputs: tuple[Node, ...], builder: GraphBuilder) -> Node:
        shape = infer_shape(node.op, inputs, node.attrs, graph.batched, node.loc)
        return builder.add(node.op, inputs, node.attrs, loc=node.loc, dtype=node.dtype, shape=shape)

    return rewrite(graph, visit)
