"""GPU: float32 a and b through the SM90 kernel's tf32 wgmma, against float64 references.

The tf32 wgmma reads each float32 operand from shared memory and keeps its top 19 bits (round
toward zero to tf32); its sums then differ from float64 by about 1e-5 of the result (measured
5e-6 to 1.2e-5 at K = 2048 to 4096). So the sharp reference is float64 arithmetic on a and b
truncated to tf32 (SHARP: 20 times tighter than the truncation's own error), and the loose one
float64 on a and b as given. cuBLAS's tf32 matmul rounds its operands to nearest instead: its
error is about a third of the kernel's (2.9e-4 against 8.3e-4 at K = 4096), which the loose bound
allows and docs/fp8.md states.
The kernel runs only where torch allows tf32 for float32 matmuls; elsewhere a call is computed in
full float32 on the torch path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from epilogue_cases import tf32_truncated

import evtc

pytestmark = pytest.mark.gpu

SHAPES = [(256, 384, 512), (1, 4096, 4096), (64, 1024, 8192), (2048, 2048, 2048), (200, 1000, 1040),
          (4096, 1536, 640), (333, 520, 100)]


@pytest.fixture
def tf32_on():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


SHARP = 4e-5  # largest relative error against the truncated operands' float64 product


truncated = tf32_truncated  # what the tf32 wgmma multiplies


def _inputs(m, n, k, seed=0, batches=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    lead = (batches,) if batches else ()
    a = torch.randn(*lead, m, k, device="cuda", generator=g)
    w = torch.randn(*lead, n, k, device="cuda", generator=g)
    return a, w.transpose(-1, -2)  # b (K, N), K-major


def _rel(got, ref):
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


def identity(acc):
    return acc


def relu_residual_bias(acc, C, bias):
    return torch.relu(acc + C + bias)


def swiglu(acc):
    gate, up = acc.chunk(2, dim=-1)
    return F.silu(gate) * up


def to_bf16_and_row_sum(acc, bias):
    y = acc + bias
    return y.to(torch.bfloat16), y.sum(dim=-1)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_identity_is_the_product_of_truncated_operands(tmp_path, tf32_on, shape):
    m, n, k = shape
    a, b = _inputs(m, n, k, seed=m + n)
    kernel = evtc.compile(identity, {"a": a, "b": b}, cache_dir=tmp_path)
    got = kernel(a, b)
    assert kernel.last_path == "kernel"
    assert got.dtype == torch.float32 and got.shape == (m, n)
    sharp = truncated(a).double() @ truncated(b).double()
    assert _rel(got, sharp) < SHARP, _rel(got, sharp)
    exact = a.double() @ b.double()
    theirs = a @ b  # torch's tf32 matmul (cuBLAS rounds the operands to nearest)
    if _rel(theirs, exact) > 1e-5:  # one row: cuBLAS runs a float32 GEMV, no tf32
        assert _rel(got, exact) <= 4 * _rel(theirs, exact), (_rel(got, exact), _rel(theirs, exact))
    assert _rel(got, exact) < 2e-3


@pytest.mark.parametrize("shape", [(256, 384, 512), (1, 4096, 4096), (200, 1000, 1040), (2048, 2048, 2048)],
                         ids=lambda s: "x".join(map(str, s)))
def test_fused_epilogue_with_float32_operands(tmp_path, tf32_on, shape):
    m, n, k = shape
    a, b = _inputs(m, n, k, seed=3)
    C = torch.randn(m, n, device="cuda")
    bias = torch.randn(n, device="cuda")
    kernel = evtc.compile(relu_residual_bias, {"a": a, "b": b, "C": C, "bias": bias}, cache_dir=tmp_path)
    got = kernel(a, b, C=C, bias=bias)
    assert kernel.last_path == "kernel"
    ref = torch.relu(truncated(a).double() @ truncated(b).double() + C.double() + bias.double())
    assert _rel(got, ref) < SHARP, _rel(got, ref)


def test_gated_batched_and_reductions(tmp_path, tf32_on):
    a, b = _inputs(300, 2 * 768, 1024, seed=5)
    kernel = evtc.compile(swiglu, {"a": a, "b": b}, cache_dir=tmp_path)
    got = kernel(a, b)
    assert kernel.last_path == "kernel"
    acc = truncated(a).double() @ truncated(b).double()
    gate, up = acc.chunk(2, dim=-1)
    assert _rel(got, F.silu(gate) * up) < SHARP

    a, b = _inputs(130, 520, 768, seed=6, batches=3)
    bias = torch.randn(520, device="cuda")
    kernel = evtc.compile(to_bf16_and_row_sum, {"a": a, "b": b, "bias": bias}, cache_dir=tmp_path)
    y, s = kernel(a, b, bias=bias)
    assert kernel.last_path == "kernel"
    ref = truncated(a).double() @ truncated(b).double() + bias.double()
    assert y.dtype == torch.bfloat16 and _rel(y, ref) < 8e-3
    assert _rel(s, ref.sum(-1)) < SHARP


def test_other_layouts_are_staged_and_without_tf32_calls_are_full_float32(tmp_path, tf32_on):
    m, n, k = 96, 640, 2048
    a, b = _inputs(m, n, k, seed=9)
    kernel = evtc.compile(identity, {"a": a, "b": b}, cache_dir=tmp_path)
    sharp = truncated(a).double() @ truncated(b).double()
    # A row-major b (N innermost) and an unaligned a: aligned K-major copies, the inputs untouched.
    b_rows = b.contiguous()
    a_odd = torch.randn(m, k + 1, device="cuda")[:, 1:]
    a_odd.copy_(a)
    keep = (b_rows.clone(), a_odd.clone())
    got = kernel(a_odd, b_rows)
    assert kernel.last_path == "staged"
    assert _rel(got, sharp) < SHARP
    assert torch.equal(b_rows, keep[0]) and torch.equal(a_odd, keep[1])
    # torch's default: no tf32 for float32 matmuls. The call is then computed in float32 by torch.
    torch.backends.cuda.matmul.allow_tf32 = False
    got = kernel(a, b)
    assert kernel.last_path == "torch"
    exact = a.double() @ b.double()
    assert _rel(got, exact) < 1e-5, _rel(got, exact)
    strict = evtc.compile(identity, {"a": a, "b": b}, cache_dir=tmp_path, strict=True)
    with pytest.raises(evtc.CallError, match="allow_tf32"):
        strict(a, b)
    torch.backends.cuda.matmul.allow_tf32 = True
    assert _rel(strict(a, b), sharp) < SHARP and strict.last_path == "kernel"


def test_examples_that_are_not_k_major_keep_the_torch_path(tmp_path, tf32_on):
    a, b = _inputs(128, 256, 512, seed=11)
    kernel = evtc.compile(identity, {"a": a, "b": b.contiguous()}, cache_dir=tmp_path)
    got = kernel(a, b.contiguous())
    assert kernel.last_path == "torch"
    assert "K-major" in kernel.source
    theirs = a @ b
    assert _rel(got, theirs.double()) < 1e-6


def test_under_torch_compile_and_cuda_graphs(tmp_path, tf32_on):
    a, b = _inputs(64, 1024, 8192, seed=12)
    bias = torch.randn(1024, device="cuda")

    def bias_gelu(acc, bias):
        return F.gelu(acc + bias)

    kernel = evtc.compile(bias_gelu, {"a": a, "b": b, "bias": bias}, cache_dir=tmp_path)
    ref = F.gelu(truncated(a).double() @ truncated(b).double() + bias.double())
    compiled = torch.compile(lambda a, b, bias: kernel(a, b, bias=bias), fullgraph=True)
    assert _rel(compiled(a, b, bias), ref) < SHARP
    kernel(a, b, bias=bias)  # an eager call first, as before any capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernel(a, b, bias=bias)
    a2, b2 = _inputs(64, 1024, 8192, seed=13)
    a.copy_(a2)
    b.copy_(b2)
    graph.replay()
    ref2 = F.gelu(truncated(a2).double() @ truncated(b2).double() + bias.double())
    assert _rel(out, ref2) < SHARP


@pytest.mark.parametrize("knobs", [
    {"schedule": "cooperative", "tile_n": n} for n in (64, 128, 160, 192, 256)
] + [{"schedule": "pingpong", "tile_m": 64, "tile_n": n} for n in (64, 128, 256)]
  + [{"schedule": "pingpong", "tile_m": 128, "tile_n": 128}],
    ids=lambda k: f"{k['schedule']}-{k.get('tile_m', 128)}x{k['tile_n']}")
def test_every_tile_of_the_family(tmp_path, tf32_on, knobs):
    """Each tile a float32 kernel may pick (tile_n a multiple of 32), in a 2-CTA cluster, at a ragged
    size: the truncated operands' product."""
    m, n, k = 300, 1000, 1000
    a, b = _inputs(m, n, k, seed=20)
    C = torch.randn(m, n, device="cuda")
    bias = torch.randn(n, device="cuda")
    kernel = evtc.compile(relu_residual_bias, {"a": a, "b": b, "C": C, "bias": bias}, cache_dir=tmp_path,
                          config={**knobs, "cluster": (2, 1)})
    got = kernel(a, b, C=C, bias=bias)
    assert kernel.last_path == "kernel"
    ref = torch.relu(truncated(a).double() @ truncated(b).double() + C.double() + bias.double())
    assert _rel(got, ref) < SHARP, _rel(got, ref)


def bias_gelu(acc, bias):
    return F.gelu(acc + bias)


def test_float32_linear_and_module_train_through_the_tf32_kernel(tmp_path, tf32_on):
    """evtc.linear and FusedLinear with float32 parameters and no autocast: the forward is the tf32
    kernel, the backward (torch's GEMMs, in tf32 too) matches autograd of the same function by norm;
    with tf32 off the forward is full float32."""
    g = torch.Generator(device="cuda").manual_seed(30)
    x = torch.randn(4, 96, 512, device="cuda", generator=g).requires_grad_()
    w = (torch.randn(768, 512, device="cuda", generator=g) * 512 ** -0.5).requires_grad_()
    bias = torch.randn(768, device="cuda", generator=g).requires_grad_()
    lin = evtc.linear(bias_gelu, {"x": x, "weight": w, "bias": bias}, cache_dir=tmp_path)
    y = lin(x, w, bias=bias)
    ref = F.gelu(truncated(x.detach()).double() @ truncated(w.detach()).double().t() + bias.detach().double())
    assert y.dtype == torch.float32 and _rel(y, ref) < SHARP, _rel(y, ref)
    dy = torch.randn(y.shape, device="cuda", generator=g)
    mine = torch.autograd.grad(y, (x, w, bias), dy)
    xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, bias))
    want = torch.autograd.grad(F.gelu(xd @ wd.t() + bd), (xd, wd, bd), dy.double())
    for name, a, b in zip(("x", "weight", "bias"), mine, want, strict=True):
        err = ((a.double() - b).norm() / b.norm()).item()
        assert a.dtype == torch.float32 and err < 3e-3, (name, err)

    layer = evtc.nn.FusedLinear(512, 768, bias_gelu, device="cuda", dtype=torch.float32, cache_dir=tmp_path)
    out = layer(x)
    ref = F.gelu(truncated(x.detach()).double() @ truncated(layer.weight.detach()).double().t()
                 + layer.bias.detach().double())
    assert _rel(out, ref) < SHARP
    out.sum().backward()
    assert layer.weight.grad is not None and torch.isfinite(layer.weight.grad).all()
    torch.backends.cuda.matmul.allow_tf32 = False
    with torch.no_grad():
        full = layer(x)
    exact = F.gelu(x.detach().double() @ layer.weight.detach().double().t() + layer.bias.detach().double())
    assert _rel(full, exact) < 1e-5, _rel(full, exact)
