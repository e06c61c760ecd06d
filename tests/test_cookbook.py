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
    assert len(built) == 4 and all(isinstance(k, evtc.Kernel) for k in built)
    assert [k.graph.name for k in built] == ["bias_act", "gelu_residual", "scaled", "relu_fp8"]
    for name in ("bias_act", "gelu_residual", "scaled", "relu_fp8", "linear_relu"):
        assert name in namespace
    assert namespace["lin"].kernel.config.b_major == "k"


def _cpu_inputs(names_shapes):
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=g).half() for n, s in names_shapes.items()}


def test_coming_recipes_fail_clearly_and_have_references(namespace):
    m, n, k = 64, 128, 32
    x = _cpu_inputs({"a": (m, k), "b": (k, n), "bias": (n,)})
    meta = {key: v.to("meta") for key, v in x.items()}
    scale = torch.tensor([0.5])
    with pytest.raises(evtc.ReductionError, match="does not compile reductions yet"):
        evtc.compile(namespace["fp8_with_amax"], {**meta, "scale": scale.to("meta")})
    with pytest.raises(evtc.ReductionError):
        evtc.compile(namespace["gelu_row_norm"], meta)
    with pytest.raises(evtc.UnsupportedOpError, match="chunk"):
        evtc.trace(namespace["swiglu"], {"a": meta["a"], "b": meta["b"]})
    # The references of the reductions evaluate, and agree with the functions on float32 tensors.
    y8, amax = evtc.reference(namespace["fp8_with_amax"], {**x, "scale": scale})
    acc = x["a"].float() @ x["b"].float()
    assert torch.allclose(amax, (acc + x["bias"].float()).abs().amax(), rtol=1e-5)
    y, sq = evtc.reference(namespace["gelu_row_norm"], x)
    assert sq.shape == (m,) and torch.allclose(sq, (y.float() ** 2).sum(-1), rtol=1e-2)
