"""Finding the user's line: the first stack frame outside evtc and torch."""

from __future__ import annotations

import linecache
import os
import sys

import torch

from ..errors import SourceLoc

_EVTC_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_SKIPPED = (_EVTC_DIR + os.sep, _TORCH_DIR + os.sep)


def user_location() -> SourceLoc | None:
    """The innermost frame of the caller's code: where the traced operation was written."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if not filename.startswith(_SKIPPED) and not frame.f_code.co_filename.startswith("<frozen"):
            lineno = frame.f_lineno
            return SourceLoc(frame.f_code.co_filename, lineno, linecache.getline(filename, lineno))
        frame = frame.f_back
    return None


def definition_location(fn: object) -> SourceLoc | None:
    """Where a function is defined (its `def` line)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    return SourceLoc(code.co_filename, code.co_firstlineno, linecache.getline(code.co_filename,
                                                                                code.co_firstlineno))


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
