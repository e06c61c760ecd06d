"""GPU: split-K (K cut into runtime-chosen splits, combined in a fixed order, the epilogue run once)
against torch in float64, for plain, loading, reducing and gated epilogues under both schedules,
with ragged sizes, more splits than K tiles, bit-for-bit determinism, CUDA graphs and the
automatic choice for small M."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import evtc

pytestmark = pytest.mark.gpu


def identity(acc):
    return acc


def residual_relu(acc, C, bias):
    return torch.relu(acc + C + bias)


def with_row_sums(acc, bias):
    y = acc + bias
    return y, y.float().sum(-1)


def swiglu(acc):
    gate, up = acc.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("evtc-split-k"))


def _inputs(m, n, k, seed, dtype=torch.bfloat16, gated=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(m, k, device="cuda", generator=g) * k ** -0.25).to(dtype)
    w = (torch.randn((2 if gated else 1) * n, k, device="cuda", generator=g) * k ** -0.25).to(dtype)
    C = torch.randn(m, n, device="cuda", generator=g).to(dtype)
    bias = torch.randn(n, device="cuda", generator=g)
    return x, w, C, bias


def _close(out, ref, tol=2e-2):
    err = ((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
    assert err < tol, f"max error {err:.3g} relative to the largest value"


SCHEDULES = ["pingpong", "cooperative"]
# (M, N, K): ragged M and N, K not a multiple of the 64-wide K tile, and K with fewer tiles than
# splits (some splits then have no K at all).
SHAPES = [(64, 512, 4096), (100, 1000, 1000), (1, 256, 8192), (200, 384, 96)]
SPLITS = [1, 2, 3, 7]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_identity_every_split_count(cache, schedule):
    k = evtc.compile(identity, {"a": torch.empty(8, 64, dtype=torch.bfloat16, device="meta"),
                                "b": torch.empty(64, 64, dtype=torch.bfloat16, device="meta").t()},
                     config={"split_k": True, "schedule": schedule, "cluster": (1, 1)}, cache_dir=cache,
                     strict=True)
    for i, (m, n, kk) in enumerate(SHAPES):
        x, w, _, _ = _inputs(m, n, kk, seed=i)
        ref = x.double() @ w.double().t()
        for splits in SPLITS:
            k.pin_splits(splits)
            _close(k(x, w.t()), ref)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_loads_and_reductions(cache, schedule):
    """An epilogue that loads C (the epilogue-load warp runs for the last split only) and one that
    reduces rows (the reduction sees the full K sum exactly once)."""
    examples = {"a": torch.empty(8, 64, dtype=torch.bfloat16, device="meta"),
                "b": torch.empty(64, 64, dtype=torch.bfloat16, device="meta").t(),
                "C": torch.empty(8, 64, dtype=torch.bfloat16, device="meta"),
                "bias": torch.empty(64, device="meta")}
    cfg = {"split_k": True, "schedule": schedule}
    fused = evtc.compile(residual_relu, examples, config=cfg, cache_dir=cache, strict=True)
    sums = evtc.compile(with_row_sums, {k: v for k, v in examples.items() if k != "C"}, config=cfg,
                        cache_dir=cache, strict=True)
    for i, (m, n, kk) in enumerate(SHAPES[:3]):
        x, w, C, bias = _inputs(m, n, kk, seed=10 + i)
        acc = x.double() @ w.double().t()
        for splits in (2, 5):
            fused.pin_splits(splits)
            sums.pin_splits(splits)
            _close(fused(x, w.t(), C=C, bias=bias), torch.relu(acc + C.double() + bias.double()))
            y, s = sums(x, w.t(), bias=bias)
            _close(y, acc + bias.double())
            _close(s, (acc + bias.double()).sum(-1))


def test_gated(cache):
    x, w, _, _ = _inputs(64, 512, 2048, seed=3, gated=True)
    k = evtc.compile(swiglu, {"a": x, "b": w.t()}, config={"split_k": True}, cache_dir=cache, strict=True)
    gate, up = (x.double() @ w.double().t()).chunk(2, dim=-1)
    for splits in (1, 4):
        k.pin_splits(splits)
        _close(k(x, w.t()), F.silu(gate) * up)


def test_deterministic_and_counters_reset(cache):
    """Same inputs, same bits, run after run: the partials are added in split order, and the
    counters go back to zero after every launch (else the next launch would not wait)."""
    x, w, _, _ = _inputs(32, 768, 8192, seed=5)
    k = evtc.compile(identity, {"a": x, "b": w.t()}, config={"split_k": True}, cache_dir=cache, strict=True)
    k.pin_splits(6)
    first = k(x, w.t())
    for _ in range(20):
        assert torch.equal(k(x, w.t()), first)
    _close(first, x.double() @ w.double().t())


def test_cuda_graph_replay(cache):
    x, w, _, _ = _inputs(64, 1024, 4096, seed=6)
    k = evtc.compile(identity, {"a": x, "b": w.t()}, config={"split_k": True}, cache_dir=cache, strict=True)
    k.pin_splits(4)
    k(x, w.t())  # compile and warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = k(x, w.t())
    for seed in range(3):
        x.copy_(_inputs(64, 1024, 4096, seed=100 + seed)[0])
        graph.replay()
        torch.cuda.synchronize()
        _close(out, x.double() @ w.double().t())


def test_two_streams(cache):
    """Launches on two streams at once use two counter buffers."""
    k = evtc.compile(identity, {"a": torch.empty(8, 64, dtype=torch.bfloat16, device="meta"),
                                "b": torch.empty(64, 64, dtype=torch.bfloat16, device="meta").t()},
                     config={"split_k": True}, cache_dir=cache, strict=True)
    k.pin_splits(4)
    problems = [_inputs(64, 2048, 8192, seed=20 + i) for i in range(2)]
    streams = [torch.cuda.Stream() for _ in problems]
    outs = []
    torch.cuda.synchronize()
    for _ in range(5):
        for (x, w, _, _), stream in zip(problems, streams, strict=True):
            with torch.cuda.stream(stream):
                outs.append((k(x, w.t()), x, w))
    torch.cuda.synchronize()
    for out, x, w in outs:
        _close(out, x.double() @ w.double().t())


def test_chosen_for_small_m(cache):
    """Without knobs, a decode-sized problem with a long K runs split (and matches float64); a large
    one does not split."""
    x, w, C, bias = _inputs(64, 4096, 8192, seed=7)
    examples = {"a": x, "b": w.t(), "C": C, "bias": bias}
    k = evtc.compile(residual_relu, examples, cache_dir=cache, strict=True)
    assert k.splits_for(64, 4096, 8192) > 1
    assert k.splits_for(8192, 8192, 8192) == 1
    _close(k(x, w.t(), C=C, bias=bias),
           torch.relu(x.double() @ w.double().t() + C.double() + bias.double()))
