"""The text and Graphviz forms of a graph."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F
from support import gemm_inputs, rand

import evtc


def _graph():
    def fused(acc, C, bias, alpha):
        y = F.gelu(alpha * acc + bias)  # line A
        return y + C, y.abs().amax()  # line B

    ex = gemm_inputs(16, 24, 8, None) | {"C": rand(16, 24, dtype=torch.bfloat16), "bias": rand(24),
                                          "alpha": 1.5}
    return evtc.trace(fused, ex), fused


def test_print_reads_like_the_epilogue():
    graph, fn = _graph()
    text = str(graph)
    lines = text.splitlines()
    assert lines[0].startswith("graph fused(acc, ")
    assert "C: bf16[M, N] tile" in lines[0] and "bias: f32[N] row" in lines[0]
    # float16 acc + a float32 bias: float32 outputs, as torch promotes them.
    assert "alpha: runtime scalar" in lines[0] and "D0: f32[M, N]" in lines[0] and "D1: f32[]" in lines[0]
    assert any(re.search(r"= gelu\(%\d+\)", line) for line in lines)
    assert any(".amax()" in line for line in lines)
    # Every computed node names the user's file and line and shows the source text.
    first = fn.__code__.co_firstlineno
    gelu_line = next(line for line in lines if "gelu(" in line)
    assert f"test_printer.py:{first + 1}" in gelu_line and "# line A" in gelu_line
    store = next(line for line in lines if line.strip().startswith("store D1"))
    assert f"test_printer.py:{first + 2}" in store
    # One node per line (literals are printed inline where they are used).
    assert len(lines) == 1 + sum(1 for n in graph.nodes if n.op != "literal")


def test_nodes_remember_source_lines():
    graph, fn = _graph()
    first = fn.__code__.co_firstlineno
    gelu = next(n for n in graph.nodes if n.op == "gelu")
    assert gelu.loc.lineno == first + 1 and "F.gelu" in gelu.loc.text


def test_to_dot_colours_by_kind_and_labels_expressions():
    graph, _ = _graph()
    dot = graph.to_dot()
    assert dot.startswith('digraph "fused" {') and dot.rstrip().endswith("}")
    for kind in ("load", "compute", "reduction", "store"):
        assert f'tooltip="{kind}"' in dot
    assert len(set(re.findall(r'fillcolor="(#[0-9a-f]{6})"', dot))) == 4
    edges = re.findall(r"n(\d+) -> n(\d+);", dot)
    assert len(edges) == sum(len(n.inputs) for n in graph.nodes)
    assert "F.gelu(alpha * acc + bias)" in dot


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz's dot is not installed")
def test_dot_renders_with_graphviz(tmp_path):
    graph, _ = _graph()
    src = tmp_path / "g.dot"
    src.write_text(graph.to_dot())
    out = tmp_path / "g.svg"
    subprocess.run(["dot", "-Tsvg", str(src), "-o", str(out)], check=True)
    assert out.read_text().lstrip().startswith("<?xml")


def test_render_writes_an_svg_picture_without_graphviz(tmp_path):
    """The built-in layout: a well-formed SVG with one coloured box per node, labelled with the
    user's expressions, and one arrow per edge."""
    import xml.etree.ElementTree as ET

    graph, _ = _graph()
    out = graph.render(tmp_path / "g.svg", engine="builtin")
    root = ET.parse(out).getroot()
    ns = {"s": "http://www.w3.org/2000/svg"}
    rects = root.findall(".//s:g/s:rect", ns)
    assert len(rects) == len(graph.nodes)
    assert len({r.get("fill") for r in rects}) == 4  # load, compute, reduction, store
    assert len(root.findall(".//s:line", ns)) == sum(len(n.inputs) for n in graph.nodes)
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert "F.gelu(alpha * acc + bias)" in " ".join(texts)
    # Boxes do not overlap within a row, and every arrow points downwards.
    boxes = sorted((float(r.get("y")), float(r.get("x")), float(r.get("width"))) for r in rects)
    for (y1, x1, w1), (y2, x2, _) in zip(boxes, boxes[1:], strict=False):
        assert y1 != y2 or x1 + w1 <= x2
    for line in root.findall(".//s:line", ns):
        assert float(line.get("y2")) > float(line.get("y1"))
    assert graph.render(tmp_path / "g.dot").read_text() == graph.to_dot()
    with pytest.raises(ValueError, match="suffix"):
        graph.render(tmp_path / "g.jpg")
    if shutil.which("dot") is None:
        with pytest.raises(RuntimeError, match="Graphviz"):
            graph.render(tmp_path / "g.png")
