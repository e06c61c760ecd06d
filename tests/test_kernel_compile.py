"""CPU tests of the SM90 GEMM engine: it compiles for every combination we claim, the PTX has the
instructions the design relies on, ptxas reports no spills, and the host glue (config validation,
scheduler order, tensor conversion, argument packing) behaves.  No GPU needed (CUTE_DSL_ARCH=sm_90a,
set in conftest)."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from gemm_kernels import compile_config, uses_d_buffers_of_c

import evtc
from evtc.plan.clusters import reference_order
from evtc.plan.config import ConfigError, GemmConfig

# (config, epilogue) pairs (None: the identity; (dtype, major) of C: alpha * acc + beta * C):
# every dtype, major, cluster and epilogue tile appears at least once, and
# the linear combination runs with 16- and 32-bit C in both majors.
# G: the cooperative schedule (GemmConfig's default is ping-pong; its entries below say so).
G = functools.partial(GemmConfig, schedule="cooperative")
MATRIX = [
    (GemmConfig(), None),  # the default: ping-pong, 128x128, cluster 1x2
    (GemmConfig(), ("float16", "n")),
    (GemmConfig(d_dtype="float8_e4m3fn"), None),   # a float8 D: satfinite cvt, no stmatrix
    (G(ab_dtype="bfloat16", d_dtype="float8_e5m2", epi_tile_n=64), None),
    (G(), None),
    (G(ab_dtype="bfloat16", d_dtype="bfloat16", b_major="k"), None),
    (G(d_dtype="float32", a_major="m"), None),
    (G(ab_dtype="bfloat16", d_dtype="float32", b_major="k", d_major="m", tile_n=128, epi_tile_n=64),
     None),
    (G(d_dtype="bfloat16", a_major="m", b_major="k", d_major="m", epi_tile_n=16), None),
    (G(d_major="m", tile_n=128, epi_tile_n=16), None),
    (G(ab_dtype="bfloat16", d_dtype="float32", tile_n=256, epi_tile_n=64), None),
    (G(tile_n=64, epi_tile_n=64), None),
    (G(cluster=(2, 1)), None),
    (G(ab_dtype="bfloat16", d_dtype="bfloat16", cluster=(1, 2)), None),
    (G(cluster=(2, 1), a_major="m", b_major="k", tile_n=128, epi_tile_n=64), None),
    (G(cluster=(1, 2), d_dtype="float32", d_major="m", tile_n=128), None),
    (G(), ("float16", "n")),
    (G(ab_dtype="bfloat16", d_dtype="bfloat16", d_major="m", tile_n=128, epi_tile_n=16),
     ("bfloat16", "m")),
    (G(d_dtype="float32", tile_n=128, epi_tile_n=64), ("float32", "n")),
    (G(cluster=(2, 1)), ("float16", "m")),
    (G(ab_dtype="bfloat16", d_dtype="bfloat16", d_major="m", cluster=(1, 2), tile_n=128, epi_tile_n=64),
     ("float16", "n")),
    # D staged in C's whole-tile load buffers (C has D's dtype and major).
    (G(load_stages=8), ("float16", "n")),
    (G(ab_dtype="bfloat16", d_dtype="bfloat16", d_major="m", epi_tile_n=64, load_stages=4, cluster=(2, 1)),
     ("bfloat16", "m")),
    # Pingpong schedule: one 128 x tile_n tile per consumer warpgroup (two m64 atoms along M).
    (G(schedule="pingpong", cluster=(1, 1)), None),
    (G(schedule="pingpong", ab_dtype="bfloat16", d_dtype="bfloat16", a_major="m", b_major="k"), None),
    (G(schedule="pingpong", d_dtype="float32", d_major="m", epi_tile_n=64, cluster=(1, 1)), None),
    (G(schedule="pingpong", ab_dtype="bfloat16", d_dtype="float32", epi_tile_n=16), None),
    (G(schedule="pingpong", tile_n=64, epi_tile_n=64, b_major="k"), None),
    (G(schedule="pingpong", cluster=(2, 1)), None),
    (G(schedule="pingpong", ab_dtype="bfloat16", d_dtype="bfloat16", cluster=(1, 2), tile_n=64),
     None),
    (G(schedule="pingpong", cluster=(1, 1)), ("float16", "n")),
    (G(schedule="pingpong", ab_dtype="bfloat16", d_dtype="bfloat16", d_major="m",
       epi_tile_n=16), ("bfloat16", "m")),
    (G(schedule="pingpong", d_dtype="float32", cluster=(1, 1)), ("float32", "n")),
    (G(schedule="pingpong", cluster=(2, 1), a_major="m"), ("float16", "m")),
    (G(schedule="pingpong", tile_n=64, epi_tile_n=16, d_major="m", load_stages=1),
     ("float32", "m")),
]


def _id(case) -> str:
    cfg, c = case
    return f"{cfg.short_name()} " + ("identity" if c is None else f"lincomb C{c[0]}{c[1]}")


@pytest.fixture(scope="module", params=MATRIX, ids=[_id(c) for c in MATRIX])
def compiled(request):
    cfg, c = request.param
    kernel = compile_config(cfg, c)
    return SimpleNamespace(ptx=kernel.ptx, config=kernel.config, stages=kernel.stages, smem=kernel.smem, c=c)


def _ptxas_report(ptx: str, tmp_path) -> str | None:
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        return None
    src = tmp_path / "kernel.ptx"
    src.write_text(ptx)
    out = subprocess.run(
        [ptxas, "-arch=sm_90a", "-v", str(src), "-o", str(tmp_path / "kernel.cubin")],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout + out.stderr


def test_ptx_has_the_sm90_instructions(compiled):
    ptx = compiled.ptx
    cfg = compiled.config
    assert "wgmma.mma_async" in ptx
    assert "setmaxnreg.inc" in ptx and "setmaxnreg.dec" in ptx
    # TMA loads (global -> shared, completing on an mbarrier) and TMA stores (shared -> global).
    assert re.search(r"cp\.async\.bulk\.tensor\.\dd\.shared::\w+\.global", ptx)
    assert re.search(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta", ptx)
    assert "cp.async.bulk.commit_group" in ptx
    assert "fence.proxy.async.shared::cta" in ptx
    if cfg.d_dtype in ("float16", "bfloat16"):
        assert "stmatrix" in ptx
    if cfg.d_dtype.startswith("float8"):
        # Saturating conversion of pairs (as the IR's casts), then a plain copy to shared memory.
        fmt = "e4m3" if cfg.d_dtype == "float8_e4m3fn" else "e5m2"
        assert f"cvt.rn.satfinite.{fmt}x2.f32" in ptx and "stmatrix" not in ptx
    if cfg.cluster != (1, 1):
        assert ".multicast::cluster" in ptx
    else:
        assert ".multicast::cluster" not in ptx
    # B's loads carry an L2 policy chosen in the kernel: EVICT_FIRST (one row of cluster tiles, each
    # weight tile read once) or the normal one, as createpolicy.fractional encodes them.
    assert re.search(r"cp\.async\.bulk\.tensor\.\dd\.shared::\w+\.global\S*\.L2::cache_hint", ptx)
    assert re.search(rf"selp\.b64\s+%rd\d+, {0x12F0000000000000}, {0x1000000000000000}, %p\d+;", ptx)
    if compiled.c is not None and compiled.c[0] != "float32":
        assert "ldmatrix" in ptx
    if cfg.schedule == "pingpong":
        # Mainloop turn-taking between the two consumer warpgroups.
        assert re.search(r"bar\.arrive\s+%r\d+, 256;", ptx)
        assert re.search(r"bar\.sync\s+%r\d+, 256;", ptx)
        assert re.search(r"bar\.sync\s+%r\d+, 128;", ptx)


def test_no_spills_and_no_serialized_wgmma(compiled, tmp_path):
    ptx = compiled.ptx
    assert ".local" not in ptx
    report = _ptxas_report(ptx, tmp_path)
    if report is None:
        pytest.skip("ptxas not on PATH: checked the PTX only")
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills, report
    assert all(s == ("0", "0") for s in spills), report
    frames = re.findall(r"(\d+) bytes stack frame", report)
    assert all(f == "0" for f in frames), report
    # ptxas serializes wgmma (C7517: an injected wait, C7519: an injected arrive) where registers
    # the wgmma owns are touched between its fence and its wait; the mainloop fences every K tile
    # and never zero-fills the accumulator, so it needs none.
    assert "C7517" not in report and "C7519" not in report, report


def _swiglu(acc):
    gate, up = acc.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _identity(acc):
    return acc


# The mainloops the matrix above does not build: split-K, 64-row tiles, gated B, float8 A/B
# (promoted and fast), each through evtc.compile as a user gets it.
_BF16 = {"a": torch.empty(256, 512, dtype=torch.bfloat16, device="meta"),
         "b": torch.empty(384, 512, dtype=torch.bfloat16, device="meta").t()}
_E4M3 = {"a": torch.empty(256, 512, dtype=torch.float8_e4m3fn, device="meta"),
         "b": torch.empty(384, 512, dtype=torch.float8_e4m3fn, device="meta").t()}
OTHER_MAINLOOPS = [
    ("split-K ping-pong", _identity, _BF16, {"split_k": True}),
    ("split-K cooperative 128x192", _identity, _BF16, {"split_k": True, "schedule": "cooperative",
                                                        "tile_n": 192}),
    ("64x128", _identity, _BF16, {"tile_m": 64, "tile_n": 128}),
    ("gated", _swiglu, _BF16, None),
    ("e4m3 promoted", _identity, _E4M3, None),
    ("e4m3 fast", _identity, _E4M3, {"fast_accum": True}),
]


@pytest.mark.parametrize("what, fn, example, config", OTHER_MAINLOOPS, ids=[c[0] for c in OTHER_MAINLOOPS])
def test_other_mainloops_have_no_serialized_wgmma(what, fn, example, config, tmp_path):
    kernel = evtc.compile(fn, example, config=config, arch="sm_90a", cache_dir=tmp_path / "cache")
    report = _ptxas_report(kernel.ptx, tmp_path)
    if report is None:
        pytest.skip("ptxas not on PATH")
    assert "C7517" not in report and "C7519" not in report, report


def test_stage_plan_fits(compiled):
    cfg = compiled.config
    stages, smem = compiled.stages, compiled.smem
    assert stages["ab"] >= 2 and stages["d"] >= 1
    d_bytes = 0 if stages["d_in_load"] else cfg.d_bytes_per_stage()
    used = stages["ab"] * cfg.ab_bytes_per_stage() + stages["d"] * d_bytes + smem["visitor"]
    assert used <= 232448 - 2048


def test_compile_is_cached():
    a = compile_config(G(), None)
    b = compile_config(G(), None)
    assert a is b
    # Epilogues with the same code share a kernel; a different C dtype does not.
    c1 = compile_config(G(), ("float16", "n"))
    c2 = compile_config(G(), ("float16", "n"))
    assert c1 is c2
    assert c1 is not a
    assert compile_config(G(), ("bfloat16", "n")) is not c1


# ---- host glue ----------------------------------------------------------------------------------


def test_majors_come_from_the_examples_and_d_major_from_the_config():
    m = torch.empty((64, 32), dtype=torch.float16, device="meta")
    w = torch.empty((48, 32), dtype=torch.float16, device="meta")  # nn.Linear weight: B = w.T, K-major
    k = evtc.compile(lambda acc: acc, {"a": m, "b": w.t()}, config={"d_major": "m", "cluster": (1, 1)})
    cfg = k.config
    assert (cfg.a_major, cfg.b_major, cfg.d_major) == ("k", "k", "m")
    k = evtc.compile(lambda acc: acc, {"a": m.t().contiguous().t(), "b": w.t().contiguous()})
    assert (k.config.a_major, k.config.b_major, k.config.d_major) == ("m", "n", "n")


def test_column_major_output_needs_a_single_tile_output():
    ex = {"a": torch.empty((64, 32), dtype=torch.float16, device="meta"),
          "b": torch.empty((32, 48), dtype=torch.float16, device="meta")}
    with pytest.raises(evtc.CompileError, match="d_major='m'"):
        evtc.compile(lambda acc: (acc, acc.relu()), ex, config={"d_major": "m"})
    with pytest.raises(evtc.CompileError, match="d_major='m'"):
        evtc.compile(lambda acc: (acc, acc.sum(dim=-1)), ex, config={"d_major": "m"})


@pytest.mark.parametrize("bad", [
    dict(ab_dtype="int8"),
    dict(ab_dtype="float32", b_major="k", schedule="cooperative", tile_n=112, epi_tile_n=16),
    dict(d_dtype="int8"), dict(a_major="n"), dict(b_major="m"),
    dict(d_major="k"), dict(tile_n=96), dict(cluster=(2, 2)), dict(epi_tile_n=8),
    dict(tile_n=64, epi_tile_n=64, ab_stages=1), dict(raster="z"), dict(schedule="pingpang"),
])
def test_config_validation(bad):
    with pytest.raises(ConfigError):
        GemmConfig(**bad).validate()


def test_stage_budget():
    cfg = G()
    ab, d = cfg.plan_stages(0)
    # Default: D staged for the whole 128x256 tile (8 subtiles of 128x32) and 3 A/B stages in the
    # rest of the 227 KiB; an explicit epi_stages=2 leaves room for 4 A/B stages.
    assert (ab, d) == (3, cfg.num_subtiles) == (3, 8)
    stage_bytes = cfg.ab_bytes_per_stage() * ab + cfg.d_bytes_per_stage() * d
    assert stage_bytes <= 232448 - 2048
    assert G(epi_stages=2).plan_stages(0) == (4, 2)
    # A visitor that wants most of shared memory leaves too few A/B stages: a clear error.
    with pytest.raises(ConfigError, match="stage"):
        cfg.plan_stages(200 * 1024)
    with pytest.raises(ConfigError, match="ab_stages=8"):
        G(ab_stages=8).plan_stages(0)


def test_d_shares_c_buffers_only_when_it_can():
    """D is staged in C's buffers exactly when C matches D's dtype and major, the C loads cover
    the whole tile, and the schedule is cooperative; then D takes no shared memory of its own."""
    lc = ("float16", "n")
    whole = G(load_stages=8)
    assert uses_d_buffers_of_c(compile_config(whole, lc))
    for cfg, vis in [
        (G(load_stages=4), lc),                            # 4 of 8 subtiles staged
        (whole, ("bfloat16", "n")),      # other dtype
        (whole, ("float16", "m")),       # other major
        (G(d_dtype="float32", load_stages=8), lc),        # other dtype
        (G(schedule="pingpong", load_stages=4), lc),      # pingpong
    ]:
        assert not uses_d_buffers_of_c(compile_config(cfg, vis)), cfg
    assert not whole.shares_d_with_load(False)
    ab, d = whole.plan_stages(8 * 128 * 32 * 2, d_in_load_buffers=True)
    # 64 KiB of C (and D) leaves 3 stages of 128x256x64; the store ring count is the default 2.
    assert (ab, d) == (3, 2)
    # D's own two 8 KiB buffers are what costs the third A/B stage next to 70400 B of visitor buffers.
    assert whole.plan_stages(70400, d_in_load_buffers=True)[0] == 3
    assert whole.plan_stages(70400)[0] == 2


def test_pingpong_shapes_and_stage_budget():
    cfg = G(schedule="pingpong")
    assert cfg.tile_n == 128 and G().tile_n == 256 and G() == G(tile_n=256)
    assert cfg.tile_shape_mnk == (128, 128, 64) and cfg.epi_tile == (128, 32) and cfg.epi_groups == 2
    assert G().tile_m == 128 and G().epi_groups == 1
    # Each warpgroup stages its whole 128x128 tile of D (4 buffers of 128x32, 2 x 32 KiB in all),
    # leaving 5 A/B stages of 128x128x64 (the cooperative default 128x256 gets 4).
    ab, d = cfg.plan_stages(0)
    assert (ab, d) == (5, 4)
    assert cfg.d_bytes_per_stage() == 2 * 128 * 32 * 2
    assert ab * cfg.ab_bytes_per_stage() + d * cfg.d_bytes_per_stage() <= 232448 - 2048
    # Epilogue loads: one ring per warpgroup, the two sharing the 32 KiB a cooperative ring gets.
    assert cfg.c_stages == 2 and G().c_stages == 4
    assert "pingpong" in cfg.short_name() and "pingpong" not in G().short_name()
    assert G(schedule="pingpong", tile_n=64).validate().tile_shape_mnk == (128, 64, 64)


def test_default_config_is_pingpong_128x128_in_clusters_of_1x2():
    cfg = GemmConfig()
    assert cfg.schedule == "pingpong" and cfg.tile_shape_mnk == (128, 128, 64) and cfg.cluster == (1, 2)
    # Each schedule brings its own defaults; explicit values win.
    assert G().cluster == (1, 1) and G().tile_n == 256
    assert GemmConfig(cluster=(2, 1)).cluster == (2, 1)
    assert GemmConfig(cluster=[1, 1]).cluster == (1, 1)
    assert GemmConfig() == GemmConfig(schedule="pingpong", tile_n=128, cluster=(1, 2))


def test_overlap_ab_stages_keeps_the_bytes_in_flight():
    """Epilogue buffers may take A/B stages down to about 144 KiB in flight, whatever the tile."""
    assert G().overlap_ab_stages() == 3                      # 3 x 48 KiB
    assert GemmConfig().overlap_ab_stages() == 5             # 5 x 32 KiB (4 would be 128 KiB)
    assert GemmConfig(tile_n=64).overlap_ab_stages() == 6    # 6 x 24 KiB
    for cfg in (G(), GemmConfig(), GemmConfig(tile_n=64), G(tile_n=128)):
        n = cfg.overlap_ab_stages()
        assert n * cfg.ab_bytes_per_stage() >= 144 * 1024 > (n - 1) * cfg.ab_bytes_per_stage()
    # D staging grows only while that many A/B stages remain: ping-pong identity gets 4 D buffers
    # per warpgroup and 5 A/B stages; next to two 128x32 C buffers per warpgroup, 2 D buffers (a
    # third would cost the fifth A/B stage).
    assert GemmConfig().plan_stages(0) == (5, 4)
    assert GemmConfig().plan_stages(2 * 2 * 128 * 32 * 2) == (5, 2)


def test_cluster_for_problem_counts_the_idle_ctas_of_overhanging_clusters():
    from evtc.plan.clusters import cluster_for_problem, waves

    assert waves(128, 1, 1, (1, 2), 132) == 2 and waves(128, 1, 1, (2, 1), 132) == 1
    assert waves(3, 3, 2, (1, 2), 132) == 1 and waves(133, 1, 1, (1, 1), 132) == 2

    def pick(m, n, batches=1, schedule="pingpong", tile_n=128, preferred=(1, 2)):
        return cluster_for_problem(-(-m // 128), -(-n // tile_n), batches, preferred, lambda c: 132,
                                   schedule)

    assert pick(8192, 8192) == (1, 2)
    assert pick(16384, 128) == (2, 1)         # one column of tiles
    assert pick(16384, 384) == (2, 1)         # three columns: 1x2 pads to four
    assert pick(512, 512) == (1, 2)           # one wave whatever the shape: keep the configured one
    # Overhanging clusters cost their padding too (measured: three rows of tiles in 2x1 clusters,
    # one wave, ran 0.72x as fast as in 1x1 ones): three rows and three columns go 1x1, three rows
    # in a configured 2x1 go 1x2.
    assert pick(257, 384) == (1, 1)
    assert pick(384, 4096, preferred=(2, 1)) == (1, 2)
    assert pick(128, 128, batches=200) == (1, 1)
    # Cooperative 128x256 tiles: the shapes cost alike, so only fewer waves move it off its 1x1.
    assert pick(16384, 128, schedule="cooperative", tile_n=256, preferred=(1, 1)) == (1, 1)
    assert pick(8192, 8192, schedule="cooperative", tile_n=256, preferred=(1, 1)) == (1, 1)


def test_float8_d_must_be_row_major():
    assert GemmConfig(d_dtype="float8_e4m3fn").validate().d_dtype == "float8_e4m3fn"
    with pytest.raises(ConfigError, match="must be row-major"):
        GemmConfig(d_dtype="float8_e5m2", d_major="m").validate()


def test_pingpong_rejects_tile_n_256_at_128_rows():
    # 128 x 256 fp32 accumulators are 256 registers per thread of one warpgroup; 64 x 256 are 128.
    with pytest.raises(ConfigError, match="tile_n=256 needs 256 accumulator registers"):
        G(schedule="pingpong", tile_n=256).validate()
    assert G(schedule="pingpong", tile_m=64, tile_n=256).validate().tile_shape_mnk == (64, 256, 64)


@pytest.mark.parametrize("tiles_m,tiles_n,batches,cluster,raster_m,swizzle", [
    (7, 5, 1, (1, 1), True, 2),
    (8, 8, 2, (1, 1), False, 3),
    (5, 9, 3, (2, 1), True, 8),
    (9, 4, 1, (1, 2), False, 1),
    (1, 33, 1, (1, 1), True, 8),
])
def test_scheduler_visits_every_cluster_tile_once(tiles_m, tiles_n, batches, cluster, raster_m, swizzle):
    order = reference_order(tiles_m, tiles_n, batches, cluster, raster_m, swizzle)
    cms = -(-tiles_m // cluster[0])
    cns = -(-tiles_n // cluster[1])
    expected = {(i, j, b) for b in range(batches) for i in range(cms) for j in range(cns)}
    assert len(order) == len(expected) and set(order) == expected
    if swizzle > 1 and raster_m and cns >= swizzle:
        # Consecutive work goes across a band of `swizzle` columns before moving down.
        assert [o[1] for o in order[:swizzle]] == list(range(swizzle))


def test_max_and_min_reductions_propagate_nan(tmp_path):
    """torch.amax/amin give NaN where a NaN is among the values: the reductions' combines are the
    NaN-propagating max/min (FMNMX.NaN), not the plain form that returns the other operand."""
    def extrema(acc):
        return acc.amax(-1), acc.amin(-2), acc.abs().amax()

    ex = dict(a=torch.randn(128, 64, dtype=torch.float16), b=torch.randn(64, 128, dtype=torch.float16))
    ptx = evtc.compile(extrema, ex, cache_dir=tmp_path).ptx
    assert re.search(r"\bmax\.NaN\.f32\b", ptx) and re.search(r"\bmin\.NaN\.f32\b", ptx)
    assert not re.search(r"\b(max|min)\.f32\b", ptx)


def test_sigmoid_takes_the_exp_that_carries_the_rounding_of_its_argument(tmp_path):
    """sigmoid (and silu, SwiGLU) compute e^-x with libdevice's exp, whose argument reduction splits
    log2(e) over two constants by fused multiply-adds; the fast exp rounds -x * log2(e) to float32
    before its 2^t, tens of ulps off for x below -10 (a review emulated 57 ulps at x = -59.6)."""
    ex = dict(a=torch.randn(128, 64, dtype=torch.bfloat16), b=torch.randn(64, 128, dtype=torch.bfloat16))
    ptx = evtc.compile(lambda acc: torch.sigmoid(acc), ex, cache_dir=tmp_path).ptx
    exps = len(re.findall(r"\bex2\.approx", ptx))
    assert exps and len(re.findall(r"\bfma\.rn\.f32\b", ptx)) >= 2 * exps, "no argument reduction"
    assert "0f3FB8AA3B" not in ptx, "log2(e) as one float32 constant: the fast exp"


@pytest.mark.parametrize("negative_first", [False, True], ids=["positive_first", "negative_first"])
def test_zero_constants_of_both_signs_stay_two_constants(tmp_path, negative_first):
    """The DSL makes Python numbers into constants through a cache keyed by the number, where
    -0.0 == 0.0: the first zero answered for both (`acc * -0.0` multiplied by +0.0 after a `C * 0.0`,
    and 1 / it was the wrong infinity on the H100; a -0.0 first would make relu's 0.0 a -0.0).
    evtc.sm90.zero_sign gives each -0.0 a constant of its own."""
    def positive_first(acc, C):
        return 1.0 / (C * 0.0), 1.0 / (acc * -0.0)

    def negative_zero_first(acc, C):  # hardtanh's -0.0 in the same block as relu's 0.0, before it
        return 1.0 / F.hardtanh(acc, -0.0, 1.0), 1.0 / torch.relu(C)

    ex = dict(a=torch.randn(64, 32, dtype=torch.bfloat16), b=torch.randn(32, 48, dtype=torch.bfloat16),
              C=torch.randn(64, 48))
    fn = negative_zero_first if negative_first else positive_first
    ptx = evtc.compile(fn, ex, out_dtypes=torch.float32, cache_dir=tmp_path).ptx
    if negative_first:  # max with each zero (which the compiler may make a compare and a select)
        assert re.search(r"\b(max|selp)\S*\s+[^;]*0f80000000", ptx), "hardtanh's -0.0 lost its sign"
        assert re.search(r"\b(max|selp)\S*\s+[^;]*0f00000000", ptx), "relu's 0.0 became -0.0"
    else:
        assert re.search(r"\bmul\.f32\s+%r\d+, %r\d+, 0f80000000;", ptx), "acc * -0.0 lost its sign"
        assert re.search(r"\bmul\.f32\s+%r\d+, %r\d+, 0f00000000;", ptx)


def test_roundings_compile_to_one_conversion_each(tmp_path):
    """floor, ceil, trunc and round are one cvt each, in the rounding mode of its name; torch.round's
    ties go to the even integer (rni), not away from zero as C's round does."""
    def roundings(acc):
        return torch.floor(acc), torch.ceil(acc), torch.trunc(acc), torch.round(acc)

    ex = dict(a=torch.randn(64, 32, dtype=torch.bfloat16), b=torch.randn(32, 48, dtype=torch.bfloat16))
    ptx = evtc.compile(roundings, ex, out_dtypes=torch.float32, cache_dir=tmp_path).ptx
    for mode in ("rmi", "rpi", "rzi", "rni"):
        assert re.search(rf"\bcvt\.{mode}\.f32\.f32\b", ptx), mode


def test_softplus_with_beta_zero_compiles_to_torchs_inf(tmp_path):
    """F.softplus(x, beta=0) divides log(2) by zero, inf as in torch: it compiles (1 / beta raised
    ZeroDivisionError inside the code generator), and the call gives torch's values."""
    def soft(acc):
        return F.softplus(acc, beta=0.0)

    ex = dict(a=torch.randn(64, 32, dtype=torch.bfloat16), b=torch.randn(32, 48, dtype=torch.bfloat16))
    k = evtc.compile(soft, ex, out_dtypes=torch.float32, cache_dir=tmp_path)
    assert "lg2.approx" in k.ptx or "log" in k.source
    want = soft(ex["a"].float() @ ex["b"].float())
    assert torch.isinf(want).all()
    torch.testing.assert_close(k(ex["a"], ex["b"]), want)
