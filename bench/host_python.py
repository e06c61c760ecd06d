"""evtc's own Python per call, on any machine: the call path with the compiled function replaced by
a function that does nothing, timed against ``x.add_(1)`` on CPU tensors.

bench/host.py times real calls on the GPU machine, whose host is shared and noisy (``x.add_(1)``
moves between 6 and 12 us there from run to run). This measures only what evtc's Python adds (the
checks, a gated call's views, the outputs' allocation, the result's structure), steadily enough to
compare two versions of the call path on the CPU machine:

    CUTE_DSL_ARCH=sm_90a python3 bench/host_python.py --names identity,swiglu,aux_outputs

The kernels are compiled for sm_90a (no GPU needed); each call takes the kernel path up to the
launch, which does nothing. Reductions finished in the kernel need a GPU for their buffers: those
epilogues are skipped.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

DEFAULT_NAMES = ("identity,relu_lincomb_bias,aux_outputs,dict_outputs,dict_outputs@out_halves,swiglu,"
                 "geglu_bias_residual,swiglu_wide_c")


def stubbed(kernel, inputs: dict, out_halves: bool = False):
    """A call of ``kernel`` on CPU ``inputs`` that runs the whole call path but launches nothing:
    returns the call as a function of no arguments. ``out_halves``: its two outputs (of one shape
    and dtype) written through ``out=`` into the left and right halves of one buffer, as the fused
    MLP backward writes dZ1 (the check that out= targets share no element runs on each call)."""
    a, b = inputs["a"], inputs["b"]
    operands = {n: v for n, v in inputs.items() if n not in ("a", "b")}
    m, n, k = a.shape[-2], b.shape[-1], a.shape[-1]
    batches = a.shape[0] if a.dim() == 3 else 1
    if kernel.plan.gated:
        n //= 2
    kernel._kernel_runs = True  # as on a Hopper GPU
    kernel._launch_memo[(m, n, k, batches, a.get_device())] = (lambda *args: None, 1, None, kernel._finisher)

    out = None
    if out_halves:
        import torch

        (dtype,) = {spec.dtype for spec in kernel.plan.outputs}
        buf = torch.empty(m, 2 * n, dtype=getattr(torch, dtype))
        names = [spec.name for spec in kernel.plan.outputs]
        out = kernel.plan.structure.build(dict(zip(names, (buf[:, :n], buf[:, n:]), strict=True)))

    def call():
        return kernel(a, b, **operands) if out is None else kernel(a, b, **operands, out=out)

    call()
    if kernel.last_path != "kernel":
        raise RuntimeError(f"{kernel.plan.name}: took the {kernel.last_path} path")
    return call


def median_us(fn, reps: int, rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        samples.append((time.perf_counter() - t0) / reps * 1e6)
    return statistics.median(samples)


def measure(names: list[str], cache: str, reps: int = 2000,
            rounds: int = 7) -> list[tuple[str, float, float]]:
    """(name, us per call, us per ``x.add_(1)``) for each catalogue epilogue that can be stubbed."""
    import torch
    from compile_catalogue import CATALOGUE, make_inputs

    import evtc

    x = torch.zeros(1024)
    rows = []
    for name in names:
        # "NAME@out_halves": the entry's two outputs written into the halves of one buffer (out=).
        name, _, variant = name.partition("@")
        entry = next(e for e in CATALOGUE if e.name == name)
        batches = 2 if entry.batched else None
        example = make_inputs(entry, 256, 256, 256, batches, torch.float16, "meta")
        kernel = evtc.compile(entry.fn, example, out_dtypes=entry.out_dtypes, config=entry.config or None,
                              cache_dir=cache, arch="sm_90a")
        if kernel.plan.reductions:
            print(f"# {name}: skipped (its reductions' buffers need a GPU)", flush=True)
            continue
        call = stubbed(kernel, make_inputs(entry, 256, 256, 256, batches, torch.float16, "cpu"),
                       out_halves=variant == "out_halves")
        name = f"{name}@{variant}" if variant else name
        rows.append((name, median_us(call, reps, rounds), median_us(lambda: x.add_(1), reps, rounds)))
        print(f"{name:28s} call {rows[-1][1]:6.2f} us   x.add_(1) {rows[-1][2]:5.2f} us   "
              f"over {rows[-1][1] - rows[-1][2]:5.2f} us", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--names", default=DEFAULT_NAMES, help="comma-separated catalogue entries")
    p.add_argument("--reps", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--cache", default=None)
    args = p.parse_args()
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    measure(args.names.split(","), args.cache or tempfile.mkdtemp(prefix="evtc-host-python-"),
            args.reps, args.rounds)


if __name__ == "__main__":
    main()
