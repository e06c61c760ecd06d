"""The dtype each traced value would have if the epilogue ran eagerly, on ``acc = a @ b``.

A node's own dtype says at what precision the kernel holds a value: evtc computes in float32 and
rounds only where the function casts (evtc/ir/passes/dtypes.py), so ``acc * 2`` is a float32 node
although torch would hold it in ``a``'s dtype. What ``x.dtype`` reports inside the function, and
what an output is stored as when the function does not cast it last, is the dtype torch gives the
value when the function runs on real tensors with the accumulator in ``a``'s dtype (the same
function as its own reference). That is this module: torch's promotion rules applied to the traced
graph, with each value's dimensionality class (dimensioned tensor, 0-dim tensor, Python number),
which those rules read.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch

from ..ir.graph import Node
from ..ir.infer import promotion_stand_in
from ..ir.ops import ELEMENTWISE

#: Dimensionality classes, in the order torch's promotion ranks them: a Python number never widens
#: a tensor of its kind, and a 0-dim tensor never widens a dimensioned tensor of its kind
#: (``bf16_tile * torch.tensor(2.0)`` stays bfloat16, ``bf16_tile + fp32_bias`` is float32).
NUMBER, ZERO_DIM, DIMENSIONED = 0, 1, 2


@dataclass(frozen=True)
class EagerType:
    """A value's dtype under eager torch, and its dimensionality class."""

    dtype: torch.dtype
    rank_class: int


def promote_eager(x: EagerType, y: EagerType) -> EagerType:
    """torch's result type of a binary op on values of these types."""
    rank_class = max(x.rank_class, y.rank_class)
    if rank_class == NUMBER:
        # Arithmetic on Python numbers: a Python number of the wider kind.
        kinds = (torch.bool, torch.int64, torch.float32)
        return EagerType(max(x.dtype, y.dtype, key=lambda d: kinds.index(_kind(d))), NUMBER)
    try:
        stand_ins = [promotion_stand_in(t.dtype, t.rank_class == NUMBER, t.rank_class == ZERO_DIM)
                     for t in (x, y)]
        dtype = torch.result_type(*stand_ins)
    except RuntimeError:
        # float8 has no promotion in torch; evtc refuses arithmetic on it with its own message
        # (check_dtypes), so any answer will do until then.
        dtype = torch.float32
    return EagerType(dtype, rank_class)


def _kind(dtype: torch.dtype) -> torch.dtype:
    if dtype == torch.bool:
        return torch.bool
    return torch.float32 if dtype.is_floating_point else torch.int64


class EagerDtypes:
    """Eager dtypes of one trace's nodes, computed on demand and remembered by node id.

    ``operands`` overrides what the named operands are (another dtype, or 0-dim where the example
    had dims): :meth:`with_operands` asks what the function's dtypes would be for another call."""

    def __init__(self, acc_dtype: torch.dtype, operands: dict[str, EagerType] | None = None) -> None:
        self._acc_dtype = acc_dtype
        self._operands = operands or {}
        self._known: dict[int, EagerType] = {}
        #: Nodes whose eager type the tracer fixed: another node's (``same_as``) or a given one.
        self._fixed: dict[int, Node | EagerType] = {}

    def with_operands(self, operands: dict[str, EagerType]) -> EagerDtypes:
        """The eager dtypes of the same trace if the named operands were of these types."""
        other = EagerDtypes(self._acc_dtype, operands)
        other._fixed = self._fixed
        return other

    def dtype(self, node: Node) -> torch.dtype:
        return self.of(node).dtype

    def of(self, node: Node) -> EagerType:
        known = self._known.get(node.id)
        if known is not None:
            return known
        # What ``node`` reads first, deepest first, with a stack of our own: a long chain of ops
        # (a loop of 400 additions) would otherwise recurse once per node, past Python's limit.
        stack = [node]
        while stack:
            top = stack[-1]
            if top.id in self._known:
                stack.pop()
                continue
            fixed = self._fixed.get(top.id)
            reads = [] if isinstance(fixed, EagerType) else [fixed] if fixed is not None else top.inputs
            pending = [n for n in reads if n.id not in self._known]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            if isinstance(fixed, EagerType):
                self._known[top.id] = fixed
            elif fixed is not None:
                self._known[top.id] = self._known[fixed.id]
            else:
                self._known[top.id] = self._infer(top)
        return self._known[node.id]

    def same_as(self, node: Node, source: Node) -> None:
        """Let ``node``, a widening evtc adds for its own arithmetic, read as ``source`` does."""
        self._fixed[node.id] = source
        self._known.pop(node.id, None)

    def set(self, node: Node, eager: EagerType) -> None:
        """Fix ``node``'s eager type (a constant tensor the function makes, ``torch.tensor([2.0])``,
        is a dimensioned float32 tensor, not a Python number)."""
        self._fixed[node.id] = eager
        self._known.pop(node.id, None)

    def _infer(self, node: Node) -> EagerType:
        op, inputs, attrs = node.op, node.inputs, node.attrs
        if op == "acc":
            return EagerType(self._acc_dtype, DIMENSIONED)
        if op == "load":
            given = self._operands.get(attrs["name"])
            return given or EagerType(attrs["dtype"], ZERO_DIM if node.shape == () else DIMENSIONED)
        if op == "arg":
            return EagerType(torch.float32, NUMBER)
        if op == "literal":
            value = attrs["value"]
            if isinstance(value, sympy.logic.boolalg.BooleanAtom):
                return EagerType(torch.bool, NUMBER)
            return EagerType(torch.int64 if value.is_integer else torch.float32, NUMBER)
        if op == "cast":
            source = self.of(inputs[0])
            # An implicit cast is evtc's widening to float32, which torch never does.
            return source if attrs.get("implicit") else EagerType(attrs["dtype"], source.rank_class)
        if op == "half":
            return self.of(inputs[0])
        if op == "reduce":
            return EagerType(self.of(inputs[0]).dtype, ZERO_DIM if node.shape == () else DIMENSIONED)
        if op == "store":
            return EagerType(attrs["dtype"], DIMENSIONED)
        types = [self.of(i) for i in inputs]
        rank_class = max(t.rank_class for t in types)
        if ELEMENTWISE[op].boolean:
            return EagerType(torch.bool, rank_class)
        operands = types[1:] if op == "where" else types  # where's condition takes no part
        result = operands[0]
        for other in operands[1:]:
            result = promote_eager(result, other)
        dtype = result.dtype
        if not dtype.is_floating_point:
            # Arithmetic on masks (exp(mask), mask * 2): torch gives a float or an integer tensor;
            # evtc's numbers are all floating, so float32 (torch's default dtype).
            dtype = torch.float32
        return EagerType(dtype, rank_class)


__all__ = ["DIMENSIONED", "NUMBER", "ZERO_DIM", "EagerDtypes", "EagerType", "promote_eager"]
