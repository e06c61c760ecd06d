"""The kernel plan: everything a call of one compiled kernel needs, decided once at compile time.

:func:`plan_kernel` reads it off the optimized graph, the emitted visitor and the example layouts
(:class:`evtc.plan.signature.KernelSignature`). It is plain data: it is written into the cache entry's
manifest as JSON and read back by a process that loads the kernel without tracing, so nothing in it
(and nothing that reads it) needs sympy, the IR or the CuTe DSL.

Names follow the kernel's operand order (the visitor's inputs; a gated kernel's ``bias.gate`` and
``bias.up`` halves of a user's ``bias``). Outputs come in the kernel's order: the full-tile outputs it
stores (D first), then the host outputs finished from the reductions' partials
(:mod:`evtc.runtime.reductions`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from evtc.plan.tensor_spec import TensorSpec

#: The version of this format; a manifest of another one is rebuilt.
PLAN_FORMAT = 6


@dataclass(frozen=True)
class KernelInput:
    """One input of the kernel, in the visitor's order.

    ``kind``: ``tile`` (M x N), ``row_vector`` is spelled ``row`` (N values: one per column),
    ``col`` (M values: one per row), ``scalar`` (one element, or one per batch), ``arg`` (a runtime
    float), ``literal`` (a value computed from the problem size at each call: ``expr`` is a Python
    expression of ``L``, ``M`` and ``N``)."""

    name: str  # the kernel's name for it
    user: str  # the name the user passes (a gated half's source operand)
    label: str  # how messages name it ("bias (its up half)")
    kind: str
    ident: str  # its identifier in the generated source
    spec: TensorSpec | None = None
    view: Any = "arg"  # the modes the kernel views it with (see evtc.sm90.launch)
    batched: bool = False
    half: int | None = None  # a gated half: 0 (gate) or 1 (up) of ``user`` along its last dim
    expr: str | None = None


@dataclass(frozen=True)
class HostOutput:
    """An output finished on the host: its name, dims (``"L" "M" "N"`` or ``"1"``) and dtype."""

    name: str
    dims: tuple[str, ...]
    dtype: str


@dataclass(frozen=True)
class ReductionPartials:
    """A reduction whose per-tile partials the kernel writes to a float32 workspace: ``op`` (sum,
    max, min) ``axis`` (row: one value per row, col: per column, batch, all), ``node`` (the id of
    the reduce node, whose value it gives), ``dims`` of that value."""

    ident: str
    op: str
    axis: str
    node: int
    dims: tuple[str, ...]


@dataclass(frozen=True)
class FinishStep:
    """One node evaluated on the host after the reductions: ``op`` is an elementwise op of the IR,
    ``cast``, ``store``, ``arg`` or ``load`` (of the operand ``name``), ``literal`` (``expr``, as in
    :class:`KernelInput`)."""

    node: int
    op: str
    inputs: tuple[int, ...] = ()
    params: tuple[tuple[str, Any], ...] = ()
    dtype: str = "float32"
    name: str = ""
    expr: str | None = None


@dataclass(frozen=True)
class OutputStructure:
    """What the epilogue returns: one tensor, a tuple, a list or a dict of outputs (by output name)."""

    kind: str  # single | tuple | list | dict
    names: tuple[str, ...]
    keys: tuple[str, ...] | None = None

    def build(self, values: Mapping[str, Any]) -> Any:
        if self.kind == "single":
            return values[self.names[0]]
        if self.kind == "tuple":
            return tuple(values[n] for n in self.names)
        if self.kind == "list":
            return [values[n] for n in self.names]
        return {k: values[n] for k, n in zip(self.keys or (), self.names, strict=True)}

    def flatten(self, out: Any, is_tensor) -> dict[str, Any] | None:
        """``out`` (the structure the epilogue returns) by output name, or None if it is not one."""
        if self.kind == "single":
            return {self.names[0]: out} if is_tensor(out) else None
        if self.kind in ("tuple", "list"):
            if not isinstance(out, tuple | list) or len(out) != len(self.names):
                return None
            return dict(zip(self.names, out, strict=True))
        if not isinstance(out, Mapping) or set(out) != set(self.keys or ()):
            return None
        return {n: out[k] for k, n in zip(self.keys or (), self.names, strict=True)}

    def describe(self) -> str:
        if self.kind == "single":
            return "one tensor"
        if self.kind in ("tuple", "list"):
            return f"a {self.kind} of {len(self.names)} tensors"
        return f"a dict with keys {list(self.keys or ())}"


@dataclass(frozen=True)
class CallInterface:
    """What a call accepts besides the kernel's live operands, and how it may run.

    ``parameters``: the user's function's parameters after ``acc`` (for messages); ``unused``: those
    that the passes removed (accepted and ignored at call time, as calling the function would accept
    them); ``constants``: parameters the trace specialised on (bools, None, defaults left out of the
    examples), accepted when they have the compiled value; ``strict``: raise instead of taking the
    staged or torch path; ``torch_only``: why no SM90 kernel exists (every call takes the torch
    path), or None."""

    parameters: tuple[str, ...] = ()
    unused: frozenset[str] = frozenset()
    constants: tuple[tuple[str, Any], ...] = ()
    strict: bool = False
    torch_only: str | None = None
    #: The GEMM's N, where the function fixes it (``acc.split(14336, -1)``): calls of another N are
    #: refused, as torch's function would fail for them.
    fixed_n: int | None = None
    #: The dtypes (and 0-dim or not) a call may pass per operand where they change an output's
    #: dtype in torch (Graph.operand_variants); the call is refused for others.
    operand_variants: tuple[tuple[str, tuple[str, ...]], ...] = ()
    #: Runtime scalars with a Python default (``alpha=1.0``, given in the examples): a call that
    #: leaves one out gets the default, as calling the function would.
    defaults: tuple[tuple[str, Any], ...] = ()
    #: The inputs whose shape or rank the function reads (Graph.shape_reads): a call passes them in
    #: the compiled shapes, never as views of another (evtc.runtime.broadcasts).
    shape_reads: frozenset[str] = frozenset()

    def tag(self) -> str:
        """A digest of this interface: kernels that share compiled code but not the interface
        must not share a Kernel object (memory cache) or a custom operator."""
        import hashlib

        if self == CallInterface():
            return ""
        text = repr((self.parameters, sorted(self.unused), self.constants, self.strict, self.torch_only,
                     self.fixed_n, self.operand_variants) + ((self.defaults,) if self.defaults else ())
                    + ((sorted(self.shape_reads),) if self.shape_reads else ()))
        return hashlib.sha256(text.encode()).hexdigest()[:8]


@dataclass(frozen=True)
class KernelPlan:
    """One compiled kernel as its calls see it (see the module docstring)."""

    name: str
    gated: bool
    batched: bool
    d_major: str
    a: TensorSpec
    b: TensorSpec
    outputs: tuple[TensorSpec, ...]  # the full-tile outputs the kernel stores, D first
    workspaces: tuple[TensorSpec, ...]  # one float32 workspace per reduction
    inputs: tuple[KernelInput, ...]
    host_outputs: tuple[HostOutput, ...]
    reductions: tuple[ReductionPartials, ...]
    finish: tuple[FinishStep, ...]
    structure: OutputStructure
    interface: CallInterface
    #: Why a and b cannot run batched as given (a batch broadcast: the torch path), or None.
    broadcast_batch: str | None = None
    class_name: str = ""
    #: The reductions the kernel finishes itself: per axis (``row``, ``col``, ``batch``, ``all``), the
    #: host outputs it stores, in the order of its arguments. Empty when the host finishes them (``finish``).
    kernel_finish: tuple[tuple[str, tuple[str, ...]], ...] = ()
    #: Block-scaled float8 (evtc.ir.block_scales): the float32 scales of a (dims M or MB, KB)
    #: and of b (KB, NB); a's 1 x 128 ones M-contiguous (the kernel reads them by TMA), the others
    #: any strides; None without block scales.
    a_scales: TensorSpec | None = None
    b_scales: TensorSpec | None = None
    #: For each output and each reduction, in graph order: the inputs it reads ("acc" for
    #: ``a @ b``, else the operand's name). What decides which broadcasts keep torch's result
    #: (:mod:`evtc.runtime.broadcasts`).
    reads: tuple[tuple[str, ...], ...] = ()
    #: Full-tile outputs of a batched kernel that are the same in every batch (``C * 2`` of a
    #: shared (M, N) or (1, M, N) ``C``), with the rank torch gives them (2 or 3): the kernel stores
    #: them per batch like the others, and a call returns the first batch, of torch's shape.
    batch_free: tuple[tuple[str, int], ...] = ()
    #: Operands a call may not pass with more leading dims of 1 than compiled (a (1, N) bias for
    #: an (N,) example, (1,) for a 0-d scalar), and those it may not pass with fewer ((M, N) for an
    #: (L, M, N) example, 0-d for (1,)): those whose rank would show in an output's or a reduction's
    #: shape in torch (:func:`_rank_fixed`; ``acc.sum() * s`` with ``s`` of (1,) is torch's (1,),
    #: ``(acc * s).amax()`` is () either way).
    no_more_dims: tuple[str, ...] = ()
    no_fewer_dims: tuple[str, ...] = ()

    # ---- derived -----------------------------------------------------------------------------
    @property
    def a_scale_rows(self) -> int:
        """Rows of a per block scale: 1 (1 x 128 blocks) or 128; 0 without block scales."""
        if self.a_scales is None:
            return 0
        return 1 if "M" in self.a_scales.dims else 128

    @property
    def output_order(self) -> tuple[str, ...]:
        """Output names in kernel order: the full-tile outputs, then the host outputs."""
        return tuple(s.name for s in self.outputs) + tuple(h.name for h in self.host_outputs)

    @property
    def finish_args(self) -> tuple[TensorSpec, ...]:
        """The kernel's arguments for its own finish (:attr:`kernel_finish`): each finished output,
        flat (``R`` = L x M values per row, ``S`` = L x N per column, L per batch, 1 over
        everything), then the int32 counters
        (``Q``) that tell each block's last tile. Empty when the host finishes."""
        if not self.kernel_finish:
            return ()
        dtypes = {h.name: h.dtype for h in self.host_outputs}
        dims = {"row": "R", "col": "S", "batch": "L", "all": "1"}
        specs = [TensorSpec(name, dtypes[name], (dims[axis],), 0)
                 for axis, names in self.kernel_finish for name in names]
        return (*specs, TensorSpec("counters", "int32", ("Q",), 0))

    @property
    def operand_names(self) -> tuple[str, ...]:
        """The names the user passes for the kernel's live operands, in kernel order."""
        return tuple(dict.fromkeys(i.user for i in self.inputs if i.kind != "literal"))

    @property
    def epilogue_tiles(self) -> int:
        """Full tiles the epilogue moves besides D: tile operands read, extra outputs written
        (what :data:`evtc.plan.selector.HEAVY_EPILOGUE_TILES` counts)."""
        return sum(1 for i in self.inputs if i.kind == "tile") + max(0, len(self.outputs) - 1)

    @property
    def wide_operands(self) -> tuple[str, ...]:
        """A gated kernel's operands as wide as the GEMM (each call splits them into halves)."""
        return tuple(sorted({i.user for i in self.inputs if i.half is not None}))

    def kind_of(self, user_name: str) -> str:
        return next(i.kind for i in self.inputs if i.user == user_name)

    # ---- JSON ----------------------------------------------------------------------------------
    def to_json(self) -> str:
        """The plan as JSON; :meth:`from_json` reads it back (None when it is not one)."""
        return json.dumps({"format": PLAN_FORMAT, "plan": _encode(self)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> KernelPlan | None:
        try:
            data = json.loads(text)
            if data.get("format") != PLAN_FORMAT:
                return None
            return _decode_plan(data["plan"])
        except (ValueError, KeyError, TypeError, AttributeError):
            return None


def _encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, frozenset):
        return sorted(value)
    if isinstance(value, tuple | list):
        return [_encode(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"not plain data: {value!r}")


def _tuple(value: Any) -> Any:
    return tuple(_tuple(v) for v in value) if isinstance(value, list) else value


def _spec(d: dict | None) -> TensorSpec | None:
    if d is None:
        return None
    return TensorSpec(d["name"], d["dtype"], tuple(d["dims"]), d["contiguous"])


def _decode_plan(d: dict) -> KernelPlan:
    interface = d["interface"]
    return KernelPlan(
        name=d["name"], gated=d["gated"], batched=d["batched"], d_major=d["d_major"],
        a=_spec(d["a"]), b=_spec(d["b"]),
        outputs=tuple(_spec(s) for s in d["outputs"]),
        workspaces=tuple(_spec(s) for s in d["workspaces"]),
        inputs=tuple(KernelInput(**{**i, "spec": _spec(i["spec"]), "view": _tuple(i["view"])})
                     for i in d["inputs"]),
        host_outputs=tuple(HostOutput(h["name"], tuple(h["dims"]), h["dtype"]) for h in d["host_outputs"]),
        reductions=tuple(ReductionPartials(**{**r, "dims": tuple(r["dims"])}) for r in d["reductions"]),
        finish=tuple(FinishStep(**{**s, "inputs": tuple(s["inputs"]), "params": _tuple(s["params"])})
                     for s in d["finish"]),
        structure=OutputStructure(d["structure"]["kind"], tuple(d["structure"]["names"]),
                                  _tuple(d["structure"]["keys"])),
        interface=CallInterface(tuple(interface["parameters"]), frozenset(interface["unused"]),
                                _tuple(interface["constants"]), interface["strict"], interface["torch_only"],
                                interface.get("fixed_n"), _tuple(interface.get("operand_variants", [])),
                                _tuple(interface.get("defaults", [])),
                                frozenset(interface.get("shape_reads", []))),
        broadcast_batch=d["broadcast_batch"], class_name=d["class_name"],
        kernel_finish=_tuple(d["kernel_finish"]),
        a_scales=_spec(d.get("a_scales")), b_scales=_spec(d.get("b_scales")),
        reads=tuple(tuple(names) for names in d["reads"]),
        batch_free=tuple((name, rank) for name, rank in d.get("batch_free", ())),
        no_more_dims=tuple(d.get("no_more_dims", ())), no_fewer_dims=tuple(d.get("no_fewer_dims", ())),
    )


# ---- built from the graph, at compile time -----------------------------------------------------


def _dims(shape) -> tuple[str, ...]:
    from evtc.plan.signature import dims_of

    return dims_of(shape)


def _python_expr(expr) -> str:
    """A sympy expression of L, M, N as Python source (``math`` for functions)."""
    import sympy

    return sympy.pycode(sympy.sympify(expr), fully_qualified_modules=True)


def plan_kernel(graph, emitted, signature, interface: CallInterface) -> KernelPlan:
    """The plan of the kernel for ``graph`` (optimized, gated graphs split), its emitted visitor
    and the example layouts."""
    from evtc.codegen.emit import on_host

    inputs = []
    for p, spec, view in zip(emitted.inputs, signature.inputs, signature.views, strict=True):
        operand = graph.operands.get(p.name)
        half_of = operand.half_of if operand is not None else None
        user = half_of[0] if half_of else p.name
        label = f"{half_of[0]} (its {'gate' if half_of[1] == 0 else 'up'} half)" if half_of else p.name
        inputs.append(KernelInput(
            name=p.name, user=user, label=label, kind=p.kind, ident=p.ident, spec=spec,
            view=view, batched=bool(p.batched), half=half_of[1] if half_of else None,
            expr=_python_expr(p.expr) if p.kind == "literal" else None))
    kernel_outputs = {o.name for o in emitted.outputs}
    host_stores = [s for s in graph.stores if s.attrs["name"] not in kernel_outputs]
    reductions = tuple(ReductionPartials(r.ident, r.op, r.axis, r.node.id, _dims(r.node.shape))
                       for r in emitted.reductions)
    reduced = {r.node for r in reductions}
    finish = []
    for node in graph.nodes:
        if node.id in reduced:
            continue
        if node.op == "store":
            if on_host(node):
                finish.append(FinishStep(node.id, "store", (node.inputs[0].id,), (), _dtype(node.dtype),
                                         name=node.attrs["name"]))
            continue
        if node.stage not in ("uniform", "final"):
            continue
        finish.append(_finish_step(node))
    finish = _live(finish)
    tree = graph.outputs
    return KernelPlan(
        name=graph.name, gated=graph.gated, batched=signature.batched, d_major=signature.d_major,
        a=signature.a, b=signature.b, outputs=tuple(signature.outputs),
        workspaces=tuple(signature.workspaces),
        inputs=tuple(inputs),
        host_outputs=tuple(HostOutput(s.attrs["name"], _dims(s.shape), _dtype(s.dtype)) for s in host_stores),
        reductions=reductions, finish=tuple(finish),
        structure=OutputStructure(tree.kind, tuple(tree.names), tuple(tree.keys) if tree.keys else None),
        interface=interface, broadcast_batch=signature.broadcast_batch, class_name=emitted.class_name,
        kernel_finish=tuple((f.axis, tuple(f.outputs)) for f in emitted.finishes),
        a_scales=signature.a_scales, b_scales=signature.b_scales, reads=_reads(graph),
        batch_free=tuple((s.attrs["name"], len(s.shape)) for s in graph.stores if signature.batched
                         and s.attrs["name"] in kernel_outputs and "L" not in _dims(s.shape)),
        no_more_dims=_rank_fixed(graph, more=True), no_fewer_dims=_rank_fixed(graph, more=False),
    )


def _reads(graph) -> tuple[tuple[str, ...], ...]:
    """:attr:`KernelPlan.reads` of ``graph``."""
    reads: dict[int, frozenset[str]] = {}
    for node in graph:  # topological order: a node's inputs come before it
        if node.op == "acc":
            reads[node.id] = frozenset({"acc"})
        elif node.op == "load":
            reads[node.id] = frozenset({node.attrs["name"]})
        else:
            reads[node.id] = frozenset().union(*(reads[i.id] for i in node.inputs))
    return tuple(tuple(sorted(reads[node.id])) for node in graph if node.op in ("store", "reduce"))


def _rank_fixed(graph, more: bool) -> tuple[str, ...]:
    """:attr:`KernelPlan.no_more_dims` (``more``) or ``no_fewer_dims`` of ``graph``. In torch a
    value's shape is the broadcast of its inputs' shapes. Extra leading dims of 1 on an operand
    vanish in any full tile it meets (a full tile has the result's rank, which no view exceeds).
    Missing leading dims vanish only in a full tile that another input keeps full whatever the
    call passes: acc, or a full tile operand of an unbatched kernel (a batched one's may itself
    come without its batch dim). ``open_[n]``: the operands whose rank still shows in node n."""
    full = ("L", "M", "N") if graph.batched else ("M", "N")
    kept_full: dict[int, bool] = {}  # full whatever rank the call gives the operands
    open_: dict[int, frozenset[str]] = {}
    fixed: set[str] = set()
    for node in graph:
        is_full = _dims(node.shape) == full
        if node.op == "acc":
            kept_full[node.id], open_[node.id] = is_full, frozenset()
            continue
        if node.op == "load":
            kept_full[node.id] = is_full and not graph.batched
            open_[node.id] = frozenset({node.attrs["name"]})
            continue
        reaching = frozenset().union(*(open_[i.id] for i in node.inputs))
        kept_full[node.id] = is_full and any(kept_full[i.id] for i in node.inputs)
        if node.op in ("store", "reduce"):
            fixed |= reaching  # the value's shape, or the reduced one's, is torch's result's
            open_[node.id] = frozenset()
            continue
        absorbed = is_full if more else kept_full[node.id]
        open_[node.id] = frozenset() if absorbed else reaching
    return tuple(sorted(fixed))


def _live(steps: list[FinishStep]) -> list[FinishStep]:
    """The steps a host output depends on, in order: a per-call host finish runs nothing else
    (values the kernel already used, such as a scalar operand of the epilogue, are not finished)."""
    needed: set[int] = set()
    for step in reversed(steps):
        if step.op == "store" or step.node in needed:
            needed.update(step.inputs)
            needed.add(step.node)
    return [step for step in steps if step.node in needed]


def _dtype(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _finish_step(node) -> FinishStep:
    from evtc.ir.ops import ELEMENTWISE

    inputs = tuple(i.id for i in node.inputs)
    if node.op in ("arg", "load") and "half_of" not in node.attrs:
        return FinishStep(node.id, node.op, name=node.attrs["name"])
    if node.op == "literal":
        return FinishStep(node.id, "literal", expr=_python_expr(node.attrs["value"]))
    if node.op == "cast":
        return FinishStep(node.id, "cast", inputs, (), _dtype(node.dtype))
    if node.op in ELEMENTWISE:
        params = tuple((p, node.attrs[p]) for p in ELEMENTWISE[node.op].params)
        return FinishStep(node.id, node.op, inputs, params, _dtype(node.dtype))
    # The passes put nothing else after a reduction (loads and the accumulator are per element).
    raise ValueError(f"node {node.op} cannot be finished on the host")


__all__ = ["CallInterface", "FinishStep", "HostOutput", "KernelInput", "KernelPlan", "OutputStructure",
           "ReductionPartials", "plan_kernel"]
