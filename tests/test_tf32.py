"""float32 a and b (issue "FP8 inputs", its tf32 item): what compiles to the tf32 wgmma, what keeps
the torch path and why (CPU). The kernels' results on the GPU: tests/test_tf32_gpu.py."""

from __future__ import annotations

import re

import pytest
import torch

import evtc
from evtc.plan.config import ConfigError, GemmConfig


def relu_bias(acc, bias):
    return torch.relu(acc + bias)


def swiglu(acc):
    gate, up = acc.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _k_major(m, n, k):
    return {"a": torch.randn(m, k), "b": torch.randn(n, k).t()}


def _wgmmas(ptx: str) -> set[tuple[str, str]]:
    return set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k(\d+)\.([\w.]+)", ptx))


@pytest.mark.parametrize("fn", [relu_bias, swiglu], ids=["relu_bias", "swiglu"])
def test_k_major_float32_compiles_to_the_tf32_wgmma(tmp_path, fn):
    ex = _k_major(128, 512, 256) | ({"bias": torch.randn(512)} if fn is relu_bias else {})
    k = evtc.compile(fn, ex, cache_dir=tmp_path)
    assert not k.interface.torch_only
    assert _wgmmas(k.ptx) == {("8", "f32.tf32.tf32")}
    assert k.config.ab_dtype == "float32" and k.config.tile_k == 32
    assert k.plan.outputs[0].dtype == "float32"  # outputs follow a and b, as torch's would
    assert "f32->f32" in k.explain()


def test_the_tf32_kernels_of_other_tiles_compile_too(tmp_path):
    """Ping-pong 64-row tiles, cooperative wide tiles and split-K: the family a call may pick."""
    ex = _k_major(64, 256, 256)
    for knobs in ({"schedule": "pingpong", "tile_m": 64, "tile_n": 64},
                  {"schedule": "cooperative", "tile_n": 256},
                  {"schedule": "pingpong", "tile_m": 64, "tile_n": 128, "split_k": True}):
        k = evtc.compile(lambda acc: acc, ex, cache_dir=tmp_path, config={**knobs, "cluster": (1, 1)})
        assert _wgmmas(k.ptx) == {("8", "f32.tf32.tf32")}, knobs


def test_a_float32_config_must_be_k_major():
    assert GemmConfig(ab_dtype="float32", b_major="k").tile_k == 32
    for majors in ({"b_major": "n"}, {"a_major": "m", "b_major": "k"}):
        with pytest.raises(ConfigError, match="tf32 wgmma reads both operands along K"):
            GemmConfig(ab_dtype="float32", **majors).validate()
    # B blocks of 112 or 144 columns abort the process in the DSL; multiples of 32 compile.
    for tile_n, gated in ((112, False), (144, False), (160, True)):
        with pytest.raises(ConfigError, match="multiples of 32 columns"):
            GemmConfig(ab_dtype="float32", b_major="k", schedule="cooperative", tile_n=tile_n, epi_tile_n=16,
                       gated=gated).validate()
    GemmConfig(ab_dtype="float32", b_major="k", schedule="cooperative", tile_n=192, gated=True).validate()


@pytest.mark.parametrize("layout", ["b row-major", "a column-major"])
def test_float32_examples_that_are_not_k_major_keep_the_torch_path(tmp_path, layout):
    m, n, k = 64, 96, 128
    ex = _k_major(m, n, k) | {"bias": torch.randn(n)}
    if layout == "b row-major":
        ex["b"] = ex["b"].contiguous()
    else:
        ex["a"] = ex["a"].t().contiguous().t()
    kern = evtc.compile(relu_bias, ex, cache_dir=tmp_path)
    assert kern.interface.torch_only and "K-major" in kern.interface.torch_only
    assert "no SM90 kernel" in kern.source
    got = kern(**ex)
    assert kern.last_path == "torch"
    want = relu_bias(ex["a"].double() @ ex["b"].double(), ex["bias"].double())
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4)
    with pytest.raises(evtc.CompileError, match="K-major.*strict=True"):
        evtc.compile(relu_bias, ex, cache_dir=tmp_path, strict=True)
