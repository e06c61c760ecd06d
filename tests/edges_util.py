"""Helpers of tests/test_edges_*_gpu.py: an independent float64 reference and checks."""

from __future__ import annotations

import torch

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
PINNED = {"cluster": (1, 2)}  # one configuration: no per-call variants to build

# relative tolerance of one output element by dtype (a few units of its last place)
RTOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2, torch.float32: 2e-4,
        torch.float8_e4m3fn: 1.3e-1, torch.float8_e5m2: 2.6e-1}


def randn(*shape, dtype=F16, device="cuda", scale=1.0):
    t = torch.randn(*shape, device=device, dtype=torch.float32) * scale
    return t.to(dtype)


def _to64(v):
    if isinstance(v, torch.Tensor):
        return v.float().double() if v.dtype.itemsize == 1 else v.double()
    return v


def ref64(fn, a, b, **ops):
    """fn on float64 tensors with acc = a.double() @ b.double() (independent of evtc)."""
    acc = torch.matmul(_to64(a), _to64(b))
    return fn(acc, **{k: _to64(v) for k, v in ops.items()})


def torch_native(fn, a, b, **ops):
    """fn on the native dtypes, acc = a @ b in a's dtype, as torch computes it: shapes and dtypes."""
    acc = torch.matmul(a, b)
    return fn(acc, **ops)


def flat(x):
    if isinstance(x, dict):
        return [x[k] for k in sorted(x)]
    if isinstance(x, (tuple, list)):
        return list(x)
    return [x]


def close(got, want, dtype, what, *, k=64, atol_rel=None, mismatch=0.0):
    """got (any dtype) against want (float64): elementwise, rtol by dtype, atol relative to want's rms."""
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    g = got.double().cpu()
    w = want.double().cpu()
    if g.numel() == 0:
        return
    nan_g, nan_w = torch.isnan(g), torch.isnan(w)
    assert torch.equal(nan_g, nan_w), f"{what}: NaN at {int((nan_g ^ nan_w).sum())} other places"
    fin = ~nan_w
    g, w = g[fin], w[fin]
    if g.numel() == 0:
        return
    inf_w = torch.isinf(w)
    assert torch.equal(g[inf_w], w[inf_w]), f"{what}: infinities differ"
    g, w = g[~inf_w], w[~inf_w]
    if g.numel() == 0:
        return
    rms = w.pow(2).mean().sqrt().item()
    rtol = RTOL.get(dtype, 2e-2)
    if atol_rel is None:
        atol_rel = max(rtol, 1e-3) * 0.5
    tol = rtol * w.abs() + atol_rel * rms + 1e-30
    bad = (g - w).abs() > tol
    frac = bad.double().mean().item()
    assert frac <= mismatch, (
        f"{what}: {int(bad.sum())}/{bad.numel()} elements off "
        f"(worst {((g - w).abs() / tol).max().item():.3g}x tol; "
        f"got {g[bad][:4].tolist()} want {w[bad][:4].tolist()})")


def check(got, fn, a, b, *, what="", mismatch=0.0, atol_rel=None, dtypes=True, **ops):
    """Compare a kernel's result with the float64 reference, and its structure/dtypes with torch's."""
    want = ref64(fn, a, b, **ops)
    native = torch_native(fn, a, b, **ops) if dtypes else None
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{what}: keys {list(got)} vs {list(want)}"
    elif isinstance(want, (tuple, list)):
        assert isinstance(got, (tuple, list)) and len(got) == len(want), f"{what}: structure"
    gl, wl = flat(got), flat(want)
    nl = flat(native) if dtypes else [None] * len(gl)
    for i, (g, w, n) in enumerate(zip(gl, wl, nl, strict=True)):
        if n is not None:
            assert g.dtype == n.dtype, f"{what} output {i}: dtype {g.dtype}, torch gives {n.dtype}"
            assert tuple(g.shape) == tuple(n.shape), (
                f"{what} output {i}: shape {tuple(g.shape)}, torch {tuple(n.shape)}")
        close(g, w, g.dtype, f"{what} output {i}", mismatch=mismatch, atol_rel=atol_rel)


def snapshot(*tensors):
    return [t.clone() if isinstance(t, torch.Tensor) else t for t in tensors]


def unchanged(before, after, what=""):
    for i, (x, y) in enumerate(zip(before, after, strict=True)):
        if isinstance(x, torch.Tensor):
            same = x.shape == y.shape and torch.allclose(x.float(), y.float(), rtol=0, atol=0, equal_nan=True)
            assert same, (
                f"{what}: input {i} was modified by the call")
