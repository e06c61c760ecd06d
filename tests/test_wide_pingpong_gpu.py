"""GPU: the ping-pong 128-row tiles 176 and 192 wide (16-column subtiles, 2 D buffers), which the
selector runs for light epilogues on problems of many tiles (evtc.plan.selector,
WIDE_PINGPONG_WIDTHS), against torch in float64: operands along M and N and a tile, ragged sizes,
batches, every cluster shape, a gated epilogue, float8 and 16-bit outputs, and the selector's own
launch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from linear_cases import assert_close, linear_inputs, residual_scaled

import evtc

pytestmark = pytest.mark.gpu

WIDTHS = [176, 192]


def _pinned(width: int, cluster=(2, 1)) -> dict:
    return {"schedule": "pingpong", "tile_n": width, "epi_tile_n": 16, "epi_stages": 2, "cluster": cluster}


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("cluster", [(2, 1), (1, 2), (1, 1)], ids=["c2x1", "c1x2", "c1x1"])
def test_fused_operands_on_ragged_sizes(cache, width, cluster):
    m, n, k = 300, 1000, 520  # ragged in M, N and K: partial tiles on both edges, several per CTA
    x, w, g = linear_inputs(m, n, k, seed=width + cluster[0])
    C = torch.randn(m, n, device="cuda", generator=g).to(torch.bfloat16)
    bias = torch.randn(n, device="cuda", generator=g)
    row_scale = torch.rand(m, 1, device="cuda", generator=g) + 0.5
    kernel = evtc.compile(residual_scaled, {"a": x, "b": w.t(), "C": C, "bias": bias, "row_scale": row_scale},
                          cache_dir=cache, config=_pinned(width, cluster))
    assert kernel.launch_for(m, n, k)[0].tile_n == width
    acc = x.double() @ w.double().t()
    assert_close(kernel(x, w.t(), C=C, bias=bias, row_scale=row_scale),
                 torch.relu(acc * row_scale.double() + C.double() + bias.double()))


def _gelu_fp8(acc, bias, s):
    y = F.gelu(acc + bias)
    return (y * s).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("width", WIDTHS)
def test_batches_and_a_float8_output(cache, width):
    batches, m, n, k = 3, 200, 776, 136
    x, w, g = linear_inputs(m, n, k, seed=40 + width, batches=batches)
    bias = torch.randn(n, device="cuda", generator=g)
    s = torch.tensor(0.5, device="cuda")
    kernel = evtc.compile(_gelu_fp8, {"a": x, "b": w.transpose(-1, -2), "bias": bias, "s": s},
                          cache_dir=cache, config=_pinned(width))
    got = kernel(x, w.transpose(-1, -2), bias=bias, s=s).float()
    want = F.gelu(x.double() @ w.double().transpose(-1, -2) + bias.double()) * 0.5
    want = want.float().to(torch.float8_e4m3fn).float()
    # One float8 spacing at most (the float32 result may round to either neighbour).
    spacing = torch.exp2(torch.floor(torch.log2(want.abs().clamp(2.0 ** -6, 448.0))) - 3)
    assert ((got - want).abs() <= spacing + 1e-6).all()


def _swiglu_bias(acc, bias):
    gate, up = (acc + bias).chunk(2, dim=-1)
    return F.silu(gate) * up


def test_gated_192(cache):
    m, n, k = 260, 2 * 488, 200
    x, w, g = linear_inputs(m, n, k, seed=77)
    bias = torch.randn(n, device="cuda", generator=g)
    kernel = evtc.compile(_swiglu_bias, {"a": x, "b": w.t(), "bias": bias}, cache_dir=cache,
                          config=_pinned(192))
    config = kernel.launch_for(m, n, k)[0]
    assert (config.tile_n, config.out_tile_n) == (192, 96)
    y = x.double() @ w.double().t() + bias.double()
    gate, up = y.chunk(2, dim=-1)
    assert_close(kernel(x, w.t(), bias=bias), F.silu(gate) * up)


def _bias(acc, bias):
    return acc + bias


@pytest.mark.parametrize("m, n, k, width", [(512, 28672, 256, 176), (512, 37888, 256, 192)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_selectors_launch(cache, m, n, k, width, dtype):
    """The default kernel of a light epilogue launches the wide tile on these sizes (many tiles)."""
    x, w, g = linear_inputs(m, n, k, seed=m + n)
    x, w = x.to(dtype), w.to(dtype)
    bias = torch.randn(n, device="cuda", generator=g)
    kernel = evtc.compile(_bias, {"a": x, "b": w.t(), "bias": bias}, cache_dir=cache)
    config, splits = kernel.launch_for(m, n, k)
    assert (config.schedule, config.tile_m, config.tile_n, config.epi_tile_n) == ("pingpong", 128, width, 16)
    assert_close(kernel(x, w.t(), bias=bias), x.double() @ w.double().t() + bias.double())


@pytest.mark.parametrize("width", WIDTHS)
def test_random_light_epilogues_on_the_wide_tile(cache, width):
    """The fuzzer's random programs whose family has the wide tile, compiled with it pinned so that
    their small, ragged problems run it (tests/fuzz.py --tile), against the function in float32."""
    import fuzz

    fuzz._init(cache, True, width)
    results = [fuzz.run_one(3102, index) for index in range(40)]
    failed = [r for r in results if r["status"] == "failed"]
    assert not failed, "\n\n".join(f"{r.get('case', '')}\n{r['error']}" for r in failed)
    assert sum(r["status"] == "passed" for r in results) >= 3  # 3 (176) and 4 (192) of these 40 have it


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("splits", [2, 3])
def test_split_k_on_the_wide_tile(cache, width, splits):
    """The selector splits a thin last round of wide tiles (the Llama-3 LM head at M = 512 ran
    128 x 192 with 4 splits): the split-K build of each width, a bias and a residual, ragged K."""
    m, n, k = 300, 1000, 1096
    x, w, g = linear_inputs(m, n, k, seed=90 + width + splits)
    C = torch.randn(m, n, device="cuda", generator=g).to(torch.bfloat16)
    bias = torch.randn(n, device="cuda", generator=g)
    row_scale = torch.rand(m, 1, device="cuda", generator=g) + 0.5
    kernel = evtc.compile(residual_scaled, {"a": x, "b": w.t(), "C": C, "bias": bias, "row_scale": row_scale},
                          cache_dir=cache, config={**_pinned(width), "split_k": True})
    kernel.pin_splits(splits)
    assert kernel.launch_for(m, n, k)[1] == splits
    acc = x.double() @ w.double().t()
    assert_close(kernel(x, w.t(), C=C, bias=bias, row_scale=row_scale),
                 torch.relu(acc * row_scale.double() + C.double() + bias.double()))


def test_split_k_on_the_gated_192(cache):
    m, n, k = 260, 2 * 488, 1096
    x, w, g = linear_inputs(m, n, k, seed=99)
    bias = torch.randn(n, device="cuda", generator=g)
    kernel = evtc.compile(_swiglu_bias, {"a": x, "b": w.t(), "bias": bias}, cache_dir=cache,
                          config={**_pinned(192), "split_k": True})
    kernel.pin_splits(3)
    y = x.double() @ w.double().t() + bias.double()
    gate, up = y.chunk(2, dim=-1)
    assert_close(kernel(x, w.t(), bias=bias), F.silu(gate) * up)
