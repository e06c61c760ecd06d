"""A float32 residual in the epilogue (C and D float32) under several shared-memory plans, against
cuBLAS: ``torch.addmm(C, a, b)`` for float32 a and b (tf32), ``torch.matmul(a, b).float().add_(C)``
for bf16 ones. One process, shuffled order per sample, medians; ratio = the baseline's time / evtc's.

    bash .devkit/gpu.sh python3 bench/f32_epilogue.py

"default" is the plan evtc chooses; the others pin the tile, the schedule or 128 x 16 subtiles
(docs/performance.md, "float32 epilogue tiles").
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import evtc  # noqa: E402
from evtc.timing import time_paired  # noqa: E402

SHAPES = [(2048, 8192, 8192), (8192, 4608, 3584), (8192, 4096, 14336), (2048, 6144, 4096)]
PLANS = {
    "default": None,
    "pp epi16": {"schedule": "pingpong", "tile_m": 128, "tile_n": 128, "epi_tile_n": 16},
    "co 128": {"schedule": "cooperative", "tile_m": 128, "tile_n": 128},
    "co 256": {"schedule": "cooperative", "tile_m": 128, "tile_n": 256},
    "co 256 epi16": {"schedule": "cooperative", "tile_m": 128, "tile_n": 256, "epi_tile_n": 16},
}


def residual(acc, C):
    return (acc + C).float()


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = True
    for ab in (torch.float32, torch.bfloat16):
        for m, n, k in SHAPES:
            a = torch.randn(m, k, device="cuda").to(ab)
            b = torch.randn(n, k, device="cuda").to(ab).t()
            C = torch.randn(m, n, device="cuda")
            if ab == torch.float32:
                calls = {"cublas": lambda a=a, b=b, C=C: torch.addmm(C, a, b)}
            else:
                calls = {"cublas": lambda a=a, b=b, C=C: torch.matmul(a, b).float().add_(C)}
            for name, plan in PLANS.items():
                kernel = evtc.compile(residual, {"a": a, "b": b, "C": C}, config=plan)
                calls[name] = lambda kernel=kernel, a=a, b=b, C=C: kernel(a, b, C=C)
            for f in calls.values():
                f()
            torch.cuda.synchronize()
            samples = time_paired(list(calls.values()), warmup=3, samples=9, reps=5)
            times = dict(zip(calls, samples, strict=True))
            ratios = " ".join(f"{name} {times['cublas'] / t:.3f}" for name, t in times.items()
                              if name != "cublas")
            print(f"{str(ab).removeprefix('torch.'):>9} {m}x{n}x{k}: {ratios}", flush=True)


if __name__ == "__main__":
    main()
