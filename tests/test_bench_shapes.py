"""bench/shapes.py without a GPU: the suite it times, its summaries, and the SVG it draws from a saved
JSON. Nothing here times or compiles a kernel."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def shapes():
    spec = importlib.util.spec_from_file_location("bench_shapes", ROOT / "bench" / "shapes.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module        # dataclasses look their module up by name
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def all_layers(shapes):
    return [layer for layers in shapes.FAMILIES.values() for layer in layers]


def test_suite_has_the_issue_shapes(shapes):
    layers = {layer.name: layer for layer in all_layers(shapes)}
    ns = {layer.n for layer in layers.values()}
    assert {128256, 152064} <= ns                                    # the two LM heads
    refs = {(layer.m, layer.n, layer.k) for layer in shapes.FAMILIES["reference"]}
    assert refs == {(8192, 8192, 8192), (4096, 4096, 4096), (8192, 8192, 1024)}
    assert layers["qwen2.5-7b/qkv"].epilogue == "bias"
    assert layers["llama3-8b/qkv"].epilogue == "identity"
    assert (layers["llama3-70b/down"].k, layers["llama3-70b/down"].n) == (28672, 8192)
    for layer in layers.values():
        if layer.layer in ("o_proj", "down", "expert_down"):
            assert layer.epilogue == "residual", layer.name
        if layer.family == "lm-head":
            assert layer.epilogue == "identity"


def test_swiglu_weight_is_gate_and_up_stacked(shapes):
    swiglu = [layer for layer in all_layers(shapes) if layer.epilogue == "swiglu"]
    assert {layer.family for layer in swiglu} == {"llama3-8b", "llama3-70b", "qwen2.5-7b",
                                                   "mixtral-8x7b-expert", "deepseek-v3-expert"}
    for layer in swiglu:
        assert layer.gemm_n == 2 * layer.n                           # weight (2N, K)
        assert shapes.Case(layer, 64, "bf16").weight_bytes == 2 * layer.n * layer.k * 2
    llama = next(layer for layer in swiglu if layer.name == "llama3-8b/gate_up")
    assert (llama.gemm_n, llama.k) == (2 * 14336, 4096)


def test_default_suite_covers_m_dtypes_and_small_expert_m(shapes):
    cases = shapes.suite_from_args(shapes.parse_args([]))
    ms = {c.m for c in cases}
    assert min(ms) == 1 and max(ms) == 16384
    assert set(shapes.DEFAULT_MS) <= ms
    assert {c.dtype for c in cases} == {"bf16", "fp16"}
    expert_ms = {c.m for c in cases if c.layer.moe}
    assert {1, 8, 16, 32} <= expert_ms
    # Every layer runs at every M of its list, in both dtypes; the reference GEMMs at their own M.
    assert len([c for c in cases if c.layer.family == "reference"]) == 3 * 2
    assert len({(c.layer, c.m, c.dtype) for c in cases}) == len(cases)


def test_quick_and_filters(shapes):
    quick = shapes.suite_from_args(shapes.parse_args(["--quick"]))
    assert {c.dtype for c in quick} == {"bf16"}
    assert {c.m for c in quick if c.layer.m is None} == {64, 4096}
    assert {c.layer.epilogue for c in quick} == {"identity", "bias", "residual", "swiglu"}
    some = shapes.suite_from_args(shapes.parse_args(["--families", "llama3-8b,lm-head", "--layers",
                                                      "gate_up,llama3", "--ms", "1,64", "--dtypes", "f16"]))
    assert {(c.layer.name, c.m, c.dtype) for c in some} == {
        ("llama3-8b/gate_up", 1, "fp16"), ("llama3-8b/gate_up", 64, "fp16"),
        ("lm-head/llama3", 1, "fp16"), ("lm-head/llama3", 64, "fp16")}
    with pytest.raises(SystemExit):
        shapes.parse_args(["--families", "gpt-5"])


def test_dry_run_lists_rows(shapes, capsys):
    assert shapes.main(["--dry-run", "--families", "lm-head", "--ms", "1,16384"]) == 0
    out = capsys.readouterr().out
    assert "# 8 rows" in out
    assert "152064" in out and "16384x128256x4096" in out
    assert "estimated time" in out


def synthetic_rows(shapes):
    """Rows as a GPU run writes them, with made-up times, one of them a wrong result."""
    rows = []
    for i, case in enumerate(shapes.suite_from_args(shapes.parse_args(
            ["--families", "llama3-8b,deepseek-v3-expert,reference", "--ms", "1,64,4096"]))):
        row = shapes.row_template(case)
        row["copy_tbs"] = 3.0
        # Every fifth row slower than cuBLAS's floor, every fourth fused one slower than eager.
        row["t_us"] = {"cublas": 10.0 + i, "evtc_id": (10.0 + i) * (1.25 if i % 5 == 0 else 0.9)}
        if row["group"] != "identity":
            row["t_us"].update(eager=20.0 + i, compile=15.0 + i,
                               evtc_fused=(20.0 + i) * (1.1 if i % 4 == 1 else 0.5))
        if case.layer.layer == "down" and case.m == 64 and case.dtype == "fp16":
            row["failures"].append("evtc_fused: WRONG RESULT, error 1.0e+00 > 5e-03")
        shapes.fill_ratios(row)
        rows.append(row)
    return rows


def test_summaries_leave_failures_out(shapes):
    rows = synthetic_rows(shapes)
    summary = shapes.summarize(rows)
    failed = [r for r in rows if r["failures"]]
    assert len(failed) == 1 and failed[0]["ratio_eager"] is None and failed[0]["ratio_id"] is not None
    assert len(summary["failures"]) == 1 and "WRONG RESULT" in summary["failures"][0]
    ratios = [r["ratio_eager"] for r in rows if r["ratio_eager"] is not None]
    assert summary["fused_vs_eager"]["all"]["n"] == len(ratios)
    assert math.isclose(summary["fused_vs_eager"]["all"]["geomean"],
                        math.exp(sum(map(math.log, ratios)) / len(ratios)))
    assert summary["fused_vs_eager"]["all"]["worst"] == min(ratios)
    assert set(summary["fused_vs_eager"]["by_m"]) == {"1", "64", "4096"}
    fusable = summary["fused_vs_eager/cuBLASLt-fusable"]["all"]["n"]
    separate = summary["fused_vs_eager/separate-kernel"]["all"]["n"]
    assert fusable + separate == len(ratios) and separate > 0
    assert summary["identity_vs_cublas"]["all"]["n"] == len(rows)
    ws = summary["weight_streaming"]
    assert ws["n"] > 0 and 0 < ws["geomean_fraction_of_copy"]
    # The issue's floors: rows below them are counted and named.
    identity = summary["identity_vs_cublas"]["all"]
    assert identity["floor"] == shapes.IDENTITY_FLOOR
    assert identity["below"] == sum(r["ratio_id"] < shapes.IDENTITY_FLOOR for r in rows) > 0
    assert len(identity["below_rows"]) == identity["below"]
    assert summary["fused_vs_eager"]["all"]["below"] == sum(x < shapes.FUSED_FLOOR for x in ratios) > 0


def test_plot_from_json_draws_an_svg(shapes, tmp_path, capsys):
    rows = synthetic_rows(shapes)
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps({"meta": {"device": "synthetic"}, "rows": rows}))
    svg = tmp_path / "run.svg"
    rc = shapes.main(["--plot-from", str(saved), "--plot", str(svg)])
    assert rc == 1                                   # the wrong result makes the run fail
    out = capsys.readouterr().out
    assert "FAILURE" in out and "geomean" in out
    root = ET.parse(svg).getroot()                   # well-formed XML
    ns = "{http://www.w3.org/2000/svg}"
    texts = " ".join(t.text or "" for t in root.iter(f"{ns}text"))
    assert "cuBLAS time / evtc time" in texts and "eager PyTorch time / evtc fused time" in texts
    assert {"llama3-8b", "deepseek-v3-expert", "reference"} <= set(texts.split())
    assert len(list(root.iter(f"{ns}polyline"))) >= 3
    assert any(line.get("stroke-dasharray") for line in root.iter(f"{ns}line"))   # the 1.0 line


def test_merge_joins_runs(shapes, tmp_path):
    rows = synthetic_rows(shapes)
    ok = [r for r in rows if not r["failures"]]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"meta": {"device": "x"}, "rows": ok[:5]}))
    b.write_text(json.dumps({"meta": {"device": "x"}, "rows": ok[5:]}))
    merged = tmp_path / "all.json"
    svg = tmp_path / "all.svg"
    assert shapes.main(["--merge", str(a), str(b), "--json", str(merged), "--plot", str(svg),
                        "--plot-by", "layer"]) == 0
    data = json.loads(merged.read_text())
    assert len(data["rows"]) == len(ok) and data["summary"]["failures"] == []
    ET.parse(svg)


def test_measure_checks_before_timing(shapes):
    """One row end to end on the CPU, with stand-ins for evtc.compile and the timer: a kernel that
    computes the epilogue passes the check; one that is off fails loudly and gets no ratio."""
    torch = pytest.importorskip("torch")
    shapes.load_torch()
    args = shapes.parse_args(["--no-torch-compile"])
    timed = []

    def timer(fns, warmup, samples, reps):
        for fn in fns:
            fn()
        timed.append(len(fns))
        return [0.01 * (i + 1) for i in range(len(fns))]

    def good_compile(fn, example, config=None):
        return lambda a, b, **ops: fn((a.float() @ b.float()), **ops).to(a.dtype)

    def bad_compile(fn, example, config=None):
        return lambda a, b, **ops: (fn((a.float() @ b.float()), **ops) * 1.1).to(a.dtype)

    compiled = shapes.TorchCompiled(False, 10, "default")
    case = shapes.Case(shapes.Layer("t", "gate_up", 48, 256, "swiglu"), 16, "bf16")
    for compile_fn, ok in ((good_compile, True), (bad_compile, False)):
        kernels = shapes.Kernels(None, compile_fn)
        gen = torch.Generator().manual_seed(0)
        row = shapes.measure(case, kernels, compiled, gen, args, timer, device="cpu", copy_tbs=3.0)
        assert set(row["t_us"]) == {"cublas", "evtc_id", "eager", "evtc_fused"}
        assert (row["failures"] == []) == ok, row["failures"]
        assert (row["ratio_eager"] is not None) == ok
        assert row["err"]["evtc_fused"] < 3e-2 if ok else row["err"]["evtc_fused"] > 3e-2
    assert timed == [4, 4]                           # all four in one timer call per row


def test_launch_info_names_a_one_wave_twin(shapes):
    from evtc.plan.config import GemmConfig

    class Fake:
        last_path = "kernel"

        def __init__(self, config):
            self.config = config

        def launch_for(self, m, n, k):
            return self.config, 1

    base = GemmConfig(b_major="k", schedule="cooperative", tile_n=112, epi_tile_n=16, cluster=(2, 1))
    assert shapes.launch_info(Fake(base), 512, 3584, 4096) == "kernel 128x112 coop c2x1 s1"
    twin = base.replace(epi_stages=1, load_stages=2)
    assert shapes.launch_info(Fake(twin), 512, 3584, 4096) == "kernel 128x112 coop c2x1 s1 d1 l2"
