"""Two more peers' GEMM-epilogue test suites, restated against evtc's public API, first written as
adversarial probes (GPU; EVTC_PEERS_DEVICE=cpu runs the same tests on CPU tensors through evtc's torch path).

What each group restates (read, not copied: every epilogue, size and check here is this file's own):

* NVIDIA/TransformerEngine tests/pytorch:
  - test_numerics.py test_linear_accuracy / test_noncontiguous and test_fusible_ops.py
    TestFusedOps.test_forward_linear_bias_activation: a linear layer with and without a bias, inputs of
    1 to 4 dims, weights (32, 64) and (3, 5), a transposed (non-contiguous) input;
  - test_fusible_ops.py test_forward_linear_bias_add / test_forward_linear_scale_add (scale 1, 0,
    -2.5, 3.5): GEMM + bias + residual, GEMM * scale + residual;
  - test_float8_blockwise_gemm_exact.py (use_gelu, use_grad, accumulate): GEMM + bias + GELU with the
    pre-activation kept as an auxiliary output; dGELU from that auxiliary tensor, with dbias;
    accumulation into an existing float32 output (beta = 1, out= the accumulator itself);
  - test_float8_current_scaling_exact.py test_current_scaling_gemm_versus_reference and
    test_numerics.py test_fp8gemm_with_unfused_quantization: per-tensor (current) scaled e4m3 GEMM
    with float32 output, accumulation, the output quantized to e4m3 in the epilogue (must equal
    quantizing the unquantized output) and its amax;
  - output dtype other than the inputs' (float32 / bfloat16 from float16 operands, out_dtypes);
    transposed operands (TE's transa / transb, x_columnwise / w_columnwise);
  - test_fusible_ops.py test_activation / test_clamped_swiglu / test_scaled_swiglu: relu, gelu(tanh),
    qgelu, srelu, silu, sigmoid and the gated geglu, reglu, sreglu, qgeglu, glu, swiglu, and the
    GPT-OSS clamped SwiGLU with per-row scales;
  - the layers' backward (dx, dweight, dbias through GELU and its kept pre-activation), out= aliasing
    the accumulator (a strided view, an overlapping one), an all-float8 output with its amax.
  Two of these found defects, fixed since: TE's (1,) scale_inv refused beside an amax, and
  evtc.linear's expand() hint that it then refused itself.
* pytorch/pytorch test/inductor:
  - test_cutlass_backend.py test_max_autotune_cutlass_backend_addmm (bias (M, N), (M, 1), (1, N),
    (N,) with M == N; alpha / beta), *_simple_fusion (mm * 3.0), *_chained_fusion (* 3.3 - 1.234),
    *_relu_fusion, *_relu6_fusion, *_no_fusion_dtype_mismatch (.to(float32) * 1e-5),
    *_shape_dependent_normalization_fusion (/ b.size(1)), test_evt_fusions_basic / _activations /
    _broadcasting / _return_accumulator (relu, tanh, exp, sigmoid; add, mul, sub, div by a tile;
    all-ones inputs), test_evt_multi_op / _multi_output / _mixed_dtypes / _reuse_matmul_input,
    test_fp8_rowwise_scaling / test_fp8_tensorwise_scaling (with and without bias);
  - test_select_algorithm.py test_linear_relu (float32, a (1, N) float32 bias), test_addmm_fp16
    (M = 2, a transposed weight), test_mm_plus_mm(2, 3), test_mm_dup_args(_view), test_baddbmm,
    test_bmm_small_m;
  - test_max_autotune.py test_max_autotune_addmm(_zero_size_input), test_non_contiguous_input_addmm /
    _bmm (padded column-major a, a batch stride of 0), test_triton_template_with_epilogues_and_dynamic_shape
    (relu(x.t() @ w.t() + b) * mul at M = 5 and 8, K = 4, N = 3, also under torch.compile(dynamic=True));
  - test_mm_dup_args also with out= the shared input, and the inputs no kernel takes (int8 of
    test__int_mm, float64 of test_mm_skip) refused by name.

Every output is compared with the epilogue (or the peer's own formula, or torch.autograd) evaluated by
torch in float64 on the same inputs, within about one rounding of the output's dtype plus float32
accumulation (tf32 and float8 GEMMs: a looser accumulation term), and its dtype and shape with what
torch gives the function; then the kernel is called again into NaN-filled out= buffers, which must be
returned as given and hold the same bits, and the inputs must be unchanged.

Run: pytest -n 15 tests/test_peers_te_inductor_gpu.py (skips itself without a Hopper GPU).
EVTC_PEERS_DEVICE=cpu: CPU tensors, evtc's torch path (a check of the tests, not of the kernels).
EVTC_PEERS_CACHE=dir: a disk cache kept between runs (default: a fresh temporary one).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from peer_checks import ROUNDOFF, as_list, close, gen, rnd, wide

import evtc

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
DEV = os.environ.get("EVTC_PEERS_DEVICE", "cuda")
ON_GPU = DEV == "cuda"
pytestmark = (
    [pytest.mark.gpu, pytest.mark.skipif(not SM90, reason="needs an NVIDIA Hopper (SM90) GPU")]
    if ON_GPU
    else []
)

f16, bf16, f32, f64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = (e4m3, e5m2)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    keep = os.environ.get("EVTC_PEERS_CACHE")
    if keep:
        os.makedirs(keep, exist_ok=True)
        return keep
    return str(tmp_path_factory.mktemp("evtc-peers2"))


# ----------------------------------------------------------------------------------------------
# Checking

TF32_TOL = 5e-3  # the kernel truncates tf32 operands (docs/tf32.md)
FP8_TOL = 3e-3


def same_bits(x, y):
    x, y = x.float(), y.float()
    return tuple(x.shape) == tuple(y.shape) and bool(((x == y) | (torch.isnan(x) & torch.isnan(y))).all())


def check_all(got, ref, *, acc_tol=1e-5, what=""):
    g, r = as_list(got), as_list(ref)
    assert len(g) == len(r), f"{what}: {len(g)} outputs, the function returns {len(r)}"
    for i, (o, e) in enumerate(zip(g, r, strict=True)):
        close(o, e, acc_tol=acc_tol, what=f"{what} output {i}")


def on_meta(v):
    return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta") if torch.is_tensor(v) else v


def torch_dtypes(fn, a, b, ops):
    """What torch gives the function: shapes and dtypes of fn(a @ b, ...) on meta tensors."""
    acc = torch.matmul(on_meta(a), on_meta(b))
    return [(tuple(o.shape), o.dtype) for o in as_list(fn(acc, **{k: on_meta(v) for k, v in ops.items()}))]


def nan_like(t):
    return torch.full(tuple(t.shape), float("nan"), device=t.device).to(t.dtype)


def nan_outs(got):
    if isinstance(got, dict):
        return {k: nan_like(v) for k, v in got.items()}
    if isinstance(got, tuple | list):
        return type(got)(nan_like(v) for v in got)
    return nan_like(got)


def want_path(k, path, what):
    if path and ON_GPU:
        assert k.last_path == path, f"{what}: took the {k.last_path!r} path, expected {path!r}"


def ref64(fn, a, b, **ops):
    return fn(torch.matmul(wide(a), wide(b)), **{k: wide(v) for k, v in ops.items()})


def run_case(k, fn, a, b, ops, *, ref=None, acc_tol=1e-5, path="kernel", what="", dtypes=True):
    """Call, compare with the float64 reference (and torch's dtypes), call again into NaN-filled out=
    buffers, check that no input was written."""
    snap = {n: v.clone() for n, v in ops.items() if torch.is_tensor(v)}
    a0, b0 = a.clone(), b.clone()
    got = k(a, b, **ops)
    want_path(k, path, what)
    if ref is None:
        ref = ref64(fn, a, b, **ops)
    if dtypes:
        have = [(tuple(o.shape), o.dtype) for o in as_list(got)]
        assert have == torch_dtypes(fn, a, b, ops), (
            f"{what}: outputs {have}, torch's {torch_dtypes(fn, a, b, ops)}"
        )
    check_all(got, ref, acc_tol=acc_tol, what=what)
    outs = nan_outs(got)
    got2 = k(a, b, **ops, out=outs)
    for o, p in zip(as_list(got2), as_list(outs), strict=True):
        assert o is p, f"{what}: an out= tensor was not returned as given"
    for i, (x, y) in enumerate(zip(as_list(got), as_list(got2), strict=True)):
        assert same_bits(x, y), f"{what} output {i}: the out= call gave other bits than the first call"
    for n, v in snap.items():
        assert same_bits(ops[n], v), f"{what}: input {n} was written"
    assert same_bits(a, a0) and same_bits(b, b0), f"{what}: a or b was written"
    return got


def run_linear(lin, fn, x, w, ops, *, acc_tol=1e-5, what=""):
    """evtc.linear against F.linear in float64 and torch's shapes and dtypes; out= returned as given."""
    got = lin(x, w, **ops)
    ref = fn(F.linear(wide(x), wide(w)), **{k: wide(v) for k, v in ops.items()})
    lin_meta = F.linear(on_meta(x), on_meta(w))
    want = [
        (tuple(o.shape), o.dtype) for o in as_list(fn(lin_meta, **{k: on_meta(v) for k, v in ops.items()}))
    ]
    have = [(tuple(o.shape), o.dtype) for o in as_list(got)]
    assert have == want, f"{what}: outputs {have}, torch's {want}"
    check_all(got, ref, acc_tol=acc_tol, what=what)
    out = nan_like(got)
    assert lin(x, w, **ops, out=out) is out, f"{what}: evtc.linear did not return out="
    assert same_bits(out, got), f"{what}: out= got other bits"
    return got


def scaled_mm(*args, **kw):
    """torch._scaled_mm's result, or None where torch refuses the combination (a size cuBLASLt takes
    only in multiples of 16, a bias dtype): then only the float64 comparison stands."""
    try:
        out = torch._scaled_mm(*args, **kw)
    except (RuntimeError, TypeError, ValueError):
        return None
    return out[0] if isinstance(out, tuple) else out


def no_worse_than(got, pt, ref, slack, what):
    """quack's / pytorch's rule: no more than twice the error of torch's own float8 GEMM."""
    if pt is None:
        return
    err, err_pt = (wide(got) - ref).abs().max().item(), (wide(pt) - ref).abs().max().item()
    assert err <= 2 * err_pt + slack, f"{what}: error {err:.3g}, torch._scaled_mm's {err_pt:.3g}"


# ----------------------------------------------------------------------------------------------
# Data




def unif(shape, dtype=f32, g=None):
    return torch.rand(tuple(shape), generator=g, device=DEV).to(dtype)


def meta(*shape, dtype=f16, major="row"):
    if major == "col":
        return torch.empty((*shape[:-2], shape[-1], shape[-2]), dtype=dtype, device="meta").transpose(-1, -2)
    return torch.empty(shape, dtype=dtype, device="meta")


def ab(m, n, k, dtype, g, *, batches=None, b_kmajor=True, std=None):
    """a (.., m, k) row-major; b (.., k, n), K-major (a weight's .t()) or N-major; acc ~ unit variance."""
    lead = () if batches is None else (batches,)
    s = max(k, 1) ** -0.25 if std is None else std
    a = rnd((*lead, m, k), dtype, g, s)
    b = rnd((*lead, k, n), dtype, g, s, major="col" if b_kmajor else "row")
    return a, b


EM, EN, EK = 256, 512, 128  # example sizes: distinct, so operand kinds are unambiguous


def ex_ab(dtype=f16, *, batches=None, b_kmajor=True, n=EN):
    lead = () if batches is None else (batches,)
    return {
        "a": meta(*lead, EM, EK, dtype=dtype),
        "b": meta(*lead, EK, n, dtype=dtype, major="col" if b_kmajor else "row"),
    }


# ----------------------------------------------------------------------------------------------
# Epilogues (module-level, named after the peer test they restate)

# TransformerEngine


def te_bias(acc, bias):  # Linear(bias=True)
    return acc + bias


def te_plain(acc):  # Linear(bias=False)
    return acc


def te_bias_add(acc, bias, x2):  # ForwardLinearBiasAdd: F.linear(x, w, b) + x2
    return acc + bias + x2


def te_scale_add(acc, scale: float, x2):  # ForwardLinearScaleAdd: F.linear(x, w) * scale + x2
    return acc * scale + x2


def te_gelu_aux(acc, bias):  # GEMM + bias + GELU, the pre-activation kept (aux)
    pre = acc + bias
    return F.gelu(pre), pre


def te_dgelu_dbias(acc, pre):  # use_grad: dGELU from the aux tensor, and dbias
    cdf = 0.5 * (1.0 + torch.erf(pre * 0.7071067811865476))
    pdf = torch.exp(-0.5 * pre * pre) * 0.3989422804014327
    dx = acc * (cdf + pre * pdf)
    return dx, dx.float().sum(-2)


def te_accumulate(acc, C):  # accumulate=True: D (float32) += A @ B
    return acc + C


def te_two_dtypes(acc):  # compiled with out_dtypes=(float32, bfloat16)
    return acc, acc


def te_fp8(acc, sx, sw, s_out, C):  # current scaling: dequantize, accumulate, requantize, amax
    y = acc * sx * sw
    return (y + C).float(), (y * s_out).to(e4m3), y.abs().amax()


def te_fp8_out(acc, sx, sw, s_out):  # out_quantizer: the GEMM writes float8 only (and its amax)
    y = acc * sx * sw
    return (y * s_out).to(e4m3), y.abs().amax()


def te_acts(acc, bias):  # relu, gelu (tanh), qgelu, srelu, silu, sigmoid
    x = acc + bias
    return (
        F.relu(x),
        F.gelu(x, approximate="tanh"),
        x * torch.sigmoid(1.702 * x),
        (x > 0) * x * x,
        F.silu(x),
        torch.sigmoid(x),
    )


def te_gated(acc):  # geglu, reglu, sreglu, qgeglu, glu (both conventions), swiglu
    h, g = acc.chunk(2, dim=-1)
    return (
        F.gelu(h, approximate="tanh") * g,
        F.relu(h) * g,
        F.relu(h) ** 2 * g,
        h * torch.sigmoid(1.702 * h) * g,
        torch.sigmoid(h) * g,
        F.glu(acc, dim=-1),
        F.silu(h) * g,
    )


def te_clamped_swiglu(acc, scale, limit: float, offset: float):  # GPT-OSS SwiGLU, per-row post-scale
    h, g = acc.chunk(2, dim=-1)
    h = h.clamp(max=limit)
    g = g.clamp(-limit, limit)
    return h * torch.sigmoid(1.702 * h) * (g + offset) * scale


# PyTorch inductor


def ind_addmm(acc, x, alpha: float, beta: float):  # torch.addmm(x, a, b, beta=beta, alpha=alpha)
    return beta * x + alpha * acc


def ind_linear_relu(acc, bias):  # F.relu(F.linear(input, weight, bias))
    return F.relu(acc + bias)


def ind_pointwise(acc):  # the cutlass-backend fusion tests, one output each
    y = acc * 3.3 - 1.234
    return (
        acc * 3.0,
        y,
        F.relu(y),
        torch.clamp(F.relu(acc), max=6.0),
        acc.to(torch.float32) * 0.00001,
        acc / acc.shape[-1],
    )


def ind_unary(acc):  # test_evt_activations / _return_accumulator
    return acc, torch.relu(acc), torch.tanh(acc), torch.exp(acc), torch.sigmoid(acc)


def ind_binary(acc, e):  # test_evt_fusions_basic / _broadcasting
    r = acc.relu()
    return torch.add(r, e), torch.mul(r, e), torch.sub(r, e), torch.div(r, e)


def ind_multi(acc, e, w32):  # test_evt_multi_output / _multi_op / _mixed_dtypes
    z0 = acc.relu()
    z = torch.mul(z0, e)
    return z, z + z0, torch.add(z.relu(), acc), torch.add(z, w32)


def ind_reuse(acc, e, x):  # test_evt_reuse_matmul_input (x: the GEMM's own a)
    return torch.relu(torch.relu(acc) * e) + x


def ind_baddbmm_relu(acc, c):  # baddbmm + relu
    return torch.relu(acc + c)


def ind_relu_bias_mul(acc, bias, mul):  # template epilogue, dynamic shapes
    return F.relu(acc + bias) * mul


def ind_fp8_rowwise(acc, sa, sb, bias):  # _scaled_mm rowwise, bf16 out
    return acc * sa * sb + bias


def ind_fp8_tensorwise(acc, sa, sb, bias):  # _scaled_mm tensorwise, out_dtype = float16
    return (acc * sa * sb + bias).to(torch.float16)


# ----------------------------------------------------------------------------------------------
# Kernels: name -> (fn, examples, options); everything compiles from meta examples.

SPECS = {
    "te_scale_add": (te_scale_add, lambda: {**ex_ab(bf16), "scale": 1.0, "x2": meta(EM, EN, dtype=bf16)}, {}),
    "te_gelu_aux": (te_gelu_aux, lambda: {**ex_ab(bf16), "bias": meta(1, EN, dtype=bf16)}, {}),
    "te_dgelu_dbias": (te_dgelu_dbias, lambda: {**ex_ab(bf16), "pre": meta(EM, EN, dtype=bf16)}, {}),
    "te_accumulate": (te_accumulate, lambda: {**ex_ab(bf16), "C": meta(EM, EN, dtype=f32)}, {}),
    "te_two_dtypes": (te_two_dtypes, lambda: ex_ab(f16), {"out_dtypes": (f32, bf16)}),
    "te_fp8": (
        te_fp8,
        lambda: {
            **ex_ab(e4m3),
            "sx": meta(dtype=f32),
            "sw": meta(dtype=f32),
            "s_out": meta(dtype=f32),
            "C": meta(EM, EN, dtype=f32),
        },
        {},
    ),
    "te_fp8_out": (
        te_fp8_out,
        lambda: {**ex_ab(e4m3), "sx": meta(dtype=f32), "sw": meta(dtype=f32), "s_out": meta(dtype=f32)},
        {},
    ),
    "te_acts": (te_acts, lambda: {**ex_ab(bf16), "bias": meta(EN, dtype=bf16)}, {}),
    "te_gated": (te_gated, lambda: ex_ab(bf16, n=2 * EN), {}),
    "te_clamped_swiglu": (
        te_clamped_swiglu,
        lambda: {**ex_ab(bf16, n=2 * EN), "scale": meta(EM, 1, dtype=f32), "limit": 0.75, "offset": 1.0},
        {},
    ),
    "ind_addmm_tile": (ind_addmm, lambda: {**ex_ab(f16), "x": meta(EM, EN), "alpha": 1.0, "beta": 1.0}, {}),
    "ind_addmm_col": (ind_addmm, lambda: {**ex_ab(f16), "x": meta(EM, 1), "alpha": 1.0, "beta": 1.0}, {}),
    "ind_addmm_row": (ind_addmm, lambda: {**ex_ab(f16), "x": meta(EN), "alpha": 1.0, "beta": 1.0}, {}),
    "ind_linear_relu": (ind_linear_relu, lambda: {**ex_ab(f32), "bias": meta(1, EN, dtype=f32)}, {}),
    "ind_pointwise": (ind_pointwise, lambda: ex_ab(f16), {}),
    "ind_unary": (ind_unary, lambda: ex_ab(f16), {}),
    "ind_binary": (ind_binary, lambda: {**ex_ab(f16), "e": meta(EM, EN)}, {}),
    "ind_multi": (ind_multi, lambda: {**ex_ab(f16), "e": meta(EM, EN), "w32": meta(EM, EN, dtype=f32)}, {}),
    "ind_reuse": (ind_reuse, lambda: {**ex_ab(f16), "e": meta(EM, EN), "x": meta(EM, EN)}, {}),
    "ind_baddbmm_relu": (
        ind_baddbmm_relu,
        lambda: {**ex_ab(f16, batches=3, b_kmajor=False), "c": meta(3, 1, EN)},
        {},
    ),
    "ind_relu_bias_mul": (
        ind_relu_bias_mul,
        lambda: {"a": meta(EK, EM).t(), "b": meta(EN, EK).t(), "bias": meta(EN), "mul": meta(EM, EN)},
        {},
    ),
    "ind_fp8_rowwise": (
        ind_fp8_rowwise,
        lambda: {
            **ex_ab(e4m3),
            "sa": meta(EM, 1, dtype=f32),
            "sb": meta(1, EN, dtype=f32),
            "bias": meta(EN, dtype=bf16),
        },
        {},
    ),
    "ind_fp8_tensorwise": (
        ind_fp8_tensorwise,
        lambda: {**ex_ab(e4m3), "sa": meta(dtype=f32), "sb": meta(dtype=f32), "bias": meta(EN, dtype=f16)},
        {},
    ),
}


def kern(name, cache_dir):
    fn, example, kw = SPECS[name]
    return evtc.compile(fn, example(), cache_dir=cache_dir, **kw)


def linear_kernel(fn, cache_dir, dtype, **operands):
    return evtc.linear(
        fn,
        {"x": meta(4, 64, dtype=dtype), "weight": meta(32, 64, dtype=dtype), **operands},
        cache_dir=cache_dir,
    )


# ==============================================================================================
# TransformerEngine: linear layers


LINEAR_SHAPES = [
    (in_shape, w_shape) for w_shape in ((32, 64), (3, 5)) for in_shape in ((-1,), (1, 7, -1), (8, 2, 10, -1))
]


@pytest.mark.parametrize("in_shape,w_shape", LINEAR_SHAPES)
def test_te_linear_bias(cache_dir, in_shape, w_shape):
    """test_linear_accuracy / test_forward_linear_bias_activation: F.linear(x, w, b), x of 1 to 4 dims,
    a (3, 5) weight (rows of 10 bytes: staged)."""
    lin = linear_kernel(te_bias, cache_dir, f16, bias=meta(32))
    g = gen(sum(w_shape) + len(in_shape))
    n, k = w_shape
    x = rnd([*in_shape[:-1], k], f16, g)
    w = rnd((n, k), f16, g, k**-0.5)
    run_linear(lin, te_bias, x, w, {"bias": rnd((n,), f16, g)}, what=f"linear+bias {in_shape} x {w_shape}")


@pytest.mark.parametrize("in_shape,w_shape", [((1, 7, -1), (32, 64)), ((-1,), (3, 5))])
def test_te_linear_no_bias(cache_dir, in_shape, w_shape):
    """test_linear_accuracy bias=False (bfloat16): the identity epilogue."""
    lin = linear_kernel(te_plain, cache_dir, bf16)
    g = gen(7 + sum(w_shape))
    n, k = w_shape
    x = rnd([*in_shape[:-1], k], bf16, g)
    run_linear(lin, te_plain, x, rnd((n, k), bf16, g, k**-0.5), {}, what=f"linear {in_shape} x {w_shape}")


def test_te_linear_noncontiguous_input(cache_dir):
    """test_noncontiguous: a transposed (256, 128) input gives the contiguous copy's bits."""
    lin = linear_kernel(te_plain, cache_dir, bf16)
    g = gen(8)
    x_t = rnd((128, 256), bf16, g).t()
    assert not x_t.is_contiguous()
    w = rnd((128, 128), bf16, g, 128**-0.5)
    got = run_linear(lin, te_plain, x_t, w, {}, what="transposed input")
    assert same_bits(got, lin(x_t.contiguous(), w)), "a non-contiguous input changed the result"


@pytest.mark.parametrize("with_bias", [True, False])
def test_te_linear_bias_add(cache_dir, with_bias):
    """test_forward_linear_bias_add (weight (32, 32), x (32, 32)): F.linear(x, w, b) + x2; without a bias
    through the scale-add kernel at scale 1."""
    g = gen(9 + int(with_bias))
    x, w, x2 = rnd((32, 32), bf16, g), rnd((32, 32), bf16, g, 32**-0.5), rnd((32, 32), bf16, g)
    if with_bias:
        lin = linear_kernel(
            te_bias_add, cache_dir, bf16, bias=meta(32, dtype=bf16), x2=meta(4, 32, dtype=bf16)
        )
        run_linear(lin, te_bias_add, x, w, {"bias": rnd((32,), bf16, g), "x2": x2}, what="linear+bias+add")
    else:
        k = kern("te_scale_add", cache_dir)
        run_case(k, te_scale_add, x, w.t(), {"scale": 1, "x2": x2}, path=None, what="linear+add")


def test_te_linear_residual_row_hint(cache_dir):
    """A (N,) residual for a linear compiled with a full (.., N) one is refused (documented: the kind is
    compiled in); the error's own remedy must then be accepted."""
    lin = linear_kernel(te_bias_add, cache_dir, bf16, bias=meta(32, dtype=bf16), x2=meta(4, 32, dtype=bf16))
    g = gen(10)
    x, w, bias, x2 = (
        rnd((2, 10, 32), bf16, g),
        rnd((32, 32), bf16, g, 32**-0.5),
        rnd((32,), bf16, g),
        rnd((32,), bf16, g),
    )
    with pytest.raises(evtc.CallError) as info:
        lin(x, w, bias=bias, x2=x2)
    import re

    hint = re.search(r"pass x2\.expand\(([0-9, ]+)\)", str(info.value))
    assert hint, str(info.value)
    shape = tuple(int(v) for v in hint.group(1).split(","))
    run_linear(lin, te_bias_add, x, w, {"bias": bias, "x2": x2.expand(*shape)}, what="the error's remedy")


@pytest.mark.parametrize("scale", [1, 0, -2.5, 3.5])
def test_te_linear_scale_add(cache_dir, scale):
    """test_forward_linear_scale_add: F.linear(x, w) * scale + x2, every scale one kernel (an int too)."""
    k = kern("te_scale_add", cache_dir)
    g = gen(11)
    x, w = rnd((96, 64), bf16, g), rnd((160, 64), bf16, g, 0.125)
    run_case(
        k, te_scale_add, x, w.t(), {"scale": scale, "x2": rnd((96, 160), bf16, g)}, what=f"scale {scale}"
    )
    assert kern("te_scale_add", cache_dir) is k


# ==============================================================================================
# TransformerEngine: GEMM with GELU (aux), dGELU, accumulation, output dtypes, transposes

TE_MKN = [(128, 128, 128), (320, 128, 336), (320, 64, 336)]  # (M, K, N), blockwise gemm exact


@pytest.mark.parametrize("m,kk,n", TE_MKN)
def test_te_gemm_gelu_aux(cache_dir, m, kk, n):
    """use_gelu: D = gelu(acc + bias) and the pre-GELU aux output; bias (1, N) bf16."""
    k = kern("te_gelu_aux", cache_dir)
    g = gen(m + kk + n)
    x, w = rnd((m, kk), bf16, g), rnd((n, kk), bf16, g, kk**-0.5)
    got = run_case(k, te_gelu_aux, x, w.t(), {"bias": rnd((1, n), bf16, g)}, what=f"gelu aux {m}x{kk}x{n}")
    # the aux tensor is the pre-activation: gelu of it (torch, float64) is within bf16 rounding of D
    close(got[0], F.gelu(got[1].double()), acc_tol=2 * ROUNDOFF[bf16], what="gelu(aux) against D")


@pytest.mark.parametrize("in_shape", [(2, 24, 64), (7, 64)])
def test_te_linear_gelu_aux_backward(cache_dir, in_shape):
    """test_linear_accuracy's backward (dx, dweight, dbias), through a layer with both outputs (GELU and its
    pre-activation) in the loss: evtc.linear's derived backward against float64 autograd, within TE's bf16
    tolerance (rtol 1.6e-2 of the largest gradient)."""
    lin = evtc.linear(
        te_gelu_aux,
        {"x": meta(4, 64, dtype=bf16), "weight": meta(32, 64, dtype=bf16), "bias": meta(1, 32, dtype=bf16)},
        cache_dir=cache_dir,
    )
    g = gen(len(in_shape))
    x = rnd(in_shape, bf16, g).requires_grad_(True)
    w = rnd((48, 64), bf16, g, 0.125).requires_grad_(True)
    b = rnd((1, 48), bf16, g).requires_grad_(True)
    D, aux = lin(x, w, bias=b)
    gD, gA = rnd(D.shape, bf16, g), rnd(aux.shape, bf16, g)
    ((D.float() * gD.float()).sum() + (aux.float() * gA.float()).sum()).backward()
    x6, w6, b6 = (t.detach().double().requires_grad_(True) for t in (x, w, b))
    D6, A6 = te_gelu_aux(F.linear(x6, w6), b6)
    ((D6 * wide(gD)).sum() + (A6 * wide(gA)).sum()).backward()
    for name, got, want in [
        ("dx", x.grad, x6.grad),
        ("dweight", w.grad, w6.grad),
        ("dbias", b.grad, b6.grad),
    ]:
        assert got is not None and got.shape == want.shape and got.dtype == bf16, name
        rel = ((wide(got) - want).abs().max() / want.abs().max()).item()
        assert rel <= 1.6e-2, f"{name}: {rel:.3g} of its largest value off"


@pytest.mark.parametrize("m,kk,n", [(128, 256, 256), (320, 64, 336)])
def test_te_gemm_dgelu_dbias(cache_dir, m, kk, n):
    """use_grad: dX = dY @ W times gelu'(pre) from the aux tensor, and dbias its column sum; against
    torch.autograd in float64."""
    k = kern("te_dgelu_dbias", cache_dir)
    g = gen(m + n)
    dy, w = rnd((m, kk), bf16, g), rnd((kk, n), bf16, g, kk**-0.5)  # dgrad: dY (M, K) @ W (K, N)
    pre = rnd((m, n), bf16, g, 2.0)
    grad_in = torch.matmul(wide(dy), wide(w))
    p = wide(pre).requires_grad_(True)
    F.gelu(p).backward(grad_in)
    ref = (p.grad, p.grad.sum(0))
    run_case(k, te_dgelu_dbias, dy, w, {"pre": pre}, ref=ref, path=None, what=f"dgelu {m}x{kk}x{n}")


@pytest.mark.parametrize("m,kk,n", [(64, 128, 64), (200, 72, 96)])
def test_te_accumulate_into_output(cache_dir, m, kk, n):
    """accumulate=True with a float32 output (fp32_acc): out= the accumulator itself, written in place."""
    k = kern("te_accumulate", cache_dir)
    g = gen(m + kk)
    x, w = rnd((m, kk), bf16, g), rnd((n, kk), bf16, g, kk**-0.5)
    C = rnd((m, n), f32, g)
    run_case(k, te_accumulate, x, w.t(), {"C": C}, path=None, what=f"accumulate {m}x{kk}x{n}")
    want = wide(x) @ wide(w).t() + wide(C)
    D = C.clone()
    assert k(x, w.t(), C=D, out=D) is D
    close(D, want, what="accumulated in place")
    # the accumulator a column block of a wider buffer (a strided view), accumulated in place too
    big = torch.full((m, n + 40), float("nan"), device=DEV)
    big[:, 8 : 8 + n] = C
    view = big[:, 8 : 8 + n]
    assert k(x, w.t(), C=view, out=view) is view
    close(view, want, what="accumulated in place into a strided view")
    assert bool(torch.isnan(big[:, :8]).all()) and bool(torch.isnan(big[:, 8 + n :]).all()), (
        "wrote past the view"
    )
    # out= overlapping the accumulator's memory shifted by 8 columns: torch's out= of a result computed first
    big = torch.zeros((m, n + 8), device=DEV)
    big[:, 8:] = C
    res = k(x, w.t(), C=big[:, 8:], out=big[:, :n])
    close(res, want, what="out= overlapping C")
    close(big[:, :n], want, what="out= overlapping C, read back")


def test_te_output_dtypes(cache_dir):
    """An output dtype other than the inputs' (float16 GEMM, float32 and bfloat16 outputs: out_dtypes)."""
    k = kern("te_two_dtypes", cache_dir)
    g = gen(12)
    x, w = rnd((100, 72), f16, g), rnd((200, 72), f16, g, 72**-0.5)
    got = run_case(k, te_two_dtypes, x, w.t(), {}, path=None, dtypes=False, what="out_dtypes")
    assert [o.dtype for o in got] == [f32, bf16]


@pytest.mark.parametrize("x_cols,w_cols", [(False, False), (True, False), (False, True), (True, True)])
def test_te_transposed_operands(cache_dir, x_cols, w_cols):
    """x_columnwise / w_columnwise (transb / transa): the same product from either layout of x and w."""
    k = kern("te_gelu_aux", cache_dir)
    g = gen(13 + 2 * int(x_cols) + int(w_cols))
    m, kk, n = 320, 128, 336
    x = rnd((m, kk), bf16, g, major="col" if x_cols else "row")
    w = rnd((n, kk), bf16, g, kk**-0.5, major="col" if w_cols else "row")
    path = "kernel" if not (x_cols or w_cols) else "staged"
    run_case(
        k,
        te_gelu_aux,
        x,
        w.t(),
        {"bias": rnd((1, n), bf16, g)},
        path=path,
        what=f"x {'T' if x_cols else 'N'} w {'T' if w_cols else 'N'}",
    )


# ==============================================================================================
# TransformerEngine: per-tensor (current) scaled float8


def quantize_tensorwise(t, dtype=e4m3):
    """Current scaling: scale = fp8_max / amax; returns the float8 data and its float32 scale_inv."""
    fmax = torch.finfo(dtype).max
    scale = fmax / t.abs().amax().float().clamp_min(1e-12)
    q = (t.float() * scale).clamp(-fmax, fmax).to(dtype)
    return q, (1.0 / scale).float()


@pytest.mark.parametrize(
    "m,kk,n,accumulate",
    [(128, 256, 96, False), (64, 128, 64, True), (32, 32, 32, False), (1000, 512, 1008, True)],
)
def test_te_fp8_current_scaling(cache_dir, m, kk, n, accumulate):
    """D = acc * sx * sw (+ C) in float32, the output quantized in the epilogue and its amax. The fused
    quantization must equal quantizing the unquantized output (C = 0), and the amax its |max|."""
    k = kern("te_fp8", cache_dir)
    g = gen(m + n + int(accumulate))
    qx, sx = quantize_tensorwise(rnd((m, kk), bf16, g))
    qw, sw = quantize_tensorwise(rnd((n, kk), bf16, g))
    C = rnd((m, n), f32, g) if accumulate else torch.zeros((m, n), device=DEV)
    s_out = torch.tensor(8.0, device=DEV)
    ops = {"sx": sx, "sw": sw, "s_out": s_out, "C": C}
    got = run_case(
        k,
        te_fp8,
        qx,
        qw.t(),
        ops,
        acc_tol=FP8_TOL,
        path="kernel" if m % 8 == 0 else None,
        dtypes=False,
        what=f"fp8 {m}x{kk}x{n} acc={accumulate}",
    )
    assert [o.dtype for o in got] == [f32, e4m3, f32] and got[2].shape == ()
    if not accumulate:
        y = got[0]
        # saturated first: torch 2.11's eager cast gives NaN past 464 (see close)
        assert same_bits(got[1], (y * s_out).clamp(-448, 448).to(e4m3)), (
            "fused quantization differs from quantizing D"
        )
        assert same_bits(got[2], y.abs().amax()), "amax differs from D's |max|"
    if ON_GPU and not accumulate:
        pt = scaled_mm(qx, qw.t(), scale_a=sx, scale_b=sw, out_dtype=f32)
        no_worse_than(got[0], pt, wide(qx) @ wide(qw).t() * wide(sx) * wide(sw), 1e-6, "against _scaled_mm")
    if accumulate:
        D = C.clone()
        res = k(qx, qw.t(), sx=sx, sw=sw, s_out=s_out, C=D, out=(D, nan_like(got[1]), nan_like(got[2])))
        assert res[0] is D
        close(
            D, wide(qx) @ wide(qw).t() * wide(sx) * wide(sw) + wide(C), acc_tol=FP8_TOL, what="fp8 in place"
        )


def test_te_fp8_scale_inv_of_shape_1(cache_dir):
    """TransformerEngine keeps per-tensor scale_inv as (1,) tensors; torch broadcasts them as it does 0-d
    ones here (y is (M, N) either way, its amax 0-d), and docs/compile.md takes (1,) for a 0-d example."""
    k = kern("te_fp8_out", cache_dir)
    g = gen(30)
    qx, sx = quantize_tensorwise(rnd((64, 128), bf16, g))
    qw, sw = quantize_tensorwise(rnd((32, 128), bf16, g))
    ops = {"sx": sx.reshape(1), "sw": sw.reshape(1), "s_out": torch.tensor([4.0], device=DEV)}
    run_case(k, te_fp8_out, qx, qw.t(), ops, acc_tol=FP8_TOL, dtypes=False, path=None, what="(1,) scale_inv")


@pytest.mark.parametrize("m,kk,n", [(128, 256, 96), (200, 128, 64)])
def test_te_fp8_quantized_output(cache_dir, m, kk, n):
    """generic_gemm with an output quantizer (Float8Quantizer, scale 4): the kernel writes only the e4m3
    tile (its D) and the amax; against quantizing the float64 product."""
    k = kern("te_fp8_out", cache_dir)
    g = gen(m + kk + n)
    qx, sx = quantize_tensorwise(rnd((m, kk), bf16, g))
    qw, sw = quantize_tensorwise(rnd((n, kk), bf16, g))
    ops = {"sx": sx, "sw": sw, "s_out": torch.tensor(4.0, device=DEV)}
    got = run_case(
        k, te_fp8_out, qx, qw.t(), ops, acc_tol=FP8_TOL, dtypes=False, path=None, what=f"fp8 out {m}x{kk}x{n}"
    )
    assert got[0].dtype == e4m3 and got[1].dtype == f32


# ==============================================================================================
# TransformerEngine: activations, gated activations


@pytest.mark.parametrize("m,n,kk", [(32, 32, 32), (200, 1000, 96)])
def test_te_activations(cache_dir, m, n, kk):
    """test_activation: relu, gelu(tanh), qgelu, srelu ((x > 0) * x * x), silu, sigmoid after a bias."""
    k = kern("te_acts", cache_dir)
    g = gen(m + n)
    x, w = rnd((m, kk), bf16, g), rnd((n, kk), bf16, g, kk**-0.5 * 2)
    run_case(k, te_acts, x, w.t(), {"bias": rnd((n,), bf16, g)}, path=None, what=f"acts {m}x{n}")


@pytest.mark.parametrize("m,n,kk", [(32, 64, 32), (200, 2000, 96)])
def test_te_gated_activations(cache_dir, m, n, kk):
    """geglu, reglu, sreglu, qgeglu, glu (TE's and torch's halves), swiglu: reference by slicing."""
    k = kern("te_gated", cache_dir)
    g = gen(m + n + 1)
    x, w = rnd((m, kk), bf16, g), rnd((n, kk), bf16, g, kk**-0.5 * 2)
    acc = wide(x) @ wide(w).t()
    h, u = acc[:, : n // 2], acc[:, n // 2 :]
    ref = (
        F.gelu(h, approximate="tanh") * u,
        F.relu(h) * u,
        F.relu(h).square() * u,
        h * torch.sigmoid(1.702 * h) * u,
        torch.sigmoid(h) * u,
        h * torch.sigmoid(u),
        h * torch.sigmoid(h) * u,
    )
    run_case(k, te_gated, x, w.t(), {}, ref=ref, path=None, what=f"gated {m}x{n}")


@pytest.mark.parametrize("limit,offset", [(0.75, 1.0), (7.0, 0.0)])
def test_te_clamped_swiglu(cache_dir, limit, offset):
    """test_clamped_swiglu (limit, alpha 1.702, glu_linear_offset) with test_scaled_swiglu's per-row
    scales; limit and offset runtime scalars (one kernel)."""
    k = kern("te_clamped_swiglu", cache_dir)
    g = gen(int(limit * 4))
    m, n, kk = 96, 256, 64
    x, w = rnd((m, kk), bf16, g), rnd((n, kk), bf16, g, kk**-0.5 * 2)
    acc = wide(x) @ wide(w).t()
    scale = unif((m, 1), f32, g) + 0.5
    h, u = acc[:, : n // 2].clamp(max=limit), acc[:, n // 2 :].clamp(-limit, limit)
    ref = h * torch.sigmoid(1.702 * h) * (u + offset) * wide(scale)
    run_case(
        k,
        te_clamped_swiglu,
        x,
        w.t(),
        {"scale": scale, "limit": limit, "offset": offset},
        ref=ref,
        path="kernel",
        what=f"clamped swiglu {limit}",
    )


# ==============================================================================================
# inductor: addmm and its bias kinds


ADDMM_X = {
    "(M, N)": ("ind_addmm_tile", lambda m, n: (m, n)),
    "(M, 1)": ("ind_addmm_col", lambda m, n: (m, 1)),
    "(1, N)": ("ind_addmm_row", lambda m, n: (1, n)),
    "(N,)": ("ind_addmm_row", lambda m, n: (n,)),
}


@pytest.mark.parametrize("mnk", [(128, 128, 16), (512, 512, 128)])
@pytest.mark.parametrize("x_kind", list(ADDMM_X))
def test_ind_addmm_bias_kinds(cache_dir, x_kind, mnk):
    """test_max_autotune_cutlass_backend_addmm: x (M, N), (M, 1), (1, N), (N,) at M == N, b a transposed
    (N, K) weight; alpha and beta as test_cutlass_backend_op_allowlist swaps them."""
    name, shape = ADDMM_X[x_kind]
    k = kern(name, cache_dir)
    m, n, kk = mnk
    g = gen(m + kk + len(x_kind))
    a, b = ab(m, n, kk, f16, g)
    for alpha, beta in [(1.0, 1.0), (2.0, 1.0), (1.0, 2.0)]:
        run_case(
            k,
            ind_addmm,
            a,
            b,
            {"x": rnd(shape(m, n), f16, g), "alpha": alpha, "beta": beta},
            path=None if x_kind == "(1, N)" else "kernel",
            what=f"addmm x {x_kind} alpha {alpha} beta {beta}",
        )


def test_ind_addmm_fp16_decode(cache_dir):
    """test_addmm_fp16: M = 2, b = a (320, 320) weight's .t(), a (320,) bias."""
    k = kern("ind_addmm_row", cache_dir)
    g = gen(14)
    a, w = rnd((2, 320), f16, g), rnd((320, 320), f16, g, 320**-0.5)
    run_case(k, ind_addmm, a, w.t(), {"x": rnd((320,), f16, g), "alpha": 1.0, "beta": 1.0}, what="addmm M=2")


@pytest.mark.parametrize("m", [0, 7])
def test_ind_addmm_zero_size(cache_dir, m):
    """test_max_autotune_addmm_zero_size_input: a (0, 10) with a (100,) bias; and K = 0 (beta * x)."""
    k = kern("ind_addmm_row", cache_dir)
    g = gen(15 + m)
    kk = 10 if m == 0 else 0
    a, b = rnd((m, kk), f16, g), rnd((kk, 100), f16, g)
    got = run_case(
        k,
        ind_addmm,
        a,
        b,
        {"x": rnd((100,), f16, g), "alpha": 1.0, "beta": 0.5},
        path=None,
        what=f"addmm {m}x100x{kk}",
    )
    assert got.shape == (m, 100)


def test_ind_addmm_noncontiguous_a(cache_dir):
    """test_non_contiguous_input_addmm (scaled down): a (1000, 256) with strides (1, 1008), a column-major
    view of a padded buffer; b contiguous (K, N)."""
    k = kern("ind_addmm_row", cache_dir)
    g = gen(16)
    store = rnd((256, 1008), f16, g, 256**-0.25)
    a = store.t()[:1000]
    assert a.stride() == (1, 1008)
    b = rnd((256, 768), f16, g, 256**-0.25)
    run_case(
        k,
        ind_addmm,
        a,
        b,
        {"x": rnd((768,), f16, g), "alpha": 1.0, "beta": 1.0},
        path=None,
        what="non-contiguous a",
    )


@pytest.mark.parametrize("tf32", [False, True])
def test_ind_linear_relu_float32(cache_dir, tf32):
    """test_linear_relu: float32 input (64, 32), weight (16, 32), a float32 (1, 16) bias. tf32 off (the
    inductor tests' setting): torch's float32 GEMM; on: the tf32 kernel."""
    k = kern("ind_linear_relu", cache_dir)
    g = gen(17)
    x, w = rnd((64, 32), f32, g), rnd((16, 32), f32, g, 32**-0.5)
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        run_case(
            k,
            ind_linear_relu,
            x,
            w.t(),
            {"bias": rnd((1, 16), f32, g)},
            acc_tol=TF32_TOL if tf32 else 1e-6,
            path="kernel" if tf32 else "torch",
            what=f"linear relu tf32={tf32}",
        )
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


# ==============================================================================================
# inductor: pointwise epilogues (cutlass backend / EVT tests)


@pytest.mark.parametrize("m,n,kk", [(256, 512, 256), (100, 200, 72)])
def test_ind_pointwise_epilogues(cache_dir, m, n, kk):
    """simple (* 3.0), chained (* 3.3 - 1.234), relu, relu6 (clamp(relu, max=6)), a float32 cast then
    * 1e-5 (torch's output float32), and / b.size(1) (the size read per call: N = 512 and 200)."""
    k = kern("ind_pointwise", cache_dir)
    g = gen(m + n)
    a, b = ab(m, n, kk, f16, g, std=kk**-0.25 * 2)
    run_case(
        k, ind_pointwise, a, b, {}, path="kernel" if m % 8 == 0 else None, what=f"pointwise {m}x{n}x{kk}"
    )


@pytest.mark.parametrize("data,m,n", [("ones", 512, 512), ("ones", 1024, 512), ("randn", 1000, 200)])
def test_ind_evt_activations_and_accumulator(cache_dir, data, m, n):
    """test_evt_activations / _return_accumulator: (acc, relu, tanh, exp, sigmoid); all-ones a (M, N) and
    b = ones(N, N).t() make acc = N exactly (exp overflows to inf in float16, as in torch)."""
    k = kern("ind_unary", cache_dir)
    g = gen(m + n)
    if data == "ones":
        a, b = torch.ones(m, n, device=DEV, dtype=f16), torch.ones(n, n, device=DEV, dtype=f16).t()
    else:
        a, b = ab(m, n, 96, f16, g)
    got = run_case(k, ind_unary, a, b, {}, path="kernel", what=f"unary {data} {m}x{n}")
    if data == "ones":
        assert bool((got[0] == n).all()) and bool(torch.isinf(got[3]).all())


@pytest.mark.parametrize("data,m,n", [("ones", 1024, 512), ("randn", 512, 1024), ("randn", 100, 72)])
def test_ind_evt_binary_ops(cache_dir, data, m, n):
    """test_evt_fusions_basic / _broadcasting: add, mul, sub, div of relu(acc) by a torch.rand (M, N) tile
    (division by a 0 of it gives inf or NaN, as in torch)."""
    k = kern("ind_binary", cache_dir)
    g = gen(m + 2 * n)
    if data == "ones":
        a, b = torch.ones(m, n, device=DEV, dtype=f16), torch.ones(n, n, device=DEV, dtype=f16).t()
    else:
        a, b = ab(m, n, 64, f16, g)
    run_case(
        k,
        ind_binary,
        a,
        b,
        {"e": unif((m, n), f16, g)},
        path="kernel" if m % 8 == 0 else None,
        what=f"binary {data} {m}x{n}",
    )


@pytest.mark.parametrize("m,n", [(512, 512), (1024, 64), (128, 256)])
def test_ind_evt_multi_output_mixed_dtypes(cache_dir, m, n):
    """test_evt_multi_output (z, z + relu(acc)), _multi_op (relu(z) + acc), _mixed_dtypes (z + a float32
    tile: a float32 output), at the sizes of its dynamic variant."""
    k = kern("ind_multi", cache_dir)
    g = gen(m * 3 + n)
    a, b = ab(m, n, n, f16, g)
    got = run_case(
        k,
        ind_multi,
        a,
        b,
        {"e": unif((m, n), f16, g), "w32": torch.ones(m, n, device=DEV)},
        what=f"multi {m}x{n}",
    )
    assert [o.dtype for o in got] == [f16, f16, f16, f32]


@pytest.mark.parametrize("how", ["a as operand", "a @ a", "F.linear(a, a)", "views of one buffer"])
def test_ind_reuse_matmul_input(cache_dir, how):
    """test_evt_reuse_matmul_input (the GEMM's own a read again as a tile), test_mm_dup_args (a @ a) and
    test_mm_dup_args_view (q = t[:32], k = t[32:], q @ k.t()); inputs shared with operands."""
    k = kern("ind_reuse", cache_dir)
    g = gen(len(how))
    if how == "views of one buffer":
        t = rnd((64, 64), f16, g, 0.4)
        a, b, x = t[:32], t[32:].t(), t[:32, :32]
        e = unif((32, 32), f16, g)
    else:
        a = rnd((128, 128), f16, g, 0.3)
        b = {"a @ a": a, "F.linear(a, a)": a.t()}.get(how, rnd((128, 128), f16, g, 0.3).t())
        x, e = a, unif((128, 128), f16, g)
    got = run_case(k, ind_reuse, a, b, {"e": e, "x": x}, path=None, what=how)
    if how == "a @ a":
        # out= the GEMM's own input (and the operand x): written through a new tensor, then copied
        a2 = a.clone()
        assert k(a2, a2, e=e, x=a2, out=a2) is a2
        assert same_bits(a2, got), "out= aliasing a, b and x changed the result"


@pytest.mark.parametrize("m,kk,n", [(32, 32, 32), (512, 512, 512), (512, 32, 8)])
def test_ind_mm_plus_mm(cache_dir, m, kk, n):
    """test_mm_plus_mm(2, 3): (a @ b) + (c @ d), the second product (torch's, in float16) an addmm tile."""
    k = kern("ind_addmm_tile", cache_dir)
    g = gen(m + kk + n)
    a, b = ab(m, n, kk, f16, g, b_kmajor=False)
    c, d = ab(m, n, kk, f16, g, b_kmajor=False)
    cd = torch.matmul(c, d) if ON_GPU else torch.matmul(c.float(), d.float()).to(f16)
    run_case(k, ind_addmm, a, b, {"x": cd, "alpha": 1.0, "beta": 1.0}, path=None, what=f"mm+mm {m}x{kk}x{n}")


def test_ind_second_matmul_in_epilogue_is_named():
    """A mm + mm written into the epilogue itself: evtc refuses the second GEMM by name, at its line."""

    def mm_plus_mm(acc, c, d):
        return acc + c @ d

    with pytest.raises(evtc.UnsupportedOpError, match=r"(?i)gemm|matmul|matrix"):
        evtc.trace(mm_plus_mm, {**ex_ab(f16), "c": meta(EM, 64), "d": meta(64, EN)})


@pytest.mark.parametrize("dtype", [torch.int8, f64])
def test_ind_unsupported_gemm_dtypes_are_named(dtype):
    """test__int_mm / test_mm_skip (float64): inputs no kernel takes are refused, naming the dtype."""
    ex = {"a": meta(EM, EK, dtype=dtype), "b": meta(EN, EK, dtype=dtype).t()}
    with pytest.raises(evtc.DTypeError, match=str(dtype).replace("torch.", "")):
        evtc.trace(ind_unary, ex)


# ==============================================================================================
# inductor: batched GEMMs, tiny dynamic shapes


@pytest.mark.parametrize(
    "case",
    [
        "baddbmm (2, 8, 32) @ (2, 32, 8)",
        "bmm small M (4, 2, 64) @ (4, 64, 32)",
        "batch stride 0, padded column-major a",
        "c of shape (N,)",
    ],
)
def test_ind_bmm_epilogue(cache_dir, case):
    """test_baddbmm (c (L, 1, N)), test_bmm_small_m, test_non_contiguous_input_bmm (scaled down: (1, M, K)
    with strides (0, 1, pitch)), and baddbmm's 1-d input broadcast over the batches; relu after."""
    k = kern("ind_baddbmm_relu", cache_dir)
    g = gen(len(case))
    if case.startswith("baddbmm"):
        a, b, c = rnd((2, 8, 32), f16, g, 0.4), rnd((2, 32, 8), f16, g, 0.4), rnd((2, 1, 8), f16, g)
    elif case.startswith("bmm small"):
        a, b, c = rnd((4, 2, 64), f16, g, 0.3), rnd((4, 64, 32), f16, g, 0.3), rnd((4, 1, 32), f16, g)
    elif case.startswith("batch stride"):
        store = rnd((200, 1008), f16, g, 200**-0.25)  # K rows of a padded M
        a = store.as_strided((1, 1000, 200), (0, 1, 1008))  # (1, M, K), strides (0, 1, 1008)
        b = rnd((200, 768), f16, g, 200**-0.25).as_strided((1, 200, 768), (0, 768, 1))
        c = rnd((1, 1, 768), f16, g)
    else:
        a, b, c = rnd((3, 64, 48), f16, g, 0.4), rnd((3, 48, 80), f16, g, 0.4), rnd((80,), f16, g)
    run_case(k, ind_baddbmm_relu, a, b, {"c": c}, path=None, what=case)


def test_ind_template_epilogue_dynamic_shape(cache_dir):
    """test_triton_template_with_epilogues_and_dynamic_shape: relu(x.t() @ w.t() + b) * mul, K = 4, N = 3,
    one kernel at M = 5 and M = 8."""
    k = kern("ind_relu_bias_mul", cache_dir)
    g = gen(18)
    w, bias = unif((3, 4), f16, g), unif((3,), f16, g)
    results = {}
    for m in (5, 8):
        x, mul = unif((4, m), f16, g), unif((m, 3), f16, g)
        results[m] = (
            x,
            mul,
            run_case(
                k, ind_relu_bias_mul, x.t(), w.t(), {"bias": bias, "mul": mul}, path=None, what=f"M={m}"
            ),
        )

    def fn(x, w, b, mul):
        return k(x.t(), w.t(), bias=b, mul=mul)

    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="inductor" if ON_GPU else "aot_eager")
    for m, (x, mul, want) in results.items():
        assert same_bits(compiled(x, w, bias, mul), want), f"torch.compile(dynamic=True) at M={m}"


# ==============================================================================================
# inductor: float8 rowwise / tensorwise scaled GEMMs


def quantize_rowwise(t, dtype=e4m3):
    fmax = torch.finfo(dtype).max
    scale = fmax / t.abs().amax(dim=1, keepdim=True).float().clamp_min(1e-12)
    return (t.float() * scale).clamp(-fmax, fmax).to(dtype), (1.0 / scale).float()


@pytest.mark.parametrize("input_dtype", [bf16, f16])
def test_ind_fp8_rowwise(cache_dir, input_dtype):
    """test_fp8_rowwise_scaling (512 x 128 x 64 with a bias): x scale_inv (M, 1), w scale_inv (1, N), a bf16
    bias, bf16 out; against float64 emulation and, on the GPU, no more than twice _scaled_mm's error."""
    k = kern("ind_fp8_rowwise", cache_dir)
    g = gen(19 + int(input_dtype == f16))
    m, kk, n = 512, 128, 64
    xq, xs = quantize_rowwise(rnd((m, kk), input_dtype, g))
    wq, ws = quantize_rowwise(rnd((n, kk), input_dtype, g))
    bias = rnd((n,), input_dtype, g).to(bf16)
    ops = {"sa": xs, "sb": ws.t(), "bias": bias}
    got = run_case(k, ind_fp8_rowwise, xq, wq.t(), ops, acc_tol=FP8_TOL, dtypes=False, what="fp8 rowwise")
    assert got.dtype == bf16 and got.shape == (m, n)
    if ON_GPU:
        pt = scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.t(), bias=bias, out_dtype=bf16)
        no_worse_than(got, pt, ref64(ind_fp8_rowwise, xq, wq.t(), **ops), 1e-3, "against _scaled_mm")


def test_ind_fp8_tensorwise(cache_dir):
    """test_fp8_tensorwise_scaling (float16 in and out, with a bias): 0-dim scale_inv, .to(float16)."""
    k = kern("ind_fp8_tensorwise", cache_dir)
    g = gen(21)
    m, kk, n = 512, 128, 64
    xq, xs = quantize_tensorwise(rnd((m, kk), f16, g))
    wq, ws = quantize_tensorwise(rnd((n, kk), f16, g))
    ops = {"sa": xs, "sb": ws, "bias": rnd((n,), f16, g)}
    got = run_case(
        k, ind_fp8_tensorwise, xq, wq.t(), ops, acc_tol=FP8_TOL, dtypes=False, what="fp8 tensorwise"
    )
    assert got.dtype == f16
    if ON_GPU:
        pt = scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, bias=ops["bias"], out_dtype=f16)
        no_worse_than(got, pt, ref64(ind_fp8_tensorwise, xq, wq.t(), **ops), 1e-3, "against _scaled_mm")
