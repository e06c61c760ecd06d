"""Symbolic shapes: every graph is valid for all problem sizes (L, M, N).

A shape is a tuple of sympy expressions, right-aligned like torch's, whose entries are the symbols
L, M, N or the integer 1. Broadcasting is checked symbolically, so that `acc + acc.sum(-1)` is
rejected even when the example happens to have M == N (torch would silently broadcast it).
"""

from __future__ import annotations

from collections.abc import Sequence

import sympy

L, M, N = sympy.symbols("L M N", positive=True, integer=True)
ONE = sympy.Integer(1)
#: The width of one half of N, after ``acc.chunk(2, dim=-1)`` (the gate and up of SwiGLU).
HALF_N = N / 2

Shape = tuple[sympy.Expr, ...]


def problem_shape(batched: bool) -> Shape:
    """The accumulator's shape: (L, M, N) or (M, N)."""
    return (L, M, N) if batched else (M, N)


def broadcast(shapes: Sequence[Shape]) -> Shape | None:
    """Torch broadcasting on symbolic shapes; None where two dims differ and neither is 1."""
    rank = max((len(s) for s in shapes), default=0)
    out: list[sympy.Expr] = []
    for i in range(rank):
        dim: sympy.Expr = ONE
        for shape in shapes:
            j = i - (rank - len(shape))
            if j < 0:
                continue
            d = shape[j]
            if d == ONE:
                continue
            if dim != ONE and d != dim:
                return None
            dim = d
        out.append(dim)
    return tuple(out)


def varying_dims(shape: Shape) -> frozenset[sympy.Symbol]:
    """Which of L, M, N a value of this shape varies along (N for a half-width N/2 dim too)."""
    return frozenset(s for d in shape for s in sympy.sympify(d).free_symbols)


def format_shape(shape: Shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def evaluate_shape(shape: Shape, sizes: dict[sympy.Symbol, int]) -> tuple[int, ...]:
    return tuple(int(sympy.sympify(d).subs(sizes)) for d in shape)
