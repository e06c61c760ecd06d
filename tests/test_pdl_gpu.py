"""GPU tests of programmatic dependent launch (PDL, ``config={"pdl": True}``): back-to-back kernels
must not see each other's memory early.

A PDL launch may start while the previous kernel of the stream is still running; the kernel waits
for it (``griddepcontrol.wait``) before it reads or writes global memory. These tests chain
launches with no synchronisation between them, where an early read (read after write) or an early
write (write after read) would change the result, and check every result against torch in float32
with the rounding of each step.
"""

from __future__ import annotations

import pytest
import torch

import evtc

pytestmark = pytest.mark.gpu

M, N = 64, 512


def scaled_plus_bias(acc, bias):
    return (acc * 0.5 + bias).to(acc.dtype)  # float16, as the chain's next input


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    ex = {"a": torch.empty(8, N, dtype=torch.float16, device="meta"),
          "b": torch.empty(N, N, dtype=torch.float16, device="meta").t(),
          "bias": torch.empty(N, dtype=torch.float32, device="meta")}
    return evtc.compile(scaled_plus_bias, ex, config={"pdl": True},
                        cache_dir=tmp_path_factory.mktemp("evtc-pdl"))


def _inputs(seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, N, device="cuda", generator=g).half()
    w = (torch.randn(N, N, device="cuda", generator=g) * N ** -0.5).half()
    bias = torch.randn(N, device="cuda", generator=g)
    return x, w, bias


def _step(x, w, bias):
    """One step as the kernel computes it: float32 accumulation, float16 output."""
    return (x.float() @ w.float().t() * 0.5 + bias).half()


def _close(got, want, what):
    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert rel <= 1e-2, f"{what}: relative error {rel:.3g}"


def test_every_launch_takes_pdl(kernel):
    """pdl is not a tile knob: the kernel still chooses its tile per call, each with PDL."""
    for m, k in ((M, N), (4096, 4096), (M, 16384)):
        config, _ = kernel.launch_for(m, N, k)
        assert config.pdl is True, config.short_name()
    assert len({kernel.launch_for(m, N, 4096)[0].tile_m for m in (16, 4096)}) == 2


def test_a_chain_reads_each_previous_output(kernel):
    """x_{i+1} = f(x_i @ w): each launch reads what the one before wrote (read after write)."""
    x, w, bias = _inputs(1)
    want = x
    for _ in range(12):
        want = _step(want, w, bias)
    for _ in range(3):  # a race need not show on the first try
        got = x
        for _ in range(12):
            got = kernel(got, w.t(), bias=bias)
        torch.cuda.synchronize()
        _close(got, want, "12 chained launches")


def test_a_launch_does_not_write_what_the_previous_one_still_reads(kernel):
    """The second launch writes into the first one's input (write after read)."""
    x, w, bias = _inputs(2)
    z, _, _ = _inputs(3)
    want_y, want_x = _step(x, w, bias), _step(z, w, bias)
    for _ in range(20):
        x_now = x.clone()
        y = kernel(x_now, w.t(), bias=bias)
        kernel(z, w.t(), bias=bias, out=x_now)
        torch.cuda.synchronize()
        _close(y, want_y, "first launch")
        _close(x_now, want_x, "second launch, written over the first's input")


def test_a_chain_in_a_cuda_graph(kernel):
    x, w, bias = _inputs(4)
    src = x.clone()  # the graph's input: refilled before each replay
    kernel(src, w.t(), bias=bias)  # warm up: loads the kernel outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h = src
        for _ in range(6):
            h = kernel(h, w.t(), bias=bias)
    for seed in range(3):
        fresh, _, _ = _inputs(10 + seed)
        src.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        expected = fresh
        for _ in range(6):
            expected = _step(expected, w, bias)
        _close(h, expected, f"graph replay {seed}")


def test_after_a_torch_kernel(kernel):
    """A torch kernel before the launch (no PDL of its own) must be finished first too."""
    x, w, bias = _inputs(5)
    for _ in range(10):
        x2 = x.clone()
        x2.mul_(2.0)
        got = kernel(x2, w.t(), bias=bias)
        torch.cuda.synchronize()
        _close(got, _step(x * 2.0, w, bias), "after mul_")
