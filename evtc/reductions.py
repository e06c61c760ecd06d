"""Finishing reductions on the host, after the kernel.

The kernel writes, per reduction, float32 partials into a flat workspace (one spare element last, see
:mod:`evtc.codegen.operands`):

* per row (``RowReduction``, also behind per-batch and whole-output reductions): each row's partial
  of each tile, (L, n tiles, M);
* per column (``ColReduction``): each column's partial of each tile (the warps' partials combined
  in shared memory), (L, m tiles, N).

Here torch reduces them over the partials (a fixed order, so the result is the same bit for bit on
every run), then over rows and batches for per-batch and whole-output reductions, and evaluates what
the epilogue computes from finished reductions (the ``final`` stage: the 1/N of a mean,
``sqrt(ms + eps)``, a scale) with the reference evaluator's own node semantics.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import sympy
import torch

from .codegen.config import GemmConfig
from .codegen.emit import ReductionPlan, on_host
from .ir.graph import Graph
from .ir.interpreter import _evaluate_node
from .ir.shapes import L, M, N

_REDUCE = {"sum": torch.sum, "max": torch.amax, "min": torch.amin}


def _tiles(size: int, tile: int) -> int:
    return -(-size // tile)


def partial_rows(plan: ReductionPlan, m: int, n: int, config: GemmConfig) -> tuple[int, int]:
    """(partials per reduced value, reduced values) of one batch: (n tiles, M) per row, (m tiles, N)
    per column."""
    if plan.axis == "col":
        return _tiles(m, config.tile_m), n
    return _tiles(n, config.out_tile_n), m


def workspace_numel(plan: ReductionPlan, m: int, n: int, batches: int, config: GemmConfig) -> int:
    """The partials of every batch and one spare element (the kernel's branch-free stores go there)."""
    parts, values = partial_rows(plan, m, n, config)
    return parts * values * batches + 1


def finish(graph: Graph, plans: Sequence[ReductionPlan], workspaces: Sequence[torch.Tensor], m: int, n: int,
           batches: int, config: GemmConfig, operands: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The host outputs (stores of reductions and of values computed from them), by output name."""
    sizes = {M: m, N: n, L: batches}
    values: dict[int, Any] = {}
    for plan, ws in zip(plans, workspaces, strict=True):
        reduce = _REDUCE[plan.op]
        parts, count = partial_rows(plan, m, n, config)
        reduced = reduce(ws[:-1].view(batches, parts, count), dim=1)  # (L, M) or (L, N)
        axis = plan.axis
        if axis in ("row", "col"):
            value = reduced
        else:
            value = reduce(reduced, dim=1) if axis == "batch" else reduce(reduced)
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
