"""A kernel's torch integration on the GPU: the real kernel's outputs against its fake implementation
(shape, dtype, device, strides on dims longer than 1), opcheck on CUDA tensors, inductor /
reduce-overhead (CUDA graphs) / autocast with evtc.nn modules, a CPU 0-dim scalar under
torch.compile. Every value is compared with torch's own result of the same function on the same
inputs (float64), or with the same kernel's eager call. First written as an adversarial probe of
the torch integration."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import evtc

pytestmark = pytest.mark.gpu
H = torch.float16


_SEEDS = itertools.count(1)


def R(*shape, dtype=H):
    """Random values of a seed of their own (the next one each call)."""
    torch.manual_seed(next(_SEEDS))
    return torch.randn(*shape, device="cuda").to(dtype)


def rel(got, want):
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def _as_tuple(x):
    if isinstance(x, dict):
        return tuple(x.values())
    return tuple(x) if isinstance(x, tuple | list) else (x,)


def _ref(fn, ex):
    acc = ex["a"].double() @ ex["b"].double()
    ops = {n: v.double() if isinstance(v, torch.Tensor) else v for n, v in ex.items() if n not in ("a", "b")}
    return _as_tuple(fn(acc, **ops))


def _stats(acc, C):
    y = acc + C
    return y, y.float().sum(-1), y.float().amax(0), y.float().abs().amax()


def _stats_kd(acc, C):
    y = acc + C
    return y, y.float().sum(-1, keepdim=True), y.float().sum(0, keepdim=True)


def _bstats(acc, C):
    y = acc + C
    return y, y.float().sum(-1), y.float().sum(-2, keepdim=True), y.float().mean((-2, -1))


def _dict(acc, bias):
    y = F.gelu(acc + bias)
    return {"m": y.float().amax(-1), "y": y.to(H), "z": (acc * 2).to(torch.bfloat16)}


def _swiglu(acc):
    g, u = acc.chunk(2, dim=-1)
    return F.silu(g) * u


def _residual(acc, C):
    return acc + C


CASES = {
    "stats": (_stats, lambda m, n, k: dict(a=R(m, k), b=R(k, n), C=R(m, n)), {}),
    "stats_kd": (_stats_kd, lambda m, n, k: dict(a=R(m, k), b=R(k, n), C=R(m, n)), {}),
    "bstats": (_bstats, lambda m, n, k: dict(a=R(3, m, k), b=R(3, k, n), C=R(3, m, n)), {}),
    "dict": (_dict, lambda m, n, k: dict(a=R(m, k), b=R(k, n), bias=R(n, dtype=torch.float32)), {}),
    # b scaled by 1/sqrt(K): silu(g) * u of two order-sqrt(K) halves passes float16's 65504 at K = 8192
    "swiglu": (_swiglu, lambda m, n, k: dict(a=R(m, k), b=(R(k, 2 * n).float() * k**-0.5).to(H)), {}),
    "d_major_m": (_residual, lambda m, n, k: dict(a=R(m, k), b=R(k, n), C=R(m, n)), {"d_major": "m"}),
    "coop_C_in_D": (_residual, lambda m, n, k: dict(a=R(m, k), b=R(k, n), C=R(m, n)),
                    {"schedule": "cooperative"}),
}
# a finished-in-kernel size, a decode split-K size, odd sizes that stage, M = 1
SIZES = [(300, 256, 64), (64, 256, 8192), (33, 200, 72), (1, 128, 64)]


@pytest.fixture(scope="module")
def kernels(cache):
    out = {}
    for name, (fn, make, config) in CASES.items():
        out[name] = evtc.compile(fn, make(256, 256, 64), config=config or None, cache_dir=cache)
    return out


def _check_meta(real, fake, what):
    assert tuple(real.shape) == tuple(fake.shape), (what, real.shape, fake.shape)
    assert real.dtype == fake.dtype and real.device == fake.device, (what, real.dtype, fake.dtype)
    for size, rs, fs in zip(real.shape, real.stride(), fake.stride(), strict=True):
        # a fake that says contiguous where the real output is strided: inductor reads it wrongly
        assert size <= 1 or rs == fs, (what, tuple(real.shape), real.stride(), fake.stride())


@pytest.mark.parametrize("case", list(CASES))
def test_real_outputs_match_fake_metadata_and_values(case, kernels):
    fn, make, _ = CASES[case]
    k = kernels[case]
    for m, n, kk in SIZES:
        ex = make(m, n, kk)
        args = [ex["a"], ex["b"], *[ex[x] for x in k.operand_names]]
        real = _as_tuple(k.op(*args))
        with FakeTensorMode() as mode:
            fake = _as_tuple(k.op(*[mode.from_tensor(t) for t in args]))
        want_struct = _as_tuple(k(*args[:2], **{x: ex[x] for x in k.operand_names}))
        assert len(real) == len(fake) == len(want_struct)
        for i, (r, f) in enumerate(zip(real, fake, strict=True)):
            _check_meta(r, f, (case, m, n, kk, i))
        # values: the eager structured call against torch in float64
        for i, (g, w) in enumerate(zip(want_struct, _ref(fn, ex), strict=True)):
            assert tuple(g.shape) == tuple(w.shape), (case, i)
            assert rel(g, w) < 2e-2, (case, m, n, kk, i)


@pytest.mark.parametrize("case", ["stats", "bstats", "dict", "swiglu", "d_major_m"])
def test_opcheck_on_cuda_tensors(case, kernels):
    fn, make, _ = CASES[case]
    k = kernels[case]
    ex = make(300, 256, 64)
    args = [ex["a"], ex["b"], *[ex[x] for x in k.operand_names]]
    # A gated kernel's eager backward runs the fused dZ kernel and the compiled one the reference:
    # their float16 gradients can differ by one rounding in an element (docs/training.md), which
    # opcheck's exact comparison of eager and AOT gradients reports; its forward is checked here.
    grads = case != "swiglu"
    args = [t.clone().requires_grad_(grads and t.dtype.is_floating_point) for t in args]
    result = torch.library.opcheck(k.op, args, test_utils=("test_schema", "test_faketensor",
                                                           "test_aot_dispatch_dynamic"))
    assert all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.parametrize("case", ["stats", "stats_kd", "bstats", "dict", "d_major_m"])
def test_inductor_reads_every_output_as_eager(case, kernels):
    """Each output consumed by inductor-generated code (a layout the fake got wrong is read with
    the fake's strides): compiled against the same kernel's eager call."""
    fn, make, _ = CASES[case]
    k = kernels[case]

    def model(a, b, *ops):
        outs = _as_tuple(k(a, b, **dict(zip(k.operand_names, ops, strict=True))))
        return tuple(o.float() * 2 + 1 for o in outs)

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    for m, n, kk in SIZES:
        ex = make(m, n, kk)
        ops = [ex[x] for x in k.operand_names]
        got = compiled(ex["a"], ex["b"], *ops)
        want = [2 * w + 1 for w in _ref(fn, ex)]
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert tuple(g.shape) == tuple(w.shape), (case, i)
            assert rel(g, w) < 2e-2, (case, m, n, kk, i)


def test_cpu_zero_dim_scalar_under_torch_compile(cache):
    """docs/compile.md: a 0-dim CPU tensor beside CUDA tensors is a scalar, as in torch."""
    def scaled(acc, s, C):
        return acc * s + C

    ex = dict(a=R(128, 64), b=R(64, 256), s=torch.tensor(0.5, device="cuda"), C=R(128, 256))
    k = evtc.compile(scaled, ex, cache_dir=cache)
    s = torch.tensor(0.25)  # CPU
    torch._dynamo.reset()
    got = torch.compile(lambda a, b, s, C: k(a, b, s=s, C=C), fullgraph=True)(ex["a"], ex["b"], s, ex["C"])
    want = (ex["a"].double() @ ex["b"].double()) * 0.25 + ex["C"].double()
    assert rel(got, want) < 1e-2


def _gelu_bias(acc, bias):
    return F.gelu(acc + bias)


def _res_stats(acc, bias, residual):
    y = F.silu(acc + bias) + residual
    return y, y.float().pow(2).mean(-1, keepdim=True)


@pytest.mark.parametrize("fn", [_gelu_bias, _res_stats])
@pytest.mark.parametrize("dynamic", [False, True])
def test_fused_linear_inductor_training_against_nn_linear(fn, dynamic, cache):
    torch.manual_seed(0)
    layer = evtc.nn.FusedLinear(256, 384, fn, dtype=torch.bfloat16, device="cuda", cache_dir=cache)
    ref = torch.nn.Linear(256, 384, dtype=torch.float64, device="cuda")
    ref.load_state_dict({"weight": layer.weight.detach().double(), "bias": layer.bias.detach().double()})
    ops = {"residual": None} if fn is _res_stats else {}

    def make(*lead):
        x = torch.randn(*lead, 256, device="cuda").bfloat16()
        return x, {n: torch.randn(*lead, 384, device="cuda").bfloat16() for n in ops}

    x, o = make(4, 96)
    layer(x.requires_grad_(), **o)  # eager warm-up: builds the kernels and the twin
    torch._dynamo.reset()
    f = torch.compile(lambda x, o: layer(x, **o), fullgraph=True, dynamic=dynamic)
    for lead in [(4, 96), (2, 300), (1, 1)]:
        x, o = make(*lead)
        xc = x.clone().requires_grad_()
        xr = x.double().requires_grad_()
        layer.zero_grad()
        ref.zero_grad()
        outs = _as_tuple(f(xc, o))
        wants = _as_tuple(fn(F.linear(xr, ref.weight), ref.bias, **{n: v.double() for n, v in o.items()}))
        assert [tuple(t.shape) for t in outs] == [tuple(t.shape) for t in wants]
        for g, w in zip(outs, wants, strict=True):
            assert rel(g, w) < 2e-2, lead
        sum(t.float().sum() for t in outs).backward()
        sum(t.sum() for t in wants).backward()
        assert rel(xc.grad, xr.grad) < 3e-2, lead
        assert rel(layer.weight.grad, ref.weight.grad) < 3e-2, lead
        assert rel(layer.bias.grad, ref.bias.grad) < 3e-2, lead


def test_fused_linear_autocast_under_torch_compile(cache):
    """float32 master weights under bf16 autocast: the bf16 kernel, float32 gradients."""
    torch.manual_seed(1)
    layer = evtc.nn.FusedLinear(128, 256, _gelu_bias, device="cuda", cache_dir=cache)
    x = torch.randn(64, 128, device="cuda")
    with torch.autocast("cuda", torch.bfloat16):
        layer(x.clone().requires_grad_())
        torch._dynamo.reset()
        f = torch.compile(layer, fullgraph=True)
        xc = x.clone().requires_grad_()
        y = f(xc)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert layer.weight.grad.dtype == torch.float32 and xc.grad.dtype == torch.float32
    xr = x.double().requires_grad_()
    w, b = layer.weight.detach().double().requires_grad_(), layer.bias.detach().double().requires_grad_()
    want = _gelu_bias(xr @ w.t(), b)
    want.sum().backward()
    assert rel(y, want) < 2e-2
    assert rel(layer.weight.grad, w.grad) < 3e-2 and rel(xc.grad, xr.grad) < 3e-2


def test_reduce_overhead_cuda_graph_fused_linear_training(cache):
    """mode="reduce-overhead": forward and backward of FusedLinear in CUDA graph trees, new inputs
    on every replay."""
    torch.manual_seed(2)
    layer = evtc.nn.FusedLinear(256, 512, _res_stats, dtype=torch.bfloat16, device="cuda", cache_dir=cache)
    x, r = torch.randn(128, 256, device="cuda").bfloat16(), torch.randn(128, 512, device="cuda").bfloat16()
    layer(x.clone().requires_grad_(), residual=r)

    @torch.compile(mode="reduce-overhead", fullgraph=True)
    def step(x, r):
        y, s = layer(x, residual=r)
        return (y.float().sum() + s.sum())

    for i in range(4):
        x = torch.randn(128, 256, device="cuda").bfloat16()
        r = torch.randn(128, 512, device="cuda").bfloat16()
        xc = x.clone().requires_grad_()
        layer.zero_grad()
        loss = step(xc, r)
        loss.backward()
        xr = x.double().requires_grad_()
        w = layer.weight.detach().double().requires_grad_()
        b = layer.bias.detach().double()
        yr, sr = _res_stats(xr @ w.t(), b, r.double())
        lr = yr.sum() + sr.sum()
        lr.backward()
        assert abs(loss.item() - lr.item()) <= 2e-2 * max(1.0, abs(lr.item())), i
        assert rel(xc.grad, xr.grad) < 3e-2 and rel(layer.weight.grad, w.grad) < 3e-2, i


def test_reduce_overhead_cuda_graph_kernel_outputs_survive_next_replay(cache):
    """Outputs of one replay kept while the next replay runs: CUDA graph trees warn/copy; evtc's
    outputs must not alias buffers the next replay overwrites."""
    ex = dict(a=R(300, 64), b=R(64, 256), C=R(300, 256))
    k = evtc.compile(_stats, ex, cache_dir=cache)

    @torch.compile(mode="reduce-overhead", fullgraph=True)
    def f(a, b, C):
        return tuple(o.float() + 0 for o in k(a, b, C=C))

    kept = []
    for _ in range(4):
        x = dict(a=R(300, 64), b=R(64, 256), C=R(300, 256))
        outs = [o.clone() for o in f(x["a"], x["b"], x["C"])]
        kept.append((outs, _ref(_stats, x)))
    for outs, want in kept:
        for g, w in zip(outs, want, strict=True):
            assert rel(g, w) < 2e-2
