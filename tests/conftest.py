"""Shared pytest set-up: the `gpu` marker, a CPU-only DSL target, and a disk cache per test module."""

from __future__ import annotations

import os

import pytest

# Without a GPU the CuTe DSL still compiles kernels when told which architecture to target.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


def _have_hopper_gpu() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return False
    if not torch.cuda.is_available():
        return False
    major, _ = torch.cuda.get_device_capability()
    return major == 9


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _have_hopper_gpu():
        return
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA Hopper (SM90) GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest):
    """A disk cache of the test module's own (its kernels compiled once for all its tests, apart
    from the user's cache and from other modules')."""
    return tmp_path_factory.mktemp("evtc-" + request.module.__name__.rpartition(".")[2].removeprefix("test_"))
