"""The `@evtc.epilogue` decorator."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


class Epilogue:
    """A user's epilogue function, marked for evtc.

    Calling it runs the plain function (on real tensors it is its own reference); `evtc.trace`
    and `evtc.reference` accept it wherever they accept a function.
    """

    def __init__(self, fn: Callable[..., Any], name: str | None = None) -> None:
        if not callable(fn):
            raise TypeError(f"@evtc.epilogue needs a function, got {type(fn).__name__}")
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "epilogue")
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<evtc.epilogue {self.name}>"


def epilogue(fn: Callable[..., Any] | None = None, *, name: str | None = None) -> Any:
    """Mark `fn(acc, *operands)` as a GEMM epilogue: `@evtc.epilogue` or `@evtc.epilogue(name=...)`."""
    if fn is None:
        return lambda f: Epilogue(f, name)
    return Epilogue(fn, name)


def unwrap(fn: Any) -> Callable[..., Any]:
    return fn.fn if isinstance(fn, Epilogue) else fn
