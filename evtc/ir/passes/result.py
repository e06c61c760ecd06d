"""What a rewriting pass returns: the new graph and whether it differs from the input.

Passes never mutate their input: nodes are immutable once a graph holds them, and a pass builds the
nodes of its result (sharing the input's where nothing changed). ``changed`` lets a pipeline stop at
a fixed point without comparing graphs itself.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

from ..graph import Graph


class PassResult(NamedTuple):
    """A pass's output graph, and whether it differs from the pass's input."""

    graph: Graph
    changed: bool


def fingerprint(graph: Graph) -> tuple:
    """The graph's structure, independent of node ids (which every rebuild renumbers): ops, edges,
    attributes, dtypes, shapes and the fusion pass's annotations."""
    index = {n.id: k for k, n in enumerate(graph.nodes)}
    return tuple(
        (n.op, tuple(index[i.id] for i in n.inputs), repr(sorted(n.attrs.items(), key=lambda kv: kv[0])),
         str(n.dtype), repr(n.shape), n.stage, n.group)
        for n in graph.nodes
    )


def graph_pass(rewrite: Callable[[Graph], Graph]) -> Callable[[Graph], PassResult]:
    """Make ``rewrite`` (Graph -> new Graph) a pass that also says whether it changed anything."""

    @functools.wraps(rewrite)
    def run(graph: Graph) -> PassResult:
        result = rewrite(graph)
        return PassResult(result, fingerprint(result) != fingerprint(graph))

    return run


__all__ = ["PassResult", "fingerprint", "graph_pass"]
