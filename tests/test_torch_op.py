"""Compiled kernels as PyTorch custom operators: the schema, the fake (meta) implementation, and
torch.compile(fullgraph=True) tracing through a model that calls a kernel.  CPU only: meta tensors
stand in for CUDA ones, and nothing launches (tests/test_torch_op_gpu.py runs them)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import evtc


def bias_relu_aux(acc, C, bias, alpha: float):
    # The cast keeps C's dtype where a float32 bias would make the sum float32 (as in torch).
    return torch.relu(alpha * acc + C + bias).to(C.dtype), acc * 2


def scaled(acc, s):
    return (acc * s).to(torch.bfloat16)


def meta(*shape, dtype=torch.float16):
    return torch.empty(shape, dtype=dtype, device="meta")


def example():
    return dict(a=meta(256, 128), b=meta(128, 512), C=meta(256, 512), bias=meta(512, dtype=torch.float32),
                alpha=1.0)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    return evtc.compile(bias_relu_aux, example(), cache_dir=tmp_path_factory.mktemp("evtc-op"))


def test_operator_schema_follows_the_epilogue(kernel):
    assert kernel.operand_names == ["C", "bias", "alpha"]
    schema = str(kernel.op._schema)
    assert schema.startswith("evtc::bias_relu_aux_")
    assert "(Tensor a, Tensor b, Tensor C, Tensor bias, float alpha) -> (Tensor, Tensor)" in schema
    # One operator per kernel and process: compiling again finds it.
    assert evtc.compile(bias_relu_aux, example(), cache_dir=kernel.cache_path.parents[1]).op is kernel.op


def test_pinned_and_per_call_cluster_kernels_are_different_operators(kernel):
    pinned = evtc.compile(bias_relu_aux, example(), config={"cluster": (1, 2)},
                          cache_dir=kernel.cache_path.parents[1])
    assert pinned.key == kernel.key and pinned.op is not kernel.op


def test_fake_implementation_gives_shapes_and_dtypes(kernel, tmp_path):
    with FakeTensorMode():
        a, b = torch.empty(300, 64, dtype=torch.float16), torch.empty(64, 200, dtype=torch.float16)
        y, z = kernel.op(a, b, torch.empty(300, 200, dtype=torch.float16), torch.empty(200), 0.5)
        assert y.shape == z.shape == (300, 200) and y.dtype == z.dtype == torch.float16
    batched = evtc.compile(scaled, dict(a=meta(2, 64, 32), b=meta(2, 32, 64), s=meta(1, dtype=torch.float32)),
                           cache_dir=tmp_path)
    with FakeTensorMode():
        a = torch.empty(3, 100, 32, dtype=torch.float16)
        d = batched.op(a, torch.empty(3, 32, 48, dtype=torch.float16), torch.empty(1))
        assert d.shape == (3, 100, 48) and d.dtype == torch.bfloat16


def test_torch_compile_fullgraph_traces_the_kernel_as_one_op(kernel):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def model(a, b, C, bias):
        y, z = kernel(a, b, C=C, bias=bias, alpha=1.5)
        return torch.relu(y) + z

    a, b, C, bias = meta(300, 64), meta(64, 200), meta(300, 200), meta(200, dtype=torch.float32)
    out = torch.compile(model, fullgraph=True, backend=backend)(a, b, C, bias)
    assert out.shape == (300, 200) and out.dtype == torch.float16
    assert len(graphs) == 1
    calls = [n for n in graphs[0].graph.nodes if n.op == "call_function" and "evtc" in str(n.target)]
    assert len(calls) == 1 and str(calls[0].target).startswith("evtc.bias_relu_aux_")


def test_torch_compile_with_out_copies_into_it(kernel):
    def model(a, b, C, bias, y, z):
        return kernel(a, b, C=C, bias=bias, alpha=1.5, out=(y, z))

    args = (meta(300, 64), meta(64, 200), meta(300, 200), meta(200, dtype=torch.float32), meta(300, 200),
            meta(300, 200))
    y, z = torch.compile(model, fullgraph=True, backend="eager")(*args)
    assert y.shape == (300, 200)


def test_operator_on_cpu_tensors_computes_the_function(kernel):
    """CPU tensors take the torch path (torch.matmul, then the graph evaluated by torch)."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(300, 64, generator=g).half(), torch.randn(64, 200, generator=g).half()
    C, bias = torch.randn(300, 200, generator=g).half(), torch.randn(200, generator=g)
    y, z = kernel.op(a, b, C, bias, 0.5)
    want_y, want_z = bias_relu_aux(a.float() @ b.float(), C.float(), bias, 0.5)
    torch.testing.assert_close(y.float(), want_y.half().float(), rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(z.float(), want_z.half().float(), rtol=2e-3, atol=2e-3)


def residual_gelu(acc, bias, residual):
    return torch.nn.functional.gelu(acc + bias) + residual


def test_linear_takes_the_weight_as_it_is_and_any_leading_dims(tmp_path):
    ex = dict(x=meta(2, 8, 64), weight=meta(96, 64), bias=meta(96, dtype=torch.float32),
              residual=meta(2, 8, 96))
    lin = evtc.linear(residual_gelu, ex, cache_dir=tmp_path)
    # weight.t() is a K-major B: loaded as it is, never transposed or copied.
    assert lin.kernel.config.b_major == "k" and lin.kernel.config.a_major == "k"
    assert "residual: float16[M, N]" in lin.explain() and "bias: float32[N]" in lin.explain()

    def model(x, weight, bias, residual):
        return lin(x, weight, bias=bias, residual=residual)

    out = torch.compile(model, fullgraph=True, backend="eager")(meta(3, 5, 64), meta(96, 64),
                                                                meta(96, dtype=torch.float32), meta(3, 5, 96))
    assert out.shape == (3, 5, 96) and out.dtype == torch.float32  # a float32 bias promotes, as in torch
    with pytest.raises(evtc.CallError, match="input features"):
        lin(torch.randn(4, 32).half(), torch.randn(96, 64).half(), bias=torch.randn(96),
            residual=torch.randn(4, 96).half())
    with pytest.raises(evtc.CallError, match="needs 'x'"):
        evtc.linear(residual_gelu, dict(a=meta(8, 64), b=meta(64, 96)), cache_dir=tmp_path)


# ---- batch broadcasts under torch.compile (CPU tensors: the torch path, traced as the GPU's) ------


def _resid(acc, C):
    return acc + C


def _relu(acc):
    return torch.relu(acc)


def _bias_gelu(acc, bias):
    return torch.nn.functional.gelu(acc + bias)


@pytest.mark.parametrize("a_shape", [(8, 32), (1, 8, 32)])
def test_fake_result_has_the_broadcast_batch(a_shape, tmp_path):
    """A kernel compiled with a 2-d a (or one of batch 1) beside a b of batch 3: the fake gives
    torch's (3, M, N), as the real operator does. It gave (M, M, N) or (1, M, N), so inductor either
    failed its size checks or, with them off, read memory it never wrote."""
    a, b, bias = torch.randn(*a_shape), torch.randn(3, 32, 16), torch.randn(16)
    k = evtc.compile(_bias_gelu, dict(a=a, b=b, bias=bias), cache_dir=tmp_path)
    with FakeTensorMode() as mode:
        fake = k.op(mode.from_tensor(a), mode.from_tensor(b), mode.from_tensor(bias))
    assert tuple(fake.shape) == tuple(k.op(a, b, bias).shape) == (3, 8, 16)
    want = _bias_gelu(a.double() @ b.double(), bias.double())
    torch._dynamo.reset()
    f = torch.compile(lambda a, b, bias: k(a, b, bias=bias) * 2, backend="aot_eager", fullgraph=True)
    a_ = a.clone().requires_grad_()
    got = f(a_, b, bias)
    got.sum().backward()
    assert torch.allclose(got.double(), want * 2, atol=1e-4, rtol=1e-4)
    a64 = a.double().requires_grad_()
    (_bias_gelu(a64 @ b.double(), bias.double()) * 2).sum().backward()
    assert torch.allclose(a_.grad.double(), a64.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dynamic", [False, True])
def test_batch_one_broadcasts_under_torch_compile(dynamic, tmp_path):
    """A batch of 1 beside a batch of L (C, a or b) under torch.compile, dynamic shapes included:
    symbolic batch sizes were tested with ``in``, which dynamo answers False for an equal
    constant, and the call was refused."""
    M, N, K = 8, 16, 32
    k = evtc.compile(_resid, dict(a=torch.randn(3, M, K), b=torch.randn(3, K, N), C=torch.randn(3, M, N)),
                     cache_dir=tmp_path)
    kr = evtc.compile(_relu, dict(a=torch.randn(4, M, K), b=torch.randn(4, K, N)), cache_dir=tmp_path)
    cases = [(k, (torch.randn(3, M, K), torch.randn(3, K, N)), {"C": torch.randn(1, M, N)}, _resid),
             (kr, (torch.randn(1, M, K), torch.randn(4, K, N)), {}, _relu),
             (kr, (torch.randn(4, M, K), torch.randn(1, K, N)), {}, _relu)]
    for kern, (a, b), ops, fn in cases:
        want = fn(a.double() @ b.double(), **{n: v.double() for n, v in ops.items()})
        torch._dynamo.reset()
        f = torch.compile(lambda a, b, ops, kern=kern: kern(a, b, **ops), fullgraph=True, dynamic=dynamic,
                          backend="aot_eager")
        got = f(a, b, ops)
        assert got.shape == want.shape and torch.allclose(got.double(), want, atol=1e-4, rtol=1e-4)


def test_dynamic_batches_compile_once(tmp_path):
    """Batched calls under dynamic=True keep the batch symbolic (the sizes were put in a set,
    which specialised them: one graph per batch size)."""
    from torch._dynamo.utils import counters

    M, N, K = 8, 16, 32
    k = evtc.compile(_resid, dict(a=torch.randn(3, M, K), b=torch.randn(3, K, N), C=torch.randn(3, M, N)),
                     cache_dir=tmp_path)
    torch._dynamo.reset()
    counters.clear()
    f = torch.compile(lambda a, b, C: k(a, b, C=C), fullgraph=True, dynamic=True, backend="eager")
    for batch in (3, 5, 7):
        a, b, C = torch.randn(batch, M, K), torch.randn(batch, K, N), torch.randn(batch, M, N)
        assert torch.allclose(f(a, b, C), a @ b + C, atol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1


def test_linear_out_without_a_flat_view_under_torch_compile(tmp_path):
    """evtc.linear's out= whose leading dims no single stride spans (a (2, 3, N) view of an (S, B, N)
    buffer) is written by a copy under torch.compile too (its view's error cannot be caught while
    tracing)."""
    K, N = 32, 16
    x, w, res = torch.randn(2, 3, K), torch.randn(N, K), torch.randn(2, 3, N)
    lin = evtc.linear(_resid, dict(x=x, weight=w, C=res), cache_dir=tmp_path)
    buf = torch.zeros(3, 2, N).transpose(0, 1)

    def g(x, w, res, buf):
        lin(x, w, C=res, out=buf)
        return buf.sum()

    torch._dynamo.reset()
    torch.compile(g, fullgraph=True, backend="aot_eager")(x, w, res, buf)
    assert torch.allclose(buf, x @ w.t() + res, atol=1e-5)


def test_the_operator_runs_the_kernel_object_that_called_it_last(tmp_path):
    """Kernel objects of one compiled code share one operator (an evtc.Linear's twin is compiled
    from a new wrapper each time): each call through one of them runs that one, so that its
    last_path (and saved accumulators) are those its caller reads."""
    def make():
        return lambda acc, C: acc + C

    a, b, C = torch.randn(8, 16), torch.randn(16, 12), torch.randn(8, 12)
    first = evtc.compile(make(), dict(a=a, b=b, C=C), cache_dir=tmp_path / "one")
    second = evtc.compile(make(), dict(a=a, b=b, C=C), cache_dir=tmp_path / "two")
    assert first is not second and first.op is second.op  # second registered last
    first.last_path = second.last_path = ""
    got = first(a.requires_grad_(), b, C=C)  # the operator's path (autograd)
    assert first.last_path == "torch" and second.last_path == ""
    assert torch.allclose(got, a @ b + C)


def test_torch_compile_fullgraph_with_out_on_real_tensors(tmp_path):
    """out= under torch.compile(fullgraph=True) on real (CPU) tensors: the out= checks must not read
    what dynamo cannot trace (``is_inference()``, ``is_neg()``), and the result lands in out."""
    def lincomb(acc, C, s: float):
        return acc * s + C

    h = torch.float16
    a, b, C = torch.randn(16, 16, dtype=h), torch.randn(16, 32, dtype=h), torch.randn(16, 32, dtype=h)
    k = evtc.compile(lincomb, dict(a=a, b=b, C=C, s=1.0), cache_dir=tmp_path)
    compiled = torch.compile(lambda a, b, C, o: k(a, b, C=C, s=2.0, out=o), fullgraph=True,
                             backend="aot_eager")
    out = torch.full((16, 32), float("nan"), dtype=h)
    got = compiled(a, b, C, out)
    assert got is out
    want = 2 * (a.double() @ b.double()) + C.double()
    torch.testing.assert_close(out.double(), want, rtol=2e-3, atol=2e-2)


def test_refusals_under_torch_compile_carry_evtc_messages(tmp_path):
    """A refused call under torch.compile says what evtc says eagerly: with fullgraph=True inside
    dynamo's error (it was dynamo's complaint about super() in evtc's error class), without it as
    the CallError itself. A tensor for a runtime scalar is refused as eagerly (the operator would
    take it, and dynamo failed inside the fake implementation)."""
    def lincomb(acc, C, s: float):
        return acc * s + C

    h = torch.float16
    a, b, C = torch.randn(16, 16, dtype=h), torch.randn(16, 32, dtype=h), torch.randn(16, 32, dtype=h)
    k = evtc.compile(lincomb, dict(a=a, b=b, C=C, s=1.0), cache_dir=tmp_path)
    scalar = "s is a runtime scalar: pass a Python float or int, got Tensor"
    with pytest.raises(evtc.CallError, match=scalar):
        k(a, b, C=C, s=torch.tensor(2.0))
    cases = [(lambda a, b, C: k(a, b, C=C, s=torch.tensor(2.0)), scalar),
             (lambda a, b, C: k(a, b, C=C, s=2.0, out=torch.empty(16, 31, dtype=h)),
              r"out.*(must be a torch.float16 tensor of shape|expected \(M, N\) =|"
              r"must have the output.s shape) \(16, 32\)")]
    for fn, message in cases:
        torch._dynamo.reset()
        with pytest.raises(Exception) as err:
            torch.compile(fn, fullgraph=True, backend="aot_eager")(a, b, C)
        # torch 2.13 quotes the message (raised exception CallError('...')); 2.11 names the class
        # and shows the raising line only.
        assert "CallError" in str(err.value) and "super()" not in str(err.value)
        torch._dynamo.reset()
        with pytest.raises(evtc.CallError, match=message):
            torch.compile(fn, backend="aot_eager")(a, b, C)


def test_make_fx_and_dispatch_modes_see_the_operator(kernel):
    """make_fx with real tensors records the call as the kernel's operator (a launch through
    TVM-FFI would be invisible to it, and a replay would return the outputs' allocation only); any
    other dispatch mode sees the operator too."""
    from torch.fx.experimental.proxy_tensor import make_fx

    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(32, 64, generator=g).half(), torch.randn(64, 48, generator=g).half()
    C, bias = torch.randn(32, 48, generator=g).half(), torch.randn(48, generator=g)
    traced = make_fx(lambda a, b, C, bias: kernel(a, b, C=C, bias=bias, alpha=0.5))(a, b, C, bias)
    assert any("evtc" in str(n.target) for n in traced.graph.nodes if n.op == "call_function")
    a2, b2 = torch.randn(32, 64, generator=g).half(), torch.randn(64, 48, generator=g).half()
    y, z = traced(a2, b2, C, bias)
    want_y, want_z = bias_relu_aux(a2.float() @ b2.float(), C.float(), bias, 0.5)
    torch.testing.assert_close(y.float(), want_y.half().float(), rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(z.float(), want_z.half().float(), rtol=2e-3, atol=2e-3)
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Recorder() as recorder:
        y, _ = kernel(a, b, C=C, bias=bias, alpha=0.5)
    assert any(op.startswith("evtc.") for op in recorder.ops), recorder.ops
    torch.testing.assert_close(y.float(), bias_relu_aux(a.float() @ b.float(), C.float(), bias, 0.5)[0]
                               .half().float(), rtol=2e-3, atol=2e-3)


def _lincomb(acc, C, alpha: float):
    return alpha * acc + C


@pytest.mark.parametrize("dynamic", [None, True])
def test_a_python_number_that_changes_under_torch_compile(dynamic, tmp_path):
    """A runtime scalar whose value changes between calls of a torch.compile'd function (directly,
    through evtc.linear and as a module's attribute): dynamo makes such a number symbolic (with
    dynamic=True from the first call), and evtc's check of which inputs require grad asked it for
    ``requires_grad``, which dynamo cannot trace: fullgraph=True failed, and without it the graph
    broke on every call."""
    from torch._dynamo.utils import counters

    g = torch.Generator().manual_seed(5)
    a, b, C, w = (torch.randn(*s, generator=g) for s in ((10, 16), (16, 24), (10, 24), (24, 16)))
    k = evtc.compile(_lincomb, dict(a=a, b=b, C=C, alpha=1.0), cache_dir=tmp_path)
    lin = evtc.linear(_lincomb, dict(x=a, weight=w, C=C, alpha=1.0), cache_dir=tmp_path)

    class Scaled(torch.nn.Module):
        alpha = 0.5

        def forward(self, a, b, C):
            return k(a, b, C=C, alpha=self.alpha)

    module = Scaled()
    torch._dynamo.reset()
    counters.clear()
    call = torch.compile(lambda a, b, C, al: k(a, b, C=C, alpha=al), fullgraph=True, dynamic=dynamic,
                         backend="eager")
    layer = torch.compile(lambda x, C, al: lin(x, w, C=C, alpha=al), fullgraph=True, dynamic=dynamic,
                          backend="eager")
    attribute = torch.compile(module, fullgraph=True, dynamic=dynamic, backend="eager")
    breaks = torch.compile(lambda a, b, C, al: k(a, b, C=C, alpha=al) * 2, dynamic=dynamic, backend="eager")
    for alpha in (0.5, 0.7, 3):
        module.alpha = alpha
        torch.testing.assert_close(call(a, b, C, alpha), alpha * (a @ b) + C, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer(a, C, alpha), alpha * (a @ w.t()) + C, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(attribute(a, b, C), alpha * (a @ b) + C, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(breaks(a, b, C, alpha), 2 * (alpha * (a @ b) + C), rtol=1e-5, atol=1e-5)
    assert not counters["graph_break"], dict(counters["graph_break"])


def _residual(acc, residual):
    return acc + residual


@pytest.mark.parametrize("lead", [(5,), (2, 5)], ids=["2d", "3d"])
def test_fused_linear_takes_one_row_under_dynamic_shapes(lead, tmp_path):
    """FusedLinear with a tile operand, built for many rows, called with one row (a decode step)
    under torch.compile(fullgraph=True, dynamic=True): the check that the built layer serves the
    one-row residual compared a bool with dynamo's symbolic one (a sympy BooleanAtom error)."""
    torch.manual_seed(0)
    layer = evtc.nn.FusedLinear(16, 24, _residual, bias=False, cache_dir=tmp_path)
    with torch.no_grad():
        layer(torch.randn(*lead, 16), residual=torch.randn(*lead, 24))
    torch._dynamo.reset()
    f = torch.compile(lambda x, r: layer(x, residual=r), fullgraph=True, dynamic=True, backend="eager")
    one = (1,) * len(lead)
    x, r = torch.randn(*one, 16), torch.randn(*one, 24)
    with torch.no_grad():
        torch.testing.assert_close(f(x, r), x @ layer.weight.t() + r, rtol=1e-5, atol=1e-5)


def test_fake_implementation_refuses_operand_shapes_the_call_refuses(kernel, tmp_path):
    """The fake runs the call's shape checks on every operand, so torch.compile and torch.export
    refuse a graph whose run would be refused (it checked a and b only: an exported program
    with a wrong C traced, then raised when run)."""
    a, b = meta(300, 64), meta(64, 200)
    with FakeTensorMode() as mode:
        for C, bias, match in [(meta(300, 40), meta(200, dtype=torch.float32), r"C has shape \(300, 40\)"),
                               (meta(300, 200), meta(47, dtype=torch.float32), r"bias has shape \(47,\)"),
                               (meta(200), meta(200, dtype=torch.float32), "C must be 2-d")]:
            args = [mode.from_tensor(torch.empty(t.shape, dtype=t.dtype)) for t in (a, b, C, bias)]
            with pytest.raises(evtc.CallError, match=match):
                kernel.op(*args, 0.5)

    class Layer(torch.nn.Module):
        def forward(self, a, b, C, bias):
            return kernel(a, b, C=C, bias=bias, alpha=1.5)

    good = [torch.randn(300, 64).half(), torch.randn(64, 200).half(), torch.randn(300, 200).half(),
            torch.randn(200)]
    torch.export.export(Layer(), tuple(good))
    with pytest.raises(evtc.CallError, match=r"C has shape \(300, 40\)"):
        torch.export.export(Layer(), (good[0], good[1], torch.randn(300, 40).half(), good[3]))

    # A gated kernel: its operand as wide as the GEMM is checked whole, at 2N.
    def swiglu_bias(acc, bias):
        g, u = (acc + bias).chunk(2, dim=-1)
        return F.silu(g) * u

    gated = evtc.compile(swiglu_bias, {"a": meta(64, 32), "b": meta(32, 128), "bias": meta(128)},
                         cache_dir=tmp_path)
    with FakeTensorMode() as mode:
        x, w = mode.from_tensor(torch.empty(64, 32).half()), mode.from_tensor(torch.empty(32, 128).half())
        assert gated.op(x, w, mode.from_tensor(torch.empty(128).half())).shape == (64, 64)
        with pytest.raises(evtc.CallError, match="bias must be a tensor whose last dim is N = 128"):
            gated.op(x, w, mode.from_tensor(torch.empty(64).half()))
