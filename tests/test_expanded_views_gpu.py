"""GPU: inputs that are expanded views (a stride of 0 along a dim of extent > 1), as broadcasting
code passes them: a weight shared by every batch, a bias expanded to a tile, an activation row
repeated. Every result must equal the function on the same values; an ``out=`` whose elements
overlap is refused as torch refuses it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import evtc

pytestmark = pytest.mark.gpu


def randn(*shape, dtype=torch.float16):
    return torch.randn(*shape, device="cuda").to(dtype)


def _rel(got, want) -> float:
    want = want.float()
    return (torch.linalg.vector_norm(got.float() - want) / torch.linalg.vector_norm(want)).item()


# In a's dtype, whatever the float32 operands (torch would promote to float32): these tests are
# about the views the kernel reads and writes.
def residual(acc, C, bias):
    return (F.gelu(acc + bias) + C).to(acc.dtype)


def scaled(acc, s, col):
    return (acc * s + col).to(acc.dtype)


def _ref(fn, a, b, **ops):
    return fn(a.float() @ b.float(), **{k: v.float() for k, v in ops.items()})


def test_expanded_epilogue_operands(cache):
    m, n, k = 256, 384, 128
    a, b = randn(m, k), randn(k, n)
    kernel = evtc.compile(residual, dict(a=a, b=b, C=randn(m, n), bias=randn(n, dtype=torch.float32)),
                          cache_dir=cache)
    row = randn(1, n)
    C = row.expand(m, n)  # strides (0, 1)
    bias = torch.randn(1, device="cuda").expand(n)  # stride 0
    got = kernel(a, b, C=C, bias=bias)
    assert _rel(got, _ref(residual, a, b, C=C, bias=bias)) < 1e-2
    col_tile = randn(m, 1).expand(m, n)  # strides (1, 0)
    got = kernel(a, b, C=col_tile, bias=bias)
    assert _rel(got, _ref(residual, a, b, C=col_tile, bias=bias)) < 1e-2


def test_expanded_col_and_scalar(cache):
    m, n, k = 200, 256, 64
    a, b = randn(m, k), randn(k, n)
    kernel = evtc.compile(scaled, dict(a=a, b=b, s=torch.ones((), device="cuda"),
                                       col=randn(m, 1, dtype=torch.float32)), cache_dir=cache)
    s = torch.tensor(0.5, device="cuda")
    col = torch.randn(1, 1, device="cuda").expand(m, 1)
    got = kernel(a, b, s=s, col=col)
    assert _rel(got, _ref(scaled, a, b, s=s, col=col)) < 1e-2


def test_expanded_a_and_shared_weight_across_batches(cache):
    batches, m, n, k = 3, 128, 256, 192
    kernel = evtc.compile(residual, dict(a=randn(batches, m, k), b=randn(batches, k, n),
                                         C=randn(batches, m, n), bias=randn(n, dtype=torch.float32)),
                          cache_dir=cache)
    w = randn(n, k)
    b = w.t().unsqueeze(0).expand(batches, k, n)  # one weight for every batch: batch stride 0
    a = randn(batches, m, k)
    C, bias = randn(batches, m, n), randn(n, dtype=torch.float32)
    got = kernel(a, b, C=C, bias=bias)
    assert _rel(got, _ref(residual, a, b, C=C, bias=bias)) < 1e-2
    b_rows = randn(k, n).unsqueeze(0).expand(batches, k, n)  # row-major, batch stride 0
    got = kernel(a, b_rows, C=C, bias=bias)
    assert _rel(got, _ref(residual, a, b_rows, C=C, bias=bias)) < 1e-2
    a_rep = randn(1, m, k).expand(batches, m, k)  # the same activations for every batch
    got = kernel(a_rep, b, C=C, bias=bias)
    assert _rel(got, _ref(residual, a_rep, b, C=C, bias=bias)) < 1e-2
    a_row = randn(1, 1, k).expand(batches, m, k)  # one row repeated: stride 0 along M too
    got = kernel(a_row, b, C=C, bias=bias)
    assert _rel(got, _ref(residual, a_row, b, C=C, bias=bias)) < 1e-2


def test_out_with_overlapping_elements_is_refused(cache):
    m, n, k = 128, 256, 64
    a, b = randn(m, k), randn(k, n)
    kernel = evtc.compile(residual, dict(a=a, b=b, C=randn(m, n), bias=randn(n, dtype=torch.float32)),
                          cache_dir=cache)
    out = torch.empty(1, n, device="cuda", dtype=torch.float16).expand(m, n)
    with pytest.raises(evtc.CallError, match="share memory"):
        kernel(a, b, C=randn(m, n), bias=randn(n, dtype=torch.float32), out=out)
    whole = torch.full((m, n), float("nan"), device="cuda", dtype=torch.float16)
    shared = randn(1, n).expand(m, n)
    zero = torch.zeros(n, device="cuda")
    got = kernel(a, b, C=shared, bias=zero, out=whole)  # as an input it is fine
    assert got is whole and _rel(whole, _ref(residual, a, b, C=shared, bias=zero)) < 1e-2


def _double_ref(fn, a, b, **ops):
    return fn(a.double() @ b.double(), **{k: v.double() for k, v in ops.items()})


@pytest.mark.parametrize("knobs,splits", [
    ({"schedule": "pingpong", "cluster": (1, 1)}, 3),
    ({"schedule": "cooperative", "cluster": (1, 2)}, 2),
    # More than one wave of 64 x 64 tiles in 2x1 clusters: only the tail is split.
    ({"schedule": "pingpong", "tile_m": 64, "tile_n": 64, "cluster": (2, 1)}, 4),
], ids=["pingpong-c1x1", "cooperative-c1x2", "tail-c2x1"])
def test_batch_stride_zero_under_split_k_and_clusters(cache, knobs, splits):
    """A weight, activations and C shared by every batch (batch stride 0) go to TMA as they are.
    With K split (the partials of each batch combined apart) and multi-CTA clusters, each batch
    must still read its own problem: equal to float64 on the same values, batch by batch."""
    batches, m, n, k = 3, 640, 1800, 1000
    ex = dict(a=torch.empty(batches, 64, 64, dtype=torch.bfloat16, device="meta"),
              b=torch.empty(batches, 64, 64, dtype=torch.bfloat16, device="meta").transpose(1, 2),
              C=torch.empty(batches, 64, 64, dtype=torch.bfloat16, device="meta"),
              bias=torch.empty(64, device="meta"))
    kernel = evtc.compile(residual, ex, config={"split_k": True, **knobs}, cache_dir=cache, strict=True)
    kernel.pin_splits(splits)
    try:
        w = randn(n, k, dtype=torch.bfloat16) * k ** -0.5
        shared_b = w.t().unsqueeze(0).expand(batches, k, n)
        a = randn(batches, m, k, dtype=torch.bfloat16)
        a_shared = randn(1, m, k, dtype=torch.bfloat16).expand(batches, m, k)
        C = randn(1, m, n, dtype=torch.bfloat16).expand(batches, m, n)
        bias = torch.randn(n, device="cuda")
        for a_in in (a, a_shared):
            got = kernel(a_in, shared_b, C=C, bias=bias)
            want = _double_ref(residual, a_in, shared_b, C=C, bias=bias)
            for i in range(batches):
                assert _rel(got[i], want[i]) < 2e-2, (i, knobs, splits)
    finally:
        kernel.pin_splits(None)


def test_examples_of_one_batch_then_three(cache):
    """Compiled from a, b and C of batch 1 (so C is per batch), called with batches of 3: a C of
    its own per batch, and a shared (1, M, N) C, which the kernel reads expanded (batch stride 0)."""
    m, n, k = 256, 384, 128
    bias = randn(n, dtype=torch.float32)
    kernel = evtc.compile(residual, dict(a=randn(1, m, k), b=randn(1, k, n), C=randn(1, m, n), bias=bias),
                          cache_dir=cache)
    a, b = randn(3, m, k), randn(3, k, n)
    for C in (randn(3, m, n), randn(1, m, n)):
        got = kernel(a, b, C=C, bias=bias)
        assert kernel.last_path == "kernel"
        assert got.shape == (3, m, n)
        assert _rel(got, _ref(residual, a, b, C=C, bias=bias)) < 1e-2
