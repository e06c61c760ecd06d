"""GPU: autotuning picks a launch by timing the candidates on the call's inputs, never writes the
caller's outputs (or inputs they alias) more than once, keeps the result per size bucket in the
disk cache, and gives the same results as the default launch, checked against float64."""

from __future__ import annotations

import json

import pytest
import torch

import evtc
from evtc.runtime import autotune

pytestmark = pytest.mark.gpu


def residual_relu(acc, C, bias):
    return torch.relu(acc + C + bias).to(C.dtype)  # C's dtype (out=C), whatever the bias's


def with_row_sums(acc, bias):
    y = acc + bias
    return y, y.float().sum(-1)


def _inputs(m, n, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(m, k, device="cuda", generator=g) * k ** -0.25).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.25).to(torch.bfloat16)
    C = torch.randn(m, n, device="cuda", generator=g).to(torch.bfloat16)
    bias = torch.randn(n, device="cuda", generator=g)
    return x, w, C, bias


def _rel(got, ref):
    return ((got.double() - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def test_tuned_launch_is_correct_and_in_place_safe(tmp_path):
    ex = {"a": _meta(8, 64), "b": _meta(64, 64).t(), "C": _meta(8, 64),
          "bias": _meta(64, dtype=torch.float32)}
    k = evtc.compile(residual_relu, ex, cache_dir=tmp_path, autotune=True)
    for i, (m, n, kk) in enumerate([(64, 1024, 4096), (100, 512, 3000), (2048, 1024, 512)]):
        x, w, C, bias = _inputs(m, n, kk, i)
        ref = torch.relu(x.double() @ w.double().t() + C.double() + bias.double())
        assert _rel(k(x, w.t(), C=C, bias=bias), ref) < 1e-2
        # out=C: the candidates run into scratch outputs, so C is read unchanged by the real launch.
        got = k(x, w.t(), C=C, bias=bias, out=C)
        assert got is C and _rel(C, ref) < 1e-2, (m, n, kk)
    store = json.loads(k.tuner.store.path.read_text())
    assert autotune.bucket(64, 1024, 4096, 1) in store and len(store) == 3
    entry = store[autotune.bucket(64, 1024, 4096, 1)]
    assert len(entry["us"]) > 1 and entry["splits"] >= 1


def test_tuned_launches_come_back_from_the_disk_cache(tmp_path, monkeypatch):
    ex = {"a": _meta(8, 64), "b": _meta(64, 64).t(), "bias": _meta(64, dtype=torch.float32)}
    k = evtc.compile(with_row_sums, ex, cache_dir=tmp_path, autotune=True)
    x, w, _, bias = _inputs(16, 2048, 4096, 7)
    y_ref = x.double() @ w.double().t() + bias.double()
    y, sums = k(x, w.t(), bias=bias)
    assert _rel(y, y_ref) < 1e-2 and _rel(sums, y_ref.sum(-1)) < 1e-4
    tuned = k.tuner.tuned[autotune.bucket(16, 2048, 4096, 1)]
    # A new kernel object (as in a new process) reads the store and times nothing.
    k.tuner.tuned.clear()
    k._launch_memo.clear()
    k.tuner.store = None

    def no_timing(run):
        raise AssertionError("timed again instead of reading the disk cache")

    monkeypatch.setattr(autotune, "time_us", no_timing)
    y2, sums2 = k(x, w.t(), bias=bias)
    assert k.tuner.tuned[autotune.bucket(16, 2048, 4096, 1)] == tuned
    assert torch.equal(y2, y) and torch.equal(sums2, sums)


def test_tuning_a_staged_call(tmp_path):
    """N = 1001 halves: rows of 2002 bytes, not a 16-byte multiple, so the call runs on padded
    copies. The candidates are timed into scratch outputs with those padded strides."""
    ex = {"a": _meta(8, 64, dtype=torch.float16), "b": _meta(64, 64, dtype=torch.float16).t(),
          "C": _meta(8, 64, dtype=torch.float16), "bias": _meta(64, dtype=torch.float32)}
    k = evtc.compile(residual_relu, ex, cache_dir=tmp_path, autotune=True)
    x, w, C, bias = (t.half() if t.dtype == torch.bfloat16 else t for t in _inputs(48, 1001, 640, 3))
    ref = torch.relu(x.double() @ w.double().t() + C.double() + bias.double())
    assert _rel(k(x, w.t(), C=C, bias=bias), ref) < 1e-2
    assert k.last_path == "staged" and autotune.bucket(48, 1001, 640, 1) in k.tuner.tuned


def test_a_call_on_unaligned_tensors_is_tuned_on_its_aligned_copies(tmp_path):
    """K = 1001 halves: a's rows are 2002 bytes, which TMA cannot read, so no launch runs on the
    call's own tensors. The tuner must not store the rules' launch untimed as the winner: it times
    the candidates on the aligned copies the call then runs on."""
    ex = {"a": _meta(8, 64, dtype=torch.float16), "b": _meta(64, 64, dtype=torch.float16).t(),
          "C": _meta(8, 64, dtype=torch.float16), "bias": _meta(64, dtype=torch.float32)}
    k = evtc.compile(residual_relu, ex, cache_dir=tmp_path, autotune=True)
    g = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(64, 1001, device="cuda", generator=g).half()
    w = torch.randn(512, 1001, device="cuda", generator=g).half()
    C = torch.randn(64, 512, device="cuda", generator=g).half()
    bias = torch.randn(512, device="cuda", generator=g)
    ref = torch.relu(x.double() @ w.double().t() + C.double() + bias.double())
    assert _rel(k(x, w.t(), C=C, bias=bias), ref) < 1e-2
    assert k.last_path == "staged"
    entry = json.loads(k.tuner.store.path.read_text())[autotune.bucket(64, 512, 1001, 1)]
    assert len(entry["us"]) > 1, entry  # timed, not the rules' launch stored untimed
    assert _rel(k(x, w.t(), C=C, bias=bias), ref) < 1e-2
