"""docs/cookbook.md runs: every python block, in order, in one namespace (kernels compile for
sm_90a without a GPU), and the references of its recipes are what torch computes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import evtc

COOKBOOK = Path(__file__).resolve().parents[1] / "docs" / "cookbook.md"


@pytest.fixture(scope="module")
def namespace(tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("EVTC_CACHE_DIR", str(tmp_path_factory.mktemp("cookbook-cache")))
    blocks = re.findall(r"```python\n(.*?)```", COOKBOOK.read_text(), re.S)
    assert len(blocks) >= 7
    ns: dict = {"built": []}
    for block in blocks:
        ns.pop("k", None)
        exec(compile(block, str(COOKBOOK), "exec"), ns)  # noqa: S102 - our own documentation
        if "k" in ns:
            ns["built"].append(ns["k"])
    return ns


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_recipes_compile(namespace):
    built = namespace["built"]
    assert all(isinstance(k, evtc.Kernel) for k in built)
    assert [k.graph.name for k in built] == ["bias_act", "gelu_residual", "scaled", "relu_fp8",
                                             "fp8_with_amax", "gelu_row_stats", "fp8_layer",
                                             "fp8_block_layer", "column_stats", "geglu_bias"]
    fp8 = built[6]  # float8 inputs: K-major a and b, the 8-bit wgmma, a float8 output and its amax
    assert fp8.plan.a.dtype == fp8.plan.b.dtype == "float8_e4m3fn" and fp8.config.promotes
    assert "e4m3.e4m3" in fp8.ptx and fp8.config.d_dtype == "float8_e4m3fn"
    assert namespace["lin"].kernel.config.b_major == "k"
    blocks = built[7]  # block scales: 1 x 128 for a, 128 x 128 for b, applied in the mainloop
    assert blocks.config.block_scales == 1 and blocks.plan.a_scales.dims == ("M", "KB")
    amax_kernel = built[4]
    assert amax_kernel.config.d_dtype == "float8_e4m3fn" and len(amax_kernel.plan.reductions) == 1


def _cpu_inputs(names_shapes):
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=g).half() for n, s in names_shapes.items()}


def test_gated_and_column_recipes_compile_and_match_torch(namespace):
    """The SwiGLU and column-statistics recipes compile for the shapes they name, and their
    references are what torch computes."""
    built = {k.graph.name: k for k in namespace["built"]}
    mlp = namespace["mlp"]
    assert mlp.kernel.config.gated and mlp.kernel.config.b_major == "k"
    assert built["geglu_bias"].config.gated and "bias.gate" in built["geglu_bias"].graph.operands
    assert len(built["column_stats"].plan.reductions) == 2
    m, n, k = 64, 128, 32
    x = _cpu_inputs({"a": (m, k), "b": (k, n), "bias": (n,)})
    y, sums, absmax = evtc.reference(namespace["column_stats"], x)
    assert sums.shape == (n,) and torch.allclose(sums, y.float().sum(0), rtol=1e-3, atol=1e-3)
    assert torch.equal(absmax, y.float().abs().amax(0))
    acc = x["a"].float() @ x["b"].float()
    gate, up = acc[:, : n // 2], acc[:, n // 2:]
    got = evtc.reference(namespace["swiglu"], {"a": x["a"], "b": x["b"]})
    assert got.shape == (m, n // 2)
    assert torch.allclose(got, gate * torch.sigmoid(gate) * up, rtol=1e-5, atol=1e-5)
