"""One evtc identity launch per split count and one cuBLAS launch of a small-M problem, between
cudaProfilerStart/Stop, for Nsight Compute:

    ncu --profile-from-start off --metrics gpu__time_duration.sum,dram__bytes_read.sum \
        python3 bench/profile_small_m.py --shape 64x4096x4096 --splits 1,4
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="64x4096x4096")
    p.add_argument("--splits", default="1,4")
    p.add_argument("--config", default="")
    args = p.parse_args()
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
