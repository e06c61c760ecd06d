"""Keep the sign of a ``-0.0`` constant in kernels the CuTe DSL builds.

The DSL makes a Python number into an IR constant through a cache keyed by the number (per IR
context and insertion point). Python holds ``-0.0 == 0.0`` with one hash, so whichever zero a block
asks for first answers for both: after ``C * 0.0``, an epilogue's ``acc * -0.0`` multiplies by
``+0.0`` (``1 / (acc * -0.0)`` then has the wrong infinity), and a ``-0.0`` that came first turns a
later ``relu``'s ``0.0`` into ``-0.0``. :func:`install` routes negative zeros past that cache, so
they get a constant of their own; every other number still takes the cache. It is idempotent and
changes nothing but negative zeros, and it is installed when :mod:`evtc.sm90` is imported, before
any kernel is traced.
"""

from __future__ import annotations

import math

_MARK = "_evtc_keeps_zero_sign"


def _is_negative_zero(value) -> bool:
    value = getattr(value, "value", value)  # a DSL Numeric holds its Python number here
    return isinstance(value, float) and value == 0.0 and math.copysign(1.0, value) < 0


def install() -> None:
    """Route the DSL's constants of value ``-0.0`` past its constant cache (once per process)."""
    from cutlass._mlir_helpers import arith as dsl_arith

    cached = dsl_arith._const_cached
    if getattr(cached, _MARK, False):
        return
    uncached = getattr(cached, "__wrapped__", None)
    if uncached is None:  # pragma: no cover - another DSL than the pinned one
        raise ImportError("evtc: the CuTe DSL's constant cache has changed (no __wrapped__ on "
                          "_const_cached); evtc pins the DSL's version (see pyproject.toml)")

    def constant(value, ty=None, **kwargs):
        if _is_negative_zero(value):
            return uncached(value, ty, **kwargs)
        return cached(value, ty, **kwargs)

    setattr(constant, _MARK, True)
    constant.cache_clear = cached.cache_clear  # the DSL's own callers may clear it
    constant.cache_info = cached.cache_info
    dsl_arith._const_cached = constant


__all__ = ["install"]
