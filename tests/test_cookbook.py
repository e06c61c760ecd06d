"""docs/cookbook.md runs: every python block, in order, in one namespace (kernels compile for
sm_90a without a GPU); the recipes it lists as coming next fail with the errors it names, and their
references evaluate."""

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
                                             "fp8_with_amax", "gelu_row_stats"]
    assert namespace["lin"].kernel.config.b_major == "k"
    amax_kernel = built[4]
    assert amax_kernel.config.d_dtype == "float8_e4m3fn" and len(amax_kernel._emitted.reductions) == 1


def _cpu_inputs(names_shapes):
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=g).half() for n, s in names_shapes.items()}


def test_coming_recipes_fail_clearly_and_have_references(namespace):
    m, n, k = 64, 128, 32
    x = _cpu_inputs({"a": (m, k), "b": (k, n), "bias": (n,)})
    meta = {key: v.to("meta") for key, v in x.items()}
    with pytest.raises(evtc.ReductionError, match="per-column reductions"):
        evtc.compile(namespace["column_sums"], meta)
    with pytest.raises(evtc.UnsupportedOpError, match="chunk"):
        evtc.trace(namespace["swiglu"], {"a": meta["a"], "b": meta["b"]})
    y, sums = evtc.reference(namespace["column_sums"], x)
    assert sums.shape == (n,) and torch.allclose(sums, y.float().sum(0), rtol=1e-3, atol=1e-3)
