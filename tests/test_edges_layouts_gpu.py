"""Edge cases of the forward call (first written as an adversarial probe): awkward layouts of a,
b and the operands, against a float64 reference.

Each test compiles its own kernel(s) (so xdist spreads the compiles) and checks values, output
dtypes/shapes against torch, and that the inputs are unchanged after the call.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from edges_util import BF16, F16, F32, PINNED, check, randn, snapshot, unchanged

import evtc


def residual(acc, C, bias, alpha: float):
    return torch.relu(alpha * acc + bias) + C


@pytest.mark.gpu
def test_every_major_of_a_and_b_on_one_kernel(cache):
    """docs/compile.md "Call paths": a kernel compiled K-major/N-major takes a and b of any major
    (transposed views staged) and gives torch's values; inputs unchanged."""
    m, n, k = 200, 264, 136
    kern = evtc.compile(residual, dict(a=randn(64, 64), b=randn(64, 64), C=randn(64, 64),
                                       bias=randn(64, dtype=F32), alpha=1.0), cache_dir=cache, config=PINNED)
    a0, b0 = randn(m, k), randn(k, n)
    C, bias = randn(m, n), randn(n, dtype=F32)
    for am in ("k", "m"):
        for bm in ("n", "k"):
            a = a0 if am == "k" else a0.t().contiguous().t()
            b = b0 if bm == "n" else b0.t().contiguous().t()
            before = snapshot(a, b, C, bias)
            got = kern(a, b, C=C, bias=bias, alpha=0.75)
            check(got, residual, a, b, C=C, bias=bias, alpha=0.75, what=f"a {am}-major b {bm}-major")
            unchanged(before, (a, b, C, bias), f"a {am} b {bm}")


@pytest.mark.gpu
def test_compiled_from_m_major_a_and_k_major_b_called_with_row_major(cache):
    """A kernel compiled from an M-major a (a.t() of a (K, M)) and a K-major b (w.t()) must give
    the right values when called with the other majors, and with its own."""
    m, n, k = 136, 200, 72
    ex_a = randn(64, 64).t()
    ex_b = randn(64, 64).t()
    def silu_bias(acc, bias):
        return F.silu(acc + bias)
    kern = evtc.compile(silu_bias, dict(a=ex_a, b=ex_b, bias=randn(64)), cache_dir=cache, config=PINNED)
    bias = randn(n)
    for a in (randn(k, m).t(), randn(m, k)):
        for b in (randn(n, k).t(), randn(k, n)):
            check(kern(a, b, bias=bias), silu_bias, a, b, bias=bias, what=f"a{a.stride()} b{b.stride()}")


@pytest.mark.gpu
def test_storage_offsets_and_sliced_views(cache):
    """Views with storage offsets (16-byte aligned and not), column slices, and row slices of wider
    buffers for a, b, C, bias give torch's values; nothing is written into the parents."""
    m, n, k = 130, 136, 96
    kern = evtc.compile(residual, dict(a=randn(64, 64), b=randn(64, 64), C=randn(64, 64),
                                       bias=randn(64, dtype=F32), alpha=1.0), cache_dir=cache, config=PINNED)
    A = randn(m + 3, k + 24)
    B = randn(k + 5, n + 16)
    Cbig = randn(m + 2, n + 9)
    biasbig = randn(n + 3, dtype=F32)
    before = snapshot(A, B, Cbig, biasbig)
    cases = {
        "aligned offsets": (A[1:1 + m, 8:8 + k], B[2:2 + k, 8:8 + n], Cbig[1:1 + m, 8:8 + n], biasbig[:n]),
        "odd offsets": (A[3:3 + m, 1:1 + k], B[5:5 + k, 3:3 + n], Cbig[2:2 + m, 1:1 + n], biasbig[3:3 + n]),
        "every other row": (A[:2 * 60:2, :k], B[:k, :n], Cbig[:2 * 60:2, :n], biasbig[1:1 + n]),
    }
    for name, (a, b, C, bias) in cases.items():
        got = kern(a, b, C=C, bias=bias, alpha=-1.25)
        check(got, residual, a, b, C=C, bias=bias, alpha=-1.25, what=name)
    unchanged(before, (A, B, Cbig, biasbig), "parents")


@pytest.mark.gpu
def test_stride_zero_operands_and_expanded_a(cache):
    """Stride-0 (expanded) tile, row and col operands, and an expanded a (every row the same):
    read as the values they show; their storage is untouched."""
    m, n, k = 192, 256, 64

    def f(acc, C, col, row):
        return acc * col + C - row

    kern = evtc.compile(f, dict(a=randn(64, 64), b=randn(64, 64), C=randn(64, 64), col=randn(64, 1),
                                row=randn(64)), cache_dir=cache, config=PINNED)
    b = randn(k, n)
    a = randn(1, k).expand(m, k)
    C = randn(m, 1).expand(m, n)
    col = randn(1, 1).expand(m, 1)
    row = randn(1).expand(n)
    before = snapshot(a, b, C, col, row)
    check(kern(a, b, C=C, col=col, row=row), f, a, b, C=C, col=col, row=row, what="expanded")
    unchanged(before, (a, b, C, col, row), "expanded")
    # An (N,) row compiled, given as (1, N); a col (M, 1) given as 2-d with a pitch.
    C2 = randn(m, n)
    row2 = randn(1, n)
    colp = randn(m, 4)[:, 1:2]
    check(kern(a.contiguous(), b, C=C2, col=colp, row=row2), f, a.contiguous(), b, C=C2, col=colp, row=row2,
          what="(1,N) row, pitched col")


@pytest.mark.gpu
def test_scalar_kinds_and_their_promotion(cache):
    """docs/epilogues.md "Outputs": a 0-dim float32 tensor keeps a's dtype (f16), a (1,) float32
    tensor promotes to float32; a Python number keeps f16. Values and dtypes as torch's."""
    m, n, k = 128, 192, 64
    a, b = randn(m, k), randn(k, n)

    def f(acc, s, t, alpha: float):
        return acc * s + t * alpha

    s0 = torch.tensor(0.5, device="cuda")
    t1 = torch.tensor([0.25], device="cuda")
    k0 = evtc.compile(f, dict(a=a, b=b, s=s0, t=s0, alpha=1.0), cache_dir=cache, config=PINNED)
    got = k0(a, b, s=s0, t=torch.tensor(-0.75, device="cuda"), alpha=3.0)
    check(got, f, a, b, s=s0, t=torch.tensor(-0.75, device="cuda"), alpha=3.0, what="0-d scalars")
    assert got.dtype == F16
    k1 = evtc.compile(f, dict(a=a, b=b, s=s0, t=t1, alpha=1.0), cache_dir=cache, config=PINNED)
    got = k1(a, b, s=s0, t=t1, alpha=2)
    check(got, f, a, b, s=s0, t=t1, alpha=2, what="(1,) scalar promotes")
    assert got.dtype == F32


@pytest.mark.gpu
def test_one_row_and_odd_sizes_on_one_kernel(cache):
    """One compiled kernel (default configuration, variants chosen per call) over M = 1, 7, 129,
    1000; N = 8, 24, 1000; K = 8, 24, 4096: every call equals torch's values."""

    def f(acc, bias, C):
        return F.gelu(acc + bias, approximate="tanh") * C

    kern = evtc.compile(f, dict(a=randn(256, 64), b=randn(64, 256), bias=randn(256, dtype=BF16).float(),
                                C=randn(256, 256)), cache_dir=cache)
    sizes = ((1, 1000, 4096), (7, 24, 8), (129, 8, 24), (1000, 1000, 64), (1, 8, 8), (33, 136, 4096))
    for (m, n, k) in sizes:
        a, b, bias, C = randn(m, k, scale=0.2), randn(k, n, scale=0.2), randn(n, dtype=F32), randn(m, n)
        check(kern(a, b, bias=bias, C=C), f, a, b, bias=bias, C=C, what=f"{m}x{n}x{k}")


@pytest.mark.gpu
def test_batched_operands_of_every_batch_shape(cache):
    """Batched a (L, M, K), b (L, K, N) with per-batch tile/row/col operands and a shared (N,)
    bias; the same kernel called with a 2-d b (broadcast, expanded), a batch of 1 operand
    (expanded) and a batch-less per-batch operand."""
    L, m, n, k = 3, 96, 136, 64

    def f(acc, C, row, col, bias):
        return (acc + C) * col + row + bias

    ex = dict(a=randn(L, 64, 64), b=randn(L, 64, 64), C=randn(L, 64, 64), row=randn(L, 1, 64),
              col=randn(L, 64, 1), bias=randn(64, dtype=F32))
    kern = evtc.compile(f, ex, cache_dir=cache, config=PINNED)
    a, b = randn(L, m, k), randn(L, k, n)
    ops = dict(C=randn(L, m, n), row=randn(L, 1, n), col=randn(L, m, 1), bias=randn(n, dtype=F32))
    check(kern(a, b, **ops), f, a, b, **ops, what="all per batch")
    b2 = randn(k, n)
    check(kern(a, b2, **ops), f, a, b2, **ops, what="2-d b")
    ops1 = dict(ops, C=randn(1, m, n), row=randn(n))
    check(kern(a, b, **ops1), f, a, b, **ops1, what="batch-1 C, batch-less row")
    a1 = randn(1, m, k)
    check(kern(a1, b, **ops), f, a1, b, **ops, what="a of batch 1")


@pytest.mark.gpu
def test_batched_permuted_and_transposed_per_batch(cache):
    """Batched a and b whose batch dim is not outermost (permute of (M, L, K)), b transposed per
    batch, C column-major per batch: values as torch's."""
    L, m, n, k = 4, 72, 80, 40

    def f(acc, C):
        return torch.tanh(acc) - C

    kern = evtc.compile(f, dict(a=randn(L, 64, 64), b=randn(L, 64, 64), C=randn(L, 64, 64)), cache_dir=cache,
                        config=PINNED)
    a = randn(m, L, k).permute(1, 0, 2)
    b = randn(L, n, k).transpose(1, 2)
    C = randn(L, n, m).transpose(1, 2)
    before = snapshot(a, b, C)
    check(kern(a, b, C=C), f, a, b, C=C, what="permuted")
    unchanged(before, (a, b, C))


@pytest.mark.gpu
def test_bf16_row_major_b_real_shape_decode_and_prefill(cache):
    """bfloat16, nn.Linear-style weight (K-major b = w.t()), Llama-3-8B MLP down shape at M = 1, 5
    and 300 with a residual: the default kernel's decode and prefill variants."""

    def f(acc, resid):
        return acc + resid

    kern = evtc.compile(f, dict(a=randn(128, 14336, dtype=BF16), b=randn(4096, 14336, dtype=BF16).t(),
                                resid=randn(128, 4096, dtype=BF16)), cache_dir=cache)
    w = randn(4096, 14336, dtype=BF16, scale=0.02)
    for m in (1, 5, 300):
        x = randn(m, 14336, dtype=BF16)
        r = randn(m, 4096, dtype=BF16)
        check(kern(x, w.t(), resid=r), f, x, w.t(), resid=r, what=f"M={m}")
