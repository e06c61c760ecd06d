"""What a split-K build costs where it does not split: the same tile and cluster compiled plain and
with ``split_k=True``, at split counts 1, 2 and 3, against torch.matmul, timed on replays of CUDA
graphs (device time only, no host cost) in shuffled order.

    python3 bench/split_overhead.py --shapes 4096x4096x4096,512x10240x8192
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import evtc  # noqa: E402
from evtc.timing import graphed, time_paired  # noqa: E402


def identity(acc):
    return acc


def row(shape: str, plain, builds: dict, samples: int) -> None:
    """One shape: cuBLAS, the plain build, and the split-K build at each pinned split count."""
    m, n, k = (int(x) for x in shape.split("x"))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    reps = max(2, min(50, int(2e6 // max(m * n * k // 1_000_000, 1))))
    fns = [graphed(lambda: torch.matmul(x, w.t(), out=out), reps),
           graphed(lambda: plain(x, w.t(), out=out), reps)]
    for s, kernel in builds.items():
        kernel.pin_splits(s)
        fns.append(graphed(lambda kernel=kernel: kernel(x, w.t(), out=out), reps))
    times = time_paired(fns, warmup=3, samples=samples, reps=1)
    cells = " ".join(f"{times[0] / t:7.3f}" for t in times[1:])
    print(f"{shape:>18} {times[0] * 1e3 / reps:10.1f} {cells}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="4096x4096x4096,512x10240x8192,2048x4608x3584")
    p.add_argument("--config", default="tile_m=128,tile_n=128,schedule=pingpong,cluster=1x2")
    p.add_argument("--samples", type=int, default=15)
    args = p.parse_args()
    knobs: dict = {}
    for item in filter(None, args.config.split(",")):
        key, value = item.split("=")
        knobs[key] = (tuple(int(v) for v in value.split("x")) if key == "cluster"
                      else int(value) if value.isdigit() else value)
    example = {"a": torch.empty(8, 64, dtype=torch.bfloat16, device="meta"),
               "b": torch.empty(64, 64, dtype=torch.bfloat16, device="meta").t()}
    plain = evtc.compile(identity, example, config=knobs)
    builds = {s: evtc.compile(identity, example, config={**knobs, "split_k": True}) for s in (1, 2, 3)}
    print(f"device: {torch.cuda.get_device_name()}; knobs {knobs}; ratio = cuBLAS / evtc (graphs)")
    print(f"{'shape':>18} {'cuBLAS us':>10} {'plain':>7} {'sk S=1':>7} {'sk S=2':>7} {'sk S=3':>7}")
    for shape in args.shapes.split(","):
        row(shape, plain, builds, args.samples)

if __name__ == "__main__":
    main()
