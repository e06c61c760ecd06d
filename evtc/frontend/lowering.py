"""How each supported torch function, Tensor method and operator becomes IR nodes.

Each handler has the signature of the torch function it stands for (minus the arguments evtc does
not support, which it rejects by name), receives the tracer first, and returns traced values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import sympy
import torch
import torch.nn.functional as F

from ..errors import DTypeError, ReductionError, UnsupportedOpError
from ..ir.dtypes import CAST_DTYPES, FLOAT8_DTYPES, short_name
from ..ir.infer import promotion_stand_in
from ..ir.shapes import ONE, N
from .proxy import SymDim, TracedValue
from .source import user_location

if TYPE_CHECKING:
    from .tracer import Tracer

Handler = Callable[..., Any]

#: torch / torch.nn.functional callables -> handler.
FUNCTIONS: dict[Any, Handler] = {}
#: Tensor method names -> handler (the traced value is passed as the first argument).
METHODS: dict[str, Handler] = {}
#: Methods whose trailing-underscore form is an in-place version of them.
INPLACE_CAPABLE: set[str] = set()


def register(functions: list[Any], methods: list[str], handler: Handler, inplace: bool = True) -> None:
    for f in functions:
        FUNCTIONS[f] = handler
    for m in methods:
        METHODS[m] = handler
        if inplace:
            INPLACE_CAPABLE.add(m)


def _reject_out(kwargs: dict[str, Any], name: str) -> None:
    if kwargs.get("out") is not None:
        raise UnsupportedOpError(f"{name}(..., out=...) is not supported in epilogues", user_location())
    unknown = set(kwargs) - {"out"}
    if unknown:
        raise UnsupportedOpError(
            f"{name}: argument(s) {', '.join(sorted(unknown))} not supported in epilogues",
            user_location(),
        )


def _maybe_inplace(t: Tracer, x: Any, result: TracedValue, inplace: bool, name: str) -> Any:
    if inplace:
        return t.assign(x, result, f"{name}(inplace=True)")
    return result


def _torch_dtype_of(values: tuple[Any, ...]) -> torch.dtype:
    """The dtype torch gives a function of ``values`` (tensors, 0-dim tensors and numbers by
    torch's categories), read from the IR's dtypes, as evtc's ops promote: a float32 accumulator
    stays float32, a value cast to float16 is float16."""
    total: Any = None
    for value in values:
        if isinstance(value, TracedValue):
            node = value._node
            stand_in = promotion_stand_in(node.dtype, node.is_python_scalar, len(node.shape) == 0)
        else:
            stand_in = 1.0
        total = stand_in if total is None else total + stand_in
    dtype = total.dtype if isinstance(total, torch.Tensor) else torch.float32
    return dtype if dtype.is_floating_point else torch.float32


def _rounded_once(t: Tracer, values: tuple[Any, ...], formula: Callable[..., Any]) -> Any:
    """``formula(*values)`` computed in float32 and rounded once to the dtype torch gives it.

    torch runs each function here as one kernel that computes in float32 and rounds its result
    (``torch.lerp`` of float16 values rounds once), where evtc's ops on a float16 value round each
    step to float16, as separate torch ops would: a step could overflow, or lose the digits a
    cancellation needs. So float16 and bfloat16 values are widened first (their eager dtypes
    unchanged: torch widens nothing the user sees), and the result cast back."""
    want = _torch_dtype_of(values)
    widened = []
    for value in values:
        if isinstance(value, TracedValue) and value._node.dtype in (torch.float16, torch.bfloat16):
            wide = t.emit("cast", (value,), {"dtype": torch.float32})
            t.eager.same_as(wide._node, value._node)
            value = wide
        widened.append(value)
    result = formula(*widened)
    if not isinstance(result, TracedValue) or result._node.dtype == want:
        return result
    return t.emit("cast", (result,), {"dtype": want})


# --- elementwise ------------------------------------------------------------------------------
def _unary(op: str, **fixed: Any) -> Handler:
    def handler(t: Tracer, input: Any, **kwargs: Any) -> Any:
        _reject_out(kwargs, op)
        return t.emit(op, (input,), fixed)

    return handler


def _leaky_relu_by(t: Tracer, x: Any, negative_slope: Any) -> Any:
    """F.leaky_relu(x, s) for a runtime s: x where x > 0, else x * s (NaN stays NaN), rounded once
    to x's dtype (torch's kernel does not promote x by a runtime slope)."""
    def formula(v, s):
        return t.emit("where", (t.emit("gt", (v, 0.0)), v, t.emit("mul", (v, s))))

    return _rounded_once(t, (x, negative_slope), formula)


def _elu_by(t: Tracer, x: Any, alpha: Any) -> Any:
    """F.elu(x, alpha) for a runtime alpha: x where x > 0, else alpha * (exp(x) - 1), rounded
    once."""
    def formula(v, a):
        return t.emit("where", (t.emit("gt", (v, 0.0)), v, t.emit("mul", (a, t.emit("expm1", (v,))))))

    return _rounded_once(t, (x, alpha), formula)


#: Activations whose parameter may be a runtime scalar: written out as torch defines them.
_BY_RUNTIME_SCALAR: dict[str, Callable[..., Any]] = {"leaky_relu": _leaky_relu_by, "elu": _elu_by}


def _unary_inplace_kw(op: str, **defaults: Any) -> Handler:
    """Unary activations of torch.nn.functional that take an `inplace` flag and parameters."""

    def handler(t: Tracer, input: Any, *args: Any, inplace: bool = False, **kwargs: Any) -> Any:
        params = dict(defaults)
        for key, value in zip(defaults, args, strict=False):
            params[key] = value
        for key, value in kwargs.items():
            if key not in defaults:
                raise UnsupportedOpError(f"{op}: argument {key!r} not supported", user_location())
            params[key] = value
        # A runtime scalar, or a number computed from the problem's sizes (1 / acc.shape[-1]),
        # which is known only per call too.
        # torch reads a 0-dim tensor where it takes a number (F.leaky_relu(x, torch.tensor(0.1))).
        runtime = [key for key, value in params.items() if isinstance(value, SymDim)
                   or isinstance(value, TracedValue) and (value._node.is_python_scalar or value.dim() == 0)]
        if runtime and op in _BY_RUNTIME_SCALAR:
            # A parameter passed per call: the op written out with it, as torch computes it.
            return _maybe_inplace(t, input, _BY_RUNTIME_SCALAR[op](t, input, **params), inplace, op)
        for key, value in params.items():
            if key in runtime:
                what = ("computed from the problem's sizes" if isinstance(params[key], SymDim)
                        else "a runtime scalar (an epilogue argument)" if params[key]._node.is_python_scalar
                        else "a 0-dim tensor, known only when the kernel runs")
                raise UnsupportedOpError(
                    f"{op}: parameter {key} is {what}; evtc takes it only as a compile-time number: "
                    "write it as a literal, or give the parameter a default value and leave it out of "
                    "the example inputs", user_location())
            if not isinstance(value, int | float):
                raise UnsupportedOpError(
                    f"{op}: parameter {key} must be a Python number, got {_described(value)}",
                    user_location(),
                )
            params[key] = float(value)
        return _maybe_inplace(t, input, t.emit(op, (input,), params), inplace, op)

    return handler


def _described(value: Any) -> str:
    """What a user passed, in their terms (a traced value is their tensor)."""
    if isinstance(value, TracedValue):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def _binary(op: str) -> Handler:
    def handler(t: Tracer, input: Any, other: Any, **kwargs: Any) -> Any:
        _reject_out(kwargs, op)
        return t.emit(op, (input, other))

    return handler


def _pow(t: Tracer, input: Any = None, exponent: Any = None, **kwargs: Any) -> Any:
    """torch.pow(input, exponent), either by keyword (``torch.pow(acc, exponent=2)``)."""
    if "self" in kwargs:  # torch.pow(self=2.0, exponent=x): a number to a tensor's power
        input = kwargs.pop("self")
    _reject_out(kwargs, "pow")
    if input is None or exponent is None:
        raise UnsupportedOpError("pow takes a base and an exponent: torch.pow(x, 2.0) or x ** 2.0",
                                 user_location())
    return t.emit("pow", (input, exponent))


def _add_sub(op: str) -> Handler:
    def handler(t: Tracer, input: Any, other: Any, *, alpha: Any = 1, **kwargs: Any) -> Any:
        _reject_out(kwargs, op)
        if isinstance(alpha, int | float) and alpha == 1:
            return t.emit(op, (input, other))
        if isinstance(alpha, TracedValue) and alpha.dim() > 0:
            raise DTypeError(f"torch.{op}'s alpha must be a number or a 0-dim tensor (torch refuses a "
                             f"tensor of shape {tuple(alpha._node.shape)})", user_location())
        masks = [isinstance(v, TracedValue) and v._node.dtype == torch.bool for v in (input, other)]
        if op == "sub" and any(masks):
            return t.emit(op, (input, other))  # refused as torch refuses a mask's subtraction
        if all(masks):
            # On two masks torch adds in bool: alpha * other is other where alpha is nonzero.
            if not isinstance(alpha, bool | int):
                raise DTypeError(f"torch.{op} of two boolean masks takes an int alpha (torch refuses "
                                 "a float one for integral tensors)", user_location())
            return t.emit(op, (input, other)) if alpha else input
        # torch computes input + alpha * other in float32 and rounds once, to the dtype the plain
        # sum would have (alpha, a scalar, takes no part): alpha * other is never rounded to a
        # 16-bit other's dtype on its own.
        return _rounded_once(t, (input, other), lambda x, o: t.emit(op, (x, t.emit("mul", (alpha, o)))))

    return handler


def _div(t: Tracer, input: Any, other: Any, *, rounding_mode: Any = None, **kwargs: Any) -> Any:
    _reject_out(kwargs, "div")
    if rounding_mode is not None:
        raise UnsupportedOpError(
            f"div(..., rounding_mode={rounding_mode!r}) is not supported (only true division)",
            user_location(),
        )
    return t.emit("div", (input, other))


def _gelu(t: Tracer, input: Any, approximate: str = "none") -> Any:
    if approximate == "none":
        return t.emit("gelu", (input,))
    if approximate == "tanh":
        return t.emit("gelu_tanh", (input,))
    raise UnsupportedOpError(f"gelu(approximate={approximate!r}) is not a gelu variant", user_location())


def _logical_xor(t: Tracer, input: Any, other: Any, **kwargs: Any) -> Any:
    _reject_out(kwargs, "logical_xor")
    return t.emit("ne", (t.emit("ne", (input, 0)), t.emit("ne", (other, 0))))


def _square(t: Tracer, input: Any, **kwargs: Any) -> Any:
    _reject_out(kwargs, "square")
    return t.emit("mul", (input, input))


def _clamp(t: Tracer, input: Any, min: Any = None, max: Any = None, **kwargs: Any) -> Any:
    _reject_out(kwargs, "clamp")
    if min is None and max is None:
        raise UnsupportedOpError("clamp needs min or max", user_location())
    # torch's clamp takes two tensor bounds or two numbers; a 0-dim tensor passes as either (a
    # Tensor, or a Scalar), so only a dimensioned tensor beside a number is refused.
    kinds = {_clamp_bound_kind(bound) for bound in (min, max) if bound is not None}
    if {"a tensor", "a number"} <= kinds:
        raise UnsupportedOpError("clamp with a tensor for one bound and a number for the other, which torch "
                                 "refuses: give both as tensors or both as numbers (or clamp twice, "
                                 "clamp_min then clamp_max)", user_location())
    # clamp(x, lo, hi) == minimum(maximum(x, lo), hi), NaN propagating like torch.clamp and giving
    # hi where lo > hi, as torch documents.
    result = input
    if min is not None:
        result = t.emit("clamp_min", (result, min))
    if max is not None:
        result = t.emit("clamp_max", (result, max))
    return result


def _clamp_bound_kind(bound: Any) -> str:
    """"a tensor" (dimensioned), "a number" (a Python number or an epilogue's float argument) or
    "0-dim" (a 0-dim tensor, which torch's clamp takes in place of either)."""
    if isinstance(bound, TracedValue) and not bound._node.is_python_scalar:
        return "a tensor" if len(bound._node.shape) > 0 else "0-dim"
    if isinstance(bound, torch.Tensor):
        return "a tensor" if bound.dim() > 0 else "0-dim"
    return "a number"


def _clamp_min(t: Tracer, input: Any, min: Any) -> Any:
    return _clamp(t, input, min=min)


def _clamp_max(t: Tracer, input: Any, max: Any) -> Any:
    return _clamp(t, input, max=max)


def _hardtanh(t: Tracer, input: Any, min_val: float = -1.0, max_val: float = 1.0,
              inplace: bool = False) -> Any:
    for name, value in (("min_val", min_val), ("max_val", max_val)):
        if isinstance(value, TracedValue) and (value._node.is_python_scalar or value.dim() == 0):
            # torch checks min_val <= max_val, which a value known only per call cannot be.
            what = ("a runtime scalar (an epilogue argument)" if value._node.is_python_scalar
                    else "a 0-dim tensor")
            raise UnsupportedOpError(
                f"hardtanh: {name} is {what}; evtc takes it only as a compile-time number (a literal, "
                "or a parameter default left out of the example inputs); torch.clamp takes runtime "
                "bounds", user_location())
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise UnsupportedOpError(f"hardtanh: {name} must be a Python number, got {_described(value)}",
                                     user_location())
    if min_val > max_val:
        raise UnsupportedOpError(f"hardtanh: min_val {min_val} is greater than max_val {max_val}, which "
                                 "torch refuses", user_location())
    bounds = {"min_val": float(min_val), "max_val": float(max_val)}
    return _maybe_inplace(t, input, t.emit("hardtanh", (input,), bounds), inplace, "hardtanh")


def _relu6(t: Tracer, input: Any, inplace: bool = False) -> Any:
    return _hardtanh(t, input, 0.0, 6.0, inplace)


def _where(t: Tracer, condition: Any, input: Any = None, other: Any = None, **kwargs: Any) -> Any:
    _reject_out(kwargs, "where")
    if input is None or other is None:
        raise UnsupportedOpError(
            "torch.where(condition) with one argument returns indices; epilogues need "
            "torch.where(condition, x, y)",
            user_location(),
        )
    return t.emit("where", (condition, input, other))


def _max_min(kind: str) -> Handler:
    elementwise = "maximum" if kind == "max" else "minimum"

    def handler(t: Tracer, input: Any, dim: Any = None, keepdim: bool = False, *, other: Any = None,
                **kwargs: Any) -> Any:
        from .proxy import TracedValue

        _reject_out(kwargs, kind)
        if other is not None:  # torch.max(x, other=y)
            return t.emit(elementwise, (input, other))
        if isinstance(dim, TracedValue | torch.Tensor):  # torch.max(x, y): the elementwise form
            return t.emit(elementwise, (input, dim))
        if dim is not None:
            raise ReductionError(
                f"{kind}(dim=...) returns values and indices, which epilogues cannot produce; "
                f"use a{kind}(dim) for the values",
                user_location(),
            )
        if keepdim:  # torch's max() over everything takes no keepdim (TypeError)
            raise ReductionError(f"{kind}(keepdim=True) without a dim, which torch refuses; use "
                                 f"a{kind}((-2, -1), keepdim=True)", user_location())
        return t.reduce(input, kind, None, keepdim)

    return handler


# --- reductions -------------------------------------------------------------------------------
def _reduction(name: str, kind: str, mean: bool = False) -> Handler:
    def handler(t: Tracer, input: Any, dim: Any = None, keepdim: bool = False, *,
                dtype: Any = None, **kwargs: Any) -> Any:
        if "axis" in kwargs:  # NumPy's name, which torch takes for dim
            if dim is not None:
                raise UnsupportedOpError(f"{name}: dim and axis both given (torch refuses it too); axis is "
                                         "torch's other name for dim", user_location())
            dim = kwargs.pop("axis")
        _reject_out(kwargs, name)
        if dtype in (torch.float16, torch.bfloat16):
            # torch casts the input to dtype first, accumulates in float32 and rounds the result
            # to dtype once: a reduction of the cast input does the same.
            return t.reduce(input.to(dtype), kind, dim, keepdim, mean=mean, dtype=None)
        if dtype not in (None, torch.float32):
            raise DTypeError(f"reductions accumulate in float32 and round to the input's dtype; "
                             f"dtype={dtype} is not supported (float32, float16 or bfloat16 are)",
                             user_location())
        return t.reduce(input, kind, dim, keepdim, mean=mean, dtype=dtype)

    return handler


# --- gated epilogues: acc.chunk(2, dim=-1) -----------------------------------------------------
def _halves(t: Tracer, input: Any, what: str) -> tuple[Any, Any]:
    """(gate, up): the two halves of the last dim, each a node of its own (op "half")."""
    node = t.node_of(input)
    loc = user_location()
    halves = tuple(t.wrap(t.builder.add("half", (node,), {"index": i}, loc=loc)) for i in (0, 1))
    # The halves are views of `input`: an in-place op on any of the three would change the others.
    for value in (input, *halves):
        if isinstance(value, TracedValue) and value._input_name is None:
            value._shares_memory = f"a value split by {what} or one of its halves"
    for value in halves:
        if isinstance(input, TracedValue) and input._input_name is not None:
            value._shares_memory = f"a half of input {input._input_name!r} ({what})"
    return halves


def _last_dim(t: Tracer, input: Any, dim: Any, what: str) -> None:
    rank = len(t.node_of(input).shape)
    if not isinstance(dim, int) or isinstance(dim, bool) or not -rank <= dim < rank \
            or dim % rank != rank - 1:
        raise UnsupportedOpError(
            f"{what} with dim={dim!r}: epilogues split only the last dim (dim=-1), into the gate and "
            "up halves of a gated epilogue such as SwiGLU",
            user_location(),
        )


def _chunk(t: Tracer, input: Any, chunks: Any, dim: Any = 0) -> Any:
    _last_dim(t, input, dim, "chunk")
    if chunks != 2:
        raise UnsupportedOpError(
            f"chunk({chunks!r}, dim=-1): epilogues split the last dim into 2 halves only (the gate "
            "and up of a gated epilogue); for q, k, v of a fused projection, return the whole tile "
            "and split the result after the call (y.chunk(...) gives views, no copy)",
            user_location(),
        )
    if t.problem.sizes[N] % 2:
        raise UnsupportedOpError(
            f"chunk(2, dim=-1) of N = {t.problem.sizes[N]} columns: a gated epilogue needs an even N "
            "(equal gate and up halves)",
            user_location(),
        )
    return _halves(t, input, "chunk")


def _split(t: Tracer, input: Any, split_size_or_sections: Any, dim: Any = 0) -> Any:
    _last_dim(t, input, dim, "split")
    half = t.problem.sizes[N] // 2
    literal = False

    def concrete(size: Any) -> Any:
        nonlocal literal
        if isinstance(size, SymDim) and size.expr in (sympy.floor(N / 2), N / 2):
            return half  # acc.shape[-1] // 2: half of whatever N the kernel runs
        literal = literal or isinstance(size, int)
        return size

    size = split_size_or_sections
    size = [concrete(s) for s in size] if isinstance(size, list | tuple) else concrete(size)
    even = t.problem.sizes[N] % 2 == 0
    if not (even and (size == half or (isinstance(size, list | tuple) and list(size) == [half, half]))):
        parts = (len(size) if isinstance(size, list | tuple) else
                 -(-t.problem.sizes[N] // size) if isinstance(size, int) and size > 0 else 2)
        hint = ("write x.chunk(2, dim=-1)" if parts <= 2 else
                f"this split makes {parts} parts (q, k, v of a fused projection?): return the whole "
                "tile and split the result after the call (y.split(...) gives views, no copy)")
        raise UnsupportedOpError(
            f"split({size!r}, dim=-1): epilogues split the last dim into 2 equal halves only (N = "
            f"{t.problem.sizes[N]}, a gated epilogue); {hint}",
            user_location(),
        )
    if literal:
        # split(14336, -1) is two halves only where N is 28672 (torch fails for another N): the
        # kernel takes that N alone (acc.shape[-1] // 2 or chunk(2) serve every N).
        t.fixed_n = t.problem.sizes[N]
    return _halves(t, input, "split")


# --- casts ------------------------------------------------------------------------------------
def cast_to(t: Tracer, input: Any, dtype: torch.dtype, copy: bool = False) -> Any:
    if dtype == torch.bool and isinstance(input, TracedValue):
        # torch's .bool(): a mask as it is (the tensor itself, unless copy), a number as != 0 (NaN
        # is True) of the value as torch holds it: rounded to its 16-bit dtype first (a float16
        # product can underflow to 0), a float8 one compared in float32 (exactly; torch has no
        # arithmetic on float8, but .bool() of one is legal). Returned, it is a bool output.
        eager = input.dtype
        if eager == torch.bool:
            return input.clone() if copy else input
        if eager in FLOAT8_DTYPES:
            input = cast_to(t, input, torch.float32)
        elif eager != torch.float32:
            input = cast_to(t, input, eager, copy=True)
        return input != 0
    if dtype not in CAST_DTYPES:
        allowed = ", ".join(short_name(d) for d in (*CAST_DTYPES, torch.bool))
        raise DTypeError(f"cast to {dtype} is not supported; epilogue values may be cast to {allowed}",
                         user_location())
    result = t.emit("cast", (input,), {"dtype": dtype})
    if getattr(input, "dtype", None) == dtype and not copy:
        # torch returns the tensor itself (no copy): an in-place op on either would change the
        # other too, which the graph cannot say. (The cast stays: it sets an output's dtype.)
        what = f"x.to({dtype}) of a {short_name(dtype)} x"
        result._shares_memory = f"a cast to the value's own dtype ({what})"
        if isinstance(input, TracedValue) and input._input_name is None:
            input._shares_memory = f"a value cast to its own dtype ({what})"
    return result


def _to(t: Tracer, input: Any, *args: Any, **kwargs: Any) -> Any:
    dtype = kwargs.pop("dtype", None)
    copy = bool(kwargs.pop("copy", False))
    kwargs.pop("non_blocking", None)
    kwargs.pop("device", None)  # where the value lives is the kernel's business
    if kwargs.get("memory_format", torch.preserve_format) == torch.preserve_format:
        kwargs.pop("memory_format", None)
    rest: list[Any] = []
    for a in args:
        if isinstance(a, torch.device | str | int) and not isinstance(a, bool) and dtype is None:
            continue  # x.to("cuda"), x.to(acc.device): already there
        if isinstance(a, torch.dtype) and dtype is None:
            dtype = a
        elif isinstance(a, TracedValue) and dtype is None and not rest:
            dtype = a.dtype  # x.to(other): other's dtype (its device is the kernel's)
        else:
            rest.append(a)
    if rest or kwargs:
        raise UnsupportedOpError(
            ".to(...) in an epilogue takes only a dtype (devices and memory formats are the "
            "kernel's business)",
            user_location(),
        )
    if dtype is None:
        # Only a device: torch returns the value itself (a copy with copy=True).
        return t.wrap(t.node_of(input)) if copy else input
    return cast_to(t, input, dtype, copy)


def _fixed_cast(dtype: torch.dtype) -> Handler:
    def handler(t: Tracer, input: Any) -> Any:
        return cast_to(t, input, dtype)

    return handler


def _type(t: Tracer, input: Any, dtype: Any = None) -> Any:
    if not isinstance(dtype, torch.dtype):
        raise UnsupportedOpError(".type() needs a torch dtype in an epilogue", user_location())
    return cast_to(t, input, dtype)


def _type_as(t: Tracer, input: Any, other: Any) -> Any:
    if not isinstance(other, TracedValue):
        raise UnsupportedOpError(".type_as() needs a tensor of the epilogue (an input or a value made "
                                 "from one)", user_location())
    return cast_to(t, input, other.dtype)


# --- the table --------------------------------------------------------------------------------
_SIMPLE_UNARY = {
    "neg": ([torch.neg, torch.negative], ["neg", "negative"]),
    "abs": ([torch.abs, torch.absolute], ["abs", "absolute"]),
    "sqrt": ([torch.sqrt], ["sqrt"]),
    "rsqrt": ([torch.rsqrt], ["rsqrt"]),
    "reciprocal": ([torch.reciprocal], ["reciprocal"]),
    "exp": ([torch.exp], ["exp"]),
    "exp2": ([torch.exp2, torch.special.exp2], ["exp2"]),
    "expm1": ([torch.expm1, torch.special.expm1], ["expm1"]),
    "log": ([torch.log], ["log"]),
    "log2": ([torch.log2], ["log2"]),
    "log1p": ([torch.log1p, torch.special.log1p], ["log1p"]),
    "sin": ([torch.sin], ["sin"]),
    "cos": ([torch.cos], ["cos"]),
    "tanh": ([torch.tanh, F.tanh], ["tanh"]),
    "erf": ([torch.erf, torch.special.erf], ["erf"]),
    "floor": ([torch.floor], ["floor"]),
    "ceil": ([torch.ceil], ["ceil"]),
    "trunc": ([torch.trunc, torch.fix], ["trunc", "fix"]),
    "sigmoid": ([torch.sigmoid, F.sigmoid, torch.special.expit], ["sigmoid"]),
    "relu": ([torch.relu], ["relu"]),
    "logical_not": ([torch.logical_not], ["logical_not"]),
}
for _op, (_funcs, _methods) in _SIMPLE_UNARY.items():
    register(_funcs, _methods, _unary(_op))

_ACTIVATIONS = {
    "relu": (F.relu, {}),
    "leaky_relu": (F.leaky_relu, {"negative_slope": 0.01}),
    "elu": (F.elu, {"alpha": 1.0}),
    "silu": (F.silu, {}),
    "mish": (F.mish, {}),
    "hardswish": (F.hardswish, {}),
    "hardsigmoid": (F.hardsigmoid, {}),
}
for _op, (_func, _defaults) in _ACTIVATIONS.items():
    register([_func], [], _unary_inplace_kw(_op, **_defaults))
register([F.softplus], [], _unary_inplace_kw("softplus", beta=1.0, threshold=20.0))

register([torch.add], ["add", "__add__"], _add_sub("add"))
register([torch.sub, torch.subtract], ["sub", "subtract"], _add_sub("sub"))
register([torch.mul, torch.multiply], ["mul", "multiply"], _binary("mul"))
register([torch.div, torch.divide, torch.true_divide], ["div", "divide", "true_divide"], _div)
register([torch.pow], ["pow"], _pow)
register([torch.minimum], ["minimum"], _binary("minimum"))
register([torch.maximum], ["maximum"], _binary("maximum"))
register([torch.gt, torch.greater], ["gt", "greater"], _binary("gt"), inplace=False)
register([torch.ge, torch.greater_equal], ["ge", "greater_equal"], _binary("ge"), inplace=False)
register([torch.lt, torch.less], ["lt", "less"], _binary("lt"), inplace=False)
register([torch.le, torch.less_equal], ["le", "less_equal"], _binary("le"), inplace=False)
register([torch.eq], ["eq"], _binary("eq"), inplace=False)
register([torch.ne, torch.not_equal], ["ne", "not_equal"], _binary("ne"), inplace=False)
register([torch.logical_and], ["logical_and"], _binary("logical_and"))
register([torch.logical_or], ["logical_or"], _binary("logical_or"))
register([torch.logical_xor], ["logical_xor"], _logical_xor)
register([torch.square], ["square"], _square)
register([torch.clamp, torch.clip], ["clamp", "clip"], _clamp)
register([torch.clamp_min], ["clamp_min"], _clamp_min)
register([torch.clamp_max], ["clamp_max"], _clamp_max)
register([F.hardtanh], [], _hardtanh)
register([F.relu6], [], _relu6)
register([torch.where], [], _where, inplace=False)
# x.where(condition, y) is torch.where(condition, x, y): the receiver is the value, not the mask.
register([], ["where"], lambda t, input, condition, other: _where(t, condition, input, other),
         inplace=False)
register([F.gelu], [], _gelu)

register([torch.sum], ["sum"], _reduction("sum", "sum"), inplace=False)
register([torch.mean], ["mean"], _reduction("mean", "sum", mean=True), inplace=False)
register([torch.amax], ["amax"], _reduction("amax", "max"), inplace=False)
register([torch.amin], ["amin"], _reduction("amin", "min"), inplace=False)
register([torch.max], ["max"], _max_min("max"), inplace=False)
register([torch.min], ["min"], _max_min("min"), inplace=False)

register([torch.chunk], ["chunk"], _chunk, inplace=False)
register([torch.split], ["split"], _split, inplace=False)

register([], ["to"], _to, inplace=False)
register([], ["type"], _type, inplace=False)
register([], ["type_as"], _type_as, inplace=False)
register([], ["float"], _fixed_cast(torch.float32), inplace=False)
register([], ["half"], _fixed_cast(torch.float16), inplace=False)
register([], ["bfloat16"], _fixed_cast(torch.bfloat16), inplace=False)
register([], ["bool"], _fixed_cast(torch.bool), inplace=False)
# F.sigmoid / F.tanh call the Tensor methods; the activation functions of torch with an `inplace`
# flag call themselves through __torch_function__ and land in _ACTIVATIONS above.

__all__ = ["FUNCTIONS", "METHODS", "INPLACE_CAPABLE", "ONE", "sympy"]
