"""evtc: compile plain-PyTorch GEMM epilogues into fused SM90 (Hopper) kernels.

Write the epilogue as an ordinary function of the accumulator `acc = a @ b` and other operands,
trace it into an IR graph with :func:`trace`, compile it into a fused GEMM kernel with
:func:`compile`, and check results with :func:`reference`.
"""

import logging as _logging

from .api import reference, trace
from .compile import CallError, CompileError, Kernel, compile
from .errors import (
    ControlFlowError,
    DTypeError,
    EpilogueError,
    GraphError,
    InPlaceError,
    InputError,
    OutputError,
    ReductionError,
    ShapeError,
    SourceLoc,
    UnsupportedOpError,
)
from .frontend.epilogue import Epilogue, epilogue
from .ir.graph import Graph, Node, Operand
from .ir.interpreter import evaluate
from .linear import Linear, linear

__version__ = "0.1.0"

# A library logs and leaves the handlers to the application: logging.basicConfig(level=logging.INFO)
# (or a handler on the "evtc" logger) shows compile steps, cache hits and misses and the chosen
# configuration.
_logging.getLogger("evtc").addHandler(_logging.NullHandler())

__all__ = [
    "CallError",
    "CompileError",
    "ControlFlowError",
    "DTypeError",
    "Epilogue",
    "EpilogueError",
    "Graph",
    "GraphError",
    "InPlaceError",
    "InputError",
    "Kernel",
    "Linear",
    "Node",
    "Operand",
    "OutputError",
    "ReductionError",
    "ShapeError",
    "SourceLoc",
    "UnsupportedOpError",
    "compile",
    "epilogue",
    "evaluate",
    "linear",
    "reference",
    "trace",
]
