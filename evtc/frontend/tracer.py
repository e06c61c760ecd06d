"""Tracing: run the epilogue once on proxy values and record what it does as an IR graph."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import sympy
import torch
from torch.overrides import resolve_name

from ..errors import (
    DTypeError,
    EpilogueError,
    InputError,
    OutputError,
    ReductionError,
    ShapeError,
    SourceLoc,
    UnsupportedOpError,
    made_during,
)
from ..ir.dtypes import (
    COMPUTE_DTYPE,
    FLOAT8_DTYPES,
    OPERAND_DTYPES,
    beyond_int64,
    eager_acc_dtype,
    variant_name,
)
from ..ir.graph import Graph, GraphBuilder, Node, Operand, OutputTree, upstream
from ..ir.infer import promote
from ..ir.ops import ELEMENTWISE
from ..ir.shapes import L, varying_dims
from ..numpy_scalars import is_numpy_scalar
from . import composites, lowering  # noqa: F401 - composites registers its handlers with lowering
from .eager_dtypes import DIMENSIONED, NUMBER, ZERO_DIM, EagerDtypes, EagerType
from .epilogue import signature_of
from .inputs import Problem, check_example_keys, classify_tensor, read_problem, read_signature
from .made_tensors import MadeTensors
from .proxy import MATRIX_PRODUCTS, SymDim, TracedValue, unsupported
from .source import definition_location, matrix_product_location, traceback_location, user_location
from .type_checks import TypeChecks


class Tracer:
    """Holds the graph under construction and turns torch calls on proxies into nodes."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self.builder = GraphBuilder(problem.batched)
        #: The tensors the function makes itself while it runs (torch.tensor(2.0)).
        self.made = MadeTensors(self)
        #: N, where the function fixes it (a split of a literal size): see Graph.fixed_n.
        self.fixed_n: int | None = None
        #: What each value's dtype would be in eager torch: ``x.dtype``, and an output's dtype.
        #: float8 a and b have no eager product (torch._scaled_mm takes an out_dtype), so their
        #: accumulator reads as what it is, float32.
        self.eager = EagerDtypes(eager_acc_dtype(problem.ab_dtype))
        #: Whether the epilogue is running (its values, not the inputs evtc sets up for it).
        self.running = False
        #: Reductions refused only if an output reads them: node id -> (message, location).
        self.refused_if_read: dict[int, tuple[str, Any]] = {}
        #: The inputs ("acc", operand names) whose shape or rank the function read: see
        #: Graph.shape_reads; and those of which it read any size, the last dim included.
        self.shape_reads: set[str] = set()
        self.size_reads: set[str] = set()

    def note_shape_read(self, node: Node, last_dim: bool = False) -> None:
        """The function read the shape, a size or the rank of ``node`` (only its last dim, which
        no call-time view changes, with ``last_dim``): each input it is computed from is one whose
        shape a call may not change (torch's value would read another)."""
        if not self.running:
            return
        for n in upstream(node):
            name = "acc" if n.op == "acc" else n.attrs["name"] if n.op == "load" else None
            if name is not None:
                self.size_reads.add(name)
                if not last_dim:
                    self.shape_reads.add(name)

    # --- values -----------------------------------------------------------------------------
    def node_of(self, value: Any) -> Node:
        """The node for an argument of a traced op: a traced value, a Python number, a size."""
        if isinstance(value, TracedValue):
            if value._tracer is not self:
                raise UnsupportedOpError("a traced value from another trace was used", user_location())
            return value._node
        if is_numpy_scalar(value):
            value = value.item()  # np.float32(0.5): the number it holds, as torch reads it
        if isinstance(value, bool):
            # torch keeps `mask | True` a mask but makes `x * True` a number: evtc's literals are
            # float32 numbers, so a bool literal would silently change one or the other.
            raise DTypeError(
                f"the Python bool {value} in an epilogue expression: write 1.0 / 0.0 for a number, or "
                "build masks from comparisons (acc > 0) and combine them with &, |, ~",
                user_location(),
            )
        if beyond_int64(value):
            # torch reads an int as an int64 and refuses one beyond it (OverflowError)
            raise DTypeError(f"the Python int {value} in an epilogue expression is beyond int64, which "
                             "torch refuses; write it as a float (a literal such as 1e30)", user_location())
        if isinstance(value, int | float):
            return self.builder.literal(value, user_location())
        if isinstance(value, SymDim):
            return self.builder.literal(value.expr, user_location())
        if isinstance(value, torch.Tensor) and self.made.holds(value):
            if value.dtype == torch.float64:
                raise DTypeError(
                    "a float64 tensor made in the epilogue (torch.tensor(2.0) under a float64 default "
                    "dtype, or dtype=torch.float64): torch would make the result float64, which a "
                    "kernel does not compute; make it float32 (dtype=torch.float32) or use a Python "
                    "number", user_location())
            if value.numel() == 1 and value.dim() <= 1 and value.device.type in ("cpu", "cuda") \
                    and value.dtype.is_floating_point:
                # A constant made in the epilogue (torch.tensor(2.0)): a literal like a Python number
                # (one of shape (1,) broadcasts against the tile as a number does), though torch
                # promotes it as the tensor it is (torch.tensor([2.0]) makes a bfloat16 tile float32).
                node = self.builder.literal(float(value), user_location())
                dtype = value.dtype if value.dtype in OPERAND_DTYPES else torch.float32
                self.eager.set(node, EagerType(dtype, DIMENSIONED if value.dim() else ZERO_DIM))
                return node
            raise UnsupportedOpError(
                f"a {value.dtype} tensor of shape {tuple(value.shape)} on {value.device} made in the "
                "epilogue: constants are Python numbers or one-element float tensors on the CPU of "
                "at most one dim (torch.tensor(2.0))", user_location())
        if isinstance(value, torch.Tensor):
            # From outside the function (a global, a closure variable, a module's parameter), or
            # made from one: a constant would keep its value of today, where torch reads the
            # tensor as it is at each call (after an optimizer step, a fill_), and would give it
            # no gradient.
            raise InputError(
                "the epilogue uses a tensor that is not one of its inputs (a global, a closure "
                f"variable or a module's parameter, of shape {tuple(value.shape)}): pass it as a "
                "parameter so the kernel reads it at each call",
                user_location(),
            )
        raise UnsupportedOpError(
            f"cannot use a value of type {type(value).__name__} in an epilogue expression",
            user_location(),
        )

    def wrap(self, node: Node, input_name: str | None = None) -> TracedValue:
        if self.running and not torch.is_grad_enabled() and _carries_gradient(node):
            # Made inside the epilogue's own torch.no_grad() (or inference_mode, set_grad_enabled(
            # False)): torch records no gradient for it, so the backward graph must stop here. The
            # trace itself runs with gradients enabled (trace_raw), whatever the caller's mode.
            node = self.builder.add("detach", (node,), None, loc=node.loc)
            self.eager.same_as(node, node.inputs[0])
        return TracedValue(self, node, input_name)

    def emit(self, op: str, args: tuple[Any, ...], attrs: dict[str, Any] | None = None) -> TracedValue:
        inputs = tuple(self.node_of(a) for a in args)
        op, inputs = self._mask_rules(op, inputs)
        if op in _COMPARISONS:
            inputs = self._compared_in(inputs)
        elif len(inputs) == 2 and op in ELEMENTWISE and not ELEMENTWISE[op].boolean:
            inputs = self._zero_dim_rounded(inputs)
            if op == "pow":
                inputs = self._pow_number_rounded(inputs)
        return self.wrap(self.builder.add(op, inputs, attrs, loc=user_location()))

    def _compared_in(self, inputs: tuple[Node, ...]) -> tuple[Node, ...]:
        """torch compares in the promoted dtype: a value cast to float16 against a Python number
        (or a runtime scalar, or a 0-dim tensor) compares against that number rounded to float16
        (``h == 0.1`` is True for ``h = torch.tensor(0.1).half()``). Where the promoted dtype is
        narrower than float32, the other side is cast to it; evtc's values are held in float32, so
        the comparison itself is then exact."""
        if len(inputs) != 2 or any(n.dtype == torch.bool for n in inputs):
            return inputs
        # A loaded 16-bit operand is widened to float32 as it is loaded; torch compares it in its
        # own dtype, so the promotion reads the load's.
        unloaded = tuple(n.inputs[0] if n.op == "cast" and n.attrs.get("implicit")
                         and n.inputs[0].op == "load" else n for n in inputs)
        return self._cast_to_narrow_promotion(inputs, unloaded, lambda n: True)

    def _zero_dim_rounded(self, inputs: tuple[Node, ...]) -> tuple[Node, ...]:
        """torch computes a binary op on tensors in their common dtype, converting each input to it
        first: a 0-dim tensor (a device scalar, a full reduction) beside a 16-bit value does not
        promote the result, and is rounded to its dtype (``y * s`` for a bfloat16 ``y`` and a float32
        0-dim ``s`` multiplies by s rounded to bfloat16). Python numbers are not: torch passes them
        in float32."""
        if any(n.dtype == torch.bool for n in inputs):
            return inputs
        # The inputs' own dtypes, loads as widened (evtc computes on a loaded 16-bit operand in
        # float32, as evtc.reference does): only a value the function itself narrowed is narrow.
        return self._cast_to_narrow_promotion(
            inputs, inputs, lambda n: len(n.shape) == 0 and not n.is_python_scalar)

    def _pow_number_rounded(self, inputs: tuple[Node, ...]) -> tuple[Node, ...]:
        """torch's pow of a tensor and a Python number (or a runtime scalar), either way round,
        converts the number to the tensor's dtype (its kernels take it as ``scalar_t``): for a
        float16 ``h``, ``1.1 ** h`` and ``h ** 1.1`` use 1.1 rounded to float16 (1.0996). Only a
        value the function narrowed is 16-bit here: a loaded operand and the accumulator compute
        in float32, as evtc.reference computes them (widened), so a number beside them is not
        rounded. Other ops take a number in float32."""
        numbers = [n.is_python_scalar for n in inputs]
        if numbers.count(True) != 1 or any(n.dtype == torch.bool for n in inputs):
            return inputs
        return self._cast_to_narrow_promotion(inputs, inputs, lambda n: n.is_python_scalar)

    def _cast_to_narrow_promotion(self, inputs: tuple[Node, ...], promoted_from: tuple[Node, ...],
                                  cast: Callable[[Node], bool]) -> tuple[Node, ...]:
        """``inputs`` with those ``cast`` selects cast to the dtype ``promoted_from`` promotes to,
        where that dtype is a 16-bit float (float32 and wider: evtc computes in float32 anyway)."""
        dtype = promote(promoted_from)
        if not dtype.is_floating_point or dtype.itemsize >= 4:
            return inputs
        loc = user_location()
        return tuple(self.builder.add("cast", (n,), {"dtype": dtype}, loc=loc) if n.dtype != dtype and cast(n)
                     else n for n in inputs)

    def _mask_rules(self, op: str, inputs: tuple[Node, ...]) -> tuple[str, tuple[Node, ...]]:
        """torch's rules for boolean masks in arithmetic: on two masks, + and maximum are "or", *
        and minimum "and", and the result stays a mask (True + True is True, not 2); - and unary -
        refuse a mask; logical ops read any other value as ``value != 0``; where's condition must
        be a mask."""
        masks = [n.dtype == torch.bool for n in inputs]
        loc = user_location()
        if any(masks) and op in _PYTHON_ARITHMETIC and self._python_numbers(inputs):
            # Python bools, not masks: a comparison of runtime scalars (alpha > 0.5) is a bool when
            # the function runs, and bools are ints in arithmetic (True + True is 2, True - True 0).
            inputs = tuple([self._as_int(n) if mask else n for n, mask in zip(inputs, masks, strict=True)])
            return op, inputs
        if op in ("sub", "neg") and any(masks):
            raise DTypeError(
                "subtraction or negation of a boolean mask, which torch refuses: invert a mask with ~ "
                "or torch.logical_not, or convert it with .float() first", loc)
        if op in _NO_MASKS and any(masks):
            raise DTypeError(
                f"{op} of a boolean mask, which torch refuses (its activations, abs and roundings are not "
                "defined for bool): convert the mask with .float() first", loc)
        if len(inputs) == 2 and all(masks) and op in _MASK_PAIRS:
            return _MASK_PAIRS[op], inputs
        if op == "logical_xor":  # a != b on masks (Python's ^ on two masks)
            if not all(masks):
                raise DTypeError("^ on a value that is not a boolean mask: torch's ^ is bitwise, which "
                                 "floats do not have; use torch.logical_xor", loc)
            return "ne", inputs
        if op in ("logical_and", "logical_or", "logical_not") and not all(masks):
            zero = self.builder.literal(0, loc)
            inputs = tuple(n if n.dtype == torch.bool else self.builder.add("ne", (n, zero), None, loc=loc)
                           for n in inputs)
        if op == "where" and all(masks):
            # A mask chosen between two masks is a mask: (c & x) | (~c & y), which every backend
            # keeps boolean (a where of booleans computes as numbers).
            c, x, y = inputs
            loc = user_location()
            chosen = self.builder.add("logical_and", (c, x), None, loc=loc)
            other = self.builder.add("logical_and", (self.builder.add("logical_not", (c,), None, loc=loc), y),
                                     None, loc=loc)
            return "logical_or", (chosen, other)
        if op == "where" and not masks[0]:
            raise DTypeError(f"torch.where's condition is {inputs[0].dtype}, not a boolean mask (torch "
                             "refuses it): compare it, e.g. torch.where(x != 0, ...)", loc)
        return op, inputs

    def _python_numbers(self, inputs: tuple[Node, ...]) -> bool:
        """Whether every input is a Python number when the function runs (runtime scalars, literals
        and what is computed from them alone)."""
        return all([self.eager.of(n).rank_class == NUMBER for n in inputs])

    def _as_int(self, node: Node) -> Node:
        """A Python bool as the int it is in arithmetic (0 or 1), held as a float like every number."""
        number = self.builder.add("cast", (node,), {"dtype": COMPUTE_DTYPE}, loc=user_location())
        self.eager.set(number, EagerType(torch.int64, NUMBER))
        return number

    def bitwise(self, op: str, args: tuple[Any, ...]) -> TracedValue:
        """Python's & | ~ on traced values: logical on masks, as torch's bitwise ops are; torch has
        no bitwise op on floats, so anything else is refused. ``~`` of a Python bool (a comparison
        of runtime scalars) is Python's: ~True is -2."""
        inputs = tuple(self.node_of(a) for a in args)
        if op == "logical_not" and self._python_numbers(inputs) and (
                inputs[0].dtype == torch.bool or self.eager.dtype(inputs[0]) == torch.int64):
            # ~ of a Python bool or int (~True is -2, ~~True is 1): -(x + 1)
            loc = user_location()
            number = self._as_int(inputs[0]) if inputs[0].dtype == torch.bool else inputs[0]
            negated = self.builder.add("neg", (number,), None, loc=loc)
            result = self.builder.add("sub", (negated, self.builder.literal(1, loc)), None, loc=loc)
            self.eager.set(result, EagerType(torch.int64, NUMBER))
            return self.wrap(result)
        if any(n.dtype != torch.bool for n in inputs):
            symbol = {"logical_and": "&", "logical_or": "|", "logical_not": "~"}[op]
            raise DTypeError(f"{symbol} on a value that is not a boolean mask: torch's {symbol} is bitwise, "
                             f"which floats do not have; use torch.{op}", user_location())
        return self.emit(op, args)

    def assign(self, target: Any, result: TracedValue, op_name: str) -> TracedValue:
        if not isinstance(target, TracedValue):
            raise UnsupportedOpError(f"{op_name} on a non-traced value", user_location())
        return target._assign(result, op_name)

    # --- dispatch ---------------------------------------------------------------------------------
    def call(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        handler = lowering.FUNCTIONS.get(func)
        if handler is None and args and isinstance(args[0], torch.Tensor) and \
                getattr(torch.Tensor, getattr(func, "__name__", ""), None) is not None:
            # A tensor method of a real tensor given a traced value (torch.tensor(3.0) * acc): the
            # tensor as a value of the epilogue (a constant it made; anything else is refused).
            this = self.wrap(self.node_of(args[0]))
            return getattr(this, func.__name__)(*args[1:], **kwargs)
        if handler is None:
            raise unsupported(_describe(func))
        return handler(self, *args, **kwargs)

    def method(self, value: TracedValue, name: str) -> Callable[..., Any]:
        handler = lowering.METHODS.get(name)
        if handler is not None:
            return lambda *args, **kwargs: handler(self, value, *args, **kwargs)
        base = name[:-1]
        if name.endswith("_") and base in lowering.INPLACE_CAPABLE:
            inplace_handler = lowering.METHODS[base]

            def inplace(*args: Any, **kwargs: Any) -> Any:
                return value._assign(inplace_handler(self, value, *args, **kwargs), f".{name}()")

            return inplace
        if hasattr(torch.Tensor, name):
            raise unsupported(f"Tensor.{name}")
        raise AttributeError(f"a traced epilogue value has no attribute {name!r}")

    def operator(self, op: str, args: tuple[Any, ...]) -> Any:
        return self.emit(op, args)

    # --- reductions -------------------------------------------------------------------------------
    def reduce(self, value: Any, kind: str, dim: Any, keepdim: bool, mean: bool = False,
               dtype: torch.dtype | None = None) -> Any:
        node = self.node_of(value)
        rank = len(node.shape)
        name = "mean" if mean else {"sum": "sum", "max": "amax", "min": "amin"}[kind]
        if node.dtype == torch.bool:
            raise ReductionError(f"{name} of a boolean mask: cast it with .float() first",
                                 user_location())
        if rank < 2:
            raise ReductionError(
                f"{name} of a value of shape {list(node.shape)}: reductions apply to values that "
                "vary over the whole (M, N) tile",
                user_location(),
            )
        shared = None
        if self.problem.batched and L not in varying_dims(node.shape):
            # The kernel reduces per batch, each batch's tiles seeing this value again: it would be
            # counted once per batch, where torch counts it once. Refused if an output reads it
            # (after the trace: a reduction the function computes and drops is legal torch).
            # (The message only: an error made while the function runs would read as one it caught.)
            shared = (f"{name} of a value that is the same in every batch (it reads neither acc nor a "
                      "per-batch operand) in a batched epilogue: compute it outside the kernel",
                      user_location())
        dims = _normalize_dims(dim, rank, name)
        last, second = rank - 1, rank - 2
        if dims == {last}:
            axis = "row"
        elif dims == {second}:
            axis = "col"
        elif dims == {second, last}:
            axis = "batch" if rank == 3 else "all"
        elif dims == set(range(rank)):
            axis = "all"
        else:
            raise ReductionError(
                f"{name} over dim(s) {sorted(dims)} of a value of rank {rank} is not supported: "
                "reduce over -1 (per row), -2 (per column), (-2, -1) (per batch) or all dims",
                user_location(),
            )
        loc = user_location()
        # torch sums a 16-bit value in float32 and rounds once at the end: a mean divides first,
        # and dtype=torch.float32 never rounds.
        narrow = node.dtype if node.dtype != torch.float32 and kind == "sum" else None
        if narrow is not None:
            node = self.builder.add("cast", (node,), {"dtype": torch.float32}, loc=loc)
        result = self.builder.add("reduce", (node,), {"reduce": kind, "axis": axis,
                                                      "keepdim": bool(keepdim)}, loc=loc)
        if shared is not None:
            self.refused_if_read[result.id] = shared
        if mean:
            count = sympy.Mul(*(node.shape[d] for d in sorted(dims)))
            scale = self.builder.literal(1 / count, loc)
            result = self.builder.add("mul", (result, scale), loc=loc)
        if narrow is not None and dtype is None:
            result = self.builder.add("cast", (result,), {"dtype": narrow}, loc=loc)
        if dtype is not None and self.eager.dtype(result) != dtype:
            # x.sum(dtype=torch.float32) of a value torch holds in 16 bits is float32 there; the
            # kernel already holds it so, and the cast says which dtype an output of it takes.
            result = self.builder.add("cast", (result,), {"dtype": dtype}, loc=loc)
        return self.wrap(result)


#: The comparisons, which torch computes in the promoted dtype of their two sides.
_COMPARISONS = frozenset({"gt", "ge", "lt", "le", "eq", "ne"})

#: Ops torch does not define for bool tensors (``F.relu(mask)`` raises); other unary ops promote a
#: mask to float (``torch.exp(mask)``), as evtc does.
_NO_MASKS = frozenset({"abs", "relu", "hardtanh", "leaky_relu", "elu", "gelu", "gelu_tanh", "silu",
                       "softplus", "mish", "hardswish", "hardsigmoid", "floor", "ceil", "trunc", "round"})

#: Python's arithmetic, which takes bools as ints (where every input is a Python number).
_PYTHON_ARITHMETIC = frozenset({"add", "sub", "mul", "div", "neg", "pow", "abs"})

#: torch on two boolean masks: + and maximum are "or", * and minimum are "and".
_MASK_PAIRS = {"add": "logical_or", "maximum": "logical_or", "mul": "logical_and", "minimum": "logical_and"}


def _normalize_dims(dim: Any, rank: int, name: str) -> set[int]:
    if dim is None:
        return set(range(rank))
    dims = dim if isinstance(dim, list | tuple) else (dim,)
    result: set[int] = set()
    for d in dims:
        if not isinstance(d, int) or isinstance(d, bool):
            raise ReductionError(f"{name}: dim must be an int or a tuple of ints, got {d!r}",
                                 user_location())
        if not -rank <= d < rank:
            raise ReductionError(f"{name}: dim {d} is out of range for a value of rank {rank}",
                                 user_location())
        if d % rank in result:
            raise ReductionError(f"{name}: dim {d} appears more than once in {dim!r} (torch refuses it)",
                                 user_location())
        result.add(d % rank)
    if not result:
        return set(range(rank))
    return result


def _describe(func: Any) -> str:
    try:
        name = resolve_name(func)
    except Exception:  # resolve_name can fail on odd callables; the fallback still names it
        name = None
    return name or getattr(func, "__qualname__", None) or repr(func)


# --- the whole trace ------------------------------------------------------------------------------

# Python's message for torch.Tensor.relu(traced): the C method checks its first argument's type.
_UNBOUND_METHOD = re.compile(r"descriptor '(\w+)' for 'torch\._C\.TensorBase' objects doesn't apply")


def _classify(fn: Callable[..., Any], name: str, value: torch.Tensor, problem: Problem, def_loc) -> Operand:
    """The operand kind of a tensor input; where its shape fits no kind and ``fn`` takes a matrix
    product (LoRA's ``acc + (x @ lora_b)``), the error names the product at its line instead."""
    try:
        return classify_tensor(name, value, problem, def_loc)
    except ShapeError as err:
        where = matrix_product_location(fn, MATRIX_PRODUCTS)
        if where is None:
            raise
        raise UnsupportedOpError(
            f"a matrix product: an epilogue is elementwise over the accumulator of one GEMM, and its "
            f"inputs are shaped like it ({err.message}). A second GEMM is a second evtc.compile (or "
            "torch): pass its result as an (M, N) tile operand", where) from None

def trace_raw(fn: Callable[..., Any], example: Mapping[str, Any]) -> Graph:
    """Trace `fn` on proxies built from `example` and return the graph as traced (no passes)."""
    if not isinstance(example, Mapping):
        raise InputError(
            f"example inputs must be a dict of name -> tensor or scalar, got {type(example).__name__}",
            definition_location(fn),
        )
    sig = read_signature(fn)
    check_example_keys(fn, sig, example)
    def_loc = definition_location(fn)
    problem = read_problem(example, def_loc)
    tracer = Tracer(problem)
    builder = tracer.builder

    acc = builder.add("acc", (), {}, loc=def_loc)
    call_args: dict[str, Any] = {sig.acc_name: tracer.wrap(acc, sig.acc_name)}
    operands: dict[str, Operand] = {}
    for name in sig.params:
        value = example[name] if name in example else sig.defaults[name]
        if is_numpy_scalar(value):
            value = value.item()  # np.float32(0.5) is the number 0.5, as torch reads it
        if isinstance(value, torch.Tensor) and name not in example:
            raise InputError(
                f"parameter {name!r} has a tensor default: a kernel loads its tensors from the call, "
                f"so pass {name!r} in the example inputs and in every call (or make the default None)",
                def_loc,
            )
        if isinstance(value, torch.Tensor):
            operand = _classify(fn, name, value, problem, def_loc)
            operands[name] = operand
            load = builder.add("load", (), {"name": name, "kind": operand.kind, "dtype": operand.dtype,
                                            "shape": operand.shape, "batched": operand.batched},
                               loc=def_loc)
            # Values compute in float32 from the moment they are loaded, as in the reference.
            value_node = load if load.dtype == COMPUTE_DTYPE else builder.add(
                "cast", (load,), {"dtype": COMPUTE_DTYPE, "implicit": True}, loc=def_loc)
            call_args[name] = tracer.wrap(value_node, name)
        elif isinstance(value, bool) or value is None:
            # Flags and absent optionals specialise the trace, so `if flag:` in the epilogue works.
            call_args[name] = value
        elif isinstance(value, int | float) and name in example:
            if beyond_int64(value):
                # torch reads an int scalar as an int64 and refuses one beyond it; so would each call
                raise InputError(f"example input {name!r}, an int of {len(str(abs(value)))} digits, does not "
                                 "fit in int64, which torch requires of an int scalar: pass a float",
                                 def_loc)
            operands[name] = Operand(name, "arg", torch.float32)
            node = builder.add("arg", (), {"name": name, "python_scalar": True}, loc=def_loc)
            call_args[name] = tracer.wrap(node, name)
        elif isinstance(value, int | float):
            call_args[name] = value  # an unlisted default: a compile-time constant
        elif name not in example:
            raise InputError(
                f"parameter {name!r} defaults to a {type(value).__name__} ({value!r}): a parameter left "
                "out of the example inputs is a compile-time constant, which evtc takes as a Python "
                "number, a bool or None; for another constant, close over it (def make(mode): "
                "def epilogue(acc): ...) or use it in the function's body",
                def_loc,
            )
        else:
            raise InputError(
                f"example input {name!r} is a {type(value).__name__}; epilogue inputs are tensors, "
                "Python numbers (runtime scalars), bools or None (compile-time constants)",
                def_loc,
            )

    try:
        # Gradients enabled while the function runs: a value it makes inside its own
        # torch.no_grad() is then one made with them disabled (Tracer.wrap).
        with made_during() as made, tracer.made, TypeChecks(fn) as checks, torch.enable_grad():
            tracer.running = True
            try:
                returned = sig.call(fn, call_args.pop(sig.acc_name), call_args)
            finally:
                tracer.running = False
    except EpilogueError as err:
        raise err.with_traceback(None) from None
    except TypeError as err:
        # A torch function given arguments it does not take (torch.add(acc), or a builtin used
        # as the epilogue that needs more than the accumulator): torch's message, at the user's line.
        name = getattr(fn, "__name__", type(fn).__name__)
        where = traceback_location(err.__traceback__) or def_loc
        unbound = _UNBOUND_METHOD.search(str(err))
        if unbound is not None:
            method = unbound.group(1)
            raise UnsupportedOpError(
                f"torch.Tensor.{method}(x, ...), a Tensor method called through the class, is not "
                f"traced (evtc traces the epilogue with stand-ins for tensors, which the class's "
                f"method refuses): write x.{method}(...)"
                + ("" if where is not def_loc else f"; as the epilogue itself, lambda acc: acc.{method}()"),
                where) from None
        # torch names our stand-in's class in its message; the user knows it as a tensor.
        detail = str(err).replace("TracedValue", "Tensor")
        if not _has_readable_signature(fn):
            name = resolve_name(fn) or name
            raise UnsupportedOpError(
                f"{name}, used as the epilogue, is a builtin whose parameters evtc cannot read, so it "
                f"is called with the accumulator alone, which it does not take ({detail}): wrap it "
                f"in a function that names its operands, e.g. lambda acc, other: {name}(acc, other)",
                where or user_location()) from None
        raise UnsupportedOpError(f"{name}: a call does not take the arguments it was given: {detail}",
                                 where) from None

    if made:
        # The function returned although evtc raised an error into it: its own try/except took it.
        first = made[0]
        raise type(first)(f"{first.message} (the epilogue caught this error itself, in a try/except; "
                          "evtc cannot trace past it: remove the try/except)", first.loc)
    return_loc = checks.returned_at or def_loc
    tree, values = _flatten_outputs(returned, return_loc)
    ab_dtype = problem.ab_dtype
    names: list[str] = []
    stored: list[Node] = []
    for out_name, value in values:
        node = tracer.node_of(value) if isinstance(value, TracedValue) else None
        if node is None:
            raise OutputError(
                f"output {out_name!r} is a {type(value).__name__}, not a tensor computed by the "
                "epilogue",
                return_loc,
            )
        # A value returned as it came in (an operand, acc) was made at the def: its store is the return.
        where = return_loc if node.loc == def_loc else node.loc
        _check_output(out_name, node, where)
        dtype = _default_output_dtype(node, ab_dtype, tracer.eager.dtype(node))
        builder.add("store", (node,), {"name": out_name, "dtype": dtype}, loc=where)
        names.append(out_name)
        stored.append(node)
    _refuse_what_outputs_read(tracer.refused_if_read, stored)
    tree.names = names
    return Graph(
        name=getattr(fn, "__name__", None) or type(fn).__name__,
        nodes=builder.nodes,
        operands=operands,
        outputs=tree,
        batched=problem.batched,
        acc_name=sig.acc_name,
        ab_dtype=ab_dtype,
        fixed_n=tracer.fixed_n,
        operand_variants=_operand_variants(tracer, operands, stored),
        shape_reads=frozenset(tracer.shape_reads),
        size_reads=frozenset(tracer.size_reads),
    )


def _refuse_what_outputs_read(refused: dict[int, tuple[str, Any]], stored: list[Node]) -> None:
    """Raise a ReductionError for the first of ``refused`` (by node) that an output reads."""
    if not refused:
        return
    seen = {node.id for node in upstream(*stored)}
    read = sorted(i for i in refused if i in seen)
    if read:
        raise ReductionError(*refused[read[0]])


def _has_readable_signature(fn: Any) -> bool:
    try:
        signature_of(fn)
    except (TypeError, ValueError):
        return False
    return True


def _flatten_outputs(returned: Any, loc: Any) -> tuple[OutputTree, list[tuple[str, Any]]]:
    if returned is None:
        raise OutputError("the epilogue returns nothing: return the output tensor(s)", loc)
    if isinstance(returned, dict):
        if not returned:
            raise OutputError("the epilogue returns an empty dict", loc)
        keys = list(returned)
        for k in keys:
            if not isinstance(k, str) or not k.isidentifier():
                raise OutputError(f"output dict keys must be identifiers, got {k!r}", loc)
        return OutputTree("dict", [], keys), [(k, returned[k]) for k in keys]
    if isinstance(returned, tuple | list):
        if not returned:
            raise OutputError("the epilogue returns an empty tuple", loc)
        kind = "list" if isinstance(returned, list) else "tuple"
        return OutputTree(kind, []), [(f"D{i}", v) for i, v in enumerate(returned)]
    return OutputTree("single", []), [("D", returned)]


def _carries_gradient(node: Node) -> bool:
    """Whether a value made by the epilogue could carry a gradient: a float tensor value computed
    from its inputs (not an input itself, a number, a mask or a detached value)."""
    return (node.dtype.is_floating_point and not node.is_python_scalar
            and node.op not in ("acc", "load", "arg", "literal", "detach"))


def _check_output(name: str, node: Node, where: SourceLoc | None) -> None:
    from ..ir.shapes import M, N, varying_dims

    if node.op in ("reduce",) or _depends_on_reduction(node):
        return
    if not {M, N} <= varying_dims(node.shape):
        shape = "[" + ", ".join(str(d) for d in node.shape) + "]"
        raise OutputError(
            f"output {name!r} has shape {shape}: outputs are full (M, N) tiles or reductions; "
            "a value that does not vary over the tile can be computed outside the kernel",
            where,
        )


def _depends_on_reduction(node: Node) -> bool:
    return any(n.op == "reduce" for n in upstream(node))


def _operand_variants(tracer: Tracer, operands: dict[str, Operand], stored: list[Node]) -> tuple:
    """For each tensor operand whose dtype (or 0-dim-ness, for a one-element one) changes an
    output's dtype in torch, the variants a call may pass that leave every output's dtype as
    traced: ``(name, ("f16", "f32/0-dim", ...))`` (evtc.ir.dtypes.variant_name). Operands whose
    every variant gives the same dtypes (the usual case: a bias of a's dtype beside a final cast,
    a mask's operand) are not listed; a call may pass any float dtype for them."""
    ab_dtype = tracer.problem.ab_dtype

    def dtypes_with(given: dict[str, EagerType]) -> list[torch.dtype]:
        eager = tracer.eager.with_operands(given)
        return [_default_output_dtype(node, ab_dtype, eager.dtype(node)) for node in stored]

    traced = dtypes_with({})
    variants = []
    for name, operand in operands.items():
        if operand.kind == "arg":
            continue
        ranks = (ZERO_DIM, DIMENSIONED) if operand.kind == "scalar" else (DIMENSIONED,)
        allowed = tuple(variant_name(dtype, rank == ZERO_DIM) for dtype in OPERAND_DTYPES for rank in ranks
                        if dtypes_with({name: EagerType(dtype, rank)}) == traced)
        if len(allowed) < len(OPERAND_DTYPES) * len(ranks):
            variants.append((name, allowed))
    return tuple(variants)


def _default_output_dtype(node: Node, ab_dtype: torch.dtype, eager: torch.dtype) -> torch.dtype:
    """The dtype torch would give the output with ``acc = a @ b`` in a's dtype (``eager``): a's
    dtype, unless the function casts or promotes (a float32 bias makes ``acc + bias`` float32, a
    ``.sum()`` of it is float32, of ``acc * 2`` a's dtype). A mask is a bool tensor, as in torch.

    float8 a and b have no such product in torch (``torch._scaled_mm`` takes an ``out_dtype``):
    there an explicit final cast wins, full tiles are bfloat16 and reductions float32."""
    if ab_dtype not in FLOAT8_DTYPES or eager == torch.bool:
        return eager
    if node.op == "cast" and not node.attrs.get("implicit") or node.dtype not in (COMPUTE_DTYPE, torch.bool):
        return node.dtype
    if _depends_on_reduction(node):
        return COMPUTE_DTYPE
    return torch.bfloat16
