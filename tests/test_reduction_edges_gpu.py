"""Edge cases of epilogue reductions on the GPU (docs/epilogues.md "Reductions", docs/compile.md
"Who finishes them"): one-signed data at many launch shapes, NaN / infinities / -0.0, batches,
gated halves, float8, mixed-axis finishes, operand-only reductions, out=, many tiles and exact
integer sums. Every check compares with an independent float64 torch reference computed from the
same inputs (acc = a.double() @ b.double()); output shapes and dtypes against torch's own. First
written as an adversarial probe of reductions."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from reduction_edges_util import (
    BF16,
    E4M3,
    E5M2,
    F16,
    F32,
    acc64,
    close,
    d64,
    kmajor_b,
    randn,
    same_bits,
    snapshot,
    sum_tol,
    unchanged,
    uniform,
)

import evtc


def _compile(fn, ex, cache, **kw):
    return evtc.compile(fn, ex, cache_dir=cache, **kw)


def _meta(fn, a, b, **ops):
    """torch's own output structure (shapes, dtypes) on native dtypes."""
    out = fn(torch.matmul(a, b), **ops)
    return out if isinstance(out, (tuple, list)) else (out,)


def _check_meta(got, fn, a, b, what, **ops):
    want = _meta(fn, a, b, **ops)
    got = got if isinstance(got, (tuple, list)) else (got,)
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.dtype == w.dtype, f"{what} output {i}: dtype {g.dtype}, torch gives {w.dtype}"
        assert tuple(g.shape) == tuple(w.shape), (f"{what} output {i}: shape {tuple(g.shape)}, "
                                                  f"torch {tuple(w.shape)}")


# ---------------------------------------------------------------------------------------------------
# 1. maxima/minima/sums over rows, columns and everything at many launch shapes (the default
#    kernel picks 64x64 a8, 64x80 two-row, 128x64 coop, 128x144, 128x192, 128x256, split 3, ...),
#    on data of one sign, so that a padding element counted as 0 changes an amax (all negative)
#    or an amin (all positive).

def red_mix(acc):
    return (acc.amax(-1), acc.amin(-1), acc.amax(-2), acc.amin(-2), acc.amax(), acc.amin(),
            acc.float().sum(-1), acc.float().mean(-2), acc.mean())


def _red_mix_ref(y):
    return (y.amax(-1), y.amin(-1), y.amax(-2), y.amin(-2), y.amax(), y.amin(),
            y.sum(-1), y.mean(-2), y.mean())


def _signed_inputs(m, n, k, sign):
    """a > 0, sign * b > 0, with a factor per row and per column: acc has sign `sign` everywhere
    and its rows and columns differ."""
    s = 1 / math.sqrt(k)
    rows = (1 + torch.arange(m, device="cuda") % 7).float()[:, None] / 4
    cols = (1 + torch.arange(n, device="cuda") % 5).float()[None, :] / 3
    a = (uniform(m, k, dtype=F32, scale=s) * rows).to(F16)
    w = (uniform(n, k, dtype=F32, scale=s) * cols.t() * sign).to(F16)
    return a, w.t()


def _check_red_mix(got, a, b, what):
    y = acc64(a, b)
    want = _red_mix_ref(y)
    _check_meta(got, red_mix, a, b, what)
    tols = [None] * 6 + [sum_tol(y, -1), sum_tol(y, -2) / max(y.shape[-2], 1), sum_tol(y, None) / y.numel()]
    for i, (g, w, t) in enumerate(zip(got, want, tols, strict=True)):
        close(g, w, f"{what} output {i}", abs_tol=t)


RED_MIX_SHAPES = [(1, 1, 64), (7, 1, 64), (1, 9, 64), (5, 520, 4096), (33, 4100, 4096), (100, 4600, 4096),
                  (120, 4600, 4096), (512, 4600, 4096), (512, 8000, 4096), (1536, 6100, 1024),
                  (64, 1000, 8192), (130, 200, 64), (3, 65544, 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", RED_MIX_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_one_sign_extremes_and_sums_at_launch_shapes(cache, shape):
    m, n, k = shape
    ex_a, ex_b = _signed_inputs(64, 96, 64, -1)
    kern = _compile(red_mix, dict(a=ex_a, b=ex_b), cache)
    for sign in (-1.0, 1.0):
        a, b = _signed_inputs(m, n, k, sign)
        before = snapshot(a, b)
        got = kern(a, b)
        unchanged(before, (a, b), "red_mix")
        launch = kern.launch_for(m, n, k)[0].short_name()
        _check_red_mix(got, a, b, f"red_mix {shape} sign {sign:+} ({launch})")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(64, 296, 2000), (200, 296, 2000), (1, 40, 4096)],
                         ids=lambda s: "x".join(map(str, s)))
def test_split_k_pinned_with_tile_and_reductions(cache, shape):
    """Split-K (config split_k, pinned counts 3 and 4): reductions see the full sum once."""

    def sk(acc, bias):
        y = acc + bias
        return y, y.amax(-1), y.float().sum(-2), y.amin(), y.float().mean()

    m, n, k = shape
    ex = dict(a=randn(64, 128), b=kmajor_b(128, 96), bias=randn(96))
    kern = _compile(sk, ex, cache, config={"split_k": True})
    for splits in (3, 4):
        kern.pin_splits(splits)
        try:
            a, b, bias = randn(m, k, scale=0.5), kmajor_b(k, n, scale=0.5), randn(n)
            got = kern(a, b, bias=bias)
        finally:
            kern.pin_splits(None)
        _check_meta(got, sk, a, b, "split", bias=bias)
        y = acc64(a, b) + d64(bias)
        close(got[0], y, f"split {splits} y", abs_tol=2e-4 * y.abs().max())
        close(got[1], y.amax(-1), f"split {splits} amax(-1)", abs_tol=2e-4 * y.abs().max())
        close(got[2], y.sum(-2), f"split {splits} sum(-2)", abs_tol=sum_tol(y, -2))
        close(got[3], y.amin(), f"split {splits} amin()", abs_tol=2e-4 * y.abs().max())
        close(got[4], y.mean(), f"split {splits} mean()", abs_tol=sum_tol(y, None) / y.numel())


# ---------------------------------------------------------------------------------------------------
# 2. NaN, infinities and -0.0 (torch: amax/amin propagate NaN; inf - inf is NaN in a sum)

def specials(acc, C):
    y = acc * C
    return (y.amax(-1), y.amin(-2), y.sum(-1), y.amax(), y.float().sum(-2), y.amin((-2, -1), keepdim=True),
            y.amin(-1), y.amax(-2))


def _special_inputs(m=200, n=264, k=64):
    a, b = randn(m, k, scale=0.125), randn(k, n, scale=0.125)
    a[2] = 0.0                        # acc row 2 is +0.0
    C = randn(m, n) + 2.0
    C[:, 20] = -float("inf")          # a column of -inf (times acc's sign; 0 * inf = NaN at row 2)
    C[3] = float("inf")               # a row of +-inf: its sum is NaN (both signs), amax +inf
    C[5, 7] = float("nan")            # one NaN: row 5, column 7, everything
    C[2] = -1.0                       # y row 2 is -0.0 everywhere
    C[m - 1, :] = 100.0               # the last (ragged) row large
    return a, b, C


@pytest.mark.gpu
def test_nan_inf_propagation_matches_torch(cache):
    a, b, C = _special_inputs()
    kern = _compile(specials, dict(a=a, b=b, C=C), cache, config={"cluster": (1, 2)})
    before = snapshot(a, b, C)
    got = kern(a, b, C=C)
    unchanged(before, (a, b, C), "specials")
    _check_meta(got, specials, a, b, "specials", C=C)
    y = acc64(a, b) * d64(C)
    fin = torch.where(torch.isfinite(y), y, torch.zeros_like(y))
    want = (y.amax(-1), y.amin(-2), y.sum(-1), y.amax(), y.sum(-2), y.amin((-2, -1), keepdim=True),
            y.amin(-1), y.amax(-2))
    tols = [1e-3 * fin.abs().amax(-1), 1e-3 * fin.abs().amax(-2), sum_tol(fin, -1), None, sum_tol(fin, -2),
            None, 1e-3 * fin.abs().amax(-1), 1e-3 * fin.abs().amax(-2)]
    for i, (g, w, t) in enumerate(zip(got, want, tols, strict=True)):
        close(g, w, f"specials output {i}", abs_tol=t)


@pytest.mark.gpu
def test_amax_of_a_row_of_negative_zeros_is_negative_zero(cache):
    """torch.amax / amin over values that are all -0.0 give -0.0 (the only value present): no +0.0
    that is not an element of the row (a zeroed padding element, a +0.0 initial value) may enter
    the maximum."""
    a, b, C = _special_inputs()
    kern = _compile(specials, dict(a=a, b=b, C=C), cache, config={"cluster": (1, 2)})
    got = kern(a, b, C=C)
    row_max, row_min = got[0][2], got[6][2]
    assert row_max.item() == 0 and row_min.item() == 0
    assert torch.signbit(row_min).item(), "amin(-1) of a row of -0.0 is +0.0; torch gives -0.0"
    assert torch.signbit(row_max).item(), "amax(-1) of a row of -0.0 is +0.0; torch gives -0.0"


# ---------------------------------------------------------------------------------------------------
# 3. batched a / b: per row, per column, per batch, everything, keepdim shapes, a (1, M, K) a
#    broadcast against a batch of b (expanded), split-K of a batched problem

def bat(acc, bias):
    y = acc + bias
    return (y.sum(-1), y.amax(-2, keepdim=True), y.float().sum((-2, -1)), y.amin(),
            y.mean((-1, -2), keepdim=True), y.amax(dim=(0, 1, 2), keepdim=True), y.float().mean(-2),
            y.amin(-1, keepdim=True))


def _bat_ref(y):
    return (y.sum(-1), y.amax(-2, keepdim=True), y.sum((-2, -1)), y.amin(),
            y.mean((-1, -2), keepdim=True), y.amax(dim=(0, 1, 2), keepdim=True), y.mean(-2),
            y.amin(-1, keepdim=True))


def _check_bat(got, a, b, bias, what):
    _check_meta(got, bat, a, b, what, bias=bias)
    y = acc64(a, b) + d64(bias)
    mx = 2e-4 * y.abs().amax() + 0 * y.sum()
    tols = [sum_tol(y, -1), mx, sum_tol(y, (-2, -1)), mx,
            sum_tol(y, (-1, -2), True) / (y.shape[-1] * y.shape[-2]), mx,
            sum_tol(y, -2) / y.shape[-2], mx]
    for i, (g, w, t) in enumerate(zip(got, _bat_ref(y), tols, strict=True)):
        close(g, w, f"{what} output {i}", abs_tol=t)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(3, 130, 72, 64), (1, 5, 200, 64), (4, 1, 8, 64), (2, 300, 264, 128)],
                         ids=lambda s: "x".join(map(str, s)))
def test_batched_reductions_every_axis_and_keepdim(cache, shape):
    L, m, n, k = shape
    ex = dict(a=randn(2, 64, 64), b=randn(2, 64, 96), bias=randn(2, 1, 96))
    kern = _compile(bat, ex, cache)
    a, b, bias = randn(L, m, k, scale=0.25), randn(L, k, n, scale=0.25), randn(L, 1, n)
    before = snapshot(a, b, bias)
    got = kern(a, b, bias=bias)
    unchanged(before, (a, b, bias), "bat")
    _check_bat(got, a, b, bias, f"bat {shape}")


@pytest.mark.gpu
def test_batched_reductions_with_a_of_batch_one_beside_b_of_three(cache):
    ex = dict(a=randn(2, 64, 64), b=randn(2, 64, 96), bias=randn(2, 1, 96))
    kern = _compile(bat, ex, cache)
    a, b, bias = randn(1, 70, 64, scale=0.25), randn(3, 64, 40, scale=0.25), randn(3, 1, 40)
    got = kern(a, b, bias=bias)
    _check_bat(got, a, b, bias, "bat a of batch 1")


@pytest.mark.gpu
def test_batched_reductions_split_k(cache):
    ex = dict(a=randn(2, 64, 64), b=randn(2, 64, 96), bias=randn(2, 1, 96))
    kern = _compile(bat, ex, cache, config={"split_k": True})
    kern.pin_splits(3)
    try:
        a, b, bias = randn(3, 70, 1000, scale=0.1), randn(3, 1000, 136, scale=0.1), randn(3, 1, 136)
        got = kern(a, b, bias=bias)
    finally:
        kern.pin_splits(None)
    _check_bat(got, a, b, bias, "bat split 3")


# ---------------------------------------------------------------------------------------------------
# 4. gated epilogues: a mean over the half width divides by N/2, columns of the half

def glu(acc):
    gate, up = acc.chunk(2, dim=-1)
    h = F.silu(gate) * up
    return h, h.pow(2).mean(-1), h.amax(-2), h.abs().amax(), h.float().sum(-1, keepdim=True), h.amin()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(100, 400, 128), (3, 200, 64), (257, 528, 64)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gated_reductions_over_the_half_width(cache, shape):
    m, n, k = shape
    kern = _compile(glu, dict(a=randn(64, 64), b=kmajor_b(64, 256)), cache)
    a, b = randn(m, k, scale=0.3), kmajor_b(k, n, scale=0.3)
    got = kern(a, b)
    _check_meta(got, glu, a, b, f"glu {shape}")
    acc = acc64(a, b)
    gate, up = acc.chunk(2, dim=-1)
    h = F.silu(gate) * up
    mx = 1e-3 * h.abs().amax()
    want = (h, h.pow(2).mean(-1), h.amax(-2), h.abs().amax(), h.sum(-1, keepdim=True), h.amin())
    tols = [mx, sum_tol(h.pow(2), -1) / h.shape[-1], mx, mx, sum_tol(h, -1, True, rel=1e-3), mx]
    for i, (g, w, t) in enumerate(zip(got, want, tols, strict=True)):
        close(g, w, f"glu {shape} output {i}", abs_tol=t)


# ---------------------------------------------------------------------------------------------------
# 5. float8: a float8 output of a reduction (host finish), float8 a and b (reductions float32)

def f8red(acc, s: float):
    y = acc * s
    return y.to(E4M3), y.amax(-1).to(E4M3), y.abs().amax(), y.float().sum(-2).to(E5M2), y.amin(-2).to(E4M3)


@pytest.mark.gpu
def test_float8_outputs_of_reductions(cache):
    m, n, k = 136, 208, 64
    kern = _compile(f8red, dict(a=randn(64, 64), b=randn(64, 96), s=1.0), cache)
    a, b = randn(m, k, scale=0.5), randn(k, n, scale=0.5)
    got = kern(a, b, s=3.0)
    _check_meta(got, f8red, a, b, "f8red", s=3.0)
    y = acc64(a, b) * 3.0
    want = (y.float().to(E4M3), y.amax(-1).float().to(E4M3), y.abs().amax(), y.sum(-2).float().to(E5M2),
            y.amin(-2).float().to(E4M3))
    # each float8 value within one float8 step of torch's rounding of the exact value
    for i in (0, 1, 3, 4):
        close(got[i].float(), want[i].float(), f"f8red output {i}", dtype=got[i].dtype,
              abs_tol=2.0 ** -9 if got[i].dtype == E4M3 else 2.0 ** -16)  # a subnormal step
    close(got[2], y.abs().amax(), "f8red abs amax", abs_tol=1e-3 * y.abs().amax())


def f8in(acc, sa: float):
    y = acc * sa
    return y.amax(-1), y.sum(), y.mean(-2, keepdim=True), y


@pytest.mark.gpu
def test_float8_inputs_reductions_are_float32(cache):
    m, n, k = 130, 200, 128
    a = randn(m, k).to(E4M3)
    b = randn(n, k).to(E4M3).t()
    kern = _compile(f8in, dict(a=randn(64, 128).to(E4M3), b=randn(96, 128).to(E4M3).t(), sa=1.0), cache)
    got = kern(a, b, sa=0.5)
    assert [g.dtype for g in got] == [F32, F32, F32, BF16], [g.dtype for g in got]
    assert [tuple(g.shape) for g in got] == [(m,), (), (1, n), (m, n)]
    y = acc64(a, b) * 0.5
    # float8 MMAs accumulate with fewer bits than float32: 1e-3 of the magnitudes
    close(got[0], y.amax(-1), "f8in amax", abs_tol=1e-3 * y.abs().amax())
    close(got[1], y.sum(), "f8in sum", abs_tol=sum_tol(y, None, rel=1e-3))
    close(got[2], y.mean(-2, keepdim=True), "f8in mean", abs_tol=sum_tol(y, -2, True, rel=1e-3) / m)
    close(got[3], y, "f8in y", abs_tol=1e-3 * y.abs().amax())


# ---------------------------------------------------------------------------------------------------
# 6. finishes that mix axes (host), chains of reductions and scalars (kernel)

def mixed(acc):
    return (acc.float().sum(-1, keepdim=True) + acc.float().sum(-2, keepdim=True),
            acc.mean() + acc.amax(-1), acc.float().sum(),
            acc.amax(-2, keepdim=True) - acc.amin(-1, keepdim=True))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(130, 200, 64), (1, 8, 64), (700, 72, 256)],
                         ids=lambda s: "x".join(map(str, s)))
def test_outputs_mixing_two_axes(cache, shape):
    m, n, k = shape
    kern = _compile(mixed, dict(a=randn(64, 64), b=randn(64, 96)), cache)
    a, b = randn(m, k, scale=0.25), randn(k, n, scale=0.25)
    got = kern(a, b)
    _check_meta(got, mixed, a, b, f"mixed {shape}")
    y = acc64(a, b)
    mx = 2e-4 * y.abs().amax()
    want = (y.sum(-1, keepdim=True) + y.sum(-2, keepdim=True), y.mean() + y.amax(-1), y.sum(),
            y.amax(-2, keepdim=True) - y.amin(-1, keepdim=True))
    tols = [sum_tol(y, -1, True) + sum_tol(y, -2, True), mx + sum_tol(y, None) / y.numel(), sum_tol(y, None),
            2 * mx]
    for i, (g, w, t) in enumerate(zip(got, want, tols, strict=True)):
        close(g, w, f"mixed {shape} output {i}", abs_tol=t)


def chain(acc, bias, eps: float):
    y = acc + bias
    return (torch.sqrt((y * y).mean(-1) + eps), 448.0 / y.abs().amax().clamp_min(1e-12),
            torch.rsqrt(y.float().pow(2).mean(-2, keepdim=True) + eps) * y.float().amax(-2, keepdim=True),
            y.amax(-1) - y.amin(-1), y.float().pow(2).mean(-1) - y.float().mean(-1) ** 2)


@pytest.mark.gpu
@pytest.mark.parametrize("eps", [1e-6, 100.0])
def test_chained_finishes_rms_scale_and_range(cache, eps):
    m, n, k = 150, 300, 128
    kern = _compile(chain, dict(a=randn(64, 128), b=kmajor_b(128, 96), bias=randn(96), eps=1e-5), cache)
    a, b, bias = randn(m, k, scale=0.2), kmajor_b(k, n, scale=0.2), randn(n)
    got = kern(a, b, bias=bias, eps=eps)
    _check_meta(got, chain, a, b, "chain", bias=bias, eps=eps)
    y = acc64(a, b) + d64(bias)
    ms_r, ms_c = (y * y).mean(-1), y.pow(2).mean(-2, keepdim=True)
    want = (torch.sqrt(ms_r + eps), 448.0 / y.abs().amax().clamp_min(1e-12),
            torch.rsqrt(ms_c + eps) * y.amax(-2, keepdim=True), y.amax(-1) - y.amin(-1),
            y.pow(2).mean(-1) - y.mean(-1) ** 2)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        close(g, w, f"chain eps={eps} output {i}", rtol=3e-3 if g.dtype == F16 else 1e-4,
              abs_tol=(1e-3 * y.abs().amax() if i == 3 else 1e-5 * ms_r if i == 4
                       else 2e-4 * y.abs().amax() * torch.rsqrt(ms_c + eps) if i == 2 else None))


# ---------------------------------------------------------------------------------------------------
# 7. reductions of operands only (no acc), of a broadcast-only (M, N) value, float16 products,
#    16-bit dtype= arguments

def conly(acc, C, bias, colv):
    return C.sum(-1), C.float().amax(-2), (bias + colv).sum(-1), (C * colv).mean(), (bias + colv).amin(-2)


@pytest.mark.gpu
def test_reductions_of_operands_without_acc(cache):
    m, n, k = 130, 200, 64
    ex = dict(a=randn(64, 64), b=randn(64, 96), C=randn(64, 96), bias=randn(96), colv=randn(64, 1))
    kern = _compile(conly, ex, cache)
    a, b, C, bias, colv = randn(m, k), randn(k, n), randn(m, n), randn(n), randn(m, 1)
    before = snapshot(a, b, C, bias, colv)
    got = kern(a, b, C=C, bias=bias, colv=colv)
    unchanged(before, (a, b, C, bias, colv), "conly")
    _check_meta(got, conly, a, b, "conly", C=C, bias=bias, colv=colv)
    C6, b6, c6 = d64(C), d64(bias), d64(colv)
    # torch rounds bias + colv to float16 before its sum; evtc sums float32: compare to the rounded
    bc = (b6 + c6).half().double()
    want = (C6.sum(-1), C6.amax(-2), bc.sum(-1), (C6 * c6).mean(), bc.amin(-2))
    tols = [sum_tol(C6, -1, rel=1e-5), None, sum_tol(bc, -1, rel=1e-3),
            sum_tol(C6 * c6, None, rel=1e-3) / C6.numel(), None]
    for i, (g, w, t) in enumerate(zip(got, want, tols, strict=True)):
        close(g, w, f"conly output {i}", abs_tol=t)


def halfprod(acc, C):
    p = acc.half() * C
    return (p.mean(-1), p.sum(-2, dtype=torch.float32), acc.sum(-1, dtype=torch.float16),
            acc.mean(-2, dtype=torch.bfloat16))


@pytest.mark.gpu
def test_mean_of_a_float16_product_and_16_bit_dtype_arguments(cache):
    m, n, k = 200, 136, 64
    ex = dict(a=randn(64, 64), b=randn(64, 96), C=randn(64, 96))
    kern = _compile(halfprod, ex, cache)
    a, b, C = randn(m, k, scale=0.3), randn(k, n, scale=0.3), randn(m, n)
    got = kern(a, b, C=C)
    _check_meta(got, halfprod, a, b, "halfprod", C=C)
    acc = acc64(a, b)
    p = (acc.half().double() * d64(C)).half().double()
    ah, ab = acc.half().double(), acc.to(BF16).double()
    want = (p.mean(-1), p.sum(-2), ah.sum(-1), ab.mean(-2))
    # an element rounded to 16 bits from evtc's float32 acc may sit one step from the exact value's
    tols = [2e-3 * p.abs().mean(-1), 2e-3 * p.abs().sum(-2), 2e-3 * ah.abs().sum(-1),
            8e-3 * ab.abs().mean(-2)]
    for i, (g, w, t) in enumerate(zip(got, want, tols, strict=True)):
        close(g, w, f"halfprod output {i}", abs_tol=t)


def dims(acc):
    return (acc.sum(dim=[1]), acc.amax((1, 0)), acc.mean(-2, True), acc.amin(dim=(-1,), keepdim=True),
            torch.sum(acc, (0,), keepdim=False, dtype=torch.float32),
            acc.float().sum(dim=[-1, -2], keepdim=True),
            torch.amax(acc, 0, True), acc.max(), acc.min())


@pytest.mark.gpu
def test_dims_as_lists_tuples_positive_and_negative(cache):
    m, n, k = 70, 136, 64
    kern = _compile(dims, dict(a=randn(64, 64), b=randn(64, 96)), cache)
    a, b = randn(m, k, scale=0.25), randn(k, n, scale=0.25)
    got = kern(a, b)
    _check_meta(got, dims, a, b, "dims")
    y = acc64(a, b)
    want = (y.sum(1), y.amax((1, 0)), y.mean(-2, True), y.amin(-1, keepdim=True), y.sum(0),
            y.sum((-1, -2), keepdim=True),
            y.amax(0, True), y.max(), y.min())
    mx = 2e-4 * y.abs().amax()
    tols = [sum_tol(y, 1), mx, sum_tol(y, -2, True) / m, mx, sum_tol(y, 0), sum_tol(y, None), mx, mx, mx]
    for i, (g, w, t) in enumerate(zip(got, want, tols, strict=True)):
        close(g, w, f"dims output {i}", abs_tol=t)


# ---------------------------------------------------------------------------------------------------
# 8. out= for reduction outputs (strided views, 0-d), kernel and host finish, reused twice

def without(acc, bias):
    y = acc + bias
    return y, y.amax(-1, keepdim=True), y.float().sum(), y.mean(-2)


def _out_buffers(m, n):
    D = torch.full((m, n), float("nan"), device="cuda", dtype=F16)
    rmax = torch.full((m, 3), float("nan"), device="cuda", dtype=F16)[:, 1:2]
    total = torch.full((), float("nan"), device="cuda", dtype=F32)
    cmean = torch.full((2 * n,), float("nan"), device="cuda", dtype=F16)[::2]
    return (D, rmax, total, cmean)


@pytest.mark.gpu
@pytest.mark.parametrize("finish", ["kernel", "host"])
def test_out_for_reduction_outputs(cache, monkeypatch, finish):
    if finish == "host":
        import evtc.runtime.reductions as red
        monkeypatch.setattr(red, "KERNEL_FINISH_MAX_OUTPUT", 0)
    m, n, k = 150, 200, 64
    kern = _compile(without, dict(a=randn(64, 64), b=randn(64, 96), bias=randn(96)), cache)
    out = _out_buffers(m, n)
    for trial in range(2):
        a, b, bias = randn(m, k, scale=0.25), randn(k, n, scale=0.25), randn(n)
        res = kern(a, b, bias=bias, out=out)
        for r, o in zip(res, out, strict=True):
            assert r.data_ptr() == o.data_ptr() and r.shape == o.shape, "out= not returned"
        y = acc64(a, b) + d64(bias)
        mx = 2e-4 * y.abs().amax()
        close(out[0], y, f"{finish} out y #{trial}", abs_tol=mx)
        close(out[1], y.amax(-1, keepdim=True), f"{finish} out amax #{trial}", abs_tol=mx)
        close(out[2], y.sum(), f"{finish} out sum #{trial}", abs_tol=sum_tol(y, None))
        close(out[3], y.mean(-2), f"{finish} out mean #{trial}", abs_tol=sum_tol(y, -2) / m)
    # the untouched neighbours of the strided views
    assert out[1]._base[:, 0].isnan().all() and out[1]._base[:, 2].isnan().all(), "out= wrote past its view"
    assert out[3]._base[1::2].isnan().all(), "out= wrote past its view"


# ---------------------------------------------------------------------------------------------------
# 9. many tiles: accuracy and determinism at the kernel-finish limit (16M outputs) and past it

def big(acc):
    return acc.float().sum(-2), acc.float().mean(-1), acc.amax(), acc.float().sum(), acc.amin(-2)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2048, 2056], ids=["kernel_finish_16M", "host_finish"])
def test_many_tiles_deterministic_and_accurate(cache, n):
    m, k = 8192, 64
    kern = _compile(big, dict(a=randn(64, 64), b=randn(64, 96)), cache)
    a, b = randn(m, k, scale=0.25), randn(k, n, scale=0.25)
    got1 = kern(a, b)
    got2 = kern(a, b)
    small = kern(a[:100], b[:, :72])  # another size between: counters and buffers reused
    got3 = kern(a, b)
    for i, (x, y, z) in enumerate(zip(got1, got2, got3, strict=True)):
        assert same_bits(x, y) and same_bits(x, z), f"output {i} differs between runs"
    y = acc64(a, b)
    want = (y.sum(-2), y.mean(-1), y.amax(), y.sum(), y.amin(-2))
    mx = 2e-4 * y.abs().amax()
    tols = [sum_tol(y, -2, rel=1e-5), sum_tol(y, -1, rel=1e-5) / n, mx, sum_tol(y, None, rel=1e-5), mx]
    for i, (g, w, t) in enumerate(zip(got1, want, tols, strict=True)):
        close(g, w, f"big n={n} output {i}", abs_tol=t)
    ys = acc64(a[:100], b[:, :72])
    close(small[0], ys.sum(-2), "small between", abs_tol=sum_tol(ys, -2, rel=1e-5))


# ---------------------------------------------------------------------------------------------------
# 10. exact arithmetic: integer-valued a and b make acc, its row/column/total sums and mask counts
#     exact in float32, so any padding element (or garbage row past M / past a_rows) that enters a
#     sum or a count shows as a difference. (acc >= 0) is True on a zeroed padding element.

def exact(acc):
    y = acc.float()
    return ((acc >= 0).float().sum(-1), (acc >= 0).float().sum(-2), (acc <= 0).float().mean(), y.sum(-1),
            y.sum(-2),
            y.sum(), torch.where(acc > 0, 1.0, 0.0).sum(-2), y.abs().sum((-2, -1), keepdim=True))


def _ints(*shape, lo=-3, hi=4):
    return torch.randint(lo, hi, shape, device="cuda").to(F16)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 9, 64), (5, 520, 4096), (33, 4100, 4096), (100, 4600, 4096),
                                   (120, 4600, 4096), (512, 4600, 4096), (130, 200, 64), (64, 1000, 8192)],
                         ids=lambda s: "x".join(map(str, s)))
def test_exact_counts_and_sums_at_launch_shapes(cache, shape):
    m, n, k = shape
    kern = _compile(exact, dict(a=_ints(64, 64), b=_ints(96, 64).t()), cache)
    a, b = _ints(m, k), _ints(n, k).t()
    a[0] = 0  # a row of exact zeros: acc >= 0 everywhere in it
    got = kern(a, b)
    _check_meta(got, exact, a, b, f"exact {shape}")
    y = acc64(a, b)
    want = ((y >= 0).double().sum(-1), (y >= 0).double().sum(-2), (y <= 0).double().mean(), y.sum(-1),
            y.sum(-2),
            y.sum(), (y > 0).double().sum(-2), y.abs().sum((-2, -1), keepdim=True))
    what = f"exact {shape} ({kern.launch_for(m, n, k)[0].short_name()}, splits {kern.launch_for(m, n, k)[1]})"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        # all exact in float32 (integers below 2^24) but the mean (one rounding of count / MN) and
        # the sum of |acc| over everything (past 2^24 at the larger shapes)
        close(g, w, f"{what} output {i}", rtol=2e-7 if i == 2 else 1e-5 if i == 7 else 0.0)


# ---------------------------------------------------------------------------------------------------
# 11. out_dtypes overriding reduction outputs; a batched gated epilogue's reductions

def overridden(acc):
    return acc, acc.sum(-1), acc.amax(), acc.mean(-2)


@pytest.mark.gpu
def test_out_dtypes_override_reduction_outputs(cache):
    m, n, k = 130, 200, 64
    kern = _compile(overridden, dict(a=randn(64, 64), b=randn(64, 96)), cache,
                    out_dtypes={"D1": F32, "D2": BF16, "D3": F32})
    a, b = randn(m, k, scale=0.25), randn(k, n, scale=0.25)
    got = kern(a, b)
    assert [g.dtype for g in got] == [F16, F32, BF16, F32]
    y = acc64(a, b)
    close(got[0], y, "override y", abs_tol=2e-4 * y.abs().amax())
    close(got[1], y.sum(-1), "override sum f32", abs_tol=sum_tol(y, -1, rel=1e-5))
    close(got[2], y.amax(), "override amax bf16")
    close(got[3], y.mean(-2), "override mean f32", abs_tol=sum_tol(y, -2, rel=1e-5) / m)


def glu_batched(acc):
    gate, up = acc.chunk(2, dim=-1)
    h = F.silu(gate) * up
    return h.sum(-2), h.amax((-2, -1)), h.float().mean(-1), h.float().sum()


@pytest.mark.gpu
def test_batched_gated_reductions(cache):
    kern = _compile(glu_batched, dict(a=randn(2, 64, 64), b=kmajor_b(64, 128, batch=2)), cache)
    L, m, n, k = 3, 130, 272, 64
    a, b = randn(L, m, k, scale=0.3), kmajor_b(k, n, batch=L, scale=0.3)
    got = kern(a, b)
    _check_meta(got, glu_batched, a, b, "glu batched")
    acc = acc64(a, b)
    gate, up = acc.chunk(2, dim=-1)
    h = F.silu(gate) * up
    want = (h.sum(-2), h.amax((-2, -1)), h.mean(-1), h.sum())
    tols = [sum_tol(h, -2), 1e-3 * h.abs().amax(), sum_tol(h, -1, rel=1e-5) / h.shape[-1],
            sum_tol(h, None, rel=1e-5)]
    for i, (g, w, t) in enumerate(zip(got, want, tols, strict=True)):
        close(g, w, f"glu batched output {i}", abs_tol=t)
