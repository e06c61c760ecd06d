"""Mask outputs are bool tensors, as torch returns them (GPU).

The kernel writes a bool output's bytes (0 and 1) through float8_e4m3fn stores; these tests check
the bytes torch reads back against torch's own comparison on float64. The inputs are small
integers (exact products and sums in float32 and float64 alike) and the thresholds sit halfway
between integers, so every mask must match torch's exactly, whatever the launch: the kernel's D
(a mask as the only output), an extra output beside a 16-bit D, a gated epilogue, batches, decode
sizes that trim A's rows, split K, ragged widths (the staged path), out= of bool tensors,
``out_dtypes=torch.bool`` and ``evtc.linear`` with autograd.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import evtc

pytestmark = pytest.mark.gpu

F16, BF16 = torch.float16, torch.bfloat16


def ints(*shape, dtype=F16, lo=-3, hi=4, offset=0.0):
    """Random integers in [lo, hi) (plus ``offset``) as ``dtype`` on the GPU: exact in 16 bits."""
    return (torch.randint(lo, hi, shape, device="cuda").float() + offset).to(dtype)


def f64(t):
    return t.double() if isinstance(t, torch.Tensor) else t


def check_mask(got, want, what):
    assert got.dtype == torch.bool, f"{what}: dtype {got.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    assert want.dtype == torch.bool
    bad = (got.cpu() != want.cpu()).sum().item()
    assert bad == 0, f"{what}: {bad} of {want.numel()} elements differ"
    # Only 0 and 1 bytes: anything else would read as True but compare unequal to True.
    assert set(got.view(torch.uint8).unique().tolist()) <= {0, 1}, f"{what}: bytes other than 0 and 1"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("mask-cache"))


def only_mask(acc, C):
    return acc > C


@pytest.mark.parametrize("m,n,k", [(256, 256, 64), (100, 136, 32), (1, 512, 256), (5, 96, 128),
                                   (1, 3584, 18944), (300, 24, 40)])
def test_a_mask_as_the_only_output(cache, m, n, k):
    """The mask is the kernel's D: decode sizes (A's rows trimmed), split K (the last shape),
    ragged widths (staged) and a narrow N."""
    a, b, C = ints(m, k), ints(k, n), ints(m, n, lo=-20, hi=20, offset=0.5)
    kern = evtc.compile(only_mask, {"a": a, "b": b, "C": C}, cache_dir=cache)
    got = kern(a, b, C=C)
    check_mask(got, only_mask(f64(a) @ f64(b), f64(C)), f"{m}x{n}x{k}")


def gelu_and_mask(acc, bias):
    pre = acc + bias
    return F.gelu(pre), pre > 0, pre.sum(-1)


@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("m", [1, 64, 200])
def test_a_mask_beside_a_16_bit_output_and_a_reduction(cache, dtype, m):
    n, k = 192, 96
    # Entries of -1, 0 and 1: the row sums stay well inside float16's range.
    a, b = ints(m, k, dtype=dtype, lo=-1, hi=2), ints(k, n, dtype=dtype, lo=-1, hi=2)
    bias = ints(n, dtype=dtype, offset=0.5)
    kern = evtc.compile(gelu_and_mask, {"a": a, "b": b, "bias": bias}, cache_dir=cache)
    y, mask, sums = kern(a, b, bias=bias)
    want_y, want_mask, want_sums = gelu_and_mask(f64(a) @ f64(b), f64(bias))
    check_mask(mask, want_mask, f"m={m}")
    assert y.dtype == dtype and sums.dtype == dtype
    torch.testing.assert_close(y.double(), want_y, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(sums.double(), want_sums, rtol=1e-2, atol=8.0)


def batched(acc, C):
    return acc * C, torch.isnan(acc / C), acc >= C


def test_masks_of_a_batched_kernel(cache):
    """Two masks and a tile, batched; one mask is NaN where C is 0 and acc is 0 (0 / 0)."""
    L, m, n, k = 3, 70, 128, 48
    a, b = ints(L, m, k, lo=-1, hi=2), ints(L, k, n, lo=-1, hi=2)
    C = ints(L, m, n, lo=-2, hi=3)
    kern = evtc.compile(batched, {"a": a, "b": b, "C": C}, cache_dir=cache)
    y, nans, ge = kern(a, b, C=C)
    want_y, want_nans, want_ge = batched(f64(a) @ f64(b), f64(C))
    assert want_nans.any() and not want_nans.all()
    check_mask(nans, want_nans, "isnan")
    check_mask(ge, want_ge, ">=")
    torch.testing.assert_close(y.double(), want_y, rtol=1e-3, atol=1e-3)


def swiglu_and_gate_mask(acc):
    gate, up = acc.chunk(2, dim=-1)
    return F.silu(gate) * up, gate > 0.5


@pytest.mark.parametrize("m", [1, 128])
def test_a_mask_of_a_gated_epilogue(cache, m):
    n, k = 256, 64
    a, b = ints(m, k, lo=-1, hi=2), ints(k, 2 * n, lo=-1, hi=2)
    kern = evtc.compile(swiglu_and_gate_mask, {"a": a, "b": b}, cache_dir=cache)
    y, mask = kern(a, b)
    want_y, want_mask = swiglu_and_gate_mask(f64(a) @ f64(b))
    check_mask(mask, want_mask, f"gated m={m}")
    torch.testing.assert_close(y.double(), want_y, rtol=1e-2, atol=1e-2)


def difference(acc, C):
    return acc - C


def test_out_dtypes_bool_is_torchs_nonzero(cache):
    """``out_dtypes=torch.bool`` on a number: value != 0, NaN included, as torch's ``.bool()``."""
    m, n, k = 128, 64, 32
    a, b = ints(m, k), ints(k, n)
    C = (f64(a) @ f64(b)).to(F16)
    C[::3] += 1
    C[1, :5] = float("nan")
    kern = evtc.compile(difference, {"a": a, "b": b, "C": C}, out_dtypes=torch.bool, cache_dir=cache)
    got = kern(a, b, C=C)
    want = difference(f64(a) @ f64(b), f64(C)).bool()
    assert want.any() and not want.all()
    check_mask(got, want, "out_dtypes=bool")


def test_out_of_bool_tensors_is_written_and_returned(cache):
    """out= with bool tensors: a padded view and a contiguous one, written in place and returned."""
    m, n, k = 96, 160, 64
    a, b, bias = ints(m, k), ints(k, n), ints(n, offset=0.5)
    kern = evtc.compile(gelu_and_mask, {"a": a, "b": b, "bias": bias}, cache_dir=cache)
    big = torch.ones(m, n + 16, dtype=torch.bool, device="cuda")
    out = (torch.empty(m, n, dtype=F16, device="cuda"), big[:, :n], torch.empty(m, dtype=F16, device="cuda"))
    got = kern(a, b, bias=bias, out=out)
    assert all(g is o for g, o in zip(got, out, strict=True))
    _, want_mask, _ = gelu_and_mask(f64(a) @ f64(b), f64(bias))
    check_mask(out[1], want_mask, "out= view")
    assert big[:, n:].all(), "out= wrote past its view"


def test_a_layer_that_returns_a_mask_trains(cache):
    """evtc.linear with a mask output: the mask is torch's and needs no gradient; the other
    output's gradients are autograd's of the same function."""
    def layer(acc, bias):
        pre = acc + bias
        return F.gelu(pre), pre > 0

    x = ints(2, 24, 64, dtype=BF16).requires_grad_()
    w = (ints(96, 64, dtype=BF16)).requires_grad_()
    bias = ints(96, dtype=BF16, offset=0.5).requires_grad_()
    lin = evtc.linear(layer, {"x": x.detach(), "weight": w.detach(), "bias": bias.detach()}, cache_dir=cache)
    y, mask = lin(x, w, bias=bias)
    assert not mask.requires_grad
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, bias))
    want_y, want_mask = layer(x64 @ w64.t(), b64)
    check_mask(mask, want_mask, "linear")
    g = torch.randn_like(want_y)
    (y.double() * g).sum().backward()
    (want_y * g).sum().backward()
    pairs = ((x.grad, x64.grad, "x"), (w.grad, w64.grad, "weight"), (bias.grad, b64.grad, "bias"))
    for got, want, name in pairs:
        err = (got.double() - want).norm() / want.norm()
        assert err < 3e-2, f"{name}: relative error {err:.3g}"


def test_a_mask_under_torch_compile(cache):
    a, b, C = ints(64, 32), ints(32, 128), ints(64, 128, lo=-10, hi=10, offset=0.5)
    kern = evtc.compile(only_mask, {"a": a, "b": b, "C": C}, cache_dir=cache)
    compiled = torch.compile(lambda a, b, C: kern(a, b, C=C), fullgraph=True)
    got = compiled(a, b, C)
    check_mask(got, only_mask(f64(a) @ f64(b), f64(C)), "torch.compile")


def energies(acc, t: float):
    energy = acc.pow(2).sum(-1)
    return acc, energy.float(), energy > t


@pytest.mark.parametrize("m,n", [(130, 96), (4, 520)])
def test_a_mask_of_a_row_reduction_finished_in_the_kernel(cache, m, n):
    """A comparison of a row's sum, stored by the kernel's own finish (as its bytes) beside the
    sum itself; integer sums, a threshold between integers."""
    a, b = ints(m, 32, lo=-1, hi=2), ints(32, n, lo=-1, hi=2)
    kern = evtc.compile(energies, {"a": a, "b": b, "t": 1.5}, cache_dir=cache)
    assert kern.plan.kernel_finish, "the kernel should finish the row reductions"
    acc64 = f64(a) @ f64(b)
    t = float(acc64.pow(2).sum(-1).median()) + 0.5  # between integers: no ties
    y, energy, big = kern(a, b, t=t)
    want_y, want_energy, want_big = energies(acc64, t)
    assert want_big.any() and not want_big.all()
    check_mask(big, want_big, f"{m}x{n}")
    torch.testing.assert_close(energy.double(), want_energy.double(), rtol=1e-6, atol=0.0)


def tiny(acc):
    return acc * 1e-8


@pytest.mark.parametrize("fn", [None, lambda acc: (acc * 1e-8).bool(),
                                lambda acc: (acc * 1e-3).to(torch.float8_e4m3fn).bool()],
                         ids=["out_dtypes", "bool", "e4m3-bool"])
def test_bool_of_a_value_reads_it_as_torch_holds_it(cache, fn):
    """``out_dtypes=torch.bool`` / ``.bool()`` of a float16 value round it to float16 first (tiny
    products underflow to False, as in torch); of a float8 one compare it exactly."""
    a, b = ints(96, 32), ints(32, 128)  # exact products: torch's float16 acc is the kernel's
    if fn is None:
        kern = evtc.compile(tiny, {"a": a, "b": b}, out_dtypes=torch.bool, cache_dir=cache)
        want = tiny(a @ b).bool()
    else:
        kern = evtc.compile(fn, {"a": a, "b": b}, cache_dir=cache)
        want = fn(a @ b)
    assert want.any() and not want.all()
    check_mask(kern(a, b), want, "bool of a value")
