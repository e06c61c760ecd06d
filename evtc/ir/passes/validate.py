"""Validation: the invariants every optimized graph satisfies (a failure is a bug in evtc)."""

from __future__ import annotations

import torch

from ...errors import GraphError
from ..dtypes import COMPUTE_DTYPE, STORE_DTYPES
from ..graph import LOAD_OPS, Graph
from ..infer import infer_shape
from ..ops import ELEMENTWISE


def validate(graph: Graph, *, lowered: bool = True) -> None:
    """Check structure, arity, shapes, and (when `lowered`) that compute is float32 with explicit casts."""
    seen: set[int] = set()
    names: set[str] = set()
    for node in graph.nodes:
        if node.id in seen:
            raise GraphError(f"node %{node.id} appears twice")
        for i in node.inputs:
            if i.id not in seen:
                raise GraphError(f"node %{node.id} ({node.op}) uses %{i.id}, which is not before it")
        seen.add(node.id)
        if node.op in ELEMENTWISE:
            definition = ELEMENTWISE[node.op]
            if len(node.inputs) != definition.arity:
                raise GraphError(f"{node.op} takes {definition.arity} inputs, has {len(node.inputs)}")
            missing = [p for p in definition.params if p not in node.attrs]
            if missing:
                raise GraphError(f"{node.op} lacks parameter(s) {missing}")
        elif node.op not in LOAD_OPS | {"cast", "reduce", "store", "half"}:
            raise GraphError(f"unknown op {node.op!r}")
        expected = infer_shape(node.op, node.inputs, node.attrs, graph.batched, node.loc)
        if tuple(expected) != tuple(node.shape):
            raise GraphError(f"node %{node.id} ({node.op}) has shape {node.shape}, expected {expected}")
        if node.op == "store":
            name = node.attrs["name"]
            if name in names:
                raise GraphError(f"two stores named {name!r}")
            names.add(name)
            if node.dtype not in STORE_DTYPES:
                raise GraphError(f"store {name!r} has dtype {node.dtype}")
        if lowered:
            _check_lowered(node)
    if sorted(names) != sorted(graph.outputs.names):
        raise GraphError(f"stores {sorted(names)} do not match outputs {graph.outputs.names}")


def _check_lowered(node) -> None:  # noqa: ANN001 - a Node
    native = (COMPUTE_DTYPE, torch.bool)
    if node.op in ELEMENTWISE or node.op == "reduce":
        if node.dtype not in native:
            raise GraphError(f"{node.op} node %{node.id} computes in {node.dtype}, not float32")
        bad = [i for i in node.inputs if i.dtype not in native]
        if bad:
            raise GraphError(f"{node.op} node %{node.id} reads {bad[0].dtype} without a cast")
    if node.op == "store" and node.inputs[0].dtype != node.dtype:
        raise GraphError(f"store %{node.id} converts {node.inputs[0].dtype} -> {node.dtype} implicitly")
