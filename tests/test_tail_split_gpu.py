"""GPU: split-K on problems of more than one wave, where only the tail is split (the tiles past the
last whole round; see evtc.plan.split_k). Against torch in float64, for plain, loading, reducing,
gated and batched epilogues under both schedules and both 2-CTA cluster shapes, with the partials
workspace poisoned with NaN first, bit-for-bit repeatable, and chosen by itself where the last round
is thin."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import evtc
from evtc.plan.split_k import cta_tile_grid, whole_cluster_tiles
from evtc.runtime import device

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
    return str(tmp_path_factory.mktemp("evtc-tail-split"))


def _inputs(m, n, k, seed, batches=None, gated=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    lead = () if batches is None else (batches,)
    x = (torch.randn(*lead, m, k, device="cuda", generator=g) * k ** -0.25).to(torch.bfloat16)
    rows = (2 if gated else 1) * n
    w = (torch.randn(*lead, rows, k, device="cuda", generator=g) * k ** -0.25).to(torch.bfloat16)
    C = torch.randn(*lead, m, n, device="cuda", generator=g).to(torch.bfloat16)
    bias = torch.randn(n, device="cuda", generator=g)
    return x, w, C, bias


def _close(out, ref, tol=2e-2):
    err = ((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
    assert err < tol, f"max error {err:.3g} relative to the largest value"


def _meta(m, n, k, **extra):
    ex = {"a": torch.empty(m, k, dtype=torch.bfloat16, device="meta"),
          "b": torch.empty(n, k, dtype=torch.bfloat16, device="meta").t()}
    for name, shape in extra.items():
        ex[name] = torch.empty(*shape, dtype=torch.float32 if name == "bias" else torch.bfloat16,
                               device="meta")
    return ex


def _poison_partials():
    """Fill the allocator's free blocks with NaN so a partial read before it is written shows."""
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
CONFIGS = [
    {"schedule": "pingpong", "tile_m": 64, "tile_n": 64, "cluster": (1, 2)},
    {"schedule": "pingpong", "tile_m": 64, "tile_n": 64, "cluster": (2, 1)},
    {"schedule": "cooperative", "tile_m": 128, "tile_n": 64, "cluster": (1, 2)},
    {"schedule": "cooperative", "tile_m": 128, "tile_n": 64, "cluster": (2, 1)},
]
# (M, N, K): ragged M and N (the last cluster ragged too), K not a multiple of 64.
SHAPES = [(640, 1800, 1000), (1100, 1536, 2048)]


def _name(c):
    return f"{c['schedule']}-{c['tile_m']}-c{c['cluster'][0]}x{c['cluster'][1]}"


@pytest.mark.parametrize("cfg", CONFIGS, ids=_name)
def test_identity_and_loads(cache, cfg):
    config = {"split_k": True, **cfg}
    plain = evtc.compile(identity, _meta(64, 64, 64), config=config, cache_dir=cache, strict=True)
    fused = evtc.compile(residual_relu, _meta(64, 64, 64, C=(64, 64), bias=(64,)), config=config,
                         cache_dir=cache, strict=True)
    for i, (m, n, kk) in enumerate(SHAPES):
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
    m, n, kk = SHAPES[0]
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


def test_repeatable_bit_for_bit(cache):
    """The tail's partials are added in split order and its counters go back to zero: the same bits
    on every run."""
    k = evtc.compile(identity, _meta(64, 64, 64), config={"split_k": True, **CONFIGS[0]},
                     cache_dir=cache, strict=True)
    x, w, _, _ = _inputs(640, 1800, 4096, seed=8)
    k.pin_splits(4)
    first = k(x, w.t())
    for _ in range(10):
        assert torch.equal(k(x, w.t()), first)
    _close(first, x.double() @ w.double().t())


def test_chosen_for_a_thin_last_round(cache):
    """Without knobs, 512 x 10240 x 8192 (three rounds of 128 x 128 tiles, the last 42% full on an
    H100) splits its tail, and matches float64; 4096 x 4096 x 4096 (a fuller last round) does not."""
    x, w, C, bias = _inputs(512, 10240, 8192, seed=9)
    k = evtc.compile(residual_relu, {"a": x, "b": w.t(), "C": C, "bias": bias}, cache_dir=cache, strict=True)
    if torch.cuda.get_device_properties(0).multi_processor_count == 132:
        assert k.splits_for(512, 10240, 8192) == 2
        assert k.splits_for(4096, 4096, 4096) == 1
    _close(k(x, w.t(), C=C, bias=bias),
           torch.relu(x.double() @ w.double().t() + C.double() + bias.double()))
