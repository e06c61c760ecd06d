"""Two more peers' test suites restated against evtc's public API, first written as adversarial probes (GPU).

* deepseek-ai/DeepGEMM  tests/test_core.py, tests/test_fp8.py and tests/generators.py: float8 e4m3
  GEMMs with per-token 1 x 128 activation scales and 128 x 128 weight-block scales ("1D2D" on SM90),
  bf16 output, DeepSeek-V3's (n, k) shapes at m in {64, 128, 4096} and odd m; the scale-factor
  layouts (raw (M, K/128), M-major, TMA-aligned M-major with the pitch padded to 4); accumulation
  into an existing float32 output (d = alpha * a @ b + c with c = d); the masked grouped GEMM (one
  weight per group, rows past each group's count with zeroed scales); the dgrad GEMM (the weight
  read the other way round, its block scales untransposed); the wgrad recipe's 1 x 128 scales on
  b, which evtc documents as not taken (the refusal must name the shape it takes).
* NVIDIA/cutlass  test/unit/gemm/device/sm90_evt_operations.hpp and the sm90_gemm_*_{aux_load,
  reduce,bias_elementwise,dag,evt}.cu tests: linear combination with an auxiliary load (row- and
  column-major, f16 and f32), a per-column bias, the EVT-DAG and DAG-EVT examples, row / column /
  scalar reductions (sum; max, min and max-abs), LinCombPerRowBiasEltActAux (ReLU, GELU, negate;
  with and without C; column-major D), dReLU with a per-row dBias, float8 ScaledLinCombPerRowBias-
  EltAct(AmaxAux) with f32, bf16 and e4m3 outputs, and several outputs of different dtypes. Sizes
  follow TestAllEVT: m in {align, 512 - 3 align}, n in {align, 512 - 2 align}, k in {align,
  tile_k * (stages + 1) - align}, 768 for the ping-pong kernels, and one batched problem of L = 3.

Every result is compared with an independent float64 reference: the epilogue function evaluated by
torch on float64 copies of the (dequantized) inputs. Integer-valued CUTLASS problems must match bit
for bit; others within one rounding of the output dtype plus the accumulation's error (the float8
rule of tests/test_fp8_blockwise_gpu.py). Where a test passes out=, the buffers are NaN-filled and
must come back as given, with the bits of the call without out=.

Run on a Hopper GPU: pytest -n 15 tests/test_peers_deepgemm_cutlass_gpu.py (skips itself elsewhere).
EVTC_PEERS_DEVICE=cpu runs it on CPU tensors (evtc's torch path; kernels still compile for
sm_90a): a check of the tests and of the torch path, not of the kernels.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from peer_checks import ROUNDOFF as UNIT  # noqa: E402
from peer_checks import as_list, close  # noqa: E402
from peer_checks import wide as f64  # noqa: E402

import evtc  # noqa: E402

DEV = os.environ.get("EVTC_PEERS_DEVICE", "cuda")
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
ON_GPU = DEV == "cuda"
pytestmark = [pytest.mark.gpu] if ON_GPU else []
if ON_GPU and not SM90:
    pytestmark.append(
        pytest.mark.skip(
            reason="needs an NVIDIA Hopper (SM90) GPU (EVTC_PEERS_DEVICE=cpu runs the torch path)"
        )
    )

f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32
e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = (e4m3, e5m2)
BLOCK = 128
FP8_TOL = 3e-3  # the accumulation's share of the tolerance for float8 a and b (relative to rms)


def cdiv(x, y):
    return -(-x // y)


# ----------------------------------------------------------------------------------------------
# One disk cache per run, shared by xdist workers.


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    if os.environ.get("EVTC_PEERS_CACHE"):  # a cache kept across runs (fewer rebuilds by hand)
        return os.environ["EVTC_PEERS_CACHE"]
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    path = root / "evtc-peers3-cache"
    path.mkdir(exist_ok=True)
    return str(path)


# ----------------------------------------------------------------------------------------------
# Checking


def exact(out, ref, *, what=""):
    """Bit for bit with the exact (float64) reference rounded once to out's dtype."""
    assert tuple(out.shape) == tuple(ref.shape), f"{what}: shape {tuple(out.shape)}, want {tuple(ref.shape)}"
    want = (ref.to(out.dtype) if ref.dtype != out.dtype else ref).double()
    got = out.double()
    ok = (got == want) | (torch.isnan(got) & torch.isnan(want))
    if not bool(ok.all()):
        i = tuple((~ok).nonzero()[0].tolist())
        raise AssertionError(
            f"{what} ({out.dtype}): {int((~ok).sum())} of {ok.numel()} differ; first at {i}: "
            f"got {got[i].item()!r}, want {want[i].item()!r}"
        )


def sum_close(out, ref, terms_abs, *, rel=1e-5, what=""):
    """A sum reduced in float32 against its float64 value: within rel * sum(|terms|) (then rounded to
    out's dtype)."""
    assert tuple(out.shape) == tuple(ref.shape), f"{what}: shape {tuple(out.shape)}, want {tuple(ref.shape)}"
    err = (f64(out) - f64(ref)).abs()
    tol = rel * f64(terms_abs) + UNIT[out.dtype] * 2 * f64(ref).abs()
    bad = ~(err <= tol)
    assert not bool(bad.any()), (
        f"{what}: {int(bad.sum())} of {bad.numel()} sums off; max err "
        f"{err.max().item():.4g}, tol {tol.flatten()[err.flatten().argmax()].item():.4g}"
    )


def same_bits(x, y):
    x, y = x.double(), y.double()
    return bool(((x == y) | (torch.isnan(x) & torch.isnan(y))).all())


def nan_like(t, col_major=False):
    if col_major and t.dim() >= 2 and t.shape[-1] > 1 and t.shape[-2] > 1:
        store = torch.full((*t.shape[:-2], t.shape[-1], t.shape[-2]), float("nan"), device=t.device)
        return store.to(t.dtype).transpose(-1, -2)
    return torch.full(tuple(t.shape), float("nan"), device=t.device).to(t.dtype)


def poisoned(got, col_major=False):
    if isinstance(got, dict):
        return {k: nan_like(v, col_major) for k, v in got.items()}
    if isinstance(got, (tuple, list)):
        return type(got)(nan_like(v, col_major) for v in got)
    return nan_like(got, col_major)


def expect_path(k, path, what=""):
    if ON_GPU and SM90 and path:
        allowed = (path,) if isinstance(path, str) else tuple(path)
        assert k.last_path in allowed, f"{what}: took the {k.last_path!r} path, expected {allowed}"


def call_and_check(k, a, b, ops, ref, *, check, path="kernel", col_major_out=False, what=""):
    """The call, its check against ref, then again into NaN-filled out= buffers (returned as given,
    the same bits, or the same check for column-major buffers); inputs never written."""
    snap = {n: v.clone() for n, v in ops.items() if torch.is_tensor(v)}
    got = k(a, b, **ops)
    expect_path(k, path, what)
    g, r = as_list(got), as_list(ref)
    assert len(g) == len(r), f"{what}: {len(g)} outputs, the function returns {len(r)}"
    for i, (o, e) in enumerate(zip(g, r, strict=True)):
        check(i, o, e, f"{what} output {i}")
    outs = poisoned(got, col_major_out)
    got2 = k(a, b, **ops, out=outs)
    for o, p in zip(as_list(got2), as_list(outs), strict=True):
        assert o is p, f"{what}: out= tensor not returned as given"
    for i, (x, y) in enumerate(zip(g, as_list(got2), strict=True)):
        if col_major_out:
            check(i, y, r[i], f"{what} output {i} (column-major out=)")
        else:
            assert same_bits(x, y), f"{what} output {i}: out= call gave other bits than the first call"
    for n, v in snap.items():
        assert same_bits(ops[n], v), f"{what}: input {n} was written"
    return got


# ----------------------------------------------------------------------------------------------
# Data


def gen(seed):
    return torch.Generator(device=DEV).manual_seed(seed)


def randn(shape, dtype=f32, g=None, std=1.0):
    return (torch.randn(tuple(shape), generator=g, device=DEV) * std).to(dtype)


def rint(shape, dtype=f16, g=None, lo=-4, hi=4, col_major=False):
    """Integers in [lo, hi), as CUTLASS's testbeds fill f16 tensors."""
    shape = tuple(shape)
    if col_major:
        store = (*shape[:-2], shape[-1], shape[-2])
        return torch.randint(lo, hi, store, generator=g, device=DEV).to(dtype).transpose(-1, -2)
    return torch.randint(lo, hi, shape, generator=g, device=DEV).to(dtype)


def meta(*shape, dtype=f16, col_major=False):
    if col_major:
        return torch.empty((*shape[:-2], shape[-1], shape[-2]), dtype=dtype, device="meta").transpose(-1, -2)
    return torch.empty(shape, dtype=dtype, device="meta")


# ==============================================================================================
# DeepGEMM: quantization as its tests do it (written here from the recipe, not copied)


def quant_per_token(x):
    """x (..., m, k) -> float8 e4m3 (..., m, k) and float32 scales (..., m, ceil(k/128)): each row's
    128-element K block divided by amax / 448 (amax clamped at 1e-4)."""
    *lead, m, k = x.shape
    kp = cdiv(k, BLOCK) * BLOCK
    xp = F.pad(x.float(), (0, kp - k)).view(*lead, m, kp // BLOCK, BLOCK)
    amax = xp.abs().amax(-1).clamp(min=1e-4)
    q = (xp * (448.0 / amax).unsqueeze(-1)).to(e4m3).view(*lead, m, kp)[..., :k].contiguous()
    return q, amax / 448.0


def quant_per_block(x):
    """x (..., n, k) -> float8 e4m3 and float32 scales (..., ceil(n/128), ceil(k/128)) per 128 x 128 block."""
    *lead, n, k = x.shape
    nb, kb = cdiv(n, BLOCK), cdiv(k, BLOCK)
    xp = torch.zeros(*lead, nb * BLOCK, kb * BLOCK, device=x.device)
    xp[..., :n, :k] = x.float()
    v = xp.view(*lead, nb, BLOCK, kb, BLOCK)
    amax = v.abs().amax(dim=(-3, -1), keepdim=True).clamp(min=1e-4)
    q = (v * (448.0 / amax)).to(e4m3).view(*lead, nb * BLOCK, kb * BLOCK)[..., :n, :k].contiguous()
    return q, (amax / 448.0).view(*lead, nb, kb)


def tma_aligned(s, fill=float("nan")):
    """DeepGEMM's column-major, TMA-aligned scale layout: (..., m, kb) values in a buffer of
    (..., kb, ceil(m/4)*4), M contiguous; the padding holds `fill` (NaN: nothing may read it)."""
    *lead, m, kb = s.shape
    buf = torch.full((*lead, kb, cdiv(m, 4) * 4), fill, device=s.device)
    buf[..., :m] = s.transpose(-1, -2)
    return buf.transpose(-1, -2)[..., :m, :]


def a_scales_layout(s, layout):
    if layout == "k-major":  # what per_token_cast_to_fp8 returns
        return s.contiguous()
    if layout == "m-major":  # torch's blockwise scaled_mm layout, pitch m
        return s.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "tma-aligned":  # get_col_major_tma_aligned_tensor
        return tma_aligned(s)
    raise ValueError(layout)


def dequant(q, s, rows, cols=BLOCK):
    """float64 q * its block's scale; s (..., ceil(r/rows), ceil(c/cols))."""
    r, c = q.shape[-2:]
    ri = torch.arange(r, device=q.device) // rows
    ci = torch.arange(c, device=q.device) // cols
    return f64(q) * f64(s)[..., ri[:, None], ci[None, :]]


def calc_diff(x, y):
    """DeepGEMM's similarity measure: 1 - 2<x,y> / (|x|^2 + |y|^2)."""
    x, y = x.double(), y.double()
    return (1 - 2 * (x * y).sum() / (x * x + y * y).sum()).item()


# DeepSeek-V3 (n, k) of DeepGEMM's normal GEMMs (n = the weight's rows, k = the reduction).
DS_NK = [(2112, 7168), (576, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048)]


def ds_shape(n, k):
    """The real shape on the GPU; an eighth of n and k on the CPU (a float64 reference per case
    there): still block edges in n (264, 72), k under one block (64), several K blocks."""
    return (n, k) if ON_GPU else (n // 8, k // 8)


def ds_m(m):
    return m if ON_GPU else min(m, 512)


# Epilogues. Module-level functions: the kernels' names say which peer test they restate.


def dg_gemm_nt(acc):  # gemm_fp8_fp8_bf16_nt: the bf16 product
    return acc


def dg_gemm_nt_acc(acc, c, alpha: float):  # fp8_gemm_nt(..., c=d): d = alpha * a @ b + c, float32
    return (alpha * acc + c).float()


def _dg_ex(lead=(), rows=1):
    em, en, ek = 256, 384, 256
    a_rows = em if rows == 1 else cdiv(em, BLOCK)
    return {
        "a": (
            meta(*lead, em, ek, dtype=e4m3),
            meta(*lead, a_rows, cdiv(ek, BLOCK), dtype=f32, col_major=True),
        ),
        "b": (
            meta(*lead, ek, en, dtype=e4m3, col_major=True),
            meta(*lead, cdiv(ek, BLOCK), cdiv(en, BLOCK), dtype=f32, col_major=True),
        ),
    }


DG_SPECS = {
    "dg_gemm_nt": (dg_gemm_nt, lambda: _dg_ex(), {}),
    "dg_gemm_nt_acc": (
        dg_gemm_nt_acc,
        lambda: {**_dg_ex(), "c": meta(256, 384, dtype=f32), "alpha": 1.0},
        {},
    ),
    "dg_masked": (dg_gemm_nt, lambda: _dg_ex((4,)), {}),
    "dg_blocks_a128": (dg_gemm_nt, lambda: _dg_ex(rows=BLOCK), {}),
}

_KERNELS: dict = {}


def kern(name, cache_dir):
    if name not in _KERNELS:
        fn, ex, kw = {**DG_SPECS, **CL_SPECS}[name]
        _KERNELS[name] = evtc.compile(fn, ex(), cache_dir=cache_dir, **kw)
    return _KERNELS[name]


def dg_construct(m, n, k, seed, a_layout="tma-aligned"):
    """DeepGEMM's construct(): bf16 x (m, k) and y (n, k), x per token, y per block; evtc's b is
    y.t() (K-major) with y's scales transposed alike."""
    g = gen(seed)
    x = randn((m, k), bf16, g)
    y = randn((n, k), bf16, g)
    xq, xs = quant_per_token(x)
    yq, ys = quant_per_block(y)
    a = (xq, a_scales_layout(xs, a_layout))
    b = (yq.t(), ys.t())
    deq = dequant(xq, xs, 1) @ dequant(yq, ys, BLOCK).t()
    return a, b, x, y, deq


DG_CASES = (
    [(128, n, k) for (n, k) in DS_NK]
    + [(64, n, k) for (n, k) in DS_NK[:2]]
    + [(4096, 4096, 7168), (4096, 7168, 2048)]
)


@pytest.mark.parametrize("m,n,k", DG_CASES, ids=lambda v: str(v))
def test_deepgemm_gemm_nt(cache_dir, m, n, k):
    """test_core.py test_gemm: calc_diff against the bf16 product below 1e-3 (DeepGEMM's check), and
    elementwise against the dequantized float64 product; TMA-aligned scales run the kernel."""
    m = ds_m(m)
    n, k = ds_shape(n, k)
    kk = kern("dg_gemm_nt", cache_dir)
    a, b, x, y, deq = dg_construct(m, n, k, seed=m * 7 + n + k)
    what = f"deepgemm {m}x{n}x{k}"

    def check(i, o, e, w):
        assert o.dtype == bf16, f"{w}: float8 a and b give bf16 by default (docs/fp8.md)"
        close(o, e, acc_tol=FP8_TOL, what=w)

    got = call_and_check(kk, a, b, {}, deq, check=check, what=what)
    diff = calc_diff(got, x.double() @ y.double().t())
    assert diff < 1e-3, f"{what}: calc_diff {diff:.3g} (DeepGEMM asserts < 1e-3)"


@pytest.mark.parametrize("m", [1, 129, 257])
def test_deepgemm_odd_m(cache_dir, m):
    """Odd m (decode and ragged prefill): DeepGEMM's m = 1 and its TMA-aligned scales, the pitch
    padded past m; also out= a column slice of a wider buffer (a strided output)."""
    n, k = ds_shape(2112, 7168)
    kk = kern("dg_gemm_nt", cache_dir)
    a, b, x, y, deq = dg_construct(m, n, k, seed=1000 + m)

    def check(i, o, e, w):
        close(o, e, acc_tol=FP8_TOL, what=w)

    got = call_and_check(kk, a, b, {}, deq, check=check, what=f"odd m {m}")
    wide = torch.full((m, n + 8), float("nan"), device=DEV, dtype=bf16)
    view = wide[:, :n]
    assert kk(a, b, out=view) is view
    assert same_bits(view, got), "out= a strided view: other bits"
    assert bool(torch.isnan(wide[:, n:].float()).all()), "out= view: wrote past its columns"


@pytest.mark.parametrize("layout", ["k-major", "m-major", "tma-aligned"])
@pytest.mark.parametrize("m,k", [(4096, 7296), (4097, 128)])
def test_deepgemm_scale_layouts(cache_dir, layout, m, k):
    """generators.py enumerate_sf_layout (mn in {4096, 4097}, k in {128, 7296}: 57 K blocks, one):
    a's scales as per_token_cast returns them, M-major, and TMA-aligned; b's scales in the
    weight's layout transposed and as a contiguous (K/128, N/128) tensor. Same answer each way;
    the TMA-aligned ones reach the kernel without a copy (docs/fp8.md)."""
    m = m if ON_GPU else m // 8 + (m % 2)
    k = k if ON_GPU else (k // 8 if k > 128 else k)
    n = 256
    kk = kern("dg_gemm_nt", cache_dir)
    a, b, x, y, deq = dg_construct(m, n, k, seed=m + k, a_layout=layout)
    aligned = layout == "tma-aligned" or (layout == "m-major" and m % 4 == 0)
    got = kk(a, b)
    expect_path(kk, "kernel" if aligned else ("staged", "kernel"), f"{layout} {m}x{k}")
    close(got, deq, acc_tol=FP8_TOL, what=f"{layout} {m}x{k}")
    b2 = (b[0], b[1].contiguous())
    got2 = kk(a, b2)
    assert same_bits(got, got2), "b's scales row-major: other bits than in the weight's layout"


@pytest.mark.parametrize(
    "m,n,k,alpha", [(128, 2112, 7168, 1.0), (4096, 7168, 2048, 0.5), (77, 576, 7168, 2.0)]
)
def test_deepgemm_accumulate_into_out(cache_dir, m, n, k, alpha):
    """test_fp8.py with accumulate (generate_normal: c = d = randn * 32, d = alpha * a @ b + c,
    float32): as a fresh output, then written in place (out= the c operand itself)."""
    m = ds_m(m)
    n, k = ds_shape(n, k)
    kk = kern("dg_gemm_nt_acc", cache_dir)
    a, b, x, y, deq = dg_construct(m, n, k, seed=m + n + 3)
    d = randn((m, n), f32, gen(m + 17), 32.0)
    d0 = d.clone()
    ref = alpha * deq + f64(d0)
    got = kk(a, b, c=d, alpha=alpha)
    expect_path(kk, "kernel", "accumulate")
    assert got.dtype == f32 and same_bits(d, d0), "the c operand was written without out="
    close(got, ref, acc_tol=FP8_TOL, what="accumulate (fresh output)")
    res = kk(a, b, c=d, alpha=alpha, out=d)
    assert res is d, "out=c not returned as given"
    assert same_bits(d, got), "accumulating in place (out=c) gave other bits than the fresh output"
    diff = calc_diff(d, alpha * (x.double() @ y.double().t()) + f64(d0))
    assert diff < 1e-3, f"calc_diff {diff:.3g}"


@pytest.mark.parametrize("groups,max_m,n,k", [(2, 256, 4096, 2048), (6, 192, 7168, 3072)])
def test_deepgemm_masked_grouped(cache_dir, groups, max_m, n, k):
    """m_grouped_fp8_gemm_nt_masked: one weight per group (batched), each group's rows past its
    masked_m have zeroed scales (DeepGEMM zeroes SFA padding), a's scales TMA-aligned per group.
    evtc computes every row: the masked ones must be exactly zero, the others the product."""
    n, k = ds_shape(n, k)
    g = gen(groups * 1000 + n)
    x = randn((groups, max_m, k), bf16, g)
    y = randn((groups, n, k), bf16, g)
    xq, xs = quant_per_token(x)
    yq, ys = quant_per_block(y)
    masked = [max(1, int(max_m * f)) for f in torch.linspace(0.3, 1.0, groups).tolist()]
    rows = torch.arange(max_m, device=DEV)[None, :] < torch.tensor(masked, device=DEV)[:, None]
    xs = xs * rows[..., None]
    kk = kern("dg_masked", cache_dir)
    a = (xq, tma_aligned(xs))
    b = (yq.transpose(-1, -2), ys.transpose(-1, -2))
    deq = dequant(xq, xs, 1) @ dequant(yq, ys, BLOCK).transpose(-1, -2)

    def check(i, o, e, w):
        close(o, e, acc_tol=FP8_TOL, what=w)

    got = call_and_check(kk, a, b, {}, deq, check=check, what=f"masked {groups}x{max_m}x{n}x{k}")
    assert bool((got.float()[~rows] == 0).all()), "rows with zero scales are not exactly zero"
    for j, mj in enumerate(masked):
        diff = calc_diff(got[j, :mj], x[j, :mj].double() @ y[j].double().t())
        assert diff < 1e-3, f"group {j}: calc_diff {diff:.3g}"


@pytest.mark.parametrize("weight_layout", ["k-major copy", "as stored (n-major)"])
def test_deepgemm_dgrad(cache_dir, weight_layout):
    """generators.py's dgrad: grad_x = grad_y @ w, the same weight and block scales as the forward
    GEMM read the other way round: b = w (K = out_features), b's scales w's own (N/128, K/128)
    untransposed. SM90 DeepGEMM takes the weight K-major; evtc stages an N-major one."""
    m = 128
    n_out, k_in = ds_shape(2112, 7168)
    g = gen(55)
    dy = randn((m, n_out), bf16, g)
    w = randn((n_out, k_in), bf16, g)
    dq, ds = quant_per_token(dy)
    wq, ws = quant_per_block(w)
    bt = wq.t().contiguous().t() if weight_layout == "k-major copy" else wq
    kk = kern("dg_gemm_nt", cache_dir)
    deq = dequant(dq, ds, 1) @ dequant(wq, ws, BLOCK)
    got = kk((dq, tma_aligned(ds)), (bt, ws))
    expect_path(kk, "kernel" if weight_layout == "k-major copy" else "staged", weight_layout)
    close(got, deq, acc_tol=FP8_TOL, what=f"dgrad ({weight_layout})")
    assert calc_diff(got, dy.double() @ w.double()) < 1e-3


def test_deepgemm_blocks_128x128_on_a(cache_dir):
    """torch's (and DeepGEMM's per_block_cast) 128 x 128 blocks on the activation side too, at a
    ragged m: a's scales (ceil(m/128), k/128)."""
    m = 300
    n, k = ds_shape(2112, 7168)
    g = gen(77)
    x = randn((m, k), bf16, g)
    y = randn((n, k), bf16, g)
    xq, xs = quant_per_block(x)
    yq, ys = quant_per_block(y)
    kk = kern("dg_blocks_a128", cache_dir)
    deq = dequant(xq, xs, BLOCK) @ dequant(yq, ys, BLOCK).t()

    def check(i, o, e, w):
        close(o, e, acc_tol=FP8_TOL, what=w)

    call_and_check(kk, (xq, xs), (yq.t(), ys.t()), {}, deq, check=check, what="128x128 a blocks")


def test_deepgemm_wgrad_per_token_b_scales_refused_by_name(cache_dir):
    """The wgrad recipe (1D1D: both operands per-token, b's scales (K/128, N)) is documented as not
    taken (b's blocks are 128 x 128): the call must say which shape it takes, not compute garbage."""
    m, n, k = 128, 384, 512
    g = gen(91)
    xq, xs = quant_per_token(randn((m, k), bf16, g))
    yq, ys = quant_per_token(randn((n, k), bf16, g))
    kk = kern("dg_gemm_nt", cache_dir)
    with pytest.raises(evtc.CallError, match=r"b's block scales have shape \(4, 384\).*\(4, 3\)"):
        kk((xq, tma_aligned(xs)), (yq.t(), ys.t()))


# ==============================================================================================
# CUTLASS SM90 EVT unit tests (sm90_evt_operations.hpp and the sm90_gemm_*.cu that use it)


def cl_lincomb_aux(acc, C, aux, alpha: float, beta: float):  # Sm90LinCombAuxLoad / HostEVTAuxLoad
    return beta * C + (alpha * acc + aux)


def cl_lincomb_colbias(acc, C, bias, alpha: float, beta: float):  # Sm90LinCombPerColumnBias: bias (N,)
    return beta * C + (alpha * acc + bias)


def cl_evt_dag(acc, C, aux, alpha: float, beta: float):  # Sm90LinCombEVTDAG
    t = alpha * acc + aux
    return beta * C + (torch.relu(t) + aux)


def cl_dag_evt(acc, C, bias, alpha: float):  # Sm90LinCombDAGEVT: aux store of the EVT, bias (M, 1)
    evt = alpha * acc + C
    return torch.maximum(evt + bias, evt), evt


# HostReduce: the f16 linear combination stored as D, and reduced after its rounding (ElementOutput).
def cl_reduce_cols(acc, C, alpha: float, beta: float):  # Sm90LinCombPerColumnReduce (N values)
    y = (alpha * acc + beta * C).to(torch.float16)
    return y, y.sum(-2, dtype=torch.float32)


def cl_reduce_rows(acc, C, alpha: float, beta: float):  # Sm90LinCombPerRowReduce (M values)
    y = (alpha * acc + beta * C).to(torch.float16)
    return y, y.float().sum(-1)


def cl_reduce_scalar(acc, C, alpha: float, beta: float):  # Sm90LinCombScalarReduce
    y = (alpha * acc + beta * C).to(torch.float16)
    return y, y.sum(dtype=torch.float32)


def cl_reduce_stats(acc, C, alpha: float, beta: float):  # max / min / max-abs reductions, no D at all
    y = alpha * acc + beta * C
    return y.amax(-1), y.amax(-2), y.amin(-1), y.abs().amax()


# LinCombPerRowBiasEltActAux: Z = alpha * acc + beta * C + bias (per row, M), D = act(Z), T = Z.
def cl_bias_relu(acc, C, bias, alpha: float, beta: float):
    z = alpha * acc + beta * C + bias
    return torch.relu(z), z


def cl_bias_gelu(acc, C, bias, alpha: float, beta: float):
    z = alpha * acc + beta * C + bias
    return F.gelu(z), z


def cl_bias_negate(acc, C, bias, alpha: float, beta: float):
    z = alpha * acc + beta * C + bias
    return -z, z


def cl_bias_relu_void_c(acc, bias, alpha: float):  # BiasF16_ReLU_VoidC
    z = alpha * acc + bias
    return torch.relu(z), z


def cl_bias_relu_no_t(acc, C, bias, alpha: float, beta: float):  # BiasF32_ReLU_NoStoreT
    return torch.relu(alpha * acc + beta * C + bias)


def cl_drelu_dbias(acc, z, alpha: float):  # LinCombDeEltActDePerRowBias<dReLU>, VoidC
    d = torch.where(z > 0, alpha * acc, 0.0)
    return d, d.sum(-1, dtype=torch.float32)


# Sm90ScaledLinCombPerRowBiasEltAct(AmaxAux): Z = sa * sb * alpha * acc + sc * beta * C + bias (M, 1)
def _z(acc, C, bias, sa, sb, sc, alpha, beta):
    return sa * sb * alpha * acc + sc * beta * C + bias


def cl_fp8_act_f32(acc, C, bias, sa, sb, sc, alpha: float, beta: float):
    return torch.relu(_z(acc, C, bias, sa, sb, sc, alpha, beta)).float()


def cl_fp8_act_aux_bf16(acc, C, bias, sa, sb, sc, alpha: float, beta: float):
    z = _z(acc, C, bias, sa, sb, sc, alpha, beta)
    return torch.relu(z), z


def cl_fp8_act_amax_aux_e4m3(acc, C, bias, sa, sb, sc, sd, saux, alpha: float, beta: float):
    z = _z(acc, C, bias, sa, sb, sc, alpha, beta)
    y = torch.relu(z)
    return (sd * y).to(e4m3), y.abs().amax(), (saux * z).to(e4m3), z.abs().amax()


def cl_multi_dtype(acc, C, bias, s8):  # several outputs of different dtypes, with reductions
    z = acc + C + bias
    y = F.gelu(z)
    return (
        y.to(torch.float16),
        z.float(),
        y.to(torch.bfloat16),
        (y * s8).to(e5m2),
        y.sum(-1),
        z.amax(-2),
        y.abs().amax(),
    )


CEM, CEN, CEK, CL = 256, 512, 128, 3


def _cab(dtype=f16, lead=()):
    return {"a": meta(*lead, CEM, CEK, dtype=dtype), "b": meta(*lead, CEK, CEN, dtype=dtype, col_major=True)}


def _scal():
    return meta(dtype=f32)


CL_SPECS = {
    "cl_aux_f16_row": (
        cl_lincomb_aux,
        lambda: {**_cab(), "C": meta(CEM, CEN), "aux": meta(CEM, CEN), "alpha": 1.0, "beta": 1.0},
        {},
    ),
    "cl_aux_f16_col": (
        cl_lincomb_aux,
        lambda: {
            **_cab(),
            "C": meta(CEM, CEN),
            "aux": meta(CEM, CEN, col_major=True),
            "alpha": 1.0,
            "beta": 1.0,
        },
        {},
    ),
    "cl_aux_f32_col": (
        cl_lincomb_aux,
        lambda: {
            **_cab(),
            "C": meta(CEM, CEN),
            "aux": meta(CEM, CEN, dtype=f32, col_major=True),
            "alpha": 1.0,
            "beta": 1.0,
        },
        {"out_dtypes": f16},
    ),
    "cl_aux_f16_row_batched": (
        cl_lincomb_aux,
        lambda: {
            **_cab(lead=(CL,)),
            "C": meta(CL, CEM, CEN),
            "aux": meta(CL, CEM, CEN),
            "alpha": 1.0,
            "beta": 1.0,
        },
        {},
    ),
    "cl_colbias_f16": (
        cl_lincomb_colbias,
        lambda: {**_cab(), "C": meta(CEM, CEN), "bias": meta(CEN), "alpha": 1.0, "beta": 1.0},
        {},
    ),
    "cl_colbias_f32": (
        cl_lincomb_colbias,
        lambda: {**_cab(), "C": meta(CEM, CEN), "bias": meta(CEN, dtype=f32), "alpha": 1.0, "beta": 1.0},
        {"out_dtypes": f16},
    ),
    "cl_evt_dag": (
        cl_evt_dag,
        lambda: {**_cab(), "C": meta(CEM, CEN), "aux": meta(CEM, CEN), "alpha": 1.0, "beta": 1.0},
        {},
    ),
    "cl_dag_evt": (
        cl_dag_evt,
        lambda: {**_cab(), "C": meta(CEM, CEN), "bias": meta(CEM, 1), "alpha": 1.0},
        {},
    ),
    **{
        f"cl_{name}": (
            fn,
            lambda: {**_cab(lead=(CL,)), "C": meta(CL, CEM, CEN), "alpha": 1.0, "beta": 1.0},
            {},
        )
        for name, fn in [
            ("reduce_cols", cl_reduce_cols),
            ("reduce_rows", cl_reduce_rows),
            ("reduce_scalar", cl_reduce_scalar),
        ]
    },
    "cl_reduce_stats": (
        cl_reduce_stats,
        lambda: {**_cab(), "C": meta(CEM, CEN), "alpha": 1.0, "beta": 1.0},
        {},
    ),
    **{
        f"cl_bias_{name}": (
            fn,
            lambda: {
                **_cab(),
                "C": meta(CEM, CEN),
                "bias": meta(CEM, 1, dtype=f32),
                "alpha": 1.0,
                "beta": 1.0,
            },
            {"out_dtypes": f16},
        )
        for name, fn in [("relu", cl_bias_relu), ("gelu", cl_bias_gelu), ("negate", cl_bias_negate)]
    },
    "cl_bias_relu_void_c": (cl_bias_relu_void_c, lambda: {**_cab(), "bias": meta(CEM, 1), "alpha": 1.0}, {}),
    "cl_bias_relu_col_major": (
        cl_bias_relu_no_t,
        lambda: {
            **_cab(),
            "C": meta(CEM, CEN, col_major=True),
            "bias": meta(CEM, 1, dtype=f32),
            "alpha": 1.0,
            "beta": 1.0,
        },
        {"out_dtypes": f16, "config": {"d_major": "m"}},
    ),
    "cl_drelu_dbias": (cl_drelu_dbias, lambda: {**_cab(), "z": meta(CEM, CEN), "alpha": 1.0}, {}),
    "cl_fp8_f32": (
        cl_fp8_act_f32,
        lambda: {
            **_cab(e4m3),
            "C": meta(CEM, CEN, dtype=f32, col_major=True),
            "bias": meta(CEM, 1, dtype=f32),
            "sa": _scal(),
            "sb": _scal(),
            "sc": _scal(),
            "alpha": 1.0,
            "beta": 1.0,
        },
        {"config": {"d_major": "m"}},
    ),
    "cl_fp8_bf16": (
        cl_fp8_act_aux_bf16,
        lambda: {
            **_cab(e4m3),
            "C": meta(CEM, CEN, dtype=bf16),
            "bias": meta(CEM, 1, dtype=bf16),
            "sa": _scal(),
            "sb": _scal(),
            "sc": _scal(),
            "alpha": 1.0,
            "beta": 1.0,
        },
        {},
    ),
    "cl_fp8_e4m3": (
        cl_fp8_act_amax_aux_e4m3,
        lambda: {
            **_cab(e4m3),
            "C": meta(CEM, CEN, dtype=bf16),
            "bias": meta(CEM, 1, dtype=bf16),
            "sa": _scal(),
            "sb": _scal(),
            "sc": _scal(),
            "sd": _scal(),
            "saux": _scal(),
            "alpha": 1.0,
            "beta": 1.0,
        },
        {},
    ),
    "cl_multi_dtype": (
        cl_multi_dtype,
        lambda: {**_cab(), "C": meta(CEM, CEN), "bias": meta(CEN, dtype=f32), "s8": _scal()},
        {},
    ),
}


def cl_ab(m, n, k, g, dtype=f16, lead=()):
    """CUTLASS's A row-major (K-major) and B column-major (K-major: b = w.t()), integer-valued."""
    a = rint((*lead, m, k), dtype, g)
    b = rint((*lead, n, k), dtype, g).transpose(-1, -2)
    return a, b


def ref64(fn, a, b, **ops):
    return fn(torch.matmul(f64(a), f64(b)), **{k: f64(v) for k, v in ops.items()})


def _exact_check(i, o, e, w):
    exact(o, e, what=w)


# TestAllEVT's sizes for 16-bit A and B (alignment 8): m in {8, 488}, n in {8, 496}, k in {8, 312};
# the ping-pong tests add 768.
CL_SIZES = [(8, 8, 8), (488, 496, 312), (768, 768, 312)]
CL_SIZES2 = [(8, 496, 312), (488, 8, 8), (768, 768, 312)]


@pytest.mark.parametrize(
    "variant,m,n,k",
    [(v, *s) for v in ("f16_row", "f16_col", "f32_col") for s in CL_SIZES[1:]] + [("f16_row", 264, 264, 168)],
)
def test_cutlass_aux_load(cache_dir, variant, m, n, k):
    """sm90_..._aux_load.cu: D = beta * C + (alpha * acc + aux), aux f16 row- and column-major and f32
    column-major (D f16 throughout, as CUTLASS's ElementOutput); the batched problem once, as
    TestAllEVT runs it."""
    batched = (m, n, k) == (264, 264, 168)
    name = "cl_aux_f16_row_batched" if batched else f"cl_aux_{variant}"
    kk = kern(name, cache_dir)
    lead = (CL,) if batched else ()
    g = gen(m * 3 + n + k)
    a, b = cl_ab(m, n, k, g, lead=lead)
    aux = rint((*lead, m, n), f32 if variant == "f32_col" else f16, g, col_major=variant != "f16_row")
    ops = {"C": rint((*lead, m, n), f16, g), "aux": aux, "alpha": 1.5, "beta": 0.5}
    got = call_and_check(
        kk,
        a,
        b,
        ops,
        ref64(cl_lincomb_aux, a, b, **ops),
        check=_exact_check,
        path=None if m == 8 else "kernel",
        what=f"{name} {m}x{n}x{k}",
    )
    assert got.dtype == f16


@pytest.mark.parametrize("m,n,k", CL_SIZES2[:2])
@pytest.mark.parametrize("bias_dtype", [f16, f32])
def test_cutlass_per_column_bias(cache_dir, bias_dtype, m, n, k):
    """Sm90LinCombPerColumnBias: D = beta * C + (alpha * acc + bias[n])."""
    kk = kern("cl_colbias_f16" if bias_dtype == f16 else "cl_colbias_f32", cache_dir)
    g = gen(m + n * 5 + k)
    a, b = cl_ab(m, n, k, g)
    ops = {"C": rint((m, n), f16, g), "bias": rint((n,), bias_dtype, g, -8, 8), "alpha": 2.0, "beta": -1.0}
    call_and_check(
        kk,
        a,
        b,
        ops,
        ref64(cl_lincomb_colbias, a, b, **ops),
        check=_exact_check,
        path=None,
        what=f"colbias {bias_dtype} {m}x{n}x{k}",
    )


@pytest.mark.parametrize("m,n,k", CL_SIZES[1:])
def test_cutlass_evt_dag(cache_dir, m, n, k):
    """sm90_..._dag.cu EVTDAG: D = beta * C + (relu(alpha * acc + aux) + aux); aux read twice."""
    kk = kern("cl_evt_dag", cache_dir)
    g = gen(m * 11 + n + k)
    a, b = cl_ab(m, n, k, g)
    ops = {"C": rint((m, n), f16, g), "aux": rint((m, n), f16, g, -40, 40), "alpha": 0.5, "beta": 2.0}
    call_and_check(
        kk,
        a,
        b,
        ops,
        ref64(cl_evt_dag, a, b, **ops),
        check=_exact_check,
        path=None,
        what=f"evt_dag {m}x{n}x{k}",
    )


@pytest.mark.parametrize("m,n,k", CL_SIZES[:2])
def test_cutlass_dag_evt(cache_dir, m, n, k):
    """sm90_..._dag.cu DAGEVT: EVT = alpha * acc + C stored as an f16 aux, D = maximum(EVT + bias[m],
    EVT) with NaN propagation (a NaN and an infinity in the bias: maximum_with_default_nan_propagation
    and torch.maximum both propagate NaN)."""
    kk = kern("cl_dag_evt", cache_dir)
    g = gen(m * 13 + n + k)
    a, b = cl_ab(m, n, k, g)
    bias = rint((m, 1), f16, g, -8, 8)
    bias[m // 2, 0] = float("nan")
    bias[m - 1, 0] = float("-inf")
    ops = {"C": rint((m, n), f16, g), "bias": bias, "alpha": 1.5}
    ref = ref64(cl_dag_evt, a, b, **ops)
    got = call_and_check(kk, a, b, ops, ref, check=_exact_check, path=None, what=f"dag_evt {m}x{n}x{k}")
    assert bool(torch.isnan(got[0][m // 2].float()).all()), "maximum(NaN, x) must be NaN (torch.maximum)"


@pytest.mark.parametrize("L,m,n,k", [(1, 8, 8, 8), (1, 488, 496, 312), (3, 264, 264, 168)])
@pytest.mark.parametrize("axis", ["cols", "rows", "scalar"])
def test_cutlass_reduce(cache_dir, axis, L, m, n, k):
    """sm90_..._reduce.cu (RowReduce / ColumnReduce / ScalarReduce, cutlass::plus): D is the f16
    linear combination, reduced after its rounding; CUTLASS reduces across L as well, which evtc
    does per batch: the batches' sum must be CUTLASS's value."""
    fn = {"cols": cl_reduce_cols, "rows": cl_reduce_rows, "scalar": cl_reduce_scalar}[axis]
    kk = kern(f"cl_reduce_{axis}", cache_dir)
    g = gen(L * 1000 + m + n + k)
    a, b = cl_ab(m, n, k, g, lead=(L,))
    ops = {"C": rint((L, m, n), f16, g), "alpha": 1.5, "beta": 0.5}
    ref = ref64(fn, a, b, **ops)
    y_abs = ref[0].double().abs()

    def check(i, o, e, w):
        if i == 0 or axis != "scalar":
            exact(o, e, what=w)  # integers and halves: exact in float32 at these sizes
        else:
            sum_close(o, e, y_abs.sum(), what=w)

    got = call_and_check(kk, a, b, ops, ref, check=check, path=None, what=f"reduce {axis} L={L} {m}x{n}x{k}")
    y = ref[0].double()
    if axis == "cols":
        exact(got[1].sum(0) if got[1].dim() == 2 else got[1], y.sum((0, 1)), what="across batches")
    elif axis == "rows":
        assert got[1].shape == (L, m)


@pytest.mark.parametrize("m,n,k", CL_SIZES2[1:])
def test_cutlass_reduce_max_min_amax_only(cache_dir, m, n, k):
    """Max, min and max-abs reductions (cutlass::maximum / maximum_absolute_value_reduction) with no
    tile output; half the rows all negative (padding read as zero would show), exact."""
    kk = kern("cl_reduce_stats", cache_dir)
    g = gen(m * 17 + n + k)
    a, b = cl_ab(m, n, k, g)
    C = rint((m, n), f16, g)
    C[::2] -= 2000
    ops = {"C": C, "alpha": 0.5, "beta": 1.0}
    call_and_check(
        kk,
        a,
        b,
        ops,
        ref64(cl_reduce_stats, a, b, **ops),
        check=_exact_check,
        path=None,
        what=f"max/min/amax {m}x{n}x{k}",
    )


@pytest.mark.parametrize("m,n,k", [(488, 496, 312), (768, 8, 312)])
@pytest.mark.parametrize("act", ["relu", "gelu", "negate"])
def test_cutlass_bias_elementwise(cache_dir, act, m, n, k):
    """sm90_..._bias_elementwise.cu (LinCombPerRowBiasEltActAux, bias f32 per row, StoreT):
    D = act(Z), T = Z, both f16; the second call writes column-major out= buffers."""
    fn = {"relu": cl_bias_relu, "gelu": cl_bias_gelu, "negate": cl_bias_negate}[act]
    kk = kern(f"cl_bias_{act}", cache_dir)
    g = gen(m + n + k + len(act))
    a, b = cl_ab(m, n, k, g)
    ops = {"C": rint((m, n), f16, g), "bias": randn((m, 1), f32, g, 4.0), "alpha": 1.0, "beta": 1.0}
    ref = ref64(fn, a, b, **ops)

    def check(i, o, e, w):
        assert o.dtype == f16
        close(o, e, what=w)  # a float32 bias: D rounds once (GELU to within a few float32 ulp)

    call_and_check(kk, a, b, ops, ref, check=check, col_major_out=True, what=f"bias {act} {m}x{n}x{k}")


@pytest.mark.parametrize("m,n,k", CL_SIZES[1:])
def test_cutlass_bias_f16_relu_void_c(cache_dir, m, n, k):
    """BiasF16_ReLU_VoidC: no C; Z = alpha * acc + bias (f16), D = relu(Z), T = Z."""
    kk = kern("cl_bias_relu_void_c", cache_dir)
    g = gen(m * 19 + n + k)
    a, b = cl_ab(m, n, k, g)
    ops = {"bias": rint((m, 1), f16, g, -30, 30), "alpha": 0.5}
    call_and_check(
        kk,
        a,
        b,
        ops,
        ref64(cl_bias_relu_void_c, a, b, **ops),
        check=_exact_check,
        path=None,
        what=f"bias relu void C {m}x{n}x{k}",
    )


@pytest.mark.parametrize("m,n,k", [(488, 496, 312), (8, 768, 8)])
def test_cutlass_bias_relu_column_major(cache_dir, m, n, k):
    """The f32n variant: C and D column-major (LayoutC = ColumnMajor), compiled with d_major="m" (evtc
    documents d_major="m" for one full-tile output: the NoStoreT form; the aux T column-major is
    test_cutlass_bias_elementwise's column-major out=)."""
    kk = kern("cl_bias_relu_col_major", cache_dir)
    g = gen(m + 7 * n + k)
    a, b = cl_ab(m, n, k, g)
    ops = {
        "C": rint((m, n), f16, g, col_major=True),
        "bias": rint((m, 1), f32, g, -8, 8),
        "alpha": 1.0,
        "beta": 2.0,
    }
    got = call_and_check(
        kk,
        a,
        b,
        ops,
        ref64(cl_bias_relu_no_t, a, b, **ops),
        check=_exact_check,
        path=None,
        what=f"bias relu column-major {m}x{n}x{k}",
    )
    if m > 1 and n > 1:
        assert got.stride(-2) == 1, f"d_major='m': D should be column-major, strides {got.stride()}"


@pytest.mark.parametrize("m,n,k", CL_SIZES[::2])
def test_cutlass_drelu_dbias(cache_dir, m, n, k):
    """dReLU_dBias_VoidC: D = dReLU(alpha * acc, Z) (the gradient where the stored pre-activation is
    positive), dBias = D summed per row (float32)."""
    kk = kern("cl_drelu_dbias", cache_dir)
    g = gen(m * 23 + n + k)
    a, b = cl_ab(m, n, k, g)
    ops = {"z": rint((m, n), f16, g), "alpha": 1.0}
    call_and_check(
        kk,
        a,
        b,
        ops,
        ref64(cl_drelu_dbias, a, b, **ops),
        check=_exact_check,
        path=None,
        what=f"drelu dbias {m}x{n}x{k}",
    )


# float8 TestAllEVT (alignment 16): m in {16, 464}, n in {16, 480}, k in {16, 624}; batched skipped.
CL_FP8_SIZES = [(16, 16, 16), (464, 480, 624)]


def _fp8_ops(m, n, k, g, c_dtype, c_col, with_out_scales):
    a = randn((m, k), e4m3, g, 2.0)
    b = randn((n, k), e4m3, g, 2.0).t()
    sc = lambda v: torch.tensor(v, device=DEV)  # noqa: E731
    ops = {
        "C": randn((m, n), c_dtype, g) if not c_col else randn((n, m), c_dtype, g).t(),
        "bias": randn((m, 1), c_dtype, g),
        "sa": sc(0.5),
        "sb": sc(0.25),
        "sc": sc(2.0),
        "alpha": 1.5,
        "beta": 0.75,
    }
    if with_out_scales:
        ops["sd"], ops["saux"] = sc(2.0), sc(2.0)  # below e4m3's 448
    return a, b, ops


@pytest.mark.parametrize("m,n,k", CL_FP8_SIZES)
@pytest.mark.parametrize("out", ["f32_col", "bf16", "e4m3_amax"])
def test_cutlass_fp8_scaled_lincomb(cache_dir, out, m, n, k):
    """sm90_gemm_f8_f8_{f32,bf16,f8}_tensor_op_fp32_evt.cu: Z = scale_a * scale_b * alpha * acc +
    scale_c * beta * C + bias[m] (scales device scalars); D = relu(Z) (f32 column-major), or with the
    aux Z (bf16), or scale_d * relu(Z) in e4m3 with amax_d = max|relu(Z)|, aux = scale_aux * Z in e4m3
    with amax_aux = max|Z|. (CUTLASS's f8 test reads an e4m3 C; evtc takes C in bf16 here and refuses
    a float8 one: test_cutlass_documented_operand_dtype_refusals.)"""
    name = {"f32_col": "cl_fp8_f32", "bf16": "cl_fp8_bf16", "e4m3_amax": "cl_fp8_e4m3"}[out]
    fn = {"f32_col": cl_fp8_act_f32, "bf16": cl_fp8_act_aux_bf16, "e4m3_amax": cl_fp8_act_amax_aux_e4m3}[out]
    kk = kern(name, cache_dir)
    g = gen(m + n + k + len(out))
    a, b, ops = _fp8_ops(m, n, k, g, f32 if out == "f32_col" else bf16, out == "f32_col", out == "e4m3_amax")
    ref = ref64(fn, a, b, **ops)
    dts = {"f32_col": [f32], "bf16": [bf16, bf16], "e4m3_amax": [e4m3, f32, e4m3, f32]}[out]

    def check(i, o, e, w):
        assert o.dtype == dts[i], f"{w}: dtype {o.dtype}, want {dts[i]}"
        close(o, e, acc_tol=FP8_TOL, what=w)

    got = call_and_check(kk, a, b, ops, ref, check=check, path=None, what=f"fp8 {out} {m}x{n}x{k}")
    if out == "f32_col" and m > 1 and n > 1:
        assert as_list(got)[0].stride(-2) == 1, "d_major='m': D should be column-major"


@pytest.mark.parametrize("m,n,k", [(488, 496, 312), (8, 8, 8)])
def test_cutlass_several_outputs_of_different_dtypes(cache_dir, m, n, k):
    """Aux stores of f16, f32, bf16 and e5m2 beside row, column and scalar reductions in one kernel."""
    kk = kern("cl_multi_dtype", cache_dir)
    g = gen(m * 29 + n + k)
    a = randn((m, k), f16, g, k**-0.25)
    b = randn((n, k), f16, g, k**-0.25).t()
    ops = {"C": randn((m, n), f16, g), "bias": randn((n,), f32, g), "s8": torch.tensor(64.0, device=DEV)}
    ref = ref64(cl_multi_dtype, a, b, **ops)
    dts = [f16, f32, bf16, e5m2, f32, f32, f32]  # reductions of the float32 y (bias f32 promotes)
    y_abs = F.gelu(torch.matmul(f64(a), f64(b)) + f64(ops["C"]) + f64(ops["bias"])).abs()

    def check(i, o, e, w):
        assert o.dtype == dts[i], f"{w}: dtype {o.dtype}, want {dts[i]}"
        if i == 4:
            sum_close(o, e, y_abs.sum(-1), rel=1e-4, what=w)
        else:
            close(o, e, acc_tol=1e-4, what=w)

    call_and_check(kk, a, b, ops, ref, check=check, path=None, what=f"multi-dtype {m}x{n}x{k}")


def test_cutlass_documented_operand_dtype_refusals(cache_dir):
    """CUTLASS reads an e4m3 C (f8 test), an int8 bias (BiasS8) and a 1-bit mask (dReLU's aux);
    evtc documents epilogue tensors as f32 / f16 / bf16: each must be refused at compile time by a
    DTypeError that names the operand and its dtype."""
    cases = [
        (
            lambda acc, C, s: acc + s * C.float(),
            {"C": meta(CEM, CEN, dtype=e4m3), "s": _scal()},
            "C",
            "float8_e4m3fn",
        ),
        (lambda acc, bias: torch.relu(acc + bias), {"bias": meta(CEM, 1, dtype=torch.int8)}, "bias", "int8"),
        (
            lambda acc, mask: torch.where(mask, acc, 0.0),
            {"mask": meta(CEM, CEN, dtype=torch.bool)},
            "mask",
            "bool",
        ),
    ]
    for fn, ops, name, dt in cases:
        with pytest.raises(evtc.DTypeError, match=rf"'{name}'.*{dt}"):
            evtc.compile(fn, {**_cab(e4m3 if name == "C" else f16), **ops}, cache_dir=cache_dir)


# ==============================================================================================
# More of DeepGEMM's cases (kept after the epilogues above, whose lines key the disk cache)


def test_deepgemm_tensorwise_as_expanded_block_scales(cache_dir):
    """One scale per tensor written as block scales (an expanded view, stride 0, on both sides): a's
    cannot be read by TMA as they are (a copy, docs/fp8.md), b's are read at any strides."""
    m = 256
    n, k = ds_shape(2112, 7168)
    g = gen(61)
    xq = randn((m, k), e4m3, g, 2.0)
    wq = randn((n, k), e4m3, g, 2.0)
    sa = torch.full((1, 1), 0.01, device=DEV).expand(m, cdiv(k, BLOCK))
    sb = torch.full((1, 1), 0.02, device=DEV).expand(cdiv(k, BLOCK), cdiv(n, BLOCK))
    kk = kern("dg_gemm_nt", cache_dir)
    got = kk((xq, sa), (wq.t(), sb))
    expect_path(kk, ("staged", "kernel"), "expanded scales")
    close(got, (f64(xq) @ f64(wq).t()) * (0.01 * 0.02), acc_tol=FP8_TOL, what="expanded block scales")


@pytest.mark.parametrize("b_rank", ["2-d", "batch of 1"])
def test_deepgemm_grouped_one_shared_weight(cache_dir, b_rank):
    """Groups of tokens through one expert (m_grouped with a single weight): a batched (G, M, K) with
    a 2-d b or a b of batch 1, on the kernel compiled for equal batches (a 2-d operand beside a 3-d
    one is taken, docs/epilogues.md)."""
    groups, m = 4, 192
    n, k = ds_shape(4096, 2048)
    g = gen(62)
    xq, xs = quant_per_token(randn((groups, m, k), bf16, g))
    yq, ys = quant_per_block(randn((n, k), bf16, g))
    b = (yq.t(), ys.t()) if b_rank == "2-d" else (yq.t()[None], ys.t()[None])
    kk = kern("dg_masked", cache_dir)
    got = kk((xq, tma_aligned(xs)), b)
    deq = dequant(xq, xs, 1) @ dequant(yq, ys, BLOCK).t()
    close(got, deq, acc_tol=FP8_TOL, what=f"shared weight ({b_rank})")


@pytest.mark.parametrize("layout", ["strided rows", "column-major"])
def test_deepgemm_accumulate_into_a_strided_out(cache_dir, layout):
    """d = a @ b + c written in place (out= the c operand itself) where c is a column slice of a
    wider buffer (row pitch n + 3 floats: not 16-byte) or column-major: the columns past n untouched."""
    m = 200
    n, k = ds_shape(2112, 7168)
    kk = kern("dg_gemm_nt_acc", cache_dir)
    a, b, x, y, deq = dg_construct(m, n, k, seed=63)
    if layout == "strided rows":
        wide = randn((m, n + 3), f32, gen(64), 32.0)
        c = wide[:, :n]
    else:
        wide = randn((n, m), f32, gen(64), 32.0)
        c = wide.t()
    before = wide.clone()
    ref = deq + f64(c)
    res = kk(a, b, c=c, alpha=1.0, out=c)
    assert res is c
    close(c, ref, acc_tol=FP8_TOL, what=f"accumulate into {layout} out=c")
    if layout == "strided rows":
        assert same_bits(wide[:, n:], before[:, n:]), "wrote past out='s columns"


def test_cutlass_cross_batch_row_reduce_refused_by_name():
    """CUTLASS's RowReduce sums over L and M (one N vector for all batches); evtc documents reductions
    over the batch dim as not taken: the refusal must name the dims and what is taken."""

    def across(acc):
        return acc, acc.sum(dim=(0, 1))

    with pytest.raises(evtc.ReductionError, match=r"dim\(s\) \[0, 1\].*per column"):
        evtc.trace(across, _cab(lead=(CL,)))
