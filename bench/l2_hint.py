"""B's L2 eviction hint (EVICT_FIRST where a problem has one row of cluster tiles) against the same
kernel with the normal policy everywhere: two identity kernels traced in their own cache
directories, one with ``evtc.sm90.gemm.L2_EVICT_FIRST`` set to the normal policy while it is traced,
timed at decode to prefill sizes in CUDA graphs cycling weight copies, paired with cuBLAS in
shuffled order. Ratio = cuBLAS time / evtc time.

    python3 bench/l2_hint.py
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from shapes import capture as graph_of  # noqa: E402

import evtc  # noqa: E402
from evtc.compile import clear_memory_cache  # noqa: E402
from evtc.sm90 import gemm  # noqa: E402
from evtc.timing import time_paired  # noqa: E402

WEIGHTS = ((4096, 4096), (6144, 4096), (4096, 14336), (28672, 4096), (2048, 7168), (7168, 2048), (1024, 8192))
SHAPES = [(m, n, k) for m in (1, 16, 64, 128) for n, k in WEIGHTS] + [
    (512, 4096, 4096), (512, 14336, 4096), (2048, 4096, 4096), (4096, 4096, 4096)]


def identity(acc):
    return acc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=13)
    args = p.parse_args()
    bf = torch.bfloat16
    example = {"a": torch.empty(64, 64, dtype=bf, device="meta"),
               "b": torch.empty(64, 64, dtype=bf, device="meta").t()}
    weights = {}
    for _, n, k in SHAPES:
        if (n, k) not in weights:
            copies = max(2, min(16, math.ceil((256 << 20) / (n * k * 2))))
            weights[(n, k)] = [torch.randn(n, k, device="cuda").to(bf) for _ in range(copies)]
    first = gemm.L2_EVICT_FIRST
    settings = {"normal": gemm.L2_EVICT_NORMAL, "first where one row": first}
    kernels = {}
    try:
        for name, policy in settings.items():
            gemm.L2_EVICT_FIRST = policy  # read while the kernel and its variants are traced
            clear_memory_cache()
            kernel = evtc.compile(identity, example, cache_dir=tempfile.mkdtemp())
            for m, n, k in SHAPES:  # every variant is traced now, under this setting
                x = torch.randn(m, k, device="cuda").to(bf)
                w = weights[(n, k)][0]
                ref = x.float() @ w.float().t()
                assert ((kernel(x, w.t()).float() - ref).norm() / ref.norm()).item() < 1e-2
            kernels[name] = kernel
    finally:
        gemm.L2_EVICT_FIRST = first
    ratios = {name: [] for name in settings}
    for m, n, k in SHAPES:
        ws = weights[(n, k)]
        x = torch.randn(m, k, device="cuda").to(bf)
        d = torch.empty(m, n, device="cuda", dtype=bf)
        reps = max(4, min(60, int(2000 / max(1.0, m * n * k * 2 / 600e6))))
        graphs = [graph_of(lambda w, x=x, d=d: torch.matmul(x, w.t(), out=d), ws, reps)]
        for kernel in kernels.values():
            graphs.append(graph_of(lambda w, x=x, d=d, kernel=kernel: kernel(x, w.t(), out=d), ws, reps))
        t = time_paired([g.replay for g in graphs], 3, args.samples, 1)
        for name, tt in zip(settings, t[1:], strict=True):
            ratios[name].append(t[0] / tt)
        cells = "  ".join(f"{name} {t[0] / tt:.3f}" for name, tt in zip(settings, t[1:], strict=True))
        print(f"{m:5d}x{n}x{k}: cuBLAS {t[0] / reps * 1e3:7.1f} us  {cells}", flush=True)
    for name, values in ratios.items():
        geomean = math.exp(statistics.mean(map(math.log, values)))
        print(f"{name}: geomean {geomean:.3f}, worst {min(values):.3f}")


if __name__ == "__main__":
    main()
