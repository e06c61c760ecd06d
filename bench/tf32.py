"""float32 GEMMs run as tf32 (issue "FP8 inputs", its tf32 item): evtc against cuBLAS's tf32 matmul
over the LLM layers of bench/shapes.py, one process, shuffled order per sample, medians.

    bash .devkit/gpu.sh python3 bench/tf32.py [--ms 128,2048,8192] [--samples 9]

Every call runs with ``torch.backends.cuda.matmul.allow_tf32 = True`` (else evtc's kernel does not
run: a float32 matmul is then computed in full float32). float32 a (M, K) and a K-major weight
(b = w.t(), w (N, K)), float32 results; ratio = the baseline's time / evtc's (above 1: evtc faster):

* ``identity``: ``acc`` against ``torch.matmul`` (cuBLAS, tf32);
* ``bias+gelu``: ``gelu(acc + bias)`` against ``F.gelu(F.linear(a, w, bias))`` (cuBLASLt adds the
  bias, then a separate GELU kernel);
* ``residual``: ``acc + C`` against ``torch.addmm(C, a, b)`` (cuBLASLt fuses it).

Each row also prints the largest relative error of evtc's identity and of torch's tf32 matmul
against float64 (rows small enough for a float64 reference).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from fp8 import print_summary, row_parser, row_selection, run_rows, time_calls  # noqa: E402

import evtc  # noqa: E402


def identity(acc):
    return acc


def bias_gelu(acc, bias):
    return F.gelu(acc + bias)


def residual(acc, C):
    return acc + C


def measure(name: str, m: int, n: int, k: int, kernels: dict, samples: int, graphs: bool = False) -> tuple:
    """One row: the three ratios, evtc's identity time (us) and both errors."""
    from shapes import rel_max_error
    dev = "cuda"
    a = torch.randn(m, k, device=dev)
    w = torch.randn(n, k, device=dev)
    b = w.t()
    bias = torch.randn(n, device=dev)
    C = torch.randn(m, n, device=dev)
    if "identity" not in kernels:
        kernels["identity"] = evtc.compile(identity, {"a": a, "b": b})
        kernels["bias_gelu"] = evtc.compile(bias_gelu, {"a": a, "b": b, "bias": bias})
        kernels["residual"] = evtc.compile(residual, {"a": a, "b": b, "C": C})
    ki, kg, kr = kernels["identity"], kernels["bias_gelu"], kernels["residual"]
    calls = {
        "evtc_i": lambda: ki(a, b),
        "torch_i": lambda: torch.matmul(a, b),
        "evtc_g": lambda: kg(a, b, bias=bias),
        "torch_g": lambda: F.gelu(F.linear(a, w, bias)),
        "evtc_r": lambda: kr(a, b, C=C),
        "torch_r": lambda: torch.addmm(C, a, b),
    }
    times = time_calls(calls, samples, graphs)
    assert ki.last_path == "kernel", ki.last_path
    err_evtc = err_torch = math.nan
    if m * n * k <= 2**37:
        ref = a.double() @ b.double()
        err_evtc = rel_max_error(ki(a, b), ref)
        err_torch = rel_max_error(torch.matmul(a, b), ref)
        del ref
    return (name, m, n, k, times["torch_i"] / times["evtc_i"], times["torch_g"] / times["evtc_g"],
            times["torch_r"] / times["evtc_r"], times["evtc_i"] * 1e3, err_evtc, err_torch)


def main() -> None:
    args = row_parser(__doc__, "128,2048,8192", 9).parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    ms, keep = row_selection(args)
    torch.manual_seed(0)
    kernels: dict[str, evtc.Kernel] = {}
    rows = run_rows(ms, keep,
                    lambda name, m, n, k: measure(name, m, n, k, kernels, args.samples, args.graphs),
                    f"{'identity':>10} {'bias+gelu':>9} {'residual':>8}", "{:10.3f} {:9.3f} {:8.3f}")
    print_summary(rows, ms, ("identity vs torch.matmul (tf32)", "bias+gelu vs F.linear + F.gelu",
                             "residual vs torch.addmm"), "identity; baseline: torch.matmul in tf32")


if __name__ == "__main__":
    main()
