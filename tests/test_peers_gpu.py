"""Peers' fused-GEMM-epilogue tests, restated against evtc's public API (GPU).

Each group says which peer test it restates:

* NVIDIA/cutlass  test/python/cutlass/evt/evt_{compute,load,store,mixed,layout}_sm80_90.py
  (integer-valued inputs, checked bit for bit; problem sizes m in {8, 512-3*8, 768},
  n in {8, 512-8, 768}, k = 128, l = 3, as its EVTTestCaseBase.get_problem_sizes(8)).
* Dao-AILab/quack  tests/test_linear.py (gemm / gemm_act / gemm_dact / gemm_gated / gemm_add with
  alpha and beta, A/B/out majors), tests/test_gemm_epilogue.py (norm_gelu, scalar_and_c,
  linear_epi, rms_fused, gated_swiglu, gated_operands_and_d, dgated(_norm_reduce), residual,
  amax_reduce, max_reduce_ragged_oob, rowvec_reduce, lse_partials, multi_output_mixed_dtype),
  tests/test_gemm_split_k.py, tests/test_gemm_quant_out.py (B = identity exactness),
  tests/test_gemm_functional.py (fake tensors), tests/test_mlp.py.
* pytorch/pytorch  test/test_linalg.py (_test_addmm_addmv: addmm, _addmm_activation relu/gelu,
  transposes, 0-strided inputs, beta = 0 with a NaN input, test_addmm_sizes) and
  test/test_matmul_cuda.py (_scaled_mm tensorwise / rowwise / blockwise against emulation).

Every output is compared with an independent reference: the epilogue function (or the peer's own
formula, or torch.autograd) evaluated by torch in float64 on the same inputs. Tiles must be within
about one rounding of their dtype of it (elementwise), reductions within float32 summation error;
integer-valued problems must match bit for bit. Every kernel is then called again with NaN-poisoned
out= buffers, which must be returned as they are and hold the same bits.

Run: pytest -n 15 tests/test_peers_gpu.py (tests/conftest.py skips it without a Hopper GPU).
EVTC_PEERS_DEVICE=cpu runs it on CPU tensors (evtc's torch path): a check of the tests, not the kernels.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from peer_checks import DEV, ROUNDOFF, SMALLEST, as_list, bf16, e4m3, e5m2, f16, f32, gen, rnd, wide

import evtc

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
pytestmark = pytest.mark.gpu if DEV == "cuda" else []
# A pinned cluster pins tile and cluster too (docs/compile.md): one build serves every call.
FIX = {"cluster": (1, 2)}


# ----------------------------------------------------------------------------------------------
# The disk cache: one per run, shared by the xdist workers (evtc locks each entry while building).


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    path = root / "evtc-peers-cache"
    path.mkdir(exist_ok=True)
    return str(path)


# ----------------------------------------------------------------------------------------------
# Checking


def acc64(a, b):
    return torch.matmul(wide(a), wide(b))


def ref64(fn, a, b, **ops):
    """The epilogue function itself, on real tensors in float64: the reference."""
    return fn(acc64(a, b), **{k: wide(v) for k, v in ops.items()})


def assert_close(out, ref, *, acc_tol=1e-5, what=""):
    """|out - ref| <= (2u + acc_tol) (|ref| + rms(ref)) elementwise, u the unit roundoff of out's
    dtype: one rounding of the output plus float32 accumulation. NaN never passes unless the
    reference is NaN there too."""
    assert tuple(out.shape) == tuple(ref.shape), f"{what}: shape {tuple(out.shape)} vs {tuple(ref.shape)}"
    if out.numel() == 0:
        return
    o, r = wide(out), wide(ref)
    u = ROUNDOFF[out.dtype]
    finite = torch.isfinite(r)
    rms = r[finite].square().mean().sqrt().item() if finite.any() else 0.0
    t = 2 * u + acc_tol
    tol = t * r.abs() + t * rms + SMALLEST[out.dtype]
    err = (o - r).abs()
    ok = (err <= tol) | (o == r) | (torch.isnan(o) & torch.isnan(r))
    if not bool(ok.all()):
        bad = (~ok).nonzero()
        i = tuple(bad[0].tolist())
        raise AssertionError(
            f"{what} ({out.dtype}, shape {tuple(out.shape)}): {int((~ok).sum())} of {ok.numel()} "
            f"elements off; first at {i}: got {o[i].item()!r}, want {r[i].item()!r} "
            f"(tol {tol[i].item():.3g}); max err {err.nan_to_num(float('inf')).max().item():.3g}, "
            f"rms(ref) {rms:.3g}")


def assert_exact(out, ref, *, what=""):
    """Bit for bit: ref (exact in float64) rounded once to out's dtype."""
    assert tuple(out.shape) == tuple(ref.shape), f"{what}: shape {tuple(out.shape)} vs {tuple(ref.shape)}"
    want = ref.to(out.dtype).float() if ref.dtype != out.dtype else ref.float()
    got = out.float()
    ok = (got == want) | (torch.isnan(got) & torch.isnan(want))
    if not bool(ok.all()):
        i = tuple((~ok).nonzero()[0].tolist())
        raise AssertionError(f"{what} ({out.dtype}): {int((~ok).sum())} of {ok.numel()} elements differ; "
                             f"first at {i}: got {got[i].item()!r}, want {want[i].item()!r}")


def check_outputs(got, ref, *, exact=False, acc_tol=1e-5, what=""):
    g, r = as_list(got), as_list(ref)
    assert len(g) == len(r), f"{what}: {len(g)} outputs, the function returns {len(r)}"
    for i, (o, e) in enumerate(zip(g, r, strict=True)):
        name = f"{what} output {i}"
        if exact:
            assert_exact(o, e, what=name)
        else:
            assert_close(o, e, acc_tol=acc_tol, what=name)


def assert_peer_rule(out, ref, lowp, *, slack=1e-6, what=""):
    """quack's rule: no more than twice the error of torch's own low-precision path."""
    err = (wide(out) - wide(ref)).abs().max().item()
    err_pt = (wide(lowp) - wide(ref)).abs().max().item()
    assert err <= 2 * err_pt + slack, f"{what}: max error {err:.3g}, torch's low-precision path {err_pt:.3g}"


def _poison_like(t, major):
    full = torch.full(tuple(t.shape), float("nan"), device=t.device)
    if major == "col" and t.dim() >= 2 and t.shape[-1] > 1 and t.shape[-2] > 1:
        store = torch.full((*t.shape[:-2], t.shape[-1], t.shape[-2]), float("nan"), device=t.device)
        return store.to(t.dtype).transpose(-1, -2)
    return full.to(t.dtype)


def poisoned(got, major="row"):
    if isinstance(got, dict):
        return {k: _poison_like(v, major) for k, v in got.items()}
    if isinstance(got, tuple | list):
        return type(got)(_poison_like(v, major) for v in got)
    return _poison_like(got, major)


def _same_bits(x, y):
    x, y = x.float(), y.float()
    return bool(((x == y) | (torch.isnan(x) & torch.isnan(y))).all())


def expect_path(k, path, what=""):
    if path and SM90 and DEV == "cuda":
        assert k.last_path == path, (f"{what}: took the {k.last_path!r} path, expected {path!r} "
                                     "(docs/compile.md, 'Call paths')")


def run_case(k, fn, a, b, ops, *, exact=False, acc_tol=1e-5, out_major="row", path="kernel", what="",
             ref=None):
    """Call the kernel, compare with the reference, call again into NaN-poisoned out= buffers, check
    that inputs were not written."""
    snap = {n: v.clone() for n, v in ops.items() if torch.is_tensor(v)}
    a0 = a.clone() if torch.is_tensor(a) else None
    b0 = b.clone() if torch.is_tensor(b) else None
    got = k(a, b, **ops)
    expect_path(k, path, what)
    if ref is None:
        ref = ref64(fn, a, b, **ops)
    check_outputs(got, ref, exact=exact, acc_tol=acc_tol, what=what)
    outs = poisoned(got, out_major)
    got2 = k(a, b, **ops, out=outs)
    for o, p in zip(as_list(got2), as_list(outs), strict=True):
        assert o is p, f"{what}: out= tensor not returned as given"
    if out_major == "row":
        for i, (x, y) in enumerate(zip(as_list(got), as_list(got2), strict=True)):
            assert _same_bits(x, y), f"{what} output {i}: out= call gave other bits than the first call"
    else:
        check_outputs(got2, ref, exact=exact, acc_tol=acc_tol, what=what + " (column-major out=)")
    for n, v in snap.items():
        assert _same_bits(ops[n], v), f"{what}: input {n} was written"
    if a0 is not None:
        assert _same_bits(a, a0) and _same_bits(b, b0), f"{what}: a or b was written"
    return got


# ----------------------------------------------------------------------------------------------
# Data




def rint(shape, dtype=f16, g=None, major="row", lo=-4, hi=4):
    """Integers in [lo, hi): CUTLASS's ceil(uniform(-4.5, 3.5))."""
    shape = tuple(shape)
    if major == "col":
        store = (*shape[:-2], shape[-1], shape[-2])
        return torch.randint(lo, hi, store, generator=g, device=DEV).to(dtype).transpose(-1, -2)
    return torch.randint(lo, hi, shape, generator=g, device=DEV).to(dtype)


def gemm_inputs(m, n, k, batches=None, dtype=f16, g=None, a_major="k", b_major="n", integer=False):
    """a (.., m, k) and b (.., k, n); random ones scaled so that acc has about unit variance."""
    lead = () if batches is None else (batches,)
    am = "row" if a_major == "k" else "col"
    bm = "row" if b_major == "n" else "col"
    if integer:
        return rint((*lead, m, k), dtype, g, am), rint((*lead, k, n), dtype, g, bm)
    s = max(k, 1) ** -0.25
    return rnd((*lead, m, k), dtype, g, s, am), rnd((*lead, k, n), dtype, g, s, bm)


def meta(*shape, dtype=f16, major="row"):
    if major == "col":
        return torch.empty((*shape[:-2], shape[-1], shape[-2]), dtype=dtype, device="meta").transpose(-1, -2)
    return torch.empty(shape, dtype=dtype, device="meta")


# Example sizes (only dtype, kind and layout matter): all distinct, so kinds are unambiguous.
EM, EN, EK, EL = 256, 512, 128, 3


def ex_ab(dtype=f16, batches=None, a_major="k", b_major="n", gated=False):
    lead = () if batches is None else (batches,)
    n = 2 * EN if gated else EN
    return {"a": meta(*lead, EM, EK, dtype=dtype, major="row" if a_major == "k" else "col"),
            "b": meta(*lead, EK, n, dtype=dtype, major="row" if b_major == "n" else "col")}


# ----------------------------------------------------------------------------------------------
# Epilogues. Named module-level functions: the kernels' names say which peer test they restate.

# NVIDIA/cutlass evt_compute_sm80_90.py


def evt_arith(acc, C, alpha: float, beta: float, gamma: float):
    return ((acc + C) * alpha - gamma) / beta


def evt_func_call(acc, C, alpha: float, beta: float, gamma: float):
    return (torch.relu(acc + alpha) + C) * beta + gamma      # multiply_add(relu(acc+alpha)+C, beta, gamma)


def evt_func_call2(acc, C, alpha: float, beta: float):
    return torch.clamp_min(alpha * acc + beta * C, 0.0)      # maximum(alpha*acc + beta*C, 0.0)


def evt_unary(acc):
    return torch.tanh(acc), torch.sigmoid(acc), F.gelu(acc), torch.exp(acc)   # test_tanh/sigmoid/gelu/exp


# evt_load_sm80_90.py


def evt_tensor_load(acc, C, aux, aux_batch):
    return acc + C + aux + aux_batch


def evt_row_broadcast(acc, C, bias, bias_batch):
    return acc + C + bias + bias_batch


def evt_column_broadcast(acc, C, bias, bias_batch):
    return acc + C + bias + bias_batch


def evt_scalar_broadcast(acc, C, alpha: float, alpha_batch, s):
    return acc + C + alpha + alpha_batch + s


# evt_store_sm80_90.py (the per-batch reductions; CUTLASS's reductions across batches are finished
# on the host here: evtc documents reductions over dims (0, 2) / (0, 1) as errors)


def evt_aux_store(acc, alpha: float, C):
    f = alpha * acc
    return f + C, f


def evt_row_reduce_max(acc, alpha: float, C):     # CUTLASS test_col_reduce: [m, n] -> [m, 1]
    f = alpha * acc
    return f + C, f.amax(-1), acc.amax(-1)


def evt_col_reduce_max(acc, alpha: float, C):     # CUTLASS test_row_reduce: [m, n] -> [n]
    f = alpha * acc
    return f + C, f.amax(-2), acc.amax(-2)


def evt_scalar_reduce_max(acc, alpha: float, C):  # CUTLASS test_scalar_reduce
    f = alpha * acc
    return f + C, f.amax(), acc.amax((-2, -1))


# evt_mixed_sm80_90.py


def evt_same_var(acc):
    z0 = torch.relu(acc)
    return z0, z0 + z0                 # the first output has users (CUTLASS refuses this on SM90)


def evt_no_lca(acc, bias):
    e = torch.relu(acc)
    f = e + bias  # noqa: F841 - unused on purpose, as in CUTLASS
    tmp = e + 2
    return tmp + e


def evt_mixed_dag(acc, alpha: float, C, beta: float, aux, cbias, rbias):
    f = alpha * acc + (beta * C + aux)
    f_col_max = f.amax(-2)
    e = torch.relu(f + 1) + cbias + rbias
    e_row_max = e.amax(-1, keepdim=True)
    return e + f, f, f_col_max, e_row_max


def evt_mixed_dag_sk(acc, alpha: float, C, beta: float, aux, cbias, rbias):   # test_mixed_dag_stream_k
    f = alpha * acc + (beta * C + aux)
    e = torch.relu(f + 1) + cbias + rbias
    return e + f, f, f.amax(-2), e.amax(-1, keepdim=True)


# quack tests/test_linear.py test_gemm / test_gemm_add_inplace(_alpha_beta); pytorch addmm


def gemm_add(acc, C, alpha: float, beta: float):
    return alpha * acc + beta * C


def addmm_gelu(acc, C, alpha: float, beta: float):     # torch._addmm_activation(use_gelu=True), CUDA: tanh
    return F.gelu(alpha * acc + beta * C, approximate="tanh")


def addmm_relu_vec(acc, V, alpha: float, beta: float):  # the vector-bias epilogue-fusion case
    return torch.relu(alpha * acc + beta * V)


# quack test_linear_act / test_gemm_act_alpha: (preact, postact), alpha before the bias


def _in_acc_dtype(acc, *outputs):
    """quack's pre- and post-activations come back in the inputs' dtype; a float32 bias would make
    them float32, as torch promotes them."""
    return tuple(o.to(acc.dtype) for o in outputs)


def act_relu(acc, bias, alpha: float):
    pre = alpha * acc + bias
    return _in_acc_dtype(acc, pre, torch.relu(pre))


def act_relu_sq(acc, bias, alpha: float):
    pre = alpha * acc + bias
    return _in_acc_dtype(acc, pre, torch.relu(pre).square())


def act_gelu_tanh(acc, bias, alpha: float):
    pre = alpha * acc + bias
    return _in_acc_dtype(acc, pre, F.gelu(pre, approximate="tanh"))


def act_tanh(acc, bias, alpha: float):
    pre = alpha * acc + bias
    return _in_acc_dtype(acc, pre, torch.tanh(pre))


def act_silu(acc, bias, alpha: float):
    pre = alpha * acc + bias
    return _in_acc_dtype(acc, pre, F.silu(pre))


ACT_KERNELS = {"relu": act_relu, "relu_sq": act_relu_sq, "gelu_tanh": act_gelu_tanh, "tanh": act_tanh,
               "silu": act_silu}
ACT_TORCH = {"relu": torch.relu, "relu_sq": lambda x: torch.relu(x).square(),
             "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "tanh": torch.tanh, "silu": F.silu}


def act_pack1(acc, bias):           # the rest of docs/epilogues.md's activations, as aux outputs
    y = acc + bias
    return _in_acc_dtype(acc, F.relu6(y), F.leaky_relu(y, 0.1), F.elu(y), F.softplus(y), F.mish(y),
                         F.hardswish(y))


def act_pack2(acc, bias):
    y = acc + bias
    return _in_acc_dtype(acc, F.hardsigmoid(y), F.hardtanh(y, -0.5, 0.5), F.gelu(y), torch.sigmoid(y),
                         F.softplus(y, beta=2.0, threshold=5.0), F.silu(y))


# quack test_gemm_dact: dx = dout * act'(preact), postact = act(preact), both * colvec_scale, and
# the colvec reduce sum(postact * dout)


def dact_relu(acc, preact, scale):
    post = torch.relu(preact)
    dx = acc * (preact > 0)
    return (dx * scale).to(acc.dtype), (post * scale).to(acc.dtype), (post * acc).float().sum(-1)


def dact_relu_sq(acc, preact, scale):
    r = torch.relu(preact)
    post = r * r
    dx = acc * 2 * r
    return (dx * scale).to(acc.dtype), (post * scale).to(acc.dtype), (post * acc).float().sum(-1)


def dact_gelu_tanh(acc, preact, scale):
    c = 0.7978845608028654
    inner = c * (preact + 0.044715 * preact * preact * preact)
    t = torch.tanh(inner)
    post = 0.5 * preact * (1 + t)
    d = 0.5 * (1 + t) + 0.5 * preact * (1 - t * t) * c * (1 + 3 * 0.044715 * preact * preact)
    dx = acc * d
    return (dx * scale).to(acc.dtype), (post * scale).to(acc.dtype), (post * acc).float().sum(-1)


def dact_tanh(acc, preact, scale):
    post = torch.tanh(preact)
    dx = acc * (1 - post * post)
    return (dx * scale).to(acc.dtype), (post * scale).to(acc.dtype), (post * acc).float().sum(-1)


DACT_KERNELS = {"relu": dact_relu, "relu_sq": dact_relu_sq, "gelu_tanh": dact_gelu_tanh, "tanh": dact_tanh}


# quack test_gemm_gated / gated_to_pytorch_fn_map (evtc's halves: [W_gate; W_up], not interleaved)


def gated_pack(acc, bias):
    gate, up = (acc + bias).chunk(2, dim=-1)
    g7, u7 = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
    return _in_acc_dtype(acc,
                         F.silu(gate) * up,                           # swiglu
                         F.relu(gate) * up,                           # reglu
                         F.gelu(gate, approximate="tanh") * up,       # geglu
                         torch.sigmoid(gate) * up,                    # glu
                         g7 * torch.sigmoid(1.702 * g7) * (u7 + 1))   # swiglu_oai (gpt-oss, limit 7)


def swiglu(acc):
    gate, up = acc.chunk(2, dim=-1)
    return F.silu(gate) * up


def norm_swiglu_residual(acc, rstd, bias, residual):   # quack gated_operands_and_d (+ a residual)
    gate, up = (acc * rstd + bias).chunk(2, dim=-1)
    return F.silu(gate) * up + residual


def gated_full_width(acc):
    gate, up = acc.chunk(2, dim=-1)
    return F.silu(gate) * up, acc       # quack's D writeback of the pre-activation: not in evtc


# quack test_epi_mod_dgated / dgated_norm_reduce: the halves of the pre-activation as two tiles


def dswiglu_norm(acc, gate, up, rstd):
    dout = acc * rstd
    s = torch.sigmoid(gate)
    silu = gate * s
    dgate = dout * up * s * (1 + gate * (1 - s))
    dup = dout * silu
    post = silu * up
    return dgate, dup, post * rstd, (post * acc).sum(-1)


# quack gemm_rms / rms_fused, norm_gelu, gemm_norm_act


def gemm_rms(acc, C, weight, eps: float):
    d = acc + C
    rstd = torch.rsqrt((d * d).mean(-1) + eps)
    return d * weight, rstd, d


def norm_gelu(acc, rstd, weight):
    x = acc * rstd * weight
    return x, F.gelu(x, approximate="tanh")


def norm_act(acc, C, rstd):
    pre = (acc + C) * rstd
    return pre, F.gelu(pre, approximate="tanh")


# quack reductions: amax_reduce, max_reduce_ragged_oob, rowvec_reduce, lse_partials; sum, max and
# sum of squares per row and per column


def red_stats(acc, bias):
    y = acc + bias
    return y, y.abs().amax(-1), y.sum(-1), (y * y).sum(-1), y.amax(-2), y.sum(-2), (y * y).sum(-2)


def neg_max(acc):
    return acc, acc.amax(-1), acc.amax(-2)


def red_only(acc):
    return (acc * acc).sum(-1), acc.abs().amax(), acc.amin(-2), acc.mean()


def colsum_y(acc, y):
    return acc, (acc * y).sum(-2)


def lse(acc, scale: float):
    # float32 partials, as quack's are (on a bf16 acc, torch's own would be bf16)
    return acc, torch.log(torch.exp(acc.float() * scale).sum(-1))


def dual_out(acc):                  # quack multi_output_mixed_dtype
    return acc, F.gelu(acc, approximate="tanh"), torch.relu(acc).to(torch.float32)


# quack test_gemm_split_k


def sk_bias(acc, bias, alpha: float):
    return alpha * acc + bias


def sk_add(acc, C):
    return acc + C


# quack test_gemm_quant_out / pytorch _scaled_mm


def fp8_quant(acc, scale):
    y = acc * scale
    return y.to(e4m3), y.to(e5m2), y.abs().amax()


def fp8_rowwise(acc, sa, sb, bias, s_out):
    y = F.gelu(acc * sa * sb + bias)
    return y, (y * s_out).to(e4m3), y.abs().amax()


def fp8_tensorwise(acc, sa, sb):
    return acc * sa * sb


def fp8_block(acc, bias):
    return acc + bias


# Batches that broadcast (a batched, b shared): docs say the torch path


def bcast_bias_relu(acc, bias):
    return torch.relu(acc + bias)


# The size sweep (default configuration: each call picks its launch)


def sweep_main(acc, bias, C, alpha: float):
    y = F.gelu(alpha * acc + bias)
    return y + C, y


def lin_relu_sq(acc, bias):
    return torch.relu(acc + bias).square()


def mlp_gelu(acc):
    return F.gelu(acc, approximate="tanh")


# ----------------------------------------------------------------------------------------------
# Kernels: name -> (fn, examples, options). Everything compiles from meta examples.


def _s(**kw):
    return kw


B3 = EL


SPECS = {
    # cutlass compute (batched, as the testbed)
    "evt_arith": (evt_arith, lambda: {**ex_ab(f16, B3), "C": meta(B3, EM, EN),
                                      "alpha": 1.5, "beta": 0.5, "gamma": 2.5}, _s(config=FIX)),
    "evt_arith_bf16": (evt_arith, lambda: {**ex_ab(bf16, B3), "C": meta(B3, EM, EN, dtype=bf16),
                                           "alpha": 1.5, "beta": 0.5, "gamma": 2.5}, _s(config=FIX)),
    "evt_func_call": (evt_func_call, lambda: {**ex_ab(f16, B3), "C": meta(B3, EM, EN), "alpha": 1.5,
                                              "beta": 0.5, "gamma": 2.5}, _s(config=FIX)),
    "evt_func_call2": (evt_func_call2, lambda: {**ex_ab(f16, B3), "C": meta(B3, EM, EN), "alpha": 1.5,
                                                "beta": 0.5}, _s(config=FIX)),
    "evt_unary": (evt_unary, lambda: ex_ab(f16, B3), _s(config=FIX)),
    # cutlass load
    "evt_tensor_load": (evt_tensor_load, lambda: {**ex_ab(f16, B3), "C": meta(B3, EM, EN),
                                                  "aux": meta(EM, EN),
                                                  "aux_batch": meta(B3, EM, EN, dtype=f32)},
                        _s(config=FIX)),
    "evt_row_broadcast": (evt_row_broadcast, lambda: {**ex_ab(f16, B3), "C": meta(B3, EM, EN),
                                                      "bias": meta(EN),
                                                      "bias_batch": meta(B3, 1, EN, dtype=f32)},
                          _s(config=FIX)),
    "evt_column_broadcast": (evt_column_broadcast, lambda: {**ex_ab(f16, B3), "C": meta(B3, EM, EN),
                                                            "bias": meta(EM, 1),
                                                            "bias_batch": meta(B3, EM, 1, dtype=f32)},
                             _s(config=FIX)),
    "evt_scalar_broadcast": (evt_scalar_broadcast, lambda: {**ex_ab(f16, B3), "C": meta(B3, EM, EN),
                                                            "alpha": 0.5,
                                                            "alpha_batch": meta(B3, 1, 1, dtype=f32),
                                                            "s": meta(1, dtype=f32)}, _s(config=FIX)),
    # cutlass store
    "evt_aux_store": (evt_aux_store, lambda: {**ex_ab(f16, B3), "alpha": 0.5, "C": meta(B3, EM, EN)},
                      _s(config=FIX)),
    "evt_row_reduce_max": (evt_row_reduce_max, lambda: {**ex_ab(f16, B3), "alpha": 2.0,
                                                        "C": meta(B3, EM, EN)}, _s(config=FIX)),
    "evt_col_reduce_max": (evt_col_reduce_max, lambda: {**ex_ab(f16, B3), "alpha": 2.0,
                                                        "C": meta(B3, EM, EN)}, _s(config=FIX)),
    "evt_scalar_reduce_max": (evt_scalar_reduce_max, lambda: {**ex_ab(f16, B3), "alpha": 2.0,
                                                              "C": meta(B3, EM, EN)}, _s(config=FIX)),
    # cutlass mixed
    "evt_same_var": (evt_same_var, lambda: ex_ab(f16, B3), _s(config=FIX)),
    "evt_no_lca": (evt_no_lca, lambda: {**ex_ab(f16, B3), "bias": meta(EM, 1)}, _s(config=FIX)),
    "evt_mixed_dag": (evt_mixed_dag, lambda: {**ex_ab(f16, B3), "alpha": 1.0, "C": meta(B3, EM, EN),
                                              "beta": 1.0, "aux": meta(B3, EM, EN), "cbias": meta(EM, 1),
                                              "rbias": meta(EN)},
                      _s(config=FIX)),
    "evt_mixed_dag_nobatch": (evt_mixed_dag, lambda: {**ex_ab(f16), "alpha": 1.0, "C": meta(EM, EN),
                                                      "beta": 1.0, "aux": meta(EM, EN), "cbias": meta(EM, 1),
                                                      "rbias": meta(EN)},
                              _s(config=FIX)),
    "evt_mixed_dag_sk": (evt_mixed_dag_sk, lambda: {**ex_ab(f16, B3), "alpha": 1.0, "C": meta(B3, EM, EN),
                                                    "beta": 1.0, "aux": meta(B3, EM, EN),
                                                    "cbias": meta(EM, 1), "rbias": meta(EN)},
                         _s(config={"cluster": (1, 2), "split_k": True})),
    # layouts: alpha * acc + beta * C with every (A, B) major, C row-major; and C column-major
    **{f"gemm_add_{am}{bm}": (gemm_add, (lambda am=am, bm=bm: {**ex_ab(bf16, None, am, bm),
                                                                "C": meta(EM, EN, dtype=bf16),
                                                                "alpha": 1.0, "beta": 1.0}), _s(config=FIX))
       for am in ("k", "m") for bm in ("n", "k")},
    "gemm_add_kk_ccol": (gemm_add, lambda: {**ex_ab(bf16, None, "k", "k"),
                                            "C": meta(EM, EN, dtype=bf16, major="col"),
                                            "alpha": 1.0, "beta": 1.0}, _s(config=FIX)),
    # pytorch addmm / _addmm_activation
    "addmm_gelu": (addmm_gelu, lambda: {**ex_ab(f16), "C": meta(EM, EN), "alpha": 1.2, "beta": 0.8},
                   _s(config=FIX)),
    "addmm_relu_vec": (addmm_relu_vec, lambda: {**ex_ab(f16), "V": meta(EN), "alpha": 1.2, "beta": 1.0},
                       _s(config=FIX)),
    # quack gemm_act (weight (N, K): b = w.t(), K-major)
    **{f"act_{name}": (fn, lambda: {**ex_ab(bf16, None, "k", "k"), "bias": meta(EN, dtype=f32), "alpha": 1.0},
                       _s(config=FIX)) for name, fn in ACT_KERNELS.items()},
    "act_pack1": (act_pack1, lambda: {**ex_ab(f16), "bias": meta(EN, dtype=f32)}, _s(config=FIX)),
    "act_pack2": (act_pack2, lambda: {**ex_ab(f16), "bias": meta(EN, dtype=f32)}, _s(config=FIX)),
    # quack gemm_dact
    **{f"dact_{name}": (fn, lambda: {**ex_ab(bf16, None, "k", "k"), "preact": meta(EM, EN, dtype=bf16),
                                     "scale": meta(EM, 1, dtype=f32)}, _s(config=FIX))
       for name, fn in DACT_KERNELS.items()},
    # quack gated
    "gated_pack": (gated_pack, lambda: {**ex_ab(bf16, None, "k", "k", gated=True),
                                        "bias": meta(2 * EN, dtype=f32)}, _s(config=FIX)),
    "swiglu": (swiglu, lambda: ex_ab(f16, None, "k", "k", gated=True), _s()),
    "norm_swiglu_residual": (norm_swiglu_residual,
                             lambda: {**ex_ab(bf16, 2, "k", "k", gated=True),
                                      "rstd": meta(2, EM, 1, dtype=f32),
                                      "bias": meta(2, 1, 2 * EN, dtype=f32),
                                      "residual": meta(2, EM, EN, dtype=bf16)},
                             _s(config=FIX)),
    "dswiglu_norm": (dswiglu_norm, lambda: {**ex_ab(bf16, 2, "k", "k"), "gate": meta(2, EM, EN, dtype=bf16),
                                            "up": meta(2, EM, EN, dtype=bf16),
                                            "rstd": meta(2, EM, 1, dtype=f32)},
                     _s(config=FIX)),
    # quack norms
    "gemm_rms": (gemm_rms, lambda: {**ex_ab(bf16, 2, "k", "k"), "C": meta(2, EM, EN, dtype=bf16),
                                    "weight": meta(2, 1, EN, dtype=f32), "eps": 1e-6}, _s(config=FIX)),
    "norm_gelu": (norm_gelu, lambda: {**ex_ab(bf16, 2, "k", "k"), "rstd": meta(2, EM, 1, dtype=f32),
                                      "weight": meta(2, 1, EN, dtype=f32)}, _s(config=FIX)),
    "norm_act": (norm_act, lambda: {**ex_ab(bf16, None, "k", "k"), "C": meta(EM, EN, dtype=bf16),
                                    "rstd": meta(EM, 1, dtype=f32)}, _s(config=FIX)),
    # reductions
    "red_stats": (red_stats, lambda: {**ex_ab(bf16, None, "k", "k"), "bias": meta(EN, dtype=f32)}, _s()),
    "neg_max": (neg_max, lambda: ex_ab(bf16, 2, "k", "k"), _s(config=FIX)),
    "red_only": (red_only, lambda: ex_ab(bf16, None, "k", "k"), _s(config=FIX)),
    "colsum_y": (colsum_y, lambda: {**ex_ab(bf16, 2, "k", "k"), "y": meta(2, EM, EN, dtype=bf16)},
                 _s(config=FIX)),
    "lse": (lse, lambda: {**ex_ab(bf16, 2, "k", "k"), "scale": 8.0}, _s(config=FIX)),
    "dual_out": (dual_out, lambda: ex_ab(bf16, 2, "k", "k"), _s(config=FIX)),
    # split-K
    "sk_bias": (sk_bias, lambda: {**ex_ab(bf16), "bias": meta(EN, dtype=f32), "alpha": 1.0},
                _s(config={"split_k": True})),
    "sk_bias_f32": (sk_bias, lambda: {**ex_ab(bf16), "bias": meta(EN, dtype=f32), "alpha": 1.0},
                    _s(config={"split_k": True}, out_dtypes=f32)),
    "sk_add_batched": (sk_add, lambda: {**ex_ab(bf16, B3), "C": meta(B3, EM, EN, dtype=bf16)},
                       _s(config={"split_k": True})),
    # float8
    "fp8_quant": (fp8_quant, lambda: {**ex_ab(e4m3, None, "k", "k"), "scale": meta(1, dtype=f32)}, _s()),
    "fp8_rowwise": (fp8_rowwise, lambda: {**ex_ab(e4m3, None, "k", "k"), "sa": meta(EM, 1, dtype=f32),
                                          "sb": meta(EN, dtype=f32), "bias": meta(EN, dtype=bf16),
                                          "s_out": meta(1, dtype=f32)}, _s()),
    "fp8_tensorwise": (fp8_tensorwise, lambda: {**ex_ab(e4m3, None, "k", "k"), "sa": meta(dtype=f32),
                                                "sb": meta(dtype=f32)}, _s()),
    "fp8_tensorwise_e5m2": (fp8_tensorwise, lambda: {"a": meta(EM, EK, dtype=e5m2),
                                                     "b": meta(EK, EN, dtype=e4m3, major="col"),
                                                     "sa": meta(dtype=f32), "sb": meta(dtype=f32)}, _s()),
    "fp8_block": (fp8_block, lambda: {"a": (meta(EM, EK, dtype=e4m3), meta(EM, 1, dtype=f32, major="col")),
                                      "b": (meta(EK, EN, dtype=e4m3, major="col"),
                                            meta(1, EN // 128, dtype=f32, major="col")),
                                      "bias": meta(EN, dtype=bf16)}, _s()),
    # others
    "bcast_bias_relu": (bcast_bias_relu, lambda: {"a": meta(B3, EM, EK), "b": meta(EK, EN), "bias": meta(EN)},
                        _s(config=FIX)),
    "sweep_main": (sweep_main, lambda: {**ex_ab(f16), "bias": meta(EN, dtype=f32), "C": meta(EM, EN),
                                        "alpha": 1.0}, _s()),
}


def kern(name, cache_dir):
    fn, example, kw = SPECS[name]
    return evtc.compile(fn, example(), cache_dir=cache_dir, **kw)


def fn_of(name):
    return SPECS[name][0]


# ==============================================================================================
# NVIDIA/cutlass test/python/cutlass/evt: integer inputs, bit-for-bit results

CUTLASS_MN = [(m, n) for m in (8, 512 - 3 * 8, 768) for n in (8, 512 - 8, 768)]
CUTLASS_K, CUTLASS_L = 128, 3


@pytest.mark.parametrize("m,n", CUTLASS_MN)
@pytest.mark.parametrize("name", ["evt_arith", "evt_arith_bf16", "evt_func_call", "evt_func_call2"])
def test_cutlass_evt_compute(cache_dir, name, m, n):
    """evt_compute_sm80_90.py test_arith / test_func_call / test_func_call2."""
    k = kern(name, cache_dir)
    dt = bf16 if name.endswith("bf16") else f16
    g = gen(m * 7 + n)
    a, b = gemm_inputs(m, n, CUTLASS_K, CUTLASS_L, dt, g, integer=True)
    ops = {"C": rint((CUTLASS_L, m, n), dt, g), "alpha": 1.5, "beta": 0.5}
    if name != "evt_func_call2":
        ops["gamma"] = 2.5
    run_case(k, fn_of(name), a, b, ops, exact=True, what=f"{name} {m}x{n}")


@pytest.mark.parametrize("m,n", CUTLASS_MN)
def test_cutlass_evt_unary(cache_dir, m, n):
    """test_tanh / test_sigmoid / test_gelu / test_exp (random data: transcendental ops are not exact)."""
    k = kern("evt_unary", cache_dir)
    a, b = gemm_inputs(m, n, CUTLASS_K, CUTLASS_L, f16, gen(m + n))
    run_case(k, evt_unary, a, b, {}, what=f"evt_unary {m}x{n}")


def _load_ops(name, m, n, g):
    L = CUTLASS_L
    if name == "evt_tensor_load":
        return {"C": rint((L, m, n), f16, g), "aux": rint((m, n), f16, g),
                "aux_batch": rint((L, m, n), f32, g)}
    if name == "evt_row_broadcast":
        return {"C": rint((L, m, n), f16, g), "bias": rint((n,), f16, g),
                "bias_batch": rint((L, 1, n), f32, g)}
    if name == "evt_column_broadcast":
        return {"C": rint((L, m, n), f16, g), "bias": rint((m, 1), f16, g),
                "bias_batch": rint((L, m, 1), f32, g)}
    return {"C": rint((L, m, n), f16, g), "alpha": 0.5, "alpha_batch": rint((L, 1, 1), f32, g),
            "s": rint((1,), f32, g)}


@pytest.mark.parametrize("m,n", CUTLASS_MN)
@pytest.mark.parametrize("name", ["evt_tensor_load", "evt_row_broadcast", "evt_column_broadcast",
                                  "evt_scalar_broadcast"])
def test_cutlass_evt_load(cache_dir, name, m, n):
    """evt_load_sm80_90.py: tile, row, column and scalar operands, shared and per batch (float32 ones)."""
    k = kern(name, cache_dir)
    g = gen(m * 3 + n)
    a, b = gemm_inputs(m, n, CUTLASS_K, CUTLASS_L, f16, g, integer=True)
    run_case(k, fn_of(name), a, b, _load_ops(name, m, n, g), exact=True, what=f"{name} {m}x{n}")


@pytest.mark.parametrize("m,n", CUTLASS_MN)
@pytest.mark.parametrize("name", ["evt_aux_store", "evt_row_reduce_max", "evt_col_reduce_max",
                                  "evt_scalar_reduce_max"])
def test_cutlass_evt_store(cache_dir, name, m, n):
    """evt_store_sm80_90.py: aux store and max reductions per row, per column, per batch and overall."""
    k = kern(name, cache_dir)
    g = gen(m * 5 + n)
    a, b = gemm_inputs(m, n, CUTLASS_K, CUTLASS_L, f16, g, integer=True)
    ops = {"alpha": 0.5 if name == "evt_aux_store" else 2.0, "C": rint((CUTLASS_L, m, n), f16, g)}
    got = run_case(k, fn_of(name), a, b, ops, exact=True, what=f"{name} {m}x{n}")
    if name in ("evt_row_reduce_max", "evt_col_reduce_max"):
        # CUTLASS's F_max over dims [0, 2] / [0, 1]: the batch maximum of evtc's per-batch result.
        acc = acc64(a, b)
        axis = -1 if name == "evt_row_reduce_max" else -2
        assert_exact(got[1].amax(0), (2.0 * acc).amax(axis).amax(0), what=f"{name}: max across batches")


def test_cutlass_cross_batch_reduction_is_a_documented_error():
    """CUTLASS's max(F, dim=[0, 2]) (across batches): evtc documents it as a ReductionError."""
    def across(acc):
        return acc, acc.amax(dim=(0, 2))

    with pytest.raises(evtc.ReductionError):
        evtc.trace(across, ex_ab(f16, B3))


@pytest.mark.parametrize("m,n", CUTLASS_MN)
@pytest.mark.parametrize("name", ["evt_same_var", "evt_no_lca"])
def test_cutlass_evt_mixed_small(cache_dir, name, m, n):
    """evt_mixed_sm80_90.py test_same_variable_used_multiple_times / test_no_lca (a 0-strided column)."""
    k = kern(name, cache_dir)
    g = gen(m * 11 + n)
    a, b = gemm_inputs(m, n, CUTLASS_K, CUTLASS_L, f16, g, integer=True)
    ops = {}
    if name == "evt_no_lca":
        ops["bias"] = rint((m,), f16, g).as_strided((m, 1), (1, 0))
    run_case(k, fn_of(name), a, b, ops, exact=True, what=f"{name} {m}x{n}")


@pytest.mark.parametrize("m,n", CUTLASS_MN)
@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("alpha,beta", [(1.0, 1.0), (0.5, 2.0)])
def test_cutlass_evt_mixed_dag(cache_dir, batched, m, n, alpha, beta):
    """evt_mixed_sm80_90.py test_mixed_dag / test_mixed_dag_no_batch."""
    name = "evt_mixed_dag" if batched else "evt_mixed_dag_nobatch"
    k = kern(name, cache_dir)
    g = gen(m * 13 + n + int(batched))
    L = CUTLASS_L if batched else None
    lead = (L,) if batched else ()
    a, b = gemm_inputs(m, n, CUTLASS_K, L, f16, g, integer=True)
    ops = {"alpha": alpha, "C": rint((*lead, m, n), f16, g), "beta": beta, "aux": rint((*lead, m, n), f16, g),
           "cbias": rint((m, 1), f16, g), "rbias": rint((n,), f16, g)}
    run_case(k, evt_mixed_dag, a, b, ops, exact=True, what=f"{name} {m}x{n}")


@pytest.mark.parametrize("splits", [1, 2, 3, 15])
@pytest.mark.parametrize("m,n", [(8, 8), (488, 504), (768, 768)])
def test_cutlass_evt_mixed_dag_split_k(cache_dir, m, n, splits):
    """evt_mixed_sm80_90.py test_mixed_dag_stream_k (k = 960, l = 3): evtc's split-K instead of stream-K."""
    k = kern("evt_mixed_dag_sk", cache_dir)
    g = gen(m + n + splits)
    a, b = gemm_inputs(m, n, 960, CUTLASS_L, f16, g, integer=True)
    ops = {"alpha": 1.0, "C": rint((CUTLASS_L, m, n), f16, g), "beta": 1.0,
           "aux": rint((CUTLASS_L, m, n), f16, g), "cbias": rint((m, 1), f16, g), "rbias": rint((n,), f16, g)}
    k.pin_splits(splits)
    try:
        run_case(k, evt_mixed_dag_sk, a, b, ops, exact=True, what=f"mixed_dag split {splits} {m}x{n}")
    finally:
        k.pin_splits(None)


# ==============================================================================================
# Layouts: quack test_linear.py test_gemm (A_major x B_major x out_major) and
# test_gemm_add_inplace(_alpha_beta); pytorch _test_addmm_impl transposes


LAYOUT_SHAPES = [(960, 1504, 736), (127, 200, 72)]


@pytest.mark.parametrize("m,n,kk", LAYOUT_SHAPES)
@pytest.mark.parametrize("d_major", ["row", "col"])
@pytest.mark.parametrize("c_major", ["row", "col"])
@pytest.mark.parametrize("b_major", ["n", "k"])
@pytest.mark.parametrize("a_major", ["k", "m"])
def test_layouts(cache_dir, a_major, b_major, c_major, d_major, m, n, kk):
    if c_major == "col" and (a_major, b_major) == ("k", "k"):
        name = "gemm_add_kk_ccol"
    else:
        name = f"gemm_add_{a_major}{b_major}"
    k = kern(name, cache_dir)
    g = gen(m + n + kk)
    a, b = gemm_inputs(m, n, kk, None, bf16, g, a_major, b_major)
    C = rnd((m, n), bf16, g, major=c_major)
    compiled_c = "col" if name.endswith("ccol") else "row"
    aligned = (m, n, kk) == (960, 1504, 736)
    path = "kernel" if aligned and c_major == compiled_c else ("staged" if aligned else None)
    run_case(k, gemm_add, a, b, {"C": C, "alpha": 0.5, "beta": 1.5}, out_major=d_major, path=path,
             what=f"{name} A{a_major} B{b_major} C{c_major} D{d_major} {m}x{n}x{kk}")


def test_gemm_add_alpha_beta_grid(cache_dir):
    """quack test_gemm_add_inplace_alpha_beta: alpha in {0.5, 1, 2} x beta in {0, 0.5, 1, 1.5}, one kernel."""
    k = kern("gemm_add_kn", cache_dir)
    for m, n, kk in [(480, 512, 256), (960, 1024, 768)]:
        g = gen(m + kk)
        a, b = gemm_inputs(m, n, kk, None, bf16, g)
        C = rnd((m, n), bf16, g)
        for alpha in (0.5, 1.0, 2.0):
            for beta in (0.0, 0.5, 1.0, 1.5):
                run_case(k, gemm_add, a, b, {"C": C, "alpha": alpha, "beta": beta},
                         what=f"alpha {alpha} beta {beta} {m}x{n}x{kk}")
                assert kern("gemm_add_kn", cache_dir) is k  # new scalars: no new kernel


def test_gemm_add_out_is_c(cache_dir):
    """quack test_gemm_add_out_reuses_c_storage: out=C writes C in place and returns it."""
    k = kern("gemm_add_kn", cache_dir)
    g = gen(5)
    for m, n, kk in [(960, 1504, 736), (1920, 2048, 1024)]:
        a, b = gemm_inputs(m, n, kk, None, bf16, g)
        C = rnd((m, n), bf16, g)
        ref = ref64(gemm_add, a, b, C=C, alpha=0.5, beta=1.0)
        out = k(a, b, C=C, alpha=0.5, beta=1.0, out=C)
        assert out is C
        assert_close(C, ref, what=f"out=C {m}x{n}x{kk}")


def test_addmm_beta_zero_keeps_nan(cache_dir):
    """pytorch _test_addmm_impl 'beta=0, M=nan', restated with the function's semantics: evtc evaluates
    alpha * acc + 0.0 * C as torch does (0 * NaN = NaN), never as BLAS's 'C not read'."""
    k = kern("gemm_add_kn", cache_dir)
    g = gen(6)
    a, b = gemm_inputs(64, 128, 64, None, bf16, g)
    C = torch.full((64, 128), float("nan"), device=DEV, dtype=bf16)
    out = k(a, b, C=C, alpha=1.2, beta=0.0)
    assert bool(torch.isnan(out).all()), "0 * NaN must stay NaN (docs/epilogues.md)"


@pytest.mark.parametrize("t4", [False, True])
@pytest.mark.parametrize("t3", [False, True])
@pytest.mark.parametrize("t2", [False, True])
@pytest.mark.parametrize("t1", [False, True])
@pytest.mark.parametrize("act", ["gelu", "relu_vec"])
def test_addmm_activation_transposes(cache_dir, act, t1, t2, t3, t4):
    """pytorch test_addmm_gelu / test_addmm_relu: M 10x25, m1 10x50, m2 50x25, every transpose and a
    transposed out; alpha 1.2, beta 0.8 (the vector bias with beta 1)."""
    name = "addmm_gelu" if act == "gelu" else "addmm_relu_vec"
    k = kern(name, cache_dir)
    g = gen(int(t1) + 2 * int(t2) + 4 * int(t3) + 8 * int(t4))
    C = rnd((10, 25), f16, g, major="col" if t1 else "row") if act == "gelu" else rnd((25,), f16, g)
    a = rnd((10, 50), f16, g, 50 ** -0.25, major="col" if t2 else "row")
    b = rnd((50, 25), f16, g, 50 ** -0.25, major="col" if t3 else "row")
    ops = {"C" if act == "gelu" else "V": C, "alpha": 1.2, "beta": 0.8 if act == "gelu" else 1.0}
    run_case(k, fn_of(name), a, b, ops, out_major="col" if t4 else "row", path=None, what=f"addmm {act}")


def test_addmm_zero_strided(cache_dir):
    """pytorch _test_addmm_impl 'Test 0-strided': M (10, 1) and m1 (10, 1) expanded."""
    k = kern("addmm_gelu", cache_dir)
    g = gen(7)
    C = rnd((10, 1), f16, g).expand(10, 25)
    a = rnd((10, 1), f16, g, 0.3).expand(10, 50)
    b = rnd((50, 25), f16, g, 0.3)
    run_case(k, addmm_gelu, a, b, {"C": C, "alpha": 1.2, "beta": 0.8}, path=None, what="0-strided")


def test_addmm_sizes(cache_dir):
    """pytorch test_addmm_sizes: m in {0, 1, 25}, n in {0, 1, 10}, k in {0, 1, 8} (empty problems, K = 0)."""
    k = kern("gemm_add_kn", cache_dir)
    g = gen(8)
    for m in (0, 1, 25):
        for n in (0, 1, 10):
            for kk in (0, 1, 8):
                a, b = gemm_inputs(m, n, kk, None, bf16, g)
                C = rnd((m, n), bf16, g)
                got = k(a, b, C=C, alpha=1.2, beta=0.8)
                ref = ref64(gemm_add, a, b, C=C, alpha=1.2, beta=0.8)
                assert_close(got, ref, what=f"addmm sizes {m}x{n}x{kk}")
                out = torch.full((m, n), float("nan"), device=DEV, dtype=bf16)
                assert k(a, b, C=C, alpha=1.2, beta=0.8, out=out) is out
                assert_close(out, ref, what=f"addmm sizes out= {m}x{n}x{kk}")


# ==============================================================================================
# quack tests/test_linear.py: gemm_act, gemm_dact, gemm_gated (weight (N, K), b = w.t())

QUACK_KN = [(736, 1504), (736, 2048), (4096, 1504), (4096, 2048)]


@pytest.mark.parametrize("in_f,out_f", QUACK_KN)
@pytest.mark.parametrize("act", list(ACT_KERNELS))
def test_quack_linear_act(cache_dir, act, in_f, out_f):
    """test_linear_act (store_preact, bias, x[::2] non-contiguous) and test_gemm_act_alpha
    (alpha before the activation, a new alpha without a recompile)."""
    k = kern(f"act_{act}", cache_dir)
    g = gen(in_f + out_f)
    x = rnd((1920, in_f), bf16, g)[::2]
    w = rnd((out_f, in_f), bf16, g, in_f ** -0.5)
    bias = rnd((out_f,), f32, g)
    for alpha in (1.0, 0.7371, 0.25):
        ops = {"bias": bias, "alpha": alpha}
        got = run_case(k, ACT_KERNELS[act], x, w.t(), ops, what=f"act {act} alpha {alpha} {in_f}->{out_f}")
        ref = ref64(ACT_KERNELS[act], x, w.t(), **ops)
        pre_pt = alpha * (x @ w.t()) + bias            # torch in bf16 (+ an fp32 bias), quack's gemm_act_ref
        post_pt = ACT_TORCH[act](pre_pt).to(bf16)
        assert_peer_rule(got[1], ref[1], post_pt, what=f"act {act} postact")
        assert_peer_rule(got[0], ref[0], pre_pt.to(bf16), what=f"act {act} preact")
    assert kern(f"act_{act}", cache_dir) is k


@pytest.mark.parametrize("m,n,kk", [(1, 1504, 736), (3, 200, 72), (127, 1000, 1000), (1000, 8, 8)])
@pytest.mark.parametrize("act", ["relu", "gelu_tanh"])
def test_quack_linear_act_odd_sizes(cache_dir, act, m, n, kk):
    """The same kernels at decode and ragged sizes (the pytorch addmm_activation sizes are tiny)."""
    k = kern(f"act_{act}", cache_dir)
    g = gen(m + n + kk)
    x = rnd((m, kk), bf16, g)
    w = rnd((n, kk), bf16, g, kk ** -0.5)
    run_case(k, ACT_KERNELS[act], x, w.t(), {"bias": rnd((n,), f32, g), "alpha": 0.5}, path=None,
             what=f"act {act} {m}x{n}x{kk}")


@pytest.mark.parametrize("m", [64, 1000])
@pytest.mark.parametrize("name", ["act_pack1", "act_pack2"])
def test_activation_pack(cache_dir, name, m):
    """docs/epilogues.md's other activations (relu6, leaky_relu, elu, softplus, mish, hardswish,
    hardsigmoid, hardtanh, exact gelu, sigmoid, softplus(beta, threshold), silu), six outputs at once;
    inputs spread to cover every branch (|y| up to ~10)."""
    k = kern(name, cache_dir)
    g = gen(m)
    a, b = gemm_inputs(m, 1000, 200, None, f16, g)
    bias = rnd((1000,), f32, g, 3.0)
    a = (a.float() * 2).to(f16)
    run_case(k, fn_of(name), a, b, {"bias": bias}, what=f"{name} M={m}")


@pytest.mark.parametrize("kk", [736, 1024])
@pytest.mark.parametrize("n", [1504, 2048])
@pytest.mark.parametrize("act", list(DACT_KERNELS))
def test_quack_gemm_dact(cache_dir, act, n, kk):
    """test_gemm_dact with has_colvec_scale and colvec_reduce: checked against torch.autograd in float64."""
    k = kern(f"dact_{act}", cache_dir)
    g = gen(n + kk)
    m = 960
    dout_in = rnd((m, kk), bf16, g)
    weight = rnd((n, kk), bf16, g, kk ** -0.5)
    preact = rnd((m, n), bf16, g)
    scale = rnd((m, 1), f32, g)
    acc = acc64(dout_in, weight.t())
    p = preact.double().requires_grad_(True)
    post = ACT_TORCH[act](p)
    post.backward(acc)
    ref = (p.grad * scale.double(), post.detach() * scale.double(), (post.detach() * acc).sum(-1))
    run_case(k, DACT_KERNELS[act], dout_in, weight.t(), {"preact": preact, "scale": scale}, ref=ref,
             what=f"dact {act} {n}x{kk}")


@pytest.mark.parametrize("bias_dtype", [f32, bf16])
@pytest.mark.parametrize("in_f,out_f", QUACK_KN)
def test_quack_gemm_gated(cache_dir, in_f, out_f, bias_dtype):
    """test_gemm_gated: swiglu, reglu, geglu, glu, swiglu_oai with a bias as wide as the weight
    ([W_gate; W_up], evtc's halves). A bf16 bias for a kernel compiled with a float32 one takes the
    torch path (docs/compile.md)."""
    k = kern("gated_pack", cache_dir)
    g = gen(in_f + out_f + int(bias_dtype == bf16))
    x = rnd((960, in_f), bf16, g)
    w = rnd((2 * out_f, in_f), bf16, g, in_f ** -0.5 * 2)
    bias = rnd((2 * out_f,), bias_dtype, g)
    path = "kernel" if bias_dtype == f32 else "torch"
    got = run_case(k, gated_pack, x, w.t(), {"bias": bias}, path=path, what=f"gated {in_f}->{out_f}")
    assert all(o.shape == (960, out_f) for o in got)


@pytest.mark.parametrize("m,n,kk", [(1, 16, 8), (3, 400, 72), (127, 2000, 1000), (1000, 16, 1000),
                                    (200, 200, 72), (960, 3008, 736)])
def test_swiglu_linear(cache_dir, m, n, kk):
    """docs' SwiGLU via evtc.linear (quack test_mlp's swiglu layer): x with leading dims, w13 = [w1; w3]."""
    lin = evtc.linear(swiglu, {"x": meta(2, 128, 512), "weight": meta(2 * 512, 512)}, cache_dir=cache_dir)
    g = gen(m + n)
    x = rnd((2, m, kk), f16, g)
    w = rnd((n, kk), f16, g, kk ** -0.5 * 2)
    got = lin(x, w)
    ref = swiglu(x.double() @ w.double().t())
    assert got.shape == (2, m, n // 2)
    assert_close(got, ref, what=f"swiglu linear {m}x{n}x{kk}")
    out = torch.full((2, m, n // 2), float("nan"), device=DEV, dtype=f16)
    lin(x, w, out=out)
    assert _same_bits(out, got), "evtc.linear did not write out="


def test_linear_out_is_returned(cache_dir):
    """torch's out= convention (and quack's 'assert out is C'): the call returns the out= tensor itself.
    evtc.compile's kernels do; evtc.linear returns a reshaped view of it."""
    lin = evtc.linear(swiglu, {"x": meta(2, 128, 512), "weight": meta(2 * 512, 512)}, cache_dir=cache_dir)
    g = gen(25)
    x, w = rnd((2, 64, 256), f16, g), rnd((256, 256), f16, g, 0.1)
    out = torch.full((2, 64, 128), float("nan"), device=DEV, dtype=f16)
    assert lin(x, w, out=out) is out


def test_linear_out_non_contiguous_is_written(cache_dir):
    """An out= whose leading dims do not flatten into a view (a transposed (L, M, N) buffer) must still be
    written: evtc.compile's kernels accept out= of any layout (docs/compile.md)."""
    lin = evtc.linear(swiglu, {"x": meta(2, 128, 512), "weight": meta(2 * 512, 512)}, cache_dir=cache_dir)
    g = gen(26)
    x, w = rnd((2, 64, 256), f16, g), rnd((256, 256), f16, g, 0.1)
    want = lin(x, w)
    out = torch.full((64, 2, 128), float("nan"), device=DEV, dtype=f16).transpose(0, 1)
    lin(x, w, out=out)
    assert _same_bits(out, want), "out= was not written (the result went to a reshaped copy)"


@pytest.mark.parametrize("m,n,kk", [(384, 768, 512), (200, 504, 72), (1, 64, 64)])
def test_quack_gated_operands(cache_dir, m, n, kk):
    """test_epi_mod_gated_operands_and_d (l = 2): a per-row rstd, a per-batch bias as wide as the GEMM,
    and a residual as wide as the output."""
    k = kern("norm_swiglu_residual", cache_dir)
    g = gen(m + n)
    x = rnd((2, m, kk), bf16, g)
    w = rnd((2, 2 * n, kk), bf16, g, kk ** -0.5 * 2)
    ops = {"rstd": torch.rand((2, m, 1), generator=g, device=DEV) + 0.5, "bias": rnd((2, 1, 2 * n), f32, g),
           "residual": rnd((2, m, n), bf16, g)}
    run_case(k, norm_swiglu_residual, x, w.transpose(-1, -2), ops, path=None,
             what=f"norm_swiglu {m}x{n}x{kk}")


def test_quack_gated_full_width_output_refused(cache_dir):
    """quack writes the full-width pre-activation D beside the gated output; evtc documents that a gated
    epilogue's full-width value cannot be returned (a clear EpilogueError, docs/compile.md)."""
    with pytest.raises(evtc.EpilogueError):
        evtc.compile(gated_full_width, ex_ab(f16, None, "k", "k", gated=True), cache_dir=cache_dir)


@pytest.mark.parametrize("m,n,kk", [(384, 1536, 512), (100, 200, 72)])
def test_quack_dgated_norm_reduce(cache_dir, m, n, kk):
    """test_epi_mod_dgated_norm_reduce (l = 2): dgate, dup, postact * rstd and the per-row
    sum(postact * dout), against torch.autograd in float64."""
    k = kern("dswiglu_norm", cache_dir)
    g = gen(m + n)
    dout_in = rnd((2, m, kk), bf16, g)
    w = rnd((2, n, kk), bf16, g, kk ** -0.5)
    gate, up = rnd((2, m, n), bf16, g), rnd((2, m, n), bf16, g)
    rstd = torch.rand((2, m, 1), generator=g, device=DEV) + 0.5
    acc = acc64(dout_in, w.transpose(-1, -2))
    gg, uu = gate.double().requires_grad_(True), up.double().requires_grad_(True)
    out = F.silu(gg) * uu
    out.backward(acc * rstd.double())
    post = out.detach()
    ref = (gg.grad, uu.grad, post * rstd.double(), (post * acc).sum(-1))
    run_case(k, dswiglu_norm, dout_in, w.transpose(-1, -2), {"gate": gate, "up": up, "rstd": rstd}, ref=ref,
             path=None, what=f"dswiglu {m}x{n}x{kk}")


# ==============================================================================================
# quack tests/test_gemm_epilogue.py: norms, residuals, reductions, several outputs


@pytest.mark.parametrize("L,m,n,kk", [(2, 512, 1536, 736), (1, 127, 1000, 72), (3, 1, 200, 8)])
def test_quack_gemm_rms(cache_dir, L, m, n, kk):
    """gemm_rms / test_epi_mod_rms_fused: D = (acc + C) * weight, rstd = rsqrt(mean((acc + C)^2) + eps)
    per row, and the pre-weight value."""
    k = kern("gemm_rms", cache_dir)
    g = gen(m + n)
    a, b = gemm_inputs(m, n, kk, L, bf16, g, "k", "k")
    ops = {"C": rnd((L, m, n), bf16, g), "weight": rnd((L, 1, n), f32, g), "eps": 1e-6}
    run_case(k, gemm_rms, a, b, ops, path=None, what=f"gemm_rms {L}x{m}x{n}x{kk}")


@pytest.mark.parametrize("L,m,n,kk", [(2, 512, 1024, 736), (1, 1000, 200, 72)])
def test_quack_norm_gelu(cache_dir, L, m, n, kk):
    """test_epi_mod_norm_gelu (batched): x = acc * rstd * weight, and gelu_tanh(x) as an aux output."""
    k = kern("norm_gelu", cache_dir)
    g = gen(m + n)
    a = rnd((L, m, kk), bf16, g, kk ** -0.5 * 4)
    b = rnd((L, n, kk), bf16, g, kk ** -0.5 * 4).transpose(-1, -2)
    ops = {"rstd": torch.rand((L, m, 1), generator=g, device=DEV) + 0.5, "weight": rnd((L, 1, n), f32, g)}
    run_case(k, norm_gelu, a, b, ops, path=None, what=f"norm_gelu {L}x{m}x{n}")


@pytest.mark.parametrize("m,n,kk", [(960, 2048, 1024), (127, 200, 72), (1, 1504, 736)])
def test_quack_norm_act(cache_dir, m, n, kk):
    """gemm_norm_act_ref: preact = (acc + C) * rstd, postact = gelu_tanh(preact)."""
    k = kern("norm_act", cache_dir)
    g = gen(m + n)
    a, b = gemm_inputs(m, n, kk, None, bf16, g, "k", "k")
    ops = {"C": rnd((m, n), bf16, g), "rstd": torch.rand((m, 1), generator=g, device=DEV) + 0.5}
    run_case(k, norm_act, a, b, ops, path=None, what=f"norm_act {m}x{n}x{kk}")


@pytest.mark.parametrize("n", [1536, 1000])
def test_quack_amax_and_row_col_stats(cache_dir, n):
    """test_epi_mod_amax_reduce (n = 1536, 1000 ragged): |y| max, sum and sum of squares per row and per
    column."""
    k = kern("red_stats", cache_dir)
    g = gen(n)
    a = rnd((512, 736), bf16, g, 736 ** -0.5 * 4)
    b = rnd((n, 736), bf16, g, 736 ** -0.5 * 4).t()
    run_case(k, red_stats, a, b, {"bias": rnd((n,), f32, g)}, path=None, what=f"red_stats n={n}")


@pytest.mark.parametrize("m,n", [(256, 1000), (456, 512), (256, 1024), (1, 8), (3, 200)])
def test_quack_max_reduce_ragged_negative(cache_dir, m, n):
    """test_epi_mod_max_reduce_ragged_oob: every product negative, so a max that counted the zero
    padding past M or N would come out 0 instead of negative."""
    k = kern("neg_max", cache_dir)
    g = gen(m + n)
    kk = 512
    a = rnd((2, m, kk), bf16, g, kk ** -0.5).abs()
    b = -rnd((2, n, kk), bf16, g, kk ** -0.5).abs().transpose(-1, -2)
    got = run_case(k, neg_max, a, b, {}, path=None, what=f"neg_max {m}x{n}")
    assert bool((got[1] < 0).all()) and bool((got[2] < 0).all()), "padding counted in a max"


@pytest.mark.parametrize("m,n,kk", [(512, 1024, 736), (127, 1000, 72), (1, 8, 8), (1000, 200, 1000)])
def test_reductions_only(cache_dir, m, n, kk):
    """An epilogue of reductions only (row sum of squares, overall |max|, column min, overall mean):
    the kernel stores no tile (docs/epilogues.md)."""
    k = kern("red_only", cache_dir)
    g = gen(m + n + kk)
    a, b = gemm_inputs(m, n, kk, None, bf16, g, "k", "k")
    run_case(k, red_only, a, b, {}, path=None, what=f"red_only {m}x{n}x{kk}")


@pytest.mark.parametrize("m", [384, 440, 1])
def test_quack_rowvec_reduce(cache_dir, m):
    """test_epi_mod_rowvec_reduce (batched; 440 leaves a ragged last M tile): per-column sum of acc * y."""
    k = kern("colsum_y", cache_dir)
    g = gen(m)
    kk, n = 512, 1024
    a = rnd((2, m, kk), bf16, g, kk ** -0.5 * 4)
    b = rnd((2, n, kk), bf16, g, kk ** -0.5 * 4).transpose(-1, -2)
    run_case(k, colsum_y, a, b, {"y": rnd((2, m, n), bf16, g)}, path=None, what=f"colsum m={m}")


@pytest.mark.parametrize("m,n", [(512, 1536), (100, 1000)])
def test_quack_lse(cache_dir, m, n):
    """test_epi_mod_lse_partials (scale 8): log(sum(exp(acc * scale))) per row, finished in the kernel."""
    k = kern("lse", cache_dir)
    g = gen(m + n)
    kk = 512
    a = rnd((2, m, kk), bf16, g, kk ** -0.5)
    b = rnd((2, n, kk), bf16, g, kk ** -0.5).transpose(-1, -2)
    got = run_case(k, lse, a, b, {"scale": 8.0}, path=None, what=f"lse {m}x{n}")
    want = torch.logsumexp(acc64(a, b) * 8.0, dim=-1)
    assert (got[1].double() - want).abs().max().item() < 1e-4


def test_quack_multi_output_mixed_dtype(cache_dir):
    """test_epi_mod_multi_output_mixed_dtype: D, gelu_tanh and a float32 relu from one epilogue."""
    k = kern("dual_out", cache_dir)
    g = gen(11)
    kk = 736
    a = rnd((2, 512, kk), bf16, g, kk ** -0.5 * 4)
    b = rnd((2, 1024, kk), bf16, g, kk ** -0.5 * 4).transpose(-1, -2)
    got = run_case(k, dual_out, a, b, {}, path=None, what="dual_out")
    assert [o.dtype for o in got] == [bf16, bf16, f32], "an explicit final .to(float32) sets the output dtype"


@pytest.mark.parametrize("alpha", [0.5, 2.0])
def test_quack_scalar_and_c_linear_epi(cache_dir, alpha):
    """test_epi_mod_scalar_and_c (alpha * acc + C) and test_epi_mod_linear (plus row and column vectors
    per batch): the cutlass scalar-broadcast kernel with random data, l = 3."""
    k = kern("evt_mixed_dag", cache_dir)
    g = gen(int(alpha * 10))
    L, m, n, kk = 3, 512, 768, 512
    a, b = gemm_inputs(m, n, kk, L, f16, g)
    ops = {"alpha": alpha, "C": rnd((L, m, n), f16, g), "beta": 0.5, "aux": rnd((L, m, n), f16, g),
           "cbias": rnd((m, 1), f16, g), "rbias": rnd((n,), f16, g)}
    run_case(k, evt_mixed_dag, a, b, ops, what=f"linear_epi alpha {alpha}")


# ==============================================================================================
# quack tests/test_gemm_split_k.py


@pytest.mark.parametrize("name,L", [("sk_bias", None), ("sk_bias_f32", None), ("sk_add_batched", 3)])
def test_quack_split_k(cache_dir, name, L):
    """test_gemm_split_k / test_gemm_split_k_bias_alpha / test_gemm_add_split_k: 192 x 480 x 4160 (bf16
    and float32 out; L = 3), splits 2 and 5 (uneven over 65 k-tiles of 64), bit-for-bit the same on
    every run, and close to the unsplit result."""
    k = kern(name, cache_dir)
    g = gen(17)
    m, n, kk = 192, 480, 4160
    lead = () if L is None else (L,)
    a = rnd((*lead, m, kk), bf16, g, 0.25)
    b = rnd((*lead, kk, n), bf16, g, 0.25)
    ops = {"bias": rnd((n,), f32, g), "alpha": 0.5} if L is None else {"C": rnd((L, m, n), bf16, g)}
    fn = fn_of(name)
    results = {}
    try:
        for splits in (1, 2, 5):
            k.pin_splits(splits)
            got = run_case(k, fn, a, b, ops, what=f"{name} splits {splits}")
            for _ in range(2):
                again = k(a, b, **ops)
                assert _same_bits(again, got), f"{name}: split {splits} not bitwise deterministic"
            results[splits] = got
    finally:
        k.pin_splits(None)
    assert_close(results[5], results[1].double(), what=f"{name}: 5 splits against 1")


def test_quack_split_k_larger_than_k_tiles(cache_dir):
    """test_gemm_split_k_larger_than_k_tiles: 16 splits of a 4-tile K."""
    k = kern("sk_bias", cache_dir)
    g = gen(18)
    a, b = gemm_inputs(128, 256, 256, None, bf16, g)
    try:
        k.pin_splits(16)
        run_case(k, sk_bias, a, b, {"bias": rnd((256,), f32, g), "alpha": 1.0}, what="16 splits, K=256")
    finally:
        k.pin_splits(None)


def test_split_k_chosen_per_call(cache_dir):
    """The rules' own split for a decode-sized long-K problem (docs: 64 x 1024 x 8192 splits)."""
    k = kern("sk_bias", cache_dir)
    g = gen(19)
    for m, n, kk in [(64, 1024, 8192), (1, 512, 4160), (7, 200, 3000)]:
        a, b = gemm_inputs(m, n, kk, None, bf16, g)
        run_case(k, sk_bias, a, b, {"bias": rnd((n,), f32, g), "alpha": 1.0}, path=None,
                 what=f"split per call {m}x{n}x{kk} ({k.splits_for(m, n, kk)} splits)")


# ==============================================================================================
# float8: quack test_gemm_quant_out (B = identity: exact), pytorch _scaled_mm

FP8_TOL = 3e-3


@pytest.mark.parametrize("m,n,kk", [(256, 256, 256), (128, 448, 64), (64, 32, 128)])
def test_quack_fp8_quant_exact(cache_dir, m, n, kk):
    """test_quant_out_exact: b = identity, so acc = a exactly; (acc * scale) cast to e4m3 and e5m2 and
    its amax must match torch bit for bit."""
    k = kern("fp8_quant", cache_dir)
    g = gen(m + n)
    a = (torch.randn((m, kk), generator=g, device=DEV) * 50).clamp(-448, 448).to(e4m3)
    b = torch.eye(n, kk, device=DEV).to(e4m3).t()              # (K, N), K-major
    scale = torch.tensor([0.5], device=DEV)
    got = run_case(k, fp8_quant, a, b, {"scale": scale}, exact=True, path=None,
                   what=f"fp8 quant {m}x{n}x{kk}")
    y = acc64(a, b) * 0.5
    assert_exact(got[0], y, what="e4m3 against torch's cast")
    assert_exact(got[2], y.abs().amax(), what="amax")


@pytest.mark.parametrize("m,n,kk", [(256, 512, 1024), (1000, 1008, 512), (1, 2048, 4096), (16, 64, 32)])
def test_fp8_rowwise_layer(cache_dir, m, n, kk):
    """pytorch test_scaled_mm rowwise / docs/fp8.md: dequantize with (M, 1) and (N,) scales, bias, GELU,
    quantize to e4m3 with its amax."""
    k = kern("fp8_rowwise", cache_dir)
    g = gen(m + n + kk)
    a = rnd((m, kk), f32, g, 2.0).to(e4m3)
    w = rnd((n, kk), f32, g, 2.0).to(e4m3)
    sa = torch.rand((m, 1), generator=g, device=DEV) / (2 * kk ** 0.5) + 0.01
    sb = torch.rand((n,), generator=g, device=DEV) + 0.5
    ops = {"sa": sa, "sb": sb, "bias": rnd((n,), bf16, g), "s_out": torch.tensor([4.0], device=DEV)}
    run_case(k, fp8_rowwise, a, w.t(), ops, acc_tol=FP8_TOL, path=None, what=f"fp8 rowwise {m}x{n}x{kk}")


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("m,n,kk", [(16, 16, 16), (256, 512, 1024), (1024, 2048, 4096)])
def test_fp8_tensorwise_vs_scaled_mm(cache_dir, m, n, kk, mixed):
    """pytorch test_scaled_mm_vs_emulated (tensorwise; e5m2 x e4m3 too): float64 emulation, and no more
    than twice torch._scaled_mm's error."""
    k = kern("fp8_tensorwise_e5m2" if mixed else "fp8_tensorwise", cache_dir)
    g = gen(m + n + int(mixed))
    a = rnd((m, kk), f32, g, 2.0).to(e5m2 if mixed else e4m3)
    w = rnd((n, kk), f32, g, 2.0).to(e4m3)
    sa, sb = torch.tensor(0.5, device=DEV), torch.tensor(1.0 / kk ** 0.5, device=DEV)
    got = run_case(k, fp8_tensorwise, a, w.t(), {"sa": sa, "sb": sb}, acc_tol=FP8_TOL, path=None,
                   what=f"fp8 tensorwise {m}x{n}x{kk}")
    assert got.dtype == bf16, "float8 a and b give bfloat16 tiles by default (docs/fp8.md)"
    ref = ref64(fp8_tensorwise, a, w.t(), sa=sa, sb=sb)
    try:
        pt = torch._scaled_mm(a, w.t(), scale_a=sa.float(), scale_b=sb.float(), out_dtype=bf16)
    except (RuntimeError, TypeError) as err:  # pragma: no cover - torch refusing a combination
        pytest.skip(f"torch._scaled_mm refused: {err}")
    pt = pt[0] if isinstance(pt, tuple) else pt
    assert_peer_rule(got, ref, pt, slack=1e-3, what="against torch._scaled_mm")


@pytest.mark.parametrize("m,n,kk", [(256, 384, 512), (100, 200, 320), (4, 256, 128)])
def test_fp8_blockwise(cache_dir, m, n, kk):
    """pytorch blockwise scaled_mm (DeepSeek-V3 1 x 128 / 128 x 128), edge blocks cut short: against the
    float64 product of the dequantized operands."""
    k = kern("fp8_block", cache_dir)
    g = gen(m + n + kk)
    kb = -(-kk // 128)
    x = rnd((m, kk), f32, g, 2.0).to(e4m3)
    w = rnd((n, kk), f32, g, 2.0).to(e4m3)
    xs = (torch.rand((kb, m), generator=g, device=DEV) + 0.5).t() / kk ** 0.5    # (M, KB), M-major
    ws = torch.rand((-(-n // 128), kb), generator=g, device=DEV) + 0.5          # (N/128, KB)
    bias = rnd((n,), bf16, g)
    cols = torch.arange(kk, device=DEV) // 128
    a_deq = x.double() * xs.double()[:, cols]
    w_deq = w.double() * ws.double()[torch.arange(n, device=DEV) // 128][:, cols]
    ref = fp8_block(a_deq @ w_deq.t(), bias.double())
    got = k((x, xs), (w.t(), ws.t()), bias=bias)
    assert_close(got, ref, acc_tol=FP8_TOL, what=f"fp8 block {m}x{n}x{kk}")
    out = torch.full((m, n), float("nan"), device=DEV, dtype=got.dtype)
    assert k((x, xs), (w.t(), ws.t()), bias=bias, out=out) is out
    assert _same_bits(out, got)


# ==============================================================================================
# Batches that broadcast; the size sweep; custom op, torch.compile, evtc.linear, evtc.nn


def test_batch_broadcast_b_shared(cache_dir):
    """quack/cutlass batched problems with one weight for every batch: a (L, M, K) @ b (K, N) (docs: the
    torch path), and b expanded to (L, K, N)."""
    k = kern("bcast_bias_relu", cache_dir)
    g = gen(21)
    a = rnd((3, 200, 72), f16, g, 72 ** -0.25)
    b = rnd((72, 504), f16, g, 72 ** -0.25)
    bias = rnd((504,), f16, g)
    run_case(k, bcast_bias_relu, a, b, {"bias": bias}, path="torch", what="a batched, b shared")
    k2 = kern("evt_row_broadcast", cache_dir)
    bb = b.expand(3, 72, 504)
    ops = {"C": rnd((3, 200, 504), f16, g), "bias": bias, "bias_batch": rnd((3, 1, 504), f32, g)}
    run_case(k2, evt_row_broadcast, a, bb, ops, path=None, what="b expanded over batches")


SWEEP_M, SWEEP_N, SWEEP_K = (1, 3, 127, 1000), (8, 200, 1000), (8, 72, 1000)
SWEEP = [(m, n, kk) for m in SWEEP_M for n in SWEEP_N for kk in SWEEP_K]


@pytest.mark.parametrize("m,n,kk", SWEEP)
def test_sweep_bias_gelu_residual(cache_dir, m, n, kk):
    """Sizes that are no multiple of a tile: gelu(alpha * acc + bias) + C and the aux output, fp16, the
    launch chosen per call."""
    k = kern("sweep_main", cache_dir)
    g = gen(m * 31 + n * 7 + kk)
    a, b = gemm_inputs(m, n, kk, None, f16, g)
    ops = {"bias": rnd((n,), f32, g), "C": rnd((m, n), f16, g), "alpha": 0.75}
    run_case(k, sweep_main, a, b, ops, path="kernel", what=f"sweep {m}x{n}x{kk}")


@pytest.mark.parametrize("m,n,kk", SWEEP)
def test_sweep_row_col_reductions(cache_dir, m, n, kk):
    """The same sizes with sums, maxima and sums of squares per row and per column (bf16)."""
    k = kern("red_stats", cache_dir)
    g = gen(m * 37 + n * 3 + kk)
    a, b = gemm_inputs(m, n, kk, None, bf16, g, "k", "k")
    run_case(k, red_stats, a, b, {"bias": rnd((n,), f32, g)}, path="kernel", what=f"red_stats {m}x{n}x{kk}")


@pytest.mark.parametrize("m,n,kk", [(m, n, kk) for m in SWEEP_M for n in (16, 200, 400, 2000)
                                    for kk in SWEEP_K])
def test_sweep_swiglu(cache_dir, m, n, kk):
    """SwiGLU over the sweep (N is the GEMM's: halves of 8, 100, 200 and 1000 columns; 100 takes the
    staged path, its output rows being 200 bytes apart, except for one row, whose pitch no TMA
    step uses)."""
    k = kern("swiglu", cache_dir)
    g = gen(m * 41 + n + kk)
    a = rnd((m, kk), f16, g, kk ** -0.25)
    b = rnd((n, kk), f16, g, kk ** -0.25).t()
    run_case(k, swiglu, a, b, {}, path="staged" if n == 200 and m > 1 else "kernel",
             what=f"swiglu {m}x{n}x{kk}")


def test_custom_op_and_fake_tensors(cache_dir):
    """quack test_gemm_functional: the operator gives the call's bits, and its fake implementation the
    shapes and dtypes, without a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    k = kern("evt_func_call2", cache_dir)
    g = gen(22)
    a, b = gemm_inputs(488, 504, 128, 3, f16, g)
    C = rnd((3, 488, 504), f16, g)
    ops = {"C": C, "alpha": 0.5, "beta": 2.0}
    direct = k(a, b, **ops)
    via_op = k.op(a, b, *[ops[n] for n in k.operand_names])
    via_op = via_op[0] if isinstance(via_op, tuple | list) else via_op
    assert _same_bits(direct, via_op)
    with FakeTensorMode():
        fa = torch.empty(3, 64, 32, dtype=f16, device=DEV)
        fb = torch.empty(3, 32, 128, dtype=f16, device=DEV)
        fc = torch.empty(3, 64, 128, dtype=f16, device=DEV)
        fo = k.op(fa, fb, *[{"C": fc, "alpha": 0.5, "beta": 2.0}[n] for n in k.operand_names])
        fo = fo[0] if isinstance(fo, tuple | list) else fo
        assert tuple(fo.shape) == (3, 64, 128) and fo.dtype == f16


def test_torch_compile_fullgraph(cache_dir):
    """docs: kernels are custom ops, so torch.compile(fullgraph=True, dynamic=True) keeps them in the
    graph (quack test_mlp use_compile)."""
    k = kern("sweep_main", cache_dir)

    def step(a, b, bias, C):
        d, y = k(a, b, bias=bias, C=C, alpha=0.5)
        return d.float() * 2 + y.float()

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    g = gen(23)
    for m, n, kk in [(256, 512, 128), (127, 1000, 72)]:
        a, b = gemm_inputs(m, n, kk, None, f16, g)
        bias, C = rnd((n,), f32, g), rnd((m, n), f16, g)
        want = step(a, b, bias, C)
        got = compiled(a, b, bias, C)
        assert _same_bits(got, want), f"torch.compile changed the result at {m}x{n}x{kk}"


def test_quack_linear_autograd(cache_dir):
    """quack test_linear: x[::2] (non-contiguous), a weight in nn.Linear layout, bias; forward and the
    gradients of x, weight and bias no more than twice torch's bf16 error against float32."""
    lin = evtc.linear(lin_relu_sq, {"x": meta(2, 96, 736, dtype=bf16), "weight": meta(1504, 736, dtype=bf16),
                                    "bias": meta(1504, dtype=f32)}, cache_dir=cache_dir)
    g = gen(24)
    x = rnd((4, 96, 736), bf16, g)[::2].requires_grad_(True)
    w = rnd((1504, 736), bf16, g, 736 ** -0.5).requires_grad_(True)
    bias = rnd((1504,), f32, g).requires_grad_(True)
    x_ref, w_ref, b_ref = (t.detach().clone().float().requires_grad_(True) for t in (x, w, bias))
    x_pt, w_pt, b_pt = (t.detach().clone().requires_grad_(True) for t in (x, w, bias))
    out = lin(x, w, bias=bias)
    out_ref = lin_relu_sq(F.linear(x_ref, w_ref), b_ref)
    out_pt = lin_relu_sq(F.linear(x_pt, w_pt), b_pt).to(bf16)
    assert out.shape == (2, 96, 1504) and out.dtype == f32  # a float32 bias promotes, as in torch
    assert_peer_rule(out, out_ref, out_pt, what="linear forward")
    dout = rnd(out.shape, bf16, g)
    out.backward(dout.to(out.dtype))  # the incoming gradient in the output's dtype, as a loss gives it
    out_ref.backward(dout.float())
    out_pt.backward(dout)
    assert_peer_rule(x.grad, x_ref.grad, x_pt.grad, slack=1e-5, what="dx")
    assert_peer_rule(w.grad, w_ref.grad, w_pt.grad, slack=1e-5, what="dw")
    assert_peer_rule(bias.grad, b_ref.grad, b_pt.grad, slack=1e-4, what="dbias")


@pytest.mark.parametrize("use_compile", [False, True])
def test_quack_mlp(cache_dir, use_compile):
    """quack test_mlp (gelu_tanh_approx, 512 -> 512 -> 512, batch 256, bf16): output and x.grad within 1e-2
    of float32 torch."""
    torch.manual_seed(0)
    mlp = evtc.nn.MLP(512, 512, mlp_gelu, device=DEV, dtype=bf16, cache_dir=cache_dir)
    w1, w2 = mlp.up.weight.detach().float(), mlp.down.weight.detach().float()
    model = mlp
    if use_compile:
        # docs/getting-started.md: the modules compile with fullgraph=True after one eager call.
        warm = torch.randn(256, 512, device=DEV, dtype=bf16, requires_grad=True)
        mlp(warm).sum().backward()
        mlp.zero_grad(set_to_none=True)
        model = torch.compile(mlp, fullgraph=True, backend="aot_eager")
    x = torch.randn(256, 512, device=DEV, dtype=bf16, requires_grad=True)
    out = model(x)
    assert out.shape == (256, 512)
    x_ref = x.detach().clone().float().requires_grad_(True)
    out_ref = F.linear(F.gelu(F.linear(x_ref, w1), approximate="tanh"), w2)
    assert (out.float() - out_ref).abs().max().item() < 1e-2
    dout = torch.randn_like(out)
    out.backward(dout)
    out_ref.backward(dout.float())
    assert x.grad is not None
    assert (x.grad.float() - x_ref.grad).abs().max().item() < 1e-2
