"""CPU: Kernel.prebuild builds the variants that given problem sizes launch (in place, or in a
background worker process through the disk cache), so that those calls compile nothing."""

from __future__ import annotations

import pytest
import torch

import evtc
from evtc.compile import clear_memory_cache
from evtc.runtime import prebuild


@pytest.fixture(autouse=True)
def _fresh_memory():
    # Kernels are remembered in memory by their code, whatever the cache directory: start afresh so
    # that each test's variants come from its own cache.
    clear_memory_cache()
    yield
    clear_memory_cache()


SHAPES = [(16, 4096, 4096), (4096, 4096, 4096), (64, 1024, 8192), (4096, 4096, 4096, 2)]


def bias_relu(acc, bias):
    return torch.relu(acc + bias)


def _compile(cache_dir) -> evtc.Kernel:
    example = {"a": torch.empty(256, 128, dtype=torch.bfloat16, device="meta"),
               "b": torch.empty(512, 128, dtype=torch.bfloat16, device="meta").t(),
               "bias": torch.empty(512, dtype=torch.bfloat16, device="meta")}
    return evtc.compile(bias_relu, example, cache_dir=str(cache_dir))


def _expected(k: evtc.Kernel) -> list:
    """The configurations the calls launch, from launch_for (independent of prebuild)."""
    out = []
    for shape in SHAPES:
        config, splits = k.launch_for(*shape)
        config = config.replace(split_k=True) if splits > 1 else config
        if config not in out:
            out.append(config)
    return out


def test_prebuild_builds_what_the_calls_launch(tmp_path):
    k = _compile(tmp_path)
    expected = _expected(k)
    # Decode sizes take other tiles, one of them with split K: at least two variants to build.
    assert len([c for c in expected if c != k.config]) >= 2 and any(c.split_k for c in expected)
    handle = k.prebuild(SHAPES)
    assert handle.done() and list(handle.configs) == expected
    for config in expected:
        if config != k.config:
            assert config in k._variants and k._variants[config].ptx, config.short_name()
    # Built once: a second prebuild finds them all.
    before = dict(k._variants)
    k.prebuild(SHAPES)
    assert k._variants == before


def test_prebuild_in_the_background_fills_the_disk_cache(tmp_path):
    k = _compile(tmp_path)
    handle = k.prebuild(SHAPES, wait=False)
    assert "configuration(s)" in repr(handle)
    handle.wait(timeout=600)
    assert handle.done()
    # This process has built none of them; each now loads from the disk cache.
    for config in handle.configs:
        if config != k.config:
            assert config not in k._variants
            assert k._variant(config).origin == "disk", config.short_name()


def test_prebuild_rejects_bad_shapes_and_reports_failed_builds(tmp_path):
    k = _compile(tmp_path)
    for bad in [(16, 4096), (16, 4096, 0), (16, 4096, 4096, 1, 1), (16.0, 4096, 4096)]:
        with pytest.raises(ValueError, match="prebuild: each shape"):
            k.prebuild([bad])
    job = {"plan": "not a plan", "source": "", "signature": {}, "config": {}, "arch": None,
           "cache_dir": str(tmp_path)}
    with pytest.raises(RuntimeError, match="background build failed"):
        prebuild.start([job], ()).wait(timeout=300)


def test_a_fixed_configuration_has_nothing_to_prebuild(tmp_path):
    example = {"a": torch.empty(256, 128, dtype=torch.bfloat16, device="meta"),
               "b": torch.empty(512, 128, dtype=torch.bfloat16, device="meta").t(),
               "bias": torch.empty(512, dtype=torch.bfloat16, device="meta")}
    k = evtc.compile(bias_relu, example, config={"tile_m": 128, "tile_n": 128, "cluster": (1, 2)},
                     cache_dir=str(tmp_path))
    handle = k.prebuild(SHAPES)
    assert handle.configs == (k.config,) and handle.done()
