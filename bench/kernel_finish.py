"""Who should finish the reductions: the kernel (its last tiles) or the host (torch ops on the
partials)? Each reduction epilogue of bench/reductions.py is timed both ways on the same inputs,
per problem size, with ``gelu(acc + bias)`` without a reduction and ``torch.matmul`` alone as
references, in shuffled order (CUDA events, warm-up, medians).

    python3 bench/kernel_finish.py                          # float16, sizes from 256^3 to 8192x8192x1024
    python3 bench/kernel_finish.py --sizes 2048x2048x1024 --samples 21

Two columns per way: ``eager`` times back-to-back calls (what a user's loop sees: host-bound at small
sizes), ``graph`` replays the calls from a CUDA graph (GPU time only). The kernel's finish is forced
on or off per call through ``evtc.runtime.reductions.KERNEL_FINISH_MAX_OUTPUT``, the limit the
default call path applies (4M output elements).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import evtc  # noqa: E402
import evtc.runtime.reductions as runtime_reductions  # noqa: E402
from evtc.timing import graphed, time_paired  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reductions import (  # noqa: E402  bench/reductions.py
    fp8_with_amax,
    gelu_bias,
    gelu_bias_amax,
    gelu_bias_col_sum,
    gelu_bias_row_norm,
)

EPILOGUES = [gelu_bias_row_norm, gelu_bias_col_sum, gelu_bias_amax, fp8_with_amax]
ON, OFF = 1 << 62, -1  # limits that force the kernel's finish on, off


def _with_limit(fn, limit):
    def call():
        runtime_reductions.KERNEL_FINISH_MAX_OUTPUT = limit
        return fn()
    return call


def _time_both_ways(kern, plain, a, b, bias, ops: dict, samples: int) -> tuple[list[float], list[float]]:
    """(eager, graph) milliseconds per call: the kernel's finish, the host's; then, graph only, the
    epilogue without a reduction and torch.matmul."""
    calls = [_with_limit(lambda: kern(a, b, **ops), ON), _with_limit(lambda: kern(a, b, **ops), OFF),
             lambda: plain(a, b, bias=bias), lambda: torch.matmul(a, b)]
    eager = time_paired(calls[:2], warmup=5, samples=samples, reps=10)
    replays = []
    for call in calls:
        call()  # the limit in force while the graph is captured decides its launch
        replays.append(graphed(call, 10))
    graph = [t / 10 for t in time_paired(replays, warmup=3, samples=samples, reps=1)]
    return eager, graph


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="256x256x256,1024x1024x1024,2048x2048x1024,2048x2048x4096,"
                                      "4096x4096x1024,8192x8192x1024")
    p.add_argument("--samples", type=int, default=15)
    p.add_argument("--cache", default=None)
    args = p.parse_args()
    default_limit = runtime_reductions.KERNEL_FINISH_MAX_OUTPUT
    dtype = torch.float16
    print(f"{'M x N x K':>18} {'epilogue':>18} | {'eager: kernel':>13} {'host':>7} {'ratio':>6} | "
          f"{'graph: kernel':>13} {'host':>7} {'ratio':>6} | {'no red.':>7} {'matmul':>7}")
    print("(us per call; ratio = host finish / kernel finish)")
    ratios: dict[str, list[float]] = {"eager": [], "graph": []}
    for size in args.sizes.split(","):
        m, n, k = (int(v) for v in size.split("x"))
        g = torch.Generator(device="cuda").manual_seed(m + n + k)
        a = torch.randn(m, k, device="cuda", generator=g).to(dtype)
        b = torch.randn(n, k, device="cuda", generator=g).to(dtype).t()
        bias = torch.randn(n, device="cuda", generator=g)
        s = torch.tensor(0.25, device="cuda")
        ex = {"a": a, "b": b, "bias": bias}
        plain = evtc.compile(gelu_bias, ex, cache_dir=args.cache)
        for epi in EPILOGUES:
            ops = {"bias": bias, **({"scale": s} if epi is fp8_with_amax else {})}
            kern = evtc.compile(epi, {**ex, **ops}, cache_dir=args.cache)
            if not kern.plan.kernel_finish:
                print(f"{size:>18} {epi.__name__:>18} | the host finishes it at every size: skipped")
                continue
            try:
                eager, graph = _time_both_ways(kern, plain, a, b, bias, ops, args.samples)
            finally:
                runtime_reductions.KERNEL_FINISH_MAX_OUTPUT = default_limit
            for mode, (kern_ms, host_ms) in (("eager", eager), ("graph", graph[:2])):
                ratios[mode].append(host_ms / kern_ms)
            print(f"{size:>18} {epi.__name__:>18} | {eager[0] * 1e3:13.1f} {eager[1] * 1e3:7.1f} "
                  f"{eager[1] / eager[0]:6.3f} | {graph[0] * 1e3:13.1f} {graph[1] * 1e3:7.1f} "
                  f"{graph[1] / graph[0]:6.3f} | {graph[2] * 1e3:7.1f} {graph[3] * 1e3:7.1f}")
    for mode, values in ratios.items():
        if values:
            geo = math.exp(sum(math.log(v) for v in values) / len(values))
            print(f"{mode}: host / kernel finish, geomean {geo:.3f}, "
                  f"min {min(values):.3f}, max {max(values):.3f}")


if __name__ == "__main__":
    main()
