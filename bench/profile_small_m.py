"""One evtc identity launch per split count and one cuBLAS launch of a small-M problem, between
cudaProfilerStart/Stop, for Nsight Compute:

    ncu --profile-from-start off --metrics gpu__time_duration.sum,dram__bytes_read.sum \
        python3 bench/profile_small_m.py --shape 64x4096x4096 --splits 1,4

With --auto, the default kernel (the selector's launch for each size) runs once per shape in a
comma list, for comparing sizes that share a launch (e.g. --auto --shape 1x6144x4096,2x6144x4096).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import evtc  # noqa: E402


def identity(acc):
    return acc


def profile_auto(shapes: list[tuple[int, ...]]) -> None:
    """One launch of the default kernel and one of cuBLAS per shape, inside the profiled range."""
    runs = []
    kernel = None
    for m, n, k in shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        if kernel is None:
            kernel = evtc.compile(identity, {"a": x, "b": w.t()})
        kernel(x, w.t())  # build and warm up outside the profiled range
        torch.matmul(x, w.t())
        runs.append((x, w))
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for x, w in runs:
        kernel(x, w.t())
        torch.matmul(x, w.t())
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="64x4096x4096")
    p.add_argument("--splits", default="1,4")
    p.add_argument("--config", default="")
    p.add_argument("--auto", action="store_true", help="profile the default kernel per shape")
    args = p.parse_args()
    if args.auto:
        profile_auto([tuple(int(x) for x in s.split("x")) for s in args.shape.split(",")])
        return
    knobs: dict = {"split_k": True}
    for item in filter(None, args.config.split(",")):
        key, value = item.split("=")
        knobs[key] = int(value) if value.isdigit() else value
    m, n, k = (int(x) for x in args.shape.split("x"))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    kernel = evtc.compile(identity, {"a": x, "b": w.t()}, config=knobs)
    splits = [int(s) for s in args.splits.split(",")]
    for s in splits:  # compile and warm up outside the profiled range
        kernel.pin_splits(s)
        kernel(x, w.t())
    torch.matmul(x, w.t())
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for s in splits:
        kernel.pin_splits(s)
        kernel(x, w.t())
    torch.matmul(x, w.t())
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
