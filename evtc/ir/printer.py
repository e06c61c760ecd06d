"""Text and Graphviz forms of a graph: one node per line, reading like the user's code."""

from __future__ import annotations

import os

import sympy

from .dtypes import short_name
from .graph import Graph, Node
from .ops import ELEMENTWISE
from .shapes import format_shape

_REDUCE_METHOD = {"sum": "sum", "max": "amax", "min": "amin"}
_REDUCE_DIM = {"row": "-1", "col": "-2", "batch": "(-2, -1)", "all": ""}


def node_names(graph: Graph) -> dict[int, str]:
    """Printable names: inputs by their parameter names, other values numbered in order."""
    names: dict[int, str] = {}
    counter = 0
    for node in graph.nodes:
        if node.op == "acc":
            half = node.attrs.get("half")
            names[node.id] = "%" + graph.acc_name + ("" if half is None else (".gate", ".up")[half])
        elif node.op in ("load", "arg"):
            names[node.id] = "%" + node.attrs["name"]
        elif node.op == "literal":
            names[node.id] = format_literal(node.attrs["value"])
        elif node.op == "store":
            names[node.id] = node.attrs["name"]
        else:
            counter += 1
            names[node.id] = f"%{counter}"
    return names


def format_literal(value: sympy.Expr) -> str:
    value = sympy.sympify(value)
    if value.is_Number:
        f = float(value)
        return repr(int(f)) if f.is_integer() and abs(f) < 1e15 else repr(f)
    return f"({value})"


def expression(node: Node, names: dict[int, str]) -> str:
    """The right-hand side of a node, in something close to the torch the user wrote."""
    args = [names[i.id] for i in node.inputs]
    op = node.op
    if op == "acc":
        half = node.attrs.get("half")
        return "a @ b" if half is None else f"(a @ b).chunk(2, -1)[{half}]"
    if op == "load":
        batch = ", per batch" if node.attrs["batched"] else ""
        return f"load {node.attrs['kind']} {node.attrs['name']!r}{batch}"
    if op == "arg":
        return f"runtime scalar {node.attrs['name']!r}"
    if op == "literal":
        return format_literal(node.attrs["value"])
    if op == "cast":
        return f"{args[0]}.to({short_name(node.dtype)})"
    if op == "half":
        return f"{args[0]}.chunk(2, -1)[{node.attrs['index']}]"
    if op == "join":  # backward graphs: two halves of the last dim side by side
        return f"torch.cat([{args[0]}, {args[1]}], -1)"
    if op == "reduce" and node.attrs["axis"] == "to_shape":  # backward graphs: torch's sum_to_size
        shape = ", ".join(str(d) for d in node.attrs["to_shape"])
        return f"{args[0]}.sum_to_size({shape})"
    if op == "reduce":
        method = _REDUCE_METHOD[node.attrs["reduce"]]
        dims = _REDUCE_DIM[node.attrs["axis"]]
        keep = ", keepdim=True" if node.attrs["keepdim"] else ""
        inner = dims + keep if dims else keep.lstrip(", ")
        return f"{args[0]}.{method}({inner})"
    if op == "store":
        return args[0]
    definition = ELEMENTWISE[op]
    if definition.infix is not None and len(args) == 2:
        return f"{args[0]} {definition.infix} {args[1]}"
    params = [f"{p}={node.attrs[p]!r}" for p in definition.params]
    return f"{op}({', '.join(args + params)})"


def _signature(graph: Graph) -> str:
    parts = [graph.acc_name] + [o.describe() for o in graph.operands.values()]
    outs = ", ".join(
        f"{s.attrs['name']}: {short_name(s.dtype)}{format_shape(s.shape)}" for s in graph.stores
    )
    return f"graph {graph.name}({', '.join(parts)}) -> ({outs})"


def _where(node: Node) -> str:
    if node.loc is None:
        return ""
    return f"{os.path.basename(node.loc.filename)}:{node.loc.lineno}"


def format_graph(graph: Graph) -> str:
    names = node_names(graph)
    rows: list[tuple[str, str, str]] = []
    for node in graph.nodes:
        if node.op == "literal":
            continue  # printed inline where used
        if node.op == "store":
            lhs = f"store {names[node.id]}"
        else:
            lhs = names[node.id]
        code = f"{lhs} = {expression(node, names)}"
        typ = f"{short_name(node.dtype)}{format_shape(node.shape)}"
        if node.stage is not None:
            unit = f" unit {node.group}" if node.group is not None else ""
            typ += f"  [{node.stage}{unit}]"
        src = ""
        if node.loc is not None and node.op not in ("acc", "load", "arg") \
                and not node.attrs.get("implicit"):
            src = f"{_where(node)}  {node.loc.text.strip()}"
        rows.append((code, typ, src))
    width = max((len(r[0]) for r in rows), default=0)
    twidth = max((len(r[1]) for r in rows), default=0)
    lines = [_signature(graph)]
    for code, typ, src in rows:
        line = f"  {code.ljust(width)}  # {typ.ljust(twidth)}"
        if src:
            line += f"  {src}"
        lines.append(line.rstrip())
    return "\n".join(lines)


COLOURS = {"load": "#cfe8ff", "compute": "#fff2c2", "reduction": "#e6d5ff", "store": "#c9f2c9"}


def _dot_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def node_label(node, names: dict[int, str]) -> list[str]:
    """The lines that label a node in a picture: its expression, its type, the user's source line."""
    first = f"store {names[node.id]}" if node.op == "store" else \
        f"{names[node.id]} = {expression(node, names)}"
    label = [first, f"{short_name(node.dtype)}{format_shape(node.shape)}"]
    if node.loc is not None and node.op not in ("acc", "load", "arg", "literal"):
        label.append(node.loc.text.strip())
    return label


def graph_to_dot(graph: Graph) -> str:
    names = node_names(graph)
    lines = [f'digraph "{_dot_escape(graph.name)}" {{', "  rankdir=TB;",
             '  node [shape=box, style="rounded,filled", fontname="Helvetica"];']
    for node in graph.nodes:
        label = node_label(node, names)
        text = "\\n".join(_dot_escape(part) for part in label)
        lines.append(f'  n{node.id} [label="{text}", fillcolor="{COLOURS[node.category]}", '
                     f'tooltip="{node.category}"];')
    for node in graph.nodes:
        for i in node.inputs:
            lines.append(f"  n{i.id} -> n{node.id};")
    lines.append("}")
    return "\n".join(lines)
