"""Finishing reductions on the host, after the kernel.

The kernel writes, per reduction, the partial of every row of every tile (a float32 workspace of
(M, n tiles, L) values, see :class:`evtc.codegen.operands.RowReduction`). Here torch reduces them
over the n tiles (a fixed order, so the result is the same bit for bit on every run), then over rows
and batches for per-batch and whole-output reductions, and evaluates what the epilogue computes from
finished reductions (the ``final`` stage: the 1/N of a mean, ``sqrt(ms + eps)``, a scale) with the
reference evaluator's own node semantics.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import sympy
import torch

from .codegen.emit import ReductionPlan, on_host
from .ir.graph import Graph
from .ir.interpreter import _evaluate_node
from .ir.shapes import L, M, N

_REDUCE = {"sum": torch.sum, "max": torch.amax, "min": torch.amin}


def workspace_numel(m: int, n: int, batches: int, tile_n: int) -> int:
    """(M, n tiles, L) partials and one spare element (the kernel's branch-free stores go there)."""
    return m * (-(-n // tile_n)) * batches + 1


def finish(graph: Graph, plans: Sequence[ReductionPlan], workspaces: Sequence[torch.Tensor], m: int, n: int,
           batches: int, tile_n: int, operands: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The host outputs (stores of reductions and of values computed from them), by output name."""
    sizes = {M: m, N: n, L: batches}
    tiles_n = -(-n // tile_n)
    values: dict[int, Any] = {}
    for plan, ws in zip(plans, workspaces, strict=True):
        reduce = _REDUCE[plan.op]
        rows = reduce(ws[:-1].view(batches, tiles_n, m), dim=1)  # (L, M)
        axis = plan.node.attrs["axis"]
        value = rows if axis == "row" else reduce(rows, dim=1) if axis == "batch" else reduce(rows)
        shape = [int(sympy.sympify(d).subs(sizes)) for d in plan.node.shape]
        values[plan.node.id] = value.reshape(shape)
    device = workspaces[0].device
    nowhere = torch.empty(0, device=device)  # the accumulator is not needed after the kernel
    outputs: dict[str, torch.Tensor] = {}
    for node in graph.nodes:
        if node.id in values:
            continue
        if node.op == "store":
            if on_host(node):
                outputs[node.attrs["name"]] = values[node.inputs[0].id].to(node.dtype)
            continue
        if node.stage in ("uniform", "final"):
            values[node.id] = _evaluate_node(node, values, operands, nowhere, sizes, torch.float32)
    return outputs
