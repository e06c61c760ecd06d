"""The elementwise ops of :mod:`evtc.ir.ops` in the CuTe DSL, for generated epilogue code.

Every function takes and returns float32 values (or boolean masks) in one of two forms:

* a ``cute.TensorSSA``: a whole register fragment of the subtile (the tile stage), or
* a ``cutlass.Float32`` / Python float: one value for the whole tile (the uniform stage).

Arithmetic operators (``+ - * /``, comparisons, ``& |``) work on both forms directly and the
generated code writes them infix; the functions here are the ops that need a name. Their results
follow torch's float32 semantics, NaN included: ``maximum``, ``minimum`` and ``relu`` propagate NaN
as torch does, and rounding casts to float8 round as torch's ``.to`` does (e4m3fn saturates,
e5m2 overflows to infinity), as evtc's IR does.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from evtc.sm90.dtypes import narrow

SQRT1_2 = 0.7071067811865476  # 1/sqrt(2)
SQRT_2_OVER_PI = 0.7978845608028654  # sqrt(2/pi)
GELU_TANH_CUBIC = 0.044715


def _is_tensor(x) -> bool:
    return isinstance(x, cute.TensorSSA)


def _f32(x):
    return Float32(x) if isinstance(x, int | float) else x


def splat(x, like):
    """``x`` as a fragment shaped like ``like`` (a no-op for fragments)."""
    if _is_tensor(x):
        return x
    return cute.full_like(like, _f32(x), Float32)


def _pair(a, b):
    """Both operands as fragments if either is one (the math functions want matching kinds)."""
    if _is_tensor(a) and not _is_tensor(b):
        return a, splat(b, a)
    if _is_tensor(b) and not _is_tensor(a):
        return splat(a, b), b
    return _f32(a), _f32(b)


# ---- arithmetic ----------------------------------------------------------------------------------


def pow(x, y):  # noqa: A001 - the op's name
    x, y = _pair(x, y)
    return cute.math.pow(x, y)


def abs(x):  # noqa: A001 - the op's name
    return cute.math.abs(_f32(x))


def reciprocal(x):
    return 1.0 / x


def minimum(x, y):
    x, y = _pair(x, y)
    return cute.math.min(x, y, propagate_nan=True)


def maximum(x, y):
    x, y = _pair(x, y)
    return cute.math.max(x, y, propagate_nan=True)


def clamp_min(x, lo):
    return maximum(x, lo)


def clamp_max(x, hi):
    return minimum(x, hi)


def hardtanh(x, min_val: float, max_val: float):
    return minimum(maximum(x, min_val), max_val)


# ---- transcendental ------------------------------------------------------------------------------


def sqrt(x):
    return cute.math.sqrt(_f32(x))


def rsqrt(x):
    return cute.math.rsqrt(_f32(x))


def exp(x):
    return cute.math.exp(_f32(x))


def exp2(x):
    return cute.math.exp2(_f32(x))


def detach(x):
    """The value itself: a detach matters only to the backward graph."""
    return x


def floor(x):
    return cute.math.floor(_f32(x))


def ceil(x):
    return cute.math.ceil(_f32(x))


def trunc(x):
    return cute.math.trunc(_f32(x))


def round(x):  # noqa: A001 - the op's name
    """To the nearest integer, a tie to the even one (torch.round; cute.math.round takes ties away
    from zero)."""
    return cute.math.roundeven(_f32(x))


def expm1(x):
    return cute.math.expm1(_f32(x))


def log(x):
    return cute.math.log(_f32(x))


def log2(x):
    return cute.math.log2(_f32(x))


def log1p(x):
    return cute.math.log1p(_f32(x))


def sin(x):
    return cute.math.sin(_f32(x))


def cos(x):
    return cute.math.cos(_f32(x))


def tanh(x):
    return cute.math.tanh(_f32(x))


def erf(x):
    return cute.math.erf(_f32(x))


# ---- activations ---------------------------------------------------------------------------------


def sigmoid(x):
    # 1 / (1 + e^-x) with libdevice's exp and the hardware's approximate reciprocal (a few ulp in
    # float32): an IEEE division costs ~10 instructions and a slow path per value, which
    # SwiGLU-sized epilogues feel at small K. Not the fast exp: it rounds -x * log2(e) to float32
    # before its 2^t, which is 2^-24 of |t| off, tens of ulps of the result for x below -10 (the
    # libdevice one carries that rounding error with a second constant). The denominator is >= 1;
    # below x = -87.3 the result, a float32 denormal in torch, flushes to 0. e^-x = inf gives 0
    # and NaN stays NaN, as in torch.
    denominator = exp(-x) + 1.0
    return cute.math.rcp(denominator, approx=True, ftz=True)


def relu(x):
    return maximum(x, 0.0)


def leaky_relu(x, negative_slope: float):
    return where(x > 0.0, x, x * negative_slope)


def elu(x, alpha: float):
    return where(x > 0.0, x, expm1(x) * alpha)


def gelu(x):
    """x * Phi(x) with the exact normal CDF (torch's approximate="none")."""
    # Halved first, as torch's kernel does: x * (erf + 1) overflows for |x| above 1.7e38.
    return x * 0.5 * (erf(x * SQRT1_2) + 1.0)


def gelu_tanh(x):
    """torch's approximate="tanh" gelu."""
    inner = (x + x * x * x * GELU_TANH_CUBIC) * SQRT_2_OVER_PI
    return x * 0.5 * (tanh(inner) + 1.0)


def silu(x):
    return x * sigmoid(x)


def softplus(x, beta: float, threshold: float):
    """log(1 + exp(beta x)) / beta, and x itself where beta x > threshold (as torch)."""
    bx = x * beta
    # beta = 0 divides by zero, as in torch: log(2) / 0 = inf, and -inf for beta = -0.0 (NaN stays NaN)
    inverse = 1.0 / beta if beta else math.copysign(math.inf, beta)
    soft = log1p(exp(bx)) if beta == 1 else log1p(exp(bx)) * inverse
    return where(bx > threshold, x, soft)


def mish(x):
    return x * tanh(softplus(x, 1.0, 20.0))


def hardswish(x):
    return x * minimum(maximum(x + 3.0, 0.0), 6.0) * (1.0 / 6.0)


def hardsigmoid(x):
    return minimum(maximum(x + 3.0, 0.0), 6.0) * (1.0 / 6.0)


# ---- masks and selection -------------------------------------------------------------------------


def logical_not(mask):
    if _is_tensor(mask):
        return mask == cute.full_like(mask, False)
    return mask == cutlass.Boolean(False)


def where(cond, x, y):
    if _is_tensor(cond):
        if not _is_tensor(x) and not _is_tensor(y):
            x = cute.full_like(cond, _f32(x), Float32)
        return cute.where(cond, x, _f32(y) if not _is_tensor(y) else y)
    if _is_tensor(x) or _is_tensor(y):
        x, y = _pair(x, y)
        return cute.where(cute.full_like(x, cond, cutlass.Boolean), x, y)
    # select_ gives a bare IR value; later ops on the scalar (a rounding cast's .to) need a Float32.
    return Float32(cutlass.select_(cond, _f32(x), _f32(y)))


def mask_to_float(mask):
    """A boolean mask as 1.0 / 0.0 (torch's promotion of bool in arithmetic)."""
    if _is_tensor(mask):
        return cute.where(mask, cute.full_like(mask, 1.0, Float32), 0.0)
    return Float32(cutlass.select_(mask, Float32(1.0), Float32(0.0)))


#: The float8_e4m3fn value whose encoding is the byte 1 (its smallest subnormal): what a bool
#: output's True is written as, so that the byte reads as torch's True.
BOOL_TRUE_AS_E4M3 = 2.0 ** -9


def mask_to_byte(mask):
    """A boolean mask as the float32 values 2^-9 / 0.0, which a float8_e4m3fn store writes as the
    bytes 1 / 0: a bool output's memory, as torch lays out True and False."""
    if _is_tensor(mask):
        return cute.where(mask, cute.full_like(mask, BOOL_TRUE_AS_E4M3, Float32), 0.0)
    return Float32(cutlass.select_(mask, Float32(BOOL_TRUE_AS_E4M3), Float32(0.0)))


def round_to(x, dtype):
    """Round float32 ``x`` to ``dtype`` and widen it back (a rounding cast), as torch rounds:
    float8_e4m3fn saturates, float8_e5m2 overflows to infinity (:func:`evtc.sm90.dtypes.narrow`)."""
    return narrow(_f32(x), dtype).to(Float32)

