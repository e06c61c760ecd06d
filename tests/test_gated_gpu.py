"""GPU: gated epilogues (SwiGLU) with an nn.Linear weight [W_gate; W_up], every cluster shape, the
cooperative schedule, evtc.linear, torch.compile and argument errors, against torch in float32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import evtc

pytestmark = pytest.mark.gpu

TOL = 1e-2


def swiglu(acc):
    gate, up = acc.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_bias(acc, bias):
    gate, up = (acc + bias).chunk(2, dim=-1)
    return F.silu(gate) * up, (F.silu(gate) * up).float().amax(-1)


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def weight_inputs(m, n_out, k, seed=0, dtype=torch.float16):
    """x (M, K) and a linear layer's weight (2 N_out, K): gate rows first, then up rows."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(m, k, device="cuda", generator=g) * k ** -0.25).to(dtype)
    w = (torch.randn(2 * n_out, k, device="cuda", generator=g) * k ** -0.25).to(dtype)
    bias = torch.randn(2 * n_out, device="cuda", generator=g)
    return x, w, bias


def torch_swiglu_bias(x, w, bias):
    gate, up = (x.float() @ w.float().t() + bias).chunk(2, dim=-1)
    y = F.silu(gate) * up
    return y, y.amax(-1)


@pytest.mark.parametrize("schedule", ["pingpong", "cooperative"])
def test_weight_layout_every_cluster_shape(schedule, cache):
    """B = weight.t() (K-major, no copy) on problems whose cluster shape differs: the 2x1 shape
    multicasts each half of B to two CTAs."""
    x, w, bias = weight_inputs(256, 256, 128)
    config = None if schedule == "pingpong" else {"schedule": "cooperative"}
    k = evtc.compile(swiglu_bias, dict(a=x, b=w.t(), bias=bias), config=config, cache_dir=cache)
    assert k.config.gated and k.config.b_major == "k"
    shapes = [(256, 256, 128), (16384, 64, 72), (1000, 520, 200), (129, 8, 64)]
    if schedule == "pingpong":
        assert k.cluster_for(16384, 64) == (2, 1)
    for m, n_out, kk in shapes:
        x, w, bias = weight_inputs(m, n_out, kk, seed=m)
        w_before = w.clone()
        y, row_max = k(x, w.t(), bias=bias)
        torch.cuda.synchronize()
        ref_y, ref_max = torch_swiglu_bias(x, w, bias)
        assert y.shape == (m, n_out) and row_max.shape == (m,)
        assert rel_err(y, ref_y) < TOL, (m, n_out, kk)
        assert rel_err(row_max, ref_max) < TOL, (m, n_out, kk)
        assert torch.equal(w, w_before)


def test_linear_and_torch_compile(cache):
    x, w, _ = weight_inputs(300, 192, 96)
    x3 = x.reshape(3, 100, 96)
    lin = evtc.linear(swiglu, dict(x=x3, weight=w), cache_dir=cache)
    y = lin(x3, w)
    gate, up = F.linear(x3.float(), w.float()).chunk(2, -1)
    ref = F.silu(gate) * up
    assert y.shape == (3, 100, 192) and rel_err(y, ref) < TOL

    k = lin.kernel

    @torch.compile(fullgraph=True)
    def model(x, w):
        return k(x, w.t()) * 2

    out = model(x, w)
    assert rel_err(out, 2 * ref.reshape(300, 192)) < TOL


def test_gated_argument_errors(cache):
    x, w, bias = weight_inputs(256, 256, 128)
    k = evtc.compile(swiglu_bias, dict(a=x, b=w.t(), bias=bias), cache_dir=cache)
    odd = torch.randn(255, 128, device="cuda", dtype=torch.float16)
    with pytest.raises(evtc.CallError, match="N must be even"):
        k(x, odd.t(), bias=torch.randn(255, device="cuda"))
    with pytest.raises(evtc.CallError, match="bias"):
        k(x, w.t(), bias=torch.randn(100, device="cuda"))


def swiglu_with_stats(acc):
    gate, up = acc.chunk(2, dim=-1)
    y = F.silu(gate) * up
    return y, (y * y).sum(-1), y.abs().amax()


def swiglu_with_column_max(acc):
    gate, up = acc.chunk(2, dim=-1)
    y = F.silu(gate) * up
    return y, y.amax(-2)


def test_linear_with_reductions_keeps_leading_dims(cache):
    """Outputs along M (the tile, per-row sums) get x's leading dims back; a whole-output
    reduction keeps its shape; out= takes the same structure. A per-column reduction, which
    PyTorch takes per leading index on a 3-d x, is refused rather than reduced over all rows."""
    x, w, _ = weight_inputs(300, 192, 96)
    x3 = x.reshape(3, 100, 96)
    lin = evtc.linear(swiglu_with_stats, dict(x=x3, weight=w), cache_dir=cache)
    y, rows, amax = lin(x3, w)
    gate, up = F.linear(x3.float(), w.float()).chunk(2, -1)
    ref = F.silu(gate) * up
    assert y.shape == (3, 100, 192) and rows.shape == (3, 100) and amax.shape == ()
    assert rel_err(y, ref) < TOL
    # bfloat16 sums and maximum of a bfloat16 value, as in torch: one bfloat16 rounding.
    assert rows.dtype == amax.dtype == y.dtype
    assert rel_err(rows, (ref * ref).sum(-1)) < 2.0**-8
    assert rel_err(amax, ref.abs().amax()) < 2.0**-8
    out = (torch.full_like(y, float("nan")), torch.full_like(rows, float("nan")),
           torch.full_like(amax, float("nan")))
    again = lin(x3, w, out=out)
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(again, out, strict=True))
    # The outputs are 16-bit like the first call's, so the same one-rounding tolerance.
    assert rel_err(out[0], ref) < TOL and rel_err(out[1], (ref * ref).sum(-1)) < 2.0**-8
    assert rel_err(out[2], ref.abs().amax()) < 2.0**-8

    with pytest.raises(evtc.CallError, match="leading dims"):
        evtc.linear(swiglu_with_column_max, dict(x=x3, weight=w), cache_dir=cache)
    flat = evtc.linear(swiglu_with_column_max, dict(x=x, weight=w), cache_dir=cache)
    y2, cols = flat(x, w)
    assert cols.shape == (192,) and rel_err(cols, ref.reshape(300, 192).amax(0)) < 2.0**-8  # 16-bit, as y
