"""What each call path costs (docs/compile.md, "Call paths"): the kernel on tensors it takes as they
are, the staged path (aligned copies in, compact copies out) and the torch path, each against
cuBLAS plus the eager epilogue, timed in one process on the same random inputs (CUDA events,
warm-up, medians, shuffled order). Also the host cost per call on a small problem, where the GPU
does not hide it.

    python3 bench/call_paths.py
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import evtc  # noqa: E402
from evtc.timing import time_paired  # noqa: E402


def bias_gelu(acc, bias):
    return F.gelu(acc + bias)


def eager(a, b, bias):
    return F.gelu(torch.matmul(a, b).float() + bias).to(a.dtype)


def _case(name, m, n, k, *, b_k_major=False, dtype=torch.float16, a_m_major=False):
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    if a_m_major:
        a = a.t().contiguous().t()
    b = torch.randn(n, k, device="cuda", dtype=dtype).t() if b_k_major else \
        torch.randn(k, n, device="cuda", dtype=dtype)
    bias = torch.randn(n, device="cuda")
    return name, a, b, bias


def _compile(a, b, bias, cache):
    """The kernel a user would have compiled: K-major a, b in the major it has (an nn.Linear weight is
    K-major), on aligned example sizes."""
    a_ex = torch.empty(64, 64, dtype=a.dtype, device="meta")
    b_ex = torch.empty(64, 64, dtype=b.dtype, device="meta")
    if b.stride(0) == 1:
        b_ex = b_ex.t()
    bias_ex = torch.empty(64, dtype=bias.dtype, device="meta")
    return evtc.compile(bias_gelu, dict(a=a_ex, b=b_ex, bias=bias_ex), cache_dir=cache)


def gpu_costs(samples: int, reps: int, cache) -> list[tuple[str, str, float, float]]:
    rows = []
    # Each case against the same shape's aligned neighbour where one exists, and against cuBLAS +
    # eager (what a user would do instead).
    cases = [
        _case("aligned 4096x4096x4096", 4096, 4096, 4096),
        _case("output rows 4095 wide", 4096, 4095, 4096),
        _case("a with K = 4095 (row pitch)", 4096, 4096, 4095),
        _case("nn.Linear weight with K = 4095", 4096, 4096, 4095, b_k_major=True),
        _case("a M-major (compiled K-major)", 4096, 4096, 4096, a_m_major=True),
        _case("aligned 512x4096x4096", 512, 4096, 4096),
        _case("output rows 4095 wide, M = 512", 512, 4095, 4096),
        _case("nn.Linear weight K = 4095, M = 512", 512, 4096, 4095, b_k_major=True),
        _case("float32 a, b (torch path)", 4096, 4096, 4096, dtype=torch.float32),
    ]
    for name, a, b, bias in cases:
        kernel = _compile(a, b, bias, cache)
        kernel(a, b, bias=bias)
        path = kernel.last_path
        ours, theirs = time_paired([lambda k=kernel, a=a, b=b, bias=bias: k(a, b, bias=bias),
                                    lambda a=a, b=b, bias=bias: eager(a, b, bias)], 5, samples, reps)
        rows.append((name, path, ours, theirs))
        print(f"{name:38s} {path:7s} evtc {ours:8.4f} ms  cuBLAS+eager {theirs:8.4f} ms  "
              f"ratio {theirs / ours:5.2f}", flush=True)
    return rows


def host_costs(cache, calls: int = 2000) -> None:
    """Microseconds per call on the CPU, for a problem small enough that launches dominate."""
    print("\nhost cost per call (64x64x64 unless named; wall clock, synchronised every 100 calls)")
    small = [
        _case("aligned (kernel path)", 64, 64, 64),
        _case("output rows 63 wide (staged)", 64, 63, 64),
        _case("a with K = 63 (staged)", 64, 64, 63),
    ]
    for name, a, b, bias in small:
        kernel = _compile(a, b, bias, cache)
        ours = (lambda k=kernel, a=a, b=b, bias=bias: k(a, b, bias=bias))
        theirs = (lambda a=a, b=b, bias=bias: eager(a, b, bias))
        for fn, label in ((ours, "evtc"), (theirs, "eager")):
            for _ in range(50):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(calls):
                fn()
                if i % 100 == 99:
                    torch.cuda.synchronize()
            torch.cuda.synchronize()
            us = (time.perf_counter() - t0) / calls * 1e6
            print(f"  {name:32s} {label:6s} {us:7.1f} us/call" + (f"  ({kernel.last_path})" if label == "evtc"
                                                                  else ""), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=15)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cache-dir", default=None)
    args = p.parse_args()
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; evtc {evtc.__version__}")
    gpu_costs(args.samples, args.reps, args.cache_dir)
    host_costs(args.cache_dir)


if __name__ == "__main__":
    main()
