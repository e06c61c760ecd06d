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
    assert "alpha: runtime scalar" in lines[0] and "D0: f16[M, N]" in lines[0] and "D1: f32[]" in lines[0]
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
