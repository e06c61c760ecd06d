"""Edge cases of float8 epilogues that need no GPU: refusals of bad scales and other float8 formats
name the problem, the PTX's wgmma keeps the operand order of mixed e5m2 / e4m3 inputs, and the
torch path's float8 roundings (twice through 16 bits, out_dtypes, reductions cast to float8) match
torch's rule as docs/epilogues.md states it. First written as an adversarial probe of float8."""

from __future__ import annotations

import re

import pytest
import torch
from fp8_edges_util import E4M3, E5M2, bits_equal, snapshot, to_float8, unchanged

import evtc
from evtc.errors import CompileError, DTypeError, ShapeError


def _ab(m=96, n=160, k=256, da=E4M3, db=E4M3):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(m, k, generator=g) * 2).to(da), (torch.randn(n, k, generator=g) * 2).to(db).t()


@pytest.mark.parametrize("what,example,error,match", [
    ("float64 col", {"s": torch.rand(96, 1, dtype=torch.float64)}, DTypeError, "float64"),
    ("float64 scalar", {"s": torch.tensor(2.0, dtype=torch.float64)}, DTypeError, "float64"),
    ("float8 operand", {"s": torch.rand(96, 160).to(E4M3)}, DTypeError, "float8_e4m3fn"),
    ("(M,) scale", {"s": torch.rand(96)}, ShapeError, r"\(96, 1\)"),
])
def test_scale_refusals_name_the_problem(tmp_path, what, example, error, match):
    a, b = _ab()
    with pytest.raises(error, match=match):
        evtc.compile(lambda acc, s: acc * s.float(), dict(a=a, b=b, **example), cache_dir=tmp_path)


def _cast_to(dtype):
    return lambda acc: acc.to(dtype)


def test_other_float8_formats_are_refused(tmp_path):
    a, b = _ab()
    for name in ("float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"):
        dt = getattr(torch, name, None)
        if dt is None:
            continue
        with pytest.raises(DTypeError, match="not supported"):
            evtc.compile(_cast_to(dt), dict(a=a, b=b), cache_dir=tmp_path)
        with pytest.raises(DTypeError, match="the GEMM takes"):
            evtc.compile(lambda acc: acc, dict(a=a.float().to(dt), b=b), cache_dir=tmp_path)
    if hasattr(torch, "float8_e8m0fnu"):
        with pytest.raises(CompileError, match="must be float32"):
            evtc.compile(lambda acc: acc, dict(a=(a, torch.ones(96, 2).to(torch.float8_e8m0fnu)),
                                               b=(b, torch.ones(2, 2))), cache_dir=tmp_path)


@pytest.mark.parametrize("da,db,op", [(E5M2, E4M3, "f32.e5m2.e4m3"), (E4M3, E5M2, "f32.e4m3.e5m2")])
def test_mixed_formats_keep_the_operand_order_in_the_wgmma(tmp_path, da, db, op):
    a, b = _ab(128, 256, 256, da, db)
    for ex, cfg in ((dict(a=a, b=b, s=torch.tensor(1.0)), None),
                    (dict(a=a, b=b, s=torch.tensor(1.0)), {"fast_accum": True}),
                    (dict(a=(a, torch.rand(128, 2)), b=(b, torch.rand(2, 2))), None)):
        fn = (lambda acc, s: acc * s) if "s" in ex else (lambda acc: acc)
        k = evtc.compile(fn, ex, config=cfg, arch="sm_90a", cache_dir=tmp_path)
        ops = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.([\w.]+)", k.ptx))
        assert ops == {op}, ops


def chains(acc, C):
    y = acc + C
    return (y.to(torch.float8_e4m3fn), y.bfloat16().to(torch.float8_e4m3fn), y.half().to(torch.float8_e5m2),
            y.bfloat16().to(torch.float8_e5m2))


def test_torch_path_rounds_twice_through_16_bits(tmp_path):
    """Values whose bf16/f16 rounding lands on a float8 tie (17.03 -> 17 -> 16, directly 18)."""
    a, b = _ab(64, 64, 32)
    a = torch.zeros_like(a.float()).to(E4M3)  # acc = 0: y = C exactly
    vals = torch.tensor([17.03, 18.97, 18.004, 9.49, 4.51, 4.5001, 65520.0, 1e30, 2.0 ** -10, 3 * 2.0 ** -17])
    signs = torch.where(torch.arange(64) % 2 == 0, 1.0, -1.0)
    C = vals[torch.arange(64 * 64) % len(vals)].reshape(64, 64) * signs
    snap = snapshot(a, b, C)
    k = evtc.compile(chains, dict(a=a, b=b, C=C), cache_dir=tmp_path)
    got = k(a, b, C=C)
    y = C.clone()
    want = (to_float8(y, E4M3), to_float8(y.bfloat16(), E4M3), to_float8(y.half(), E5M2),
            to_float8(y.bfloat16(), E5M2))
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        bits_equal(g, w, f"chain {i}")
    # the double rounding matters for these values
    assert not torch.equal(want[0].float(), want[1].float())
    unchanged(snap)


def test_torch_path_out_dtypes_and_float8_reductions(tmp_path):
    a, b = _ab()

    def f(acc):
        y = acc * 10
        return y, y.abs().amax(), y.amax(-1)

    k = evtc.compile(f, dict(a=a, b=b), cache_dir=tmp_path, out_dtypes=E4M3)
    d, amax, rmax = k(a, b)
    y = (a.float() @ b.float()) * 10
    bits_equal(d, to_float8(y, E4M3), "D")
    assert amax.dtype == E4M3 and amax.float().item() == 448.0
    bits_equal(rmax, to_float8(y.amax(-1), E4M3), "row max")
