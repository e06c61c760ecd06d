"""Edge cases of the forward call (first written as an adversarial probe): gated (chunk)
epilogues, float8 and tf32 inputs, and a set of documented ops
(pow, clamp with tensor bounds, casts, sizes in arithmetic), against a float64 reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from edges_util import BF16, F32, PINNED, check, close, randn, ref64, snapshot, unchanged

import evtc

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def swiglu_res(acc, bias, resid):
    gate, up = (acc + bias).chunk(2, dim=-1)
    return F.silu(gate) * up + resid


@pytest.mark.gpu
def test_gated_with_full_width_bias_and_half_width_residual(cache):
    """SwiGLU with a 2N bias and an N/2 residual at odd M and halves not multiples of 8 (staged)
    and of 8 (kernel), with a K-major weight; values as torch; inputs unchanged."""
    kern = evtc.compile(swiglu_res, dict(a=randn(64, 64), b=randn(128, 64).t(), bias=randn(128),
                                         resid=randn(64, 64)), cache_dir=cache, config=PINNED)
    for (m, n2, k) in ((1, 256, 64), (77, 2 * 200, 96), (130, 2 * 36, 40), (65, 2 * 13, 64)):
        a, w = randn(m, k), randn(n2, k)
        bias, resid = randn(n2), randn(m, n2 // 2)
        before = snapshot(a, w, bias, resid)
        check(kern(a, w.t(), bias=bias, resid=resid), swiglu_res, a, w.t(), bias=bias, resid=resid,
              what=f"{m}x{n2}x{k}")
        unchanged(before, (a, w, bias, resid))


@pytest.mark.gpu
def test_gated_geglu_batched_with_reduction_and_row_major_b(cache):
    """GeGLU on batched inputs with a row-major b, returning the gated value and its per-row sum of
    squares (a reduction of a half-width value)."""

    def geglu(acc):
        g, u = torch.chunk(acc, 2, -1)
        y = F.gelu(g) * u
        return y, (y.float() ** 2).sum(-1)

    kern = evtc.compile(geglu, dict(a=randn(2, 64, 64), b=randn(2, 64, 128)), cache_dir=cache, config=PINNED)
    for (L, m, n2, k) in ((2, 100, 256, 64), (3, 17, 2 * 72, 32)):
        a, b = randn(L, m, k), randn(L, k, n2)
        check(kern(a, b), geglu, a, b, what=f"L={L} {m}x{n2}x{k}")


@pytest.mark.gpu
def test_gated_with_split_spelled_and_size_arithmetic(cache):
    """`acc.split(N // 2, -1)` and `gate.shape[-1]` in arithmetic (N/2, symbolic): one kernel over
    two widths gives the value for each width."""

    def f(acc):
        n = acc.shape[-1]
        g, u = acc.split(n // 2, -1)
        return torch.sigmoid(g) * u / g.shape[-1] ** 0.5

    kern = evtc.compile(f, dict(a=randn(64, 64), b=randn(64, 128)), cache_dir=cache, config=PINNED)
    for n2 in (128, 512):
        a, b = randn(96, 64), randn(64, n2)
        check(kern(a, b), f, a, b, what=f"N={n2}")


@pytest.mark.gpu
def test_float8_mixed_rowwise_scales_and_fp8_output_with_amax(cache):
    """e4m3 a with e5m2 b (K-major), rowwise scales (M, 1) and (N,), a bf16 bias; outputs: an e4m3
    tensor (saturating), the amax in float32; compared with the float64 function of the fp8 values."""

    def f(acc, sa, sb, bias, s_out):
        y = F.gelu(acc * sa * sb + bias)
        return (y * s_out).to(torch.float8_e4m3fn), y.abs().amax()

    m, n, k = 136, 272, 256
    x = randn(m, k, dtype=F32).to(E4M3)
    w = (randn(n, k, dtype=F32) * 2).to(E5M2)
    sa, sb = torch.rand(m, 1, device="cuda") + 0.5, torch.rand(n, device="cuda") + 0.5
    bias, s_out = randn(n, dtype=BF16), torch.tensor(40.0, device="cuda")
    kern = evtc.compile(f, dict(a=x, b=w.t(), sa=sa, sb=sb, bias=bias, s_out=s_out), cache_dir=cache,
                        config=PINNED)
    q, amax = kern(x, w.t(), sa=sa, sb=sb, bias=bias, s_out=s_out)
    assert q.dtype == E4M3 and amax.dtype == F32 and amax.shape == ()
    def pre(acc, sa, sb, bias, s_out):  # f before its cast: torch 2.11's eager cast gives NaN past 464
        y = F.gelu(acc * sa * sb + bias)
        return y * s_out, y.abs().amax()

    want_pre, want_amax = ref64(pre, x, w.t(), sa=sa, sb=sb, bias=bias, s_out=s_out)
    want_q = want_pre.clamp(-448, 448).to(E4M3)  # e4m3fn saturates (docs/epilogues.md)
    close(q.float(), want_q.float(), E4M3, "fp8 out", mismatch=1e-3)
    assert q.float().abs().max().item() <= 448
    close(amax, want_amax, BF16, "amax")


@pytest.mark.gpu
def test_float8_default_bf16_output_and_tensorwise_0d_scales(cache):
    """e4m3 a and b with 0-dim device scales; a full tile output without a cast is bfloat16 (docs);
    a call with (1,)-shaped scales for 0-dim ones works (documented broadcast)."""

    def f(acc, sa, sb):
        return acc * sa * sb

    m, n, k = 64, 128, 128
    x, w = randn(m, k, dtype=F32).to(E4M3), randn(n, k, dtype=F32).to(E4M3)
    sa, sb = torch.tensor(0.5, device="cuda"), torch.tensor(2.0, device="cuda")
    kern = evtc.compile(f, dict(a=x, b=w.t(), sa=sa, sb=sb), cache_dir=cache, config=PINNED)
    got = kern(x, w.t(), sa=sa, sb=sb)
    assert got.dtype == BF16
    close(got, ref64(f, x, w.t(), sa=sa, sb=sb), BF16, "bf16 out")
    got = kern(x, w.t(), sa=sa.reshape(1), sb=sb.reshape(1, 1))
    close(got, ref64(f, x, w.t(), sa=sa, sb=sb), BF16, "(1,) scales")


@pytest.mark.gpu
def test_tf32_kernel_and_the_setting_read_per_call(cache):
    """float32 K-major a and b: with allow_tf32 on the kernel (tf32 precision), off the torch path
    (float32 precision): each within its precision of the float64 reference."""

    def f(acc, bias):
        return acc + bias

    m, n, k = 128, 256, 512
    a, w, bias = randn(m, k, dtype=F32), randn(n, k, dtype=F32), randn(n, dtype=F32)
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        kern = evtc.compile(f, dict(a=a, b=w.t(), bias=bias), cache_dir=cache, config=PINNED)
        got = kern(a, w.t(), bias=bias)
        assert got.dtype == F32
        close(got, ref64(f, a, w.t(), bias=bias), BF16, "tf32")  # tf32 ~ 10 mantissa bits
        torch.backends.cuda.matmul.allow_tf32 = False
        got = kern(a, w.t(), bias=bias)
        assert kern.last_path == "torch"
        close(got, ref64(f, a, w.t(), bias=bias), F32, "fp32 torch path", atol_rel=1e-5)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.gpu
def test_many_documented_ops_in_one_epilogue(cache):
    """pow (number and runtime exponent), clamp with tensor bounds, c ** x, rsqrt, log1p, hardswish,
    softplus(beta, threshold), leaky_relu with a runtime slope, nan_to_num, addcmul, lerp, a mid cast
    to bfloat16: values as the float64 function (casts rounded there too)."""

    def f(acc, lo, hi, C, p: float, slope: float):
        x = acc * 0.25
        y = torch.clamp(x, min=lo, max=hi) ** 2 + x.abs() ** p
        y = y + 2.0 ** x.clamp_max(4.0) + torch.rsqrt(x * x + 1.0) + torch.log1p(x.abs())
        y = y + F.hardswish(x) + F.softplus(x, beta=2.0, threshold=5.0) + F.leaky_relu(x, slope)
        y = torch.addcmul(y, C, x, value=0.5) + torch.lerp(x, C, 0.3)
        z = torch.nan_to_num(y.to(torch.bfloat16) * 3, posinf=1.0)
        return z, y

    m, n, k = 160, 144, 48
    a, b, C = randn(m, k), randn(k, n), randn(m, n)
    lo, hi = -randn(n, dtype=F32).abs(), randn(m, 1, dtype=F32).abs()
    kern = evtc.compile(f, dict(a=a, b=b, lo=lo, hi=hi, C=C, p=1.5, slope=0.1), cache_dir=cache,
                        config=PINNED)
    for p, slope in ((1.5, 0.1), (0.5, -0.3), (3.0, 0.0)):
        got = kern(a, b, lo=lo, hi=hi, C=C, p=p, slope=slope)
        check(got, f, a, b, lo=lo, hi=hi, C=C, p=p, slope=slope, what=f"p={p} slope={slope}", mismatch=1e-3)


@pytest.mark.gpu
def test_explicit_casts_and_dtype_of_operand(cache):
    """`.to(C.dtype)` with a bf16 C and f16 a/b, `.type_as`, `.float()` outputs: dtypes as torch,
    values rounded where cast."""

    def f(acc, C, s):
        y = (acc * s + C).to(C.dtype)
        return y, (acc.float() * 2).type_as(C), acc.half().float() - acc

    m, n, k = 64, 64, 64
    a, b, C, s = randn(m, k), randn(k, n), randn(m, n, dtype=BF16), randn(m, 1, dtype=F32)
    kern = evtc.compile(f, dict(a=a, b=b, C=C, s=s), cache_dir=cache, config=PINNED)
    got = kern(a, b, C=C, s=s)
    assert [g.dtype for g in got] == [BF16, BF16, F32], [g.dtype for g in got]
    want = ref64(f, a, b, C=C, s=s)
    close(got[0], want[0], BF16, "cast to C.dtype")
    close(got[1], want[1], BF16, "type_as")
    # acc.half().float() - acc: f16 rounding error of acc; just bounded by an f16 ulp of acc
    acc = (a.double() @ b.double())
    assert (got[2].double() - 0).abs().le(acc.abs() * 2 ** -10 + 1e-6).all()
