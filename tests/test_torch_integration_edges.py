"""A kernel's torch integration on the CPU (the torch path): its custom operator passes opcheck and
its fake implementation gives the real outputs' shapes, dtypes and strides (column-major D
included); torch.compile with inductor (dict outputs, changing sizes, out= aliasing an input),
torch.export with a dynamic size, vmap, gradients of one operand, second derivatives, no_grad and
inference_mode, and torch.func.grad refused by name. First written as an adversarial probe of the
torch integration."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import evtc

_SEEDS = itertools.count(1)


def R(*shape, dtype=torch.float32):
    """Random values of a seed of their own (the next one each call)."""
    g = torch.Generator().manual_seed(next(_SEEDS))
    return torch.randn(*shape, generator=g).to(dtype)


def _residual(acc, residual):
    return acc + residual


def _rowsum(acc, C):
    y = acc + C
    return y, y.sum(-1)


def _colsum_kd(acc):
    return acc.relu(), acc.sum(0, keepdim=True)


def _total(acc, s: float):
    return acc * s, acc.abs().amax()


def _dict_out(acc, C):
    return {"s": acc.sum(-1), "y": (acc + C).half()}


def _swiglu(acc):
    g, u = acc.chunk(2, dim=-1)
    return F.silu(g) * u


def _batched_stats(acc):
    return acc, acc.sum(-2, keepdim=True), acc.mean((-2, -1))


CASES = {
    "rowsum": (_rowsum, lambda: dict(a=R(10, 16), b=R(16, 24), C=R(10, 24))),
    "colsum_kd": (_colsum_kd, lambda: dict(a=R(10, 16), b=R(16, 24))),
    "total_py": (_total, lambda: dict(a=R(10, 16), b=R(16, 24), s=0.5)),
    "dict_out": (_dict_out, lambda: dict(a=R(10, 16), b=R(16, 24), C=R(10, 24))),
    "swiglu": (_swiglu, lambda: dict(a=R(10, 16), b=R(16, 48))),
    "batched_stats": (_batched_stats, lambda: dict(a=R(3, 10, 16), b=R(3, 16, 24))),
}


def _meta_close(real, fake):
    """shape, dtype, device, and strides on dims longer than 1 (torch's notion of equal layout)."""
    assert tuple(real.shape) == tuple(fake.shape) and real.dtype == fake.dtype
    for size, rs, fs in zip(real.shape, real.stride(), fake.stride(), strict=True):
        assert size <= 1 or rs == fs, (real.shape, real.stride(), fake.stride())


@pytest.mark.parametrize("case", list(CASES))
def test_opcheck_and_fake_metadata(case, cache):
    fn, make = CASES[case]
    ex = make()
    k = evtc.compile(fn, ex, cache_dir=cache)
    args = [ex["a"], ex["b"], *[ex[n] for n in k.operand_names]]
    real = k.op(*args)
    with FakeTensorMode() as mode:
        fake = k.op(*[mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in args])
    real = real if isinstance(real, tuple) else (real,)
    fake = fake if isinstance(fake, tuple) else (fake,)
    for r, f in zip(real, fake, strict=True):
        _meta_close(r, f)
    grads = [t.clone().requires_grad_() if isinstance(t, torch.Tensor) else t for t in args]
    result = torch.library.opcheck(k.op, grads)
    assert all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.parametrize("m_n", [(256, 128), (1, 128), (256, 1)])
def test_column_major_d_fake_layout(m_n, cache):
    """d_major='m': the fake's column-major D matches the real one on dims longer than 1, also at
    M = 1 / N = 1 (strides of the size-1 dim differ, which torch ignores)."""
    M, N = m_n
    h = torch.float16
    ex = dict(a=R(256, 64, dtype=h), b=R(64, 128, dtype=h), residual=R(256, 128, dtype=h))
    k = evtc.compile(_residual, ex, config={"d_major": "m"}, cache_dir=cache)
    args = [R(M, 64, dtype=h), R(64, N, dtype=h), R(M, N, dtype=h)]
    real = k.op(*args)
    with FakeTensorMode() as mode:
        fake = k.op(*[mode.from_tensor(t) for t in args])
    _meta_close(real, fake)
    torch._dynamo.reset()
    got = torch.compile(lambda a, b, C: k(a, b, residual=C).float() * 2, fullgraph=True)(*args)
    want = (args[0].float() @ args[1].float() + args[2].float()).half().float() * 2
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_inductor_dict_outputs_and_dynamic_sizes(cache):
    a, b, C = R(10, 16), R(16, 24), R(10, 24)
    k = evtc.compile(_dict_out, dict(a=a, b=b, C=C), cache_dir=cache)

    def model(a, b, C):
        d = k(a, b, C=C)
        return d["y"].float() * 2 + d["s"][:, None], d["s"]

    torch._dynamo.reset()
    f = torch.compile(model, fullgraph=True)
    for M in (10, 12, 33):
        a2, C2 = R(M, 16), R(M, 24)
        for got, want in zip(f(a2, b, C2), model(a2, b, C2), strict=True):
            torch.testing.assert_close(got, want)


def test_inductor_out_aliasing(cache):
    a, b, C = R(10, 16), R(16, 24), R(10, 24)
    k = evtc.compile(_residual, dict(a=a, b=b, residual=C), cache_dir=cache)
    k2 = evtc.compile(_rowsum, dict(a=a, b=b, C=C), cache_dir=cache)
    cases = [
        (lambda a, b, C: (k(a, b, residual=C, out=C), C.sum())[1], (a, b, C)),
        (lambda a, b, C, buf: (k(a, b, residual=buf[:, :24], out=buf[:, 8:32]), buf * 1)[1],
         (a, b, C, R(10, 40))),
        (lambda a, b, C, s: (k2(a, b, C=C, out=(C, s)), C * 2, s * 2)[1:], (a, b, C, R(10))),
        (lambda a, b, C, buf: (k(a, b, residual=C, out=buf.t()), buf * 1)[1], (a, b, C, R(24, 10))),
    ]
    for fn, args in cases:
        torch._dynamo.reset()
        eager_args = [t.clone() for t in args]
        comp_args = [t.clone() for t in args]
        want = fn(*eager_args)
        got = torch.compile(fn, fullgraph=True)(*comp_args)
        wants = want if isinstance(want, tuple) else (want,)
        gots = got if isinstance(got, tuple) else (got,)
        for w, g in zip(wants, gots, strict=True):
            torch.testing.assert_close(g, w)
        for e, c in zip(eager_args, comp_args, strict=True):
            torch.testing.assert_close(c, e)


def test_export_dynamic_and_strict(cache):
    def bg(acc, bias, C):
        return F.gelu(acc + bias) * C, (acc * C).sum(-1)

    k = evtc.compile(bg, dict(a=R(10, 16), b=R(16, 24), bias=R(24), C=R(10, 24)), cache_dir=cache)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.bias = torch.nn.Parameter(R(16, 24)), torch.nn.Parameter(R(24))

        def forward(self, x, C):
            y, r = k(x, self.w, bias=self.bias, C=C)
            return y + r[:, None]

    m = M()
    dim = torch.export.Dim("M", min=2)
    ep = torch.export.export(m, (R(10, 16), R(10, 24)), dynamic_shapes={"x": {0: dim}, "C": {0: dim}})
    x, C = R(33, 16), R(33, 24)
    torch.testing.assert_close(ep.module()(x, C), m(x, C))


def test_vmap_forward_per_sample(cache):
    def bg(acc, bias, C):
        return F.gelu(acc + bias) * C, (acc * C).sum(-1)

    a, b, bias, C = R(10, 16), R(16, 24), R(24), R(10, 24)
    k = evtc.compile(bg, dict(a=a, b=b, bias=bias, C=C), cache_dir=cache)

    def ref(a, b, bias, C):
        return bg(a.double() @ b.double(), bias.double(), C.double())

    for args, dims in [((R(3, 10, 16), b, bias, C), (0, None, None, None)),
                       ((a, b, R(3, 24), C), (None, None, 0, None)),
                       ((R(10, 3, 16), R(3, 16, 24), R(3, 24), R(3, 10, 24)), (1, 0, 0, 0))]:
        got = torch.func.vmap(lambda a, b, bias, C: k(a, b, bias=bias, C=C), in_dims=dims)(*args)
        want = torch.func.vmap(ref, in_dims=dims)(*args)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("which", ["bias", "C", "a", "b"])
def test_grad_on_one_operand_only_under_inductor(which, cache):
    def bg(acc, bias, C):
        return F.gelu(acc + bias) * C, (acc * C).sum(-1)

    base = dict(a=R(10, 16), b=R(16, 24), bias=R(24), C=R(10, 24))
    k = evtc.compile(bg, base, cache_dir=cache)
    xs = {n: v.clone().requires_grad_(n == which) for n, v in base.items()}
    torch._dynamo.reset()
    y, s = torch.compile(lambda a, b, bias, C: k(a, b, bias=bias, C=C), fullgraph=True)(**xs)
    (y.sum() + (s ** 2).sum()).backward()
    ref = {n: v.detach().double().requires_grad_(n == which) for n, v in xs.items()}
    yr, sr = bg(ref["a"] @ ref["b"], ref["bias"], ref["C"])
    (yr.sum() + (sr ** 2).sum()).backward()
    assert [n for n, v in xs.items() if v.grad is not None] == [which]
    torch.testing.assert_close(xs[which].grad.double(), ref[which].grad, rtol=1e-4, atol=1e-3)


def test_second_derivative_of_recomputing_operator(cache):
    """docs/training.md: a kernel's operator that recomputes its accumulator is differentiable
    twice on the torch path. Values against float64 torch."""
    def bg(acc, bias, C):
        return F.gelu(acc + bias) * C, (acc * C).sum(-1)

    base = dict(a=R(10, 16), b=R(16, 24), bias=R(24), C=R(10, 24))
    k = evtc.compile(bg, base, cache_dir=cache)
    xs = {n: v.clone().requires_grad_() for n, v in base.items()}
    y, s = k(xs["a"], xs["b"], bias=xs["bias"], C=xs["C"])
    ga = torch.autograd.grad(y.sum() + (s ** 2).sum(), xs["a"], create_graph=True)[0]
    gg = torch.autograd.grad((ga ** 2).sum(), [xs["b"], xs["bias"], xs["C"]])
    ref = {n: v.detach().double().requires_grad_() for n, v in xs.items()}
    yr, sr = bg(ref["a"] @ ref["b"], ref["bias"], ref["C"])
    gar = torch.autograd.grad(yr.sum() + (sr ** 2).sum(), ref["a"], create_graph=True)[0]
    ggr = torch.autograd.grad((gar ** 2).sum(), [ref["b"], ref["bias"], ref["C"]])
    for g, r in zip(gg, ggr, strict=True):
        assert ((g.double() - r).abs().max() / r.abs().max()).item() < 1e-4


def test_no_grad_and_inference_mode_outputs(cache):
    base = dict(a=R(10, 16), b=R(16, 24), C=R(10, 24))
    k = evtc.compile(_rowsum, base, cache_dir=cache)
    xs = {n: v.clone().requires_grad_() for n, v in base.items()}
    with torch.no_grad():
        y, s = k(xs["a"], xs["b"], C=xs["C"])
        assert not y.requires_grad and not s.requires_grad
    with torch.inference_mode():
        y, s = k(xs["a"], xs["b"], C=xs["C"])
        assert y.is_inference() and not y.requires_grad
    torch._dynamo.reset()
    with torch.inference_mode():
        y, s = torch.compile(lambda a, b, C: k(a, b, C=C), fullgraph=True)(xs["a"], xs["b"], xs["C"])
    torch.testing.assert_close(y, (base["a"] @ base["b"] + base["C"]))


def test_torch_func_grad_refused_by_name(cache):
    base = dict(a=R(10, 16), b=R(16, 24), C=R(10, 24))
    k = evtc.compile(_rowsum, base, cache_dir=cache)
    with pytest.raises(evtc.CallError, match="torch.func"):
        torch.func.grad(lambda a: k(a, base["b"], C=base["C"])[0].sum())(base["a"])
