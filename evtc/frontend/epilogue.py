"""The `@evtc.epilogue` decorator."""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch


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

    def __reduce_ex__(self, protocol: Any) -> Any:
        # A decorated module-level function is pickled by reference, as functions are (torch.save
        # of a module holding one): its name now holds this wrapper, so the plain function in
        # `fn` could not be pickled by that name. Anything else (a wrapped nn.Module) by value.
        name = getattr(self, "__qualname__", None)
        found: Any = sys.modules.get(getattr(self, "__module__", None) or "")
        for part in (name or "<none>").split("."):
            found = getattr(found, part, None)
        if found is self:
            return name
        return super().__reduce_ex__(protocol)


def epilogue(fn: Callable[..., Any] | None = None, *, name: str | None = None) -> Any:
    """Mark `fn(acc, *operands)` as a GEMM epilogue: `@evtc.epilogue` or `@evtc.epilogue(name=...)`."""
    if fn is None:
        return lambda f: Epilogue(f, name)
    return Epilogue(fn, name)


def unwrap(fn: Any) -> Callable[..., Any]:
    return fn.fn if isinstance(fn, Epilogue) else fn


def signature_of(fn: Any) -> inspect.Signature:
    """The signature a call of the epilogue ``fn`` binds: a module's forward's (``nn.GELU()`` is
    called through ``__call__(*args, **kwargs)``). TypeError or ValueError where none can be read
    (a builtin such as ``torch.relu``)."""
    target = unwrap(fn)
    return inspect.signature(target.forward if isinstance(target, torch.nn.Module) else target)


def parameter_names(fn: Any) -> list[str]:
    """The epilogue's parameter names, the accumulator's first; a builtin without a readable
    signature (``F.gelu``) is a function of the accumulator alone."""
    try:
        return list(signature_of(fn).parameters)
    except (TypeError, ValueError):
        return ["acc"]
