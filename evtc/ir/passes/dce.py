"""Dead-code elimination: keep only what some store needs."""

from __future__ import annotations

from ..graph import Graph, replace_nodes
from .result import graph_pass


@graph_pass
def eliminate_dead_code(graph: Graph) -> Graph:
    live: set[int] = set()
    for node in reversed(graph.nodes):
        if node.op == "store" or node.id in live:
            live.add(node.id)
            live.update(i.id for i in node.inputs)
    return replace_nodes(graph, [n for n in graph.nodes if n.id in live])
