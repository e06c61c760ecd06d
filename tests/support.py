"""Helpers shared by the IR tests: random problems and comparison with the direct function."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import evtc

#: (M, N, K, L): square (M == N), odd sizes, and batched; L None means unbatched.
SHAPES = [(32, 32, 16, None), (37, 53, 19, None), (24, 40, 8, 3), (16, 16, 8, 2)]


def gemm_inputs(m: int, n: int, k: int, batch: int | None, dtype: torch.dtype = torch.float16,
                seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lead = () if batch is None else (batch,)
    a = torch.randn(*lead, m, k, generator=g).to(dtype)
    b = torch.randn(*lead, k, n, generator=g).to(dtype)
    return {"a": a, "b": b}


def rand(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def flatten(value: Any) -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return list(value.items())
    if isinstance(value, tuple | list):
        return [(str(i), v) for i, v in enumerate(value)]
    return [("", value)]


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    # One rounding of the output dtype apart, plus float32 reassociation in the passes.
    return {
        torch.float32: dict(rtol=2e-5, atol=2e-5),
        torch.float16: dict(rtol=2e-3, atol=2e-3),
        torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
        torch.float8_e4m3fn: dict(rtol=0.13, atol=0.02),
        torch.float8_e5m2: dict(rtol=0.26, atol=0.04),
        torch.bool: dict(rtol=0, atol=0),  # a mask: exactly torch's
    }[dtype]


def assert_same_outputs(graph_out: Any, ref_out: Any) -> None:
    """Graph outputs (in their store dtypes) against the function's float32 outputs."""
    got, want = flatten(graph_out), flatten(ref_out)
    assert [k for k, _ in got] == [k for k, _ in want], "output structure differs"
    for (key, g), (_, w) in zip(got, want, strict=True):
        assert isinstance(g, torch.Tensor) and isinstance(w, torch.Tensor)
        assert tuple(g.shape) == tuple(w.shape), f"output {key!r}: shape {tuple(g.shape)} vs {tuple(w.shape)}"
        expected = w.to(g.dtype).float() if g.dtype != torch.float32 else w.float()
        torch.testing.assert_close(g.float(), expected, equal_nan=True, **tolerance(g.dtype),
                                   msg=lambda m, key=key: f"output {key!r}: {m}")


def eager_dtypes(fn: Callable[..., Any], inputs: dict[str, Any]) -> list[torch.dtype]:
    """The dtype of each output of `fn` run by torch itself on ``acc = a @ b`` in a's dtype (on
    meta tensors, which follow torch's promotion rules without computing): the dtypes evtc's
    outputs take (a boolean mask is a bool tensor in both)."""
    a, b = inputs["a"], inputs["b"]
    fn = getattr(fn, "__wrapped__", fn)
    acc = torch.empty(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]),
                      dtype=a.dtype, device="meta")
    params = list(__import__("inspect").signature(fn).parameters)[1:]
    operands = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v)
                for k, v in inputs.items() if k in params}
    try:
        out = fn(acc, **operands)
    except (NotImplementedError, RuntimeError):  # no meta kernel, or a CPU constant it makes: on the CPU
        out = fn(torch.zeros(acc.shape, dtype=a.dtype), **{k: v for k, v in inputs.items() if k in params})
    return [v.dtype for _, v in flatten(out)]


def check_epilogue(fn: Callable[..., Any], inputs: dict[str, Any], **trace_kwargs: Any) -> evtc.Graph:
    """Trace `fn`, optimize it, evaluate the graph and compare with the function run directly; the
    outputs' dtypes are those torch gives the function (unless the trace overrides them)."""
    graph = evtc.trace(fn, inputs, **trace_kwargs)
    raw = evtc.trace(fn, inputs, optimize_graph=False, **trace_kwargs)
    ref = evtc.reference(fn, inputs)
    assert_same_outputs(graph.evaluate(inputs), ref)
    assert_same_outputs(raw.evaluate(inputs), ref)
    if "out_dtypes" not in trace_kwargs and inputs["a"].dtype.itemsize > 1:
        assert [s.dtype for s in graph.stores] == eager_dtypes(fn, inputs), "dtypes differ from torch"
    return graph


def precompiled_cache(tmp_path_factory, name: str, compile_fn: Callable[..., Any], jobs: list[tuple],
                      *, allow_errors: bool = False) -> str:
    """A disk cache holding ``compile_fn(*job, path)`` for every job, compiled once per test run by a
    process pool: pytest-xdist workers share it (the first compiles under a file lock, the others
    wait and then load from disk) instead of each compiling everything again. Returns its path.
    ``compile_fn`` may return an error text: an assertion error names them all, unless
    ``allow_errors`` (refusals the tests themselves expect)."""
    import concurrent.futures
    import fcntl
    import multiprocessing
    import os

    root = tmp_path_factory.getbasetemp()
    shared = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    path = shared / name
    path.mkdir(exist_ok=True)
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / "complete").exists():
            ctx = multiprocessing.get_context("spawn")
            workers = max(1, min(len(jobs), os.cpu_count() or 2))
            with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
                futures = [pool.submit(compile_fn, *job, str(path)) for job in jobs]
                errors = [e for e in (f.result() for f in futures) if e]
            assert allow_errors or not errors, errors
            (path / "complete").touch()
    return str(path)
