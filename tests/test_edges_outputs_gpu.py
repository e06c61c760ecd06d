"""Edge cases of the forward call (first written as an adversarial probe): several outputs
(tuple, dict), out= (aliasing inputs), reductions of every axis,
masks and values returned as they are."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from edges_util import BF16, F16, F32, PINNED, check, close, randn, ref64, snapshot, unchanged

import evtc


@pytest.mark.gpu
def test_dict_outputs_and_dict_out(cache):
    """An epilogue returning a dict of three outputs of three dtypes; out= as a dict of
    non-contiguous tensors is written in place and returned."""

    def f(acc, bias):
        y = acc + bias
        return {"y": y, "act": F.relu(y).to(torch.bfloat16), "y32": y.float() * 2.0}

    m, n, k = 160, 200, 64
    a, b, bias = randn(m, k), randn(k, n), randn(n)
    kern = evtc.compile(f, dict(a=a, b=b, bias=bias), cache_dir=cache, config=PINNED)
    got = kern(a, b, bias=bias)
    check(got, f, a, b, bias=bias, what="dict")
    out = {"y": torch.full((n, m), float("nan"), device="cuda", dtype=F16).t(),
           "act": torch.full((m, 2 * n), float("nan"), device="cuda", dtype=BF16)[:, ::2],
           "y32": torch.full((m, n), float("nan"), device="cuda", dtype=F32)}
    res = kern(a, b, bias=bias, out=out)
    for key in out:
        assert res[key] is out[key] or res[key].data_ptr() == out[key].data_ptr(), key
    check({k: v for k, v in out.items()}, f, a, b, bias=bias, what="dict out=")


@pytest.mark.gpu
def test_out_aliasing_a_b_and_c(cache):
    """out= overlapping a (same storage), C exactly (in place) and a transposed view of C: docs say
    written through a new tensor then copied; result equals the function of the inputs' old values."""
    m = n = k = 128

    def f(acc, C):
        return acc * 0.5 + C

    kern = evtc.compile(f, dict(a=randn(64, 64), b=randn(64, 64), C=randn(64, 64)), cache_dir=cache,
                        config=PINNED)
    a, b, C = randn(m, k), randn(k, n), randn(m, n)
    want = ref64(f, a, b, C=C)
    # out is a itself (a is M x K = M x N here)
    a2, b2, C2 = a.clone(), b.clone(), C.clone()
    kern(a2, b2, C=C2, out=a2)
    close(a2, want, F16, "out=a")
    a2, b2, C2 = a.clone(), b.clone(), C.clone()
    kern(a2, b2, C=C2, out=b2)
    close(b2, want, F16, "out=b")
    a2, b2, C2 = a.clone(), b.clone(), C.clone()
    kern(a2, b2, C=C2, out=C2)
    close(C2, want, F16, "out=C")
    a2, b2, C2 = a.clone(), b.clone(), C.clone()
    kern(a2, b2, C=C2, out=C2.t())  # out = C^T: every element of C is read and written elsewhere
    close(C2.t(), want, F16, "out=C.t()")
    # out shifted by one row inside C's buffer
    buf = torch.cat([C, randn(1, n)])
    Cv, outv = buf[:m], buf[1:m + 1]
    want2 = ref64(f, a, b, C=Cv.clone())
    kern(a, b, C=Cv, out=outv)
    close(outv, want2, F16, "out = C shifted by a row")


@pytest.mark.gpu
def test_two_outputs_into_two_views_of_one_buffer_and_same_value_twice(cache):
    """`return y, y` gives two distinct tensors; out= as the two halves of one buffer is legal."""

    def f(acc, bias):
        y = torch.sigmoid(acc + bias)
        return y, y

    m, n, k = 96, 128, 64
    a, b, bias = randn(m, k), randn(k, n), randn(n)
    kern = evtc.compile(f, dict(a=a, b=b, bias=bias), cache_dir=cache, config=PINNED)
    y1, y2 = kern(a, b, bias=bias)
    assert y1.data_ptr() != y2.data_ptr()
    check((y1, y2), f, a, b, bias=bias, what="y, y")
    buf = torch.full((m, 2 * n), float("nan"), device="cuda", dtype=F16)
    kern(a, b, bias=bias, out=(buf[:, :n], buf[:, n:]))
    check((buf[:, :n], buf[:, n:]), f, a, b, bias=bias, what="halves of one buffer")


@pytest.mark.gpu
def test_returning_inputs_and_functions_of_inputs_only(cache):
    """An output that does not depend on acc (C * 2, an input itself) beside acc: values as torch,
    new tensors (never the input itself), inputs unchanged."""

    def f(acc, C):
        return acc, C * 2.0, C

    m, n, k = 64, 128, 32
    a, b, C = randn(m, k), randn(k, n), randn(m, n)
    kern = evtc.compile(f, dict(a=a, b=b, C=C), cache_dir=cache, config=PINNED)
    before = snapshot(a, b, C)
    got = kern(a, b, C=C)
    check(got, f, a, b, C=C, what="inputs returned")
    assert got[2].data_ptr() != C.data_ptr()
    got[2].fill_(0)
    unchanged(before, (a, b, C))


@pytest.mark.gpu
def test_row_col_batch_and_total_reductions_batched(cache):
    """Batched (L=3) reductions of every axis, with keepdim and mean, at M, N not multiples of the
    tile: shapes, dtypes and values as torch's."""

    def f(acc, bias):
        y = acc + bias
        return (y, y.sum(-1), y.amax(-2, keepdim=True), y.mean((-2, -1)), y.abs().amax(),
                (y * y).mean(-1, keepdim=True))

    L, m, n, k = 3, 200, 264, 64
    ex = dict(a=randn(L, 64, 64), b=randn(L, 64, 64), bias=randn(64, dtype=F32))
    kern = evtc.compile(f, ex, cache_dir=cache, config=PINNED)
    a, b, bias = randn(L, m, k), randn(L, k, n), randn(n, dtype=F32) + 3  # means away from 0: relative checks
    check(kern(a, b, bias=bias), f, a, b, bias=bias, what="batched reductions")
    # again with another M (reductions finished by the kernel: counters must be reset)
    a, b = randn(L, 7, k), randn(L, k, n)
    check(kern(a, b, bias=bias), f, a, b, bias=bias, what="batched reductions M=7")


@pytest.mark.gpu
def test_reductions_of_16bit_values_and_dtype_arg(cache):
    """Sums of a value cast to f16 / bf16 and with dtype=: rounded as torch rounds (docs
    "Reductions"); amin of all-negative values over ragged columns; NaN propagation of amax."""

    def f(acc, C):
        h = (acc * 0.125).half()
        return h.sum(-1), h.sum(-2, dtype=torch.float32), (acc - 100.0).amin(-2), (acc + C).amax(-1)

    m, n, k = 131, 77 * 8, 64
    a, b, C = randn(m, k), randn(k, n), randn(m, n)
    kern = evtc.compile(f, dict(a=randn(64, 64), b=randn(64, 64), C=randn(64, 64)), cache_dir=cache,
                        config=PINNED)
    check(kern(a, b, C=C), f, a, b, C=C, what="16-bit reductions")
    C[5, 17] = float("nan")
    got = kern(a, b, C=C)
    assert torch.isnan(got[3][5]).item() and not torch.isnan(got[3][6]).item()


@pytest.mark.gpu
def test_reductions_only_at_m_one_and_large(cache):
    """An epilogue returning reductions only (no D) at M = 1, at a split-K size, and past the
    kernel-finish limit (host finish, > 16M outputs): values as torch's."""

    def f(acc):
        return (acc * acc).sum(-1), acc.amax()

    kern = evtc.compile(f, dict(a=randn(128, 64), b=randn(64, 128)), cache_dir=cache)
    for (m, n, k) in ((1, 4096, 4096), (64, 1024, 8192), (4352, 4096, 64)):
        a, b = randn(m, k, scale=0.1), randn(k, n, scale=0.1)
        check(kern(a, b), f, a, b, what=f"{m}x{n}x{k}")


@pytest.mark.gpu
def test_mask_outputs_where_and_comparisons(cache):
    """Comparisons, torch.where with tensor and number branches, logical ops and a mask output
    (a bool tensor, as torch returns it): values as the float64 function."""

    def f(acc, C, lo: float):
        m1 = acc > C
        m2 = (acc < lo) | (C == 0)
        y = torch.where(m1, acc, C * 2) + torch.where(m2, 1.0, -1.0)
        return y, (m1 & ~m2)

    m, n, k = 100, 136, 32
    a, b, C = randn(m, k), randn(k, n), randn(m, n)
    C[::7] = 0
    kern = evtc.compile(f, dict(a=a, b=b, C=C, lo=0.0), cache_dir=cache, config=PINNED)
    y, mask = kern(a, b, C=C, lo=-0.5)
    want_y, want_mask = ref64(f, a, b, C=C, lo=-0.5)
    close(y, want_y, F16, "where", mismatch=2e-3)
    assert mask.dtype == torch.bool, f"mask dtype {mask.dtype}"
    agree = (mask.double().cpu() == want_mask.double().cpu()).double().mean().item()
    assert agree > 0.998, f"mask agrees on {agree:.4f}"


@pytest.mark.gpu
def test_out_given_for_some_reductions_and_tiles(cache):
    """out= with a tile and reductions (a tuple), tensors with a storage offset / pitch; out tensors
    written, returned, and the result equals the one without out=."""

    def f(acc, bias):
        y = F.gelu(acc + bias)
        return y, y.sum(-1), y.amax()

    m, n, k = 150, 256, 64
    a, b, bias = randn(m, k), randn(k, n), randn(n)
    kern = evtc.compile(f, dict(a=a, b=b, bias=bias), cache_dir=cache, config=PINNED)
    plain = kern(a, b, bias=bias)
    big = torch.full((m + 1, n + 8), float("nan"), device="cuda", dtype=F16)
    rows = torch.full((2 * m,), float("nan"), device="cuda", dtype=F16)
    tot = torch.full((), float("nan"), device="cuda", dtype=F16)
    res = kern(a, b, bias=bias, out=(big[1:, 8:], rows[::2], tot))
    for i, (p, r) in enumerate(zip(plain, res, strict=True)):
        assert torch.equal(p.float(), r.float()), f"output {i} differs with out="
    check(res, f, a, b, bias=bias, what="out=")
    assert torch.isnan(big[0]).all() and torch.isnan(big[:, :8]).all() and torch.isnan(rows[1::2]).all()


@pytest.mark.gpu
def test_symbolic_sizes_follow_each_call_batched(cache):
    """`acc.numel()`, `acc.shape[-2]`, `acc.size(0)` in arithmetic stay symbolic (docs "sizes"):
    one batched kernel called at three (L, M, N) gives the values of each call's sizes."""

    def f(acc):
        return acc / acc.numel() * 1e3 + acc.shape[-2] + acc.size(0) * 0.5, acc.sum() / acc.numel()

    kern = evtc.compile(f, dict(a=randn(2, 64, 64), b=randn(2, 64, 64)), cache_dir=cache, config=PINNED)
    for (L, m, n, k) in ((2, 64, 64, 64), (3, 40, 136, 32), (1, 7, 8, 8)):
        a, b = randn(L, m, k), randn(L, k, n)
        check(kern(a, b), f, a, b, what=f"L={L} {m}x{n}x{k}", atol_rel=1e-2)


def _shared_first(acc, C):
    return C * 2.0, acc + C


def _shared_second(acc, C, bias):
    return F.gelu(acc + bias), (C - 1.0).to(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("fn, rank", [(_shared_first, 2), (_shared_second, 2), (_shared_second, 3)],
                         ids=["first", "second", "unit_batch"])
def test_an_output_the_same_in_every_batch(cache, fn, rank):
    """A batched call whose output reads no batched value (a shared (M, N) or (1, M, N) C): torch
    gives it C's shape, and the kernel returned it (L, M, N). Values and shapes against float64,
    at sizes off the tiles, D first or second; inputs unchanged."""
    shape = (64, 96) if rank == 2 else (1, 64, 96)
    ops = {"C": randn(*shape, dtype=F32)}
    if fn is _shared_second:
        ops["bias"] = randn(96, dtype=F32)
    kern = evtc.compile(fn, dict(a=randn(3, 64, 32), b=randn(3, 32, 96), **ops), cache_dir=cache,
                        config=PINNED)
    for L, m, n, k in ((3, 200, 136, 72), (2, 1, 264, 24), (4, 129, 40, 128)):
        a, b = randn(L, m, k), randn(L, k, n)
        ops = {"C": randn(*((m, n) if rank == 2 else (1, m, n)), dtype=F32)}
        if fn is _shared_second:
            ops["bias"] = randn(n, dtype=F32)
        before = snapshot(a, b, *ops.values())
        got = kern(a, b, **ops)
        assert kern.last_path == "kernel"
        check(got, fn, a, b, what=f"{fn.__name__} {L}x{m}x{n}", **ops)
        unchanged(before, [a, b, *ops.values()])
