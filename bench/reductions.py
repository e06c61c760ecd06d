"""What a reduction costs in the epilogue: ``gelu(acc + bias)`` alone, with a per-row sum of squares,
with a per-column sum, and with the FP8 recipe's amax, all timed in one process on the same random
inputs (CUDA events, warm-up, medians, in alternation).

    python3 bench/reductions.py                       # 8192^3 and 8192x8192x1024, float16
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


def gelu_bias(acc, bias):
    return F.gelu(acc + bias)


def gelu_bias_row_norm(acc, bias):
    y = F.gelu(acc + bias)
    return y, (y * y).sum(-1)


def gelu_bias_col_sum(acc, bias):
    y = F.gelu(acc + bias)
    return y, y.sum(-2)


def gelu_bias_amax(acc, bias):
    y = F.gelu(acc + bias)
    return y, y.abs().amax()


def fp8_with_amax(acc, bias, scale):
    y = acc + bias
    return (y * scale).to(torch.float8_e4m3fn), y.abs().amax()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="8192x8192x8192,8192x8192x1024")
    p.add_argument("--samples", type=int, default=15)
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; evtc {evtc.__version__}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for text in args.shapes.split(","):
        m, n, k = (int(x) for x in text.split("x"))
        scale = k ** -0.25
        a = (torch.randn(m, k, device="cuda", generator=gen) * scale).half()
        b = (torch.randn(k, n, device="cuda", generator=gen) * scale).half()
        bias = torch.randn(n, device="cuda", generator=gen).half()
        s = torch.tensor([0.5], device="cuda")
        ex = dict(a=a, b=b, bias=bias)
        kernels = {
            "gelu(acc + bias)": (evtc.compile(gelu_bias, ex), dict(bias=bias)),
            "+ row sum of squares": (evtc.compile(gelu_bias_row_norm, ex), dict(bias=bias)),
            "+ column sum": (evtc.compile(gelu_bias_col_sum, ex), dict(bias=bias)),
            "+ amax": (evtc.compile(gelu_bias_amax, ex), dict(bias=bias)),
            "fp8 out + amax": (evtc.compile(fp8_with_amax, {**ex, "scale": s}), dict(bias=bias, scale=s)),
        }
        fns = [lambda a=a, b=b: torch.matmul(a, b)] + [
            (lambda kk=kk, ops=ops, a=a, b=b: kk(a, b, **ops)) for kk, ops in kernels.values()]
        times = time_paired(fns, warmup=10, samples=args.samples, reps=args.reps)
        base = times[1]
        print(f"{text}: cuBLAS {times[0]:.3f} ms")
        for (label, _), t in zip(kernels.items(), times[1:], strict=True):
            print(f"  {label:>22}: {t:.3f} ms  {t / base:.3f} of gelu(acc + bias)")


if __name__ == "__main__":
    main()
