"""GPU: split-K (K cut into runtime-chosen splits, combined in a fixed order, the epilogue run once)
against torch in float64, for plain, loading, reducing and gated epilogues under both schedules,
with ragged sizes, more splits than K tiles, bit-for-bit determinism, CUDA graphs and the
automatic choice for small M.

Then the split tail: problems of more than one wave, where only the tail is split. The same
epilogues and batches under both schedules and every multi-CTA cluster shape, with the partials
workspace poisoned with NaN first, bit-for-bit repeatable, and chosen by itself where the last round
is thin."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import evtc
from evtc.plan.split_k import cta_tile_grid, whole_cluster_tiles
from evtc.runtime import device, stream_buffers

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


def _inputs(m, n, k, seed, dtype=torch.bfloat16, gated=False, batches=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    lead = () if batches is None else (batches,)
    x = (torch.randn(*lead, m, k, device="cuda", generator=g) * k ** -0.25).to(dtype)
    rows = (2 if gated else 1) * n
    w = (torch.randn(*lead, rows, k, device="cuda", generator=g) * k ** -0.25).to(dtype)
    C = torch.randn(*lead, m, n, device="cuda", generator=g).to(dtype)
    bias = torch.randn(n, device="cuda", generator=g)
    return x, w, C, bias


def _close(out, ref, tol=2e-2):
    err = ((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
    assert err < tol, f"max error {err:.3g} relative to the largest value"


SCHEDULES = ["pingpong", "cooperative"]
# (M, N, K): ragged M and N, K not a multiple of the 64-wide K tile, and K with fewer tiles than
# the pinned splits (the launch then takes one split per K tile).
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


@pytest.mark.parametrize("m,n,kk,knobs,splits", [
    (32, 768, 8192, {}, 6),
    # More than one wave of 64 x 64 tiles: only the tail is split.
    (640, 1800, 4096, {"schedule": "pingpong", "tile_m": 64, "tile_n": 64, "cluster": (1, 2)}, 4),
], ids=["one-wave", "tail"])
def test_deterministic_and_counters_reset(cache, m, n, kk, knobs, splits):
    """Same inputs, same bits, run after run: the partials are added in split order, and the
    counters go back to zero after every launch (else the next launch would not wait)."""
    x, w, _, _ = _inputs(m, n, kk, seed=5)
    k = evtc.compile(identity, {"a": x, "b": w.t()}, config={"split_k": True, **knobs}, cache_dir=cache,
                     strict=True)
    k.pin_splits(splits)
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


def test_captured_launches_use_arena_counters_and_replay_without_a_memset(cache):
    """A captured split launch takes its counters from the arena zeroed before the capture, so the
    graph holds no memset: replays of two graphs of the same kernel, interleaved with eager calls,
    are each right, and every slice is back at zero after them. With the arena used up, a capture
    falls back to counters zeroed inside the graph, and is right too."""
    x, w, _, _ = _inputs(64, 1024, 4096, seed=8)
    k = evtc.compile(identity, {"a": x, "b": w.t()}, config={"split_k": True}, cache_dir=cache, strict=True)
    k.pin_splits(4)
    k(x, w.t())  # warm-up outside the capture makes the arena
    arena = stream_buffers._ARENAS[torch.cuda.current_device()]
    graphs, outs = [], []
    for _ in range(2):
        before = arena[1]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs.append(k(x, w.t()))
        assert arena[1] > before, "the captured launch did not take counters from the arena"
        graphs.append(graph)
    for seed in range(3):
        x.copy_(_inputs(64, 1024, 4096, seed=200 + seed)[0])
        ref = x.double() @ w.double().t()
        for graph, out in zip(graphs, outs, strict=True):
            out.fill_(float("nan"))
            graph.replay()
            _close(k(x, w.t()), ref)
            torch.cuda.synchronize()
            _close(out, ref)
    assert not arena[0][:arena[1]].any(), "a replay left a counter nonzero"

    used, arena[1] = arena[1], arena[0].numel()  # used up
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = k(x, w.t())
    finally:
        arena[1] = used
    for _ in range(2):
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
    """Without knobs, a decode-sized problem with few tiles and a long K runs split (and matches
    float64); a large one does not split."""
    x, w, C, bias = _inputs(64, 1024, 8192, seed=7)
    examples = {"a": x, "b": w.t(), "C": C, "bias": bias}
    k = evtc.compile(residual_relu, examples, cache_dir=cache, strict=True)
    assert k.splits_for(64, 1024, 8192) > 1
    assert k.splits_for(8192, 8192, 8192) == 1
    _close(k(x, w.t(), C=C, bias=bias),
           torch.relu(x.double() @ w.double().t() + C.double() + bias.double()))


@pytest.mark.parametrize("m", [1, 16])
def test_the_gpus_memory_rate_decides_the_split_and_the_result_holds(cache, m):
    """A 3584 x 18944 weight at decode sizes splits K on the H200 (its memory rate in the split
    model, evtc.runtime.device.hbm_bytes_per_us) and not on the H100; the fused result matches
    float64 either way."""
    from evtc.plan.split_k import H200_HBM_BYTES_PER_US

    x, w, C, bias = _inputs(m, 3584, 18944, seed=11 + m)
    examples = {"a": x, "b": w.t(), "C": C, "bias": bias}
    k = evtc.compile(residual_relu, examples, cache_dir=cache, strict=True)
    h200 = device.hbm_bytes_per_us() == H200_HBM_BYTES_PER_US
    assert h200 == ("H200" in torch.cuda.get_device_name())
    assert (k.splits_for(m, 3584, 18944) > 1) == h200
    _close(k(x, w.t(), C=C, bias=bias),
           torch.relu(x.double() @ w.double().t() + C.double() + bias.double()))


# ---- split tail: problems of more than one wave, where only the tiles past the last whole round
# are split (evtc.plan.split_k) -----------------------------------------------------------------


def _meta(m, n, k, **extra):
    ex = {"a": torch.empty(m, k, dtype=torch.bfloat16, device="meta"),
          "b": torch.empty(n, k, dtype=torch.bfloat16, device="meta").t()}
    for name, shape in extra.items():
        ex[name] = torch.empty(*shape, dtype=torch.float32 if name == "bias" else torch.bfloat16,
                               device="meta")
    return ex


def _poison_partials():
    """Fill the kept partials buffers and the allocator's free blocks with NaN, so a partial read
    before it is written shows."""
    for buffer in stream_buffers._PARTIALS.values():
        buffer.fill_(float("nan"))
    junk = torch.full((64 << 20,), float("nan"), device="cuda")
    del junk


def _has_tail(kernel, m, n, batches=1):
    """The problem runs more than one round of cluster tiles and a part-filled last one."""
    config, _ = kernel.launch_for(m, n, 64, batches)
    cl = config.cluster
    tiles = cta_tile_grid(m, n, batches, config, cl) // (cl[0] * cl[1])
    clusters = device.max_active_clusters(cl[0] * cl[1], kernel._cache.root)
    return tiles > clusters and whole_cluster_tiles(tiles, clusters) < tiles


# 64 x 64 tiles keep the problems small while still running several rounds on 132 SMs.
TAIL_CONFIGS = [
    {"schedule": "pingpong", "tile_m": 64, "tile_n": 64, "cluster": (1, 2)},
    {"schedule": "pingpong", "tile_m": 64, "tile_n": 64, "cluster": (2, 1)},
    {"schedule": "pingpong", "tile_m": 64, "tile_n": 64, "cluster": (1, 4)},
    {"schedule": "cooperative", "tile_m": 128, "tile_n": 64, "cluster": (1, 2)},
    {"schedule": "cooperative", "tile_m": 128, "tile_n": 64, "cluster": (2, 1)},
]
# (M, N, K): ragged M and N (the last cluster ragged too), K not a multiple of 64.
TAIL_SHAPES = [(640, 1800, 1000), (1100, 1536, 2048)]


def _name(c):
    return f"{c['schedule']}-{c['tile_m']}-c{c['cluster'][0]}x{c['cluster'][1]}"


@pytest.mark.parametrize("cfg", TAIL_CONFIGS, ids=_name)
def test_identity_and_loads(cache, cfg):
    config = {"split_k": True, **cfg}
    plain = evtc.compile(identity, _meta(64, 64, 64), config=config, cache_dir=cache, strict=True)
    fused = evtc.compile(residual_relu, _meta(64, 64, 64, C=(64, 64), bias=(64,)), config=config,
                         cache_dir=cache, strict=True)
    for i, (m, n, kk) in enumerate(TAIL_SHAPES):
        assert _has_tail(plain, m, n), (m, n, cfg)
        x, w, C, bias = _inputs(m, n, kk, seed=i)
        acc = x.double() @ w.double().t()
        for splits in (2, 3, 4):
            plain.pin_splits(splits)
            fused.pin_splits(splits)
            _poison_partials()
            _close(plain(x, w.t()), acc)
            _close(fused(x, w.t(), C=C, bias=bias), torch.relu(acc + C.double() + bias.double()))


@pytest.mark.parametrize("schedule", ["pingpong", "cooperative"])
def test_reductions_gated_and_batches(cache, schedule):
    config = {"split_k": True, "schedule": schedule, "tile_m": 64 if schedule == "pingpong" else 128,
              "tile_n": 64}
    sums = evtc.compile(with_row_sums, _meta(64, 64, 64, bias=(64,)), config=config, cache_dir=cache,
                        strict=True)
    m, n, kk = TAIL_SHAPES[0]
    x, w, _, bias = _inputs(m, n, kk, seed=5)
    acc = x.double() @ w.double().t()
    for splits in (2, 4):
        sums.pin_splits(splits)
        y, s = sums(x, w.t(), bias=bias)
        _close(y, acc + bias.double())
        _close(s, (acc + bias.double()).sum(-1))

    gated = evtc.compile(swiglu, {"a": torch.empty(64, 64, dtype=torch.bfloat16, device="meta"),
                                  "b": torch.empty(128, 64, dtype=torch.bfloat16, device="meta").t()},
                         config=config, cache_dir=cache, strict=True)
    x, w, _, _ = _inputs(m, n, kk, seed=6, gated=True)
    gate, up = (x.double() @ w.double().t()).chunk(2, dim=-1)
    for splits in (2, 3):
        gated.pin_splits(splits)
        _close(gated(x, w.t()), F.silu(gate) * up)

    bex = {"a": torch.empty(2, 64, 64, dtype=torch.bfloat16, device="meta"),
           "b": torch.empty(2, 64, 64, dtype=torch.bfloat16, device="meta").transpose(1, 2)}
    batched = evtc.compile(identity, bex, config=config, cache_dir=cache, strict=True)
    x, w, _, _ = _inputs(384, 1000, 1536, seed=7, batches=3)
    assert _has_tail(batched, 384, 1000, batches=3)
    for splits in (2, 4):
        batched.pin_splits(splits)
        _close(batched(x, w.transpose(1, 2)), x.double() @ w.double().transpose(1, 2))


def residual_relu_and_acc(acc, C, bias):
    return torch.relu(acc + C + bias), acc


def test_chosen_for_a_thin_last_round(cache):
    """Without knobs, 768 x 14336 x 8192 (336 cluster tiles of 128 x 128 on an H100's 66 clusters:
    five whole rounds and 6 tiles) splits its tail, and matches float64; 4096 x 4096 x 4096 (a
    fuller last round) does not. (Problems of at most 5 waves take a wave-fitted width instead, and
    a light epilogue a wide ping-pong tile whose rounds are whole: this one moves two tiles, its C
    and a second output.)"""
    x, w, C, bias = _inputs(768, 14336, 8192, seed=9)
    k = evtc.compile(residual_relu_and_acc, {"a": x, "b": w.t(), "C": C, "bias": bias}, cache_dir=cache,
                     strict=True)
    if torch.cuda.get_device_properties(0).multi_processor_count == 132:
        assert k.splits_for(768, 14336, 8192) > 1
        assert k.splits_for(4096, 4096, 4096) == 1
    acc = x.double() @ w.double().t()
    y, got_acc = k(x, w.t(), C=C, bias=bias)
    _close(y, torch.relu(acc + C.double() + bias.double()))
    _close(got_acc, acc)
