"""Symbolic shapes: every graph is valid for all problem sizes (L, M, N).

A shape is a tuple of sympy expressions, right-aligned like torch's, whose entries are the symbols
L, M, N or the integer 1. Broadcasting is checked symbolically, so that `acc + acc.sum(-1)` is
rejected even when the example happens to have M == N (torch would silently broadcast it).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

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


@functools.lru_cache(maxsize=4096)
def _evaluate_at_ints(shape: tuple, sizes: tuple[tuple[sympy.Symbol, int], ...]) -> tuple[int, ...]:
    """``shape`` at integer sizes, remembered: sympy's substitution costs tens of microseconds a
    dim, and a backward evaluates the same few shapes at the same sizes on every step."""
    return tuple(int(sympy.sympify(d).subs(dict(sizes))) for d in shape)


def evaluate_shape(shape: Shape, sizes: dict[sympy.Symbol, Any]) -> tuple[Any, ...]:
    """``shape`` at ``sizes``: ints, or torch SymInts where the sizes are symbolic (a backward
    traced by torch.compile with dynamic shapes), which sympy cannot substitute: their dims are
    then computed with Python arithmetic (exact: a dim such as N/2 by floor division)."""
    if all(type(v) is int for v in sizes.values()):
        return _evaluate_at_ints(tuple(shape), tuple(sizes.items()))
    dims = []
    for d in shape:
        numerator, denominator = sympy.fraction(sympy.together(sympy.sympify(d)))
        value = _arithmetic(numerator, sizes)
        dims.append(value if denominator == 1 else value // int(denominator))
    return tuple(dims)


def evaluate_value(expr: Any, sizes: dict[sympy.Symbol, Any]) -> Any:
    """A literal of the sizes (``1/N`` of a mean) at ``sizes``: a float, or a torch SymFloat where
    the sizes are symbolic (see :func:`evaluate_shape`)."""
    expr = sympy.sympify(expr)
    if all(type(v) is int for v in sizes.values()):
        value = expr.subs(sizes)
        # 1/N at N = 0 (a mean over an empty dim) is sympy's complex infinity: torch's mean is then
        # NaN, its sum 0 times this.
        if value.is_infinite:  # -oo is a literal -inf; oo and zoo (1/0) are +inf
            return -math.inf if value == sympy.S.NegativeInfinity else math.inf
        return float(value)
    return _arithmetic(expr, sizes)


def _arithmetic(expr: sympy.Expr, sizes: dict[sympy.Symbol, Any]) -> Any:
    """``expr`` (sums, products and integer powers of the size symbols) with Python arithmetic."""
    if expr.is_Integer:
        return int(expr)
    if expr.is_Rational:
        return int(expr.p) / int(expr.q)
    if expr.is_Float:
        return float(expr)
    if expr.is_Symbol:
        return sizes[expr]
    if expr.is_Add or expr.is_Mul:
        parts = [_arithmetic(a, sizes) for a in expr.args]
        value = parts[0]
        for part in parts[1:]:
            value = value + part if expr.is_Add else value * part
        return value
    if expr.is_Pow and expr.exp.is_Integer:
        base, power = _arithmetic(expr.base, sizes), int(expr.exp)
        return base ** power if power >= 0 else 1 / base ** -power
    raise ValueError(f"cannot evaluate {expr} at symbolic sizes")
