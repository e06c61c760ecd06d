"""Finding the user's line: the first stack frame outside evtc and torch."""

from __future__ import annotations

import linecache
import os
import re
import sys

import torch

from ..errors import SourceLoc

_EVTC_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_SKIPPED = (_EVTC_DIR + os.sep, _TORCH_DIR + os.sep)


def _user_frame():
    """The innermost stack frame of the caller's code (outside evtc and torch)."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if not filename.startswith(_SKIPPED) and not frame.f_code.co_filename.startswith("<frozen"):
            return frame
        frame = frame.f_back
    return None


def user_location() -> SourceLoc | None:
    """Where the traced operation was written: the line of the caller's innermost frame."""
    frame = _user_frame()
    if frame is None:
        return None
    lineno = frame.f_lineno
    return SourceLoc(frame.f_code.co_filename, lineno,
                     linecache.getline(os.path.abspath(frame.f_code.co_filename), lineno))


_CALLED_NAME = re.compile(r"([A-Za-z_][\w.]*)\s*\(")


def python_math_call() -> str | None:
    """The ``math`` (or ``cmath``) function called on the user's line, as written (``math.exp``,
    or ``exp`` after ``from math import exp``), if any: such a function converts its argument with
    float(), which is where a traced value ends up."""
    frame = _user_frame()
    if frame is None:
        return None
    text = linecache.getline(os.path.abspath(frame.f_code.co_filename), frame.f_lineno)
    for written in _CALLED_NAME.findall(text):
        head, *attrs = written.split(".")
        value = frame.f_locals.get(head, frame.f_globals.get(head))
        try:  # the user's attributes (properties included) are read only for this message
            for attr in attrs:
                value = getattr(value, attr, None)
            module = getattr(value, "__module__", None) if callable(value) else None
        except Exception:  # noqa: BLE001 - a property of the user's that raises: no math call there
            continue
        if module in ("math", "cmath"):
            return written
    return None


def definition_location(fn: object) -> SourceLoc | None:
    """Where a function is defined (its `def` line)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    # A decorated function's first line is its first decorator's (``@evtc.epilogue``): step over the
    # decorators (a few lines at most, each possibly spanning several) to the ``def`` itself.
    line = code.co_firstlineno
    for candidate in range(line, line + 20):
        text = linecache.getline(code.co_filename, candidate).lstrip()
        if not text:
            break
        if text.startswith(("def ", "async def ", "lambda")) or "lambda" in text:
            line = candidate
            break
    return SourceLoc(code.co_filename, line, linecache.getline(code.co_filename, line))


def traceback_location(tb) -> SourceLoc | None:
    """The innermost frame of the caller's code in traceback ``tb``: the user's line that called
    what raised."""
    found = None
    while tb is not None:
        code = tb.tb_frame.f_code
        filename = os.path.abspath(code.co_filename)
        if not filename.startswith(_SKIPPED) and not code.co_filename.startswith("<frozen"):
            found = SourceLoc(code.co_filename, tb.tb_lineno, linecache.getline(filename, tb.tb_lineno))
        tb = tb.tb_next
    return found


def matrix_product_location(fn: object, names: frozenset[str]) -> SourceLoc | None:
    """The first line of ``fn``'s own code that takes a matrix product: the ``@`` operator or an
    attribute or global among ``names`` (``torch.matmul``, ``F.linear``, ``x.mm``). Read from the
    bytecode, before tracing: an operand shaped for a matrix product fails the operand checks first,
    and the user is better told about the product."""
    import dis

    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    line = None
    for ins in dis.get_instructions(code):
        # Python 3.10's instructions have no positions: the line is the last one started.
        positions = getattr(ins, "positions", None)
        if positions is not None and positions.lineno is not None:
            line = positions.lineno
        elif positions is None and ins.starts_line:
            line = ins.starts_line
        product = (ins.opname == "BINARY_MATRIX_MULTIPLY"
                   or ins.opname == "BINARY_OP" and ins.argrepr in ("@", "@=")
                   or ins.opname in ("LOAD_ATTR", "LOAD_METHOD", "LOAD_GLOBAL") and ins.argval in names)
        if product and line is not None:
            return SourceLoc(code.co_filename, line, linecache.getline(code.co_filename, line))
    return None

