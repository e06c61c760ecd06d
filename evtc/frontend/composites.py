"""torch functions that evtc writes out with the IR's own ops, as torch defines them.

None of these needs an op of its own in the kernel: each is a few elementwise ops (``F.selu`` is a
``where`` of ``x`` and ``expm1``), a choice (``masked_fill``), a no-op on values (``contiguous``,
``detach``) or a test of the value against itself (``isnan``). The formulas are torch's, branch
for branch, so values, NaN and infinities come out as torch's do (up to float32 rounding).
Importing this module registers them with :mod:`evtc.frontend.lowering`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ..errors import UnsupportedOpError
from .lowering import _halves, _last_dim, _reject_out, register
from .proxy import TracedValue
from .source import user_location

if TYPE_CHECKING:
    from .tracer import Tracer

_INF = math.inf


# --- no-ops on values -------------------------------------------------------------------------
def _itself(t: Tracer, input: Any, *args: Any, memory_format: Any = None, **kwargs: Any) -> Any:
    """x.contiguous() and x.detach(): x itself (torch returns the same memory), so an in-place op
    on one changes the other, as in torch."""
    return input


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
    info = torch.finfo(input.dtype if isinstance(input, TracedValue) else torch.float32)
    posinf = info.max if posinf is None else posinf
    neginf = info.min if neginf is None else neginf
    result = t.emit("where", (t.emit("eq", (input, -_INF)), neginf, input))
    result = t.emit("where", (t.emit("eq", (input, _INF)), posinf, result))
    return t.emit("where", (t.emit("ne", (input, input)), nan, result))


# --- tests of values ------------------------------------------------------------------------
def _isnan(t: Tracer, input: Any) -> Any:
    return t.emit("ne", (input, input))


def _isinf(t: Tracer, input: Any) -> Any:
    return t.emit("eq", (t.emit("abs", (input,)), _INF))


def _isfinite(t: Tracer, input: Any) -> Any:
    return t.emit("lt", (t.emit("abs", (input,)), _INF))  # NaN < inf is False


def _isposinf(t: Tracer, input: Any, **kwargs: Any) -> Any:
    _reject_out(kwargs, "isposinf")
    return t.emit("eq", (input, _INF))


def _isneginf(t: Tracer, input: Any, **kwargs: Any) -> Any:
    _reject_out(kwargs, "isneginf")
    return t.emit("eq", (input, -_INF))


# --- arithmetic -----------------------------------------------------------------------------
def _rsub(t: Tracer, input: Any, other: Any, *, alpha: Any = 1) -> Any:
    """torch.rsub(x, other, alpha): other - alpha * x."""
    scaled = input if isinstance(alpha, int | float) and alpha == 1 else t.emit("mul", (alpha, input))
    return t.emit("sub", (other, scaled))


def _plus_scaled(t: Tracer, input: Any, term: Any, value: Any) -> Any:
    """input + value * term (term alone where value is 1), as addcmul and addcdiv compute."""
    if not (isinstance(value, int | float) and value == 1):
        term = t.emit("mul", (value, term))
    return t.emit("add", (input, term))


def _addcmul(t: Tracer, input: Any, tensor1: Any, tensor2: Any, *, value: Any = 1, **kwargs: Any) -> Any:
    """torch.addcmul: input + value * tensor1 * tensor2."""
    _reject_out(kwargs, "addcmul")
    return _plus_scaled(t, input, t.emit("mul", (tensor1, tensor2)), value)


def _addcdiv(t: Tracer, input: Any, tensor1: Any, tensor2: Any, *, value: Any = 1, **kwargs: Any) -> Any:
    """torch.addcdiv: input + value * tensor1 / tensor2."""
    _reject_out(kwargs, "addcdiv")
    return _plus_scaled(t, input, t.emit("div", (tensor1, tensor2)), value)


def _lerp(t: Tracer, input: Any, end: Any, weight: Any, **kwargs: Any) -> Any:
    """torch.lerp, by torch's two formulas: start + w * (end - start) where |w| < 0.5, else
    end - (end - start) * (1 - w) (exact at w = 1)."""
    _reject_out(kwargs, "lerp")
    diff = t.emit("sub", (end, input))
    low = t.emit("add", (input, t.emit("mul", (weight, diff))))
    high = t.emit("sub", (end, t.emit("mul", (diff, t.emit("sub", (1.0, weight))))))
    if isinstance(weight, int | float):
        return low if abs(weight) < 0.5 else high
    return t.emit("where", (t.emit("lt", (t.emit("abs", (weight,)), 0.5)), low, high))


# --- activations ----------------------------------------------------------------------------
_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946


def _inplace_flag(inplace: bool, name: str) -> None:
    if inplace:
        raise UnsupportedOpError(f"{name}(..., inplace=True) is not supported in epilogues: use the "
                                 "out-of-place form", user_location())


def _selu(t: Tracer, input: Any, inplace: bool = False) -> Any:
    """F.selu: scale * x where x > 0, else scale * alpha * (exp(x) - 1)."""
    _inplace_flag(inplace, "selu")
    negative = t.emit("mul", (_SELU_SCALE * _SELU_ALPHA, t.emit("expm1", (input,))))
    return t.emit("where", (t.emit("gt", (input, 0.0)), t.emit("mul", (_SELU_SCALE, input)), negative))


def _celu(t: Tracer, input: Any, alpha: float = 1.0, inplace: bool = False) -> Any:
    """F.celu: x where x > 0, else alpha * (exp(x / alpha) - 1)."""
    _inplace_flag(inplace, "celu")
    negative = t.emit("mul", (alpha, t.emit("expm1", (t.emit("div", (input, alpha)),))))
    return t.emit("where", (t.emit("gt", (input, 0.0)), input, negative))


def _logsigmoid(t: Tracer, input: Any) -> Any:
    """F.logsigmoid, as torch computes it without overflow: min(x, 0) - log1p(exp(-|x|))."""
    tail = t.emit("log1p", (t.emit("exp", (t.emit("neg", (t.emit("abs", (input,)),)),)),))
    return t.emit("sub", (t.emit("minimum", (input, 0.0)), tail))


def _softsign(t: Tracer, input: Any) -> Any:
    """F.softsign: x / (1 + |x|)."""
    return t.emit("div", (input, t.emit("add", (1.0, t.emit("abs", (input,))))))


def _glu(t: Tracer, input: Any, dim: int = -1) -> Any:
    """F.glu over the last dim: the first half times the sigmoid of the second."""
    _last_dim(t, input, dim, "glu")
    first, second = _halves(t, input, "glu")
    return t.emit("mul", (first, t.emit("sigmoid", (second,))))


def _dropout(t: Tracer, input: Any, p: float = 0.5, training: bool = True, inplace: bool = False) -> Any:
    """F.dropout: the value itself where it drops nothing (training=False, as in a model's eval
    mode, or p = 0); random masks are not something one kernel call can reproduce."""
    if not training or p == 0:
        return input
    raise UnsupportedOpError(
        f"dropout(p={p}, training=True) draws a random mask, which the kernel does not: pass "
        "training=False (evaluation), or apply dropout outside the kernel", user_location())


register([], ["contiguous", "detach"], _itself, inplace=False)
register([torch.clone], ["clone"], _clone, inplace=False)
register([torch.detach], [], _itself, inplace=False)
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
