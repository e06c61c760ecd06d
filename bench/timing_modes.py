"""How much a ratio against cuBLAS depends on how it is timed: the identity and residual kernels
against ``torch.matmul`` and ``torch.addmm`` on the same inputs, timed three ways in one process,
each in alternation with shuffled order (``evtc.timing.time_paired``):

* one launch between two events, the queue drained after each sample (host launch cost shows);
* ten launches between two events (the queue stays full);
* launches replayed from one CUDA graph, about 1 ms a sample (back to back, at the power limit).

Ratio = torch time / evtc time (> 1: evtc faster). Inputs as bench/shapes.py makes them: x of
N(0, 1), w scaled by K^-1/2, C of N(0, 1), bfloat16.

    python3 bench/timing_modes.py
    python3 bench/timing_modes.py --shapes 512x3584x18944,2048x3584x18944 --samples 31
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import evtc  # noqa: E402
from evtc.timing import graphed, time_paired  # noqa: E402

SHAPES = "512x3584x18944,2048x3584x18944,512x4096x14336,4096x4096x4096"


def identity(acc):
    return acc


def residual(acc, C):
    return acc + C


def time_shape(m: int, n: int, k: int, samples: int) -> None:
    dt = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=dt, generator=gen)
    w = torch.randn(n, k, device="cuda", dtype=dt, generator=gen).mul_(k ** -0.5)
    C = torch.randn(m, n, device="cuda", dtype=dt, generator=gen)
    b = w.t()
    ident = evtc.compile(identity, {"a": x, "b": b})
    resid = evtc.compile(residual, {"a": x, "b": b, "C": C})
    for got, want in ((ident(x, b), x @ b), (resid(x, b, C=C), torch.addmm(C, x, b))):
        err = (got.float() - want.float()).abs().max().item() / want.float().abs().max().item()
        if err > 2e-2:
            raise SystemExit(f"{m}x{n}x{k}: evtc differs from torch by {err:.2e} (relative to max)")
    fns = [lambda: torch.matmul(x, b), lambda: ident(x, b), lambda: torch.addmm(C, x, b),
           lambda: resid(x, b, C=C)]
    rows = []
    for label, reps in (("1 launch a sample", 1), ("10 launches a sample", 10)):
        rows.append((label, time_paired(fns, 5, samples, reps)))
    calls = max(1, round(1.0 / rows[-1][1][0]))  # about 1 ms of cuBLAS a replay
    replays = time_paired([graphed(f, calls) for f in fns], 2, samples, 1)
    rows.append((f"CUDA graph of {calls}", [t / calls for t in replays]))
    print(f"{m}x{n}x{k} bf16 (us: matmul, evtc identity, addmm, evtc residual; ratios)")
    for label, t in rows:
        us = "  ".join(f"{v * 1e3:7.1f}" for v in t)
        print(f"  {label:22s} {us}   identity {t[0] / t[1]:.3f}  residual {t[2] / t[3]:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=SHAPES, help="MxNxK,... (default: %(default)s)")
    p.add_argument("--samples", type=int, default=21)
    args = p.parse_args()
    for shape in args.shapes.split(","):
        time_shape(*(int(s) for s in shape.split("x")), args.samples)


if __name__ == "__main__":
    main()
