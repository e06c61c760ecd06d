"""A kernel in a real program's life: copies and pickles of what holds one, forks, cache
directories (spaces in the path, EVTC_CACHE_DIR changed in the process), the example tensors'
memory, torch's default dtype and device, and the DSL settings that change the generated code."""

from __future__ import annotations

import copy
import gc
import os
import pickle
import weakref

import pytest
import torch

import evtc
from evtc.runtime.front_key import versions


def bias_relu(acc, bias):
    return torch.relu(acc + bias)


def made_constant(acc):
    return acc * torch.tensor([2.0])


def _example(m=16, n=24, k=32):
    return {"a": torch.randn(m, k).half(), "b": torch.randn(k, n).half(), "bias": torch.randn(n)}


def test_copies_share_the_kernel_and_pickling_is_refused_by_name(tmp_path):
    k = evtc.compile(bias_relu, _example(), cache_dir=tmp_path)
    assert copy.deepcopy(k) is k and copy.copy(k) is not k
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(k)
    lin = evtc.linear(bias_relu, {"x": torch.randn(4, 32).half(), "weight": torch.randn(24, 32).half(),
                                  "bias": torch.randn(24)}, cache_dir=tmp_path)
    assert copy.deepcopy(lin) is lin
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(lin)


def test_example_tensors_are_not_kept_alive(tmp_path):
    """A kernel loaded through its front record keeps meta copies of its examples, not the tensors
    (on a GPU, the whole of A, B and C)."""
    from evtc.compile import clear_memory_cache

    evtc.compile(bias_relu, _example(), cache_dir=tmp_path)
    clear_memory_cache()
    example = _example()
    watched = weakref.ref(example["b"])
    k = evtc.compile(bias_relu, example, cache_dir=tmp_path)
    assert k.origin == "disk"
    del example
    gc.collect()
    assert watched() is None


def test_cache_directories_with_spaces_and_changed_in_the_process(tmp_path, monkeypatch):
    from evtc.compile import clear_memory_cache

    spaced = tmp_path / "a cache dir"
    assert evtc.compile(bias_relu, _example(), cache_dir=spaced).origin == "compiled"
    clear_memory_cache()
    for name in ("one", "two"):
        monkeypatch.setenv("EVTC_CACHE_DIR", str(tmp_path / name))
        evtc.compile(bias_relu, _example())
        assert (tmp_path / name).is_dir() and any((tmp_path / name).iterdir())


def test_the_default_dtype_and_device_of_made_constants(tmp_path):
    """torch.tensor([2.0]) takes torch's default dtype, so the default dtype is part of the key: a
    float16 default gives float16 outputs, as eagerly; a float64 one is refused by name (no kernel
    computes float64). Constants are made on the CPU whatever the default device."""
    example = {"a": torch.randn(16, 32).half(), "b": torch.randn(32, 24).half()}
    previous = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float16)
        assert evtc.compile(made_constant, example, cache_dir=tmp_path).output_meta(16, 24, 1)[0][1] \
            == made_constant(example["a"] @ example["b"]).dtype == torch.float16
        torch.set_default_dtype(torch.float64)
        with pytest.raises(evtc.DTypeError, match="a float64 tensor made in the epilogue"):
            evtc.compile(made_constant, example, cache_dir=tmp_path)
    finally:
        torch.set_default_dtype(previous)
    def output_dtype(example):
        return evtc.compile(made_constant, example, cache_dir=tmp_path).output_meta(16, 24, 1)[0][1]

    assert output_dtype(example) == torch.float32
    with torch.device("meta"):
        assert output_dtype({"a": torch.empty(16, 32, dtype=torch.half),
                             "b": torch.empty(32, 24, dtype=torch.half)}) == torch.float32


def test_dsl_settings_that_change_the_code_change_the_key(monkeypatch):
    before = versions()
    monkeypatch.setenv("CUTE_DSL_LINEINFO", "1")
    assert versions() != before
    monkeypatch.delenv("CUTE_DSL_LINEINFO")
    monkeypatch.setenv("CUTE_DSL_LOG_LEVEL", "10")
    assert versions() == before


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_fork_taken_while_the_dsl_lock_is_held_compiles_in_the_child(tmp_path):
    """Another thread building at the fork holds the DSL's lock, and nobody releases it in the child."""
    from evtc.runtime.dsl_lock import DSL_LOCK

    with DSL_LOCK:
        pid = os.fork()
        if pid == 0:  # the child: compile something new, then leave without pytest's teardown
            code = 1
            try:
                evtc.compile(bias_relu, _example(8, 8, 8), cache_dir=tmp_path / "child")
                code = 0
            finally:
                os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_jit_trace_records_the_kernel_as_one_op(tmp_path):
    """torch.jit.trace sees the call as the kernel's custom operator: a replay on new inputs runs the
    epilogue, not the traced call's output allocation."""
    ex = {"a": torch.randn(16, 32), "b": torch.randn(32, 24), "bias": torch.randn(24)}
    k = evtc.compile(bias_relu, ex, cache_dir=tmp_path)

    class Block(torch.nn.Module):
        def forward(self, a, b, bias):
            return k(a, b, bias=bias)

    traced = torch.jit.trace(Block(), (ex["a"], ex["b"], ex["bias"]))
    assert any(node.kind().startswith("evtc::") for node in traced.graph.nodes())
    a = torch.randn(16, 32)
    torch.testing.assert_close(traced(a, ex["b"], ex["bias"]), bias_relu(a @ ex["b"], ex["bias"]))


def test_a_cache_that_takes_no_new_kernel_builds_in_a_private_one(tmp_path, caplog):
    """A read-only home in a container, a full disk, a path through a file: the kernel is built in a
    temporary directory for this process, and the warning says how to keep kernels."""
    blocker = tmp_path / "a file"
    blocker.write_text("")
    with caplog.at_level("WARNING", logger="evtc"):
        k = evtc.compile(bias_relu, _example(), cache_dir=blocker / "cache")
    assert k.origin == "compiled" and "EVTC_CACHE_DIR" in caplog.text
    assert not str(k.cache_path).startswith(str(blocker))


def test_vmap_runs_the_kernel_per_sample(tmp_path):
    """torch.func.vmap's batched tensors have no storage to launch on: the call goes through the
    kernel's custom operator, which vmap runs per sample."""
    a, b, bias = torch.randn(4, 16, 32), torch.randn(32, 24), torch.randn(24)
    k = evtc.compile(bias_relu, {"a": a[0], "b": b, "bias": bias}, cache_dir=tmp_path)
    got = torch.func.vmap(lambda x: k(x, b, bias=bias))(a)
    torch.testing.assert_close(got, bias_relu(a @ b, bias))


def test_fake_tensors_get_the_operators_shapes_and_make_fx_records_it(tmp_path):
    """Under FakeTensorMode (shape inference, memory estimators) a call returns fake outputs of
    the right shapes and dtypes without launching; make_fx records the custom operator."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    def with_sum(acc, bias):
        return torch.relu(acc + bias), (acc * acc).sum(-1)

    ex = {"a": torch.randn(16, 32), "b": torch.randn(32, 24), "bias": torch.randn(24)}
    k = evtc.compile(with_sum, ex, cache_dir=tmp_path)
    with FakeTensorMode() as mode:
        y, s = k(mode.from_tensor(ex["a"]), mode.from_tensor(ex["b"]), bias=mode.from_tensor(ex["bias"]))
    assert (tuple(y.shape), tuple(s.shape), y.dtype) == ((16, 24), (16,), torch.float32)
    graph = make_fx(lambda a, b, bias: k(a, b, bias=bias), tracing_mode="fake")(*ex.values())
    assert any(str(n.target).startswith("evtc.") for n in graph.graph.nodes if n.op == "call_function")
    torch.testing.assert_close(graph(*ex.values())[0], torch.relu(ex["a"] @ ex["b"] + ex["bias"]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
def test_compiles_for_hopper_without_a_gpu_or_an_arch(tmp_path):
    """No GPU and no CUTE_DSL_ARCH: the DSL would target its own default architecture and fail deep
    inside; evtc compiles for sm_90a (calls then take the torch path on this machine)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import torch, evtc
        h = torch.float16
        a, b = torch.randn(16, 32, dtype=h), torch.randn(32, 48, dtype=h)
        k = evtc.compile(lambda acc: acc * 11.0, dict(a=a, b=b))
        y = k(a, b)
        torch.testing.assert_close(y.float(), (a.float() @ b.float() * 11.0).half().float())
        print("ok", k.last_path)
    """)
    env = {k: v for k, v in os.environ.items() if k != "CUTE_DSL_ARCH"}
    env["EVTC_CACHE_DIR"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ok torch" in done.stdout
