"""NumPy scalars, which torch reads as the Python numbers they hold (np.float32(0.5) is 0.5)."""

from __future__ import annotations

from typing import Any


def is_numpy_scalar(value: Any) -> bool:
    """A NumPy scalar (np.float32(0.5), np.int64(3), np.bool_(True)). Recognised by its module, so
    that NumPy is never imported for it."""
    return type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0 and hasattr(value, "item")
