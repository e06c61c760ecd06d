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


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("evtc-expanded-gpu")


def residual(acc, C, bias):
    return F.gelu(acc + bias) + C


def scaled(acc, s, col):
    return acc * s + col


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
