"""GPU: a compiled kernel inside torch.compile(fullgraph=True) and inside CUDA graph capture and
replay, against evtc.reference in float32 (outputs poisoned first where the test allocates them)."""

from __future__ import annotations

import pytest
import torch

import evtc

pytestmark = pytest.mark.gpu

TOL = 1e-2


def bias_relu_aux(acc, C, bias, alpha: float):
    # C's dtype: a float32 bias would make the sum float32, as torch promotes it.
    return torch.relu(alpha * acc + C + bias).to(C.dtype), acc * 2


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def inputs(m, n, k, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, dtype=torch.float16):
        return torch.randn(shape, device="cuda", generator=g).to(dtype)

    return dict(a=randn(m, k), b=randn(k, n), C=randn(m, n), bias=randn(n, dtype=torch.float32))


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    ex = inputs(256, 512, 128)
    return evtc.compile(bias_relu_aux, {**ex, "alpha": 1.0}, cache_dir=tmp_path_factory.mktemp("evtc-op"))


def check(got, x, alpha):
    ref = evtc.reference(bias_relu_aux, {**x, "alpha": alpha})
    for g, r in zip(got, ref, strict=True):
        err = rel_err(g, r)
        assert err <= TOL, err


def test_torch_compile_fullgraph_inductor(kernel):
    torch._dynamo.reset()

    def model(a, b, C, bias):
        y, z = kernel(a, b, C=C, bias=bias, alpha=1.5)
        return torch.relu(y) + z, y

    compiled = torch.compile(model, fullgraph=True)
    for m, n, k in [(300, 200, 64), (1000, 1040, 72)]:
        x = inputs(m, n, k, seed=m)
        out, y = compiled(x["a"], x["b"], x["C"], x["bias"])
        torch.cuda.synchronize()
        ref_y, ref_z = evtc.reference(bias_relu_aux, {**x, "alpha": 1.5})
        assert rel_err(y, ref_y) <= TOL
        assert rel_err(out, torch.relu(ref_y.half().float()) + ref_z.half().float()) <= TOL


def test_cuda_graph_capture_and_replay(kernel):
    x = inputs(600, 712, 264, seed=1)
    y_out = torch.full((600, 712), float("nan"), device="cuda", dtype=torch.float16)
    z_out = torch.full_like(y_out, float("nan"))
    kernel(x["a"], x["b"], C=x["C"], bias=x["bias"], alpha=0.5, out=(y_out, z_out))  # warm up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_new, z_new = kernel(x["a"], x["b"], C=x["C"], bias=x["bias"], alpha=0.5)
        kernel(x["a"], x["b"], C=x["C"], bias=x["bias"], alpha=0.5, out=(y_out, z_out))
    for seed in (2, 3):
        fresh = inputs(600, 712, 264, seed=seed)
        for name, t in fresh.items():
            x[name].copy_(t)
        y_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check((y_new, z_new), fresh, 0.5)
        check((y_out, z_out), fresh, 0.5)


def residual_gelu(acc, bias, residual):
    return (torch.nn.functional.gelu(acc + bias) + residual).to(residual.dtype)


def test_linear_matches_functional_linear(tmp_path):
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(4, 100, 64, device="cuda", generator=g).half()
    weight = torch.randn(96, 64, device="cuda", generator=g).half()   # nn.Linear layout
    bias = torch.randn(96, device="cuda", generator=g)
    residual = torch.randn(4, 100, 96, device="cuda", generator=g).half()
    lin = evtc.linear(residual_gelu, dict(x=x, weight=weight, bias=bias, residual=residual),
                      cache_dir=tmp_path)
    before = weight.clone()
    out = lin(x, weight, bias=bias, residual=residual)
    torch.cuda.synchronize()
    ref = torch.nn.functional.gelu(torch.nn.functional.linear(x.float(), weight.float()) + bias) \
        + residual.float()
    assert out.shape == (4, 100, 96) and rel_err(out, ref) <= TOL
    assert torch.equal(weight, before)
    # out= with the leading dims, and a 2-D x
    dest = torch.full((4, 100, 96), float("nan"), device="cuda", dtype=torch.float16)
    lin(x, weight, bias=bias, residual=residual, out=dest)
    torch.cuda.synchronize()
    assert rel_err(dest, ref) <= TOL
    flat = lin(x[0], weight, bias=bias, residual=residual[0])
    torch.cuda.synchronize()
    assert rel_err(flat, ref[0]) <= TOL


def stats(acc, C):
    y = acc + C
    return y, y.sum(-1), y.amax(-1), y.abs().amax(), C


def test_operator_outputs_never_share_storage(tmp_path):
    """Reductions the kernel finishes come from one allocation, and the torch path may hand back an
    operand as it is; as a custom operator's outputs they are fresh tensors (the compiler may reuse
    or update one buffer while another view of it lives), and inductor's graph gets every value."""
    x = inputs(300, 256, 64, seed=3)
    k = evtc.compile(stats, {"a": x["a"], "b": x["b"], "C": x["C"]}, cache_dir=tmp_path)
    outs = k.op(x["a"], x["b"], x["C"])
    ptrs = [t.untyped_storage().data_ptr() for t in outs]
    assert len(set(ptrs)) == len(ptrs) and x["C"].untyped_storage().data_ptr() not in ptrs
    ref = evtc.reference(stats, {"a": x["a"], "b": x["b"], "C": x["C"]})

    @torch.compile(fullgraph=True)
    def f(a, b, C):
        y, rows, peak, top, c = k(a, b, C=C)
        return y * 2, rows + 1, peak - 1, top * 3, c + 1

    got = f(x["a"], x["b"], x["C"])
    want = (ref[0] * 2, ref[1] + 1, ref[2] - 1, ref[3] * 3, ref[4] + 1)
    for g, w in zip(got, want, strict=True):
        assert rel_err(g, w) < TOL


def test_reduce_overhead_mode_replays_kernels_with_reductions(tmp_path):
    """torch.compile(mode="reduce-overhead") records the kernel's operator in CUDA graph trees:
    every replay, on new inputs, at a decode size that splits K and at one whose reductions the
    kernel finishes itself (counters and scratch kept per stream), matches the function."""
    x = inputs(64, 256, 8192, seed=5)
    k = evtc.compile(stats, {"a": x["a"], "b": x["b"], "C": x["C"]}, cache_dir=tmp_path)

    @torch.compile(mode="reduce-overhead", fullgraph=True)
    def f(a, b, C):
        y, rows, peak, top, c = k(a, b, C=C)
        return y + 0, rows * 1, peak, top, c

    for m, n, kk in ((64, 256, 8192), (64, 256, 8192), (512, 384, 256), (512, 384, 256), (64, 256, 8192)):
        for seed in range(3):
            x = inputs(m, n, kk, seed=10 * m + seed)
            got = f(x["a"], x["b"], x["C"])
            ref = evtc.reference(stats, {"a": x["a"], "b": x["b"], "C": x["C"]})
            for g, w in zip(got, ref, strict=True):
                assert rel_err(g, w) < TOL, (m, n, kk, seed)
    config, splits = k.launch_for(64, 256, 8192)
    assert splits > 1, (config, splits)  # the decode size really splits K
