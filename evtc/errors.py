"""The errors evtc raises. Every one says what is wrong and, for epilogue code, where.

Errors found while tracing carry the user's source location (file, line, source text) so that the
message points at the line of the epilogue that caused it, not at evtc's internals.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

#: While an epilogue runs to be traced: every EpilogueError made meanwhile (see :func:`made_during`).
_made: ContextVar[list | None] = ContextVar("evtc_errors_made", default=None)


@dataclass(frozen=True)
class SourceLoc:
    """A place in the user's epilogue code."""

    filename: str
    lineno: int
    text: str = ""

    def __str__(self) -> str:
        where = f"{self.filename}:{self.lineno}"
        return f"{where}: {self.text.strip()}" if self.text else where


class EpilogueError(Exception):
    """Base class of every error about an epilogue: its code, its inputs or its outputs."""

    def __init__(self, message: str, loc: SourceLoc | None = None) -> None:
        # No call of Exception.__init__ (its __new__ keeps the arguments) and no context variable
        # while torch.compile traces: dynamo traces neither, and with them a refusal under
        # fullgraph=True became dynamo's own error about super(), without this message.
        self.message = message
        self.loc = loc
        made = None if torch.compiler.is_compiling() else _made.get()
        if made is not None:
            made.append(self)

    def __str__(self) -> str:
        return self._render()

    def _render(self) -> str:
        if self.loc is None:
            return self.message
        return f"{self.message}\n  at {self.loc}"


@contextmanager
def made_during() -> Iterator[list[EpilogueError]]:
    """The EpilogueErrors made inside the block, in order. The tracer runs the user's function in
    one: an error evtc raised into it that the function caught itself (``try: ... except
    Exception:``) would otherwise leave a graph of the fallback branch, which torch never takes."""
    made: list[EpilogueError] = []
    token = _made.set(made)
    try:
        yield made
    finally:
        _made.reset(token)


class UnsupportedOpError(EpilogueError):
    """The epilogue calls a torch function, method or operator that evtc cannot compile."""


class ControlFlowError(EpilogueError):
    """Python control flow (if, while, bool(), int(), ...) on a traced value."""


class InPlaceError(EpilogueError):
    """An in-place operation on an input of the epilogue (acc or an operand)."""


class ShapeError(EpilogueError):
    """An input or intermediate value whose shape does not fit the GEMM's (L, M, N)."""


class DTypeError(EpilogueError):
    """A dtype evtc does not support where it was used."""


class InputError(EpilogueError):
    """Example inputs that do not match the epilogue's parameters (missing, extra, wrong kind)."""


class ReductionError(EpilogueError):
    """A reduction over dims evtc cannot compute, or a reduction used where it cannot be."""


class OutputError(EpilogueError):
    """The epilogue returns nothing, a non-tensor, or a value that cannot be an output."""


class GraphError(EpilogueError):
    """An IR graph that breaks an invariant (raised by validation: a bug in a pass, not the user)."""


class CompileError(EpilogueError):
    """An epilogue or configuration that evtc.compile cannot build (the message says why)."""


class CallError(EpilogueError, ValueError):
    """A call of a compiled kernel with arguments it cannot take (the message names the argument)."""


def nested_tensor_message(what: str) -> str:
    """Why a nested (ragged) tensor is refused, where it is refused: at compile time (an example)
    and at a call."""
    return (f"{what} is a nested tensor: the kernel needs one dense shape; pad it "
            "(torch.nested.to_padded_tensor) or concatenate its rows")
