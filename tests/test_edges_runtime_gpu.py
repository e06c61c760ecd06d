"""Edge cases of the call at run time (first written as an adversarial probe): non-default
streams (with the staged path and host-finished reductions), CUDA graph capture and replay with
new contents (staged inputs, reductions, out=), runtime scalars changed between calls, one kernel
over many M in a row."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from edges_util import F16, F32, PINNED, check, close, randn, ref64

import evtc


def _busy(stream, seconds_hint=2000):
    """Queue a long kernel on `stream` so that later work on it runs late."""
    with torch.cuda.stream(stream):
        x = torch.randn(2048, 2048, device="cuda")
        for _ in range(seconds_hint // 100):
            x = x @ x
            x = x / x.norm()
    return x


@pytest.mark.gpu
def test_side_stream_staged_inputs_produced_on_that_stream(cache):
    """Inputs written on a side stream just before the call (no sync), one of them a strided view
    (staged copy): the call on that stream must see the new values (its copies and launch ordered on
    the current stream)."""

    def f(acc, C, bias):
        return acc + C * bias

    m, n, k = 256, 512, 128
    kern = evtc.compile(f, dict(a=randn(64, 64), b=randn(64, 64), C=randn(64, 64), bias=randn(64)),
                        cache_dir=cache, config=PINNED)
    a_src, b, Cbig, bias = randn(m, k), randn(k, n), randn(m, 2 * n), randn(n)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    _busy(s)
    with torch.cuda.stream(s):
        a = torch.empty_like(a_src).copy_(a_src * 2)   # written on s, late
        C = Cbig.mul(3)[:, ::2]                          # strided: staged
        got = kern(a, b, C=C, bias=bias)
        assert kern.last_path == "staged"
    s.synchronize()
    check(got, f, a_src * 2, b, C=Cbig[:, ::2] * 3, bias=bias, what="side stream staged")


@pytest.mark.gpu
def test_side_stream_host_finished_reductions(cache):
    """A reduction past the kernel-finish limit (finished on the host with torch ops) called on a
    side stream right after its inputs were made there: the finish must run on that stream."""

    def f(acc, bias):
        y = acc + bias
        return y.amax(-1), y.sum()

    m, n, k = 4608, 4096, 64
    kern = evtc.compile(f, dict(a=randn(64, 64), b=randn(64, 64), bias=randn(64, dtype=F32)), cache_dir=cache,
                        config=PINNED)
    a0, b, bias = randn(m, k, scale=0.1), randn(k, n, scale=0.1), randn(n, dtype=F32) + 1
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    _busy(s)
    with torch.cuda.stream(s):
        a = a0.clone()
        got = kern(a, b, bias=bias)
        a.zero_()  # after the call, on the same stream: must not change the result
    s.synchronize()
    check(got, f, a0, b, bias=bias, what="host finish on side stream")


@pytest.mark.gpu
def test_cuda_graph_replay_with_staged_inputs_and_new_contents(cache):
    """Capture a call whose C is a transposed view (staged) and whose scalar is a Python float;
    replays after changing a, b and C in place give the new values (scalar fixed at capture)."""

    def f(acc, C, alpha: float):
        return F.relu(acc * alpha + C)

    m, n, k = 192, 256, 64
    kern = evtc.compile(f, dict(a=randn(64, 64), b=randn(64, 64), C=randn(64, 64), alpha=1.0),
                        cache_dir=cache,
                        config=PINNED)
    a, b, Ct = randn(m, k), randn(k, n), randn(n, m)
    kern(a, b, C=Ct.t(), alpha=0.5)  # warm-up (eager)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g):
            out = kern(a, b, C=Ct.t(), alpha=0.5)
    torch.cuda.current_stream().wait_stream(s)
    for i in range(3):
        a.copy_(randn(m, k))
        b.copy_(randn(k, n))
        Ct.copy_(randn(n, m))
        g.replay()
        torch.cuda.synchronize()
        check(out, f, a, b, C=Ct.t(), alpha=0.5, what=f"replay {i}")


@pytest.mark.gpu
def test_cuda_graph_replay_reductions_and_out(cache):
    """Capture a call with a kernel-finished row reduction and a total, into out= tensors; replays
    with new a give the new reductions (counters reset every replay)."""

    def f(acc, bias):
        y = torch.tanh(acc + bias)
        return y, (y * y).sum(-1), y.abs().amax()

    m, n, k = 384, 640, 64
    kern = evtc.compile(f, dict(a=randn(64, 64), b=randn(64, 64), bias=randn(64)), cache_dir=cache,
                        config=PINNED)
    a, b, bias = randn(m, k), randn(k, n), randn(n)
    outs = (torch.empty(m, n, device="cuda", dtype=F16), torch.empty(m, device="cuda", dtype=F16),
            torch.empty((), device="cuda", dtype=F16))
    kern(a, b, bias=bias, out=outs)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g):
            kern(a, b, bias=bias, out=outs)
    torch.cuda.current_stream().wait_stream(s)
    for i in range(4):
        a.copy_(randn(m, k, scale=0.3 * (i + 1)))
        g.replay()
        torch.cuda.synchronize()
        check(outs, f, a, b, bias=bias, what=f"replay {i}")


@pytest.mark.gpu
def test_runtime_scalars_of_every_python_kind(cache):
    """Runtime scalars changed between calls: float, int, bool-free numpy float32/float64/int64, a
    negative zero, a huge number (inf in float32), left out with its default; values as torch."""

    def f(acc, C, alpha: float, beta: float = 2.0):
        return alpha * acc + beta * C

    m, n, k = 128, 128, 64
    a, b, C = randn(m, k), randn(k, n), randn(m, n)
    kern = evtc.compile(f, dict(a=a, b=b, C=C, alpha=1.0, beta=2.0), cache_dir=cache, config=PINNED)
    for alpha, beta in ((0.5, -1.0), (3, 0), (np.float32(1.25), np.float64(-0.5)), (np.int64(2), 1.0),
                        (-0.0, 1.0)):
        check(kern(a, b, C=C, alpha=alpha, beta=beta), f, a, b, C=C, alpha=float(alpha), beta=float(beta),
              what=f"alpha={alpha!r} beta={beta!r}")
    check(kern(a, b, C=C, alpha=0.25), f, a, b, C=C, alpha=0.25, what="default beta")
    check(kern(a, b, C, 0.25, 1.5), f, a, b, C=C, alpha=0.25, beta=1.5, what="positional")
    got = kern(a, b, C=C, alpha=1e39, beta=0.0)  # alpha is inf in float32 (and in torch's f16 op)
    want = torch_ref = f((a @ b), C, alpha=1e39, beta=0.0)
    assert torch.equal(torch.isinf(got), torch.isinf(torch_ref)), "inf pattern of a huge scalar"
    del want


@pytest.mark.gpu
def test_one_kernel_many_m_in_a_row_default_config(cache):
    """A default-config kernel with a row reduction and a tile output called at M = 1, 65, 128,
    513, then 3: every result right (launch memo, a_rows trimming, split-K, kernel
    finish counters all reused across sizes)."""

    def f(acc, bias):
        y = F.silu(acc + bias)
        return y, y.float().pow(2).mean(-1)

    n, k = 1024, 2048
    kern = evtc.compile(f, dict(a=randn(128, 64), b=randn(64, 128), bias=randn(128)), cache_dir=cache)
    b, bias = randn(k, n, scale=0.05), randn(n)
    for m in (1, 65, 128, 513, 3):
        a = randn(m, k, scale=0.5)
        check(kern(a, b, bias=bias), f, a, b, bias=bias, what=f"M={m}")


@pytest.mark.gpu
def test_cpu_operands_beside_cuda_and_0d_cpu_scalar(cache):
    """A 0-dim CPU tensor operand beside CUDA a and b is a scalar (as torch): right value; a
    one-element 1-d CPU tensor is refused or right (never silently wrong)."""

    def f(acc, s):
        return acc * s

    m, n, k = 64, 64, 64
    a, b = randn(m, k), randn(k, n)
    kern = evtc.compile(f, dict(a=a, b=b, s=torch.tensor(1.0, device="cuda")), cache_dir=cache, config=PINNED)
    s = torch.tensor(0.75)
    check(kern(a, b, s=s), f, a, b, s=s.cuda(), what="0-d cpu scalar")
    try:
        got = kern(a, b, s=torch.tensor([0.75]))
    except evtc.CallError:
        return
    close(got, ref64(f, a, b, s=torch.tensor(0.75, device="cuda")), F16, "(1,) cpu scalar")
