"""The static signature of a compiled kernel: dtypes and layouts of every tensor argument.

Everything about the arguments that changes the generated code (which dim is contiguous, which
operand is per batch) is read once from the example inputs at compile time; sizes are not.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from evtc.ir.graph import Graph
from evtc.ir.shapes import ONE
from evtc.plan.operand_kinds import KINDS
from evtc.plan.tensor_spec import TMA_ALIGN, TensorSpec  # noqa: F401 - re-exported


def dims_of(shape) -> tuple[str, ...]:
    return tuple("1" if d == ONE else str(d) for d in shape)


def contiguous_dim(spec_dims: tuple[str, ...], t: torch.Tensor, allowed: tuple[str, ...]) -> int | None:
    """The dim (one of ``allowed``) the kernel reads with unit stride: the example's unit-stride dim
    (the last one if several). An example with none (a strided view such as ``C[:, ::2]``) gets the
    dim of its smallest stride: calls with such views are staged into that layout
    (:mod:`evtc.runtime.staging`)."""
    strides = t.stride()
    varying = [i for i, d in enumerate(spec_dims) if d in allowed]
    candidates = [i for i in varying if strides[i] == 1]
    if candidates:
        return candidates[-1]
    moving = [i for i in varying if strides[i] != 0] or varying
    if not moving:
        return None
    return min(reversed(moving), key=lambda i: abs(strides[i]))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def half_view(t: torch.Tensor, index: int) -> torch.Tensor:
    """The gate (0) or up (1) half of ``t`` along its last dim: a view, never a copy."""
    half = t.shape[-1] // 2
    return t[..., index * half:(index + 1) * half]


def kernel_arguments(graph: Graph, a: Any, b: Any, operands: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``b`` and the operands as the kernel of ``graph`` takes them: for a split gated graph (see
    :mod:`evtc.ir.passes.gated`), b as its (gate, up) halves and each operand as wide as the
    accumulator as its two halves, under the names the split graph gives them."""
    if not graph.gated:
        return b, dict(operands)
    args: dict[str, Any] = {}
    for name, operand in graph.operands.items():
        if operand.half_of is not None:
            source, index = operand.half_of
            if source in operands:
                args[name] = half_view(operands[source], index)
        elif name in operands:
            args[name] = operands[name]
    return (half_view(b, 0), half_view(b, 1)), args


class KernelSignature:
    """Everything static about one kernel besides the graph: layouts of every tensor argument."""

    def __init__(self, graph: Graph, emitted, example: Mapping[str, Any]):
        a, b = example["a"], example["b"]
        if graph.gated:
            b, halves = kernel_arguments(graph, a, b, example)
            b = b[0]
            example = {**example, **halves}
        #: Why the kernel cannot take a and b batched like these (one batched and one not, or batch
        #: sizes that broadcast): calls then take the torch path. None when it can.
        self.broadcast_batch: str | None = None
        if a.dim() != b.dim():
            self.broadcast_batch = (f"a is {a.dim()}-d and b is {b.dim()}-d (a batch broadcast): the kernel "
                                    "needs both batched alike; expand the other one to get a kernel"
                                    + ("; for x @ weight.t() with leading dims (hidden states of (B, S, "
                                       "K)), evtc.linear flattens them into the rows of one GEMM, the "
                                       "faster kernel where S is small" if a.dim() > b.dim() else ""))
        elif a.dim() == 3 and a.shape[0] != b.shape[0]:
            self.broadcast_batch = (f"a and b have batch sizes {a.shape[0]} and {b.shape[0]} (a batch "
                                    "broadcast): the kernel needs equal ones; expand the other one to get "
                                    "a kernel")
        self.batched = graph.batched
        a_dims = ("L", "M", "K") if a.dim() == 3 else ("M", "K")
        b_dims = ("L", "K", "N") if b.dim() == 3 else ("K", "N")
        # Their own dtypes: float8 a and b may mix formats.
        self.a = TensorSpec("a", dtype_name(a.dtype), a_dims, contiguous_dim(a_dims, a, ("M", "K")))
        self.b = TensorSpec("b", dtype_name(b.dtype), b_dims, contiguous_dim(b_dims, b, ("K", "N")))
        #: Block-scaled float8 (see :meth:`set_block_scales`): the scales' specs, or None.
        self.a_scales: TensorSpec | None = None
        self.b_scales: TensorSpec | None = None
        self.a_major = "k" if a_dims[self.a.contiguous] == "K" else "m"
        self.b_major = "n" if b_dims[self.b.contiguous] == "N" else "k"
        out_dims = ("L", "M", "N") if graph.batched else ("M", "N")
        self.d_major = "n"
        self.outputs = [TensorSpec(o.name, dtype_name(o.dtype), out_dims, len(out_dims) - 1)
                        for o in emitted.outputs]
        # One float32 workspace per reduction, flat, allocated per call (evtc.runtime.reductions): W elements
        # for per-row partials, V for per-column ones.
        self.workspaces = [TensorSpec(r.ident, "float32", ("V" if r.axis == "col" else "W",), 0)
                           for r in emitted.reductions]
        self.inputs: list = []
        self.views: list = []
        self.tile_majors: dict[str, str] = {}
        for plan in emitted.inputs:
            kind = KINDS[plan.kind]
            if kind.runtime_scalar:
                self.inputs.append(None)
                self.views.append("arg")
                continue
            operand = graph.operands[plan.name]
            t = example[plan.name]
            dims = dims_of(operand.shape)
            if kind.view_modes is None:
                self.inputs.append(TensorSpec(plan.name, dtype_name(t.dtype), dims, None))
                # A per-batch scalar is read at each tile's batch through an (L,) view.
                self.views.append(("L",) if operand.batched else "scalar")
                continue
            spec = TensorSpec(plan.name, dtype_name(t.dtype), dims, contiguous_dim(dims, t, kind.varying))
            if plan.kind == "tile":
                self.tile_majors[plan.name] = "n" if dims[spec.contiguous] == "N" else "m"
            self.inputs.append(spec)
            self.views.append(kind.view_modes[0 if operand.batched else 1])

    def set_block_scales(self, a_rows: int) -> None:
        """a and b come with float32 block scales (evtc.ir.block_scales): ``a_rows`` rows of a
        per scale (1 or 128), b per 128 x 128 block. a's 1 x 128 scales are M-contiguous, every
        other stride and the base 16-byte aligned: the kernel brings them with each A/B stage by
        TMA (``GemmConfig.stages_a_scales``), and calls with another layout run on a copy. The
        others take any strides (read with ordinary loads)."""
        rows = "M" if a_rows == 1 else "MB"
        a_batch = ("L",) if len(self.a.dims) == 3 else ()
        b_batch = ("L",) if len(self.b.dims) == 3 else ()
        a_dims = (*a_batch, rows, "KB")
        self.a_scales = TensorSpec("a's block scales", "float32", a_dims,
                                   a_dims.index("M") if a_rows == 1 else None)
        self.b_scales = TensorSpec("b's block scales", "float32", (*b_batch, "KB", "NB"), None)

    def set_output_major(self, d_major: str) -> None:
        """Outputs column-major (``"m"``: M contiguous) or row-major (``"n"``, the default)."""
        self.d_major = d_major
        self.outputs = [TensorSpec(s.name, s.dtype, s.dims, s.dims.index("M" if d_major == "m" else "N"))
                        for s in self.outputs]

    def describe(self) -> dict:
        return {
            "a": self.a.describe(), "b": self.b.describe(),
            **({"scales": [self.a_scales.describe(), self.b_scales.describe()]} if self.a_scales else {}),
            "outputs": [s.describe() for s in self.outputs],
            "inputs": [s.describe() if s is not None else "scalar" for s in self.inputs],
            "views": [list(v) if isinstance(v, tuple) else v for v in self.views],
            "batched": self.batched,
        }
