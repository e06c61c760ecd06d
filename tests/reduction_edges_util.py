"""Helpers of tests/test_reduction_edges_gpu.py: inputs, an independent float64 reference,
tolerances."""

from __future__ import annotations

import torch

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

# relative tolerance of one output element, by dtype (about 2-4 units of its last place)
RTOL = {F16: 2e-3, BF16: 1.6e-2, F32: 1e-5, E4M3: 1.3e-1, E5M2: 2.6e-1}


def dev():
    return "cuda"


def randn(*shape, dtype=F16, scale=1.0):
    return (torch.randn(*shape, device=dev(), dtype=torch.float32) * scale).to(dtype)


def uniform(*shape, lo=0.5, hi=1.0, dtype=F16, scale=1.0):
    return ((torch.rand(*shape, device=dev(), dtype=torch.float32) * (hi - lo) + lo) * scale).to(dtype)


def kmajor_b(k, n, *, lo=None, hi=None, dtype=F16, scale=1.0, batch=None):
    """b of (K, N) (or (L, K, N)) stored K-major: nn.Linear's weight transposed."""
    lead = () if batch is None else (batch,)
    w = (randn(*lead, n, k, dtype=dtype, scale=scale) if lo is None
         else uniform(*lead, n, k, lo=lo, hi=hi, dtype=dtype, scale=scale))
    return w.transpose(-1, -2)


def d64(t):
    if isinstance(t, torch.Tensor):
        return t.float().double() if t.dtype.itemsize == 1 else t.double()
    return t


def acc64(a, b):
    """The exact product (float64; 16-bit products of K <= 2^20 terms are exact enough)."""
    return torch.matmul(d64(a), d64(b))


def snapshot(*ts):
    return [t.clone() for t in ts]


def unchanged(before, after, what=""):
    for i, (x, y) in enumerate(zip(before, after, strict=True)):
        xb = x.view(torch.uint8) if x.dtype.itemsize == 1 else x
        yb = y.view(torch.uint8) if y.dtype.itemsize == 1 else y
        same = x.shape == y.shape and x.dtype == y.dtype and torch.equal(xb, yb)
        assert same or torch.allclose(x.float(), y.float(), rtol=0, atol=0, equal_nan=True), \
            f"{what}: input {i} modified"


def close(got, want, what, *, abs_tol=None, rtol=None, dtype=None, shape=None):
    """got (a kernel output) against want (float64). NaN and +-inf must sit at the same places;
    finite values within rtol(dtype) * |want| + abs_tol (a tensor broadcasting to want, or a number)."""
    dtype = dtype or got.dtype
    if shape is not None:
        assert tuple(got.shape) == tuple(shape), f"{what}: shape {tuple(got.shape)}, expected {tuple(shape)}"
    assert tuple(got.shape) == tuple(want.shape), (f"{what}: shape {tuple(got.shape)} vs reference "
                                                   f"{tuple(want.shape)}")
    g = got.double().cpu()
    w = want.double().cpu()
    if got.dtype in (F16, BF16):  # the exact value as torch would store it (overflow to inf included)
        w = w.to(got.dtype).double()
    if g.numel() == 0:
        return
    ng, nw = torch.isnan(g), torch.isnan(w)
    odd = ng ^ nw
    assert torch.equal(ng, nw), (f"{what}: NaN differs at {int(odd.sum())} places "
                                 f"(first at {odd.nonzero()[:3].tolist()}; got {g[odd][:3].tolist()} "
                                 f"want {w[odd][:3].tolist()})")
    iw = torch.isinf(w)
    ig = torch.isinf(g)
    assert torch.equal(g[iw | ig], w[iw | ig]), (
        f"{what}: infinities differ at {((g != w) & (iw | ig)).nonzero()[:3].tolist()}")
    fin = ~(nw | iw | ig)
    r = RTOL.get(dtype, 2e-2) if rtol is None else rtol
    if abs_tol is None:
        at = torch.zeros_like(w)
    elif isinstance(abs_tol, torch.Tensor):
        at = torch.as_tensor(abs_tol, dtype=torch.float64).cpu().expand_as(w)
    else:
        at = torch.full_like(w, float(abs_tol))
    tol = r * w.abs() + at + 1e-30
    bad = ((g - w).abs() > tol) & fin
    if not bad.any():
        return
    worst = ((g - w).abs() / tol)[fin].max().item()
    assert not bad.any(), (f"{what}: {int(bad.sum())}/{int(fin.sum())} off; worst {worst:.3g}x tol at "
                           f"{bad.nonzero()[:3].tolist()}: got {g[bad][:3].tolist()} "
                           f"want {w[bad][:3].tolist()}")


def sum_tol(y64, dim, keepdim=False, rel=3e-4):
    """The absolute error a float32 sum of y (computed from a float32 accumulator) may carry:
    rel x the sum of |y| over the reduced dims."""
    if dim is None:
        return rel * y64.abs().sum()
    return rel * y64.abs().sum(dim, keepdim=keepdim)


def same_bits(x, y):
    if x.dtype.itemsize == 4:
        return torch.equal(x.view(torch.int32), y.view(torch.int32))
    return torch.equal(x.view(torch.int16) if x.dtype.itemsize == 2 else x,
                       y.view(torch.int16) if y.dtype.itemsize == 2 else y)
