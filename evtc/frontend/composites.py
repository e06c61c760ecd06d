"""torch functions that evtc writes out with the IR's own ops, as torch defines them.

None of these needs an op of its own in the kernel: each is a few elementwise ops (``F.selu`` is a
``where`` of ``x`` and ``expm1``), a choice (``masked_fill``), a no-op on values (``contiguous``;
``detach``, which only stops the gradient) or a test of the value against itself (``isnan``). The
formulas are torch's, branch for branch, so values, NaN and infinities come out as torch's do (up
to float32 rounding).
Importing this module registers them with :mod:`evtc.frontend.lowering`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import sympy
import torch
import torch.nn.functional as F

from ..errors import DTypeError, UnsupportedOpError
from ..ir.shapes import N
from .eager_dtypes import NUMBER
from .lowering import (
    FUNCTIONS,
    _halves,
    _last_dim,
    _maybe_inplace,
    _reject_out,
    _rounded_once,
    cast_to,
    register,
)
from .proxy import TracedValue
from .source import user_location

if TYPE_CHECKING:
    from .tracer import Tracer

_INF = math.inf
_SIXTEEN_BIT = (torch.float16, torch.bfloat16)


def _overflow_bound(value: Any) -> float:
    """Where torch's value overflows: a value that reads as float16 or bfloat16 (an accumulator of
    float16 a and b is one) is infinite in torch from half a unit past the dtype's largest value
    (a tie rounds to the even neighbour, infinity), though evtc holds it in float32; inf for
    float32."""
    dtype = value.dtype if isinstance(value, TracedValue) else torch.float32
    if dtype not in _SIXTEEN_BIT:
        return _INF
    info = torch.finfo(dtype)
    top_unit = 2.0 ** math.floor(math.log2(info.max)) * info.eps
    return info.max + top_unit / 2


def _refuse_masks(t: Tracer, name: str, *values: Any, every: bool = False) -> None:
    """torch does not define ``name`` for bool tensors ("not implemented for 'Bool'"): a mask
    among ``values`` (with ``every``, ``values`` all masks) is refused, as torch refuses it, where
    evtc's formula would compute on it."""
    masks = [isinstance(v, TracedValue) and t.node_of(v).dtype == torch.bool for v in values]
    if all(masks) if every else any(masks):
        raise DTypeError(f"{name} of a boolean mask, which torch refuses: convert the mask with "
                         ".float() first", user_location())


# --- no-ops on values -------------------------------------------------------------------------
def _positive(t: Tracer, input: Any) -> Any:
    """torch.positive: x itself, refused for a mask as torch refuses ``+mask``."""
    _refuse_masks(t, "positive", input)
    return input


def _itself(t: Tracer, input: Any, *args: Any, memory_format: Any = None, **kwargs: Any) -> Any:
    """x.contiguous(): x itself (torch returns the same memory), so an in-place op
    on one changes the other, as in torch."""
    return input


def _detach(t: Tracer, input: Any) -> Any:
    """x.detach(): the same values, through which no gradient flows (a ``detach`` node, where the
    backward graph stops; the kernel passes the value on). torch returns x's own memory, so an
    in-place op on either would change both, which the graph cannot say: it is refused."""
    if not isinstance(input, TracedValue) or t.node_of(input).dtype == torch.bool:
        return input  # a mask or a number carries no gradient
    result = t.emit("detach", (input,))
    result._shares_memory = "a detached value (x.detach() shares x's memory)"
    if input._input_name is None:
        input._shares_memory = "a value that was detached (x.detach() shares x's memory)"
    return result


def _clone(t: Tracer, input: Any, *, memory_format: Any = None) -> Any:
    """A copy: the same value, in memory of its own (an in-place op on it leaves ``input``)."""
    return t.wrap(t.node_of(input))


# --- choices --------------------------------------------------------------------------------
def _masked_fill(t: Tracer, input: Any, mask: Any, value: Any) -> Any:
    """x.masked_fill(mask, value): value where mask is True (in x's dtype, as torch casts it)."""
    if isinstance(value, TracedValue) and value.dim() > 0:
        raise UnsupportedOpError(f"masked_fill's value must be a number or a 0-dim tensor (torch refuses a "
                                 f"tensor of shape {tuple(value._node.shape)})", user_location())
    if t.node_of(input).dtype == torch.bool:
        # A mask stays a mask: the value is cast to bool (value != 0), as torch casts it.
        if isinstance(value, int | float):
            if value:
                return t.emit("logical_or", (input, mask))
            return t.emit("logical_and", (input, t.emit("logical_not", (mask,))))
        value = t.emit("ne", (value, 0.0))
    return t.emit("where", (mask, value, input))


def _nan_to_num(t: Tracer, input: Any, nan: float = 0.0, posinf: float | None = None,
                neginf: float | None = None, **kwargs: Any) -> Any:
    """torch.nan_to_num: NaN, +inf and -inf replaced; the infinities by default with the largest
    finite values of the value's dtype (bfloat16's for a bfloat16 value, as in torch)."""
    _reject_out(kwargs, "nan_to_num")
    dtype = t.node_of(input).dtype if isinstance(input, TracedValue) else None
    if dtype is not None and not dtype.is_floating_point:
        # A mask or an integer holds no NaN or infinity: torch returns a copy of it as it is.
        return t.wrap(t.node_of(input))
    info = torch.finfo(input.dtype if isinstance(input, TracedValue) else torch.float32)
    posinf = info.max if posinf is None else posinf
    neginf = info.min if neginf is None else neginf
    bound = _overflow_bound(input)  # what torch's value would hold as +-inf
    result = t.emit("where", (t.emit("le", (input, -bound)), neginf, input))
    result = t.emit("where", (t.emit("ge", (input, bound)), posinf, result))
    return t.emit("where", (t.emit("ne", (input, input)), nan, result))


# --- tests of values ------------------------------------------------------------------------
def _isnan(t: Tracer, input: Any) -> Any:
    return t.emit("ne", (input, input))


# The infinity tests take the bound where torch's value overflows (see _overflow_bound): +-inf for
# float32, half a unit past the largest value for one that reads as float16 or bfloat16.
def _isinf(t: Tracer, input: Any) -> Any:
    return t.emit("ge", (t.emit("abs", (input,)), _overflow_bound(input)))


def _isfinite(t: Tracer, input: Any) -> Any:
    return t.emit("lt", (t.emit("abs", (input,)), _overflow_bound(input)))  # NaN < bound is False


def _isposinf(t: Tracer, input: Any, **kwargs: Any) -> Any:
    _reject_out(kwargs, "isposinf")
    return t.emit("ge", (input, _overflow_bound(input)))


def _isneginf(t: Tracer, input: Any, **kwargs: Any) -> Any:
    _reject_out(kwargs, "isneginf")
    return t.emit("le", (input, -_overflow_bound(input)))


# --- arithmetic -----------------------------------------------------------------------------
def _is_one(value: Any) -> bool:
    return isinstance(value, int | float) and value == 1


def _rsub(t: Tracer, input: Any, other: Any, *, alpha: Any = 1) -> Any:
    """torch.rsub(x, other, alpha): other - alpha * x, rounded once."""
    if _is_one(alpha):
        return t.emit("sub", (other, input))
    return _rounded_once(t, (input, other, alpha),
                         lambda x, o, a: t.emit("sub", (o, t.emit("mul", (a, x)))))


def _addcmul(t: Tracer, input: Any, tensor1: Any, tensor2: Any, *, value: Any = 1, **kwargs: Any) -> Any:
    """torch.addcmul: input + value * (tensor1 * tensor2), in the order of torch's CUDA kernel
    (its CPU kernel multiplies value * tensor1 first: the two differ at the edge of float32's
    range), rounded once."""
    _reject_out(kwargs, "addcmul")
    # torch refuses three masks; a mask beside a value promotes.
    _refuse_masks(t, "addcmul", input, tensor1, tensor2, every=True)

    def formula(x, t1, t2, v):
        product = t.emit("mul", (t1, t2))
        return t.emit("add", (x, product if _is_one(v) else t.emit("mul", (v, product))))

    return _rounded_once(t, (input, tensor1, tensor2, value), formula)


def _addcdiv(t: Tracer, input: Any, tensor1: Any, tensor2: Any, *, value: Any = 1, **kwargs: Any) -> Any:
    """torch.addcdiv: input + value * (tensor1 / tensor2), rounded once."""
    _reject_out(kwargs, "addcdiv")

    def formula(x, t1, t2, v):
        quotient = t.emit("div", (t1, t2))
        return t.emit("add", (x, quotient if _is_one(v) else t.emit("mul", (v, quotient))))

    return _rounded_once(t, (input, tensor1, tensor2, value), formula)


def _lerp(t: Tracer, input: Any, end: Any, weight: Any, **kwargs: Any) -> Any:
    """torch.lerp, by torch's two formulas: start + w * (end - start) where |w| < 0.5, else
    end - (end - start) * (1 - w) (exact at w = 1); rounded once."""
    _reject_out(kwargs, "lerp")
    # torch requires end in input's dtype, and a weight tensor too unless it is 0-dim.
    tensors = [v for v in (input, end, weight) if isinstance(v, TracedValue) and not v._node.is_python_scalar
               and (v is not weight or len(v._node.shape) > 0)]
    dtypes = {t.eager.dtype(v._node) for v in tensors}
    if len(dtypes) > 1:
        raise UnsupportedOpError(f"lerp of tensors of dtypes {sorted(map(str, dtypes))}, which torch "
                                 "refuses: cast them to one dtype first", user_location())

    def formula(start, stop, w):
        diff = t.emit("sub", (stop, start))
        low = t.emit("add", (start, t.emit("mul", (w, diff))))
        high = t.emit("sub", (stop, t.emit("mul", (diff, t.emit("sub", (1.0, w))))))
        if isinstance(w, int | float):
            return low if abs(w) < 0.5 else high
        return t.emit("where", (t.emit("lt", (t.emit("abs", (w,)), 0.5)), low, high))

    return _rounded_once(t, (input, end, weight), formula)


def _xlogy(t: Tracer, input: Any, other: Any, **kwargs: Any) -> Any:
    """torch.xlogy: x * log(y), 0 where x is 0 (log(0) notwithstanding), NaN where y is NaN."""
    _reject_out(kwargs, "xlogy")

    def formula(x, y):
        product = t.emit("where", (t.emit("eq", (x, 0.0)), 0.0, t.emit("mul", (x, t.emit("log", (y,))))))
        return t.emit("where", (_isnan(t, y), y, product))

    return _rounded_once(t, (input, other), formula)


def _logaddexp_by(name: str, exp: str, log_scale: float) -> Any:
    """torch.logaddexp (exp, scale 1) and logaddexp2 (exp2, 1 / log(2)): max + log1p(exp(-|a - b|))
    * scale, and a itself where a and b are the same infinity (whose difference is NaN)."""
    def handler(t: Tracer, input: Any, other: Any, **kwargs: Any) -> Any:
        _reject_out(kwargs, name)

        def formula(a, b):
            distance = t.emit("abs", (t.emit("sub", (a, b)),))
            tail = t.emit("log1p", (t.emit(exp, (t.emit("neg", (distance,)),)),))
            if log_scale != 1:
                tail = t.emit("mul", (tail, log_scale))
            same_infinity = t.emit("logical_and", (_isinf(t, a), t.emit("eq", (a, b))))
            return t.emit("where", (same_infinity, a, t.emit("add", (t.emit("maximum", (a, b)), tail))))

        return _rounded_once(t, (input, other), formula)

    return handler


def _nan_ignoring(extremum: str) -> Any:
    """torch.fmax / fmin: the other value where one is NaN, else maximum / minimum."""
    def handler(t: Tracer, input: Any, other: Any, **kwargs: Any) -> Any:
        _reject_out(kwargs, f"f{extremum[:3]}")

        def formula(a, b):
            both = t.emit(extremum, (a, b))
            either = t.emit("where", (_isnan(t, b), a, both))
            return t.emit("where", (_isnan(t, a), b, either))

        return _rounded_once(t, (input, other), formula)

    return handler


def _scaled_by(name: str, factor: float) -> Any:
    """torch.deg2rad and rad2deg: the value times the constant."""
    def handler(t: Tracer, input: Any, **kwargs: Any) -> Any:
        _reject_out(kwargs, name)
        return t.emit("mul", (input, factor))

    return handler


# --- functions of exp, log, sin and cos -----------------------------------------------------
# From this |x| on, sinh and cosh are e^|x| / 2 to within a part in e^40 (e^-|x| is far below an
# ulp of it), computed as a product of two halves so that they overflow only where torch's do.
_HYPERBOLIC_LARGE = 20.0


def _log10(t: Tracer, input: Any, **kwargs: Any) -> Any:
    """torch.log10: log2(x) * log10(2), rounded once (a few ulp; torch's own log10 is one rounding)."""
    _reject_out(kwargs, "log10")
    return _rounded_once(t, (input,), lambda x: t.emit("mul", (t.emit("log2", (x,)), math.log10(2.0))))


def _tan(t: Tracer, input: Any, **kwargs: Any) -> Any:
    """torch.tan: sin(x) / cos(x), rounded once (a few ulp; no float32 x is a pole, and NaN for an
    infinity, as torch gives)."""
    _reject_out(kwargs, "tan")
    return _rounded_once(t, (input,), lambda x: t.emit("div", (t.emit("sin", (x,)), t.emit("cos", (x,)))))


def _hyperbolic(name: str) -> Any:
    """torch.sinh and cosh, rounded once. Up to |x| = 20: (expm1(x) - expm1(-x)) / 2 for sinh, which
    keeps a small x's digits, and (e^x + e^-x) / 2 for cosh. Beyond: e^(|x|/2) / 2 * e^(|x|/2) (with
    x's sign for sinh), finite up to where torch's value overflows, where e^|x| alone would overflow
    from |x| = 88.7. Each branch sees 0 where it is not taken, so neither puts an infinity (or a NaN
    times 0) into the other's gradient."""
    def handler(t: Tracer, input: Any, **kwargs: Any) -> Any:
        _reject_out(kwargs, name)

        def formula(x):
            magnitude = t.emit("abs", (x,))
            large = t.emit("gt", (magnitude, _HYPERBOLIC_LARGE))
            near = t.emit("where", (large, 0.0, x))
            if name == "sinh":
                ends = t.emit("sub", (t.emit("expm1", (near,)), t.emit("expm1", (t.emit("neg", (near,)),))))
            else:
                ends = t.emit("add", (t.emit("exp", (near,)), t.emit("exp", (t.emit("neg", (near,)),))))
            small = t.emit("mul", (ends, 0.5))
            half = t.emit("exp", (t.emit("mul", (t.emit("where", (large, magnitude, 0.0)), 0.5)),))
            far = t.emit("mul", (t.emit("mul", (half, 0.5)), half))
            if name == "sinh":
                far = t.emit("where", (t.emit("lt", (x, 0.0)), t.emit("neg", (far,)), far))
            return t.emit("where", (large, far, small))

        return _rounded_once(t, (input,), formula)

    return handler


def _logit(t: Tracer, input: Any, eps: Any = None, **kwargs: Any) -> Any:
    """torch.logit: log(z / (1 - z)), z = x clamped to [eps, 1 - eps] where eps >= 0 is given (both
    bounds in float32, as torch's kernel computes them), rounded once."""
    _reject_out(kwargs, "logit")
    if eps is not None and (isinstance(eps, bool) or not isinstance(eps, int | float)):
        got = "a runtime value or tensor" if isinstance(eps, TracedValue | torch.Tensor) else repr(eps)
        raise UnsupportedOpError(f"logit's eps must be a number written in the epilogue or None (got {got})",
                                 user_location())
    if isinstance(input, TracedValue) and not t.node_of(input).dtype.is_floating_point:
        input = t.emit("cast", (input,), {"dtype": torch.float32})  # torch takes a mask's logit in float32
    bounds = None
    if eps is not None and eps >= 0:
        lo = torch.tensor(float(eps), dtype=torch.float32)
        bounds = (float(lo), float(torch.tensor(1.0, dtype=torch.float32) - lo))

    def formula(x):
        z = x if bounds is None else t.emit("clamp_max", (t.emit("clamp_min", (x, bounds[0])), bounds[1]))
        return t.emit("log", (t.emit("div", (z, t.emit("sub", (1.0, z)))),))

    return _rounded_once(t, (input,), formula)


def _sinc(t: Tracer, input: Any, **kwargs: Any) -> Any:
    """torch.sinc: sin(pi x) / (pi x), 1 at 0, rounded once. The quotient sees 1 where x is 0, so
    its 0 / 0 reaches neither the value nor the gradient (torch's is 0 there)."""
    _reject_out(kwargs, "sinc")

    def formula(x):
        zero = t.emit("eq", (x, 0.0))
        product = t.emit("mul", (t.emit("where", (zero, 1.0, x)), math.pi))
        return t.emit("where", (zero, 1.0, t.emit("div", (t.emit("sin", (product,)), product))))

    return _rounded_once(t, (input,), formula)


# --- to integer values ----------------------------------------------------------------------
def _round(t: Tracer, input: Any, *, decimals: Any = 0, **kwargs: Any) -> Any:
    """torch.round: to the nearest integer, a tie to the even one; with ``decimals`` d, as torch:
    round(x * 10^d) / 10^d for d > 0, round(x / 10^-d) * 10^-d for d < 0, rounded once."""
    _reject_out(kwargs, "round")
    if not isinstance(decimals, int) or isinstance(decimals, bool):
        raise UnsupportedOpError(f"round's decimals must be an int (got {decimals!r})", user_location())
    if decimals == 0:
        return t.emit("round", (input,))
    _refuse_masks(t, "round", input)
    scale = 10.0 ** abs(decimals) if abs(decimals) <= 308 else _INF  # torch's 10^d overflows to inf too

    def formula(x):
        if decimals > 0:
            return t.emit("div", (t.emit("round", (t.emit("mul", (x, scale)),)), scale))
        return t.emit("mul", (t.emit("round", (t.emit("div", (x, scale)),)), scale))

    return _rounded_once(t, (input,), formula)


def _frac(t: Tracer, input: Any, **kwargs: Any) -> Any:
    """torch.frac: x - trunc(x) (NaN for an infinity), rounded once."""
    _reject_out(kwargs, "frac")
    return _rounded_once(t, (input,), lambda x: t.emit("sub", (x, t.emit("trunc", (x,)))))


def _sign(t: Tracer, input: Any, **kwargs: Any) -> Any:
    """torch.sign (and sgn, for real values): 1, -1 or 0; 0 for NaN, as torch gives; a mask's sign
    is the mask."""
    _reject_out(kwargs, "sign")
    node = t.node_of(input)
    if node.dtype == torch.bool:
        return input
    negative = t.emit("where", (t.emit("lt", (input, 0.0)), -1.0, 0.0))
    result = t.emit("where", (t.emit("gt", (input, 0.0)), 1.0, negative))
    # Built of numbers, the selection would read float32 to torch's promotion: sign keeps x's dtype,
    # a 16-bit value's as a cast (so that what follows rounds as torch's 16-bit ops do).
    if node.dtype in (torch.float16, torch.bfloat16):
        return t.emit("cast", (result,), {"dtype": node.dtype})
    t.eager.same_as(result._node, node)
    return result


# --- activations ----------------------------------------------------------------------------
def _refuse_a_tensor(name: str, what: str, number: Any) -> None:
    """A parameter torch takes only as a number (a runtime scalar or a 0-dim tensor passes)."""
    if isinstance(number, TracedValue) and number.dim() > 0:
        raise UnsupportedOpError(f"{name}'s {what} must be a number (torch refuses a tensor)",
                                 user_location())


def _threshold(t: Tracer, input: Any, threshold: Any, value: Any, inplace: bool = False) -> Any:
    """F.threshold: value where x <= threshold, else x (NaN stays NaN), in x's dtype."""
    _refuse_masks(t, "threshold", input)
    _refuse_a_tensor("threshold", "threshold", threshold)
    _refuse_a_tensor("threshold", "value", value)

    def formula(x):
        return t.emit("where", (t.emit("le", (x, threshold)), value, x))

    return _maybe_inplace(t, input, _rounded_once(t, (input,), formula), inplace, "threshold")


def _shrink_band(t: Tracer, lambd: Any, name: str, refuse_negative: bool) -> Any:
    """The band's lower edge, -lambd, once lambd is checked as torch checks it."""
    _refuse_a_tensor(name, "lambd", lambd)
    if refuse_negative and isinstance(lambd, int | float) and lambd < 0:
        raise UnsupportedOpError(f"{name} with lambd = {lambd}, which torch refuses (lambd >= 0)",
                                 user_location())
    return -lambd if isinstance(lambd, int | float) else t.emit("neg", (lambd,))


def _hardshrink(t: Tracer, input: Any, lambd: Any = 0.5) -> Any:
    """F.hardshrink: 0 where -lambd <= x <= lambd, else x (NaN stays NaN)."""
    _refuse_masks(t, "hardshrink", input)
    low = _shrink_band(t, lambd, "hardshrink", refuse_negative=False)

    def formula(x):
        inside = t.emit("logical_and", (t.emit("ge", (x, low)), t.emit("le", (x, lambd))))
        return t.emit("where", (inside, 0.0, x))

    return _rounded_once(t, (input,), formula)


def _softshrink(t: Tracer, input: Any, lambd: Any = 0.5) -> Any:
    """F.softshrink: x - lambd above lambd, x + lambd below -lambd, else x * 0 (a signed zero,
    NaN for NaN), as torch's kernel; rounded once."""
    low = _shrink_band(t, lambd, "softshrink", refuse_negative=True)

    def formula(x):
        below = t.emit("where", (t.emit("lt", (x, low)), t.emit("add", (x, lambd)), t.emit("mul", (x, 0.0))))
        return t.emit("where", (t.emit("gt", (x, lambd)), t.emit("sub", (x, lambd)), below))

    return _rounded_once(t, (input,), formula)


def _tanhshrink(t: Tracer, input: Any) -> Any:
    """F.tanhshrink: x - tanh(x), rounded once."""
    return _rounded_once(t, (input,), lambda x: t.emit("sub", (x, t.emit("tanh", (x,)))))


def _prelu(t: Tracer, input: Any, weight: Any) -> Any:
    """F.prelu: x where x > 0, else weight * x. torch reads the weight along dim 1: an (M, N) value's
    N columns (a weight of N values is a row vector) or one value for all."""
    # A one-element tensor the function makes (torch.tensor([0.25])) is a literal that reads as a
    # tensor to torch; a Python number or a runtime scalar is not a tensor.
    if isinstance(weight, torch.Tensor) and not isinstance(weight, TracedValue):
        weight = t.wrap(t.node_of(weight))  # (node_of names a tensor that cannot be a constant)
    if not isinstance(weight, TracedValue) or weight._node.is_python_scalar \
            and t.eager.of(weight._node).rank_class == NUMBER:
        raise UnsupportedOpError("prelu's weight must be a tensor (torch refuses a number): pass it as an "
                                 "operand of the epilogue", user_location())
    if t.eager.dtype(weight._node) != t.eager.dtype(t.node_of(input)):
        raise UnsupportedOpError(f"prelu of a {t.eager.dtype(t.node_of(input))} value by a "
                                 f"{t.eager.dtype(weight._node)} weight, which torch refuses (it does not "
                                 "promote): cast one to the other's dtype", user_location())
    shape, value_shape = weight._node.shape, t.node_of(input).shape
    one_value = all(sympy.sympify(d) == 1 for d in shape)
    columns = len(shape) == 1 and len(value_shape) == 2 and sympy.sympify(shape[0] - value_shape[1]) == 0
    if not (one_value or columns):
        raise UnsupportedOpError(
            f"prelu of a {len(value_shape)}-dim value by a weight of shape {list(shape)}: torch applies the "
            "weight along dim 1, which evtc takes as one value for all or the N columns of an (M, N) value",
            user_location())

    def formula(x, w):
        return t.emit("where", (t.emit("gt", (x, 0.0)), x, t.emit("mul", (w, x))))

    return _rounded_once(t, (input, weight), formula)


def _heaviside(t: Tracer, input: Any, values: Any, **kwargs: Any) -> Any:
    """torch.heaviside: values where x is 0, 1 where x > 0, else 0 (0 for NaN, as torch)."""
    _reject_out(kwargs, "heaviside")
    if not isinstance(values, TracedValue) or values._node.is_python_scalar:
        raise UnsupportedOpError("heaviside's values must be a tensor (torch refuses a number): pass it as "
                                 "an operand of the epilogue", user_location())
    if t.eager.dtype(values._node) != t.eager.dtype(t.node_of(input)):
        raise UnsupportedOpError("heaviside of tensors of different dtypes, which torch refuses: cast them "
                                 "to one dtype first", user_location())

    def formula(x, v):
        step = t.emit("where", (t.emit("gt", (x, 0.0)), 1.0, 0.0))
        return t.emit("where", (t.emit("eq", (x, 0.0)), v, step))

    result = _rounded_once(t, (input, values), formula)
    # The step's numbers would read float32 to torch's promotion: heaviside keeps x's dtype.
    t.eager.same_as(result._node, t.node_of(input))
    return result


_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946


def _selu(t: Tracer, input: Any, inplace: bool = False) -> Any:
    """F.selu: scale * x where x > 0, else scale * alpha * (exp(x) - 1), rounded once."""
    _refuse_masks(t, "selu", input)
    def formula(x):
        negative = t.emit("mul", (_SELU_SCALE * _SELU_ALPHA, t.emit("expm1", (x,))))
        return t.emit("where", (t.emit("gt", (x, 0.0)), t.emit("mul", (_SELU_SCALE, x)), negative))

    return _maybe_inplace(t, input, _rounded_once(t, (input,), formula), inplace, "selu")


def _celu(t: Tracer, input: Any, alpha: float = 1.0, inplace: bool = False) -> Any:
    """F.celu: x where x > 0, else alpha * (exp(x / alpha) - 1), rounded once."""
    _refuse_masks(t, "celu", input)
    if isinstance(alpha, int | float) and alpha == 0:
        raise UnsupportedOpError("celu with alpha = 0, which torch refuses (it divides by alpha)",
                                 user_location())

    def formula(x):
        negative = t.emit("mul", (alpha, t.emit("expm1", (t.emit("div", (x, alpha)),))))
        return t.emit("where", (t.emit("gt", (x, 0.0)), x, negative))

    return _maybe_inplace(t, input, _rounded_once(t, (input,), formula), inplace, "celu")


def _logsigmoid(t: Tracer, input: Any) -> Any:
    """F.logsigmoid, as torch computes it without overflow: min(x, 0) - log1p(exp(-|x|)), rounded
    once."""
    def formula(x):
        tail = t.emit("log1p", (t.emit("exp", (t.emit("neg", (t.emit("abs", (x,)),)),)),))
        return t.emit("sub", (t.emit("minimum", (x, 0.0)), tail))

    return _rounded_once(t, (input,), formula)


def _softsign(t: Tracer, input: Any) -> Any:
    """F.softsign: x / (1 + |x|)."""
    return t.emit("div", (input, t.emit("add", (1.0, t.emit("abs", (input,))))))


def _glu(t: Tracer, input: Any, dim: int = -1) -> Any:
    """F.glu over the last dim: the first half times the sigmoid of the second."""
    _last_dim(t, input, dim, "glu")
    if t.problem.sizes[N] % 2:
        raise UnsupportedOpError(f"glu of N = {t.problem.sizes[N]} columns: it halves the last dim, which "
                                 "must be even (torch refuses an odd one)", user_location())

    def formula(x):
        first, second = _halves(t, x, "glu")
        return t.emit("mul", (first, t.emit("sigmoid", (second,))))

    return _rounded_once(t, (input,), formula)  # one kernel in torch: one rounding


def _dropout(t: Tracer, input: Any, p: float = 0.5, training: bool = True, inplace: bool = False) -> Any:
    """F.dropout: the value itself where it drops nothing (training=False, as in a model's eval
    mode, or p = 0); random masks are not something one kernel call can reproduce."""
    if not isinstance(p, int | float) or isinstance(p, bool) or not 0 <= p <= 1:
        # torch refuses it whatever training is
        raise UnsupportedOpError(f"dropout probability has to be a number between 0 and 1, but got {p!r}",
                                 user_location())
    if not training or p == 0:
        return input
    raise UnsupportedOpError(
        f"dropout(p={p}, training=True) draws a random mask, which the kernel does not: pass "
        "training=False (evaluation), or apply dropout outside the kernel", user_location())


register([], ["contiguous"], _itself, inplace=False)
register([torch.detach], ["detach"], _detach, inplace=False)
register([torch.clone], ["clone"], _clone, inplace=False)
register([torch.masked_fill], ["masked_fill"], _masked_fill)
register([torch.nan_to_num], ["nan_to_num"], _nan_to_num)
register([torch.isnan], ["isnan"], _isnan, inplace=False)
register([torch.isinf], ["isinf"], _isinf, inplace=False)
register([torch.isfinite], ["isfinite"], _isfinite, inplace=False)
register([torch.isposinf], ["isposinf"], _isposinf, inplace=False)
register([torch.isneginf], ["isneginf"], _isneginf, inplace=False)
register([torch.rsub], [], _rsub, inplace=False)
register([torch.addcmul], ["addcmul"], _addcmul)
register([torch.addcdiv], ["addcdiv"], _addcdiv)
register([torch.lerp], ["lerp"], _lerp)
register([F.selu, torch.selu], [], _selu, inplace=False)
register([F.celu, torch.celu], [], _celu, inplace=False)
register([F.logsigmoid], [], _logsigmoid, inplace=False)
register([F.softsign], [], _softsign, inplace=False)
register([F.glu], [], _glu, inplace=False)
register([F.dropout], [], _dropout, inplace=False)
register([torch.xlogy, torch.special.xlogy], ["xlogy"], _xlogy)
register([torch.logaddexp], ["logaddexp"], _logaddexp_by("logaddexp", "exp", 1.0), inplace=False)
register([torch.logaddexp2], ["logaddexp2"], _logaddexp_by("logaddexp2", "exp2", 1 / math.log(2)),
         inplace=False)
register([torch.fmax], ["fmax"], _nan_ignoring("maximum"), inplace=False)
register([torch.fmin], ["fmin"], _nan_ignoring("minimum"), inplace=False)
register([torch.deg2rad], ["deg2rad"], _scaled_by("deg2rad", math.pi / 180))
register([torch.rad2deg], ["rad2deg"], _scaled_by("rad2deg", 180 / math.pi))
register([torch.positive], ["positive"], _positive, inplace=False)
register([torch.log10], ["log10"], _log10)
register([torch.tan], ["tan"], _tan)
register([torch.sinh], ["sinh"], _hyperbolic("sinh"))
register([torch.cosh], ["cosh"], _hyperbolic("cosh"))
register([torch.logit, torch.special.logit], ["logit"], _logit)
register([torch.sinc, torch.special.sinc], ["sinc"], _sinc)
register([torch.round], ["round"], _round)
register([torch.frac], ["frac"], _frac)
register([torch.sign, torch.sgn], ["sign", "sgn"], _sign)
register([F.threshold, torch.threshold], [], _threshold, inplace=False)
register([F.hardshrink, torch.hardshrink], ["hardshrink"], _hardshrink, inplace=False)
register([F.softshrink], [], _softshrink, inplace=False)
register([F.tanhshrink], [], _tanhshrink, inplace=False)
register([F.prelu, torch.prelu], ["prelu"], _prelu, inplace=False)
register([torch.heaviside], ["heaviside"], _heaviside)


# --- in-place functions -----------------------------------------------------------------------
def _in_place(handler: Any, name: str) -> Any:
    """``torch.relu_(x)``, ``F.elu_(x)``: the function's value assigned to x, as x.relu_() does."""
    def handler_in_place(t: Tracer, input: Any, *args: Any, **kwargs: Any) -> Any:
        return t.assign(input, handler(t, input, *args, **kwargs), name)

    return handler_in_place


def _register_in_place_functions() -> None:
    """Every ``torch.f_`` and ``F.f_`` whose ``f`` is supported, registered last (after lowering's
    and this module's functions)."""
    for namespace in (torch, F):
        for name in dir(namespace):
            if not name.endswith("_") or name.startswith("_"):
                continue
            function, base = getattr(namespace, name), getattr(namespace, name[:-1], None)
            if callable(function) and base in FUNCTIONS and function not in FUNCTIONS:
                FUNCTIONS[function] = _in_place(FUNCTIONS[base], f"{name}")


_register_in_place_functions()


# --- vector norms: reductions of |x| ---------------------------------------------------------------
_NORM_DTYPES = (None, torch.float32, *_SIXTEEN_BIT)


def _vector_norm(t: Tracer, name: str, input: Any, order: Any, dim: Any, keepdim: bool, dtype: Any) -> Any:
    """The p-norm of ``input`` over ``dim`` (all of it for None) as torch computes it: in float32
    (2 and 1: the sum of squares or of magnitudes; inf and -inf: the largest or smallest magnitude,
    exact), rounded once to ``dtype`` or else the input's dtype. Other orders are refused by name."""
    if not isinstance(input, TracedValue):
        raise UnsupportedOpError(f"{name} of a number: it takes a tensor of the epilogue", user_location())
    _refuse_masks(t, name, input)
    if dtype not in _NORM_DTYPES:
        raise DTypeError(f"{name}(dtype={dtype}): norms are computed in float32 and rounded to "
                         "float32, float16 or bfloat16", user_location())
    magnitude = t.emit("abs", (cast_to(t, input, torch.float32),))
    if order in ("fro", 2):
        value = t.emit("sqrt", (t.reduce(t.emit("mul", (magnitude, magnitude)), "sum", dim, keepdim,
                                         dtype=torch.float32),))
    elif order == 1:
        value = t.reduce(magnitude, "sum", dim, keepdim, dtype=torch.float32)
    elif order in (_INF, -_INF):
        value = t.reduce(magnitude, "max" if order > 0 else "min", dim, keepdim, dtype=torch.float32)
    else:
        raise UnsupportedOpError(f"{name} of order {order!r}: epilogues compute the 2-norm ('fro'), the "
                                 "1-norm and the inf and -inf norms (reductions of |x| over rows, "
                                 "columns or the whole tile)", user_location())
    return cast_to(t, value, dtype or input.dtype)


def _norm(t: Tracer, input: Any, p: Any = "fro", dim: Any = None, keepdim: bool = False, *,
          dtype: Any = None, **kwargs: Any) -> Any:
    """torch.norm / Tensor.norm of a vector order (over one dim, two, or all)."""
    _reject_out(kwargs, "norm")
    return _vector_norm(t, "norm", input, 2 if p is None else p, dim, keepdim, dtype)


def _linalg_vector_norm(t: Tracer, x: Any, ord: Any = 2, dim: Any = None, keepdim: bool = False, *,
                        dtype: Any = None, **kwargs: Any) -> Any:
    """torch.linalg.vector_norm: torch.norm's vector orders under another name."""
    _reject_out(kwargs, "linalg.vector_norm")
    return _vector_norm(t, "linalg.vector_norm", x, ord, dim, keepdim, dtype)


register([torch.norm], ["norm"], _norm, inplace=False)
register([torch.linalg.vector_norm], [], _linalg_vector_norm, inplace=False)
