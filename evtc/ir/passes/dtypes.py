"""Dtype checking, and lowering to the compute-in-float32 form with every cast explicit.

Traced nodes carry the dtype torch gives them (its promotion rules), so the graph means what the
function means on tensors. The kernel computes in float32; `make_casts_explicit` rewrites the graph
so that every compute node takes and yields float32 (or bool), and rounding to a narrower dtype
happens only in `cast` nodes, including the conversion before each store.
"""

from __future__ import annotations

import torch

from ...errors import DTypeError
from ..dtypes import CAST_DTYPES, COMPUTE_DTYPE, STORE_DTYPES, is_float8, short_name
from ..graph import Graph, GraphBuilder, Node, rewrite
from .result import graph_pass

_NATIVE = (COMPUTE_DTYPE, torch.bool)


def check_dtypes(graph: Graph) -> None:
    """Reject dtype uses the kernel (or torch itself) does not define."""
    for node in graph.nodes:
        if node.op in ("cast", "store"):
            if node.dtype not in (STORE_DTYPES if node.op == "store" else CAST_DTYPES):
                raise DTypeError(f"unsupported dtype {node.dtype} for {node.op}", node.loc)
            continue
        if node.category == "load":
            continue
        for i in node.inputs:
            if is_float8(i.dtype):
                raise DTypeError(
                    f"{node.op} on a {short_name(i.dtype)} value: torch defines no arithmetic on "
                    "float8; cast to float8 only as the last step of an output, or cast back with "
                    ".float() first",
                    node.loc,
                )


@graph_pass
def make_casts_explicit(graph: Graph) -> Graph:
    """Compute in float32 with explicit rounding casts (see the module docstring)."""

    def widen(value: Node, builder: GraphBuilder) -> Node:
        if value.dtype in _NATIVE:
            return value
        return builder.add("cast", (value,), {"dtype": COMPUTE_DTYPE, "implicit": True}, loc=value.loc)

    def visit(node: Node, inputs: tuple[Node, ...], builder: GraphBuilder) -> Node | None:
        if node.category == "load" or node.op in ("cast", "half"):
            return None  # a half is a view of its input: it keeps the input's dtype
        if node.op == "store":
            value = inputs[0]
            if node.dtype == torch.bool and value.dtype != torch.bool:
                # out_dtypes=torch.bool on a number: torch's .bool() of the value the function
                # returns, rounded to its dtype (rounded_from), then != 0 (NaN too).
                source = node.attrs.get("rounded_from")
                if source is not None and source not in _NATIVE and value.dtype != source:
                    value = builder.add("cast", (value,), {"dtype": source}, loc=node.loc)
                value = builder.add("ne", (widen(value, builder), builder.literal(0, node.loc)), None,
                                    loc=node.loc)
            elif value.dtype != node.dtype:
                value = builder.add("cast", (value,), {"dtype": node.dtype}, loc=node.loc)
            return builder.add("store", (value,), node.attrs, loc=node.loc, dtype=node.dtype)
        wide = tuple(widen(i, builder) for i in inputs)
        if node.dtype in _NATIVE:
            return builder.add(node.op, wide, node.attrs, loc=node.loc, dtype=node.dtype,
                               shape=node.shape)
        # A narrow result (downstream of an explicit narrow cast): compute in float32, then round,
        # as torch does for each op on 16-bit tensors.
        computed = builder.add(node.op, wide, node.attrs, loc=node.loc, dtype=COMPUTE_DTYPE,
                               shape=node.shape)
        return builder.add("cast", (computed,), {"dtype": node.dtype}, loc=node.loc)

    return rewrite(graph, visit)
