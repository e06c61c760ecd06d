"""Checks shared by the restated peer suites (tests/test_peers_te_inductor_gpu.py,
tests/test_peers_deepgemm_cutlass_gpu.py): outputs against a float64 reference, elementwise."""

from __future__ import annotations

import os

import torch

#: Where the peer suites run: "cuda", or "cpu" (EVTC_PEERS_DEVICE=cpu: evtc's torch path).
DEV = os.environ.get("EVTC_PEERS_DEVICE", "cuda")

f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32
e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = (e4m3, e5m2)
# unit roundoff and smallest normal (float16: subnormal) of each output dtype
ROUNDOFF = {f16: 2.0**-11, bf16: 2.0**-8, f32: 2.0**-24, e4m3: 2.0**-4, e5m2: 2.0**-3}
SMALLEST = {f16: 2.0**-24, bf16: 2.0**-126, f32: 2.0**-126, e4m3: 2.0**-9, e5m2: 2.0**-16}


def wide(t):
    """float64 of a tensor (through float32 for float8); anything else as it is."""
    if not torch.is_tensor(t):
        return t
    if t.dtype in FP8:
        return t.float().double()
    return t.double() if t.is_floating_point() else t


def as_list(x):
    if isinstance(x, dict):
        return list(x.values())
    if isinstance(x, tuple | list):
        return list(x)
    return [x]


def close(out, ref, *, acc_tol=1e-5, what=""):
    """Elementwise |out - ref| <= (2u + acc_tol) (|ref| + rms(ref)) + tiny, u the roundoff of out's
    dtype. Also accepted: out equal to ref rounded to out's dtype (overflow to inf), NaN for NaN."""
    assert tuple(out.shape) == tuple(ref.shape), f"{what}: shape {tuple(out.shape)}, want {tuple(ref.shape)}"
    if out.numel() == 0:
        return
    o, r = wide(out), wide(ref)
    rounded = wide(r.float().to(out.dtype)) if out.dtype != torch.float64 else r
    fin = torch.isfinite(r)
    rms = r[fin].square().mean().sqrt().item() if bool(fin.any()) else 0.0
    t = 2 * ROUNDOFF[out.dtype] + acc_tol
    tol = t * r.abs() + t * rms + SMALLEST[out.dtype]
    err = (o - r).abs()
    ok = (err <= tol) | (o == r) | (o == rounded) | (torch.isnan(o) & torch.isnan(r))
    if out.dtype == torch.float8_e4m3fn:
        # e4m3fn saturates at +-448 (docs/epilogues.md); torch 2.11's eager cast gave NaN past 464,
        # a torch bug since fixed: a reference of that torch holds NaN where evtc holds +-448.
        ok |= torch.isnan(r) & (o.abs() == 448)
    if not bool(ok.all()):
        i = tuple((~ok).nonzero()[0].tolist())
        raise AssertionError(
            f"{what} ({out.dtype}, {tuple(out.shape)}): {int((~ok).sum())} of {ok.numel()} off; "
            f"first at {i}: "
            f"got {o[i].item()!r}, want {r[i].item()!r} (tol {tol[i].item():.3g}); "
            f"max err {err.nan_to_num(float('inf')).max().item():.3g}, rms(ref) {rms:.3g}"
        )


def gen(seed):
    return torch.Generator(device=DEV).manual_seed(seed)


def rnd(shape, dtype=torch.float32, g=None, std=1.0, major="row"):
    """Normal values; major="col" stores the last two dims transposed (a column-major view)."""
    shape = tuple(shape)
    if major == "col":
        store = (*shape[:-2], shape[-1], shape[-2])
        return (torch.randn(store, generator=g, device=DEV) * std).to(dtype).transpose(-1, -2)
    return (torch.randn(shape, generator=g, device=DEV) * std).to(dtype)
