"""evtc: compile plain-PyTorch GEMM epilogues into fused SM90 (Hopper) kernels.

Write the epilogue as an ordinary function of the accumulator `acc = a @ b` and other operands,
trace it into an IR graph with :func:`trace`, compile it into a fused GEMM kernel with
:func:`compile`, and check results with :func:`reference`.
"""

import logging as _logging
from typing import TYPE_CHECKING

from . import nn  # evtc.nn.FusedLinear (torch.nn is loaded with torch already)

# Bound here, not lazily: importing the submodules evtc.compile and evtc.linear would otherwise
# shadow the functions of the same names. Neither imports sympy or the CuTe DSL.
from .compile import compile  # noqa: E402, I001
from .errors import (
    CallError,
    CompileError,
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
from .linear import Linear, linear  # noqa: E402
from .runtime.kernel import Kernel  # noqa: E402

if TYPE_CHECKING:
    from .api import reference, trace
    from .ir.graph import Graph, Node, Operand
    from .ir.interpreter import evaluate

# The rest of the API is imported on first use: `import evtc` stays cheap (no sympy, no CuTe DSL),
# and a process that only loads cached kernels never imports the tracer or the IR.
_LAZY = {
    "reference": "api", "trace": "api", "Graph": "ir.graph", "Node": "ir.graph",
    "Operand": "ir.graph", "evaluate": "ir.interpreter",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'evtc' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"

# A library logs and leaves the handlers to the application: logging.basicConfig(level=logging.INFO)
# (or a handler on the "evtc" logger) shows compile steps, cache hits and misses and the chosen
# configuration.
_logging.getLogger("evtc").addHandler(_logging.NullHandler())

__all__ = [
    "nn",
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
