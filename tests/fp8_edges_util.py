"""Helpers of tests/test_fp8_edges.py and its GPU twin: float8 inputs, an independent float64
reference, torch's float8 rounding as docs/epilogues.md states it, and checks that inputs are left
alone."""

from __future__ import annotations

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
ON_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
DEV = "cuda" if torch.cuda.is_available() else "cpu"

# Tolerances, relative to the largest |reference| (docs/fp8.md: promoted accumulation 1e-4..2.4e-4
# against float64 with float32 outputs; fast accumulation up to 1.4e-2 with bf16 outputs at K = 14336).
TOL_F32 = 1e-3          # promoted, float32 output
TOL_BF16 = 8e-3         # promoted, bfloat16 output (one bf16 rounding, 2^-9 relative, plus accumulation)
TOL_FAST = 2e-2         # fast accumulation (K <= 4096 here)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def fp8(shape, dtype=E4M3, seed=0, scale=2.0):
    """A float8 tensor of N(0, scale^2) values (made on the CPU, moved to DEV)."""
    return (torch.randn(*shape, generator=gen(seed)) * scale).to(dtype).to(DEV)


def weight_t(n, k, dtype=E4M3, seed=1, lead=()):
    """b = w.t() for an (N, K) weight: (K, N), K-major."""
    return fp8((*lead, n, k), dtype, seed).transpose(-1, -2)


def rand(*shape, seed=0, lo=0.5, hi=1.5, dtype=F32):
    return (torch.rand(*shape, generator=gen(seed)) * (hi - lo) + lo).to(dtype).to(DEV)


def randn(*shape, seed=0, scale=1.0, dtype=F32):
    return (torch.randn(*shape, generator=gen(seed)) * scale).to(dtype).to(DEV)


def d64(t):
    """float64 of a tensor (float8 through float32), or the number itself."""
    if isinstance(t, torch.Tensor):
        return t.float().double() if t.dtype.itemsize == 1 else t.double()
    return t


def mm64(a, b):
    return d64(a) @ d64(b)


def rel(got, ref) -> float:
    g, r = got.double(), ref.double().to(got.device)
    return ((g - r).abs().max() / r.abs().max().clamp_min(1e-300)).item()


def assert_rel(got, ref, tol, what=""):
    assert tuple(got.shape) == tuple(ref.shape), f"{what}: shape {tuple(got.shape)} vs {tuple(ref.shape)}"
    assert torch.isfinite(got.double()).all(), f"{what}: non-finite values"
    err = rel(got, ref)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


def to_float8(x: torch.Tensor, dtype) -> torch.Tensor:
    """torch 2.12's .to(float8) as docs/epilogues.md states it, independent of the installed torch:
    e4m3fn saturates at +-448 (NaN stays NaN), e5m2 overflows to +-inf from 61440 on."""
    x = x.float()
    if dtype == E4M3:
        x = torch.where(torch.isnan(x), x, x.clamp(-448.0, 448.0))
    return x.to(dtype)


def float8_close(q, want, what="", accum_rel=1e-3):
    """A float8 result within one float8 spacing of the float64 value (either neighbour), plus the
    accumulation's error, e4m3 saturating at 448."""
    assert q.dtype in (E4M3, E5M2), f"{what}: dtype {q.dtype}"
    assert tuple(q.shape) == tuple(want.shape), f"{what}: shape {tuple(q.shape)} vs {tuple(want.shape)}"
    w = want.double().to(q.device)
    if q.dtype == E4M3:
        w = w.clamp(-448.0, 448.0)
        rel_step, tiny = 2.0 ** -3, 2.0 ** -9
    else:
        rel_step, tiny = 2.0 ** -2, 2.0 ** -16
    g = q.double()
    bound = w.abs() * rel_step + tiny + accum_rel * w.abs().max()
    bad = (g - w).abs() > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} off; got {g[bad][:4].tolist()} "
                           f"want {w[bad][:4].tolist()}")


def bits_equal(got: torch.Tensor, want: torch.Tensor, what=""):
    """Float8 results bit for bit (any NaN encoding counts as NaN)."""
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} vs {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape"
    g, w = got.cpu(), want.cpu()
    gn, wn = torch.isnan(g.float()), torch.isnan(w.float())
    assert torch.equal(gn, wn), f"{what}: NaN at {int((gn ^ wn).sum())} other places"
    gb, wb = g.view(torch.uint8)[~gn], w.view(torch.uint8)[~wn]
    bad = gb != wb
    if bad.any():
        gv, wv = g.float()[~gn][bad], w.float()[~wn][bad]
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} differ: got {gv[:6].tolist()} "
                             f"want {wv[:6].tolist()}")


def snapshot(*xs):
    out = []
    for x in xs:
        if isinstance(x, torch.Tensor):
            out.append((x, x.clone(), x.stride(), x.data_ptr()))
        elif isinstance(x, tuple):
            out.extend(snapshot(*x))
    return out


def unchanged(snap, what=""):
    for i, (t, copy, stride, ptr) in enumerate(snap):
        assert t.stride() == stride and t.data_ptr() == ptr, f"{what}: input {i} was re-viewed"
        now = t.view(torch.uint8) if t.dtype.itemsize == 1 else t.float().nan_to_num(7.0)
        was = copy.view(torch.uint8) if copy.dtype.itemsize == 1 else copy.float().nan_to_num(7.0)
        assert torch.equal(now, was), f"{what}: input {i} was modified by the call"


def expect_path(kernel, path):
    """The call path, checked only where the kernel can run (a Hopper GPU)."""
    if ON_GPU:
        assert kernel.last_path == path, f"path {kernel.last_path}, expected {path}"


def blocks(x: int) -> int:
    return -(-x // 128)


def bs_inputs(m, n, k, rows, a_dtype=E4M3, b_dtype=E4M3, seed=0, lead=()):
    """Block-scaled pairs: a (M, K) with scales (M, KB) M-major (rows == 1) or (MB, KB); b = w.t()
    with scales (KB, NB) = sw.t(). Scales of a wide range."""
    g = gen(seed)
    a = (torch.randn(*lead, m, k, generator=g) * 2).to(a_dtype)
    w = (torch.randn(*lead, n, k, generator=g) * 2).to(b_dtype)
    a_rows = m if rows == 1 else blocks(m)
    sa = torch.exp2(torch.randint(-4, 5, (*lead, blocks(k), a_rows), generator=g).float())
    sa = sa * (1 + torch.rand(sa.shape, generator=g))
    sw = torch.rand(*lead, blocks(n), blocks(k), generator=g) * 4 + 0.25
    return ((a.to(DEV), sa.to(DEV).transpose(-1, -2)),
            (w.to(DEV).transpose(-1, -2), sw.to(DEV).transpose(-1, -2)))


def dequantized(a_pair, b_pair, rows):
    """a @ b in float64 from the blocks: each element times the scale of its block."""
    (a, sa), (b, sb) = a_pair, b_pair
    m, k = a.shape[-2:]
    n = b.shape[-1]
    dev = a.device
    ar = torch.arange(m, device=dev) // rows
    ks = torch.arange(k, device=dev) // 128
    bc = torch.arange(n, device=dev) // 128
    ad = d64(a) * sa.double()[..., ar[:, None], ks[None, :]]
    bd = d64(b) * sb.double()[..., ks[:, None], bc[None, :]]
    return ad @ bd
