"""Pictures of an epilogue graph: SVG or PNG through Graphviz when it is installed, and SVG from a
small layered layout of our own when it is not (so `graph.render("g.svg")` works on any machine).

Nodes are coloured by kind (load, compute, reduction, store) and labelled with their expression,
their type and the user's source line, as in `Graph.to_dot`.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from xml.sax.saxutils import escape

from .graph import Graph
from .printer import COLOURS, node_label, node_names

# Layout of the built-in SVG, in pixels: monospace-ish text metrics are enough for boxes.
CHAR_W = 7.2
LINE_H = 15
PAD_X = 10
PAD_Y = 6
GAP_X = 24
GAP_Y = 40


def render(graph: Graph, path: str | Path, *, engine: str = "auto") -> Path:
    """Write a picture of ``graph`` to ``path``; the suffix picks the format (.svg, .png or .dot).

    ``engine``: ``"graphviz"`` (needs the ``dot`` program), ``"builtin"`` (SVG only) or ``"auto"``
    (Graphviz when installed, else the built-in SVG). Returns the path written.
    """
    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in ("svg", "png", "dot"):
        raise ValueError(f"render: {path.name!r}: the suffix must be .svg, .png or .dot")
    if fmt == "dot":
        path.write_text(graph.to_dot())
        return path
    dot = shutil.which("dot")
    if engine == "graphviz" or (engine == "auto" and dot is not None):
        if dot is None:
            raise RuntimeError("render: Graphviz's `dot` program is not installed (apt install graphviz); "
                               "write an .svg with engine='builtin' instead")
        subprocess.run([dot, f"-T{fmt}", "-o", str(path)], input=graph.to_dot(), text=True, check=True,
                       capture_output=True, timeout=120)
        return path
    if fmt != "svg":
        raise RuntimeError(f"render: {fmt.upper()} needs Graphviz's `dot` program, which is not installed; "
                           "write an .svg (built in) or install graphviz")
    path.write_text(to_svg(graph))
    return path


def _layers(graph: Graph) -> list[list]:
    """Nodes by depth (longest path from an input), each layer in graph order."""
    depth: dict[int, int] = {}
    for node in graph.nodes:  # topological order
        depth[node.id] = 1 + max((depth[i.id] for i in node.inputs), default=-1)
    layers: list[list] = [[] for _ in range(max(depth.values(), default=-1) + 1)]
    for node in graph.nodes:
        layers[depth[node.id]].append(node)
    return layers


def to_svg(graph: Graph) -> str:
    """The built-in picture: one row per layer, edges as straight arrows."""
    names = node_names(graph)
    boxes: dict[int, tuple[float, float, float, float]] = {}  # id -> x, y, w, h
    rows = []
    for layer in _layers(graph):
        sizes = []
        for node in layer:
            lines = node_label(node, names)
            sizes.append((node, lines, max(len(t) for t in lines) * CHAR_W + 2 * PAD_X,
                          len(lines) * LINE_H + 2 * PAD_Y))
        rows.append(sizes)
    row_widths = [sum(w for _, _, w, _ in row) + GAP_X * (len(row) - 1) for row in rows]
    width = max(row_widths, default=0) + 2 * GAP_X
    y = GAP_Y / 2
    for row, row_w in zip(rows, row_widths, strict=True):
        x = (width - row_w) / 2
        row_h = max(h for _, _, _, h in row)
        for node, _, w, h in row:
            boxes[node.id] = (x, y, w, h)
            x += w + GAP_X
        y += row_h + GAP_Y
    height = y - GAP_Y / 2

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
           f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="Helvetica, Arial, sans-serif" '
           'font-size="12">',
           f"<title>{escape(graph.name)}</title>",
           '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" '
           'markerHeight="7" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#555"/></marker></defs>']
    for node in graph.nodes:
        x2, y2, w2, _ = boxes[node.id]
        for i in node.inputs:
            x1, y1, w1, h1 = boxes[i.id]
            out.append(f'<line x1="{x1 + w1 / 2:.1f}" y1="{y1 + h1:.1f}" x2="{x2 + w2 / 2:.1f}" '
                       f'y2="{y2:.1f}" stroke="#555" marker-end="url(#arrow)"/>')
    for row in rows:
        for node, lines, _, _ in row:
            x, y0, w, h = boxes[node.id]
            out.append(f'<g class="{node.category}"><title>{escape(node.category)}</title>')
            out.append(f'<rect x="{x:.1f}" y="{y0:.1f}" width="{w:.1f}" height="{h:.1f}" rx="6" '
                       f'fill="{COLOURS[node.category]}" stroke="#333"/>')
            for k, text in enumerate(lines):
                weight = ' font-weight="bold"' if k == 0 else ""
                out.append(f'<text x="{x + w / 2:.1f}" y="{y0 + PAD_Y + (k + 0.8) * LINE_H:.1f}" '
                           f'text-anchor="middle"{weight}>{escape(text)}</text>')
            out.append("</g>")
    out.append("</svg>")
    return "\n".join(out)
