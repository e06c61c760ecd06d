"""Where a small problem's time goes: the same calls timed eagerly (host launch cost included, as a
user sees them back to back) and replayed from a CUDA graph (device time only), for evtc and
cuBLAS, plus each call's host time alone (wall clock, no synchronisation).

    python3 bench/launch_overhead.py --shapes 64x4096x4096,64x4096x14336
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import evtc  # noqa: E402
from evtc.timing import graphed, time_paired  # noqa: E402


def identity(acc):
    return acc


def host_us(fn, calls: int = 200) -> float:
    """Median wall-clock microseconds of one call, without waiting for the GPU."""
    samples = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="64x4096x4096,64x4096x14336,64x7168x2048")
    p.add_argument("--config", default="", help="GemmConfig knobs, e.g. tile_n=64,split_k=1")
    p.add_argument("--splits", type=int, default=0, help="pin the split count (0: evtc chooses)")
    args = p.parse_args()
    knobs: dict = {}
    for item in filter(None, args.config.split(",")):
        key, value = item.split("=")
        knobs[key] = int(value) if value.isdigit() else value
    if "split_k" in knobs:
        knobs["split_k"] = bool(knobs["split_k"])
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; knobs {knobs}")
    example = {"a": torch.empty(8, 64, dtype=torch.bfloat16, device="meta"),
               "b": torch.empty(64, 64, dtype=torch.bfloat16, device="meta").t()}
    kernel = evtc.compile(identity, example, config=knobs or None)
    if args.splits:
        kernel.pin_splits(args.splits)
    print(f"{'shape':>16} {'eager cuBLAS':>12} {'eager evtc':>10} {'graph cuBLAS':>12} {'graph evtc':>10} "
          f"{'host cuBLAS':>11} {'host evtc':>9}  (us per call)")
    for shape in args.shapes.split(","):
        m, n, k = (int(x) for x in shape.split("x"))
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        wt = w.t()
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        out_ref = torch.empty_like(out)

        def ours(x=x, wt=wt, out=out):
            return kernel(x, wt, out=out)

        def cublas(x=x, wt=wt, out_ref=out_ref):
            return torch.matmul(x, wt, out=out_ref)

        ours()
        cublas()
        torch.testing.assert_close(out.float(), out_ref.float(), atol=3e-2, rtol=3e-2)
        eager = time_paired([cublas, ours], warmup=10, samples=15, reps=50)
        calls = 50
        replay = time_paired([graphed(cublas, calls), graphed(ours, calls)], warmup=3, samples=15, reps=1)
        print(f"{shape:>16} {eager[0] * 1e3:12.1f} {eager[1] * 1e3:10.1f} {replay[0] * 1e3 / calls:12.1f} "
              f"{replay[1] * 1e3 / calls:10.1f} {host_us(cublas):11.1f} {host_us(ours):9.1f}  "
              f"S={kernel.splits_for(m, n, k)}")
    # Which launcher the calls went through (the linked library's function, or the DSL's wrapper).
    print("launchers:", sorted({type(choice[0]).__name__ for choice in kernel._launch_memo.values()}))


if __name__ == "__main__":
    main()
