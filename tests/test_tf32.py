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


_FAMILY_SCRIPT = """
import sys, torch, evtc
def fn(acc, C):
    return acc + C
ex = {"a": torch.empty(256, 512), "b": torch.empty(768, 512).t(), "C": torch.empty(256, 768)}
k = evtc.compile(fn, ex, arch="sm_90a", cache_dir=sys.argv[1])
for cfg in k._family:
    for cluster in ((1, 1), (2, 1), (1, 2)):
        one = cfg.replace(cluster=cluster)
        k._variant(one)
        print(one.short_name(), flush=True)
print("done")
"""


def test_every_configuration_of_the_float32_family_builds(tmp_path):
    """Each tile of a float32 kernel's family in each cluster shape builds, in a process of its own:
    the DSL aborts the process (no Python error) on some float32 tiles (112 or 144 columns), and
    this is where a new width or rule that admits such a tile would show."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a"}
    run = subprocess.run([sys.executable, "-c", _FAMILY_SCRIPT, str(tmp_path)], capture_output=True,
                         text=True, env=env, timeout=1200)
    assert run.returncode == 0 and run.stdout.rstrip().endswith("done"), (
        f"exit {run.returncode}; built before it stopped:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
    assert len(run.stdout.splitlines()) > 12


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


class _KernelPathTaken(Exception):
    """Raised by a stubbed kernel launch: the call chose the kernel."""


def _stub_kernel_launch(*args, **kwargs):
    raise _KernelPathTaken


@pytest.fixture
def restore_tf32_settings():
    matmul = torch.backends.cuda.matmul
    new_api = hasattr(matmul, "fp32_precision")
    before = matmul.fp32_precision if new_api else matmul.allow_tf32
    yield new_api
    if new_api:
        torch.backends.fp32_precision = "none"
        matmul.fp32_precision = before
    else:
        matmul.allow_tf32 = before


def test_each_call_follows_torchs_tf32_setting_old_and_new_api(tmp_path, restore_tf32_settings):
    """The kernel is chosen only while torch would use tf32, however that was said: the legacy flag,
    set_float32_matmul_precision, or (torch >= 2.9) fp32_precision, whose use makes reading the
    legacy flag raise. Off, the call is computed in full float32 by torch."""
    ex = _k_major(64, 96, 128) | {"bias": torch.randn(96)}
    kern = evtc.compile(relu_bias, ex, cache_dir=tmp_path)
    kern._kernel_runs = True  # as on a Hopper GPU
    kern._run_kernel = _stub_kernel_launch
    want = relu_bias(ex["a"].double() @ ex["b"].double(), ex["bias"].double())
    matmul = torch.backends.cuda.matmul

    def chose_kernel() -> bool:
        try:
            got = kern(**ex)
        except _KernelPathTaken:
            return True
        assert kern.last_path == "torch"
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4)
        return False

    matmul.allow_tf32 = False
    assert not chose_kernel()
    matmul.allow_tf32 = True
    assert chose_kernel()
    torch.set_float32_matmul_precision("highest")
    assert not chose_kernel()
    torch.set_float32_matmul_precision("high")
    assert chose_kernel()
    if restore_tf32_settings:  # the new API
        matmul.fp32_precision = "ieee"
        assert not chose_kernel()
        matmul.fp32_precision = "tf32"
        assert chose_kernel()
        matmul.fp32_precision = "none"
        torch.backends.fp32_precision = "tf32"  # inherited by matmul
        assert chose_kernel()
        torch.backends.fp32_precision = "ieee"
        assert not chose_kernel()
