"""CPU tests of evtc.compile's runtime: caches (memory, disk across processes, damaged entries,
threads), compile-time errors, and the checks every call makes before launching (CPU and meta
tensors stand in for CUDA ones: the checks run first, the missing GPU is reported last)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import evtc
from evtc.compile import clear_memory_cache

ROOT = Path(__file__).resolve().parents[1]


def bias_relu(acc, C, bias, alpha: float):
    # A float32 bias makes the sum float32, as in torch: the cast keeps C's dtype for the output.
    return torch.relu(alpha * acc + C + bias).to(C.dtype)


def example(m=256, n=512, k=128, dtype=torch.float16, device="meta"):
    def empty(*shape, dt=dtype):
        return torch.empty(shape, dtype=dt, device=device)

    return dict(a=empty(m, k), b=empty(k, n), C=empty(m, n), bias=empty(n, dt=torch.float32), alpha=1.0)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    return evtc.compile(bias_relu, example(), cache_dir=tmp_path_factory.mktemp("evtc-rt"))


def test_compile_gives_source_graph_ptx_and_explain(kernel):
    assert "class BiasReluEpilogue(FusedVisitor)" in kernel.source
    assert kernel.graph.name == "bias_relu"
    assert ".target sm_90a" in kernel.ptx
    text = kernel.explain()
    for needle in ("C: float16[M, N], N contiguous: tile", "bias: float32[N], N contiguous: row",
                   "alpha: runtime float32 scalar", "stages: A/B", "shared memory", "registers"):
        assert needle in text


def test_same_signature_is_compiled_once(kernel):
    again = evtc.compile(bias_relu, example(m=1000, n=64, k=24), cache_dir=kernel.cache_path.parents[1])
    assert again is kernel  # sizes are runtime: same kernel


def test_cluster_shape_is_chosen_per_problem(kernel):
    assert kernel.config.cluster == (1, 2)
    assert kernel.cluster_for(8192, 8192) == (1, 2)
    assert kernel.cluster_for(600, 512) == (1, 2)     # one wave of tiles: the configured kernel
    assert kernel.cluster_for(16384, 128) == (2, 1)   # a 1x2 cluster would idle half its CTAs
    assert kernel.cluster_for(128, 128, 200) == (1, 1)
    assert "cluster: 1x2, or per call another shape" in kernel.explain()
    # A pinned cluster is kept for every problem; it shares the compiled kernel, not the object.
    pinned = evtc.compile(bias_relu, example(), config={"cluster": (1, 2)},
                          cache_dir=kernel.cache_path.parents[1])
    assert pinned is not kernel and pinned.key == kernel.key
    assert pinned.cluster_for(16384, 128) == (1, 2) and "per call" not in pinned.explain()


def test_config_object_counts_only_the_fields_it_changes(kernel, tmp_path):
    """A GemmConfig passed as config pins what differs from its schedule's defaults, nothing else:
    the cluster is still chosen per call and the epilogue loads still planned."""
    from evtc.plan.config import GemmConfig

    k = evtc.compile(bias_relu, example(), config=GemmConfig(epi_tile_n=64), cache_dir=tmp_path)
    assert k is evtc.compile(bias_relu, example(), config={"epi_tile_n": 64}, cache_dir=tmp_path)
    assert k.config.epi_tile_n == 64 and k.cluster_for(16384, 128) == (2, 1)
    # The epilogue loads are planned for the default config (2 stages per warpgroup here); a config
    # that sets load_stages keeps its own.
    assert kernel.config.load_stages == 2
    fixed = evtc.compile(bias_relu, example(), config=GemmConfig(load_stages=3), cache_dir=tmp_path)
    assert fixed.config.load_stages == 3


def test_layout_changes_recompile(kernel, tmp_path):
    ex = example()
    ex["C"] = torch.empty(512, 256, dtype=torch.float16, device="meta").t()
    other = evtc.compile(bias_relu, ex, cache_dir=tmp_path)
    assert other.key != kernel.key
    assert "major='m'" in other.source


_CHILD = r"""
import json, sys
sys.path.insert(0, {root!r})
sys.path.insert(0, {tests!r})
import os
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
import torch, evtc
from test_compile_runtime import bias_relu, example
k = evtc.compile(bias_relu, example(), cache_dir={cache!r})
print(json.dumps(dict(origin=k.origin, seconds=k.seconds, key=k.key, ptx=len(k.ptx))))
"""


def _child(cache: Path) -> dict:
    script = _CHILD.format(root=str(ROOT), tests=str(ROOT / "tests"), cache=str(cache))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_disk_cache_across_processes_and_damaged_entries(tmp_path):
    first = _child(tmp_path)
    assert first["origin"] == "compiled"
    second = _child(tmp_path)
    assert second["origin"] == "disk" and second["key"] == first["key"]
    assert second["seconds"] < 1.0 and second["ptx"] == first["ptx"]

    entry = tmp_path / first["key"][:2] / first["key"]
    obj = entry / "kernel.o"
    obj.write_bytes(obj.read_bytes()[:-100] + b"\0" * 100)  # damaged: checksum mismatch
    assert _child(tmp_path)["origin"] == "compiled"
    assert _child(tmp_path)["origin"] == "disk"

    manifest = json.loads((entry / "manifest.json").read_text())
    manifest["key"] = "f" * 64  # a foreign entry under this key's name
    (entry / "manifest.json").write_text(json.dumps(manifest))
    assert _child(tmp_path)["origin"] == "compiled"


_FRONT_MODULE = """
import torch

def scaled_gelu(acc, bias, alpha: float):
    return torch.nn.functional.gelu(alpha * acc + bias)
"""

_FRONT_CHILD = """
import json, sys, time
sys.path.insert(0, {module_dir!r})
import torch
import evtc
from front_epilogue import scaled_gelu
ex = dict(a=torch.empty(256, 64, dtype=torch.float16, device="meta"),
          b=torch.empty(64, 128, dtype=torch.float16, device="meta"),
          bias=torch.empty(128, dtype=torch.float32, device="meta"), alpha=1.0)
k = evtc.compile(scaled_gelu, ex, cache_dir={cache!r})
cutlass = "cutlass" in sys.modules
launch = k.launch_for(16, 4096, 4096)
print(json.dumps({{"origin": k.origin, "key": k.key, "cutlass": cutlass,
                  "sympy": "sympy" in sys.modules, "names": k.operand_names,
                  "family": [[c.schedule, c.tile_m, c.tile_n] for c in k._family],
                  "launch": [launch[0].tile_m, launch[0].tile_n, launch[1]]}}))
"""


def _front_child(module_dir: Path, cache: Path) -> dict:
    script = _FRONT_CHILD.format(module_dir=str(module_dir), cache=str(cache))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_front_record_hit_loads_without_tracing_sympy_or_the_dsl(tmp_path):
    module_dir = tmp_path / "mod"
    module_dir.mkdir()
    (module_dir / "front_epilogue.py").write_text(_FRONT_MODULE)
    cache = tmp_path / "cache"
    first = _front_child(module_dir, cache)
    assert first["origin"] == "compiled" and first["cutlass"]
    records = list((cache / "front").glob("*/*.json"))
    assert len(records) == 1
    second = _front_child(module_dir, cache)
    assert second["origin"] == "disk" and second["key"] == first["key"]
    assert not second["cutlass"] and not second["sympy"], second
    assert second["names"] == ["bias", "alpha"]
    # The family of configurations comes back with the record: the same launch per problem size.
    assert len(first["family"]) > 1 and second["family"] == first["family"]
    assert second["launch"] == first["launch"] and first["launch"][0] == 64

    # A change to the function's code is another front key: traced and compiled, never the old kernel.
    (module_dir / "front_epilogue.py").write_text(_FRONT_MODULE.replace("alpha * acc", "alpha * acc * 2"))
    third = _front_child(module_dir, cache)
    assert third["origin"] == "compiled" and third["key"] != first["key"]


def test_damaged_foreign_or_stale_front_records_are_never_used(tmp_path, caplog):
    def gelu_bias(acc, bias):
        return torch.nn.functional.gelu(acc + bias)

    def relu_bias(acc, bias):
        return torch.relu(acc + bias)

    ex = dict(a=torch.empty(64, 32, dtype=torch.float16, device="meta"),
              b=torch.empty(32, 64, dtype=torch.float16, device="meta"),
              bias=torch.empty(64, dtype=torch.float16, device="meta"))
    clear_memory_cache()
    gelu = evtc.compile(gelu_bias, ex, cache_dir=tmp_path)
    relu = evtc.compile(relu_bias, ex, cache_dir=tmp_path)
    records = {p.stem: p for p in (tmp_path / "front").glob("*/*.json")}
    assert len(records) == 2
    gelu_record = next(p for p in records.values() if json.loads(p.read_text())["body"]["key"] == gelu.key)
    relu_record = next(p for p in records.values() if p != gelu_record)

    def again(fn):
        clear_memory_cache()
        caplog.clear()
        with caplog.at_level("INFO", logger="evtc"):
            return evtc.compile(fn, ex, cache_dir=tmp_path)

    # Garbage: ignored, the call traces (the entry itself is fine: a disk hit) and rewrites it.
    gelu_record.write_text("{not json")
    k = again(gelu_bias)
    assert k.key == gelu.key and "by its front record" not in caplog.text
    assert "torch.nn.functional.gelu" in k.source or "gelu" in k.source
    assert again(gelu_bias).key == gelu.key and "by its front record" in caplog.text

    # Foreign: relu's valid record under gelu's name names relu's kernel; it is refused.
    good = gelu_record.read_text()
    gelu_record.write_text(relu_record.read_text())
    k = again(gelu_bias)
    assert k.key == gelu.key and "by its front record" not in caplog.text

    # Tampered: a body whose checksum does not match (here, pointing at relu's kernel).
    record = json.loads(good)
    record["body"]["key"] = relu.key
    gelu_record.write_text(json.dumps(record))
    k = again(gelu_bias)
    assert k.key == gelu.key and "by its front record" not in caplog.text

    # Stale: the record is intact but its kernel entry is damaged: rebuilt, never run.
    gelu_record.write_text(good)
    library = tmp_path / gelu.key[:2] / gelu.key / "kernel.so"
    if not library.exists():
        library = library.with_name("kernel.o")
    # (A new file in its place: this process has the old one mapped, and a mapped library must not
    # change under it.)
    damaged = library.with_name("damaged.tmp")
    damaged.write_bytes(library.read_bytes()[:-64] + b"\0" * 64)
    damaged.replace(library)
    k = again(gelu_bias)
    assert k.key == gelu.key and k.origin == "compiled" and "by its front record" not in caplog.text


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    from evtc.runtime.cache import DiskCache

    monkeypatch.setenv("EVTC_CACHE_DIR", str(tmp_path / "env-cache"))
    assert DiskCache().root == tmp_path / "env-cache"


def test_each_cache_directory_gets_its_own_kernel(tmp_path):
    """A second cache directory builds (or loads) its own kernel there, not the first one's
    from this process's memory; the same directory again is a memory hit."""
    def tanh_bias(acc, bias):
        return torch.tanh(acc + bias)

    ex = dict(a=torch.empty(64, 32, dtype=torch.float16, device="meta"),
              b=torch.empty(32, 64, dtype=torch.float16, device="meta"),
              bias=torch.empty(64, dtype=torch.float16, device="meta"))
    first = evtc.compile(tanh_bias, ex, arch="sm_90a", cache_dir=tmp_path / "one")
    again = evtc.compile(tanh_bias, ex, arch="sm_90a", cache_dir=tmp_path / "one")
    second = evtc.compile(tanh_bias, ex, arch="sm_90a", cache_dir=tmp_path / "two")
    assert again is first
    assert second is not first and second.key == first.key
    assert second.cache_path is not None and (tmp_path / "two") in second.cache_path.parents
    assert first.cache_path is not None and (tmp_path / "one") in first.cache_path.parents
    assert list((tmp_path / "two").glob(f"*/{first.key}"))


def test_threads_compile_one_kernel(tmp_path):
    def scaled(acc, s):
        return acc * s + 0.125

    ex = dict(a=torch.empty(64, 64, dtype=torch.float16, device="meta"),
              b=torch.empty(64, 64, dtype=torch.float16, device="meta"), s=torch.empty((), device="meta"))
    clear_memory_cache()
    results: list = []

    def work():
        results.append(evtc.compile(scaled, ex, cache_dir=tmp_path))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and all(r is results[0] for r in results)
    assert results[0].origin == "compiled"
    entries = [p for p in tmp_path.glob("??/*") if p.is_dir()]
    assert len(entries) == 1


def test_threads_compile_different_kernels_at_once(tmp_path):
    """Different epilogues compiled from threads at the same time: each gets its kernel (the DSL's
    compiler crashed the process when two builds overlapped)."""
    epilogues = [lambda acc: acc * 2.0, lambda acc, C: acc + C, lambda acc: (acc.relu(), (acc * acc).sum(-1))]
    ex = dict(a=torch.randn(64, 32, dtype=torch.float16), b=torch.randn(32, 48, dtype=torch.float16))
    C = torch.randn(64, 48)
    clear_memory_cache()
    results: dict = {}

    def work(i):
        try:
            fn = epilogues[i]
            ops = {"C": C} if i == 1 else {}
            kernel = evtc.compile(fn, {**ex, **ops}, cache_dir=tmp_path)
            want = fn(ex["a"].float() @ ex["b"].float(), **ops)
            results[i] = (kernel, kernel(ex["a"], ex["b"], **ops), want)
        except Exception as exc:  # noqa: BLE001 - reported below
            results[i] = exc

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(epilogues))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(len(epilogues)):
        assert not isinstance(results[i], Exception), results[i]
        kernel, got, want = results[i]
        assert kernel.origin == "compiled"
        as_tuple = (lambda v: v if isinstance(v, tuple) else (v,))
        for g, w in zip(as_tuple(got), as_tuple(want), strict=True):
            torch.testing.assert_close(g.float(), w.float(), rtol=1e-2, atol=1e-2)
    assert len({results[i][0].key for i in results}) == len(epilogues)


# ---- compile-time errors -----------------------------------------------------------------------------


def test_an_epilogue_of_reductions_only_stores_no_tile(tmp_path):
    def only_reductions(acc):
        return acc.abs().amax(), (acc * acc).sum(-1)

    ex = dict(a=torch.empty(64, 64, dtype=torch.float16), b=torch.empty(64, 64, dtype=torch.float16))
    k = evtc.compile(only_reductions, ex, cache_dir=tmp_path)
    assert not k.config.store_d and "no-D" in k.config.short_name()
    assert "outputs = ()" in k.source and len(k.plan.reductions) == 2
    assert "wgmma.mma_async" in k.ptx
    assert not re.search(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared", k.ptx), "a TMA store"


def test_row_and_column_reductions_are_finished_in_the_kernel(tmp_path):
    """Per-row and per-column reductions, and what follows them, are finished by the kernel: the
    visitor has a finish method per axis, the kernel counts its tiles with an atomic, and the plan
    leaves nothing for the host. A reduction over everything has a second level (the blocks of
    rows combined across threads by shuffles); a float8 output of a reduction stays a host finish."""
    def rows_and_columns(acc, eps: float):
        return acc, torch.sqrt((acc * acc).mean(-1) + eps), acc.amax(-2).to(torch.bfloat16)

    def over_everything(acc):
        return acc, acc.abs().amax()

    def float8_row_max(acc):
        return acc, acc.amax(-1).to(torch.float8_e4m3fn)

    ex = dict(a=torch.empty(64, 64, dtype=torch.float16), b=torch.empty(64, 64, dtype=torch.float16))
    k = evtc.compile(rows_and_columns, {**ex, "eps": 1e-6}, cache_dir=tmp_path)
    assert k.plan.kernel_finish == (("row", ("D1",)), ("col", ("D2",)))
    assert [s.dims for s in k.plan.finish_args] == [("R",), ("S",), ("Q",)]
    assert "def finish_rows(self, r0, eps, size_" in k.source and "op.sqrt(" in k.source
    assert "def finish_columns(self, r1):" in k.source
    assert re.search(r"atom\.global\.acq_rel\.add", k.ptx) and "fence.acq_rel.gpu" in k.ptx
    assert "finished in the kernel by the last tile of each block of rows" in k.explain()
    everything = evtc.compile(over_everything, ex, cache_dir=tmp_path)
    assert everything.plan.kernel_finish == (("all", ("D1",)),)
    assert [s.dims for s in everything.plan.finish_args] == [("1",), ("Q",)]
    assert "def finish_all(self, r0):" in everything.source
    assert "shfl.sync.bfly" in everything.ptx and re.search(r"atom\.global\.acq_rel\.add", everything.ptx)
    assert "then the last block of the launch" in everything.explain()
    host = evtc.compile(float8_row_max, ex, cache_dir=tmp_path)
    assert host.plan.kernel_finish == () and "def finish_" not in host.source
    assert not re.search(r"atom\.global\.acq_rel\.add", host.ptx)


def test_float8_only_outputs_make_a_float8_d(tmp_path):
    def fp8_only(acc):
        return acc.to(torch.float8_e4m3fn)

    def fp8_pair(acc):
        return acc.to(torch.float8_e5m2), (acc * 2).to(torch.float8_e4m3fn), acc.half()

    ex = dict(a=torch.empty(64, 64, dtype=torch.float16), b=torch.empty(64, 64, dtype=torch.float16))
    k = evtc.compile(fp8_only, ex, cache_dir=tmp_path)
    assert k.config.d_dtype == "float8_e4m3fn"
    assert "cvt.rn.satfinite.e4m3x2.f32" in k.ptx and "stmatrix" not in k.ptx
    assert "kernel D store (register-to-shared copy + TMA)" in k.explain()
    # With a 16-bit output among them, that one is the kernel's D (stmatrix) and the float8 ones
    # are extra stores.
    k2 = evtc.compile(fp8_pair, ex, cache_dir=tmp_path)
    assert k2.config.d_dtype == "float16" and "stmatrix" in k2.ptx


def test_operand_layouts_tma_cannot_load_compile_to_the_nearest_layout(tmp_path):
    """A strided example compiles; calls with such views are staged (tests/test_call_paths*.py)."""
    ex = example()
    ex["bias"] = torch.empty(1024, device="meta")[::2]
    k = evtc.compile(bias_relu, ex, cache_dir=tmp_path)
    assert "bias: float32[N], N contiguous" in k.explain()


def test_bad_config(tmp_path):
    with pytest.raises(evtc.CompileError, match="tile_n"):
        evtc.compile(bias_relu, example(), config={"tile_n": 96}, cache_dir=tmp_path)


# ---- call checks -----------------------------------------------------------------------------------


def _cpu_args(m=256, n=512, k=128):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=g).half()
    b = torch.randn(k, n, generator=g).half()
    C = torch.randn(m, n, generator=g).half()
    bias = torch.randn(n, generator=g)
    return a, b, C, bias


@pytest.mark.parametrize("change, message", [
    (lambda a, b, C, bias: dict(C=C, bias=bias), r"missing argument\(s\) \['alpha'\]"),
    (lambda a, b, C, bias: dict(C=C, bias=bias, alpha=1.0, beta=2.0), r"unexpected argument\(s\) \['beta'\]"),
    (lambda a, b, C, bias: dict(C=C.double(), bias=bias, alpha=1.0), "C must be torch.float16"),
    (lambda a, b, C, bias: dict(C=C[:, :500], bias=bias, alpha=1.0), r"C has shape \(256, 500\), incons"),
    (lambda a, b, C, bias: dict(C=C, bias=bias[:100], alpha=1.0), r"bias has shape \(100,\), inconsistent"),
    (lambda a, b, C, bias: dict(C=C[None], bias=bias, alpha=1.0), "C must be 2-d"),
    (lambda a, b, C, bias: dict(C=C, bias=bias, alpha=torch.tensor(1.0)), "alpha is a runtime scalar"),
    (lambda a, b, C, bias: dict(C=C.to("meta"), bias=bias, alpha=1.0), "C is on meta but a is on cpu"),
])
def test_call_errors(kernel, change, message):
    a, b, C, bias = _cpu_args()
    with pytest.raises(evtc.CallError, match=message):
        kernel(a, b, **change(a, b, C, bias))


def test_call_errors_on_a_and_b(kernel):
    a, b, C, bias = _cpu_args()
    with pytest.raises(evtc.CallError, match="K differs"):
        kernel(a, b[:64], C=C, bias=bias, alpha=1.0)
    with pytest.raises(evtc.CallError, match="a must be torch.float16"):
        kernel(a.bfloat16(), b, C=C, bias=bias, alpha=1.0)
    with pytest.raises(evtc.CallError, match="must be 2-d"):
        kernel(a[None], b[None], C=C, bias=bias, alpha=1.0)


def test_out_must_match(kernel):
    a, b, C, bias = _cpu_args()
    with pytest.raises(evtc.CallError, match="out must be torch.float16"):
        kernel(a, b, C=C, bias=bias, alpha=1.0, out=torch.empty(256, 512))
    with pytest.raises(evtc.CallError, match="structure"):
        kernel(a, b, C=C, bias=bias, alpha=1.0, out=(torch.empty(256, 512).half(),))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_valid_arguments_without_a_gpu_compute_on_the_torch_path_or_say_so(kernel, tmp_path):
    a, b, C, bias = _cpu_args()
    got = kernel(a, b, C=C, bias=bias, alpha=1.0)
    want = bias_relu(a.float() @ b.float(), C.float(), bias, 1.0).half()
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=2e-2)
    strict = evtc.compile(bias_relu, example(), cache_dir=tmp_path, strict=True)
    with pytest.raises(evtc.CallError, match="no CUDA GPU. strict=True refuses the torch path"):
        strict(a, b, C=C, bias=bias, alpha=1.0)


def test_logging_reports_compile_steps_and_cache(tmp_path, caplog):
    def gelu_bias(acc, bias):
        return torch.nn.functional.gelu(acc + bias)

    ex = dict(a=torch.empty(64, 32, dtype=torch.float16, device="meta"),
              b=torch.empty(32, 64, dtype=torch.float16, device="meta"),
              bias=torch.empty(64, dtype=torch.float16, device="meta"))
    with caplog.at_level("INFO", logger="evtc"):
        evtc.compile(gelu_bias, ex, cache_dir=tmp_path)
    text = caplog.text
    assert "'gelu_bias': GEMM f16->f16 AkBnDn 128x128 c1x2" in text and "cluster chosen per call" in text
    assert "disk cache miss" in text and "building 'gelu_bias'" in text and "built 'gelu_bias' (" in text
    caplog.clear()
    clear_memory_cache()
    with caplog.at_level("INFO", logger="evtc"):
        evtc.compile(gelu_bias, ex, cache_dir=tmp_path)
    assert "disk cache hit: 'gelu_bias'" in caplog.text and "building" not in caplog.text


def test_epilogues_with_many_outputs_get_smaller_tiles_or_a_clear_error(tmp_path, caplog):
    ex = dict(a=torch.empty(64, 32, dtype=torch.float16, device="meta"),
              b=torch.empty(32, 128, dtype=torch.float16, device="meta"))

    def outputs(count):
        def many(acc):
            return tuple((acc * (i + 1)).float() for i in range(count))
        return many

    with caplog.at_level("INFO", logger="evtc"):
        four = evtc.compile(outputs(4), ex, cache_dir=tmp_path)
    assert four.config.epi_tile_n == 16 and four.config.schedule == "pingpong"
    assert "do not fit with the default tiles" in caplog.text
    six = evtc.compile(outputs(6), ex, cache_dir=tmp_path)
    assert six.config.schedule == "cooperative" and six.config.epi_tile_n == 16
    nine = evtc.compile(outputs(9), ex, cache_dir=tmp_path)  # the last resort: one buffer each
    assert (nine.config.schedule, nine.config.c_stages, nine.config.epi_stages) == ("cooperative", 1, 1)
    with pytest.raises(evtc.CompileError, match="also tried: 128x16 subtiles, the cooperative") as err:
        evtc.compile(outputs(30), ex, cache_dir=tmp_path)
    assert "test_compile_runtime.py" in str(err.value) and "30 full-tile output(s)" in str(err.value)
    # A choice the user made is kept: the error says what to shrink.
    with pytest.raises(evtc.CompileError, match="use a smaller tile_n, epi_tile_n or epi_stages"):
        evtc.compile(outputs(4), ex, config={"epi_tile_n": 32, "schedule": "pingpong"}, cache_dir=tmp_path)


_SCALE = 2.0


def _scaled_by_global(acc):
    return acc * _SCALE


def test_a_front_record_kernel_refuses_a_function_changed_since(tmp_path, caplog, monkeypatch):
    """A kernel loaded through its front record traces its graph only when first needed (the
    torch path, the backward). If a global the epilogue reads changed after evtc.compile, that
    graph is another function than the kernel's: an error, never the new function on one path and
    the old one on another."""
    ex = dict(a=torch.randn(16, 32).half(), b=torch.randn(32, 24).half())
    evtc.compile(_scaled_by_global, ex, cache_dir=tmp_path)
    clear_memory_cache()
    with caplog.at_level("INFO", logger="evtc"):
        k = evtc.compile(_scaled_by_global, ex, cache_dir=tmp_path)
    assert "by its front record" in caplog.text
    monkeypatch.setitem(_scaled_by_global.__globals__, "_SCALE", 3.0)
    with pytest.raises(evtc.CompileError, match="no longer traces to the graph its kernel was compiled"):
        k(ex["a"], ex["b"])  # CPU tensors: the torch path, which evaluates the graph
    # Unchanged, the same record's kernel runs the function it was compiled from.
    monkeypatch.setitem(_scaled_by_global.__globals__, "_SCALE", 2.0)
    clear_memory_cache()
    k = evtc.compile(_scaled_by_global, ex, cache_dir=tmp_path)
    ex["b"] = torch.randn(32, 24).half()  # the example dict reused: the kernel kept its own
    torch.testing.assert_close(k(ex["a"], ex["b"]).float(), 2.0 * (ex["a"].float() @ ex["b"].float()),
                               rtol=2e-3, atol=2e-3)


def test_front_keys_only_for_what_the_digest_sees_through():
    """The front key maps a compile call to a kernel without tracing, so it must change whenever
    the traced function could: values it cannot digest give no key (the full path, every time)."""
    import types

    import torch.nn.functional as F

    from evtc.runtime.front_key import front_key

    ex = dict(a=torch.empty(8, 16, dtype=torch.float16, device="meta"),
              b=torch.empty(16, 8, dtype=torch.float16, device="meta"))

    def key(fn):
        return front_key(fn, ex, None, None, "sm_90a", False)

    user_module = types.ModuleType("user_cfg")
    user_module.SCALE = 2.0
    leaky = torch.nn.LeakyReLU(0.2)
    gelu = torch.nn.GELU()
    cases = {
        "a user module's attribute": lambda acc: acc * user_module.SCALE,
        "a bound method of a torch module": lambda acc: leaky.forward(acc),
        "a torch module instance": lambda acc: gelu(acc),
    }
    for what, fn in cases.items():
        assert key(fn) is None, what
    assert key(lambda acc: F.gelu(torch.relu(acc))) is not None  # library functions: by name

    def with_attribute(acc):
        return acc * with_attribute.scale

    with_attribute.scale = 2.0
    first = key(with_attribute)
    with_attribute.scale = 3.0
    assert first is not None and key(with_attribute) != first


def test_front_key_of_a_set_constant_is_the_same_in_every_process():
    """``x in {...}`` compiles to a frozenset constant, whose repr's order follows the process's
    hash seed: the key must not, or no other process ever finds the front record."""
    code = (
        "import torch\n"
        "from evtc.runtime.front_key import front_key\n"
        "def fn(acc, mode: str = 'x'):\n"
        "    return acc * 2.0 if mode in {'alpha', 'beta', 'gamma', 'delta'} else acc\n"
        "ex = dict(a=torch.empty(8, 16, dtype=torch.float16, device='meta'),\n"
        "          b=torch.empty(16, 8, dtype=torch.float16, device='meta'))\n"
        "print(front_key(fn, ex, None, None, 'sm_90a', False))\n"
    )
    keys = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**__import__("os").environ, "PYTHONHASHSEED": str(seed)}).stdout.strip()
            for seed in (1, 2, 3)}
    assert len(keys) == 1 and "None" not in keys, keys


def test_an_entry_whose_manifest_lists_no_kernel_file_is_not_loaded(tmp_path):
    """Only files the manifest checksums are loaded: a manifest without the library and the
    object file (edited, or from a damaged write) is an entry that does not load (rebuilt)."""
    from evtc.runtime.build import load
    from evtc.runtime.cache import DiskCache

    def relu_plus(acc):
        return torch.relu(acc) + 1.0

    ex = dict(a=torch.empty(64, 32, dtype=torch.float16, device="meta"),
              b=torch.empty(32, 64, dtype=torch.float16, device="meta"))
    k = evtc.compile(relu_plus, ex, cache_dir=tmp_path, arch="sm_90a")
    cache = DiskCache(tmp_path)
    manifest_path = cache.entry(k.key) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"] = {n: d for n, d in manifest["files"].items() if n not in ("kernel.so", "kernel.o")}
    assert manifest["files"]
    manifest_path.write_text(json.dumps(manifest))
    entry = cache.load(k.key)
    assert entry is not None  # what it lists verifies
    with pytest.raises(RuntimeError, match="lists neither"):
        load(entry)


def test_the_torch_path_ignores_the_callers_autocast(tmp_path):
    """A kernel computes in its compiled dtypes whatever autocast says; so does the torch path (it
    ran the float32 product and the epilogue in bfloat16 inside an autocast region)."""
    def gelu_bias(acc, bias):
        return torch.nn.functional.gelu(acc + bias)

    for dtype in (torch.float16, torch.float32):
        a, b = torch.randn(33, 64, dtype=dtype), torch.randn(64, 40, dtype=dtype)
        bias = torch.randn(40, dtype=dtype)
        kernel = evtc.compile(gelu_bias, dict(a=a, b=b, bias=bias), cache_dir=tmp_path)
        outside = kernel(a, b, bias=bias)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            inside = kernel(a, b, bias=bias)
        assert kernel.last_path == "torch" and inside.dtype == outside.dtype == dtype
        assert torch.equal(inside, outside)


def test_front_key_sees_what_the_epilogue_reads_through_library_modules():
    """The front key digests torch's modules by name; what an epilogue reads through them is
    digested by value: a flag it branches on (``torch.backends.cuda.matmul.allow_tf32``), a library
    function the user replaced (``F.gelu = ...``). A call of a library function that reads process
    state (``torch.are_deterministic_algorithms_enabled()``) and an lru_cache holding results of
    another time give no front key (the full path, every time): with any of these, a front record
    served the kernel traced under the state of its time."""
    import functools

    import torch.nn.functional as F

    from evtc.runtime.front_key import front_key

    ex = dict(a=torch.empty(8, 16, dtype=torch.float16, device="meta"),
              b=torch.empty(16, 8, dtype=torch.float16, device="meta"))

    def key(fn):
        return front_key(fn, ex, None, None, "sm_90a", False)

    def by_flag(acc):
        return acc * 2.0 if torch.backends.cuda.matmul.allow_tf32 else acc * 3.0

    before = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        off = key(by_flag)
        torch.backends.cuda.matmul.allow_tf32 = True
        on = key(by_flag)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    assert off is not None and on is not None and off != on

    def gelu(acc):
        return F.gelu(acc)

    plain, original = key(gelu), F.gelu
    try:
        F.gelu = lambda x, approximate="none": original(x) * 2
        replaced = key(gelu)
    finally:
        F.gelu = original
    assert plain is not None and replaced is not None and replaced != plain and key(gelu) == plain

    def deterministic(acc):
        return acc * (2.0 if torch.are_deterministic_algorithms_enabled() else 3.0)

    assert key(deterministic) is None

    @functools.lru_cache
    def scale():
        return 2.0

    def cached(acc):
        return acc * scale()

    assert key(cached) is not None  # nothing held yet: the digest sees what it will compute
    scale()
    assert key(cached) is None


def test_an_entry_that_neither_verifies_nor_can_be_replaced_is_never_loaded(tmp_path, monkeypatch):
    """A damaged entry whose folder cannot be replaced (another user's, in a shared cache): the
    commit of the fresh build failed, was taken for another process's commit of the same key, and
    the damaged library was loaded. Now the commit raises (the kernel is then built in a private
    folder, as for a read-only cache), and it still defers to another process's valid entry."""
    import os

    from evtc.runtime import cache as cache_module

    def relu_plus(acc):
        return torch.relu(acc) + 1.0

    ex = dict(a=torch.empty(64, 32, dtype=torch.float16, device="meta"),
              b=torch.empty(32, 64, dtype=torch.float16, device="meta"))
    k = evtc.compile(relu_plus, ex, cache_dir=tmp_path, arch="sm_90a")
    cache = cache_module.DiskCache(tmp_path)
    library = cache.entry(k.key) / "kernel.so"
    good = library.read_bytes()
    real_replace = os.replace

    def no_replacing_entries(src, dst):
        if Path(dst) == cache.entry(k.key):
            raise PermissionError(13, "Permission denied", str(dst))
        return real_replace(src, dst)

    monkeypatch.setattr(cache_module.os, "replace", no_replacing_entries)
    monkeypatch.setattr(cache_module.shutil, "rmtree", lambda *a, **kw: None)  # the folder stays
    for damaged in (False, True):
        # A new file, not the loaded library rewritten in place (its pages are mapped by this
        # process: changing them under the loader crashes it).
        library.unlink()
        library.write_bytes(good + (b"\0damaged" if damaged else b""))
        staged = cache.staging()
        (staged / "kernel.so").write_bytes(good)
        if damaged:
            with pytest.raises(PermissionError):
                cache.commit(k.key, staged, ["kernel.so"], {})
        else:
            assert cache.commit(k.key, staged, ["kernel.so"], {}) == cache.entry(k.key)
    # Through evtc.compile: the damaged entry is rebuilt elsewhere, and what is loaded verifies.
    clear_memory_cache()
    again = evtc.compile(relu_plus, ex, cache_dir=tmp_path, arch="sm_90a")
    assert Path(again.cache_path) != cache.entry(k.key)
    assert cache_module.DiskCache(Path(again.cache_path).parents[1]).load(again.key) is not None
