"""The code generator: an optimized epilogue graph in, the Python source of its visitor out.

The source is a module holding one :class:`~evtc.sm90.fused.FusedVisitor` subclass:

* ``inputs`` / ``outputs``: the operands, one constructor per operand (its kind, dtype, layout);
* ``uniform``: the nodes of the ``uniform`` stage (scalars and ops on scalars), run once per tile;
* ``fragment``: the nodes of the ``tile`` stage, run on this thread's float32 fragment of every
  subtile, one statement per node, named after the node (``v5`` is ``%5`` of the printed graph),
  under a comment with the user's line;
* ``finish_rows`` / ``finish_columns``: the ``final`` stage (what follows the reductions), run in
  the kernel once per row or column by the tile that completes it (:class:`FinishPlan`), when every
  output of that stage can be finished there; otherwise the host finishes them from the partials.

It is meant to be read: what a careful person would write by hand, nothing else. Casts are
statements only where they round: widening a loaded value to float32 is done by the load, and a
cast whose only users are stores of its dtype is left to the store.
"""

from __future__ import annotations

import keyword
import math
import os
import re
from dataclasses import dataclass, field

import sympy
import torch

from evtc.errors import CompileError
from evtc.ir.dtypes import MASK_STORAGE, as_float32_literal, short_name
from evtc.ir.graph import Graph, Node
from evtc.ir.ops import ELEMENTWISE
from evtc.ir.printer import format_literal, node_names
from evtc.ir.shapes import ONE, format_shape
from evtc.plan.operand_kinds import KINDS

#: Output dtypes the kernel's own D store takes (the first such output becomes D).
KERNEL_D_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_DSL_DTYPE = {
    torch.float32: "Float32",
    torch.float16: "Float16",
    torch.bfloat16: "BFloat16",
    torch.float8_e4m3fn: "Float8E4M3FN",
    torch.float8_e5m2: "Float8E5M2",
}
_DTYPE_NAME = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
}


def kernel_dtype_name(dtype: torch.dtype) -> str:
    """The dtype the kernel stores an output of ``dtype`` as (a bool output, a mask: the bytes 0
    and 1 through float8 stores, evtc.ir.dtypes.MASK_STORAGE)."""
    return _DTYPE_NAME[MASK_STORAGE if dtype == torch.bool else dtype]


_CALLED = {  # ops emitted as calls of evtc.sm90.dsl_ops (imported as `op`)
    "pow", "abs", "reciprocal", "minimum", "maximum", "clamp_min", "clamp_max", "hardtanh", "sqrt",
    "rsqrt", "exp", "exp2", "expm1", "log", "log2", "log1p", "sin", "cos", "tanh", "erf", "floor", "ceil",
    "trunc", "round", "detach", "sigmoid", "relu", "leaky_relu", "elu", "gelu",
    "gelu_tanh", "silu", "softplus", "mish", "hardswish", "hardsigmoid", "logical_not", "where",
}
_RESERVED = {"self", "op", "cute", "cutlass", "Float32", "Float16", "BFloat16", "Float8E4M3FN",
             "Float8E5M2", "FusedVisitor", "ArgScalar", "ColVector", "DeviceScalar", "RowVector",
             "TileLoad", "TileStore", "ReductionOverN", "ReductionOverM", "KernelFinish"}
_LOGICAL = {"logical_and", "logical_or", "logical_not"}


@dataclass
class InputPlan:
    """One input of the visitor: ``kind`` is tile / row / col / scalar / arg / literal."""

    name: str  # the epilogue's parameter name (or the literal's generated name)
    ident: str  # the Python identifier in the generated source
    kind: str
    dtype: torch.dtype | None = None
    batched: bool = False
    expr: sympy.Expr | None = None  # literals of L, M, N: computed on the host per call


@dataclass
class OutputPlan:
    name: str
    dtype: torch.dtype
    node: Node


@dataclass
class ReductionPlan:
    """A reduction the kernel computes partials of (per row of each tile, or per column of each
    warp's rows for ``axis == "col"``); the kernel finishes it (:class:`FinishPlan`) or the host
    does."""

    ident: str
    node: Node  # the reduce node

    @property
    def op(self) -> str:
        return self.node.attrs["reduce"]

    @property
    def axis(self) -> str:
        """row / col / batch / all, as in the IR."""
        return self.node.attrs["axis"]

    @property
    def operand(self) -> str:
        """The kernel operand class that computes the partials."""
        return "ReductionOverM" if self.axis == "col" else "ReductionOverN"


#: Dtypes of outputs the kernel's finish stores (one value per row or column); a bool one as the
#: bytes 0 and 1, as the tile outputs store it (see _DTYPE_NAME).
FINISH_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.bool)
_FINISH_METHOD = {"row": "finish_rows", "col": "finish_columns", "batch": "finish_batches",
                  "all": "finish_all"}
#: What one call of each finish method computes, for its docstring.
_FINISH_UNIT = {"row": "row", "col": "column", "batch": "batch", "all": "launch"}
_AXIS_TEXT = {"batch": "per batch", "all": "over everything"}


@dataclass
class FinishPlan:
    """The outputs of one reduction axis (``row``: one value per row, ``col``: per column) that the
    kernel finishes itself: the tile that completes a block of rows (columns) combines every tile's
    partials in a fixed order and runs ``method`` on each row's (column's) totals."""

    axis: str
    method: str
    reductions: list[str]  # the idents of this axis's reductions, as ``method`` takes them
    params: list[str] = field(default_factory=list)  # per-tile values it reads (scalars, args)
    outputs: list[str] = field(default_factory=list)  # output names, in the order it returns them


@dataclass
class EmittedEpilogue:
    source: str
    class_name: str
    inputs: list[InputPlan]
    outputs: list[OutputPlan]  # in kernel order: the kernel's D first
    #: Output names in the order the epilogue returns them.
    output_names: list[str] = field(default_factory=list)
    #: Reductions, in graph order: the kernel writes their per-tile partials.
    reductions: list[ReductionPlan] = field(default_factory=list)
    #: Per axis, the outputs the kernel finishes; empty when the host finishes the reductions.
    finishes: list[FinishPlan] = field(default_factory=list)


def _identifier(name: str, taken: set[str]) -> str:
    ident = re.sub(r"\W", "_", name)
    if not ident or ident[0].isdigit():
        ident = "_" + ident
    if keyword.iskeyword(ident) or ident in _RESERVED or re.fullmatch(r"v\d+", ident):
        ident += "_"
    while ident in taken:
        ident += "_"
    taken.add(ident)
    return ident


def _class_name(name: str) -> str:
    parts = re.split(r"\W|_", name)
    camel = "".join(p[:1].upper() + p[1:] for p in parts if p)
    if not camel or camel[0].isdigit():
        camel = "E" + camel
    return camel + "Epilogue"


def _float_text(value: float) -> str:
    if math.isnan(value):
        return 'float("nan")'
    value = as_float32_literal(value)
    if math.isinf(value):
        return 'float("inf")' if value > 0 else '-float("inf")'
    return repr(float(value))


def _where(node: Node) -> str | None:
    if node.loc is None or node.attrs.get("implicit"):
        return None
    return f"{os.path.basename(node.loc.filename)}:{node.loc.lineno}  {node.loc.text.strip()}"


def on_host(node: Node) -> bool:
    """True for values computed on the host after the kernel, from the reductions' partials:
    reductions, the ``final`` stage after them, and stores of either."""
    if node.op == "store":
        node = node.inputs[0]
    return node.op == "reduce" or node.stage in ("reduce", "final")


class _Emitter:
    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.users = graph.users()
        self.printed = node_names(graph)
        self.taken: set[str] = set()
        self.names: dict[int, str] = {}  # node id -> expression text (identifier or literal)
        self.bool_ids: set[int] = set()
        self.inputs: list[InputPlan] = []
        self.uniform_lines: list[str] = []
        self.fragment_lines: list[str] = []
        self.finish_lines: dict[str, list[str]] = {axis: [] for axis in _FINISH_METHOD}
        #: Nodes emitted into a finish method, by id: the axis whose method computes them.
        self.finish_axis: dict[int, str] = {}
        #: Each finish method's statements without their source comments, by axis.
        self.finish_bodies: dict[str, str] = {}
        self.uniform_defined: list[str] = []
        #: The uniform values the fragment reads (set once the fragment is emitted: a value can
        #: reach it through casts that emit nothing, so its users' stages do not tell).
        self.uniform_results: list[str] = []
        self.reductions: list[ReductionPlan] = []
        self._last_where: dict[str, str | None] = dict.fromkeys(["uniform", "tile", *_FINISH_METHOD])

    # ---- names -----------------------------------------------------------------------------------
    def acc_params(self) -> list[str]:
        """The accumulator parameters of ``fragment``: acc, or its gate and up halves."""
        base = _identifier(self.graph.acc_name, set())
        return [f"{base}_gate", f"{base}_up"] if self.graph.gated else [base]

    def value_name(self, node: Node) -> str:
        printed = self.printed[node.id]
        ident = "v" + printed.lstrip("%")  # operands never take these names (see _identifier)
        while ident in self.taken:
            ident += "_"
        self.taken.add(ident)
        return ident

    # ---- statements ------------------------------------------------------------------------------
    def stage_of(self, node: Node) -> str:
        """Where a node's statement goes: ``uniform``, ``tile`` or a finish method's axis."""
        return self.finish_axis.get(node.id) or node.stage or "tile"

    def emit(self, stage: str, node: Node, target: str, expr: str) -> None:
        if stage in self.finish_lines:
            lines = self.finish_lines[stage]
        else:
            lines = self.uniform_lines if stage == "uniform" else self.fragment_lines
        where = _where(node)
        if where is not None and where != self._last_where[stage]:
            if lines:
                lines.append("")
            lines.append(f"# {where}")
        if where is not None:
            self._last_where[stage] = where
        lines.append(f"{target} = {expr}")

    def arg(self, node: Node, want_float: bool = True) -> str:
        text = self.names[node.id]
        if want_float and node.id in self.bool_ids:
            return f"op.mask_to_float({text})"
        return text

    def build(self) -> tuple[list[OutputPlan], list[str]]:
        graph = self.graph
        for ident in self.acc_params():
            self.taken.add(ident)
        for node in graph.nodes:
            op = node.op
            if on_host(node):
                if op == "reduce":
                    ident = _identifier(f"r{len(self.reductions)}", self.taken)
                    self.reductions.append(ReductionPlan(ident, node))
                    self.names[node.id] = ident  # what a finish method calls its total
                continue
            if op == "acc":
                self.names[node.id] = self.acc_params()[node.attrs.get("half", 0)]
            elif op == "load":
                operand = graph.operands[node.attrs["name"]]
                ident = _identifier(operand.name, self.taken)
                self.names[node.id] = ident
                self.inputs.append(InputPlan(operand.name, ident, operand.kind, operand.dtype,
                                             operand.batched))
            elif op == "arg":
                ident = _identifier(node.attrs["name"], self.taken)
                self.names[node.id] = ident
                self.inputs.append(InputPlan(node.attrs["name"], ident, "arg"))
            elif op == "literal":
                value = sympy.sympify(node.attrs["value"])
                if value.is_Number:
                    self.names[node.id] = _float_text(float(value))
                else:
                    ident = _identifier(f"size_{len(self.inputs)}", self.taken)
                    self.names[node.id] = ident
                    self.inputs.append(InputPlan(format_literal(value), ident, "literal", expr=value))
            elif op == "store":
                self.store(self.stage_of(node), node)
            elif op == "cast":
                self.cast(node)
            elif op in ELEMENTWISE:
                self.elementwise(node)
            else:  # pragma: no cover - validate() admits nothing else
                raise CompileError(f"cannot emit node {op}", node.loc)
        outputs = [OutputPlan(s.attrs["name"], s.dtype, s) for s in graph.stores if not on_host(s)]
        by_name = {o.name: o for o in outputs}
        ordered = [by_name[n] for n in graph.outputs.names if n in by_name]
        # The kernel's own D store takes the first 16- or 32-bit output (stmatrix for 16-bit), else
        # the first output (a float8 D, stored by rows). No tile output at all (only reductions):
        # the kernel stores no D.
        if not ordered:
            return [], list(graph.outputs.names)
        first = next((i for i, o in enumerate(ordered) if o.dtype in KERNEL_D_DTYPES), 0)
        kernel_order = [ordered[first]] + ordered[:first] + ordered[first + 1:]
        return kernel_order, list(graph.outputs.names)

    def plan_finishes(self) -> list[FinishPlan]:
        """Emit the ``final`` stage into finish methods, one per reduction axis, and return their
        plans; or return [] (the host finishes) unless every output computed from the reductions
        can be finished in the kernel: one reduction axis per output, elementwise ops on the
        reductions and on per-tile values (scalars, arguments), a 16- or 32-bit float dtype, and a
        shape of one value per row (column) and batch, per batch, or one."""
        if not self.reductions or any(r.axis not in _FINISH_METHOD for r in self.reductions):
            return []
        graph = self.graph
        by_node = {r.node.id: r for r in self.reductions}
        finals: dict[int, str] = {}
        outputs: dict[str, list[str]] = {axis: [] for axis in _FINISH_METHOD}
        for store in graph.stores:
            if not on_host(store):
                continue
            cone: set[int] = set()
            axes = self._finish_cone(store.inputs[0], by_node, cone)
            if axes is None or len(axes) != 1 or store.dtype not in FINISH_DTYPES:
                return []
            axis = axes.pop()
            want = ("L",) if graph.batched and axis != "all" else ()
            want += {"row": ("M",), "col": ("N",)}.get(axis, ())
            if tuple(str(d) for d in store.shape if d != ONE) != want:
                return []
            finals.update(dict.fromkeys(cone, axis))
            outputs[axis].append(store.attrs["name"])
        for node in graph.nodes:  # in graph order: inputs before users
            if node.id in finals:
                self.finish_axis[node.id] = finals[node.id]
                if node.op == "cast":
                    self.cast(node)
                else:
                    self.elementwise(node)
        plans = []
        stores = {s.attrs["name"]: s for s in graph.stores}
        for axis, names in outputs.items():
            for name in names:
                self.finish_axis[stores[name].id] = axis
                self.store(axis, stores[name])
        for axis in _FINISH_METHOD:
            if not outputs[axis]:
                continue
            body = self.finish_bodies[axis] = "\n".join(x for x in self.finish_lines[axis]
                                                        if not x.startswith("#"))
            returned = {self.names[stores[n].inputs[0].id] for n in outputs[axis]}  # the values read
            used = [r.ident for r in self.reductions if r.axis == axis
                    and (r.ident in returned or _mentions(body, r.ident))]
            plans.append(FinishPlan(axis, _FINISH_METHOD[axis], used, [], outputs[axis]))
        return plans

    def _finish_cone(self, node: Node, by_node: dict, cone: set[int]) -> set[str] | None:
        """The reduction axes ``node`` is computed from, collecting its ``final`` nodes in ``cone``;
        None if something in it cannot run in a finish method."""
        axes: set[str] = set()
        stack = [node]
        seen: set[int] = set()
        while stack:
            n = stack.pop()
            if n.id in seen:
                continue
            seen.add(n.id)
            if n.id in by_node:
                axes.add(by_node[n.id].axis)
            elif on_host(n):
                if n.op != "cast" and n.op not in ELEMENTWISE:
                    return None
                cone.add(n.id)
                stack.extend(n.inputs)
            elif n.id not in self.names or not self._per_tile(n):
                return None
        return axes

    def _per_tile(self, node: Node) -> bool:
        """Whether a value the kernel computed is the same for the whole tile (then a finish method
        can read it): scalars, arguments, literals and what ``uniform`` computes from them."""
        if node.op == "load":
            return KINDS[self.graph.operands[node.attrs["name"]].kind].uniform
        return node.stage == "uniform"

    def cast(self, node: Node) -> None:
        src = node.inputs[0]
        stage = self.stage_of(node)
        if src.dtype == torch.bool:
            expr = f"op.mask_to_float({self.names[src.id]})"
            if node.dtype != torch.float32:
                expr = f"op.round_to({expr}, {_DSL_DTYPE[node.dtype]})"
            self.define(stage, node, expr)
            return
        if node.dtype == torch.float32:
            # Values are held in float32: widening rounds nothing (loads widen as they read).
            self.names[node.id] = self.names[src.id]
            return
        users = self.users[node.id]
        if users and all(u.op == "store" and u.dtype == node.dtype for u in users):
            # The store rounds to its dtype: no statement needed.
            self.names[node.id] = self.names[src.id]
            return
        self.define(stage, node, f"op.round_to({self.names[src.id]}, {_DSL_DTYPE[node.dtype]})")

    def elementwise(self, node: Node) -> None:
        definition = ELEMENTWISE[node.op]
        op = node.op
        if op in _LOGICAL:
            args = [self.arg(i, want_float=False) for i in node.inputs]
        elif op == "where":
            args = [self.arg(node.inputs[0], want_float=False)] + [self.arg(i) for i in node.inputs[1:]]
        else:
            args = [self.arg(i) for i in node.inputs]
        params = [f"{p}={_float_text(node.attrs[p])}" for p in definition.params]
        if op == "neg":
            expr = f"-{args[0]}"
        elif op == "logical_and":
            expr = f"{args[0]} & {args[1]}"
        elif op == "logical_or":
            expr = f"{args[0]} | {args[1]}"
        elif definition.infix is not None and op not in _CALLED:
            expr = f"{args[0]} {definition.infix} {args[1]}"
        else:
            expr = f"op.{op}({', '.join(args + params)})"
        self.define(self.stage_of(node), node, expr)
        if definition.boolean:
            self.bool_ids.add(node.id)

    def store(self, stage: str, node: Node) -> None:
        """What a store writes: its input's value, or for a mask (a bool output) the bytes 0 and 1
        as the float8 values whose encodings they are (see kernel_dtype_name)."""
        value = self.names[node.inputs[0].id]
        if node.dtype == torch.bool:
            self.define(stage, node, f"op.mask_to_byte({value})")
        else:
            self.names[node.id] = value

    def define(self, stage: str, node: Node, expr: str) -> None:
        ident = self.value_name(node)
        self.names[node.id] = ident
        self.emit(stage, node, ident, expr)
        if stage == "uniform":
            self.uniform_defined.append(ident)


def _docstring_safe(text: str) -> str:
    """``text`` as it reads inside a triple-quoted docstring: backslashes and triple quotes escaped."""
    return text.replace("\\", "\\\\").replace('"""', '\\"\\"\\"')


def _mentions(code: str, name: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(name)}\b", code) is not None


def operand_constructors(emitted: EmittedEpilogue, tile_majors: dict[str, str] | None = None,
                         batched: bool = False) -> tuple[list[str], list[str], list[str]]:
    """The visitor's operands as the generated source constructs them (classes of
    :mod:`evtc.sm90.operands`): inputs, outputs and reductions, one Python expression each.
    The shared-memory planner evaluates the same text (:func:`evtc.sm90.operands.construct`)."""
    inputs = []
    for p in emitted.inputs:
        kind = KINDS[p.kind]
        if kind.runtime_scalar:
            inputs.append(f"{kind.device_class}({p.ident!r})")
            continue
        dtype = _DTYPE_NAME[p.dtype]
        major = f", major={(tile_majors or {}).get(p.name, 'n')!r}" if p.kind == "tile" else ""
        inputs.append(f"{kind.device_class}({p.ident!r}, {dtype!r}{major}, batched={bool(p.batched)})")
    outputs = [f"TileStore({o.name!r}, {kernel_dtype_name(o.dtype)!r}, batched={batched})"
               for o in emitted.outputs]
    reductions = [f"{r.operand}({r.ident!r}, {r.op!r})" for r in emitted.reductions]
    return inputs, outputs, reductions


def finish_constructors(emitted: EmittedEpilogue) -> list[str]:
    """The visitor's finish operands (:class:`evtc.sm90.operands.KernelFinish`) as the generated
    source constructs them: one per reduction axis the kernel finishes."""
    return [f"KernelFinish({f.axis!r}, {f.method!r}, {tuple(f.reductions)!r}, {tuple(f.params)!r}, "
            f"{tuple(f.outputs)!r})" for f in emitted.finishes]


def _class_tuple(w, name: str, lines: list[str]) -> None:
    """A class attribute holding a tuple, one element per line."""
    if not lines:
        w(f"    {name} = ()")
        return
    w(f"    {name} = (")
    for line in lines:
        w("        " + line)
    w("    )")


def emit(graph: Graph, *, tile_majors: dict[str, str] | None = None, header: str = "") -> EmittedEpilogue:
    """Generate the visitor source for an optimized ``graph`` (``evtc.trace``'s result).

    ``tile_majors``: for each full-tile input, "n" (row-major, N contiguous) or "m" (column-major).
    """
    em = _Emitter(graph)
    outputs, output_names = em.build()
    finishes = em.plan_finishes()
    class_name = _class_name(graph.name)
    acc = ", ".join(em.acc_params())

    uniform_params = [p.ident for p in em.inputs if KINDS[p.kind].uniform]
    reduced = [em.names[r.node.inputs[0].id] for r in em.reductions]
    returned = {em.names[o.node.id] for o in outputs} | set(reduced)
    fragment_body = "\n".join(x for x in em.fragment_lines if not x.startswith("#"))
    uniform_body = "\n".join(x for x in em.uniform_lines if not x.startswith("#"))
    finish_bodies = em.finish_bodies
    em.uniform_results = [u for u in em.uniform_defined if u in returned or _mentions(fragment_body, u)
                          or any(_mentions(body, u) for body in finish_bodies.values())]
    fragment_params = [p.ident for p in em.inputs] + em.uniform_results
    fragment_params = [p for p in fragment_params if p in returned or _mentions(fragment_body, p)]
    uniform_params = [p for p in uniform_params if _mentions(uniform_body, p)]
    for f in finishes:
        f.params = [p for p in [i.ident for i in em.inputs if KINDS[i.kind].uniform] + em.uniform_results
                    if _mentions(finish_bodies[f.axis], p)]

    partial = EmittedEpilogue("", class_name, em.inputs, outputs, output_names, em.reductions, finishes)
    in_texts, out_texts, _ = operand_constructors(partial, tile_majors, graph.batched)
    in_lines = [f"{o}," for o in in_texts]
    out_lines = [f"{o}," for o in out_texts]

    lines: list[str] = []
    w = lines.append
    doc = [f"The epilogue {graph.name!r}, generated by evtc.{(' ' + header) if header else ''}", "",
           "This file is what runs: evtc.compile wrote it, imported it and compiled the kernel from it.",
           "The graph it was generated from:", ""]
    doc += ["    " + line for line in str(graph).splitlines()]
    # The graph quotes the user's source lines, which may hold backslashes or triple quotes.
    doc = [_docstring_safe(line) for line in doc]
    w('"""' + doc[0])
    lines.extend(doc[1:])
    w('"""')
    w("")
    w("from cutlass import BFloat16, Float8E4M3FN, Float8E5M2, Float16, Float32  # noqa: F401")
    w("")
    w("from evtc.sm90 import dsl_ops as op  # noqa: F401")
    w("from evtc.sm90.fused import FusedVisitor")
    w("from evtc.sm90.operands import (  # noqa: F401")
    w("    ArgScalar, ColVector, DeviceScalar, KernelFinish, ReductionOverM, ReductionOverN, RowVector,")
    w("    TileLoad, TileStore,")
    w(")")
    w("")
    w("")
    w(f"class {class_name}(FusedVisitor):")
    w(f"    name = {graph.name!r}")
    if graph.gated:
        w("    # Gated: each 128-wide accumulator tile holds a block of gate columns, then the matching")
        w("    # block of up columns; fragment gets both halves of a subtile and the output is half as wide.")
        w("    gated = True")
    w("    # Inputs in call order. Each owns its resources: TMA atom, shared memory, registers.")
    _class_tuple(w, "inputs", in_lines)
    if out_lines:
        w("    # Outputs: the first is the kernel's own D store; the others are extra TMA stores.")
    else:
        w("    # No full-tile output: the kernel stores no D, only the reductions' partials.")
    _class_tuple(w, "outputs", out_lines)
    if em.reductions:
        w("    # Reductions: partials per row or per column of each tile (fragment returns their inputs")
        if finishes:
            w("    # last); the tile that completes a block of rows or columns adds up every tile's partials")
            if any(f.axis in ("batch", "all") for f in finishes):
                w("    # in a fixed order, then the block that completes a batch (or the launch) adds up the")
                w("    # blocks' values in a fixed order, and the finish methods below run on the totals.")
            else:
                w("    # in a fixed order and runs the finish method below on each row's or column's totals.")
        else:
            w("    # last); the host reduces the partials and computes what follows them.")
        w("    reductions = (")
        for r in em.reductions:
            w(f"        {r.operand}({r.ident!r}, {r.op!r}),  # {_where(r.node) or r.axis}")
        w("    )")
    if finishes:
        w("    finishes = (")
        for text in finish_constructors(partial):
            w(f"        {text},")
        w("    )")
    w("")
    w(f"    def uniform(self{''.join(', ' + p for p in uniform_params)}):")
    w('        """Once per tile: the values that do not vary over it."""')
    for line in em.uniform_lines:
        w(("        " + line) if line else "")
    results = ", ".join(f"{r!r}: {r}" for r in em.uniform_results)
    w(f"        return {{{results}}}")
    w("")
    w(f"    def fragment(self, {acc}{''.join(', ' + p for p in fragment_params)}):")
    w('        """One subtile: this thread\'s float32 values in, one value per output out."""')
    for line in em.fragment_lines:
        w(("        " + line) if line else "")
    returned = [em.names[o.node.id] for o in outputs] + reduced  # noqa: F811
    comment = ", ".join([f"{o.name}: {short_name(o.dtype)}{format_shape(o.node.shape)}" for o in outputs]
                        + [f"{r.ident}: {r.op} per {'column' if r.axis == 'col' else 'row'}"
                           + ("" if r.axis in ("row", "col") else f" (then {_AXIS_TEXT[r.axis]})")
                           for r in em.reductions])
    if em.fragment_lines:
        w("")
    value = f"{returned[0]}," if len(returned) == 1 else ", ".join(returned)
    w(f"        return ({value})  # {comment}")
    stores = {st.attrs["name"]: st for st in graph.stores}
    for f in finishes:
        per = _FINISH_UNIT[f.axis]
        w("")
        w(f"    def {f.method}(self{''.join(', ' + p for p in f.reductions + f.params)}):")
        w(f'        """Once per {per}, in the kernel, after every tile\'s partials: the outputs')
        w(f'        computed from the {per}\'s reductions."""')
        for line in em.finish_lines[f.axis]:
            w(("        " + line) if line else "")
        results = [em.names[stores[n].id] for n in f.outputs]
        comment = ", ".join(f"{n}: {short_name(stores[n].dtype)}{format_shape(stores[n].shape)}"
                            for n in f.outputs)
        if em.finish_lines[f.axis]:
            w("")
        value = f"{results[0]}," if len(results) == 1 else ", ".join(results)
        w(f"        return ({value})  # {comment}")
    source = "\n".join(lines) + "\n"
    return EmittedEpilogue(source, class_name, em.inputs, outputs, output_names, em.reductions, finishes)


__all__ = ["EmittedEpilogue", "FinishPlan", "InputPlan", "OutputPlan", "emit", "finish_constructors"]
