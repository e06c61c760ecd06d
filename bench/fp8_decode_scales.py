"""Block-scaled float8 calls at decode sizes (issue "FP8 inputs"): a's 1 x 128 scales in torch's
M-major layout, whose pitch M the kernel's TMA cannot read where M is not a multiple of 4, against
the same call with the scales in a padded pitch, and torch's blockwise ``scaled_mm`` where cuBLASLt
takes the size (it refuses M = 1, 2, 3, 7 on the H100). Eager calls, events around 20
back-to-back calls, medians, shuffled order per sample: at these sizes the time is the host's.

    bash .devkit/gpu.sh python3 bench/fp8_decode_scales.py [--ms 1,2,3,4,7,8,16,64] [--n 4096 --k 7168]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from fp8_blockwise import block_scaled, identity, torch_blockwise  # noqa: E402

import evtc  # noqa: E402
from evtc.timing import time_paired  # noqa: E402


def padded_pitch(scales: torch.Tensor) -> torch.Tensor:
    """``scales`` (M, KB) M-major in storage whose pitch is M rounded up to 4, as DeepGEMM pads."""
    m, kb = scales.shape
    padded = torch.empty(kb, -(-m // 4) * 4, device=scales.device)[:, :m].t()
    padded.copy_(scales)
    return padded


def measure(kernel: evtc.Kernel, m: int, n: int, k: int, samples: int) -> str:
    """One M: the call with torch's layout (and its path), with a padded pitch, and torch's."""
    a, sa, b, sb, _, _ = block_scaled(m, n, k)
    padded = padded_pitch(sa)
    calls = [lambda: kernel((a, sa), (b, sb)), lambda: kernel((a, padded), (b, sb))]
    try:
        torch_blockwise(a, sa, b, sb)
        calls.append(lambda: torch_blockwise(a, sa, b, sb))
    except RuntimeError:
        pass  # cuBLASLt refuses the size
    kernel((a, sa), (b, sb))
    path = kernel.last_path
    times = time_paired(calls, warmup=5, samples=samples, reps=20)
    theirs = f"{times[2] * 1e3:7.1f}" if len(times) > 2 else "refused"
    return (f"M = {m:4d}: torch's layout {times[0] * 1e3:7.1f} ({path}), padded pitch "
            f"{times[1] * 1e3:7.1f}, torch blockwise {theirs}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ms", default="1,2,3,4,7,8,16,64")
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--k", type=int, default=7168)
    p.add_argument("--samples", type=int, default=15)
    args = p.parse_args()
    torch.manual_seed(0)
    a, sa, b, sb, _, _ = block_scaled(128, args.n, args.k)
    kernel = evtc.compile(identity, {"a": (a, sa), "b": (b, sb)})
    print(f"N = {args.n}, K = {args.k}; us per call (eager)")
    for m in (int(x) for x in args.ms.split(",")):
        print(measure(kernel, m, args.n, args.k, args.samples), flush=True)


if __name__ == "__main__":
    main()
