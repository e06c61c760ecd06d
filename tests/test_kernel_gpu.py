"""GPU tests of the SM90 GEMM engine against torch in float32 (skip themselves without a Hopper GPU).

Every output buffer is poisoned with NaN first, so an element the kernel never writes fails the
check (NaN never passes: the relative error is NaN and the comparison is False).  Inputs are random
normal, never zeros or small integers."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from gemm_kernels import TORCH, compile_config, uses_d_buffers_of_c

from evtc.plan.config import GemmConfig

pytestmark = pytest.mark.gpu

# The cooperative schedule, named: GemmConfig's default is the ping-pong schedule, and the tests below
# keep covering both (the pingpong sections say so).
Coop = functools.partial(GemmConfig, schedule="cooperative")

TOL = 1e-2
IDENTITY = None  # the identity epilogue; (dtype, major) of C selects the linear combination


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def _randn(shape, dtype, gen):
    return torch.randn(shape, device="cuda", generator=gen, dtype=torch.float32).to(dtype)


def make_a(m, k, batches, major, dtype, gen, batched):
    lead = (batches,) if batched else ()
    if major == "k":
        return _randn(lead + (m, k), dtype, gen)
    return _randn(lead + (k, m), dtype, gen).transpose(-1, -2)


def make_b(k, n, batches, major, dtype, gen, batched):
    lead = (batches,) if batched else ()
    if major == "n":
        return _randn(lead + (k, n), dtype, gen)
    return _randn(lead + (n, k), dtype, gen).transpose(-1, -2)


def make_mn(m, n, batches, major, dtype, batched, fill=float("nan"), gen=None):
    lead = (batches,) if batched else ()
    shape = lead + ((m, n) if major == "n" else (n, m))
    if gen is not None:
        t = _randn(shape, dtype, gen)
    else:  # via float32: float8 NaN poison too
        t = torch.full(shape, fill, device="cuda", dtype=torch.float32).to(dtype)
    return t if major == "n" else t.transpose(-1, -2)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def check(out, ref, what=""):
    err = rel_err(out, ref)
    assert err <= TOL, f"{what}: relative error {err}"  # NaN fails here too


def assert_reruns_bitwise_equal(gemm, a, b, d, kwargs, runs: int) -> None:
    """Run ``gemm`` again ``runs`` times into a NaN-poisoned ``d``: every result must equal the first
    bit for bit."""
    first = d.clone()
    for _ in range(runs):
        d.fill_(float("nan"))
        gemm(a, b, out=d, **kwargs)
        torch.cuda.synchronize()
        assert torch.equal(d, first)


def run_case(cfg: GemmConfig, c, m, n, k, batches=1, batched=False, seed=0, alpha=1.25, beta=-0.5):
    """``cfg`` with the identity epilogue (``c`` None) or ``alpha * acc + beta * C`` (``c``: C's dtype
    and major), run on the kernel path into a NaN-poisoned D."""
    gen = _gen(seed)
    ab = TORCH[cfg.ab_dtype]
    a = make_a(m, k, batches, cfg.a_major, ab, gen, batched)
    b = make_b(k, n, batches, cfg.b_major, ab, gen, batched)
    d = make_mn(m, n, batches, cfg.d_major, TORCH[cfg.d_dtype], batched)
    ref = a.float() @ b.float()
    kwargs = {}
    if c is not None:
        c_tensor = make_mn(m, n, batches, c[1], TORCH[c[0]], batched, gen=gen)
        kwargs = {"c": c_tensor, "alpha": alpha, "beta": beta}
        ref = alpha * ref + beta * c_tensor.float()
    gemm = compile_config(cfg, c, batched=batched)
    gemm(a, b, out=d, **kwargs)
    torch.cuda.synchronize()
    assert gemm.last_path == "kernel"
    return d, ref, (gemm, a, b, kwargs)


# ---- every dtype x major combination (identity epilogue), ragged shape ----------------------------

DTYPE_MAJORS = list(itertools.product(("float16", "bfloat16"), ("float32", "float16", "bfloat16"),
                                      ("k", "m"), ("k", "n"), ("n", "m")))


@pytest.mark.parametrize("schedule", ["pingpong", "cooperative"])
@pytest.mark.parametrize("ab,dt,am,bm,dm", DTYPE_MAJORS, ids=["-".join(c) for c in DTYPE_MAJORS])
def test_identity_dtypes_and_majors(ab, dt, am, bm, dm, schedule):
    cfg = GemmConfig(ab_dtype=ab, d_dtype=dt, a_major=am, b_major=bm, d_major=dm, schedule=schedule)
    d, ref, _ = run_case(cfg, IDENTITY, 264, 520, 1032)
    check(d, ref, cfg.short_name())


# ---- every cluster x epilogue tile x tile_n ----------------------------------------------------

SHAPES_KNOBS = list(itertools.product(((1, 1), (2, 1), (1, 2), (1, 4)), (16, 32, 64), (128, 256)))


@pytest.mark.parametrize("cluster,epi_n,tile_n", SHAPES_KNOBS,
                         ids=[f"c{c[0]}x{c[1]}-epi{e}-n{t}" for c, e, t in SHAPES_KNOBS])
def test_identity_clusters_and_tiles(cluster, epi_n, tile_n):
    cfg = Coop(cluster=cluster, epi_tile_n=epi_n, tile_n=tile_n)
    # 5 x 3 tiles of 128 x 256 (ragged in both): odd cluster tiles at both edges.
    d, ref, _ = run_case(cfg, IDENTITY, 600, 712, 520)
    check(d, ref, cfg.short_name())


WAVE_WIDTHS = [(112, 16), (144, 16), (160, 32)]


@pytest.mark.parametrize("tile_n,epi_n", WAVE_WIDTHS, ids=[f"n{t}" for t, _ in WAVE_WIDTHS])
@pytest.mark.parametrize("dm", ["n", "m"])
def test_wave_fitted_widths(tile_n, epi_n, dm):
    """The cooperative widths that are not multiples of 64 (K-major B): ragged in M, N and K, with
    the linear combination and both D majors."""
    cfg = Coop(tile_n=tile_n, epi_tile_n=epi_n, b_major="k", d_major=dm, cluster=(2, 1),
               ab_dtype="bfloat16", d_dtype="bfloat16")
    d, ref, _ = run_case(cfg, ("bfloat16", dm), 600, 1000, 520)
    check(d, ref, cfg.short_name())


def test_tile_n_64():
    cfg = Coop(tile_n=64, epi_tile_n=64, ab_dtype="bfloat16", d_dtype="float32")
    d, ref, _ = run_case(cfg, IDENTITY, 300, 200, 264)
    check(d, ref, cfg.short_name())


# ---- float8 D --------------------------------------------------------------------------------

FP8_D = [GemmConfig(d_dtype="float8_e4m3fn"), Coop(d_dtype="float8_e5m2", b_major="k"),
         GemmConfig(ab_dtype="bfloat16", d_dtype="float8_e4m3fn", epi_tile_n=64, cluster=(2, 1))]


@pytest.mark.parametrize("cfg", FP8_D, ids=lambda c: c.short_name())
@pytest.mark.parametrize("m,n,k", [(1000, 1008, 520), (264, 512, 1032), (16384, 128, 64)])
def test_float8_d(cfg, m, n, k):
    """A float8 D: against torch's float32 result rounded to float8 as the IR rounds (saturating);
    every element written (the NaN poison is gone)."""
    from evtc.ir.dtypes import round_to

    d, ref, _ = run_case(cfg, IDENTITY, m, n, k)
    expected = round_to(ref, TORCH[cfg.d_dtype])
    assert torch.isfinite(d.float()).all()
    check(d, expected.float(), cfg.short_name())


# ---- odd shapes --------------------------------------------------------------------------------

ODD = [(1000, 1000, 1000), (1, 4096, 4096), (4096, 8, 4096), (264, 512, 1032), (8, 8, 8),
       (128, 256, 64), (4096, 4096, 16)]


@pytest.mark.parametrize("cluster", [(1, 1), (2, 1), (1, 2), (1, 4)], ids=["c1x1", "c2x1", "c1x2", "c1x4"])
@pytest.mark.parametrize("m,n,k", ODD, ids=[f"{m}x{n}x{k}" for m, n, k in ODD])
def test_odd_shapes(m, n, k, cluster):
    cfg = Coop(cluster=cluster, b_major="k")
    d, ref, _ = run_case(cfg, IDENTITY, m, n, k)
    check(d, ref, f"{m}x{n}x{k} {cfg.short_name()}")


# ---- batched -----------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [
    Coop(),
    Coop(ab_dtype="bfloat16", d_dtype="float32", a_major="m", b_major="k", d_major="m"),
    Coop(cluster=(2, 1), tile_n=128),
    Coop(cluster=(1, 2), epi_tile_n=64),
], ids=lambda c: c.short_name())
def test_batched(cfg):
    d, ref, _ = run_case(cfg, IDENTITY, 392, 264, 520, batches=3, batched=True)
    check(d, ref, cfg.short_name())
    for i in range(3):  # no batch may be skipped or written into another
        check(d[i], ref[i], f"batch {i}")


# ---- linear combination ------------------------------------------------------------------------

LINCOMB = [
    (Coop(), "float16", "n"),
    (Coop(), "float16", "m"),
    (Coop(ab_dtype="bfloat16", d_dtype="bfloat16", d_major="m"), "bfloat16", "m"),
    (Coop(d_dtype="float32", tile_n=128, epi_tile_n=64), "float32", "n"),
    (Coop(d_dtype="float32", d_major="m", epi_tile_n=16), "float32", "m"),
    (Coop(cluster=(2, 1), a_major="m"), "float16", "n"),
    (Coop(cluster=(1, 2), b_major="k", epi_tile_n=64), "bfloat16", "n"),
    (Coop(tile_n=64, epi_tile_n=64, load_stages=1), "float16", "n"),
]


@pytest.mark.parametrize("cfg,c_dtype,c_major", LINCOMB,
                         ids=[f"{c.short_name()} C{t}{m}" for c, t, m in LINCOMB])
def test_linear_combination(cfg, c_dtype, c_major):
    d, ref, _ = run_case(cfg, (c_dtype, c_major), 600, 712, 1032)
    check(d, ref, cfg.short_name())


def test_linear_combination_batched_and_odd():
    cfg = Coop(cluster=(2, 1))
    d, ref, _ = run_case(cfg, ("float16", "n"), 1000, 1000, 1000, batches=2, batched=True)
    check(d, ref, "batched lincomb")


# D staged in C's buffers (whole-tile C loads, C with D's dtype and major): every tile's stages go
# back to the loader during the next tile's mainloop.  Shapes give each CTA several tiles, and
# K of one k-tile (release after the mainloop), two and many.
D_IN_C = [
    Coop(load_stages=8),
    Coop(d_major="m", epi_tile_n=64, load_stages=4),
    Coop(ab_dtype="bfloat16", d_dtype="bfloat16", tile_n=128, epi_tile_n=16, load_stages=8,
               b_major="k"),
    Coop(cluster=(2, 1), load_stages=8, a_major="m"),
    Coop(cluster=(1, 2), tile_n=64, epi_tile_n=32, load_stages=2),
]


@pytest.mark.parametrize("cfg", D_IN_C, ids=[c.short_name() + f" L{c.load_stages}" for c in D_IN_C])
@pytest.mark.parametrize("m,n,k", [(4096, 4096, 256), (3000, 2504, 64), (1000, 3000, 104),
                                   (2048, 2048, 1032)])
def test_d_in_c_buffers(cfg, m, n, k):
    vis = (cfg.d_dtype, cfg.d_major)
    assert uses_d_buffers_of_c(compile_config(cfg, vis))
    d, ref, _ = run_case(cfg, vis, m, n, k)
    check(d, ref, f"{cfg.short_name()} {m}x{n}x{k}")


def test_d_in_c_buffers_batched_bitwise():
    cfg = Coop(load_stages=8)
    vis = ("float16", "n")
    d, ref, (gemm, a, b, kwargs) = run_case(cfg, vis, 1000, 1000, 1000, batches=3, batched=True)
    for i in range(3):
        check(d[i], ref[i], f"batch {i}")
    assert_reruns_bitwise_equal(gemm, a, b, d, kwargs, runs=5)


def test_scalars_are_runtime_values():
    cfg = Coop()
    vis = ("float16", "n")
    d, ref, (gemm, a, b, kwargs) = run_case(cfg, vis, 256, 512, 128, alpha=1.0, beta=0.0)
    check(d, ref, "alpha=1 beta=0")
    c = kwargs["c"]
    base = a.float() @ b.float()
    for alpha, beta in [(0.5, 2.0), (-3.0, 1.0), (0.0, 1.0)]:
        gemm2 = compile_config(cfg, vis)
        assert gemm2 is gemm  # same compiled kernel, new scalars
        d.fill_(float("nan"))
        gemm2(a, b, out=d, c=c, alpha=alpha, beta=beta)
        torch.cuda.synchronize()
        check(d, alpha * base + beta * c.float(), f"alpha={alpha} beta={beta}")


# ---- bounds and determinism --------------------------------------------------------------------


@pytest.mark.parametrize("d_major", ["n", "m"])
def test_no_writes_outside_d(d_major):
    """D is a window of a larger NaN buffer: the padding must stay NaN (TMA clips the stores)."""
    m, n, k = 200, 136, 264
    cfg = Coop(d_major=d_major)
    gen = _gen(7)
    a = _randn((m, k), torch.float16, gen)
    b = _randn((k, n), torch.float16, gen)
    if d_major == "n":
        big = torch.full((m + 24, n + 40), float("nan"), device="cuda", dtype=torch.float16)
        d = big[:m, :n]
    else:
        big = torch.full((n + 40, m + 24), float("nan"), device="cuda", dtype=torch.float16)
        d = big[:n, :m].t()
    gemm = compile_config(cfg)
    gemm(a, b, out=d)
    torch.cuda.synchronize()
    assert gemm.last_path == "kernel"  # D written in place, not through a staged copy
    check(d, a.float() @ b.float(), "window")
    mask = torch.ones_like(big, dtype=torch.bool)
    rows, cols = (m, n) if d_major == "n" else (n, m)
    mask[:rows, :cols] = False
    assert torch.isnan(big[mask]).all(), "the kernel wrote outside D"


@pytest.mark.parametrize("cfg,visitor", [
    (Coop(), IDENTITY),
    (Coop(cluster=(2, 1), epi_tile_n=16), ("float16", "n")),
    (Coop(cluster=(1, 2), d_dtype="float32"), IDENTITY),
    (GemmConfig(schedule="pingpong", cluster=(1, 1)), IDENTITY),
    (GemmConfig(schedule="pingpong", cluster=(2, 1), epi_tile_n=16), ("float16", "n")),
    (GemmConfig(), ("float16", "n")),
], ids=["c1x1", "c2x1-lincomb", "c1x2-f32", "pingpong-c1x1", "pingpong-c2x1-lincomb",
        "default-lincomb"])
def test_repeated_runs_bitwise_equal(cfg, visitor):
    d, ref, (gemm, a, b, kwargs) = run_case(cfg, visitor, 2048, 2048, 2048)
    check(d, ref)
    assert_reruns_bitwise_equal(gemm, a, b, d, kwargs, runs=3)


def test_runs_on_the_current_stream():
    cfg = Coop()
    gen = _gen(11)
    a = _randn((1024, 1024), torch.float16, gen)
    b = _randn((1024, 1024), torch.float16, gen)
    d = torch.full((1024, 1024), float("nan"), device="cuda", dtype=torch.float16)
    gemm = compile_config(cfg)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gemm(a, b, out=d)
        out = d.float().clone()  # ordered after the kernel on the same stream
    stream.synchronize()
    check(out, a.float() @ b.float(), "side stream")


# ---- pingpong schedule ------------------------------------------------------------------------
# Smallest problems first: a hang here is a pipeline-phase or order-barrier mismatch, and the first
# test that hangs names the case.  PP_ODD covers CTAs with 0 or 1 tiles (every small case), k_tiles
# below the A/B stage count (K=16, K=64), and an odd number of tiles on some CTAs
# (8192x768: 384 tiles of 128x128, one per warpgroup, over at most 132 CTAs).

PP_ODD = [(8, 8, 8), (64, 256, 64), (128, 128, 64), (128, 256, 64), (192, 512, 16), (264, 520, 1032),
          (1000, 1000, 1000), (1, 4096, 4096), (4096, 8, 4096), (4096, 4096, 16), (8192, 768, 256)]


@pytest.mark.parametrize("cluster", [(1, 1), (2, 1), (1, 2)], ids=["c1x1", "c2x1", "c1x2"])
@pytest.mark.parametrize("ab", ["float16", "bfloat16"])
@pytest.mark.parametrize("m,n,k", PP_ODD, ids=[f"{m}x{n}x{k}" for m, n, k in PP_ODD])
def test_pingpong_odd_shapes(m, n, k, ab, cluster):
    cfg = GemmConfig(schedule="pingpong", ab_dtype=ab, d_dtype=ab, cluster=cluster, b_major="k")
    d, ref, _ = run_case(cfg, IDENTITY, m, n, k)
    check(d, ref, f"{m}x{n}x{k} {cfg.short_name()}")


PP_KNOBS = [
    GemmConfig(schedule="pingpong", a_major="m", d_major="m"),
    GemmConfig(schedule="pingpong", d_dtype="float32", tile_n=128, epi_tile_n=64),
    GemmConfig(schedule="pingpong", ab_dtype="bfloat16", tile_n=64, epi_tile_n=16),
    GemmConfig(schedule="pingpong", epi_stages=2),
    GemmConfig(schedule="pingpong", epi_tile_n=64, b_major="k"),
]


@pytest.mark.parametrize("cfg", PP_KNOBS, ids=lambda c: c.short_name())
def test_pingpong_knobs(cfg):
    d, ref, _ = run_case(cfg, IDENTITY, 600, 712, 520)
    check(d, ref, cfg.short_name())


@pytest.mark.parametrize("cfg", [
    GemmConfig(schedule="pingpong"),
    GemmConfig(schedule="pingpong", cluster=(2, 1), ab_dtype="bfloat16", d_dtype="float32", d_major="m"),
], ids=lambda c: c.short_name())
def test_pingpong_batched(cfg):
    d, ref, _ = run_case(cfg, IDENTITY, 392, 264, 520, batches=3, batched=True)
    check(d, ref, cfg.short_name())
    for i in range(3):
        check(d[i], ref[i], f"batch {i}")


PP_LINCOMB = [
    (GemmConfig(schedule="pingpong"), "float16", "n"),
    (GemmConfig(schedule="pingpong", ab_dtype="bfloat16", d_dtype="bfloat16", d_major="m"), "bfloat16", "m"),
    (GemmConfig(schedule="pingpong", d_dtype="float32", cluster=(1, 1)), "float32", "n"),
    (GemmConfig(schedule="pingpong", cluster=(2, 1), a_major="m"), "float16", "m"),
    (GemmConfig(schedule="pingpong", cluster=(1, 2), epi_tile_n=16), "float16", "n"),
    (GemmConfig(schedule="pingpong", tile_n=64, epi_tile_n=64, load_stages=1), "float16", "n"),
    # a ring of 1 stage per warpgroup against 4 subtiles per tile
    (GemmConfig(schedule="pingpong", tile_n=64, epi_tile_n=16, load_stages=1), "float16", "n"),
]


@pytest.mark.parametrize("cfg,c_dtype,c_major", PP_LINCOMB,
                         ids=[f"{c.short_name()} C{t}{m}" for c, t, m in PP_LINCOMB])
def test_pingpong_linear_combination(cfg, c_dtype, c_major):
    # smallest first; (256, 128, 64) gives a CTA both warpgroups' tiles, so both load rings
    for m, n, k in [(64, 256, 16), (256, 128, 64), (600, 712, 1032), (8192, 768, 256)]:
        d, ref, _ = run_case(cfg, (c_dtype, c_major), m, n, k)
        check(d, ref, f"{m}x{n}x{k} {cfg.short_name()}")


def test_pingpong_linear_combination_batched():
    cfg = GemmConfig(schedule="pingpong", cluster=(2, 1))
    d, ref, _ = run_case(cfg, ("float16", "n"), 1000, 1000, 1000, batches=3, batched=True)
    check(d, ref, "batched lincomb pingpong")
