"""Reduction kernels that need no GPU to check: the per-call variants (tiles, clusters, a_rows,
split-K) that tests/test_reduction_edges_gpu.py launches, for gated and batched epilogues full of
reductions, build for sm_90a without a crash in the DSL. First written as an adversarial probe of
reductions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import evtc

A = torch.randn(64, 64, dtype=torch.float16)
B = torch.randn(64, 96, dtype=torch.float16)


def _glu(acc):
    gate, up = acc.chunk(2, dim=-1)
    h = F.silu(gate) * up
    return h, h.pow(2).mean(-1), h.amax(-2), h.abs().amax(), h.float().sum(-1, keepdim=True), h.amin()


def _bat(acc, bias):
    y = acc + bias
    return (y.sum(-1), y.amax(-2, keepdim=True), y.float().sum((-2, -1)), y.amin(),
            y.mean((-1, -2), keepdim=True), y.amax(dim=(0, 1, 2), keepdim=True), y.float().mean(-2))


@pytest.mark.parametrize("which", ["gated", "batched"])
def test_reduction_kernel_variants_compile(tmp_path, which):
    if which == "gated":
        k = evtc.compile(_glu, dict(a=A, b=torch.randn(256, 64, dtype=torch.float16).t()), cache_dir=tmp_path)
        k.prebuild([(3, 200, 64), (100, 400, 128), (257, 528, 64), (64, 2048, 8192)])
    else:
        h = torch.float16
        ex = dict(a=torch.randn(2, 64, 64, dtype=h), b=torch.randn(2, 64, 96, dtype=h),
                  bias=torch.randn(2, 1, 96, dtype=h))
        k = evtc.compile(_bat, ex, cache_dir=tmp_path)
        k.prebuild([(130, 72, 64, 3), (5, 200, 64, 1), (1, 8, 64, 4), (300, 264, 128, 2)])
    assert k.explain()
