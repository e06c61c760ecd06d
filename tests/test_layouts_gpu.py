"""GPU: awkward layouts and sizes, against torch in float64 on the same values.

Covers the host call path (evtc/runtime, evtc/linear.py) and what the compiled function assumes
(evtc/sm90/launch.py): pitched, strided, overlapping and permuted views; batches of one with any
stride; out= aliasing its inputs, in place, with autograd and in evtc.linear; operands of other
dtypes and devices; runtime scalars of the wrong type; decode and split-K launches; and 32-bit
index overflow. Each test says what it checks.

Kernels compiled (module-scoped, one cache directory): 8 base kernels, of which 7 with a pinned
cluster (one configuration each) and one with the default configuration (its decode and split-K
variants are built on first use: a few more).

The large-index tests need about 25 GB of GPU memory at their peak (one at a time).
The LAST test passes a size-1 dim with a stride past TMA's 2^40-byte limit; if it crashes the CUDA
context, it does so after every other test has run.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import evtc

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
F32 = torch.float32
TOL = 1e-2
NAN = float("nan")
PINNED = {"cluster": (1, 2)}  # the default configuration, pinned: one kernel, no variants


# ---- helpers --------------------------------------------------------------------------------------


def randn(*shape, dtype=BF16, scale=1.0, device="cuda"):
    """Normal values made directly in ``dtype`` (no float32 copy of a multi-GB tensor)."""
    t = torch.randn(*shape, device=device, dtype=dtype)
    if scale != 1.0:
        t.mul_(scale)
    return t


def nans(*shape, dtype=BF16, device="cuda"):
    return torch.full(shape, NAN, dtype=dtype, device=device)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative error in norm against a float64 reference (NaN anywhere in ``got`` fails: NaN)."""
    got = got.double()
    want = want.double().to(got.device)
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def check(got, want, what: str, tol: float = TOL) -> None:
    got = got if isinstance(got, tuple | list) else (got,)
    want = want if isinstance(want, tuple | list) else (want,)
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert tuple(g.shape) == tuple(w.shape), (
            f"{what} output {i}: shape {tuple(g.shape)} vs {tuple(w.shape)}")
        r = rel(g, w)
        assert r <= tol, f"{what} output {i}: relative error {r:.3g}"


def all_nan(t: torch.Tensor) -> bool:
    return bool(torch.isnan(t.float()).all().item())


# The tiles are cast to a's dtype at the end: a float32 bias would make them float32, as torch
# promotes them, and these tests are about layouts, not dtypes.
def residual(acc, C, bias, alpha: float):
    return (torch.relu(alpha * acc + bias) + C).to(acc.dtype)


def residual3(acc, C, bias):
    return (torch.relu(acc + bias) + C).to(acc.dtype)


def bias_rowsum(acc, bias):
    y = acc + bias
    return y.to(acc.dtype), y.sum(-1)


def two_outputs(acc, C, bias):
    y = acc + bias
    return y.to(acc.dtype), (y * C).to(acc.dtype)


def col_scale(acc, col, s):
    return (acc * col + s).to(acc.dtype)


def swiglu(acc, bias):
    gate, up = (acc + bias).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(acc.dtype)


def bias_relu(acc, bias):
    return torch.relu(acc + bias).to(acc.dtype)


def ref_residual(a, b, C, bias, alpha=1.0):
    return torch.relu(alpha * (a.double() @ b.double()) + bias.double()) + C.double()


# ---- kernels (module-scoped) ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def k_res(cache):
    ex = dict(a=randn(64, 64), b=randn(64, 64), C=randn(64, 64), bias=randn(64, dtype=F32), alpha=1.0)
    return evtc.compile(residual, ex, config=PINNED, cache_dir=cache)


@pytest.fixture(scope="module")
def k_auto(cache):
    """The same epilogue with the default configuration: a launch (tile, cluster, split-K) per size."""
    ex = dict(a=randn(64, 64), b=randn(64, 64), C=randn(64, 64), bias=randn(64, dtype=F32), alpha=1.0)
    return evtc.compile(residual, ex, cache_dir=cache)


@pytest.fixture(scope="module")
def k_bres(cache):
    ex = dict(a=randn(2, 64, 64), b=randn(2, 64, 64), C=randn(2, 64, 64), bias=randn(64, dtype=F32))
    return evtc.compile(residual3, ex, config=PINNED, cache_dir=cache)


@pytest.fixture(scope="module")
def k_lm(cache):
    """An LM head: b = weight.t() (K-major), a bias, and each row's sum (a reduction over N)."""
    ex = dict(a=randn(64, 64), b=randn(128, 64).t(), bias=randn(128, dtype=F32))
    return evtc.compile(bias_rowsum, ex, config=PINNED, cache_dir=cache)


@pytest.fixture(scope="module")
def k_two(cache):
    ex = dict(a=randn(64, 64), b=randn(64, 64), C=randn(64, 64), bias=randn(64, dtype=F32))
    return evtc.compile(two_outputs, ex, config=PINNED, cache_dir=cache)


@pytest.fixture(scope="module")
def k_col(cache):
    ex = dict(a=randn(64, 64), b=randn(64, 64), col=randn(64, 1, dtype=F32), s=randn(1, dtype=F32))
    return evtc.compile(col_scale, ex, config=PINNED, cache_dir=cache)


@pytest.fixture(scope="module")
def k_gated(cache):
    ex = dict(a=randn(64, 64), b=randn(256, 64).t(), bias=randn(256, dtype=F32))
    return evtc.compile(swiglu, ex, config=PINNED, cache_dir=cache)


@pytest.fixture(scope="module")
def lin(cache):
    ex = dict(x=randn(2, 8, 64), weight=randn(128, 64), bias=randn(128, dtype=F32))
    return evtc.linear(bias_relu, ex, config=PINNED, cache_dir=cache)


# ---- non-contiguous, non-expanded views --------------------------------------------------------------


def test_pitched_views_of_wider_tensors_everywhere(k_res):
    """a, b, C and out= as x[:, :n] of wider tensors (row pitch > row, a 16-byte multiple): the
    kernel path; a ragged last tile must not write into out's padding columns."""
    m, n, k = 300, 200, 136
    a = randn(m, k + 24)[:, :k]
    b = randn(k, n + 56)[:, :n]
    C = randn(m, n + 8)[:, :n]
    bias = randn(n, dtype=F32)
    big = nans(m, n + 40)
    out = big[:, :n]
    got = k_res(a, b, C=C, bias=bias, alpha=0.5, out=out)
    assert got is out
    check(out, ref_residual(a, b, C, bias, 0.5), f"pitched views ({k_res.last_path})")
    assert all_nan(big[:, n:]), "the kernel wrote into out's padding columns"


def test_every_other_row_views(k_res):
    """x[::2] views (row stride twice the row) for a, b (rows of K), C and out=; the rows in
    between must stay untouched."""
    m, n, k = 257, 192, 128
    a = randn(2 * m, k)[::2]
    b = randn(2 * k, n)[::2]
    C = randn(2 * m, n)[::2]
    bias = randn(n, dtype=F32)
    big = nans(2 * m, n)
    out = big[::2]
    got = k_res(a, b, C=C, bias=bias, alpha=1.5, out=out)
    assert got is out
    check(out, ref_residual(a, b, C, bias, 1.5), f"every other row ({k_res.last_path})")
    assert all_nan(big[1::2]), "the kernel wrote into the rows between out's rows"


def test_overlapping_rows_of_an_unfolded_signal(k_res):
    """a = signal.unfold(0, K, 8): rows that overlap (stride 8 along M, K = 128 along K), as
    im2col-style code passes them. Read-only overlap is legal for TMA."""
    m, n, k = 384, 256, 128
    sig = randn(8 * (m - 1) + k)
    a = sig.unfold(0, k, 8)
    assert a.stride() == (8, 1)
    b, C, bias = randn(k, n), randn(m, n), randn(n, dtype=F32)
    check(k_res(a, b, C=C, bias=bias, alpha=1.0), ref_residual(a, b, C, bias), f"unfold ({k_res.last_path})")


def test_k_equal_to_one_on_the_kernel_path(k_res):
    """K = 1 with a pitched a (its only column, row stride 8): the compiled function takes it (the
    K dim has extent 1), so the kernel runs one K tile of which one column is in bounds."""
    m, n = 256, 192
    a = randn(m, 8)[:, :1]
    b, C, bias = randn(1, n), randn(m, n), randn(n, dtype=F32)
    check(k_res(a, b, C=C, bias=bias, alpha=2.0), ref_residual(a, b, C, bias, 2.0),
          f"K=1 ({k_res.last_path})")


def test_extent_one_rows_with_odd_strides(k_res):
    """M = 1 with a, C and out= whose row stride is odd (not 16 bytes): the compiled function skips
    the stride checks of a dim of extent 1, so the stride goes to TMA as it is
    (tests/test_call_paths_gpu.py covers an odd-strided a only)."""
    n, k = 200, 136
    a = randn(1, k + 3)[:, :k]
    C = randn(1, n + 5)[:, :n]
    b, bias = randn(k, n), randn(n, dtype=F32)
    big = nans(1, n + 5)
    out = big[:, :n]
    got = k_res(a, b, C=C, bias=bias, alpha=0.75, out=out)
    assert got is out
    check(out, ref_residual(a, b, C, bias, 0.75), f"M=1, odd strides ({k_res.last_path})")
    assert all_nan(big[:, n:])


def test_out_with_a_storage_offset(k_res):
    """out= views of a flat buffer at an aligned offset (16 bytes: written in place) and at a
    misaligned one (2 bytes: staged); the buffer outside the view must stay untouched."""
    m, n, k = 200, 256, 64
    a, b, C, bias = randn(m, k), randn(k, n), randn(m, n), randn(n, dtype=F32)
    want = ref_residual(a, b, C, bias, 1.0)
    for offset in (8, 1):
        flat = nans(m * n + 16)
        out = flat[offset:offset + m * n].view(m, n)
        got = k_res(a, b, C=C, bias=bias, alpha=1.0, out=out)
        assert got is out
        check(out, want, f"out at offset {offset} ({k_res.last_path})")
        assert all_nan(flat[:offset]) and all_nan(flat[offset + m * n:]), (
            f"offset {offset}: wrote outside out")


# ---- batches: permuted, shared strides, extent 1 -----------------------------------------------------


def test_permuted_batch_dims(k_bres):
    """(L, M, K) views of (M, L, K) buffers: the batch stride (K) smaller than the row stride (L K),
    for a, b, C and out=, then out=C exactly (in place) in that layout."""
    L, m, n, k = 3, 200, 192, 136
    a = randn(m, L, k).transpose(0, 1)
    b = randn(k, L, n).transpose(0, 1)
    C = randn(m, L, n).transpose(0, 1)
    bias = randn(n, dtype=F32)
    want = torch.relu(a.double() @ b.double() + bias.double()) + C.double()
    out = nans(m, L, n).transpose(0, 1)
    got = k_bres(a, b, C=C, bias=bias, out=out)
    assert got is out
    check(out, want, f"permuted batch dims ({k_bres.last_path})")
    check(k_bres(a, b, C=C, bias=bias), want, "permuted batch dims, new output")
    got = k_bres(a, b, C=C, bias=bias, out=C)
    assert got is C
    check(C, want, f"permuted batch dims, out=C in place ({k_bres.last_path})")


def test_batch_and_row_sharing_a_stride(k_bres):
    """a (L, M, K) with strides (K, K, 1): batch l, row i is row l + i of one buffer (two dims
    of extent > 1 with the same stride)."""
    L, m, n, k = 3, 128, 256, 64
    base = randn(L + m - 1, k)
    a = base.as_strided((L, m, k), (k, k, 1))
    b, C, bias = randn(L, k, n), randn(L, m, n), randn(n, dtype=F32)
    want = torch.relu(a.double() @ b.double() + bias.double()) + C.double()
    check(k_bres(a, b, C=C, bias=bias), want, f"shared strides ({k_bres.last_path})")


def test_batch_of_one_with_odd_batch_strides(k_bres):
    """L = 1 with batch strides of 3, 5, 7 and 9 elements (torch allows any stride on a dim of
    extent 1; the compiled function skips their checks and hands them to TMA as the L mode)."""
    m, n, k = 200, 256, 128
    a = randn(m * k + 3).as_strided((1, m, k), (3, k, 1))
    b = randn(k * n + 5).as_strided((1, k, n), (5, n, 1))
    C = randn(m * n + 7).as_strided((1, m, n), (7, n, 1))
    bias = randn(n, dtype=F32)
    flat = nans(m * n + 9)
    out = flat.as_strided((1, m, n), (9, n, 1))
    got = k_bres(a, b, C=C, bias=bias, out=out)
    assert got is out
    want = torch.relu(a.double() @ b.double() + bias.double()) + C.double()
    check(out, want, f"L=1, odd batch strides ({k_bres.last_path})")
    assert all_nan(flat[m * n:])


# ---- out= aliasing, dtypes, devices --------------------------------------------------------------------


def test_out_overlapping_C_by_columns(k_res):
    """out= and C two column windows of one buffer (out starts 8 columns into C): other tiles still
    read C where out is written, so the kernel must write a new tensor and copy it."""
    m, n, k = 512, 256, 128
    big = randn(m, n + 8)
    C = big[:, :n]
    out = big[:, 8:]
    a, b, bias = randn(m, k), randn(k, n), randn(n, dtype=F32)
    want = ref_residual(a, b, C.clone(), bias, 1.0)
    got = k_res(a, b, C=C, bias=bias, alpha=1.0, out=out)
    assert got is out
    check(out, want, f"out shifted by 8 columns over C ({k_res.last_path})")


def test_out_overlapping_a_row_operand_of_another_dtype(k_res):
    """The float32 bias is a view of out='s own first rows (another dtype, one storage): every tile
    reads the bias while the first tiles' rows are stored."""
    m, n, k = 512, 256, 128
    out = nans(m, n)
    bias = out.view(-1).view(F32)[:n]
    bias.copy_(torch.randn(n, device="cuda"))
    bias_was = bias.clone()
    a, b, C = randn(m, k), randn(k, n), randn(m, n)
    want = ref_residual(a, b, C, bias_was, 1.0)
    got = k_res(a, b, C=C, bias=bias, alpha=1.0, out=out)
    assert got is out
    check(out, want, f"bias inside out ({k_res.last_path})")


def test_tuple_outs_of_mixed_layouts_and_in_place(k_two):
    """Two full-tile outputs: out=(pitched, every other row), then each of them written exactly over
    C (the second output reads C; the first does not)."""
    m, n, k = 300, 256, 128
    a, b, C, bias = randn(m, k), randn(k, n), randn(m, n), randn(n, dtype=F32)
    y = a.double() @ b.double() + bias.double()
    want = (y, y * C.double())
    big1, big2 = nans(m, n + 16), nans(2 * m, n)
    outs = (big1[:, :n], big2[::2])
    got = k_two(a, b, C=C, bias=bias, out=outs)
    assert got[0] is outs[0] and got[1] is outs[1]
    check(got, want, f"tuple out ({k_two.last_path})")
    assert all_nan(big1[:, n:]) and all_nan(big2[1::2])
    C1 = C.clone()
    k_two(a, b, C=C1, bias=bias, out=(nans(m, n), C1))
    check(C1, want[1], "second output over C")
    C2 = C.clone()
    k_two(a, b, C=C2, bias=bias, out=(C2, nans(m, n)))
    check(C2, want[0], "first output over C")


def test_operands_of_other_dtypes_are_computed_or_refused(k_res):
    """A bfloat16 bias or a float32 C (compiled float32 and bfloat16; the epilogue's final cast
    keeps the output's dtype whatever they are): the torch path, right values. float16 a and b
    (compiled bfloat16) and a float32 out= (compiled bfloat16): CallError."""
    m, n, k = 128, 256, 64
    a, b, C, bias = randn(m, k), randn(k, n), randn(m, n), randn(n, dtype=F32)
    bias16 = bias.to(BF16)
    check(k_res(a, b, C=C, bias=bias16, alpha=1.0), ref_residual(a, b, C, bias16), "bf16 bias")
    assert k_res.last_path == "torch"
    C32 = randn(m, n, dtype=F32)
    check(k_res(a, b, C=C32, bias=bias, alpha=1.0), ref_residual(a, b, C32, bias), "f32 C")
    with pytest.raises(evtc.CallError):
        k_res(a.half(), b.half(), C=C, bias=bias, alpha=1.0)
    with pytest.raises(evtc.CallError):
        k_res(a, b, C=C, bias=bias, alpha=1.0, out=torch.empty(m, n, device="cuda"))


def test_cpu_operands_and_outputs_beside_cuda_tensors_are_refused(k_res):
    m, n, k = 128, 256, 64
    a, b, C, bias = randn(m, k), randn(k, n), randn(m, n), randn(n, dtype=F32)
    with pytest.raises(evtc.CallError):
        k_res(a, b, C=C, bias=bias.cpu(), alpha=1.0)
    with pytest.raises(evtc.CallError):
        k_res(a, b, C=C, bias=bias, alpha=1.0, out=torch.empty(m, n, dtype=BF16))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensors_on_another_gpu_than_the_current_one(k_res):
    """Every tensor on cuda:1 while cuda:0 is current: the right values or a CallError, never
    another result; one operand on another GPU than a: CallError."""
    m, n, k = 256, 256, 128
    dev = torch.device("cuda", 1)
    a, b, C, bias = (randn(m, k, device=dev), randn(k, n, device=dev), randn(m, n, device=dev),
                     randn(n, dtype=F32, device=dev))
    with torch.cuda.device(0):
        try:
            got = k_res(a, b, C=C, bias=bias, alpha=1.0)
        except evtc.CallError:
            got = None
        if got is not None:
            assert got.device == dev
            check(got, ref_residual(a, b, C, bias), "all on cuda:1")
        with pytest.raises(evtc.CallError):
            k_res(a.to("cuda:0"), b.to("cuda:0"), C=C, bias=bias.to("cuda:0"), alpha=1.0)


# ---- runtime scalars of other types ------------------------------------------------------------------------


def test_runtime_scalar_given_as_a_string_is_refused(k_res):
    """A string for a runtime scalar (alpha="0.5") is refused with a CallError, as torch raises for
    "0.5" * acc, rather than turned into a number by float() on the fast path."""
    m, n, k = 128, 256, 64
    a, b, C, bias = randn(m, k), randn(k, n), randn(m, n), randn(n, dtype=F32)
    with pytest.raises(evtc.CallError):
        k_res(a, b, C=C, bias=bias, alpha="0.5")


def test_runtime_scalar_given_as_a_tensor(k_res):
    """A one-element tensor for alpha: the result for the value it holds or a CallError are
    acceptable, another value is not."""
    m, n, k = 128, 256, 64
    a, b, C, bias = randn(m, k), randn(k, n), randn(m, n), randn(n, dtype=F32)
    try:
        got = k_res(a, b, C=C, bias=bias, alpha=torch.tensor(0.5, device="cuda"))
    except evtc.CallError:
        return
    check(got, ref_residual(a, b, C, bias, 0.5), "tensor alpha")


# ---- out= and autograd -------------------------------------------------------------------------------


def test_out_written_in_place_bumps_its_version_counter(k_res):
    """out= written in place bumps its version counter, as torch.matmul(a, b, out=y) does under
    no_grad, so a backward that saved y raises instead of silently computing exp's gradient from
    the new contents of y (the kernel writes out= through raw pointers, which autograd does not
    see)."""
    m, n, k = 256, 256, 128
    a, b, C, bias = randn(m, k), randn(k, n), randn(m, n), randn(n, dtype=F32)
    x = randn(m, n, scale=0.1).requires_grad_()
    y = x.exp()  # autograd saves y itself for exp's backward
    before = y._version
    with torch.no_grad():
        got = k_res(a, b, C=C, bias=bias, alpha=1.0, out=y)
    assert got is y
    check(y, ref_residual(a, b, C, bias), f"into y ({k_res.last_path})")
    assert y._version > before, f"out= written in place on the {k_res.last_path} path, version not bumped"
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_out_that_requires_grad_in_grad_mode_is_refused(k_res):
    """With grad mode on, an out= tensor that requires grad is refused, as torch refuses it
    ("functions with out=... arguments don't support automatic differentiation"), rather than a
    leaf parameter being overwritten in place."""
    m, n, k = 128, 256, 64
    a, b, C, bias = randn(m, k), randn(k, n), randn(m, n), randn(n, dtype=F32)
    p = torch.zeros(m, n, dtype=BF16, device="cuda", requires_grad=True)
    with pytest.raises((evtc.CallError, RuntimeError)):
        k_res(a, b, C=C, bias=bias, alpha=1.0, out=p)


def test_refused_out_leaves_the_other_out_tensors_untouched(k_lm):
    """A wrong host output in out= (the row sums, here one element too long) is refused before the
    launch, so the kernel does not write out[0] of a call that raises."""
    m, n, k = 256, 512, 64
    a, w, bias = randn(m, k), randn(n, k), randn(n, dtype=F32)
    y_buf = nans(m, n)
    with pytest.raises(evtc.CallError):
        k_lm(a, w.t(), bias=bias, out=(y_buf, torch.empty(m + 1, device="cuda", dtype=BF16)))
    assert all_nan(y_buf), "a refused call wrote out[0]"


# ---- evtc.linear out= ---------------------------------------------------------------------------------


def test_linear_out_with_contiguous_leading_dims(lin):
    """Control for the next test: a contiguous (B, S, N) out= is flattened as a view."""
    B, S, n, k = 3, 50, 128, 64
    x, w, bias = randn(B, S, k), randn(n, k), randn(n, dtype=F32)
    out = nans(B, S, n)
    with torch.no_grad():
        got = lin(x, w, bias=bias, out=out)
    want = torch.relu(x.double() @ w.double().t() + bias.double())
    check(got, want, "linear, returned")
    check(out, want, "linear, contiguous out=")


@pytest.mark.parametrize("layout", ["slice of a longer sequence", "transposed leading dims"])
def test_linear_out_whose_leading_dims_do_not_flatten_to_a_view(lin, layout):
    """evtc.linear writes out= itself where its leading dims cannot be merged into one stride
    (out = buf[:, :S] of a (B, S_max, N) buffer, a KV-cache-style slice; or a transposed (S, B, N)
    buffer): flattening such an out= would copy it, and the kernel must not write only that copy.
    The rest of the buffer stays untouched."""
    B, S, n, k = 3, 50, 128, 64
    x, w, bias = randn(B, S, k), randn(n, k), randn(n, dtype=F32)
    want = torch.relu(x.double() @ w.double().t() + bias.double())
    if layout == "slice of a longer sequence":
        buf = nans(B, S + 7, n)
        out = buf[:, :S]
    else:
        buf = nans(S, B, n)
        out = buf.transpose(0, 1)
    with torch.no_grad():
        got = lin(x, w, bias=bias, out=out)
    check(got, want, f"linear {layout}, returned")
    check(out, want, f"linear {layout}: out= itself")
    if layout == "slice of a longer sequence":
        assert all_nan(buf[:, S:])


# ---- operand kinds: columns, scalars, gated halves -----------------------------------------------------


def test_column_vectors_and_scalars_at_odd_strides_and_offsets(k_col):
    """A column operand (M, 1) as the transpose of a (1, M) row (strides (1, M): its "1" dim's stride
    is never used), as a strided slice (staged), and a device scalar at a 4-byte offset."""
    m, n, k = 300, 256, 128
    a, b = randn(m, k), randn(k, n)
    acc = a.double() @ b.double()
    col_t = randn(1, m, dtype=F32).t()
    col_slice = randn(m, 8, dtype=F32)[:, 3:4]
    s_off = randn(4, dtype=F32)[1:2]
    for col, s, what in ((col_t, s_off, "transposed row"), (col_slice, s_off, "strided slice")):
        got = k_col(a, b, col=col, s=s)
        check(got, acc * col.double() + s.double(), f"column {what} ({k_col.last_path})")


def test_gated_weight_with_a_row_pitch_and_every_other_row(k_gated):
    """A gated kernel's K-major b = w.t() where w (2N, K) is a pitched slice of a wider buffer, and
    where w is every other row of one: the up half starts N times the pitch in."""
    m, k, n2 = 300, 136, 512
    x = randn(m, k + 24)[:, :k]
    bias = randn(n2, dtype=F32)
    for w, what in ((randn(n2, k + 8)[:, :k], "pitched"), (randn(2 * n2, k + 8)[::2, :k], "every other row")):
        gate, up = (x.double() @ w.double().t() + bias.double()).chunk(2, dim=-1)
        want = F.silu(gate) * up
        check(k_gated(x, w.t(), bias=bias), want, f"gated, w {what} ({k_gated.last_path})")


# ---- the default configuration: decode, split-K, trimmed A loads --------------------------------------


def test_decode_rows_with_odd_strides_default_launch(k_auto):
    """M = 1 and M = 3 on the kernel's own launch choice (64-row tiles, trimmed A loads, split-K):
    M = 1 with odd row strides (a, C, out=), M = 3 with every other row (a, C, out=)."""
    n, k = 1024, 8192
    b, bias = randn(k, n, scale=k ** -0.5), randn(n, dtype=F32)
    a = randn(1, k + 3)[:, :k]
    C = randn(1, n + 5)[:, :n]
    big = nans(1, n + 5)
    got = k_auto(a, b, C=C, bias=bias, alpha=1.0, out=big[:, :n])
    check(got, ref_residual(a, b, C, bias),
          f"M=1 odd strides {k_auto.launch_for(1, n, k)} ({k_auto.last_path})")
    assert all_nan(big[:, n:])
    a3, C3 = randn(6, k)[::2], randn(6, n)[::2]
    big3 = nans(6, n)
    got = k_auto(a3, b, C=C3, bias=bias, alpha=1.0, out=big3[::2])
    check(got, ref_residual(a3, b, C3, bias), f"M=3 every other row {k_auto.launch_for(3, n, k)}")
    assert all_nan(big3[1::2])


def test_pinned_split_k_with_strided_outputs(k_auto):
    """Split-K (pinned to 3) with out= every other row and a pitched C: the last split runs the
    epilogue once, into out's rows only."""
    m, n, k = 256, 512, 4096
    a, b, bias = randn(m, k), randn(k, n, scale=k ** -0.5), randn(n, dtype=F32)
    C = randn(m, n + 16)[:, :n]
    big = nans(2 * m, n)
    k_auto.pin_splits(3)
    try:
        got = k_auto(a, b, C=C, bias=bias, alpha=1.0, out=big[::2])
    finally:
        k_auto.pin_splits(None)
    check(got, ref_residual(a, b, C, bias), f"split-K 3 ({k_auto.last_path})")
    assert all_nan(big[1::2])


# ---- 32-bit index overflow (needs the memory noted in the module docstring) ---------------------


def _chunked_rel(got: torch.Tensor, want_rows, rows: int, chunk: int) -> float:
    """Relative error in norm of ``got`` (rows first) against ``want_rows(r0, r1)`` (float64)."""
    num = den = 0.0
    for r0 in range(0, rows, chunk):
        r1 = min(rows, r0 + chunk)
        w = want_rows(r0, r1)
        num += (got[r0:r1].double() - w).pow(2).sum().item()
        den += w.pow(2).sum().item()
        del w
    return math.sqrt(num / den)


def test_lm_head_with_more_than_2_31_output_elements(k_lm):
    """16421 x 152064 outputs (2.5e9 elements, 5 GB of bfloat16), K = 80, ragged last row of tiles,
    and each row's sum (finished on the host: past 16M outputs)."""
    torch.cuda.empty_cache()
    m, n, k = 16421, 152064, 80
    a, w, bias = randn(m, k), randn(n, k, scale=k ** -0.5), randn(n, dtype=F32)
    y, sums = k_lm(a, w.t(), bias=bias)
    assert y.shape == (m, n) and sums.shape == (m,)
    wd, bd = w.double(), bias.double()
    y_sums = []

    def want(r0, r1):
        r = a[r0:r1].double() @ wd.t() + bd
        y_sums.append(r.sum(-1))
        return r

    err = _chunked_rel(y, want, m, 1024)
    assert err <= TOL, f"LM head y: relative error {err:.3g}"
    check(sums, torch.cat(y_sums), "LM head row sums")
    del y, sums


def test_decode_weight_with_more_than_2_31_elements(k_lm):
    """b = w.t() with w (152064, 16384): K x N = 2.5e9 elements (5 GB); M = 64, so the row sums are
    finished in the kernel (9.7M outputs)."""
    torch.cuda.empty_cache()
    m, n, k = 64, 152064, 16384
    w = torch.randn(n, k, device="cuda", dtype=BF16)
    a, bias = randn(m, k, scale=k ** -0.5), randn(n, dtype=F32)
    y, sums = k_lm(a, w.t(), bias=bias)
    ad = a.double()
    parts = []
    for c0 in range(0, n, 8192):
        c1 = min(n, c0 + 8192)
        parts.append(ad @ w[c0:c1].double().t() + bias[c0:c1].double())
    want = torch.cat(parts, dim=1)
    del parts
    check((y, sums), (want, want.sum(-1)), "decode with a 2^31+ weight")
    del w, y, want
    torch.cuda.empty_cache()


def test_batch_stride_beyond_2_31_elements(k_bres):
    """L = 2 of 49192 x 49152 outputs: C's and D's batch stride is 2.4e9 elements (4.8 GB), and
    L x M x N = 4.8e9 (C and D 9.7 GB each)."""
    torch.cuda.empty_cache()
    L, m, n, k = 2, 49192, 49152, 64
    a, b = randn(L, m, k), randn(L, k, n, scale=k ** -0.5)
    C, bias = randn(L, m, n), randn(n, dtype=F32)
    got = k_bres(a, b, C=C, bias=bias)
    assert got.shape == (L, m, n)
    for batch in range(L):
        bd = b[batch].double()

        def want(r0, r1, batch=batch, bd=bd):
            return torch.relu(a[batch, r0:r1].double() @ bd + bias.double()) + C[batch, r0:r1].double()

        err = _chunked_rel(got[batch], want, m, 2048)
        assert err <= TOL, f"batch {batch}: relative error {err:.3g}"
    del got


# ---- last: a size-1 dim with a stride past TMA's limits ------------------------------------------------


def test_size_one_batch_dim_with_a_huge_stride(k_bres):
    """L = 1 with batch strides of 2^36 elements (2^37 bytes: within TMA's 2^40-byte limit) and of
    2^41 elements (past it). torch allows any stride on a dim of extent 1 (as_strided checks only the
    elements it reaches); the compiled function skips the checks of such a dim and hands the stride to
    TMA as the L mode's. The right values or a CallError are acceptable; anything else (another
    result, a CUDA error) fails. Kept last: a CUDA fault here would poison later tests."""
    m, n, k = 200, 256, 128
    b, C, bias = randn(1, k, n), randn(1, m, n), randn(n, dtype=F32)
    buf = randn(m * k)
    for stride in (2 ** 36, 2 ** 41):
        a = buf.as_strided((1, m, k), (stride, k, 1))
        try:
            got = k_bres(a, b, C=C, bias=bias)
        except evtc.CallError:
            continue
        torch.cuda.synchronize()
        want = torch.relu(a.double() @ b.double() + bias.double()) + C.double()
        check(got, want, f"L=1, batch stride {stride} ({k_bres.last_path})")
