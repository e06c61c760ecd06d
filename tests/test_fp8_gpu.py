"""GPU: float8 a and b (e4m3, e5m2, mixed) through the SM90 kernel, against torch in float64.

Tensorwise and rowwise scales are ordinary epilogue operands; a float8 output with its amax is one
kernel. The kernel's error is compared with ``torch._scaled_mm``'s on the same inputs: the 8-bit
wgmma accumulates in reduced precision (the same as ``use_fast_accum=True``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from float8_edges import float8_edge_operands, float8_roundings

import evtc

pytestmark = pytest.mark.gpu

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SHAPES = [(64, 4096, 4096), (200, 1000, 1040), (2048, 2048, 2048), (1, 512, 7168), (4096, 1536, 640)]


def tensorwise(acc, sa, sb):
    return acc * sa * sb


def rowwise_bias_gelu_fp8_amax(acc, sa, sb, bias, s_out):
    y = F.gelu(acc * sa * sb + bias)
    return (y * s_out).to(torch.float8_e4m3fn), y.abs().amax()


def scaled_to_float32(acc, s):
    return (acc * s).float()


def gated(acc, sa, sb):
    gate, up = (acc * sa * sb).chunk(2, dim=-1)
    return F.silu(gate) * up


def _inputs(m, n, k, a_dtype=E4M3, b_dtype=E4M3, seed=0, batches=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    lead = (batches,) if batches else ()
    a = torch.randn(*lead, m, k, device="cuda", generator=g).to(a_dtype)
    w = torch.randn(*lead, n, k, device="cuda", generator=g).to(b_dtype)
    return a, w.transpose(-1, -2)  # b (K, N), K-major


def _rel(got, ref):
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E5M2, E5M2), (E4M3, E5M2)], ids=["e4m3", "e5m2", "mixed"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_tensorwise_scales(tmp_path, shape, dtypes):
    m, n, k = shape
    a, b = _inputs(m, n, k, *dtypes)
    sa, sb = torch.tensor(0.37, device="cuda"), torch.tensor(1.9, device="cuda")
    kernel = evtc.compile(tensorwise, {"a": a, "b": b, "sa": sa, "sb": sb}, cache_dir=tmp_path)
    got = kernel(a, b, sa=sa, sb=sb)
    assert kernel.last_path == "kernel"
    ref = a.double() @ b.double() * 0.37 * 1.9
    err = _rel(got, ref)
    assert got.dtype == torch.bfloat16 and err < 8e-3, err
    # No worse than cuBLASLt's float8 GEMM on the same inputs (which also promotes its partial
    # sums unless use_fast_accum), where it takes them: not two e5m2 operands, and N and K
    # multiples of 16 (evtc takes both).
    if dtypes != (E5M2, E5M2) and n % 16 == 0 and k % 16 == 0:
        theirs = torch._scaled_mm(a, b, scale_a=sa.float(), scale_b=sb.float(), out_dtype=torch.bfloat16)
        assert err <= 1.5 * _rel(theirs, ref) + 2e-3, (err, _rel(theirs, ref))


@pytest.mark.parametrize("shape", [(256, 512, 16384), (64, 4096, 4096), (1000, 1008, 2048)],
                         ids=lambda s: "x".join(map(str, s)))
def test_promotion_against_fast_accumulation(tmp_path, shape):
    """The default promotes each K tile's partial sums into float32; fast_accum=True keeps them in
    the 8-bit wgmma's accumulator, whose sums keep fewer bits: with float32 outputs (no rounding
    of their own) the promoted result is the closer to float64, as close as cuBLASLt's, and the
    fast one as close as cuBLASLt's fast mode."""
    m, n, k = shape
    a, b = _inputs(m, n, k, seed=6)
    one = torch.tensor(1.0, device="cuda")
    ref = a.double() @ b.double()
    errors = {}
    for fast in (False, True):
        kernel = evtc.compile(scaled_to_float32, {"a": a, "b": b, "s": one},
                              config={"fast_accum": fast}, cache_dir=tmp_path)
        assert kernel.config.promotes is not fast
        errors[fast] = _rel(kernel(a, b, s=one), ref)
        theirs = _rel(torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32,
                                       use_fast_accum=fast), ref)
        assert errors[fast] <= 1.5 * theirs + 1e-6, (fast, errors[fast], theirs)
    assert errors[False] <= 0.5 * errors[True], errors


def residual_to_float32(acc, s, C):
    return (acc * s + C).float()


@pytest.mark.parametrize("config", [
    {"schedule": "pingpong", "tile_m": 64, "tile_n": 64, "cluster": (1, 1)},
    {"schedule": "pingpong", "tile_m": 64, "tile_n": 128, "cluster": (1, 2)},
    {"schedule": "cooperative", "tile_m": 128, "tile_n": 64, "cluster": (2, 1)},
    {"schedule": "cooperative", "tile_m": 128, "tile_n": 128, "cluster": (1, 1)},
], ids=lambda c: f"{c['schedule']}{c['tile_m']}x{c['tile_n']}")
def test_promotion_in_pairs_sums_every_k_tile_once(tmp_path, config):
    """Small promoting tiles alternate two scratch accumulators (GemmConfig.promotes_in_pairs):
    K tiles 0, 2, ... into one and 1, 3, ... into the other, with an odd or even count per unit.
    Over 1 to 9 K tiles of 128 (ragged K included), whole and split, with a residual (whose C
    holds D under the cooperative schedule, handed back at a K tile of the next tile's mainloop)
    and without, float32 results are as close to float64 as cuBLASLt's promoted GEMM: a K tile
    dropped or added twice would be off by a whole tile's share of the sum."""
    one = torch.tensor(1.0, device="cuda")
    for k, splits in [(128, 1), (256, 1), (384, 1), (1000, 1), (1152, 1), (1152, 2), (2048, 3), (4096, 1)]:
        m, n = 300, 272  # ragged in M and N; N a multiple of 16, as _scaled_mm needs
        a, b = _inputs(m, n, k, seed=k + splits)
        c = torch.randn(m, n, device="cuda", generator=torch.Generator(device="cuda").manual_seed(k))
        ref = a.double() @ b.double()
        theirs = _rel(torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32), ref) \
            if k % 16 == 0 else 2e-4
        knobs = {**config, "split_k": splits > 1}  # the split kernel only where it splits
        plain = evtc.compile(scaled_to_float32, {"a": a, "b": b, "s": one}, config=knobs, cache_dir=tmp_path)
        with_c = evtc.compile(residual_to_float32, {"a": a, "b": b, "s": one, "C": c}, config=knobs,
                              cache_dir=tmp_path)
        for kernel, args, want in ((plain, {}, ref), (with_c, {"C": c}, ref + c.double())):
            assert kernel.config.promotes_in_pairs
            if splits > 1:
                kernel.pin_splits(splits)
                assert kernel.launch_for(m, n, k)[1] == splits
            got = kernel(a, b, s=one, **args)
            assert kernel.last_path == ("staged" if k % 16 else "kernel")  # K = 1000: aligned copies
            err = _rel(got, want)
            assert err <= 1.5 * theirs + 1e-6, (k, splits, err, theirs)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rowwise_scales_bias_gelu_and_a_float8_output_with_its_amax(tmp_path, shape):
    m, n, k = shape
    n = -(-n // 16) * 16  # a float8 output's rows in 16-byte multiples (the fast path)
    a, b = _inputs(m, n, k, seed=1)
    g = torch.Generator(device="cuda").manual_seed(2)
    sa = torch.rand(m, 1, device="cuda", generator=g) + 0.5
    sb = torch.rand(n, device="cuda", generator=g) / 16 + 0.01
    bias = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
    s_out = torch.tensor(4.0, device="cuda")
    ops = {"sa": sa, "sb": sb, "bias": bias, "s_out": s_out}
    kernel = evtc.compile(rowwise_bias_gelu_fp8_amax, {"a": a, "b": b, **ops}, cache_dir=tmp_path)
    q, amax = kernel(a, b, **ops)
    assert kernel.last_path == "kernel"
    y = F.gelu(a.double() @ b.double() * sa.double() * sb.double() + bias.double())
    assert q.dtype == E4M3 and q.shape == (m, n)
    # One e4m3 rounding (3 mantissa bits) of values within the accumulator's error of y * 4.
    assert ((q.double() - y * 4).abs() <= 0.07 * (y * 4).abs() + 2e-2 * (y * 4).abs().max()).all()
    assert abs(amax.item() - y.abs().max().item()) <= 1e-2 * y.abs().max().item()


def test_batched(tmp_path):
    a, b = _inputs(192, 384, 512, E4M3, E5M2, seed=3, batches=3)
    sa, sb = torch.tensor(0.5, device="cuda"), torch.tensor(0.25, device="cuda")
    kernel = evtc.compile(tensorwise, {"a": a, "b": b, "sa": sa, "sb": sb}, cache_dir=tmp_path)
    got = kernel(a, b, sa=sa, sb=sb)
    assert kernel.last_path == "kernel" and got.shape == (3, 192, 384)
    assert _rel(got, a.double() @ b.double() * 0.125) < 8e-3


def test_gated_swiglu(tmp_path):
    m, n, k = 256, 2 * 1024, 1024
    a, b = _inputs(m, n, k, seed=4)
    sa, sb = torch.tensor(0.5, device="cuda"), torch.tensor(0.5, device="cuda")
    kernel = evtc.compile(gated, {"a": a, "b": b, "sa": sa, "sb": sb}, cache_dir=tmp_path)
    got = kernel(a, b, sa=sa, sb=sb)
    assert kernel.last_path == "kernel"
    gate, up = (a.double() @ b.double() * 0.25).chunk(2, dim=-1)
    assert _rel(got, F.silu(gate) * up) < 1e-2


def test_a_call_with_an_n_major_b_is_staged_and_right(tmp_path, caplog):
    a, b = _inputs(128, 256, 512, seed=5)
    sa, sb = torch.tensor(1.0, device="cuda"), torch.tensor(1.0, device="cuda")
    kernel = evtc.compile(tensorwise, {"a": a, "b": b, "sa": sa, "sb": sb}, cache_dir=tmp_path)
    row_major_b = b.contiguous()  # the same values, N innermost
    got = kernel(a, row_major_b, sa=sa, sb=sb)
    assert kernel.last_path == "staged"
    assert _rel(got, a.double() @ b.double()) < 8e-3
    with pytest.raises(evtc.CallError, match="not contiguous along K"):
        evtc.compile(tensorwise, {"a": a, "b": b, "sa": sa, "sb": sb}, cache_dir=tmp_path,
                     strict=True)(a, row_major_b, sa=sa, sb=sb)


@pytest.mark.parametrize("shape", [(256, 512, 64), (200, 136, 64)], ids=["aligned", "staged"])
def test_float8_outputs_round_as_torch_does(tmp_path, shape):
    """The kernel's float8 conversions on the rounding edges, bit for bit against torch's .to on
    the same float32 values: e5m2 overflow is infinity (the hardware conversion saturates, a select
    follows it), e4m3fn saturates (torch 2.12's rule; 2.11 gives NaN in eager mode, so the e4m3fn
    reference is clamped first). D, a second output, a cast inside the epilogue, a row reduction
    and a reduction over everything cast to float8."""
    a, b, C = float8_edge_operands(*shape, device="cuda")
    kernel = evtc.compile(float8_roundings, {"a": a, "b": b, "C": C}, cache_dir=tmp_path)
    got = kernel(a, b, C=C)
    assert kernel.last_path == ("kernel" if shape[1] % 16 == 0 else "staged")
    y = a.float() @ b.float() + C
    want = float8_roundings(a.float() @ b.float(), C)
    want = (want[0], y.clamp(-448.0, 448.0).to(E4M3), want[2], want[3], want[4])
    assert torch.isinf(want[0].float()).any()
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.dtype == w.dtype and g.shape == w.shape, i
        assert torch.equal(g.float(), w.float()), f"output {i}: {(g.float() != w.float()).sum()} differ"
