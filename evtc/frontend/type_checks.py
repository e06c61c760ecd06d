"""Type checks on traced values: ``isinstance(x, torch.Tensor)``, ``torch.is_tensor(x)``.

While an epilogue is traced its tensors are proxies (:class:`TracedValue`), not ``torch.Tensor``s,
so these checks answer False where torch's eager run answers True, and a helper such as
``x + bias if torch.is_tensor(bias) else x`` would be traced down the other branch: a kernel
without the bias, silently. A proxy cannot pass for a tensor (torch's C++ argument parser takes
whatever ``isinstance`` accepts as a tensor and crashes on it), so the checks are refused instead,
at the user's line.

A profile hook sees every call the function makes while it is traced. ``torch.is_tensor`` is a
Python function whose argument the hook reads from its frame. ``isinstance`` is a builtin, whose
arguments a profile hook does not get: its first argument is read back from the calling code where
it is a plain name (``isinstance(bias, ...)``, ``isinstance(self.bias, ...)``), and any other
expression is let through rather than guessed at. ``type(x)`` is a class, whose calls no hook
sees: ``type(x) is torch.Tensor`` stays False while tracing (docs/epilogues.md).
"""

from __future__ import annotations

import builtins
import dis
import linecache
import os
import sys
import sysconfig
from types import CodeType, FrameType
from typing import Any

import torch

from ..errors import SourceLoc, UnsupportedOpError
from .proxy import TracedValue
from .source import user_location

_EVTC_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
#: Code that is not the user's: evtc, torch, the standard library and installed packages (their
#: own type checks see a proxy as they see any object: inspect.isfunction(acc), typing's checks,
#: torch.compile's frame analysis).
_LIBRARY_DIRS = [os.path.abspath(path) + os.sep for key in ("stdlib", "platstdlib", "purelib", "platlib")
                 if (path := sysconfig.get_paths().get(key))]
_NOT_USERS = tuple(dict.fromkeys([_EVTC_DIR, _TORCH_DIR, *_LIBRARY_DIRS]))

#: The builtins whose answer on a proxy differs from torch's on a tensor.
_BUILTIN_CHECKS = {id(builtins.isinstance): "isinstance"}
#: torch's Python-level checks, by code object: the name of their argument.
_PYTHON_CHECKS = {torch.is_tensor.__code__: ("torch.is_tensor", "obj")}

#: Instructions that load a name: the start of a plain-name argument.
_NAME_LOADS = frozenset({"LOAD_FAST", "LOAD_DEREF", "LOAD_CLOSURE", "LOAD_GLOBAL", "LOAD_NAME"})
#: What may follow a complete first argument: the next argument's first load, or the call itself.
_ARGUMENT_ENDS = _NAME_LOADS | {"LOAD_CONST", "PRECALL", "CALL", "KW_NAMES", "BUILD_TUPLE"}

_instructions: dict[CodeType, list[dis.Instruction]] = {}


class TypeChecks:
    """A context in which type checks on proxies raise :class:`evtc.UnsupportedOpError`.

    Its profile hook also notes where ``epilogue`` (a function) returns, in ``returned_at``: an
    output returned as it came in (``return y, C``) has no line of its own, and its messages name
    the return rather than the ``def``."""

    def __init__(self, epilogue: Any = None) -> None:
        self._code = getattr(getattr(epilogue, "__func__", epilogue), "__code__", None)
        self.returned_at: SourceLoc | None = None

    def __enter__(self) -> TypeChecks:
        self._previous = sys.getprofile()
        sys.setprofile(self._hook)
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.setprofile(self._previous)

    def _hook(self, frame: FrameType, event: str, arg: Any) -> None:
        if self._previous is not None:
            self._previous(frame, event, arg)
        if event == "c_call":
            name = _BUILTIN_CHECKS.get(id(arg))
            if name is not None and arg is getattr(builtins, name) and _is_users(frame.f_code):
                if isinstance(_first_argument(frame, name), TracedValue):
                    _refuse(f"{name}()")
        elif event == "call":
            check = _PYTHON_CHECKS.get(frame.f_code)
            if check is not None and isinstance(frame.f_locals.get(check[1]), TracedValue):
                _refuse(f"{check[0]}()")
        elif event == "return" and frame.f_code is self._code:
            line = frame.f_lineno
            self.returned_at = SourceLoc(self._code.co_filename, line,
                                         linecache.getline(self._code.co_filename, line))


def _refuse(what: str) -> None:
    raise UnsupportedOpError(
        f"{what} on a traced value: while the epilogue is traced its tensors and runtime scalars are "
        "stand-ins, not torch.Tensor or float objects, so a type check would take another branch "
        "than torch does. "
        "Write the epilogue for the inputs it is compiled with (a parameter that may be absent can "
        "default to None and be tested with `is None`)",
        user_location(),
    )


def _is_users(code: CodeType) -> bool:
    filename = os.path.abspath(code.co_filename)
    return not filename.startswith(_NOT_USERS) and not code.co_filename.startswith("<frozen")


def _first_argument(frame: FrameType, name: str) -> Any:
    """The value of the first argument of the call of builtin ``name`` that ``frame`` is making,
    where the calling code passes a plain name or a chain of attributes of one; else None."""
    code = frame.f_code
    instructions = _instructions.get(code)
    if instructions is None:
        instructions = _instructions[code] = list(dis.get_instructions(code))
    at = max((i for i, ins in enumerate(instructions) if ins.offset <= frame.f_lasti), default=-1)
    start = next((i for i in range(at, -1, -1) if instructions[i].opname in ("LOAD_GLOBAL", "LOAD_NAME")
                  and instructions[i].argval == name), None)
    if start is None or start + 1 >= len(instructions):
        return None
    first = instructions[start + 1]
    if first.opname not in _NAME_LOADS:
        return None
    value = _load(frame, first)
    i = start + 2
    while i < len(instructions) and instructions[i].opname == "LOAD_ATTR":
        if isinstance(value, TracedValue):
            return None  # an attribute of a proxy (acc.shape): not the proxy itself
        value = getattr(value, instructions[i].argval, None)
        i += 1
    if i >= len(instructions) or instructions[i].opname not in _ARGUMENT_ENDS:
        return None  # the name is the start of a longer expression
    return value


def _load(frame: FrameType, instruction: dis.Instruction) -> Any:
    name = instruction.argval
    if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
        if name in frame.f_globals:
            return frame.f_globals[name]
        return getattr(builtins, name, None)
    return frame.f_locals.get(name)


__all__ = ["TypeChecks"]
