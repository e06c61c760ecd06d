"""GPU: reductions the kernel finishes itself (the last tile of each block of rows or columns combines
every tile's partials and computes the outputs that follow them; for reductions per batch or over
everything, the last such block combines the blocks' values), against torch in float64.

Problems with many tiles per row (a vocabulary-sized N) and per column, ragged edges, batches, both
schedules, split-K and clusters that overhang the problem; bit-for-bit repeatable runs, counters back
at zero after every launch, CUDA graph replay, two streams at once, and no host finish on the call
path."""

from __future__ import annotations

import pytest
import torch

import evtc
from evtc.runtime import stream_buffers

pytestmark = pytest.mark.gpu


def rms_and_extrema(acc, bias, eps: float):
    # per row: a mean finished by 1/N, + eps and sqrt; a maximum; a keepdim minimum
    y = acc + bias
    return y, torch.sqrt((y * y).mean(-1) + eps), y.amax(-1), y.amin(-1, keepdim=True)


def column_stats(acc, scale):
    # per column: a sum scaled by a device scalar, a mean (1/M), rounded to bfloat16
    return acc.sum(-2) * scale, acc.mean(-2).to(torch.bfloat16)


def rows_and_columns(acc):
    return acc, (acc * acc).sum(-1), acc.sum(-2)


def over_everything(acc, bias, eps: float):
    # one value for the launch: a maximum, and a mean finished by 1/(M N), + eps and sqrt
    y = acc + bias
    return y, y.abs().amax(), torch.sqrt((y * y).mean() + eps), y.sum().to(torch.bfloat16)


def rows_and_everything(acc):
    return acc, acc.sum(-1), acc.abs().amax()


def per_batch(acc):
    return acc, acc.sum((-2, -1)), acc.amin((-2, -1))


def rows_batches_everything(acc):
    return acc, acc.sum((-2, -1)), acc.amax(-1), acc.sum()


def fp8_with_amax(acc, bias, s):
    y = acc + bias
    return (y * s).to(torch.float8_e4m3fn), y.abs().amax()


@pytest.fixture(autouse=True)
def kernel_finish_at_every_size(monkeypatch):
    """Large problems leave the finish to the host by default (KERNEL_FINISH_MAX_OUTPUT): these
    tests make the kernel finish them all, to test it on many tiles."""
    from evtc.runtime import reductions

    monkeypatch.setattr(reductions, "KERNEL_FINISH_MAX_OUTPUT", 1 << 62)


def _problem(m, n, k, seed, batches=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    lead = () if batches is None else (batches,)
    x = (torch.randn(*lead, m, k, device="cuda", generator=g) * k ** -0.25).to(torch.bfloat16)
    w = (torch.randn(*lead, n, k, device="cuda", generator=g) * k ** -0.25).to(torch.bfloat16)
    bias = torch.randn(n, device="cuda", generator=g)
    return x, w, bias


def _acc(x, w):
    return x.double() @ w.double().transpose(-1, -2)


#: One rounding of a 16-bit output (half its spacing), which reductions of 16-bit values take, as
#: in torch.
ROUNDING = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def _close(out, ref, tol=1e-4):
    tol = max(tol, ROUNDING.get(out.dtype, 0.0))
    err = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-12)).item()
    assert err < tol, f"relative error {err:.3g}"


def _compile(fn, x, w, cache, **kwargs):
    examples = {"a": x, "b": w.transpose(-1, -2), **kwargs.pop("operands", {})}
    k = evtc.compile(fn, examples, cache_dir=cache, strict=True, **kwargs)
    assert k.plan.kernel_finish, "expected the kernel to finish its reductions"
    return k


def _replays(k, x, w, bias, seeds):
    """Capture one call (with ``eps`` = 1e-5) in a CUDA graph, then replay it on new values of x:
    per seed, the captured outputs and the float64 reference of acc + bias."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = k(x, w.t(), bias=bias, eps=1e-5)
    for seed in seeds:
        x.copy_(_problem(x.shape[0], w.shape[0], x.shape[1], seed=seed)[0])
        graph.replay()
        torch.cuda.synchronize()
        yield outs, _acc(x, w) + bias.double()


def _check_rms(k, x, w, bias, eps=1e-5):
    y, rms, mx, mn = k(x, w.t(), bias=bias, eps=eps)
    ref = _acc(x, w) + bias.double()
    _close(rms, torch.sqrt((ref * ref).mean(-1) + eps))
    _close(mx, ref.amax(-1))
    _close(mn, ref.amin(-1, keepdim=True))
    return y, rms, mx, mn


@pytest.mark.parametrize("knobs", [{}, {"schedule": "cooperative"}, {"schedule": "pingpong", "tile_m": 64},
                                   {"cluster": (2, 1)}],
                         ids=["default", "cooperative", "tile-m-64", "cluster-2x1"])
def test_rows_of_many_tiles(cache, knobs):
    """A vocabulary-sized N (over a hundred tiles per row) and ragged M and N."""
    x, w, bias = _problem(300, 20000 + 8, 256, seed=1)
    k = _compile(rms_and_extrema, x, w, cache, operands={"bias": bias, "eps": 1e-5}, config=knobs or None)
    _check_rms(k, x, w, bias)
    assert k.last_path == "kernel"


def test_columns_scaled_and_rounded(cache):
    """Columns of a tall problem (many tiles per column), a device scalar in the finish, a
    bfloat16 finished output."""
    x, w, _ = _problem(9000 + 5, 392, 128, seed=2)
    scale = torch.tensor(0.75, device="cuda")
    k = _compile(column_stats, x, w, cache, operands={"scale": scale})
    total, mean = k(x, w.t(), scale=scale)
    acc = _acc(x, w)
    _close(total, acc.sum(-2) * 0.75)
    assert mean.dtype == torch.bfloat16
    _close(mean, acc.mean(-2), tol=1e-2)


def test_batches_rows_and_columns_with_split_k(cache):
    """Batches, both axes in one kernel, and split-K (the epilogue, and the finish, once per tile)."""
    x, w, _ = _problem(200, 1000, 3000, seed=3, batches=3)
    k = _compile(rows_and_columns, x, w, cache, config={"split_k": True})
    acc = _acc(x, w)
    for splits in (1, 3):
        k.pin_splits(splits)
        d, rows, cols = k(x, w.transpose(-1, -2))
        _close(rows, (acc * acc).sum(-1))
        _close(cols, acc.sum(-2))
        _close(d, acc, tol=1e-2)


def test_repeatable_and_counters_back_at_zero(cache):
    x, w, bias = _problem(1000, 5000, 512, seed=4)
    k = _compile(rms_and_extrema, x, w, cache, operands={"bias": bias, "eps": 1e-5})
    first = [t.clone() for t in k(x, w.t(), bias=bias, eps=1e-5)]
    for _ in range(10):
        again = k(x, w.t(), bias=bias, eps=1e-5)
        for a, b in zip(first, again, strict=True):
            assert torch.equal(a, b), "runs differ"
    torch.cuda.synchronize()
    finish_pools = [t for key, t in stream_buffers._COUNTERS.items() if key[2] == "finish"]
    assert finish_pools and all(int(t.abs().sum()) == 0 for t in finish_pools)


def test_cuda_graph_replay(cache):
    x, w, bias = _problem(256, 4096, 256, seed=5)
    k = _compile(rms_and_extrema, x, w, cache, operands={"bias": bias, "eps": 1e-5})
    k(x, w.t(), bias=bias, eps=1e-5)  # warm up outside the capture
    for outs, ref in _replays(k, x, w, bias, seeds=(50, 51, 52)):
        _close(outs[1], torch.sqrt((ref * ref).mean(-1) + 1e-5))
        _close(outs[2], ref.amax(-1))
    _check_rms(k, x, w, bias)  # eager calls after the capture still start from zeroed counters


def test_two_streams(cache):
    problems = [_problem(512, 3000, 1024, seed=60 + i) for i in range(2)]
    x, w, bias = problems[0]
    k = _compile(rms_and_extrema, x, w, cache, operands={"bias": bias, "eps": 1e-5})
    streams = [torch.cuda.Stream() for _ in problems]
    results = []
    torch.cuda.synchronize()
    for _ in range(5):
        for (x, w, bias), stream in zip(problems, streams, strict=True):
            with torch.cuda.stream(stream):
                results.append((k(x, w.t(), bias=bias, eps=1e-5), x, w, bias))
    torch.cuda.synchronize()
    for (_, rms, mx, _), x, w, bias in results:
        ref = _acc(x, w) + bias.double()
        _close(rms, torch.sqrt((ref * ref).mean(-1) + 1e-5))
        _close(mx, ref.amax(-1))


def test_no_host_finish_on_the_call_path(cache, monkeypatch):
    """A call runs no torch op of a host finish (the finish steps are never evaluated)."""
    from evtc.runtime import reductions

    x, w, bias = _problem(128, 512, 64, seed=7)
    k = _compile(rms_and_extrema, x, w, cache, operands={"bias": bias, "eps": 1e-5})
    monkeypatch.setattr(reductions, "_REDUCE", None)  # the host finish would fail on it
    _check_rms(k, x, w, bias)


def test_large_problems_are_finished_on_the_host_and_agree(cache, monkeypatch):
    """Above KERNEL_FINISH_MAX_OUTPUT the kernel's finish is off (one counter) and the host finishes
    from the same partials; below it the kernel does. Both give the float64 result, alternately."""
    from evtc.runtime import reductions

    x, w, bias = _problem(600, 3000, 256, seed=8)
    k = _compile(rms_and_extrema, x, w, cache, operands={"bias": bias, "eps": 1e-5})
    for limit in (1 << 62, 1000, 1 << 62, 1000):
        monkeypatch.setattr(reductions, "KERNEL_FINISH_MAX_OUTPUT", limit)
        _check_rms(k, x, w, bias)
    finish_pools = [t for key, t in stream_buffers._COUNTERS.items() if key[2] == "finish"]
    torch.cuda.synchronize()
    assert all(int(t.abs().sum()) == 0 for t in finish_pools)


def _check_everything(k, x, w, bias, eps=1e-5):
    y, amax, rms, total = k(x, w.t(), bias=bias, eps=eps)
    ref = _acc(x, w) + bias.double()
    assert amax.shape == () and rms.shape == () and total.dtype == torch.bfloat16
    _close(amax, ref.abs().amax(), tol=1e-5)
    _close(rms, torch.sqrt((ref * ref).mean() + eps))
    _close(total, ref.sum(), tol=1e-2)
    return y, amax, rms, total


@pytest.mark.parametrize("knobs", [{}, {"schedule": "cooperative"}, {"schedule": "pingpong", "tile_m": 64},
                                   {"cluster": (2, 1)}],
                         ids=["default", "cooperative", "tile-m-64", "cluster-2x1"])
def test_over_everything(cache, knobs):
    """Reductions over everything: hundreds of tiles in dozens of blocks of rows, ragged M and N."""
    x, w, bias = _problem(3000 + 3, 5000 + 8, 256, seed=11)
    k = _compile(over_everything, x, w, cache, operands={"bias": bias, "eps": 1e-5}, config=knobs or None)
    assert [axis for axis, _ in k.plan.kernel_finish] == ["all"]
    _check_everything(k, x, w, bias)
    assert k.last_path == "kernel"


def test_rows_and_everything_in_one_kernel(cache):
    x, w, _ = _problem(1000, 3000, 128, seed=12)
    k = _compile(rows_and_everything, x, w, cache)
    assert sorted(axis for axis, _ in k.plan.kernel_finish) == ["all", "row"]
    for _ in range(2):  # the second launch starts from the counters the first reset
        d, rows, amax = k(x, w.t())
        acc = _acc(x, w)
        _close(rows, acc.sum(-1))
        _close(amax, acc.abs().amax(), tol=1e-5)


def test_finished_outputs_are_tensors_of_their_own(cache):
    """Each output the kernel finishes has a storage of its own, as torch's ops return them (they
    were cut from one allocation per dtype: views of one storage, which torch refuses to change in
    place while autograd records, and which torch.save writes whole): separate storages, and an
    in-place op with an operand that requires grad records and differentiates as on a fresh tensor."""
    x, w, bias = _problem(300, 1000, 128, seed=21)
    k = _compile(rms_and_extrema, x, w, cache, operands={"bias": bias, "eps": 1e-5})
    y, rms, mx, mn = k(x, w.t(), bias=bias, eps=1e-5)
    storages = {t.untyped_storage().data_ptr() for t in (y, rms, mx, mn)}
    assert len(storages) == 4
    assert rms.untyped_storage().nbytes() == rms.numel() * rms.element_size()
    scale = torch.rand(300, device="cuda", requires_grad=True)
    rms.mul_(scale)  # refused for a view among several before
    rms.sum().backward()
    ref = _acc(x, w) + bias.double()
    _close(scale.grad, torch.sqrt((ref * ref).mean(-1) + 1e-5))
    _close(mx, ref.amax(-1))


def test_per_batch_with_split_k(cache):
    x, w, _ = _problem(700, 904, 3000, seed=13, batches=3)
    k = _compile(per_batch, x, w, cache, config={"split_k": True})
    assert [axis for axis, _ in k.plan.kernel_finish] == ["batch"]
    acc = _acc(x, w)
    for splits in (1, 3):
        k.pin_splits(splits)
        _, total, low = k(x, w.transpose(-1, -2))
        assert total.shape == (3,)
        _close(total, acc.sum((-2, -1)))
        _close(low, acc.amin((-2, -1)), tol=1e-5)


@pytest.mark.parametrize("batches", [1, 3, 5])
def test_per_batch_outputs_finished_on_the_host(cache, monkeypatch, batches):
    """Above KERNEL_FINISH_MAX_OUTPUT (16M output elements by default, so a (3, 4096, 4096)
    problem) the host finishes: the launch passes placeholders for the kernel-finished outputs,
    and a per-batch output's is tied to a's batch size in the compiled signature. One element for
    every placeholder failed the launch for L > 1 ("Mismatched outputs[...].shape[0]")."""
    from evtc.runtime import reductions

    x, w, _ = _problem(300, 1000, 264, seed=31, batches=batches)
    k = _compile(rows_batches_everything, x, w, cache)
    acc = _acc(x, w)
    for limit in (0, 1 << 62, 0):  # the host, the kernel, the host again
        monkeypatch.setattr(reductions, "KERNEL_FINISH_MAX_OUTPUT", limit)
        _, per_batch, rows, total = k(x, w.transpose(-1, -2))
        assert per_batch.shape == (batches,)
        _close(per_batch, acc.sum((-2, -1)))
        _close(rows, acc.amax(-1), tol=1e-5)
        _close(total, acc.sum())


def test_fp8_output_and_amax_in_one_kernel(cache, monkeypatch):
    """The float8 chain's amax comes from the kernel: no host finish runs."""
    from evtc.runtime import reductions

    x, w, bias = _problem(512, 4096, 256, seed=14)
    s = torch.tensor(0.5, device="cuda")
    k = _compile(fp8_with_amax, x, w, cache, operands={"bias": bias, "s": s})
    monkeypatch.setattr(reductions, "_REDUCE", None)  # the host finish would fail on it
    d, amax = k(x, w.t(), bias=bias, s=s)
    ref = _acc(x, w) + bias.double()
    _close(amax, ref.abs().amax(), tol=1e-5)
    assert d.dtype == torch.float8_e4m3fn
    _close(d.double(), (ref * 0.5).to(torch.float8_e4m3fn).double(), tol=0.1)


def test_over_everything_repeatable_under_graph_replay(cache):
    x, w, bias = _problem(2000, 3000, 256, seed=15)
    k = _compile(over_everything, x, w, cache, operands={"bias": bias, "eps": 1e-5})
    first = [t.clone() for t in _check_everything(k, x, w, bias)]
    for _ in range(5):
        for a, b in zip(first, k(x, w.t(), bias=bias, eps=1e-5), strict=True):
            assert torch.equal(a, b), "runs differ"
    for outs, ref in _replays(k, x, w, bias, seeds=(150, 151)):
        _close(outs[1], ref.abs().amax(), tol=1e-5)
        _close(outs[2], torch.sqrt((ref * ref).mean() + 1e-5))
    torch.cuda.synchronize()
    finish_pools = [t for key, t in stream_buffers._COUNTERS.items() if key[2] == "finish"]
    assert finish_pools and all(int(t.abs().sum()) == 0 for t in finish_pools)


def test_batched_over_everything(cache):
    x, w, bias = _problem(300, 704, 128, seed=16, batches=4)
    k = _compile(over_everything, x, w, cache, operands={"bias": bias, "eps": 1e-5})
    _, amax, rms, _ = k(x, w.transpose(-1, -2), bias=bias, eps=1e-5)
    ref = _acc(x, w) + bias.double()
    _close(amax, ref.abs().amax(), tol=1e-5)
    _close(rms, torch.sqrt((ref * ref).mean() + 1e-5))


def test_rows_batches_and_everything_in_one_kernel(cache):
    """Three finishes in one kernel, each with its own counters: per row, per batch, over
    everything."""
    x, w, _ = _problem(500, 1000, 256, seed=17, batches=3)
    k = _compile(rows_batches_everything, x, w, cache)
    assert sorted(axis for axis, _ in k.plan.kernel_finish) == ["all", "batch", "row"]
    acc = _acc(x, w)
    for _ in range(2):
        _, per_batch_sum, row_max, total = k(x, w.transpose(-1, -2))
        _close(per_batch_sum, acc.sum((-2, -1)))
        _close(row_max, acc.amax(-1), tol=1e-5)
        _close(total, acc.sum())


def extrema_of_everything(acc, C):
    y = acc + C
    return y.amax(-1), y.amin(-2), y.abs().amax(), y.amin(), y.amax((-2, -1))


@pytest.mark.parametrize("knobs", [{}, {"schedule": "cooperative"}, {"split_k": True}],
                         ids=["default", "cooperative", "split-k"])
def test_maxima_and_minima_propagate_nan_as_torch_does(cache, knobs):
    """A NaN in the tile makes its row's amax, its column's amin and every maximum and minimum over
    everything NaN, as torch.amax/amin give (the hardware's plain max drops a NaN for the other
    operand); rows and columns without one stay finite and exact."""
    x, w, _ = _problem(1000 + 3, 3000 + 8, 512, seed=23)
    C = torch.randn(x.shape[0], w.shape[0], device="cuda")
    C[5, 7] = C[700, 2999] = C[1002, 1500] = float("nan")
    k = _compile(extrema_of_everything, x, w, cache, operands={"C": C}, config=knobs or None)
    if knobs.get("split_k"):
        k.pin_splits(3)
    got = k(x, w.t(), C=C)
    assert k.last_path == "kernel"
    want = extrema_of_everything(_acc(x, w), C.double())
    for i, (g, r) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g.isnan(), r.isnan()), f"output {i}: {g.isnan().sum()} NaN, not {r.isnan().sum()}"
        _close(g[~g.isnan()], r[~r.isnan()])
