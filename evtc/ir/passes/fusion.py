"""Fusion: assign every node a stage and group elementwise chains into the units codegen emits.

Stages say when a value is computed in the kernel:
  uniform  does not vary over the tile (literals, runtime scalars, device scalars and ops on them):
           computed once, before the tile loop
  tile     varies over the tile: computed per accumulator fragment in the epilogue's visit
  reduce   a reduction: partials per fragment, combined across threads, warps and tiles
  final    computed from finished reductions (e.g. the 1/N of a mean), after the last tile

A unit is a maximal connected set of elementwise nodes (ops and casts) of one stage: the code
generator emits each unit as one straight-line block, with its inputs loaded before it and its
outputs stored or reduced after it.
"""

from __future__ import annotations

from ...errors import ReductionError
from ..graph import Graph, Node, replace_nodes
from ..shapes import M, N, format_shape, varying_dims
from .result import graph_pass


def node_stage(node: Node, input_stages: list[str]) -> str:
    if node.op == "reduce":
        return "reduce"
    if "reduce" in input_stages or "final" in input_stages:
        return "final"
    if node.op == "store":
        return input_stages[0]
    if not varying_dims(node.shape) and all(s == "uniform" for s in input_stages):
        return "uniform"
    return "tile"


def _check_stage(node: Node, stages: dict[int, str]) -> None:
    input_stages = [stages[i.id] for i in node.inputs]
    if node.op == "reduce" and input_stages[0] in ("reduce", "final"):
        raise ReductionError(
            "a reduction of a reduction's result is not supported: each reduction reads "
            "per-element values of the tile",
            node.loc,
        )
    if node.op == "reduce" or node.op == "store":
        return
    if ("reduce" in input_stages or "final" in input_stages) and "tile" in input_stages:
        vectors = [i for i in node.inputs if stages[i.id] == "tile" and not {M, N} <= varying_dims(i.shape)]
        if len(vectors) == sum(stage == "tile" for stage in input_stages):
            shapes = ", ".join(format_shape(i.shape) for i in vectors)
            raise ReductionError(
                f"the result of a reduction is combined with a value of shape {shapes} (an operand "
                "per row, column or batch): the kernel finishes reductions with numbers, device "
                "scalars and other reductions only. Return the reduction and apply that outside, "
                "or apply it before reducing where that is the same ((acc.abs() * s).amax(-1) for "
                "s >= 0)",
                node.loc,
            )
        raise ReductionError(
            "the result of a reduction is combined with per-element values of the tile (for "
            "example x - x.amax(-1, keepdim=True)); that needs a second pass over the tile, which "
            "an epilogue cannot make. Return the reduction and finish the computation outside",
            node.loc,
        )


@graph_pass
def fuse_elementwise(graph: Graph) -> Graph:
    """A copy of `graph` whose nodes carry `stage` and `group`, with `groups` filled. The input's
    nodes are left as they are: the result's are new ones (same ids, same values)."""
    stages: dict[int, str] = {}
    for node in graph.nodes:
        _check_stage(node, stages)
        stages[node.id] = node_stage(node, [stages[i.id] for i in node.inputs])

    # Union-find over edges between elementwise nodes of the same stage.
    parent: dict[int, int] = {}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    fusible = [n for n in graph.nodes if n.is_elementwise]
    for n in fusible:
        parent[n.id] = n.id
    for n in fusible:
        for i in n.inputs:
            if i.id in parent and stages[i.id] == stages[n.id]:
                parent[find(n.id)] = find(i.id)

    group_ids: dict[int, int] = {}
    groups: dict[int, list[Node]] = {}
    copies: dict[int, Node] = {}
    for node in graph.nodes:
        # Annotations are set on the new node before the result graph holds it: no graph's node
        # ever changes.
        copy = Node(node.id, node.op, tuple(copies[i.id] for i in node.inputs), node.attrs, node.dtype,
                    node.shape, node.loc)
        copy.stage = stages[node.id]
        if node.id in parent:
            gid = group_ids.setdefault(find(node.id), len(group_ids))
            copy.group = gid
            groups.setdefault(gid, []).append(copy)
        copies[node.id] = copy
    result = replace_nodes(graph, [copies[n.id] for n in graph.nodes])
    result.groups = groups
    return result


def unit_inputs(graph: Graph, group: int) -> list[Node]:
    """Values a unit reads from outside itself, in graph order."""
    members = {n.id for n in graph.groups[group]}
    seen: dict[int, Node] = {}
    for n in graph.groups[group]:
        for i in n.inputs:
            if i.id not in members:
                seen.setdefault(i.id, i)
    return list(seen.values())


def unit_outputs(graph: Graph, group: int) -> list[Node]:
    """Values of a unit that something outside it uses (stores, reductions, other units)."""
    members = {n.id for n in graph.groups[group]}
    users = graph.users()
    return [n for n in graph.groups[group] if any(u.id not in members for u in users[n.id])]
