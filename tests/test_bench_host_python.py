"""bench/host_python.py on the CPU machine: a stubbed call runs evtc's whole call path (the kernel
path, with its outputs in the epilogue's structure and shapes) and launches nothing."""

from __future__ import annotations

import pytest
import torch
from bench_modules import bench_module


@pytest.fixture(scope="module")
def host_python():
    with bench_module("host_python") as module:
        yield module


def test_a_stubbed_call_takes_the_kernel_path_and_returns_the_epilogues_structure(host_python, tmp_path):
    rows = host_python.measure(["identity", "aux_outputs", "swiglu"], str(tmp_path), reps=20, rounds=2)
    assert [r[0] for r in rows] == ["identity", "aux_outputs", "swiglu"]
    assert all(call > 0 and add > 0 for _, call, add in rows)


def test_the_stub_leaves_outputs_unwritten_but_shaped(host_python, tmp_path):
    from compile_catalogue import CATALOGUE, make_inputs

    import evtc

    entry = next(e for e in CATALOGUE if e.name == "aux_outputs")
    example = make_inputs(entry, 64, 128, 32, None, torch.float16, "meta")
    kernel = evtc.compile(entry.fn, example, cache_dir=str(tmp_path), arch="sm_90a")
    call = host_python.stubbed(kernel, make_inputs(entry, 64, 128, 32, None, torch.float16, "cpu"))
    result = call()
    reference = evtc.reference(entry.fn, make_inputs(entry, 64, 128, 32, None, torch.float16, "cpu"))
    assert isinstance(result, tuple) and len(result) == len(reference)
    for got, want in zip(result, reference, strict=True):
        assert got.shape == want.shape
    assert kernel.last_path == "kernel"


def test_out_halves_writes_both_outputs_into_one_buffer(host_python, tmp_path):
    """``NAME@out_halves``: the call returns the halves of one buffer, in the epilogue's structure
    (a dict here), and the row is named for the variant."""
    from compile_catalogue import CATALOGUE, make_inputs

    import evtc

    entry = next(e for e in CATALOGUE if e.name == "dict_outputs")
    example = make_inputs(entry, 64, 128, 32, None, torch.float16, "meta")
    kernel = evtc.compile(entry.fn, example, cache_dir=str(tmp_path), arch="sm_90a")
    call = host_python.stubbed(kernel, make_inputs(entry, 64, 128, 32, None, torch.float16, "cpu"),
                               out_halves=True)
    result = call()
    assert isinstance(result, dict) and set(result) == {"out", "pre"}
    first, second = result["out"], result["pre"]
    assert first.shape == second.shape == (64, 128) and first.stride() == (256, 1)
    assert second.data_ptr() == first.data_ptr() + 128 * first.element_size()
    rows = host_python.measure(["dict_outputs@out_halves"], str(tmp_path), reps=5, rounds=1)
    assert [r[0] for r in rows] == ["dict_outputs@out_halves"]
