"""GPU tests of the calls the kernel cannot take as they are (docs/compile.md, "Call paths").

Every call ``torch.matmul`` plus the epilogue would accept must give the right answer: rows whose
pitch is not a multiple of 16 bytes (outputs, a, b, C, gated halves), strided and transposed views,
misaligned pointers, tiny problems, K = 0 and float32 ``a`` and ``b`` compiled from a row-major ``b``
(which keep the torch path; K-major ones run as tf32: tests/test_tf32_gpu.py). Each result is checked
against the function itself run by torch in float32, with outputs poisoned first where ``out=`` is
given; ``strict=True`` must refuse each detour instead.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import evtc
from evtc.ir.dtypes import is_float8, round_to

pytestmark = pytest.mark.gpu

TOL = 1e-2


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.float()
    if is_float8(got.dtype):
        want = round_to(want, got.dtype)
    diff = torch.linalg.vector_norm(got.float() - want)
    return (diff / torch.linalg.vector_norm(want).clamp_min(1e-12)).item()


def _check(got, want, what: str) -> None:
    got = got if isinstance(got, tuple | list) else (got,)
    want = want if isinstance(want, tuple | list) else (want,)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert tuple(g.shape) == tuple(w.shape), f"{what} output {i}: {tuple(g.shape)} vs {tuple(w.shape)}"
        assert g.is_contiguous(), f"{what} output {i}: not contiguous (strides {g.stride()})"
        rel = _rel(g, w)
        assert rel <= TOL, f"{what} output {i}: relative error {rel:.3g}"


def randn(*shape, dtype=torch.float16):
    return torch.randn(*shape, device="cuda").to(dtype)


def bias_gelu(acc, bias):
    return F.gelu(acc + bias)


def residual(acc, C, bias, alpha: float):
    # In a's dtype: a float32 bias would make it float32, as torch promotes it.
    return (torch.relu(alpha * acc + bias) + C).to(acc.dtype)


def swiglu(acc, bias):
    gate, up = (acc + bias).chunk(2, dim=-1)
    return F.silu(gate) * up


def fp8_out(acc, s):
    return (acc * s).to(torch.float8_e4m3fn)


def row_stats(acc, bias):
    y = acc + bias
    return y, (y * y).sum(-1), y.amax(-2)


def _ref(fn, a, b, **operands):
    return fn(a.float() @ b.float(), **{k: v.float() if isinstance(v, torch.Tensor) else v
                                         for k, v in operands.items()})


def _compile(fn, a, b, cache, strict=False, **operands):
    return evtc.compile(fn, dict(a=a, b=b, **operands), cache_dir=cache, strict=strict)


@pytest.mark.parametrize("m, n, k", [(300, 1001, 136), (2, 2, 2), (129, 1002, 1001), (64, 8, 1001), (1, 1, 1),
                                     (1, 72, 1001)])
def test_odd_widths_and_depths_take_the_staged_path(cache, m, n, k):
    a, b = randn(m, k), randn(k, n)
    bias = randn(n, dtype=torch.float32)
    kernel = _compile(bias_gelu, randn(64, 64), randn(64, 64), cache, bias=randn(64, dtype=torch.float32))
    got = kernel(a, b, bias=bias)
    _check(got, _ref(bias_gelu, a, b, bias=bias), f"{m}x{n}x{k}")
    if kernel.last_path == "kernel":
        # The compiled function takes any stride along a dim of extent 1 (M = 1 here).
        assert m == 1
        return
    assert kernel.last_path == "staged"
    strict = _compile(bias_gelu, randn(64, 64), randn(64, 64), cache, strict=True,
                      bias=randn(64, dtype=torch.float32))
    with pytest.raises(evtc.CallError, match="strict=True refuses the aligned copies"):
        strict(a, b, bias=bias)


def test_aligned_calls_stay_on_the_kernel_path(cache):
    a, b, bias = randn(256, 128), randn(128, 512), randn(512, dtype=torch.float32)
    kernel = _compile(bias_gelu, a, b, cache, strict=True, bias=bias)
    _check(kernel(a, b, bias=bias), _ref(bias_gelu, a, b, bias=bias), "aligned")
    assert kernel.last_path == "kernel"


@pytest.mark.parametrize("b_major", ["n", "k"])
def test_layouts_other_than_compiled_and_strided_views(cache, b_major):
    m, n, k = 257, 192, 200
    a = randn(m, k)
    b = randn(k, n) if b_major == "n" else randn(n, k).t()
    C, bias = randn(m, 2 * n), randn(n, dtype=torch.float32)
    kernel = _compile(residual, randn(64, 32), randn(32, 64), cache, C=randn(64, 64),
                      bias=randn(64, dtype=torch.float32), alpha=1.0)
    want = _ref(residual, a, b, C=C[:, ::2], bias=bias, alpha=0.5)
    _check(kernel(a, b, C=C[:, ::2], bias=bias, alpha=0.5), want, "strided C")
    assert kernel.last_path == "staged"
    # a M-major, C column-major, bias misaligned (an offset view): all staged.
    a_m = a.t().contiguous().t()
    C_cm = C[:, ::2].t().contiguous().t()
    bias_off = torch.cat([torch.zeros(1, device="cuda"), bias])[1:]
    _check(kernel(a_m, b, C=C_cm, bias=bias_off, alpha=0.5), want, "other majors")


def test_outputs_into_out_of_any_layout_and_in_place(cache):
    m, n, k = 200, 1001, 64
    a, b, C, bias = randn(m, k), randn(k, n), randn(m, n), randn(n, dtype=torch.float32)
    kernel = _compile(residual, randn(64, 32), randn(32, 64), cache, C=randn(64, 64),
                      bias=randn(64, dtype=torch.float32), alpha=1.0)
    want = _ref(residual, a, b, C=C, bias=bias, alpha=2.0)
    out = torch.full((n, m), float("nan"), device="cuda", dtype=torch.float16).t()  # column-major
    got = kernel(a, b, C=C, bias=bias, alpha=2.0, out=out)
    assert got is out
    rel = _rel(out, want)
    assert rel <= TOL, f"column-major out: {rel:.3g}"
    # The residual written over C itself (out=C): staged, so C is read whole before it is written.
    C2 = C.clone()
    kernel(a, b, C=C2, bias=bias, alpha=2.0, out=C2)
    assert _rel(C2, want) <= TOL


@pytest.mark.parametrize("n", [1000, 1002, 2 * 520])
def test_gated_halves_that_are_not_16_byte_aligned(cache, n):
    m, k = 300, 128
    a, b, bias = randn(m, k), randn(k, n), randn(n, dtype=torch.float32)
    kernel = _compile(swiglu, randn(64, 64), randn(64, 256), cache, bias=randn(256, dtype=torch.float32))
    _check(kernel(a, b, bias=bias), _ref(swiglu, a, b, bias=bias), f"swiglu N={n}")
    w = randn(n, k)  # an nn.Linear weight: K-major b
    _check(kernel(a, w.t(), bias=bias), _ref(swiglu, a, w.t(), bias=bias), f"swiglu K-major N={n}")


@pytest.mark.parametrize("n", [40, 1001])
def test_float8_outputs_of_any_width(cache, n):
    m, k = 130, 96
    a, b, s = randn(m, k), randn(k, n), torch.rand(1, device="cuda") + 0.5
    kernel = _compile(fp8_out, randn(64, 64), randn(64, 64), cache, s=torch.ones(1, device="cuda"))
    _check(kernel(a, b, s=s), _ref(fp8_out, a, b, s=s), f"fp8 N={n}")


@pytest.mark.parametrize("batches", [None, 3])
def test_reductions_with_odd_widths(cache, batches):
    lead = () if batches is None else (batches,)
    m, n, k = 190, 1001, 72
    a, b, bias = randn(*lead, m, k), randn(*lead, k, n), randn(n, dtype=torch.float32)
    kernel = _compile(row_stats, randn(*lead, 64, 64), randn(*lead, 64, 64), cache,
                      bias=randn(64, dtype=torch.float32))
    got = kernel(a, b, bias=bias)
    assert kernel.last_path == "staged"
    _check(got, _ref(row_stats, a, b, bias=bias), f"stats L={batches}")


def test_k_zero_and_float32_inputs_not_k_major_take_the_torch_path(cache):
    m, n = 64, 96
    bias = randn(n, dtype=torch.float32)
    kernel = _compile(bias_gelu, randn(64, 64), randn(64, 64), cache, bias=randn(64, dtype=torch.float32))
    a, b = randn(m, 0), randn(0, n)
    _check(kernel(a, b, bias=bias), F.gelu(bias.expand(m, n)).half(), "K=0")
    assert kernel.last_path == "torch"
    a32, b32 = randn(m, 40, dtype=torch.float32), randn(40, n, dtype=torch.float32)
    k32 = _compile(bias_gelu, a32, b32, cache, bias=bias)
    _check(k32(a32, b32, bias=bias), _ref(bias_gelu, a32, b32, bias=bias), "float32")
    assert k32.last_path == "torch"


def test_per_batch_device_scalars(cache):
    """The defect that shipped: an (L, 1, 1) device scalar was read at batch 0 for every batch."""

    def shifted(acc, C, alpha: float, alpha_dev):
        return acc + C + alpha + alpha_dev

    def scaled(acc, alpha_dev):
        return acc * alpha_dev

    for batches in (2, 3):
        a, b, C = randn(batches, 200, 64), randn(batches, 64, 136), randn(batches, 200, 136)
        s = torch.randn(batches, 1, 1, device="cuda") * 4
        k1 = _compile(shifted, a, b, cache, C=C, alpha=1.0, alpha_dev=s)
        _check(k1(a, b, C=C, alpha=0.5, alpha_dev=s), _ref(shifted, a, b, C=C, alpha=0.5, alpha_dev=s),
               f"acc + C + alpha + alpha_dev, L={batches}")
        k2 = _compile(scaled, a, b, cache, alpha_dev=s)
        _check(k2(a, b, alpha_dev=s), _ref(scaled, a, b, alpha_dev=s), f"acc * alpha_dev, L={batches}")
        assert k1.last_path == k2.last_path == "kernel"


def test_unused_parameters_on_the_gpu(cache):
    def uses_bias_only(acc, C, bias):
        return acc + bias

    a, b, C, bias = randn(128, 64), randn(64, 256), randn(128, 256), randn(256, dtype=torch.float32)
    kernel = _compile(uses_bias_only, a, b, cache, C=C, bias=bias)
    _check(kernel(a, b, C=C, bias=bias), _ref(uses_bias_only, a, b, C=C, bias=bias), "unused C")
    lin = evtc.linear(uses_bias_only, dict(x=a, weight=b.t().contiguous(), C=C, bias=bias), cache_dir=cache)
    w = b.t().contiguous()
    _check(lin(a, w, C=C, bias=bias), _ref(uses_bias_only, a, b, C=C, bias=bias), "linear, unused C")


def test_out_overlapping_an_input_is_not_a_race(cache):
    """out= over a GEMM input (a of a square problem, b), or over part of an operand: other CTAs
    still read those while a tile is stored, so the kernel writes a new tensor that is then copied
    into out. Each result equals the function on the inputs as they were; out=C exactly (the same
    view) stays in place."""
    m = n = k = 512
    kernel = _compile(residual, randn(64, 64), randn(64, 64), cache, C=randn(64, 64),
                      bias=randn(64, dtype=torch.float32), alpha=1.0)
    bias = randn(n, dtype=torch.float32)
    for trial in ("out=a", "out=b", "shifted C", "same C", "shifted C through DLPack"):
        a, b = randn(m, k) * 0.1, randn(k, n) * 0.1
        big = randn(m + 1, n)
        C = big[:m] if trial.startswith("shifted C") else randn(m, n)
        want = _ref(residual, a, b, C=C, bias=bias, alpha=2.0)
        out = {"out=a": a, "out=b": b, "shifted C": big[1:], "same C": C,
               # Another storage over big's bytes: judged by address, not by storage.
               "shifted C through DLPack": torch.from_dlpack(big[1:])}[trial]
        got = kernel(a, b, C=C, bias=bias, alpha=2.0, out=out)
        assert got is out and kernel.last_path == "kernel", (trial, kernel.last_path)
        assert _rel(out, want) <= TOL, trial


def test_a_zero_dim_cpu_scalar_beside_cuda_tensors(cache):
    """torch takes a 0-dim CPU tensor beside CUDA ones as a scalar: so does a call, for a device
    scalar compiled from a CUDA example."""
    a, b = randn(128, 64), randn(64, 256)
    k = _compile(fp8_out, a, b, cache, s=torch.tensor(0.5, device="cuda"))
    s = torch.tensor(0.25)
    got = k(a, b, s=s)
    assert got.device.type == "cuda" and s.device.type == "cpu"
    _check(got, _ref(fp8_out, a, b, s=s.cuda()), "a CPU scalar")


def test_a_cpu_scalar_under_cuda_graph_capture(cache):
    """A 0-dim CPU scalar is filled into a GPU one (no synchronising copy), so a call that takes one
    is captured, with the value fixed at capture as torch fixes it."""
    a, b = randn(128, 64), randn(64, 256)
    k = _compile(fp8_out, a, b, cache, s=torch.tensor(0.5, device="cuda"))
    s = torch.tensor(0.25)
    k(a, b, s=s)  # the size's first call, eager
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = k(a, b, s=s)
    s.fill_(4.0)  # torch reads a CPU scalar at capture: replays keep 0.25
    graph.replay()
    torch.cuda.synchronize()
    _check(got, _ref(fp8_out, a, b, s=torch.tensor(0.25, device="cuda")), "a CPU scalar, captured")


def test_sparse_operands_run_the_kernel_on_dense_copies(cache):
    """A sparse C (COO or CSR) or a sparse a: torch computes with its values, and so does the
    kernel, on a dense copy (the staged path); strict=True refuses the copy by name."""
    kernel = _compile(residual, randn(64, 64), randn(64, 64), cache, C=randn(64, 64),
                      bias=randn(64, dtype=torch.float32), alpha=1.0)
    a, b, C, bias = randn(256, 128), randn(128, 192), randn(256, 192), randn(192, dtype=torch.float32)
    want = _ref(residual, a, b, C=C, bias=bias, alpha=0.5)
    for x, c, what in [(a, C.to_sparse(), "COO C"), (a, C.to_sparse_csr(), "CSR C"),
                       (a.to_sparse(), C, "COO a")]:
        got = kernel(x, b, C=c, bias=bias, alpha=0.5)
        assert kernel.last_path == "staged", what
        _check(got, want, what)
    strict = _compile(residual, randn(64, 64), randn(64, 64), cache, strict=True, C=randn(64, 64),
                      bias=randn(64, dtype=torch.float32), alpha=1.0)
    with pytest.raises(evtc.CallError, match="C: a torch.sparse_coo tensor, made dense"):
        strict(a, b, C=C.to_sparse(), bias=bias, alpha=0.5)


def test_a_2d_a_or_b_beside_a_batched_other_broadcasts_on_the_kernel(cache):
    """For a kernel compiled with batched a and b, torch.matmul's broadcast of a 2-d b (or a) over
    the other's batch runs the kernel (a batch of 1, expanded with batch stride 0)."""
    def res(acc, C, bias):
        return (torch.relu(acc + bias) + C).to(acc.dtype)

    kernel = _compile(res, randn(2, 64, 64), randn(2, 64, 64), cache, C=randn(2, 64, 64),
                      bias=randn(64, dtype=torch.float32))
    A, B, C = randn(3, 200, 128), randn(3, 128, 256), randn(3, 200, 256)
    bias = randn(256, dtype=torch.float32)
    for x, w, what in [(A, B[1], "2-d b"), (A[2], B, "2-d a")]:
        got = kernel(x, w, C=C, bias=bias)
        assert kernel.last_path == "kernel", what
        _check(got, _ref(res, x, w, C=C, bias=bias), what)


def test_strict_takes_one_row_of_any_pitch_whatever_the_scalars(cache):
    """M = 1 with an odd row pitch is read in place (a dim of extent 1 is never stepped along): also
    when the call reaches the slow path for another reason (a NumPy scalar), under strict=True."""
    import numpy as np

    strict = _compile(residual, randn(64, 64), randn(64, 64), cache, strict=True, C=randn(64, 64),
                      bias=randn(64, dtype=torch.float32), alpha=1.0)
    k = 136
    a = randn(1, k + 3)[:, :k]
    b, C, bias = randn(k, 200), randn(1, 200), randn(200, dtype=torch.float32)
    got = strict(a, b, C=C, bias=bias, alpha=np.float32(0.75))
    assert strict.last_path == "kernel"
    _check(got, _ref(residual, a, b, C=C, bias=bias, alpha=0.75), "one row, NumPy alpha")


def test_sizes_past_32_bits_take_the_torch_path_and_big_workspaces_are_refused(cache):
    """The kernel's sizes and workspace lengths are 32-bit: a size past 2**31 - 1 (an expanded b)
    takes the torch path (its reason named), and reductions whose workspace would pass it are
    refused by name before anything is allocated or launched."""
    from evtc.runtime import call_checks

    kernel = _compile(bias_gelu, randn(64, 64), randn(64, 64), cache, bias=randn(64, dtype=torch.float32))
    a = randn(1, 16)
    wide = randn(16, 1).expand(16, 2 ** 31 + 64)
    reason = call_checks.torch_reason(kernel.call_spec, a, {}, wide)
    assert reason is not None and "2**31 - 1" in reason

    def row_sums(acc):
        return acc.sum(-1)

    sums = _compile(row_sums, randn(128, 64), randn(64, 256), cache)
    tall, flat = randn(2 ** 21, 16), randn(16, 2 ** 18)  # M x N / 256 = 2**31 partials at the least
    with pytest.raises(evtc.CallError, match=r"workspace of \d+ float32 values .* split the call along M"):
        sums(tall, flat)


def test_views_with_torchs_negative_bit_are_resolved(cache):
    """A tile or a device scalar with torch's negative bit (``z.conj().imag``, or
    ``torch._neg_view``: memory that holds the values' negation) is resolved into a copy before the
    kernel reads it (the staged path); the kernel read the memory as it is before."""
    kernel = _compile(residual, randn(64, 64), randn(64, 64), cache, C=randn(64, 64),
                      bias=randn(64, dtype=torch.float32), alpha=1.0)
    a, b, bias = randn(256, 128), randn(128, 192), randn(192, dtype=torch.float32)
    plain = randn(256, 192)
    negated = torch._neg_view(plain)
    assert negated.is_neg() and negated.data_ptr() == plain.data_ptr()
    got = kernel(a, b, C=negated, bias=bias, alpha=0.5)
    assert kernel.last_path == "staged"
    _check(got, _ref(residual, a, b, C=-plain, bias=bias, alpha=0.5), "C with the negative bit")

    def scaled(acc, s):
        return (acc * s).to(acc.dtype)

    ks = _compile(scaled, randn(64, 64), randn(64, 64), cache, s=torch.tensor(0.5, device="cuda"))
    s = torch.complex(torch.tensor(0.0, device="cuda"), torch.tensor(0.5, device="cuda")).conj().imag
    assert s.is_neg() and s.item() == -0.5
    got = ks(a, b, s=s)
    assert ks.last_path == "staged"
    _check(got, _ref(scaled, a, b, s=torch.tensor(-0.5, device="cuda")), "a scalar with the negative bit")


def test_empty_out_tensors_are_resized_and_written_by_the_kernel(cache):
    """``torch.empty(0)`` for each output, reductions included: resized as torch resizes it, then
    written on the kernel path (strict: no copy), in kernel calls and through evtc.linear."""
    def gelu_and_row_norms(acc, bias):
        y = F.gelu(acc + bias)
        return y, (y.float() ** 2).sum(-1)

    a, b, bias = randn(256, 128), randn(128, 192), randn(192)
    k = evtc.compile(gelu_and_row_norms, {"a": a, "b": b, "bias": bias}, cache_dir=cache, strict=True)
    out = (torch.empty(0, device="cuda", dtype=torch.float16), torch.empty(0, device="cuda"))
    got = k(a, b, bias=bias, out=out)
    assert got[0] is out[0] and got[1] is out[1] and k.last_path == "kernel"
    _check(out, gelu_and_row_norms(a.float() @ b.float(), bias.float()), "k(out=empty)")
    w = randn(192, 128)
    lin = evtc.linear(gelu_and_row_norms, {"x": randn(2, 128, 128), "weight": w, "bias": bias},
                      cache_dir=cache)
    x = randn(2, 128, 128)
    out = (torch.empty(0, device="cuda", dtype=torch.float16), torch.empty(0, device="cuda"))
    lin(x, w, bias=bias, out=out)
    _check(out, gelu_and_row_norms(x.float() @ w.float().t(), bias.float()), "linear(out=empty)")


def test_broadcasts_that_keep_torchs_shapes_run_the_kernel(cache):
    """A (1,) scale for a 0-d example read by a reduction through a full tile, and a 2-d a or b
    (or one of batch 1) beside a batched other where an output reads shared operands alone (that
    output the same in every batch, torch's (M, N)): both run the kernel on views and give torch's
    results. An operand whose shape the function reads keeps its compiled shape (refused by name)."""
    def scaled_amax(acc, s):
        y = acc * s
        return y, y.abs().amax()

    a, b = randn(200, 128), randn(128, 256)
    # s in acc's dtype: a float32 (1,) would promote the outputs where a 0-dim one does not
    k = _compile(scaled_amax, a, b, cache, s=torch.tensor(0.5, device="cuda").half())
    for s in (torch.tensor([0.5], device="cuda").half(), torch.tensor([[0.25]], device="cuda").half()):
        got = k(a, b, s=s)
        assert k.last_path == "kernel"
        _check(got, _ref(scaled_amax, a, b, s=s), f"scale {tuple(s.shape)}")

    def shared(acc, C, D):
        return acc + C, D * 2

    A, B, C, D = randn(3, 200, 128), randn(3, 128, 256), randn(3, 200, 256), randn(200, 256)
    kb = _compile(shared, A, B, cache, C=C, D=D)
    for x, w, what in [(A, B[1], "2-d b"), (A[2], B, "2-d a"), (A[:1], B, "a of batch 1")]:
        got = kb(x, w, C=C, D=D)
        assert kb.last_path == "kernel", what
        _check(got, _ref(shared, x, w, C=C, D=D), what)

    sized = _compile(lambda acc, C: acc * C.size(0) + C, A, B, cache, C=C)
    with pytest.raises(evtc.CallError, match="the epilogue reads C's shape"):
        sized(A, B, C=C[0])
    _check(sized(A, B, C=C), (A.float() @ B.float()) * 3 + C.float(), "compiled shapes")
