"""SwiGLU in one kernel against cuBLAS plus eager ``F.silu(gate) * up``, all timed in one process on
the same random inputs (CUDA events, warm-up, medians, in alternation).

The weight is an ``nn.Linear`` weight ``[W_gate; W_up]`` of shape (2 N, K); evtc reads it as it is
(``weight.t()``, K-major). Also timed: cuBLAS alone (the GEMM with its full-width output), our own
GEMM with the full-width output (the identity epilogue), and, unless ``--no-torch-compile``,
torch.compile of the eager pair.

    python3 bench/swiglu.py                       # 8192 x 2*8192 x {8192, 1024}, float16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import evtc  # noqa: E402
from evtc.timing import time_paired  # noqa: E402


def swiglu(acc):
    gate, up = acc.chunk(2, dim=-1)
    return F.silu(gate) * up


def identity(acc):
    return acc


def eager(x, w):
    gate, up = (x @ w.t()).chunk(2, dim=-1)
    return F.silu(gate) * up


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="8192x8192x8192,8192x8192x1024",
                   help="M x N x K, N being the output's width (the GEMM's is 2 N)")
    p.add_argument("--samples", type=int, default=15)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--no-torch-compile", action="store_true")
    args = p.parse_args()
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; evtc {evtc.__version__}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    compiled = None if args.no_torch_compile else torch.compile(eager)
    for text in args.shapes.split(","):
        m, n, k = (int(v) for v in text.split("x"))
        scale = k ** -0.25
        x = (torch.randn(m, k, device="cuda", generator=gen) * scale).half()
        w = (torch.randn(2 * n, k, device="cuda", generator=gen) * scale).half()
        fused = evtc.compile(swiglu, dict(a=x, b=w.t()))
        full = evtc.compile(identity, dict(a=x, b=w.t()))
        ref = eager(x.float(), w.float())
        err = ((fused(x, w.t()).float() - ref).norm() / ref.norm()).item()
        fns = {
            "cuBLAS GEMM (2N wide)": lambda x=x, w=w: x @ w.t(),
            "cuBLAS + eager silu*up": lambda x=x, w=w: eager(x, w),
            "evtc GEMM (2N wide)": lambda x=x, w=w, k=full: k(x, w.t()),
            "evtc SwiGLU": lambda x=x, w=w, k=fused: k(x, w.t()),
        }
        if compiled is not None:
            fns["torch.compile"] = lambda x=x, w=w: compiled(x, w)
        times = dict(zip(fns, time_paired(list(fns.values()), warmup=10, samples=args.samples,
                                          reps=args.reps), strict=True))
        ours = times["evtc SwiGLU"]
        print(f"{m}x2*{n}x{k} ({fused.config.short_name()}), relative error {err:.1e}:")
        for label, t in times.items():
            print(f"  {label:>24}: {t:.3f} ms  {t / ours:.2f}x evtc SwiGLU")


if __name__ == "__main__":
    main()
