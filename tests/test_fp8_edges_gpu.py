"""Edge cases of float8 GEMMs on the GPU: e5m2 x e4m3, awkward scale layouts, ragged and tiny K,
M = 1 and narrow N, float8 rounding bit for bit (ties, subnormals, double rounding through 16 bits,
out_dtypes), out= into float8 tensors (aliasing a), extreme reductions, staged layouts, fast
accumulation with split-K, and block scales (mixed formats, small K, odd scale strides, zero and
negative scales, batched pitches, float8 out=).

Every result is checked against torch in float64 (or float32 where the float32 value is exact),
and every input is checked unmodified after the call. First written as an adversarial probe of
float8."""

from __future__ import annotations

import pytest
import torch
from fp8_edges_util import (
    BF16,
    DEV,
    E4M3,
    E5M2,
    F32,
    TOL_BF16,
    TOL_F32,
    TOL_FAST,
    assert_rel,
    bits_equal,
    blocks,
    bs_inputs,
    d64,
    dequantized,
    expect_path,
    float8_close,
    fp8,
    mm64,
    rand,
    randn,
    snapshot,
    to_float8,
    unchanged,
    weight_t,
)

import evtc

pytestmark = pytest.mark.gpu

ONE = {"cluster": (1, 1)}  # one compiled tile (no per-size variants to build)
PAIRS = {"schedule": "cooperative", "tile_m": 128, "tile_n": 128, "cluster": (1, 1)}
PP64 = {"schedule": "pingpong", "tile_m": 64, "tile_n": 64, "cluster": (1, 1)}


def _compile(fn, example, cache, config=None, **kw):
    return evtc.compile(fn, example, cache_dir=cache, config=config, **kw)


# ---- e5m2 a with e4m3 b ---------------------------------------------------------------------------------

def rowwise_f32(acc, sa, sb):
    return (acc * sa * sb).float()


@pytest.mark.parametrize("fast", [False, True], ids=["promoted", "fast"])
def test_e5m2_a_e4m3_b_rowwise_float32(cache, fast):
    m, n, k = 200, 1000, 1040
    a, b = fp8((m, k), E5M2, 10), weight_t(n, k, E4M3, 11)
    sa, sb = rand(m, 1, seed=12), rand(n, seed=13, lo=0.01, hi=0.1)
    snap = snapshot(a, b, sa, sb)
    kern = _compile(rowwise_f32, dict(a=a, b=b, sa=sa, sb=sb), cache, config={**ONE, "fast_accum": fast})
    got = kern(a, b, sa=sa, sb=sb)
    expect_path(kern, "kernel")
    assert got.dtype == F32
    assert_rel(got, mm64(a, b) * d64(sa) * d64(sb), TOL_FAST if fast else TOL_F32, "e5m2 x e4m3")
    unchanged(snap, "e5m2 x e4m3")


def batched_fp8_amax(acc, sa, sb, s):
    y = acc * sa * sb * s
    return y.to(torch.float8_e5m2), y.abs().amax((-2, -1)), y.amax(-1)


@pytest.mark.parametrize("fast", [False, True], ids=["promoted", "fast"])
def test_batched_e5m2_e4m3_per_batch_scales_float8_out(cache, fast):
    """Per-batch column, row and scalar scales (L, M, 1), (L, 1, N), (L, 1, 1) on batched e5m2 x
    e4m3; an e5m2 output, the amax per batch and per row."""
    L, m, n, k = 3, 130, 256, 384
    a, b = fp8((L, m, k), E5M2, 20), weight_t(n, k, E4M3, 21, lead=(L,))
    sa, sb, s = rand(L, m, 1, seed=22), rand(L, 1, n, seed=23), rand(L, 1, 1, seed=24, lo=0.1, hi=4)
    snap = snapshot(a, b, sa, sb, s)
    kern = _compile(batched_fp8_amax, dict(a=a, b=b, sa=sa, sb=sb, s=s), cache,
                    config={**ONE, "fast_accum": fast})
    q, amax_l, amax_row = kern(a, b, sa=sa, sb=sb, s=s)
    expect_path(kern, "staged")  # sa's batch stride, 130 floats, is off 16 bytes
    y = mm64(a, b) * d64(sa) * d64(sb) * d64(s)
    tol = TOL_FAST if fast else TOL_F32
    float8_close(q, y, "e5m2 out", accum_rel=tol)
    assert amax_l.dtype == F32 and amax_l.shape == (L,)
    assert_rel(amax_l, y.abs().amax((-2, -1)), tol, "amax per batch")
    assert amax_row.dtype == F32 and amax_row.shape == (L, m)
    assert ((amax_row.double() - y.amax(-1)).abs() <= tol * y.abs().amax()).all(), "amax per row"
    unchanged(snap, "batched")


# ---- scales in awkward layouts and dtypes ----------------------------------------------------------------

def rowwise_scalar(acc, sa, sb, s):
    return acc * sa * sb * s


def test_scale_layouts_and_dtypes(cache):
    """One kernel compiled with contiguous float32 (M, 1), (N,) and () scales, called with
    expanded (stride 0), strided and bf16 scales, a (1,) and a (1, 1) scalar and a 0-dim CPU scalar:
    each call computes acc * sa * sb * s (docs/epilogues.md, operand kinds; another float dtype
    takes the torch path), output bf16 (docs/fp8.md, Results)."""
    m, n, k = 136, 264, 256
    a, b = fp8((m, k), E4M3, 30), weight_t(n, k, E4M3, 31)
    sa, sb, s = rand(m, 1, seed=32), rand(n, seed=33), rand((), seed=34)
    kern = _compile(rowwise_scalar, dict(a=a, b=b, sa=sa, sb=sb, s=s), cache, config=ONE)
    wide_a, wide_b = rand(m, 3, seed=35), rand(3 * n, seed=36)
    variants = {
        "plain": (sa, sb, s),
        "sa expanded": (rand(1, 1, seed=37).expand(m, 1), sb, s),
        "sa strided": (wide_a[:, 1:2], sb, s),
        "sa bf16": (sa.to(BF16), sb, s),
        "sb expanded": (sa, rand(1, seed=38).expand(n), s),
        "sb strided": (sa, wide_b[1::3], s),
        "sb (1, N) row": (sa, sb[None, :], s),
        "sb bf16": (sa, sb.to(BF16), s),
        "s (1,)": (sa, sb, s.reshape(1)),
        "s (1, 1)": (sa, sb, s.reshape(1, 1)),
        "s cpu 0-dim": (sa, sb, s.cpu()),
    }
    for name, (x, y, z) in variants.items():
        snap = snapshot(a, b, x, y, z)
        got = kern(a, b, sa=x, sb=y, s=z)
        assert got.dtype == BF16 and got.shape == (m, n), name
        want = mm64(a, b) * d64(x) * d64(y) * d64(z).to(DEV)
        assert_rel(got, want, TOL_BF16, name)
        unchanged(snap, name)


# ---- K not a multiple of the 128-element K tile, nor of 16 --------------------------------------------

def to_f32(acc, s):
    return (acc * s).float()


@pytest.mark.parametrize("fast", [False, True], ids=["promoted", "fast"])
def test_tiny_and_ragged_k(cache, fast):
    """K from 1 to 144 on a kernel compiled at K = 256: one partial K tile (its tail zero-filled),
    K below the wgmma's k32, and K not a multiple of 16 (the staged path)."""
    m, n = 130, 96
    s = rand((), seed=40)
    kern = _compile(to_f32, dict(a=fp8((m, 256), E4M3, 41), b=weight_t(n, 256, E4M3, 42), s=s), cache,
                    config={**PAIRS, "fast_accum": fast})
    for k in (16, 32, 48, 96, 144, 8, 24, 40, 1):
        a, b = fp8((m, k), E4M3, 43 + k), weight_t(n, k, E4M3, 44 + k)
        snap = snapshot(a, b, s)
        got = kern(a, b, s=s)
        expect_path(kern, "kernel" if k % 16 == 0 else "staged")
        assert_rel(got, mm64(a, b) * d64(s).to(DEV), TOL_FAST if fast else TOL_F32, f"K={k}")
        unchanged(snap, f"K={k}")


# ---- M = 1 and N not a multiple of 16, with a float8 output and its row amax ---------------------------

def fp8_out_row_amax(acc, s):
    y = acc * s
    return y.to(torch.float8_e4m3fn), y.abs().amax(-1), y.sum(-2)


@pytest.mark.parametrize("config", [PP64, PAIRS], ids=["pingpong64", "pairs128"])
def test_one_row_and_narrow_columns(cache, config):
    k = 512
    s = torch.tensor(0.125, device=DEV)
    kern = _compile(fp8_out_row_amax, dict(a=fp8((64, k), E4M3, 50), b=weight_t(64, k, E4M3, 51), s=s),
                    cache, config=config)
    for m, n in ((1, 16), (1, 8), (1, 24), (1, 1000), (3, 1001), (2, 1), (65, 40)):
        a, b = fp8((m, k), E4M3, 52 + n), weight_t(n, k, E4M3, 53 + m)
        snap = snapshot(a, b, s)
        q, amax, colsum = kern(a, b, s=s)
        expect_path(kern, "kernel" if n % 16 == 0 or m == 1 else "staged")  # one row: no pitch
        y = mm64(a, b) * 0.125
        float8_close(q, y, f"q {m}x{n}")
        assert amax.shape == (m,) and amax.dtype == F32
        assert ((amax.double() - y.abs().amax(-1)).abs() <= TOL_F32 * y.abs().max()).all(), (m, n)
        assert colsum.shape == (n,) and colsum.dtype == F32
        assert ((colsum.double() - y.sum(-2)).abs() <= TOL_F32 * y.abs().sum(-2).max()).all(), (m, n)
        unchanged(snap, f"{m}x{n}")


# ---- float8 rounding bit for bit -------------------------------------------------------------------------

# acc + C lands on these float32 values (zero rows of a: acc is 0 there), both signs: ties of both
# formats (round half to even), subnormals and their ties, the saturation and overflow edges, and
# values whose rounding to bf16 or f16 first makes a tie that rounds the other way (torch rounds
# twice: y.bfloat16().to(e4m3) is not y.to(e4m3)).
TARGETS = [
    17.0, 19.0, 8.5, 9.5, 248.0, 2.0 ** -10, 3 * 2.0 ** -10, 5 * 2.0 ** -11, 1.0625 * 2.0 ** -7, 0.0146,
    18.0, 22.0, 4.5, 5.5, 2.0 ** -17, 3 * 2.0 ** -17, 2.0 ** -15 * 1.75,
    17.03, 18.97, 18.004, 9.49, 4.51, 4.5001, 18.01,
    449.0, 464.0, 465.0, 57344.0, 61439.0, 61440.0, 65519.0, 65520.0, 70000.0, 1e30,
    float("inf"), float("nan"), 3.0, 0.3,
]


def rounding_chains(acc, C):
    y = acc + C
    return (y.to(torch.float8_e4m3fn), y.bfloat16().to(torch.float8_e4m3fn), y.half().to(torch.float8_e5m2),
            y.to(torch.float8_e5m2), y.half().to(torch.float8_e4m3fn), y.bfloat16().to(torch.float8_e5m2))


def _rounding_operands(m, n, k, seed):
    """float8 a with its first half of rows zero and small integers elsewhere, b of small integers
    (acc exact in float32), and C of TARGETS (random signs) in float32."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(-2, 3, (m, k), generator=g).float()
    a[: m // 2] = 0
    w = torch.randint(-2, 3, (n, k), generator=g).float()
    t = torch.tensor(TARGETS)
    picks = t[torch.randint(0, len(TARGETS), (m, n), generator=g)]
    signs = torch.where(torch.rand(m, n, generator=g) < 0.5, -1.0, 1.0)
    C = picks * signs
    return a.to(E4M3).to(DEV), w.to(E4M3).to(DEV).t(), C.to(DEV)


def _chains_ref(y):
    return (to_float8(y, E4M3), to_float8(y.bfloat16(), E4M3), to_float8(y.half(), E5M2),
            to_float8(y, E5M2), to_float8(y.half(), E4M3), to_float8(y.bfloat16(), E5M2))


@pytest.mark.parametrize("shape", [(256, 256, 64), (200, 136, 64)], ids=["aligned", "staged"])
def test_float8_rounding_ties_subnormals_and_double_rounding(cache, shape):
    m, n, k = shape
    a, b, C = _rounding_operands(m, n, k, seed=60)
    snap = snapshot(a, b, C)
    kern = _compile(rounding_chains, dict(a=a, b=b, C=C), cache, config=ONE)
    got = kern(a, b, C=C)
    expect_path(kern, "kernel" if n % 16 == 0 else "staged")
    y = a.float() @ b.float() + C  # exact: small integers, then one float32 add as the kernel's
    names = ["y.to(e4m3)", "y.bf16.to(e4m3)", "y.half.to(e5m2)", "y.to(e5m2)", "y.half.to(e4m3)",
             "y.bf16.to(e5m2)"]
    for g, w, name in zip(got, _chains_ref(y), names, strict=True):
        bits_equal(g, w, name)
    unchanged(snap, "rounding")


def two_outputs(acc, C):
    y = acc + C
    return y, y * 0.5


def test_out_dtypes_float8_round_once_as_to_does(cache):
    """out_dtypes=[e4m3, e5m2] on float32 values: each stored as .to(dtype) rounds the float32 value
    (one rounding; docs/epilogues.md Outputs: out_dtypes overrides the output's dtype), e4m3
    saturating and e5m2 overflowing to infinity."""
    m, n, k = 256, 256, 64
    a, b, C = _rounding_operands(m, n, k, seed=61)
    snap = snapshot(a, b, C)
    kern = _compile(two_outputs, dict(a=a, b=b, C=C), cache, config=ONE, out_dtypes=[E4M3, E5M2])
    d0, d1 = kern(a, b, C=C)
    expect_path(kern, "kernel")
    y = a.float() @ b.float() + C
    bits_equal(d0, to_float8(y, E4M3), "out_dtypes e4m3")
    bits_equal(d1, to_float8(y * 0.5, E5M2), "out_dtypes e5m2")
    unchanged(snap, "out_dtypes")


# ---- out= into float8 tensors -----------------------------------------------------------------------------

def fp8_scaled(acc, s):
    return (acc * s).to(torch.float8_e4m3fn)


def test_out_float8_non_contiguous_and_aliasing_a(cache):
    """out= a transposed or strided float8 tensor, and out= a itself (float8 (M, K) with K = N): the
    result of the inputs' values before the call (docs/epilogues.md: out=)."""
    m, n = 192, 256
    k = n
    s = torch.tensor(0.25, device=DEV)
    a, b = fp8((m, k), E4M3, 70), weight_t(n, k, E4M3, 71)
    kern = _compile(fp8_scaled, dict(a=a, b=b, s=s), cache, config=ONE)
    y64 = mm64(a, b) * 0.25
    fresh = kern(a, b, s=s)
    float8_close(fresh, y64, "fresh")
    for name, out in {"transposed": torch.full((n, m), float("nan"), device=DEV).to(E4M3).t(),
                      "strided": torch.full((m, 2 * n), float("nan"), device=DEV).to(E4M3)[:, ::2]}.items():
        snap = snapshot(a, b, s)
        res = kern(a, b, s=s, out=out)
        assert res.data_ptr() == out.data_ptr() and res.stride() == out.stride(), name
        bits_equal(out, fresh, name)
        unchanged(snap, name)
    a2 = a.clone()
    res = kern(a2, b, s=s, out=a2)
    assert res.data_ptr() == a2.data_ptr()
    bits_equal(a2, fresh, "out=a")


# ---- reductions of all-negative values on ragged tiles, NaN and infinity ------------------------------

def extremes(acc, s, C):
    y = acc * s + C
    return y.amax(), y.amax(-1), y.amin(-2), y.max(), y.to(torch.float8_e4m3fn).float().amin(-1)


@pytest.mark.parametrize("shape", [(130, 200, 64), (1, 40, 32), (257, 24, 96)],
                         ids=lambda s: "x".join(map(str, s)))
def test_max_of_negative_values_on_ragged_tiles(cache, shape):
    """Every value negative: elements past the problem's edge must not count (docs/epilogues.md
    Reductions: masked, not zeroed). acc exact (small integers), so max and min are exact."""
    m, n, k = shape
    g = torch.Generator().manual_seed(80)
    a = torch.randint(-2, 3, (m, k), generator=g).float().to(E4M3).to(DEV)
    b = torch.randint(-2, 3, (n, k), generator=g).float().to(E4M3).to(DEV).t()
    C = (-1000.0 - torch.rand(m, n, generator=g) * 100).to(DEV)
    s = torch.tensor(0.5, device=DEV)
    snap = snapshot(a, b, s, C)
    kern = _compile(extremes, dict(a=a, b=b, s=s, C=C), cache, config=PP64)
    got = kern(a, b, s=s, C=C)
    y = (a.float() @ b.float()) * 0.5 + C  # exact in float32 (the kernel's one multiply-add may fuse: exact)
    want = (y.amax(), y.amax(-1), y.amin(-2), y.max(), to_float8(y, E4M3).float().amin(-1))
    for i, (g_, w) in enumerate(zip(got, want, strict=True)):
        assert g_.dtype == F32 and g_.shape == w.shape, i
        assert torch.equal(g_.cpu(), w.cpu()), (i, g_.flatten()[:4].tolist(), w.flatten()[:4].tolist())
    unchanged(snap, "extremes")


def nan_inf(acc, C):
    y = acc + C
    return y.abs().amax(), y.amax(-1), y.amin(-2), y.to(torch.float8_e4m3fn), y.to(torch.float8_e5m2)


def test_nan_and_infinity_in_reductions_and_casts(cache):
    """A NaN in the last (ragged) tile, +inf and -inf elsewhere: the amax over everything is NaN,
    the row and column reductions NaN or +-inf where they meet them (docs/epilogues.md: maxima
    propagate NaN as torch's), and the float8 casts bit for bit."""
    m, n, k = 130, 200, 64
    g = torch.Generator().manual_seed(90)
    a = torch.randint(-2, 3, (m, k), generator=g).float().to(E4M3).to(DEV)
    b = torch.randint(-2, 3, (n, k), generator=g).float().to(E4M3).to(DEV).t()
    C = torch.randn(m, n, generator=g) * 10
    C[m - 1, n - 1] = float("nan")
    C[0, 5] = float("inf")
    C[3, 7] = float("-inf")
    C[129, 0] = -0.0
    C = C.to(DEV)
    snap = snapshot(a, b, C)
    kern = _compile(nan_inf, dict(a=a, b=b, C=C), cache, config=ONE)
    amax, rmax, cmin, q4, q5 = kern(a, b, C=C)
    y = a.float() @ b.float() + C
    assert torch.isnan(amax).item(), amax
    wr, wc = y.amax(-1), y.amin(-2)
    assert torch.equal(rmax.cpu().nan_to_num(7.5), wr.cpu().nan_to_num(7.5))
    assert torch.equal(cmin.cpu().nan_to_num(7.5), wc.cpu().nan_to_num(7.5))
    bits_equal(q4, to_float8(y, E4M3), "e4m3")
    bits_equal(q5, to_float8(y, E5M2), "e5m2")
    unchanged(snap, "nan/inf")


def scale_from_amax(acc, sa, s_out):
    y = acc * sa
    amax = y.abs().amax()
    return (y * s_out).to(torch.float8_e4m3fn), amax, 448.0 / amax.clamp(min=1e-12)


def test_scale_from_amax_finished_in_the_kernel(cache):
    m, n, k = 300, 520, 768
    a, b = fp8((m, k), E4M3, 100), weight_t(n, k, E4M3, 101)
    sa, s_out = rand(m, 1, seed=102), torch.tensor(2.0, device=DEV)
    kern = _compile(scale_from_amax, dict(a=a, b=b, sa=sa, s_out=s_out), cache, config=PAIRS)
    q, amax, scale = kern(a, b, sa=sa, s_out=s_out)
    y = mm64(a, b) * d64(sa)
    float8_close(q, y * 2)
    assert amax.dtype == F32 and scale.dtype == F32 and amax.shape == scale.shape == ()
    assert abs(amax.item() - y.abs().max().item()) <= TOL_F32 * y.abs().max().item()
    assert abs(scale.item() - 448.0 / y.abs().max().item()) <= TOL_F32 * scale.item()


# ---- the staged path: N-major b, column-major a, a row pitch off 16 bytes --------------------------------

def fp8_out_amax(acc, sa, sb):
    y = acc * sa * sb
    return y.to(torch.float8_e4m3fn), y.abs().amax()


def test_staged_layouts_with_a_float8_output_and_its_amax(cache):
    m, n, k = 136, 200, 256
    a, b = fp8((m, k), E4M3, 110), weight_t(n, k, E5M2, 111)
    sa, sb = rand(m, 1, seed=112), rand(n, seed=113)
    kern = _compile(fp8_out_amax, dict(a=a, b=b, sa=sa, sb=sb), cache, config=ONE)
    big = fp8((m, k + 8), E4M3, 114)
    for name, (x, w) in {"n-major b": (a, b.contiguous()),
                         "column-major a": (a.t().contiguous().t(), b),
                         "a pitch k+8": (big[:, :k], b),
                         "both": (a.t().contiguous().t(), b.contiguous())}.items():
        snap = snapshot(x, w, sa, sb)
        q, amax = kern(x, w, sa=sa, sb=sb)
        expect_path(kern, "staged")
        y = mm64(x, w) * d64(sa) * d64(sb)
        float8_close(q, y, name)
        assert abs(amax.item() - y.abs().max().item()) <= TOL_F32 * y.abs().max().item(), name
        unchanged(snap, name)


# ---- fast accumulation with split-K ------------------------------------------------------------------------

@pytest.mark.parametrize("splits", [2, 3])
def test_fast_accum_split_k(cache, splits):
    m, n, k = 256, 384, 3072 + 128
    s = rand((), seed=120)
    a, b = fp8((m, k), E5M2, 121), weight_t(n, k, E4M3, 122)
    kern = _compile(to_f32, dict(a=a, b=b, s=s), cache,
                    config={**PAIRS, "fast_accum": True, "split_k": True})
    kern.pin_splits(splits)
    snap = snapshot(a, b, s)
    got = kern(a, b, s=s)
    expect_path(kern, "kernel")
    assert_rel(got, mm64(a, b) * d64(s), TOL_FAST, f"splits={splits}")
    unchanged(snap, "split")


# ---- block scales ------------------------------------------------------------------------------------------

def bs_f32(acc):
    return acc.float()


@pytest.mark.parametrize("rows", [1, 128], ids=["1x128", "128x128"])
def test_block_scales_e5m2_a_e4m3_b(cache, rows):
    m, n, k = 129, 200, 300
    a, b = bs_inputs(m, n, k, rows, E5M2, E4M3, seed=130)
    snap = snapshot(a, b)
    kern = _compile(bs_f32, dict(a=a, b=b), cache, config=ONE)
    got = kern(a, b)
    assert_rel(got, dequantized(a, b, rows), TOL_F32, "bs e5m2 x e4m3")
    unchanged(snap, "bs e5m2 x e4m3")


@pytest.mark.parametrize("rows", [1, 128], ids=["1x128", "128x128"])
def test_block_scales_small_and_ragged_k(cache, rows):
    """K of 16 to 200 (one partial block, K below the k32 step, K % 16 != 0 staged) on a kernel
    compiled at K = 256."""
    m, n = 132, 136
    ex_a, ex_b = bs_inputs(m, n, 256, rows, seed=140)
    kern = _compile(bs_f32, dict(a=ex_a, b=ex_b), cache, config=PAIRS)
    for k in (16, 32, 64, 100, 200, 8):
        a, b = bs_inputs(m, n, k, rows, seed=141 + k)
        snap = snapshot(a, b)
        with torch.no_grad():
            got = kern(a, b)
        assert_rel(got, dequantized(a, b, rows), TOL_F32, f"K={k}")
        unchanged(snap, f"K={k}")


def test_block_scales_odd_scale_strides(cache):
    """b's scales "take any strides" (docs/fp8.md): expanded (stride 0) and sliced; a's 1 x 128
    scales expanded along M or K (not M-major with a 16-byte pitch: an aligned copy)."""
    m, n, k = 256, 384, 640
    a, b = bs_inputs(m, n, k, 1, seed=150)
    kern = _compile(bs_f32, dict(a=a, b=b), cache, config=ONE)
    (x, sa), (w, sb) = a, b
    kb, nb = blocks(k), blocks(n)
    variants = {
        "sb expanded": (sa, rand(1, 1, seed=151).expand(kb, nb)),
        "sb row expanded": (sa, rand(1, nb, seed=152).expand(kb, nb)),
        "sb k-major": (sa, sb.contiguous()),
        "sb sliced": (sa, rand(kb, 2 * nb, seed=153)[:, 1::2]),
        "sa expanded along M": (rand(1, kb, seed=154).expand(m, kb), sb),
        "sa expanded along K": (rand(m, 1, seed=155).expand(m, kb), sb),
        "sa scalar expanded": (rand(1, 1, seed=156).expand(m, kb), sb),
    }
    for name, (xs, ws) in variants.items():
        snap = snapshot(x, w, xs, ws)
        got = kern((x, xs), (w, ws))
        assert_rel(got, dequantized((x, xs), (w, ws), 1), TOL_F32, name)
        unchanged(snap, name)


def test_block_scales_128x128_a_scales_expanded(cache):
    m, n, k = 300, 256, 512
    a, b = bs_inputs(m, n, k, 128, seed=160)
    kern = _compile(bs_f32, dict(a=a, b=b), cache, config=ONE)
    (x, _), (w, sb) = a, b
    for name, xs in {"expanded": rand(1, 1, seed=161).expand(blocks(m), blocks(k)),
                     "k-major": rand(blocks(m), blocks(k), seed=162),
                     "m-major": rand(blocks(k), blocks(m), seed=163).t()}.items():
        snap = snapshot(x, w, xs, sb)
        got = kern((x, xs), (w, sb))
        assert_rel(got, dequantized((x, xs), (w, sb), 128), TOL_F32, name)
        unchanged(snap, name)


def test_block_scales_zero_and_negative(cache):
    """Scales of 0 (a block that contributes nothing) and negative ones (a sign flip) are plain
    numbers: the product is the dequantized one."""
    m, n, k = 200, 256, 512
    (x, sa), (w, sb) = bs_inputs(m, n, k, 1, seed=170)
    sa = sa.clone()
    sb = sb.clone()
    sa[::3, 1] = 0.0
    sa[1::3, 2] *= -1
    sb[0, 1] = -sb[0, 1]
    sb[3, 0] = 0.0
    snap = snapshot(x, sa, w, sb)
    kern = _compile(bs_f32, dict(a=(x, sa), b=(w, sb)), cache, config=ONE)
    got = kern((x, sa), (w, sb))
    assert_rel(got, dequantized((x, sa), (w, sb), 1), TOL_F32, "zero/negative scales")
    unchanged(snap, "zero/negative scales")


@pytest.mark.parametrize("m", [130, 132, 1, 5])
def test_block_scales_batched_torch_layout(cache, m):
    """Batched 1 x 128 scales in torch's layout, (L, KB, M) transposed: batch stride KB * M and
    pitch M (16-byte multiples only at M = 132)."""
    L, n, k = 2, 256, 384
    ex = bs_inputs(132, n, k, 1, seed=180, lead=(L,))
    kern = _compile(bs_f32, dict(a=ex[0], b=ex[1]), cache, config=ONE)
    a, b = bs_inputs(m, n, k, 1, seed=181 + m, lead=(L,))
    snap = snapshot(a, b)
    got = kern(a, b)
    assert got.shape == (L, m, n)
    assert_rel(got, dequantized(a, b, 1), TOL_F32, f"batched M={m}")
    unchanged(snap, f"batched M={m}")


def bs_fp8_amax(acc, bias):
    y = acc * 0.05 + bias
    return y.to(torch.float8_e4m3fn), y.abs().amax(-1)


@pytest.mark.parametrize("rows", [1, 128], ids=["1x128", "128x128"])
def test_block_scales_float8_out_param(cache, rows):
    """A float8 output into out= tensors (strided: staged) and a new one, M = 1 and ragged sizes;
    N = 8 and 200 (float8 rows off 16 bytes)."""
    ex = bs_inputs(128, 256, 256, rows, seed=190)
    bias = randn(256, seed=191, dtype=BF16)
    kern = _compile(bs_fp8_amax, dict(a=ex[0], b=ex[1], bias=bias), cache, config=ONE)
    for m, n, k in ((1, 256, 256), (5, 8, 300), (129, 200, 640)):
        a, b = bs_inputs(m, n, k, rows, seed=192 + m)
        bias = randn(n, seed=193 + n, scale=5.0, dtype=BF16)
        y = dequantized(a, b, rows) * 0.05 + d64(bias)
        snap = snapshot(a, b, bias)
        q, amax = kern(a, b, bias=bias)
        float8_close(q, y, f"new {m}x{n}")
        out_q = torch.zeros(m, 2 * n, device=DEV).to(E4M3)[:, ::2]
        out_a = torch.zeros(2 * m, device=DEV)[::2]
        res = kern(a, b, bias=bias, out=(out_q, out_a))
        assert res[0].data_ptr() == out_q.data_ptr() and res[1].data_ptr() == out_a.data_ptr()
        bits_equal(out_q, q, f"out= {m}x{n}")
        assert torch.equal(out_a.cpu(), amax.cpu())
        assert ((amax.double() - y.abs().amax(-1)).abs() <= TOL_F32 * y.abs().max()).all()
        unchanged(snap, f"{m}x{n}")


# ---- float8 outputs of reductions (finished by the host), autograd through a float8 kernel ----------------

def reductions_out_e4m3(acc):
    y = acc * 10
    return y, y.abs().amax(), y.amax(-1)


def test_reduction_outputs_cast_to_float8_saturate(cache):
    """out_dtypes=e4m3 for every output, reductions included: each rounds as .to(e4m3) does,
    saturating at 448 (every row's max is past it here); an e5m2 sum overflows to +-inf."""
    m, n, k = 96, 160, 256
    a, b = fp8((m, k), E4M3, 200), weight_t(n, k, E4M3, 201)
    kern = _compile(reductions_out_e4m3, dict(a=a, b=b), cache, config=ONE, out_dtypes=E4M3)
    d, amax, rmax = kern(a, b)
    y = mm64(a, b) * 10
    assert d.dtype == amax.dtype == rmax.dtype == E4M3 and amax.shape == () and rmax.shape == (m,)
    float8_close(d, y, "D")
    assert (y.amax(-1) > 460).all()
    assert amax.float().item() == 448.0, amax
    assert torch.equal(rmax.float().cpu(), torch.full((m,), 448.0)), rmax.float()[:8]

    def sum_e5m2(acc):
        return (acc * 1e6).sum(-1).to(torch.float8_e5m2)

    k2 = _compile(sum_e5m2, dict(a=a, b=b), cache, config=ONE)
    got = k2(a, b)
    ref = mm64(a, b).sum(-1) * 1e6
    big = ref.abs() > 2 * 61440
    assert got.dtype == E5M2 and big.any()
    assert torch.equal(got.float()[big].cpu(), (torch.sign(ref[big]) * float("inf")).float().cpu())


def gelu_scaled(acc, sa, sb, bias):
    return torch.nn.functional.gelu(acc * sa * sb + bias)


def test_autograd_through_a_float8_kernel(cache):
    """Gradients of float8 a and w (b = w.t()) and of float32 scales and bias: torch gives float8
    leaves float8 gradients (a.float() @ w.float().t() autograd); compared in float64."""
    m, n, k = 192, 256, 384
    a0, w0 = fp8((m, k), E4M3, 210), fp8((n, k), E4M3, 211)
    sa0, sb0, bias0 = rand(m, 1, seed=212), rand(n, seed=213), randn(n, seed=214)
    G = randn(m, n, seed=215).to(BF16)  # the bf16 output's incoming gradient
    kern = _compile(gelu_scaled, dict(a=a0, b=w0.t(), sa=sa0, sb=sb0, bias=bias0), cache, config=ONE)
    a, w, sa, sb, bias = (t.clone().requires_grad_() for t in (a0, w0, sa0, sb0, bias0))
    out = kern(a, w.t(), sa=sa, sb=sb, bias=bias)
    assert out.dtype == BF16 and out.requires_grad
    out.backward(G)
    r = [d64(t).clone().requires_grad_() for t in (a0, w0, sa0, sb0, bias0)]
    ref = torch.nn.functional.gelu(r[0] @ r[1].t() * r[2] * r[3] + r[4])
    ref.backward(d64(G))
    for name, t, t64 in zip(["a", "w", "sa", "sb", "bias"], (a, w, sa, sb, bias), r, strict=True):
        assert t.grad is not None and t.grad.dtype == t.dtype and t.grad.shape == t.shape, name
        if t.dtype in (E4M3, E5M2):
            float8_close(t.grad, t64.grad, f"d{name}", accum_rel=1e-2)
        else:
            assert_rel(t.grad, t64.grad, 1e-2, f"d{name}")


# ---- a float8 output beside a bf16 D, and gated halves with a float8 output, at narrow widths --------------

def bf16_and_fp8(acc, s):
    y = acc * s
    return y, y.to(torch.float8_e5m2)


def test_float8_second_output_at_narrow_widths(cache):
    """D bf16 (rows of 2N bytes) and a second, e5m2 output (rows of N bytes): N = 24 and 1000 fit
    the bf16 row's 16-byte rule but not the float8 one's."""
    k = 256
    s = torch.tensor(0.5, device=DEV)
    kern = _compile(bf16_and_fp8, dict(a=fp8((128, k), E4M3, 220), b=weight_t(128, k, E4M3, 221), s=s),
                    cache, config=PAIRS)
    for m, n in ((1, 24), (130, 1000), (3, 40), (64, 128)):
        a, b = fp8((m, k), E4M3, 222 + n), weight_t(n, k, E4M3, 223 + m)
        snap = snapshot(a, b, s)
        d, q = kern(a, b, s=s)
        expect_path(kern, "kernel" if n % 16 == 0 or m == 1 else "staged")  # one row: no pitch
        y = mm64(a, b) * 0.5
        assert d.dtype == BF16 and q.dtype == E5M2
        assert_rel(d, y, TOL_BF16, f"D {m}x{n}")
        float8_close(q, y, f"e5m2 {m}x{n}")
        unchanged(snap, f"{m}x{n}")


def swiglu_fp8(acc, s):
    gate, up = (acc * s).chunk(2, dim=-1)
    y = torch.nn.functional.silu(gate) * up
    return y.to(torch.float8_e4m3fn), y.abs().amax(-1)


def test_gated_float8_output_at_narrow_halves(cache):
    k = 384
    s = torch.tensor(0.05, device=DEV)
    kern = _compile(swiglu_fp8, dict(a=fp8((128, k), E4M3, 230), b=weight_t(256, k, E4M3, 231), s=s),
                    cache, config=ONE)
    for m, n in ((130, 2 * 40), (1, 2 * 1000), (65, 2 * 256), (2, 2 * 8)):
        a, b = fp8((m, k), E4M3, 232 + n), weight_t(n, k, E4M3, 233 + m)
        snap = snapshot(a, b, s)
        q, amax = kern(a, b, s=s)
        gate, up = (mm64(a, b) * 0.05).chunk(2, dim=-1)
        y = torch.nn.functional.silu(gate) * up
        float8_close(q, y, f"swiglu {m}x{n}")
        assert ((amax.double() - y.abs().amax(-1)).abs() <= TOL_F32 * y.abs().max()).all(), (m, n)
        unchanged(snap, f"{m}x{n}")


def test_expanded_float8_a_and_b(cache):
    """Expanded float8 views (stride 0 along M of a, along N of b = w.t()): read as the values they
    show (docs/compile.md: inputs may be expanded views)."""
    k = 256
    s = rand((), seed=240)
    kern = _compile(to_f32, dict(a=fp8((130, k), E4M3, 241), b=weight_t(96, k, E4M3, 242), s=s), cache,
                    config=PAIRS)
    m, n = 130, 96
    row, wrow = fp8((1, k), E4M3, 243), fp8((1, k), E4M3, 244)
    a_full, b_full = fp8((m, k), E4M3, 245), weight_t(n, k, E4M3, 246)
    for name, (a, b) in {"a expanded": (row.expand(m, k), b_full),
                         "b expanded": (a_full, wrow.expand(n, k).t()),
                         "both": (row.expand(m, k), wrow.expand(n, k).t())}.items():
        snap = snapshot(a, b, s)
        got = kern(a, b, s=s)
        assert_rel(got, mm64(a, b) * d64(s), TOL_F32, name)
        unchanged(snap, name)
