"""CPU tests of evtc.compile: every catalogue epilogue compiles for sm_90a, and its PTX has the
instructions the design relies on (wgmma, TMA loads and stores, stmatrix). The generated source is
checked for what a reader expects: one statement per node, the user's lines as comments."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import re

import pytest
import torch
from compile_catalogue import CATALOGUE, compile_by_name, compile_entry, make_inputs

import evtc
from evtc.codegen.emit import emit
from evtc.ir.ops import ELEMENTWISE

TMA_LOAD = re.compile(r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global")
TMA_STORE = re.compile(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """Compile the catalogue once, two processes at a time, into a disk cache for the tests."""
    path = tmp_path_factory.mktemp("evtc-catalogue")
    jobs = [(e.name, "float16", str(path)) for e in CATALOGUE]
    ctx = multiprocessing.get_context("spawn")
    workers = max(1, min(4, os.cpu_count() or 1))
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        for f in [pool.submit(compile_by_name, *job) for job in jobs]:
            f.result()
    return str(path)


def test_catalogue_covers_every_op_kind_and_cast():
    assert len(CATALOGUE) >= 40
    ops, kinds, dtypes, outputs = set(), set(), set(), 0
    for e in CATALOGUE:
        g = evtc.trace(e.fn, make_inputs(e, 256, 512, 128, 2 if e.batched else None, torch.float16),
                       out_dtypes=e.out_dtypes)
        ops |= {n.op for n in g}
        kinds |= {(o.kind, o.batched) for o in g.operands.values()}
        dtypes |= {n.dtype for n in g if n.op in ("cast", "store")}
        outputs = max(outputs, len(g.stores))
    assert not set(ELEMENTWISE) - ops, f"ops without an epilogue: {sorted(set(ELEMENTWISE) - ops)}"
    assert {("tile", False), ("tile", True), ("row", False), ("row", True), ("col", False), ("col", True),
            ("scalar", False), ("arg", False)} <= kinds
    assert {torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2} <= dtypes
    assert outputs >= 4


@pytest.mark.parametrize("entry", CATALOGUE, ids=[e.name for e in CATALOGUE])
def test_catalogue_compiles_for_sm90(entry, cache_dir):
    k = compile_entry(entry, torch.float16, cache_dir)
    assert k.origin in ("disk", "compiled")
    ptx = k.ptx
    assert "wgmma.mma_async" in ptx
    assert TMA_LOAD.search(ptx), "no TMA load"
    stores = len(TMA_STORE.findall(ptx))
    outputs = len(k.plan.outputs)  # full-tile outputs (reductions go to float32 workspaces)
    assert stores >= outputs, f"{stores} TMA store instructions for {outputs} outputs"
    assert k.config.store_d == (outputs > 0)
    if not outputs:
        assert stores == 0, "an epilogue of reductions only stores no tile"
    d = k.config.d_dtype
    if d in ("float16", "bfloat16") and outputs:
        assert "stmatrix" in ptx
    if any(n.dtype == torch.float8_e4m3fn for n in k.graph.stores):
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    if any(n.dtype == torch.float8_e5m2 for n in k.graph.stores):
        assert "cvt.rn.satfinite.e5m2x2.f32" in ptx
    loads = sum(1 for o in k.graph.operands.values() if o.kind in ("tile", "row", "col"))
    if loads:
        assert len(TMA_LOAD.findall(ptx)) > 2, "no TMA load of the epilogue's operands"
    # The source is what was compiled.
    assert k.cache_path is not None
    assert (k.cache_path / "epilogue.py").read_text() == k.source


def test_bfloat16_kernel_compiles(tmp_path):
    e = next(x for x in CATALOGUE if x.name == "relu_lincomb_bias")
    k = compile_entry(e, torch.bfloat16, str(tmp_path))
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16" in k.ptx  # default tile 128x128
    # D is float32: the catalogue's bias is float32, which promotes the result, as in torch.
    assert k.config.ab_dtype == "bfloat16" and k.config.d_dtype == "float32"


def test_generated_source_reads_like_the_epilogue():
    e = next(x for x in CATALOGUE if x.name == "relu_lincomb_bias")
    g = evtc.trace(e.fn, make_inputs(e, 256, 512, 128, None, torch.float16))
    src = emit(g).source
    assert "class ReluLincombBiasEpilogue(FusedVisitor):" in src
    assert "TileLoad('C', 'float16', major='n', batched=False)" in src
    assert "RowVector('bias', 'float32', batched=False)" in src
    assert "ArgScalar('alpha')" in src
    body = src[src.index("def fragment"):]
    assert "# compile_catalogue.py:" in body and "return torch.relu(alpha * acc + beta * C + bias)" in body
    assert "v2 = alpha * acc" in body and "op.relu(" in body
    assert body.count("# compile_catalogue.py:") == 1  # one comment per user expression
    compile(src, "<generated>", "exec")


def _quoting_source_line(acc):
    return acc * 2 + 0 * len("""x""")  # a path in a comment: C:\Users\me\notes.txt


def test_generated_source_quotes_any_source_line():
    """The docstring of the generated file quotes the graph, with the user's source lines: a
    backslash or a triple quote on one must neither end the docstring nor become an escape."""
    a, b = torch.randn(64, 32).half(), torch.randn(32, 64).half()
    src = emit(evtc.trace(_quoting_source_line, {"a": a, "b": b})).source
    module = compile(src, "<generated>", "exec")
    doc = module.co_consts[0]
    assert 'len("""x""")' in doc and "C:\\Users\\me\\notes.txt" in doc


def test_uniform_values_are_computed_once_per_tile():
    e = next(x for x in CATALOGUE if x.name == "uniform_stage")
    g = evtc.trace(e.fn, make_inputs(e, 256, 512, 128, None, torch.float16))
    src = emit(g).source
    uniform = src[src.index("def uniform"):src.index("def fragment")]
    fragment = src[src.index("def fragment"):]
    assert "op.exp(" in uniform and "op.sqrt(" in uniform
    assert "op.exp(" not in fragment and "op.sqrt(" not in fragment


def _relu_lincomb_bias_aux(acc, C, bias, alpha: float, beta: float):
    pre = alpha * acc + beta * C + bias
    return torch.relu(pre), pre.to(torch.bfloat16)


def test_pingpong_fused_epilogue_compiles(tmp_path):
    """relu(alpha*acc + beta*C + bias) with a row bias and an aux output under the pingpong schedule."""
    import re
    import shutil
    import subprocess

    inputs = {
        "a": torch.empty(256, 128, dtype=torch.float16, device="meta"),
        "b": torch.empty(128, 512, dtype=torch.float16, device="meta"),
        "C": torch.empty(256, 512, dtype=torch.float16, device="meta"),
        "bias": torch.empty(512, dtype=torch.float32, device="meta"),
        "alpha": 1.5,
        "beta": 0.5,
    }
    k = evtc.compile(_relu_lincomb_bias_aux, inputs, config={"schedule": "pingpong"},
                     cache_dir=str(tmp_path))
    assert k.config.schedule == "pingpong" and k.config.tile_shape_mnk[:2] == (128, 128)
    ptx = k.ptx
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16" in ptx
    assert len(TMA_LOAD.findall(ptx)) > 2
    assert len(TMA_STORE.findall(ptx)) >= 2
    assert "stmatrix" in ptx and "setmaxnreg.inc" in ptx
    assert re.search(r"bar\.arrive\s+%r\d+, 256;", ptx)
    ptxas = shutil.which("ptxas")
    if ptxas is not None:
        (tmp_path / "k.ptx").write_text(ptx)
        out = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(tmp_path / "k.ptx"), "-o",
                              str(tmp_path / "k.cubin")], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        report = out.stdout + out.stderr
        assert all(s == ("0", "0") for s in
                   re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)), report
