"""bench/split_rule_ab.py without a GPU: the launches it compares, under the rule and the previous
one, and that it puts the rule back."""

from __future__ import annotations

import pytest
import torch
from bench_modules import bench_module

import evtc
from evtc.plan import selector


@pytest.fixture(scope="module")
def ab():
    with bench_module("split_rule_ab") as module:
        yield module


def test_compares_the_model_with_the_bounds_alone(ab, tmp_path):
    bf = torch.bfloat16
    kernel = evtc.compile(ab.identity, {"a": torch.empty(64, 64, dtype=bf, device="meta"),
                                        "b": torch.empty(64, 64, dtype=bf, device="meta").t()},
                          cache_dir=str(tmp_path))
    model = selector.modelled_splits
    # 48 tiles of 64 x 64 at K = 7168: whole now, 2 splits under the bounds alone (measured on the
    # H100: 1.03x cuBLAS whole, 0.98x in 2 splits).
    config, now = ab.launch(kernel, 64, 3072, 7168, previous=False)
    config_before, before = ab.launch(kernel, 64, 3072, 7168, previous=True)
    assert config == config_before and (now, before) == (1, 2)
    assert selector.modelled_splits is model
    # Few tiles with a long K split under both.
    assert ab.launch(kernel, 64, 1024, 8192, previous=False)[1] > 1
    assert ab.launch(kernel, 64, 1024, 8192, previous=True)[1] > 1
    assert len(ab.WEIGHTS.split(",")) >= 20
