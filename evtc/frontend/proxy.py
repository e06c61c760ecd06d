"""Proxy values: what the epilogue receives while it is traced.

A `TracedValue` stands for a tensor (or a Python-scalar argument) of the epilogue. Torch functions
called on it reach `__torch_function__`, Python operators reach the dunder methods, and Tensor
methods are looked up by name; all of them go to the op handlers of :mod:`evtc.frontend.lowering`,
which append nodes to the graph. Anything that would need the value itself (if, bool(), int(),
indexing) is an error that names the user's line.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import sympy
import torch

from ..errors import ControlFlowError, InPlaceError, UnsupportedOpError
from ..ir.shapes import format_shape
from .source import python_math_call, user_location

if TYPE_CHECKING:
    from ..ir.graph import Node
    from .tracer import Tracer


def _control_flow_error(what: str) -> ControlFlowError:
    return ControlFlowError(
        f"{what} on a traced value: data-dependent Python control flow cannot be traced, because "
        "the epilogue runs once per tile with values only known on the GPU. Compute both branches "
        "and select with torch.where(condition, x, y)",
        user_location(),
    )


#: Matrix products: an epilogue is elementwise over one GEMM, so these get their own message.
MATRIX_PRODUCTS = frozenset({
    "matmul", "mm", "bmm", "mv", "dot", "vdot", "inner", "outer", "ger", "einsum", "tensordot",
    "linear", "bilinear", "addmm", "addbmm", "baddbmm", "addmv", "addr", "chain_matmul", "kron",
    "__matmul__", "__rmatmul__", "__imatmul__", "@",
})


#: NumPy ufuncs that a NumPy scalar on the left of a Python operator calls, and the traced value's
#: reflected operator that computes them (``np.float32(2) > acc`` is ``acc < 2``).
_NUMPY_REFLECTED = {
    "add": "__radd__", "subtract": "__rsub__", "multiply": "__rmul__", "true_divide": "__rtruediv__",
    "divide": "__rtruediv__", "power": "__rpow__", "greater": "__lt__", "greater_equal": "__le__",
    "less": "__gt__", "less_equal": "__ge__", "equal": "__eq__", "not_equal": "__ne__",
}


#: Transposes, which a matrix product on the same line usually takes (``acc @ acc.t()``).
_TRANSPOSES = frozenset({"t", "T", "mT", "H", "mH", "transpose", "permute", "swapaxes", "swapdims",
                         "adjoint"})


def _user_caller(depth: int) -> bool:
    """Whether the frame ``depth`` levels up runs the user's code, not evtc's own (which reads
    shapes and dtypes to pick a lowering; those reads must not count as the function's).
    ``depth`` counts from here: 1 is the method that asks, 2 that method's caller."""
    return not sys._getframe(depth).f_globals.get("__name__", "").startswith("evtc.")


def unsupported(what: str) -> UnsupportedOpError:
    """The error for an op the epilogue language does not have (``what``: ``torch.sin``,
    ``Tensor.mm``, ``@``), at the user's line."""
    op = what.rsplit(".", 1)[-1]
    loc = user_location()
    if op in _TRANSPOSES and loc is not None and (
            "@" in loc.text or any(f"{name}(" in loc.text for name in MATRIX_PRODUCTS)):
        # ``acc @ acc.t()``: the transpose fails first, but the product is what the line asks for.
        what = "@"
    if what.rsplit(".", 1)[-1] in MATRIX_PRODUCTS:
        shown = "the @ operator" if what == "@" else what
        return UnsupportedOpError(
            f"{shown} is a matrix product: an epilogue is elementwise over the accumulator of one GEMM "
            "(with row, column and full reductions). A second GEMM is a second evtc.compile: pass "
            "this kernel's output as its `a`",
            loc,
        )
    return UnsupportedOpError(
        f"{what} is not supported in epilogues (see docs/epilogues.md for the list of supported ops)",
        loc,
    )


class TracedShape(tuple):
    """``x.shape`` while tracing: its sizes as :class:`SymDim`, with torch.Size's ``numel()``.

    ``on_read`` (where the user's code asked for it) is called when a size other than the last
    one, or the rank, is read: a call's broadcast views change leading dims only (adding or
    dropping ones of size 1, expanding a batch of 1), so the last dim of a value of rank 2 or
    more reads the same whatever the call passes (Graph.shape_reads)."""

    def __new__(cls, sizes, on_read=None):
        shape = super().__new__(cls, sizes)
        shape._on_read = on_read
        return shape

    def _read(self) -> None:
        if self._on_read is not None:
            self._on_read()

    def __getitem__(self, index):
        rank = tuple.__len__(self)
        if not (isinstance(index, int) and rank >= 2 and index in (-1, rank - 1)):
            self._read()
        elif self._on_read is not None:
            self._on_read(last_dim=True)
        if isinstance(index, slice):
            return TracedShape(tuple.__getitem__(self, index), self._on_read)
        return tuple.__getitem__(self, index)

    def __iter__(self):
        self._read()
        return tuple.__iter__(self)

    def __len__(self) -> int:
        self._read()
        return tuple.__len__(self)

    def __eq__(self, other) -> bool:
        self._read()
        if isinstance(other, TracedShape):
            other._read()
        return tuple.__eq__(self, other)

    def __ne__(self, other) -> bool:
        return not self == other

    __hash__ = tuple.__hash__

    def __add__(self, other):  # (acc.shape + (1,))[0]: a plain tuple of every size
        self._read()
        if isinstance(other, TracedShape):
            other._read()
        return tuple.__add__(self, other)

    def __radd__(self, other):
        self._read()
        return tuple(other) + tuple(tuple.__iter__(self))

    def __mul__(self, count):
        self._read()
        return tuple.__mul__(self, count)

    __rmul__ = __mul__

    def __contains__(self, size) -> bool:
        self._read()
        return tuple.__contains__(self, size)

    def index(self, *args):
        self._read()
        return tuple.index(self, *args)

    def count(self, size) -> int:
        self._read()
        return tuple.count(self, size)

    def numel(self) -> SymDim:
        self._read()
        return SymDim(sympy.Mul(*(d.expr for d in tuple.__iter__(self))))


class SymDim:
    """A problem size (M, N, L or a product of them) as seen through `x.shape` while tracing.

    It may be used in arithmetic with traced values (for example `x.sum(-1) / x.shape[-1]`), which
    keeps the graph valid for every size; Python decisions on it are errors.
    """

    __slots__ = ("expr",)

    def __init__(self, expr: sympy.Expr) -> None:
        self.expr = sympy.sympify(expr)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # A size where a torch function takes a number (torch.div(acc, acc.shape[-1])): torch's
        # argument parser reaches here when the size comes first; the traced value beside it
        # traces the call as a literal of the size.
        kwargs = kwargs or {}
        try:
            _find_tracer(args, kwargs)
        except RuntimeError:
            name = getattr(func, "__name__", str(func))
            raise ControlFlowError(
                f"{name} of a problem size alone: sizes are only known at run time; use them in "
                "arithmetic with the epilogue's values (acc / acc.shape[-1])", user_location()) from None
        return TracedValue.__torch_function__(func, types, args, kwargs)

    def _binary(self, other: Any, fn: Any) -> Any:
        if isinstance(other, SymDim):
            return SymDim(fn(self.expr, other.expr))
        if isinstance(other, int | float):
            return SymDim(fn(self.expr, sympy.sympify(other)))
        return NotImplemented

    def __add__(self, o: Any) -> Any:
        return self._binary(o, lambda a, b: a + b)

    def __radd__(self, o: Any) -> Any:
        return self._binary(o, lambda a, b: b + a)

    def __sub__(self, o: Any) -> Any:
        return self._binary(o, lambda a, b: a - b)

    def __rsub__(self, o: Any) -> Any:
        return self._binary(o, lambda a, b: b - a)

    def __mul__(self, o: Any) -> Any:
        return self._binary(o, lambda a, b: a * b)

    def __rmul__(self, o: Any) -> Any:
        return self._binary(o, lambda a, b: b * a)

    def __truediv__(self, o: Any) -> Any:
        return self._binary(o, lambda a, b: a / b)

    def __rtruediv__(self, o: Any) -> Any:
        return self._binary(o, lambda a, b: b / a)

    def __pow__(self, o: Any) -> Any:  # acc.shape[-1] ** -0.5, an attention-style scale
        return self._binary(o, lambda a, b: a**b)

    def __rpow__(self, o: Any) -> Any:
        return self._binary(o, lambda a, b: b**a)

    def __neg__(self) -> SymDim:
        return SymDim(-self.expr)

    def __pos__(self) -> SymDim:
        return self

    def __abs__(self) -> SymDim:
        return self  # a size is never negative

    def __floordiv__(self, o: Any) -> Any:  # acc.shape[-1] // 2, the width of a gated half
        if isinstance(o, int) and not isinstance(o, bool) and o > 0:
            return SymDim(sympy.floor(self.expr / o))
        return self._no_python()

    def _no_python(self, *_: Any) -> Any:
        raise ControlFlowError(
            f"the problem size {self.expr} is only known at run time; evtc compiles one kernel for "
            "every size, so Python code cannot depend on it (arithmetic with traced values is fine)",
            user_location(),
        )

    def __float__(self) -> float:
        # math.sqrt(acc.size(-1)) and the other math functions convert their argument first.
        raise ControlFlowError(
            f"float() of the problem size {self.expr} (a math function of it, such as "
            "math.sqrt(acc.size(-1)), converts it first): sizes are only known at run time; write "
            "acc.size(-1) ** 0.5 for a square root, or compute with torch on traced values",
            user_location(),
        )

    __int__ = __index__ = __bool__ = _no_python
    __rfloordiv__ = __mod__ = __rmod__ = _no_python
    __lt__ = __le__ = __gt__ = __ge__ = _no_python

    def __eq__(self, other: object) -> bool:
        return self._no_python()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"SymDim({self.expr})"


class TracedValue:
    """A value of the epilogue while it is traced (a tensor or a runtime Python scalar)."""

    __slots__ = ("_tracer", "_node", "_input_name", "_shares_memory")

    def __init__(self, tracer: Tracer, node: Node, input_name: str | None = None) -> None:
        self._tracer = tracer
        self._node = node
        #: Set for the values the epilogue receives (acc and operands): those may not be mutated.
        self._input_name = input_name
        #: Why torch would hold this value in memory it shares with another (``x.to(x.dtype)`` is
        #: ``x`` itself; chunk and split halves are views of what was split), or None. An in-place
        #: op on either would change both, which a graph of values cannot say: it is refused.
        self._shares_memory: str | None = None

    # --- torch's entry points --------------------------------------------------------------
    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        tracer = _find_tracer(args, kwargs or {})
        return tracer.call(func, args, kwargs or {})

    def __copy__(self) -> TracedValue:
        # copy.copy / copy.deepcopy of a tensor is a new tensor of the same values.
        return self._tracer.wrap(self._node)

    def __deepcopy__(self, memo: dict) -> TracedValue:
        return self.__copy__()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        tracer = object.__getattribute__(self, "_tracer")
        return tracer.method(self, name)

    # --- metadata ----------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        """The dtype torch would give this value (acc in a's dtype, a float16 C float16, acc + C
        promoted), although the kernel computes it in float32 (evtc/frontend/eager_dtypes.py)."""
        if _user_caller(2):
            # A read of the inputs' metadata (Graph.size_reads): an operand read only so is refused.
            self._tracer.note_shape_read(self._node, last_dim=True)
        return self._tracer.eager.dtype(self._node)

    def _read_shape(self) -> None:
        # A read by the user's code (not evtc's own, which asks ranks to pick a lowering): the
        # inputs of this value may not change shape at a call (Graph.shape_reads).
        if _user_caller(3):
            self._tracer.note_shape_read(self._node)

    def _traced_shape(self) -> TracedShape:
        """This value's shape, noting a read of more than its last dim (see TracedShape) where
        the user's code asked for it."""
        on_read = None
        if _user_caller(3):
            tracer, node = self._tracer, self._node
            on_read = lambda last_dim=False: tracer.note_shape_read(node, last_dim)  # noqa: E731
        return TracedShape((SymDim(d) for d in self._node.shape), on_read)

    @property
    def shape(self) -> TracedShape:
        return self._traced_shape()

    def size(self, dim: int | None = None) -> Any:
        shape = self._traced_shape()
        rank = tuple.__len__(shape)
        if dim is not None and not -rank <= dim < rank:
            # torch's IndexError, with its message (a tuple's would not say which dims exist).
            raise IndexError(f"Dimension out of range (expected to be in range of [{-rank}, "
                             f"{rank - 1}], but got {dim})")
        return shape if dim is None else shape[dim]

    @property
    def ndim(self) -> int:
        self._read_shape()
        return len(self._node.shape)

    def dim(self) -> int:
        self._read_shape()
        return len(self._node.shape)

    def numel(self) -> SymDim:
        self._read_shape()
        return SymDim(sympy.Mul(*self._node.shape))

    @property
    def is_cuda(self) -> bool:
        return True

    @property
    def device(self) -> torch.device:
        """Where the kernel computes (``x.to(acc.device)`` is x itself, as in torch)."""
        return torch.device("cuda")

    # --- rebinding for in-place ops on intermediates ----------------------------------------------
    def _assign(self, result: TracedValue, op_name: str) -> TracedValue:
        """Make an in-place op on this value take effect: every alias of it sees the new value."""
        if self._node.is_python_scalar:
            # A Python number (a runtime scalar, or a value computed from numbers) is immutable:
            # `alpha += 1.0` or `s = alpha * 2; s += acc` only rebinds the name, as in Python.
            return result
        if self._shares_memory is not None:
            raise InPlaceError(
                f"in-place {op_name} on {self._shares_memory}, which torch holds in memory it shares "
                "with another value, so the op would change that one as well: use the out-of-place op",
                user_location())
        if self._input_name is not None:
            raise InPlaceError(
                f"in-place {op_name} on input {self._input_name!r}: evtc never modifies its inputs; "
                f"write `{self._input_name} = ...` with the out-of-place op, or use a new name",
                user_location(),
            )
        if tuple(result._node.shape) != tuple(self._node.shape):
            raise InPlaceError(
                f"in-place {op_name} whose result, of shape {format_shape(result._node.shape)}, is larger "
                f"than the value it writes into, of shape {format_shape(self._node.shape)}, which torch "
                "refuses: use the out-of-place op", user_location())
        own = self._node.dtype
        if own == torch.bool and result._node.dtype != torch.bool:
            raise InPlaceError(
                f"in-place {op_name} of a number into a boolean mask, which torch refuses (a float "
                "result cannot be written into a bool tensor): use the out-of-place op", user_location())
        eager = self.dtype
        if own.is_floating_point and (result._node.dtype != own and own == eager or result.dtype != eager):
            # In place, torch writes the result into this value's dtype (a float16 `v += acc`
            # stays float16, and so does `v += C` of a bfloat16 v and a float32 C): round it
            # there. A value evtc holds in float32 although torch holds it narrower (acc * 2)
            # stays unrounded while the result's dtype is its own, as everywhere else.
            result = self._tracer.emit("cast", (result,), {"dtype": eager})
        self._node = result._node
        return self

    # --- Python operators ----------------------------------------------------------------------
    def _op(self, name: str, *args: Any) -> Any:
        return self._tracer.operator(name, args)

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        """NumPy's hook: a NumPy scalar on the left of an operator (``np.float32(2) * acc``) is the
        reflected operator, as torch takes it; a NumPy function of a traced value is refused by
        name (without this, NumPy would try to make an array of it: len(), bool(), a caught error)."""
        reflected = _NUMPY_REFLECTED.get(getattr(ufunc, "__name__", ""))
        if method == "__call__" and reflected and len(inputs) == 2 and inputs[1] is self and not kwargs:
            return getattr(self, reflected)(inputs[0])
        name = getattr(ufunc, "__name__", str(ufunc))
        raise UnsupportedOpError(
            f"numpy.{name} of a traced value: NumPy computes on host arrays, not in the kernel; use "
            f"the torch function (torch.{name}, where torch has it)", user_location())

    def __add__(self, o: Any) -> Any:
        return self._op("add", self, o)

    def __radd__(self, o: Any) -> Any:
        return self._op("add", o, self)

    def __sub__(self, o: Any) -> Any:
        return self._op("sub", self, o)

    def __rsub__(self, o: Any) -> Any:
        return self._op("sub", o, self)

    def __mul__(self, o: Any) -> Any:
        return self._op("mul", self, o)

    def __rmul__(self, o: Any) -> Any:
        return self._op("mul", o, self)

    def __truediv__(self, o: Any) -> Any:
        return self._op("div", self, o)

    def __rtruediv__(self, o: Any) -> Any:
        return self._op("div", o, self)

    def __pow__(self, o: Any) -> Any:
        return self._op("pow", self, o)

    def __rpow__(self, o: Any) -> Any:
        return self._op("pow", o, self)

    def __neg__(self) -> Any:
        return self._op("neg", self)

    def __pos__(self) -> Any:
        return self

    def __abs__(self) -> Any:
        return self._op("abs", self)

    def __gt__(self, o: Any) -> Any:
        return self._op("gt", self, o)

    def __ge__(self, o: Any) -> Any:
        return self._op("ge", self, o)

    def __lt__(self, o: Any) -> Any:
        return self._op("lt", self, o)

    def __le__(self, o: Any) -> Any:
        return self._op("le", self, o)

    def __eq__(self, o: Any) -> Any:  # type: ignore[override]
        return self._op("eq", self, o)

    def __ne__(self, o: Any) -> Any:  # type: ignore[override]
        return self._op("ne", self, o)

    def __and__(self, o: Any) -> Any:
        return self._tracer.bitwise("logical_and", (self, o))

    def __rand__(self, o: Any) -> Any:
        return self._tracer.bitwise("logical_and", (o, self))

    def __or__(self, o: Any) -> Any:
        return self._tracer.bitwise("logical_or", (self, o))

    def __ror__(self, o: Any) -> Any:
        return self._tracer.bitwise("logical_or", (o, self))

    def __invert__(self) -> Any:
        return self._tracer.bitwise("logical_not", (self,))

    def __xor__(self, o: Any) -> Any:
        return self._op("logical_xor", self, o)

    def __rxor__(self, o: Any) -> Any:
        return self._op("logical_xor", o, self)

    def _no_integer_op(self, *_: Any) -> Any:
        raise UnsupportedOpError(
            "//, %, divmod(), Python's round() and shifts on a traced value are not supported in "
            "epilogues (torch.round(x) is; docs/epilogues.md lists the ops)",
            user_location(),
        )

    __floordiv__ = __rfloordiv__ = __ifloordiv__ = __mod__ = __rmod__ = __imod__ = _no_integer_op
    __divmod__ = __rdivmod__ = __round__ = __lshift__ = __rshift__ = _no_integer_op

    __hash__ = object.__hash__

    # In-place operators: allowed on intermediates (rebinding), an error on inputs.
    def __iadd__(self, o: Any) -> Any:
        return self._assign(self.__add__(o), "+=")

    def __isub__(self, o: Any) -> Any:
        return self._assign(self.__sub__(o), "-=")

    def __imul__(self, o: Any) -> Any:
        return self._assign(self.__mul__(o), "*=")

    def __itruediv__(self, o: Any) -> Any:
        return self._assign(self.__truediv__(o), "/=")

    def __ipow__(self, o: Any) -> Any:
        return self._assign(self.__pow__(o), "**=")

    # In place on a mask: torch's |=, &= and ^= change the tensor, and so every alias of it.
    def __iand__(self, o: Any) -> Any:
        return self._assign(self.__and__(o), "&=")

    def __ior__(self, o: Any) -> Any:
        return self._assign(self.__or__(o), "|=")

    def __ixor__(self, o: Any) -> Any:
        return self._assign(self.__xor__(o), "^=")

    # --- what cannot be traced -------------------------------------------------------------------
    def __bool__(self) -> bool:
        if self._node.is_python_scalar:
            # A comparison of runtime scalars (max(alpha, 1e-6), `if alpha > 0:`): no tile value
            # is involved, so torch.where is not the answer; the host is.
            raise ControlFlowError(
                "`if`, `while`, `and`/`or`, bool(), max() or min() on a runtime scalar (an epilogue "
                "argument), whose value is only known at the call: compute it before the call and "
                "pass the result, or make the parameter a compile-time constant (a default left out "
                "of the example inputs)", user_location())
        raise _control_flow_error("`if`, `while`, `and`/`or` or bool()")

    def _scalar_in_python(self, what: str) -> ControlFlowError:
        if self._node.is_python_scalar and self._input_name is not None:
            return ControlFlowError(
                f"{what} on runtime scalar {self._input_name!r}: its value is only known when the "
                "kernel runs, so Python math on it (math.exp, float(), ...) cannot be traced; use "
                "torch ops on tensors, or pass a bool/None or a parameter default for a constant",
                user_location(),
            )
        return _control_flow_error(what)

    def __float__(self) -> float:
        math_call = python_math_call()
        if math_call is not None and not self._node.is_python_scalar:
            torch_name = "torch." + math_call.rsplit(".", 1)[-1]
            raise ControlFlowError(
                f"{math_call}() works on Python numbers, and a traced value is a tile whose values are "
                f"only known on the GPU: use torch's function ({torch_name}(x) if torch has it)",
                user_location())
        raise self._scalar_in_python("float()")

    def __int__(self) -> int:
        raise self._scalar_in_python("int()")

    def __index__(self) -> int:
        raise _control_flow_error("use as an index")

    def __len__(self) -> int:
        # len() must give a Python int, and the sizes are known only per call.
        raise ControlFlowError(
            "len() of a traced value: its first size is a problem size known only at run time, which "
            "len() cannot return as a Python int; use x.shape[0] (or "
            "x.size(0)), which works in arithmetic (acc / acc.shape[0])", user_location())

    def __iter__(self) -> Any:
        raise UnsupportedOpError(
            "iterating over a traced value (or unpacking it) is not supported: epilogues work on "
            "whole tiles",
            user_location(),
        )

    def __matmul__(self, o: Any) -> Any:
        raise unsupported("@")

    __rmatmul__ = __imatmul__ = __matmul__

    def __getitem__(self, index: Any) -> Any:
        raise UnsupportedOpError(
            "indexing and slicing (x[...]) are not supported in epilogues: they work on whole tiles",
            user_location(),
        )

    def __setitem__(self, index: Any, value: Any) -> None:
        raise InPlaceError(
            "item assignment (x[...] = ...) is not supported: use torch.where to select values",
            user_location(),
        )

    def __repr__(self) -> str:
        return f"TracedValue({self._node.op}, dtype={self.dtype}, shape={self._node.shape})"

    def item(self) -> Any:
        raise _control_flow_error(".item()")

    def tolist(self) -> Any:
        raise _control_flow_error(".tolist()")


def _find_tracer(args: Any, kwargs: Any) -> Tracer:
    def search(obj: Any) -> Tracer | None:
        if isinstance(obj, TracedValue):
            return obj._tracer
        if isinstance(obj, list | tuple):
            for o in obj:
                found = search(o)
                if found is not None:
                    return found
        return None

    for obj in (*args, *kwargs.values()):
        found = search(obj)
        if found is not None:
            return found
    raise RuntimeError("__torch_function__ called without a traced value")  # pragma: no cover
