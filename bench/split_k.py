"""Split-K sweep: evtc's identity GEMM with each split count pinned, and with the count it chooses,
against torch.matmul (cuBLAS), all timed in one process on the same random inputs (CUDA events,
warm-up, medians, shuffled order per sample).

    python3 bench/split_k.py                                  # decode-sized LLM layers, bf16
    python3 bench/split_k.py --shapes 64x4096x14336 --splits 1,2,4,8

ratio = cuBLAS time / evtc time (> 1: evtc faster). "auto" is the count evtc picks by itself.

The calls are eager (host cost included; each sample starts from an idle GPU), and the pinned
columns run a kernel compiled with ``split_k=True``, whose host path allocates the partials on every
call: at 4096^3 its S=1 column read 0.86 where the same build ran 0.99 on graph replays. For device
time alone, use bench/split_overhead.py (graphs) or bench/sweep_configs.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import evtc  # noqa: E402
from evtc.timing import time_paired  # noqa: E402

DEFAULT_SHAPES = ("64x4096x14336,64x4096x4096,64x6144x4096,64x8192x28672,64x8192x8192,"
                  "16x4096x14336,128x4096x14336,512x4096x14336,64x7168x2048,64x2048x7168")


def identity(acc):
    return acc


def sweep(shape: str, auto, pinned, splits_list, samples: int) -> None:
    """One row: each pinned split count and the automatic choice, each paired with cuBLAS."""
    m, n, k = (int(x) for x in shape.split("x"))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    ref = x.float() @ w.float().t()
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    reps = min(200, max(1, int(2e5 // max(m * n * k // 1_000_000, 1))))
    ratios = []

    def cublas():
        return torch.matmul(x, w.t())

    # One paired timing per split count: pinning is per kernel object, and re-pinning inside
    # the timed function would add host time to every launch.
    for s in splits_list:
        pinned.pin_splits(s)
        got = pinned(x, w.t(), out=out)
        err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
        assert err < 2e-2, (shape, s, err)
        base, ours = time_paired([cublas, lambda: pinned(x, w.t(), out=out)], warmup=5,
                                 samples=samples, reps=reps)
        ratios.append(base / ours)
    base, ours = time_paired([cublas, lambda: auto(x, w.t(), out=out)], warmup=5, samples=samples,
                             reps=reps)
    cells = " ".join(f"{r:7.2f}" for r in ratios)
    chosen = auto.splits_for(m, n, k)
    tbs = n * k * 2 / (ours * 1e-3) / 1e12
    print(f"{shape:>18} {base * 1e3:10.1f} {cells} {base / ours:7.2f}(S={chosen}) {tbs:5.2f} TB/s")



def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="M x N x K, comma separated")
    p.add_argument("--splits", default="1,2,3,4,6,8")
    p.add_argument("--samples", type=int, default=15)
    p.add_argument("--config", default="", help="extra GemmConfig knobs, e.g. tile_n=64,schedule=cooperative")
    args = p.parse_args()
    knobs: dict = {}
    for item in filter(None, args.config.split(",")):
        key, value = item.split("=")
        knobs[key] = int(value) if value.isdigit() else value
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; knobs {knobs}")
    splits_list = [int(s) for s in args.splits.split(",")]
    example = {"a": torch.empty(8, 64, dtype=torch.bfloat16, device="meta"),
               "b": torch.empty(64, 64, dtype=torch.bfloat16, device="meta").t()}
    auto = evtc.compile(identity, example, config=knobs or None)
    pinned = evtc.compile(identity, example, config={**knobs, "split_k": True})
    header = f"{'shape':>18} {'cuBLAS us':>10} " + " ".join(f"{'S=' + str(s):>7}" for s in splits_list)
    print(header + f" {'auto':>12}")
    for shape in args.shapes.split(","):
        sweep(shape, auto, pinned, splits_list, args.samples)

if __name__ == "__main__":
    main()
