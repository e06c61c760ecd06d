"""The kernel's elementwise math against CUDA torch on the same float32 values, at the extremes
(large |x|, +-inf, NaN, -0.0, denormals, ties): rounding and NaN rules, activations, powers, and a
number raised to a 16-bit power. One kernel per test, many ops per kernel (a dict of outputs). Every
output is float32 (explicit casts), so the comparison sees the op, not the output's rounding.
Exceptions the docs state are left out: signs of zeros of maximum/minimum/relu/clamp, FMA
contraction, sigmoid/silu flushing results below ~1e-35. First written as an adversarial probe of
the epilogue's semantics."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import evtc

M, N, K = 64, 128, 64
PINNED = {"cluster": (1, 2)}

SPECIAL = [0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 1.5, 2.5, -2.5, 3.0, -3.0, 0.49999997, -0.49999997,
           1e-40, -1e-40, 1e-30, 20.0, -20.0, 30.0, -30.0, 88.0, -88.0, 89.0, -89.0, 100.0, -100.0,
           1e20, -1e20, 3e38, -3e38, math.inf, -math.inf, math.nan, 7.0, -7.0, 1e-8, -1e-8, 4.5, -4.5,
           8388609.0, -8388609.5, 1e7 + 0.5, 12.5, -12.5, 0.3, -0.3, 2.0, -2.0, 60.0, 1e-3, -1e-3]


def _C(device="cuda"):
    g = torch.Generator().manual_seed(0)
    t = torch.randn(M, N, generator=g) * 4.0
    flat = t.view(-1)
    flat[:len(SPECIAL)] = torch.tensor(SPECIAL)
    # a second copy of the specials, scaled, further in
    flat[1000:1000 + len(SPECIAL)] = torch.tensor(SPECIAL) * 0.5
    return t.to(device=device)


def _ab(device="cuda"):
    g = torch.Generator().manual_seed(1)
    a = (torch.randn(M, K, generator=g) * 0.1).half().to(device=device)
    b = (torch.randn(K, N, generator=g) * 0.1).half().to(device=device)
    return a, b


def _compare(got: torch.Tensor, want: torch.Tensor, what: str, *, exact=False, signed_zero=False,
             rtol=2e-6, atol=0.0):
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype,
                                                                  want.dtype)
    g, w = got.double().cpu(), want.double().cpu()
    nan_g, nan_w = g.isnan(), w.isnan()
    where = (nan_g ^ nan_w).nonzero()[:4].tolist()
    assert torch.equal(nan_g, nan_w), (f"{what}: NaN differs at {where}: "
                                       f"got {[g[tuple(i)].item() for i in where]} "
                                       f"want {[w[tuple(i)].item() for i in where]}")
    g, w = g[~nan_w], w[~nan_w]
    inf = w.isinf() | g.isinf()
    bad = inf & (g != w)
    assert not bad.any(), f"{what}: infinities differ: got {g[bad][:4].tolist()} want {w[bad][:4].tolist()}"
    if exact:
        bad = g != w
    else:
        bad = ~inf & ((g - w).abs() > atol + rtol * w.abs())
    assert not bad.any(), f"{what}: got {g[bad][:4].tolist()} want {w[bad][:4].tolist()}"
    if signed_zero:
        zero = w == 0
        assert torch.equal(g[zero].signbit(), w[zero].signbit()), f"{what}: sign of zero differs"


def _run(fn, cache, **ops):
    a, b = _ab()
    kern = evtc.compile(fn, dict(a=a, b=b, **ops), cache_dir=cache, config=PINNED)
    got = kern(a, b, **ops)
    acc = torch.matmul(a.float(), b.float())  # evtc's acc is float32; these outputs ignore most of it
    want = fn(acc, **ops)
    return got, want


def integer_valued(acc, C):
    x = C + acc * 0.0  # (acc * 0.0 is +-0; keeps acc in the kernel)
    return {"round": torch.round(C), "floor": torch.floor(C), "ceil": torch.ceil(C), "trunc": torch.trunc(C),
            "frac": torch.frac(C), "sign": torch.sign(C), "round_x": torch.round(x),
            "nan_to_num": torch.nan_to_num(C),
            "nan_to_num_args": torch.nan_to_num(C, nan=1.0, posinf=2.0, neginf=-2.0),
            "isnan_etc": torch.isnan(C).float() + 2 * torch.isinf(C) + 4 * torch.isposinf(C),
            "where_scalars": torch.where(C > 0, 1.0, -1.0), "heaviside": torch.heaviside(C, C * 0.0 + 0.5),
            "maximum": torch.maximum(C, C * 0.5), "max2": torch.max(C, -C),
            "fmax": torch.fmax(C, torch.nan_to_num(C, nan=3.0) * 0.5),
            "clamp_rev": torch.clamp(C, 1.0, -1.0), "hardtanh": F.hardtanh(C, -2.0, 2.0)}


@pytest.mark.gpu
def test_integer_valued_and_nan_rules(cache):
    """Exact results: round half to even (torch.round), floor/ceil/trunc/frac, sign (0 for NaN),
    nan_to_num (float32 max), NaN propagation of maximum / torch.max(a, b), fmax ignoring NaN,
    clamp with min > max (max wins)."""
    C = _C()
    got, want = _run(integer_valued, cache, C=C)
    for key in want:
        _compare(got[key], want[key], key, exact=True,
                 signed_zero=key in ("round", "floor", "ceil", "trunc"))


def activations_a(acc, C):
    x = C
    return {"sigmoid": torch.sigmoid(x), "tanh": torch.tanh(x), "erf": torch.erf(x), "gelu": F.gelu(x),
            "gelu_tanh": F.gelu(x, approximate="tanh"), "silu": F.silu(x), "softplus": F.softplus(x),
            "softplus_b2": F.softplus(x, beta=2.0, threshold=5.0), "softplus_bneg": F.softplus(x, beta=-1.0),
            "hardswish": F.hardswish(x), "hardsigmoid": F.hardsigmoid(x), "leaky": F.leaky_relu(x, 0.1),
            "elu": F.elu(x, 0.7), "mish": F.mish(x)}


def activations_b(acc, C):
    x = C
    return {"log1p": torch.log1p(x), "expm1": torch.expm1(x),
            "rsqrt": torch.rsqrt(x), "sqrt": torch.sqrt(x), "exp": torch.exp(x), "log": torch.log(x),
            "selu": F.selu(x), "celu": F.celu(x, 0.5), "logsigmoid": F.logsigmoid(x),
            "softsign": F.softsign(x),
            "reciprocal": torch.reciprocal(x), "exp2": torch.exp2(x), "log2": torch.log2(x)}


@pytest.mark.gpu
@pytest.mark.parametrize("group", ["a", "b"])
def test_activations_at_extremes(cache, group):
    """Each activation against CUDA torch at +-inf, NaN, -0.0, denormals and the overflow edges:
    NaN and infinities exact, finite values within a few float32 ulps (atol 1e-35 for the documented
    flush of sigmoid/silu results below ~1e-35). rsqrt(1e-40) is 1e20 in torch: a flush-to-zero
    rsqrt would give inf."""
    C = _C()
    got, want = _run(activations_a if group == "a" else activations_b, cache, C=C)
    # Cancellation in 1 + erf / 1 + tanh below x ~ -3 (documented for gelu: < 1e-7 absolutely) and the
    # kernel's FMA contraction move those results by more than ulps of themselves: an absolute bound.
    cancelling = {"gelu": 2e-7, "gelu_tanh": 1e-6, "mish": 1e-6}
    for key in want:
        _compare(got[key], want[key], key, rtol=8e-7 * 8, atol=cancelling.get(key, 1e-35))


def powers(acc, C):
    x = C
    r = C.round()
    return {"sq": x ** 2, "cube": x ** 3, "inv": x ** -1, "half": x ** 0.5, "mhalf": x ** -0.5,
            "m2": x ** -2, "m3": x ** -3.0, "p15": x ** 1.5, "p0": x ** 0, "neg_base_int": (-2.0) ** r,
            "neg_base_frac": (-2.0) ** x, "two_to": 2.0 ** x, "ten_to": 10.0 ** r, "zero_to": 0.0 ** x,
            "one_to": 1.0 ** x, "tile_tile": x ** r}


@pytest.mark.gpu
def test_powers_with_negative_bases_zeros_and_infinities(cache):
    """torch's pow: (-2) ** 3 = -8, (-2) ** 1.5 NaN, (-0.0) ** -1 = -inf, (-0.0) ** -3 = -inf, 0 ** 0 = 1,
    x ** 0 = 1 for NaN x, 1 ** x = 1 for NaN x; within float32 ulps elsewhere. Documented exceptions
    (runtime exponents, 0.5 / -0.5 at -0.0 and -inf) do not apply: these exponents are literals."""
    C = _C()
    got, want = _run(powers, cache, C=C)
    for key in want:
        # x ** -2 and x ** 3: torch computes 1 / (x * x) and x * x * x; a denormal result may differ
        _compare(got[key], want[key], key, rtol=8e-7 * 4, atol=2e-38)


def number_base_16bit(acc, C, alpha: float):
    h = C.half()
    bf = C.bfloat16()
    return {"lit_h": (1.1 ** h).float(), "lit_bf": (1.1 ** bf).float(), "arg_h": (alpha ** h).float(),
            "e_h": (math.e ** h).float(), "h_exp": (h.abs() ** 1.1).float(),
            "bf_exp": (bf.abs() ** 0.3).float(),
            "h_arg_exp": (h.abs() ** alpha).float()}


@pytest.mark.gpu
def test_number_base_to_a_16bit_power(cache):
    """CUDA torch's pow(Scalar, Tensor) converts the base to the tensor's dtype (pow_scalar_tensor_impl
    takes a scalar_t base): 1.1 ** h is pow(1.0996, h). At h = 60 that is 298 in float16, where
    pow(1.1, 60) is 304.5. Compared within one 16-bit ulp."""
    C = _C().clamp(-60.0, 60.0).nan_to_num(0.0)
    got, want = _run(number_base_16bit, cache, C=C, alpha=1.1)
    for key in want:
        _compare(got[key], want[key], key, rtol=8e-3 if "bf" in key else 1e-3, atol=1e-6)
