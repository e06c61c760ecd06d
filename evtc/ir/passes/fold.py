"""Constant folding and algebraic simplification.

Rules (x any value, c a constant, s a uniform value: one that does not vary over the tile):
  ops on constants only      -> the constant (sympy keeps sizes like 1/N exact; a result of -0.0,
                                which sympy cannot hold, is left unfolded)
  x - 0, x * 1, x / 1, x ** 1          -> x
  x * -1, -(-x)              -> -x, x
  x - c                      -> x + (-c)
  x / c                      -> x * (1/c)      (where 1/c is a normal float32 number: rounded once,
                                                 at most about 1 ulp apart, as torch's CUDA
                                                 division by a scalar does)
  x ** 2, x ** 0.5, x ** -0.5, x ** -1    -> x * x, sqrt, rsqrt, reciprocal
  2 ** x                     -> exp2(x)         (other bases stay pow, which is exact where
                                                 exp2(x * log2(c)) is not: 10 ** 2 is 100)
  (x * c1) * c2              -> x * (c1 * c2)   (so c1 * c2 is computed once, not per element;
                                                 literals or sizes only, and only where c1 * c2
                                                 is a normal float32 number: a product that
                                                 overflows or underflows would turn finite
                                                 results into inf, NaN or 0. Runtime scalars are
                                                 never regrouped: their range is not known)
  x.to(d) where x is d       -> x
Nothing that changes NaN/inf behaviour or the sign of a zero is folded: x * 0 and x - x stay;
x + 0 and 0 - x stay (-0.0 + 0.0 and 0 - 0.0 are +0.0); sums are never regrouped, since
(x + c1) + c2 may cancel x against c1 first ((acc + 1.0) + 1e-12 at acc = -1 is 1e-12, not 0).
"""

from __future__ import annotations

import math
from typing import Any

import sympy
import torch

from ..dtypes import COMPUTE_DTYPE, FLOAT32_MAX, as_float32_literal, round_to
from ..graph import Graph, GraphBuilder, Node, rewrite
from ..ops import ELEMENTWISE
from ..shapes import varying_dims
from .result import graph_pass

_SYMPY_OPS = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
    "neg": lambda a: -a,
}


def _const(node: Node) -> sympy.Expr | None:
    return sympy.sympify(node.attrs["value"]) if node.op == "literal" else None


def _is(node: Node, value: float) -> bool:
    c = _const(node)
    return c is not None and c.is_Number and float(c) == value


def _uniform(node: Node) -> bool:
    return not varying_dims(node.shape) and node.dtype == COMPUTE_DTYPE


def _evaluate_numeric(op: str, values: list[float], attrs: dict[str, Any]) -> float:
    definition = ELEMENTWISE[op]
    tensors = [torch.tensor(v, dtype=torch.float64) for v in values]
    params = {p: attrs[p] for p in definition.params}
    return float(definition.evaluate(*tensors, **params))


class _Simplifier:
    def __init__(self, graph: Graph) -> None:
        self.users = graph.users()

    def single_use(self, old: Node) -> bool:
        return len(self.users.get(old.id, ())) == 1

    def visit(self, node: Node, inputs: tuple[Node, ...], b: GraphBuilder) -> Node | None:
        if node.op == "cast":
            return self.cast(node, inputs[0], b)
        if node.op not in ELEMENTWISE or ELEMENTWISE[node.op].boolean or node.op == "where":
            return None
        return self.simplify(node.op, inputs, node, b)

    def cast(self, node: Node, x: Node, b: GraphBuilder) -> Node | None:
        if x.dtype == node.dtype:
            return x
        c = _const(x)
        if c is not None and c.is_Number:
            return b.literal(float(round_to(torch.tensor(float(c), dtype=torch.float64), node.dtype)),
                             node.loc)
        return None

    def make(self, op: str, inputs: tuple[Node, ...], like: Node, b: GraphBuilder) -> Node:
        """Build `op` on `inputs`, simplifying it too; shape and dtype are re-inferred."""
        simplified = self.simplify(op, inputs, like, b, fresh=True)
        if simplified is not None:
            return simplified
        return b.add(op, inputs, _params(op, like), loc=like.loc)

    def simplify(self, op: str, inputs: tuple[Node, ...], node: Node, b: GraphBuilder,
                 fresh: bool = False) -> Node | None:
        loc = node.loc
        consts = [_const(i) for i in inputs]
        # 1. Constants only: fold.
        if all(c is not None for c in consts):
            if any(c.is_Number and not math.isfinite(as_float32_literal(float(c))) for c in consts):
                # A number float32 cannot hold is inf where the op runs (1e308 * 0.0 is NaN there,
                # as in torch's kernels), not the exact value sympy would give.
                return None
            if op in _SYMPY_OPS:
                if all(c.is_Number for c in consts) and _negative_zero(op, consts):
                    return None  # -0.0, which a literal cannot hold: the node keeps it
                return b.literal(sympy.simplify(_SYMPY_OPS[op](*consts)), loc)
            if op == "pow" and all(c.is_Number for c in consts):
                base, exp = (float(c) for c in consts)
                try:
                    return b.literal(math.pow(base, exp), loc)
                except (ValueError, OverflowError):
                    return None
            if all(c.is_Number for c in consts):
                return b.literal(_evaluate_numeric(op, [float(c) for c in consts], _params(op, node)),
                                 loc)
            return None
        # Identities must not change what the node is: same shape and dtype as the kept operand.
        def same(x: Node) -> bool:
            return fresh or (x.shape == node.shape and x.dtype == node.dtype)

        if op == "add":
            # x + 0.0 is not x: -0.0 + 0.0 is +0.0 (and 1 / it +inf); sums are not regrouped either,
            # as x + c1 + c2 may cancel x against c1 first ((acc + 1.0) + 1e-12 at acc = -1).
            return None
        if op == "sub":
            x, y = inputs
            if _is(y, 0) and same(x):
                return x  # x - 0.0 is x, -0.0 included (0 - x is not -x: 0 - 0.0 is +0.0)
            if consts[1] is not None:
                return self.make("add", (x, b.literal(-consts[1], loc)), node, b)
            return None
        if op == "mul":
            x, y = inputs
            if _is(y, 1) and same(x):
                return x
            if _is(x, 1) and same(y):
                return y
            # A mask times -1 stays a product: neg of a bool is not a number (torch refuses it).
            if _is(y, -1) and x.dtype != torch.bool:
                return self.make("neg", (x,), node, b)
            if _is(x, -1) and y.dtype != torch.bool:
                return self.make("neg", (y,), node, b)
            return self.reassociate("mul", inputs, node, b)
        if op == "div":
            x, y = inputs
            c = consts[1]
            if c is not None:
                if c.is_Number and float(c) == 1 and same(x):
                    return x
                if c.is_Number and (float(c) == 0 or not _normal_float32(1 / float(c))):
                    return None  # 1/c would be 0, inf or subnormal: x / c is not x * (1/c) then
                if not c.is_Number and not 1e-30 <= abs(float(c.as_coeff_Mul()[0])) <= 1e30:
                    return None  # a size times a literal far from 1: 1/c could leave float32
                return self.make("mul", (x, b.literal(1 / c, loc)), node, b)
            return None
        if op == "neg":
            (x,) = inputs
            if x.op == "neg":
                return x.inputs[0]
            return None
        if op == "pow":
            return self.power(inputs, consts, node, b)
        return None

    def power(self, inputs: tuple[Node, ...], consts: list[Any], node: Node, b: GraphBuilder) -> Node | None:
        x, e = inputs
        ce = consts[1]
        if ce is not None and ce.is_Number:
            value = float(ce)
            if value == 1 and x.shape == node.shape and x.dtype == node.dtype:
                return x  # (a mask ** 1 is a number, not the mask)
            rewrites = {2.0: lambda: self.make("mul", (x, x), node, b),
                        0.5: lambda: self.make("sqrt", (x,), node, b),
                        -0.5: lambda: self.make("rsqrt", (x,), node, b),
                        -1.0: lambda: self.make("reciprocal", (x,), node, b)}
            if value in rewrites:
                return rewrites[value]()
            return None
        cb = consts[0]
        if cb is not None and cb.is_Number and float(cb) == 2:
            return self.make("exp2", (e,), node, b)
        # Other bases stay pow: exp2(x * log2(c)) is not exact where pow is (10 ** 2 is 100).
        return None

    def reassociate(self, op: str, inputs: tuple[Node, ...], node: Node, b: GraphBuilder) -> Node | None:
        """(x op s1) op s2 -> x op (s1 op s2) when s1, s2 are uniform and the inner node is ours, within
        the limits of the module docstring."""
        if node.dtype != COMPUTE_DTYPE:
            return None
        for outer_idx in (0, 1):
            inner, s2 = inputs[outer_idx], inputs[1 - outer_idx]
            if inner.op != op or not _uniform(s2) or inner.dtype != COMPUTE_DTYPE:
                continue
            old_inner = node.inputs[outer_idx] if outer_idx < len(node.inputs) else None
            if old_inner is not None and not self.single_use(old_inner):
                continue
            for inner_idx in (0, 1):
                x, s1 = inner.inputs[inner_idx], inner.inputs[1 - inner_idx]
                c1, c2 = _const(s1), _const(s2)
                # Constants only: runtime values (device scalars, float arguments) have no range
                # when compiling, and s1 * s2 may overflow or underflow where torch's order does
                # not ((acc * 1e20) * 1e20 at acc = 1e-30 is 1e10, acc * inf is inf).
                regroups = c1 is not None and c2 is not None and _normal_float32_product(c1, c2)
                if regroups:
                    combined = self.make(op, (s1, s2), node, b)
                    return self.make(op, (x, combined), node, b)
        return None


def _normal_float32_product(c1: sympy.Expr | None, c2: sympy.Expr | None) -> bool:
    """Whether c1 and c2 are literals whose product is a normal float32 value, or expressions of
    the sizes (so x * c1 * c2 and x * (c1 * c2) differ by rounding only)."""
    if c1 is None or c2 is None:
        return False
    if not (c1.is_Number and c2.is_Number):
        # Sizes (1/N of a mean), kept exact by sympy and rounded once when evaluated: but only
        # beside a literal whose product with any size stays a float32 number (1e38 * N does not).
        literal = c1 if c1.is_Number else c2 if c2.is_Number else None
        return literal is None or 1e-30 <= abs(float(literal)) <= 1e30
    product = abs(float(c1) * float(c2))
    return torch.finfo(torch.float32).tiny <= product <= FLOAT32_MAX


def _normal_float32(value: float) -> bool:
    return torch.finfo(torch.float32).tiny <= abs(value) <= FLOAT32_MAX


def _negative_zero(op: str, consts: list[sympy.Expr]) -> bool:
    """Whether ``op`` on these numbers gives -0.0 in floating point (sympy would give 0)."""
    try:
        result = _SYMPY_OPS[op](*[float(c) for c in consts])  # the same operators, on Python floats
    except ZeroDivisionError:
        return False
    return result == 0 and math.copysign(1.0, result) < 0


def _params(op: str, node: Node) -> dict[str, Any]:
    definition = ELEMENTWISE.get(op)
    if definition is None or node.op != op:
        return {}
    return {p: node.attrs[p] for p in definition.params}


@graph_pass
def fold_constants(graph: Graph) -> Graph:
    """Apply the rules of the module docstring once over the graph."""
    simplifier = _Simplifier(graph)
    return rewrite(graph, simplifier.visit)
