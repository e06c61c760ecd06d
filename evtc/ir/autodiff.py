"""Backward epilogues: the gradient of an epilogue graph, derived from its IR.

For an epilogue ``y = f(acc, operands)``, :func:`backward` builds a graph that takes what the
forward takes plus one incoming gradient per output (``dY``) and returns

* ``grad_<acc>``: ``dZ = df/dacc * dY``, elementwise over the tile (for SwiGLU and other gated
  epilogues, the gate and up halves side by side, as the accumulator has them);
* ``grad_<operand>`` for every floating-point tensor operand, reduced to the operand's shape: row
  vectors over M (a column reduction), column vectors over N (a row reduction), device scalars over
  everything, tile operands elementwise, and over L for an operand shared by all batches.

The backward graph recomputes the forward values it needs from acc and the operands (nothing is
saved), so it is an ordinary evtc graph: the interpreter evaluates it, and the existing passes
simplify it (:func:`backward` runs the pass pipeline on it). Every elementwise op has a derivative
rule in :data:`RULES`, written as graph nodes; the rules follow torch's conventions where a
derivative is not defined everywhere (relu' = 0 at 0, ties of maximum and minimum share the
gradient, ties of an amax or amin reduction share it evenly), so that the result equals
``torch.autograd`` on the same function (tests/test_autodiff.py checks it in float64 over the
catalogue and random programs). Rounding casts pass the gradient through unchanged (float8 casts
that saturate too), as torch's ``.to(dtype)`` does.

Not derived: Python-number arguments and literals (constants of the call), and boolean values.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import sympy
import torch

from ..errors import EpilogueError
from .graph import Graph, GraphBuilder, Node, Operand, OutputTree
from .infer import reduced_shape
from .ops import ELEMENTWISE
from .shapes import ONE, L, M, N, Shape, broadcast

GRAD = "grad_"
F32 = torch.float32


class BackwardError(EpilogueError):
    """An epilogue whose backward graph evtc cannot derive (the message says why)."""


@dataclass(frozen=True)
class Backward:
    """The backward graph of an epilogue and what its inputs and outputs mean."""

    graph: Graph
    #: Forward output name -> the backward graph's operand that carries its incoming gradient.
    output_grads: dict[str, str]
    #: Forward input (the accumulator's name or an operand's) -> the backward graph's output that
    #: holds its gradient.
    input_grads: dict[str, str]
    #: The symbolic shape each incoming gradient is passed in (by its operand name): the forward
    #: output's, except that a reduction's keeps its reduced dims (``(M, 1)`` for ``(M,)``).
    grad_shapes: dict[str, Shape]


# ---- building blocks -------------------------------------------------------------------------------
class _Ops:
    """Graph-building shorthands for the rules: every value in float32 (the compute dtype)."""

    def __init__(self, builder: GraphBuilder) -> None:
        self.b = builder

    def op(self, name: str, *inputs: Node, **attrs) -> Node:
        return self.b.add(name, tuple(inputs), attrs, dtype=torch.bool if ELEMENTWISE[name].boolean else F32)

    def const(self, value: float) -> Node:
        return self.b.literal(value)

    def add(self, x, y):
        return self.op("add", x, y)

    def sub(self, x, y):
        return self.op("sub", x, y)

    def mul(self, *xs):
        out = xs[0]
        for x in xs[1:]:
            out = self.op("mul", out, x)
        return out

    def div(self, x, y):
        return self.op("div", x, y)

    def neg(self, x):
        return self.op("neg", x)

    def where(self, cond, x, y):
        return self.op("where", cond, x, y)

    def zero(self):
        return self.const(0)

    def one(self):
        return self.const(1)


# A rule: (ops, node, its inputs, the gradient of its value) -> one gradient (or None) per input,
# each of the node's shape or broadcastable to it.
Rule = Callable[[_Ops, Node, Sequence[Node], Node], Sequence[Node | None]]


def _clamp_bound(keeps: str, passes: str):
    """clamp_min / clamp_max (torch.clamp's halves): the input keeps the gradient where it is within
    the bound, the bound included; the bound gets it only where the input is strictly beyond it
    (torch's clamp backward, unlike maximum's half to each on a tie)."""

    def rule(o: _Ops, node: Node, ins: Sequence[Node], g: Node):
        x, bound = ins
        return o.where(o.op(keeps, x, bound), g, o.zero()), o.where(o.op(passes, x, bound), g, o.zero())

    return rule


def _hardtanh(o: _Ops, node: Node, ins: Sequence[Node], g: Node):
    """torch's hardtanh backward: the gradient strictly inside the bounds, none at them."""
    x = ins[0]
    inside = o.op("logical_and", o.op("gt", x, o.const(node.attrs["min_val"])),
                  o.op("lt", x, o.const(node.attrs["max_val"])))
    return (o.where(inside, g, o.zero()),)


def _sign(o: _Ops, x: Node) -> Node:
    return o.where(o.op("gt", x, o.zero()), o.one(), o.where(o.op("lt", x, o.zero()), o.const(-1), o.zero()))


def _pow(o: _Ops, node: Node, ins: Sequence[Node], g: Node):
    x, y = ins
    # torch: d/dx = y x^(y-1), 0 where y == 0; d/dy = x^y log x, 0 where x == 0 and y >= 0.
    dx = o.where(o.op("eq", y, o.zero()), o.zero(), o.mul(g, y, o.op("pow", x, o.sub(y, o.one()))))
    at_zero = o.op("logical_and", o.op("eq", x, o.zero()), o.op("ge", y, o.zero()))
    dy = o.where(at_zero, o.zero(), o.mul(g, node, o.op("log", x)))
    return dx, dy


def _extremum(pick: str):
    """maximum / minimum: the gradient goes to the input picked, half to each on a tie, and as
    torch writes it (zero where the other input wins), so a NaN passes it to both."""
    loses = "lt" if pick == "gt" else "gt"

    def rule(o: _Ops, node: Node, ins: Sequence[Node], g: Node):
        x, y = ins
        half = o.mul(g, o.const(0.5))
        tie = o.op("eq", x, y)
        dx = o.where(tie, half, o.where(o.op(loses, x, y), o.zero(), g))
        dy = o.where(tie, half, o.where(o.op(loses, y, x), o.zero(), g))
        return dx, dy

    return rule


def _gelu(o: _Ops, node: Node, ins: Sequence[Node], g: Node):
    (x,) = ins
    cdf = o.mul(o.const(0.5), o.add(o.one(), o.op("erf", o.mul(x, o.const(1 / math.sqrt(2))))))
    pdf = o.mul(o.const(1 / math.sqrt(2 * math.pi)), o.op("exp", o.mul(o.const(-0.5), x, x)))
    return (o.mul(g, o.add(cdf, o.mul(x, pdf))),)


def _gelu_tanh(o: _Ops, node: Node, ins: Sequence[Node], g: Node):
    (x,) = ins
    k, kappa = math.sqrt(2 / math.pi), 0.044715
    inner = o.mul(o.const(k), o.add(x, o.mul(o.const(kappa), x, x, x)))
    t = o.op("tanh", inner)
    right = o.add(o.one(), t)
    d_inner = o.mul(o.const(k), o.add(o.one(), o.mul(o.const(3 * kappa), x, x)))
    d_right = o.mul(o.sub(o.one(), o.mul(t, t)), d_inner)
    return (o.mul(g, o.add(o.mul(o.const(0.5), right), o.mul(o.const(0.5), x, d_right))),)


def _silu(o: _Ops, node: Node, ins: Sequence[Node], g: Node):
    (x,) = ins
    s = o.op("sigmoid", x)
    return (o.mul(g, s, o.add(o.one(), o.mul(x, o.sub(o.one(), s)))),)


def _softplus(o: _Ops, node: Node, ins: Sequence[Node], g: Node):
    (x,) = ins
    bx = o.mul(x, o.const(node.attrs["beta"]))
    linear = o.op("gt", bx, o.const(node.attrs["threshold"]))
    return (o.where(linear, g, o.mul(g, o.op("sigmoid", bx))),)


def _mish(o: _Ops, node: Node, ins: Sequence[Node], g: Node):
    (x,) = ins
    t = o.op("tanh", o.op("softplus", x, beta=1.0, threshold=20.0))
    return (o.mul(g, o.add(t, o.mul(x, o.op("sigmoid", x), o.sub(o.one(), o.mul(t, t))))),)


def _hardswish(o: _Ops, node: Node, ins: Sequence[Node], g: Node):
    (x,) = ins
    middle = o.mul(g, o.add(o.div(x, o.const(3)), o.const(0.5)))
    # torch: 0 up to -3 included, x/3 + 1/2 below 3, 1 from 3 on.
    return (o.where(o.op("le", x, o.const(-3)), o.zero(), o.where(o.op("lt", x, o.const(3)), middle, g)),)


def _hardsigmoid(o: _Ops, node: Node, ins: Sequence[Node], g: Node):
    (x,) = ins
    inside = o.op("logical_and", o.op("gt", x, o.const(-3)), o.op("lt", x, o.const(3)))
    return (o.where(inside, o.mul(g, o.const(1 / 6)), o.zero()),)


RULES: dict[str, Rule] = {
    "add": lambda o, n, i, g: (g, g),
    "sub": lambda o, n, i, g: (g, o.neg(g)),
    "mul": lambda o, n, i, g: (o.mul(g, i[1]), o.mul(g, i[0])),
    "div": lambda o, n, i, g: (o.div(g, i[1]), o.neg(o.div(o.mul(g, n), i[1]))),
    "pow": _pow,
    "neg": lambda o, n, i, g: (o.neg(g),),
    "abs": lambda o, n, i, g: (o.mul(g, _sign(o, i[0])),),
    "reciprocal": lambda o, n, i, g: (o.neg(o.mul(g, n, n)),),
    "minimum": _extremum("lt"),
    "maximum": _extremum("gt"),
    "clamp_min": _clamp_bound("ge", "lt"),
    "clamp_max": _clamp_bound("le", "gt"),
    "hardtanh": _hardtanh,
    "sqrt": lambda o, n, i, g: (o.div(g, o.mul(o.const(2), n)),),
    "rsqrt": lambda o, n, i, g: (o.mul(o.const(-0.5), g, n, n, n),),
    "exp": lambda o, n, i, g: (o.mul(g, n),),
    "exp2": lambda o, n, i, g: (o.mul(g, n, o.const(math.log(2))),),
    "expm1": lambda o, n, i, g: (o.mul(g, o.add(n, o.one())),),
    "log": lambda o, n, i, g: (o.div(g, i[0]),),
    "log2": lambda o, n, i, g: (o.div(g, o.mul(i[0], o.const(math.log(2)))),),
    "log1p": lambda o, n, i, g: (o.div(g, o.add(i[0], o.one())),),
    "sin": lambda o, n, i, g: (o.mul(g, o.op("cos", i[0])),),
    "cos": lambda o, n, i, g: (o.neg(o.mul(g, o.op("sin", i[0]))),),
    "tanh": lambda o, n, i, g: (o.mul(g, o.sub(o.one(), o.mul(n, n))),),
    "erf": lambda o, n, i, g: (o.mul(g, o.const(2 / math.sqrt(math.pi)),
                                     o.op("exp", o.neg(o.mul(i[0], i[0])))),),
    "sigmoid": lambda o, n, i, g: (o.mul(g, n, o.sub(o.one(), n)),),
    # torch's threshold_backward: zero where the output is <= 0, so a NaN passes the gradient on.
    "relu": lambda o, n, i, g: (o.where(o.op("le", n, o.zero()), o.zero(), g),),
    "leaky_relu": lambda o, n, i, g: (o.where(o.op("gt", i[0], o.zero()), g,
                                              o.mul(g, o.const(n.attrs["negative_slope"]))),),
    "elu": lambda o, n, i, g: (o.where(o.op("gt", i[0], o.zero()), g,
                                       o.mul(g, o.const(n.attrs["alpha"]), o.op("exp", i[0]))),),
    "gelu": _gelu,
    "gelu_tanh": _gelu_tanh,
    "silu": _silu,
    "softplus": _softplus,
    "mish": _mish,
    "hardswish": _hardswish,
    "hardsigmoid": _hardsigmoid,
    "where": lambda o, n, i, g: (None, o.where(i[0], g, o.zero()), o.where(i[0], o.zero(), g)),
}
#: Ops no gradient flows through: those whose result is a mask (comparisons, logical ops), detach,
#: and the steps to an integer value (torch's gradient of floor, ceil, trunc and round is zero
#: everywhere).
NO_GRADIENT = frozenset(name for name, op in ELEMENTWISE.items() if op.boolean) | {
    "detach", "floor", "ceil", "trunc", "round"}


# ---- the pass ---------------------------------------------------------------------------------------
def backward(graph: Graph, *, simplify: bool = True) -> Backward:
    """The backward graph of ``graph`` (a traced epilogue, see :func:`evtc.trace`): see the module
    docstring. With ``simplify``, the simplifying passes (folding, CSE, dead code) run on it."""
    builder = GraphBuilder(graph.batched)
    o = _Ops(builder)
    new: dict[int, Node] = {}
    # The forward, recomputed; reductions keep their reduced dims (size 1) so that their
    # gradients broadcast back over the tile.
    for node in graph.nodes:
        if node.op == "store":
            continue
        ins = tuple(new[i.id] for i in node.inputs)
        if node.op == "reduce" and not node.attrs["keepdim"]:
            _check_squeezed_use(graph, node)
            attrs = {**node.attrs, "keepdim": True}
            copy = builder.add("reduce", ins, attrs, loc=node.loc, dtype=node.dtype,
                               shape=reduced_shape(ins[0].shape, node.attrs["axis"], True))
        else:
            copy = builder.add(node.op, ins, node.attrs, loc=node.loc, dtype=node.dtype,
                               shape=_kept_shape(node, ins))
        new[node.id] = copy

    grads: dict[int, Node] = {}
    operands = dict(graph.operands)
    output_grads: dict[str, str] = {}
    for store in graph.stores:
        name = store.attrs["name"]
        value = store.inputs[0]
        if not value.dtype.is_floating_point:
            continue
        grad_name = _fresh(GRAD + name, operands)
        shape = new[value.id].shape
        operands[grad_name] = Operand(grad_name, _kind(shape), F32, shape=shape,
                                      batched=graph.batched and L in _symbols(shape))
        load = builder.add("load", (), {"name": grad_name, "kind": operands[grad_name].kind,
                                        "batched": operands[grad_name].batched, "shape": shape},
                           dtype=F32, shape=shape)
        output_grads[name] = grad_name
        _accumulate(o, grads, new[value.id], load, None, value)

    # Gradients of the halves of a value (``x.chunk(2, -1)``), joined into one for the value when
    # the reverse walk reaches it (every half comes after it in the forward order).
    halves: dict[int, dict[int, Node]] = {}
    for node in reversed(graph.nodes):
        if node.id in halves:
            parts = halves.pop(node.id)
            copy = new[node.id]
            half_like = next(new[h.id] for h in graph.nodes if h.op == "half" and h.inputs[0] is node)
            zeros = _expand(o, o.zero(), half_like)
            whole = o.b.add("join", tuple(_expand(o, parts.get(i, zeros), half_like) for i in (0, 1)), {},
                            dtype=F32, shape=copy.shape)
            _accumulate(o, grads, copy, whole, None, node)
        g = grads.get(node.id)
        if g is None or node.op in ("store", "load", "arg", "literal", "acc"):
            continue
        copy = new[node.id]
        ins = [new[i.id] for i in node.inputs]
        if node.op == "half":
            pending = halves.setdefault(node.inputs[0].id, {})
            index = node.attrs["index"]
            pending[index] = g if index not in pending else o.add(pending[index], g)
            continue
        if node.op == "cast":
            input_grads = (_cast_rule(o, node, ins, g),)
        elif node.op == "reduce":
            input_grads = (_reduce_rule(o, node, copy, ins, g),)
        elif node.op in NO_GRADIENT:
            continue
        elif node.op in RULES:
            input_grads = RULES[node.op](o, copy, ins, g)
        else:
            raise BackwardError(f"no derivative rule for op {node.op!r}")
        for source, dx in zip(node.inputs, input_grads, strict=True):
            if dx is not None and source.dtype.is_floating_point:
                _accumulate(o, grads, new[source.id], dx, copy, source)

    input_grads: dict[str, str] = {}
    stores: list[Node] = []
    for acc in (n for n in graph.nodes if n.op == "acc"):
        if acc.attrs.get("half") is not None:
            raise BackwardError("a gated graph already split into halves: derive the backward graph of "
                                "the traced epilogue (evtc.trace), before the kernel's split")
        g = grads.get(acc.id)
        if g is not None:
            stores.append(_store(builder, GRAD + graph.acc_name, _expand(o, g, new[acc.id])))
            input_grads[graph.acc_name] = GRAD + graph.acc_name
    for node in graph.nodes:
        if node.op != "load" or node.attrs["name"] not in graph.operands:
            continue
        operand = graph.operands[node.attrs["name"]]
        g = grads.get(node.id)
        if g is None or not operand.dtype.is_floating_point:
            continue
        # Accumulated at the operand's shape already; one that never varied along a dim of the
        # operand is broadcast to it.
        reduced = _expand(o, g, new[node.id])
        grad_name = _fresh(GRAD + operand.name, operands)
        stores.append(_store(builder, grad_name, reduced))
        input_grads[operand.name] = grad_name

    names = [s.attrs["name"] for s in stores]
    back = Graph(name=f"{graph.name}_backward", nodes=builder.nodes, operands=operands,
                 outputs=OutputTree("dict", names, keys=list(input_grads)), batched=graph.batched,
                 acc_name=graph.acc_name, ab_dtype=graph.ab_dtype, gated=graph.gated)
    if simplify:
        from .passes.pipeline import simplify as simplify_graph

        back = simplify_graph(back)
    grad_shapes = {g: operands[g].shape for g in output_grads.values()}
    return Backward(back, output_grads, input_grads, grad_shapes)


def _check_squeezed_use(graph: Graph, node: Node) -> None:
    """A reduction without keepdim is recomputed with it: fine where its users are stores and
    values that broadcast the same either way (other keepdim-free reductions of the same axis and
    scalars)."""
    users = graph.users()
    for user in users[node.id]:
        if user.op == "store":
            continue
        for other in user.inputs:
            if other is node or all(sympy.sympify(d) == 1 for d in other.shape) \
                    and len(other.shape) <= len(node.shape) + 1:
                continue  # a scalar, or a one-element value such as a (1,) operand
            if other.op == "reduce" and other.attrs["axis"] == node.attrs["axis"] \
                    and not other.attrs["keepdim"]:
                continue
            if other.shape == node.shape and other.op != "load":
                continue
            raise BackwardError(f"{user.loc or ''}: the result of a reduction without keepdim is combined "
                                "with a value of another shape; use keepdim=True for a backward graph")


def _kept_shape(node: Node, ins: tuple[Node, ...]) -> Shape:
    """The shape of a recomputed node whose inputs may now keep reduced dims."""
    if node.op in ("load", "acc", "arg", "literal"):
        return node.shape
    if node.op == "reduce":
        return reduced_shape(ins[0].shape, node.attrs["axis"], node.attrs["keepdim"])
    if node.op in ("cast", "half"):
        return ins[0].shape if node.op == "cast" else node.shape
    shape = broadcast([i.shape for i in ins])
    return node.shape if shape is None else shape


def _cast_rule(o: _Ops, node: Node, ins: Sequence[Node], g: Node) -> Node:
    # Every cast passes the gradient through, as torch's does (a float8 cast that saturates too).
    return g


def _reduce_rule(o: _Ops, node: Node, copy: Node, ins: Sequence[Node], g: Node) -> Node:
    """Sum: the gradient broadcast back over what was reduced. Max / min: to the elements equal to
    the result, shared evenly among ties (as torch.amax)."""
    if node.attrs["reduce"] == "sum":
        return g
    (x,) = ins
    hit = o.op("eq", x, copy)
    ones = o.where(hit, o.one(), o.zero())
    count = o.b.add("reduce", (ones,), {"reduce": "sum", "axis": node.attrs["axis"], "keepdim": True},
                    dtype=F32, shape=copy.shape)
    return o.where(hit, o.div(g, count), o.zero())


def _accumulate(o: _Ops, grads: dict[int, Node], target: Node, dx: Node, user: Node | None,
                source: Node) -> None:
    """Add ``dx``, the gradient that ``user`` (the recomputed node, or None for a store) passes to
    ``source``, to the gradient of ``source`` (recomputed as ``target``), summed down to
    ``target``'s shape where ``user`` broadcast it. A ``dx`` that does not vary along a dim of
    ``user`` still stands for every element along it: it is broadcast first where that dim is then
    summed away."""
    if user is not None:
        missing = _symbols(user.shape) - _symbols(dx.shape)
        if missing - _symbols(target.shape):
            dx = _expand(o, dx, user)
    dx = _sum_to(o, dx, target.shape)
    grads[source.id] = dx if source.id not in grads else o.add(grads[source.id], dx)


def _symbols(shape: Shape) -> set:
    return {s for d in shape for s in sympy.sympify(d).free_symbols}


def _sum_to(o: _Ops, g: Node, shape: Shape) -> Node:
    """``g`` summed over the dims along which a value of ``shape`` was broadcast (torch's
    ``sum_to_size``; dims along which ``g`` does not vary stay, and broadcast later). A kernel
    reduction axis where one fits (row vectors: over M; column vectors: over N; scalars: over
    everything), else the interpreter's ``to_shape``."""
    rank, target_rank = len(g.shape), len(shape)
    result: list = []
    for i, d in enumerate(g.shape):
        j = i - (rank - target_rank)
        if j < 0:
            continue  # a leading dim the target does not have: summed away
        result.append(ONE if (d != ONE and shape[j] == ONE) else d)
    result_shape = tuple(result)
    if result_shape == tuple(g.shape):
        return g
    axis = _standard_axis(g.shape, result_shape)
    attrs = ({"reduce": "sum", "axis": axis[0], "keepdim": axis[1]} if axis else
             {"reduce": "sum", "axis": "to_shape", "keepdim": True, "to_shape": result_shape})
    return o.b.add("reduce", (g,), attrs, dtype=F32, shape=result_shape)


def _standard_axis(source: Shape, target: Shape) -> tuple[str, bool] | None:
    """The reduction axis (and keepdim) of a kernel epilogue that takes a full-tile value of
    ``source`` shape to ``target`` shape, where there is one."""
    if len(source) < 2 or not {M, N} <= _symbols(source[-2:]):
        return None
    for axis in ("row", "col", "batch", "all"):
        for keepdim in (False, True):
            if tuple(reduced_shape(source, axis, keepdim)) == tuple(target):
                return axis, keepdim
    return None


def _expand(o: _Ops, g: Node, like: Node) -> Node:
    """``g`` broadcast to ``like``'s shape (where(True, g, like) has the broadcast shape)."""
    if tuple(g.shape) == tuple(like.shape):
        return g
    true = o.op("eq", o.zero(), o.zero())
    return o.where(true, g, like)


def _store(builder: GraphBuilder, name: str, value: Node) -> Node:
    return builder.add("store", (value,), {"name": name}, dtype=F32, shape=value.shape)


def _kind(shape: Shape) -> str:
    varying = _symbols(shape)
    if {M, N} <= varying:
        return "tile"
    if N in varying:
        return "row"
    if M in varying:
        return "col"
    return "scalar"


def _fresh(name: str, taken: dict) -> str:
    out, i = name, 1
    while out in taken:
        i += 1
        out = f"{name}{i}"
    return out




# ---- what to save ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SavePlan:
    """What the forward saves for the backward, and the graphs that use it.

    ``saved`` is None when the backward needs no value of the forward that depends on the
    accumulator (an epilogue linear in acc: its dZ is a function of dY and the operands only);
    ``backward`` is then the plain backward graph. Otherwise ``saved`` names one more output of
    ``forward`` (float32, shaped like the tile), and ``backward`` takes it as an operand of that name
    instead of the accumulator: recomputing the accumulator would cost the backward a whole GEMM,
    where the saved tile costs one write and one read of M x N values.
    """

    forward: Graph
    backward: Graph
    saved: str | None


def plan_saves(graph: Graph, back: Backward, *, name: str = "saved") -> SavePlan:
    """Choose what ``graph``'s forward saves for its backward ``back`` (see :class:`SavePlan`).

    The value saved is the latest one through which every use of the accumulator by the backward
    passes (a dominator of those uses): the pre-activation of ``act(acc * s + bias)``, the input of
    the halves of SwiGLU, the accumulator itself when two unrelated values of it are needed. The
    backward then recomputes only the cheap elementwise steps from it to what it needs.
    """
    bg = back.graph
    from_grads: set[int] = set()
    for node in bg.nodes:
        if (node.op == "load" and node.attrs["name"] in back.grad_shapes) or any(i.id in from_grads
                                                                               for i in node.inputs):
            from_grads.add(node.id)
    from_acc: set[int] = set()
    for node in bg.nodes:
        if node.id not in from_grads and (node.op == "acc" or any(i.id in from_acc for i in node.inputs)):
            from_acc.add(node.id)
    # Values of the forward that the backward's own computation (or an output) reads.
    needed = {i.id for n in bg.nodes if n.id in from_grads or n.op == "store" for i in n.inputs
              if i.id in from_acc}
    if not needed:
        return SavePlan(graph, bg, None)
    by_id = {n.id: n for n in bg.nodes}
    acc = next(n for n in bg.nodes if n.op == "acc")

    def reaches_needed_without(cut: int) -> bool:
        seen = {acc.id} if acc.id != cut else set()
        for node in bg.nodes:
            if node.id == cut or node.id in seen:
                continue
            if any(i.id in seen for i in node.inputs) and node.id in from_acc:
                seen.add(node.id)
        return bool(seen & needed)

    # Floating-point values only (a saved mask would be read back as float32).
    candidates = [n for n in bg.nodes if n.id in from_acc and n.op != "store" and n.dtype.is_floating_point]
    cut = next(n for n in reversed(candidates) if not reaches_needed_without(n.id))
    saved_name = _fresh(name, {**graph.operands, **bg.operands})
    backward_graph = _load_instead(bg, cut, saved_name)
    forward_graph = _store_also(graph, bg, by_id, cut, saved_name)
    return SavePlan(forward_graph, backward_graph, saved_name)


def _load_instead(bg: Graph, cut: Node, name: str) -> Graph:
    """``bg`` with ``cut`` read from an operand ``name`` (float32, its shape); dead code dropped."""
    from .passes.dce import eliminate_dead_code

    builder = GraphBuilder(bg.batched)
    mapping: dict[int, Node] = {}
    operand = Operand(name, _kind(cut.shape), F32, shape=cut.shape,
                      batched=bg.batched and L in _symbols(cut.shape))
    for node in bg.nodes:
        if node.id == cut.id:
            mapping[node.id] = builder.add("load", (), {"name": name, "kind": operand.kind,
                                                        "batched": operand.batched, "shape": cut.shape},
                                           dtype=F32, shape=cut.shape)
            continue
        ins = tuple(mapping[i.id] for i in node.inputs)
        mapping[node.id] = builder.add(node.op, ins, node.attrs, loc=node.loc, dtype=node.dtype,
                                       shape=node.shape)
    out = Graph(name=bg.name, nodes=builder.nodes, operands={**bg.operands, name: operand},
                outputs=bg.outputs, batched=bg.batched, acc_name=bg.acc_name, ab_dtype=bg.ab_dtype,
                gated=bg.gated)
    return eliminate_dead_code(out).graph


def _store_also(graph: Graph, bg: Graph, by_id: dict[int, Node], cut: Node, name: str) -> Graph:
    """``graph`` with one more output ``name``: ``cut``'s value (computed as the backward graph
    computes it from acc and the operands), in float32."""
    from .passes.pipeline import simplify

    builder = GraphBuilder(graph.batched)
    mapping: dict[int, Node] = {}
    stores = []
    for node in graph.nodes:
        if node.op == "store":
            stores.append(node)
            continue
        ins = tuple(mapping[i.id] for i in node.inputs)
        mapping[node.id] = builder.add(node.op, ins, node.attrs, loc=node.loc, dtype=node.dtype,
                                       shape=node.shape)
    # The cut's cone, from the backward graph: its acc and loads are the forward's own.
    forward_loads = {n.attrs["name"]: mapping[n.id] for n in graph.nodes if n.op == "load"}
    forward_acc = next((mapping[n.id] for n in graph.nodes if n.op == "acc"), None)
    cone: dict[int, Node] = {}
    for node in bg.nodes:
        if node.op == "acc":
            cone[node.id] = forward_acc if forward_acc is not None else builder.add("acc")
        elif node.op == "load" and node.attrs["name"] in forward_loads:
            cone[node.id] = forward_loads[node.attrs["name"]]
        elif all(i.id in cone for i in node.inputs):
            cone[node.id] = builder.add(node.op, tuple(cone[i.id] for i in node.inputs), node.attrs,
                                        loc=node.loc, dtype=node.dtype, shape=node.shape)
        if node.id == cut.id:
            break
    for node in stores:
        builder.add("store", (mapping[node.inputs[0].id],), node.attrs, loc=node.loc, dtype=node.dtype,
                    shape=node.shape)
    builder.add("store", (cone[cut.id],), {"name": name}, dtype=F32, shape=cut.shape)
    tree = graph.outputs
    if tree.kind == "dict":
        outputs = OutputTree("dict", [*tree.names, name], keys=[*(tree.keys or []), name])
    else:
        outputs = OutputTree("tuple", [*tree.names, name])
    out = Graph(name=graph.name, nodes=builder.nodes, operands=graph.operands, outputs=outputs,
                batched=graph.batched, acc_name=graph.acc_name, ab_dtype=graph.ab_dtype, gated=graph.gated)
    return simplify(out)


__all__ = ["GRAD", "NO_GRADIENT", "RULES", "Backward", "BackwardError", "SavePlan", "backward", "plan_saves"]
