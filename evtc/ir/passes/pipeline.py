"""The standard pass pipeline from a traced graph to the graph the code generator consumes."""

from __future__ import annotations

from collections.abc import Callable

from ..graph import Graph
from .cse import eliminate_common_subexpressions
from .dce import eliminate_dead_code
from .dtypes import check_dtypes, make_casts_explicit
from .fold import fold_constants
from .fusion import fuse_elementwise
from .result import PassResult
from .shapes import infer_shapes
from .validate import validate

#: The rewriting passes, by name, in the order `optimize` first applies them.
PASSES: dict[str, Callable[[Graph], PassResult]] = {
    "infer_shapes": infer_shapes,
    "make_casts_explicit": make_casts_explicit,
    "fold_constants": fold_constants,
    "eliminate_common_subexpressions": eliminate_common_subexpressions,
    "eliminate_dead_code": eliminate_dead_code,
    "fuse_elementwise": fuse_elementwise,
}


def simplify(graph: Graph, *, max_rounds: int = 8) -> Graph:
    """Fold constants, merge common subexpressions and drop dead code, to a fixed point."""
    for _ in range(max_rounds):
        changed = False
        for rewrite_pass in (fold_constants, eliminate_common_subexpressions, eliminate_dead_code):
            graph, did = rewrite_pass(graph)
            changed |= did
        if not changed:
            break
    return graph


def optimize(graph: Graph, *, max_rounds: int = 8) -> Graph:
    """Check, lower, simplify to a fixed point, fuse and validate."""
    check_dtypes(graph)
    graph = infer_shapes(graph).graph
    graph = make_casts_explicit(graph).graph
    graph = simplify(graph, max_rounds=max_rounds)
    graph = fuse_elementwise(graph).graph
    validate(graph, lowered=True)
    return graph
