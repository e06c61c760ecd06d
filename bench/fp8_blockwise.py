"""Block-scaled float8 GEMMs (DeepSeek-V3's recipe: 1 x 128 activation blocks, 128 x 128 weight
blocks) against torch's blockwise ``scaled_mm`` (cuBLASLt) and against a bf16 GEMM, over the LLM
layers of bench/fp8.py. One process, shuffled order per sample, medians.

    bash .devkit/gpu.sh python3 bench/fp8_blockwise.py [--ms 128,2048,8192] [--samples 11] [--graphs]

Per (layer, M), e4m3 a (M, K) with float32 scales (M, K/128) and a weight w (N, K) with scales
(N/128, K/128), passed to evtc as ``(a, sa)`` and ``(w.t(), sw.t())``:

* ``torch``: torch's time over evtc's for the identity epilogue, bf16 results (above 1: evtc
  faster), torch's ``F.scaled_mm(..., BlockWise1x128, ..., BlockWise128x128)``;
* ``bf16``: ``torch.matmul`` of bf16 a and w.t() over evtc's blockwise time (the speedup of going
  to float8);
* ``fused``: ``y = gelu(acc + bias)``, ``(y * s).to(e4m3)`` and ``amax(|y|)`` in one evtc kernel,
  against torch's blockwise GEMM followed by the same epilogue in eager PyTorch;
* ``dequant``: evtc's identity call against an eager dequantization (each 128-block of a and b
  times its scale, in bf16) followed by a bf16 ``torch.matmul``.

``--swiglu`` times the gate/up layers (N: both halves) with a gated epilogue instead, each ratio
torch's time over evtc's: ``silu(gate) * up`` in bf16 against torch's blockwise GEMM then the eager
SwiGLU; the same against a bf16 ``torch.matmul`` then the eager SwiGLU; and the SwiGLU with an e4m3
output and its amax against torch's blockwise GEMM then that epilogue in eager PyTorch.

Rows small enough also print both relative errors against the float64 product of the dequantized
inputs (float32 results). ``--graphs``: as in bench/fp8.py, each call replayed from a CUDA
graph. Geomeans, per M, and the worst row at the end.
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

E4M3 = torch.float8_e4m3fn


def identity(acc):
    return acc


def to_float32(acc):
    return acc.float()


def fused(acc, bias, s):
    y = F.gelu(acc + bias)
    return (y * s).to(torch.float8_e4m3fn), y.abs().amax()


def swiglu(acc):
    gate, up = acc.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_float32(acc):
    return swiglu(acc).float()


def swiglu_fp8(acc, s):
    y = swiglu(acc)
    return (y * s).to(torch.float8_e4m3fn), y.abs().amax()


def torch_blockwise(a, sa, b, sb, dtype=torch.bfloat16):
    """torch's blockwise GEMM: sa (M, K/128) and sb (K/128, N/128), both outer-dim-major."""
    from torch.nn.functional import ScalingType, scaled_mm

    return scaled_mm(a, b, sa, ScalingType.BlockWise1x128, sb, ScalingType.BlockWise128x128,
                     output_dtype=dtype)


def eager_fused(a, sa, b, sb, bias, s):
    y = F.gelu(torch_blockwise(a, sa, b, sb) + bias)
    return (y * s).to(E4M3), y.abs().amax()


def blocks(x: int) -> int:
    return -(-x // 128)


def eager_dequant(a, sa, b, sb):
    """The issue's other anchor: a and b dequantized in eager PyTorch (every element times its
    block's scale, rounded to bf16), then a bf16 GEMM."""
    k, n = b.shape
    a_scales = sa.repeat_interleave(128, dim=1)[:, :k]
    b_scales = sb.repeat_interleave(128, dim=0)[:k].repeat_interleave(128, dim=1)[:, :n]
    return torch.matmul((a.float() * a_scales).to(torch.bfloat16), (b.float() * b_scales).to(torch.bfloat16))


def block_scaled(m: int, n: int, k: int) -> tuple:
    """e4m3 a (M, K) and b = w.t() with float32 scales, in the layouts torch's blockwise GEMM takes:
    a's (M, K/128) M-major, b's (K/128, N/128) K-major; and bf16 copies of a and b."""
    dev = "cuda"
    a = (torch.randn(m, k, device=dev) * 2).to(E4M3)
    b = (torch.randn(n, k, device=dev) * 2).to(E4M3).t()
    sa = (torch.rand(blocks(k), m, device=dev) + 0.5).t()
    sb = (torch.rand(blocks(n), blocks(k), device=dev) + 0.5).t()
    return a, sa, b, sb, a.to(torch.bfloat16), b.to(torch.bfloat16)


def errors(m: int, n: int, k: int, fn32, kernel32, theirs, a, sa, b, sb) -> tuple[float, float]:
    """Relative errors of ``kernel32`` (``fn32`` compiled) and of ``theirs()`` against the float64
    reference, on rows small enough for one (NaN otherwise)."""
    from shapes import rel_max_error

    if m * n * k > 2**36:
        return math.nan, math.nan
    ref = evtc.reference(fn32, {"a": (a, sa), "b": (b, sb)}, dtype=torch.float64).double()
    return rel_max_error(kernel32((a, sa), (b, sb)), ref), rel_max_error(theirs(), ref)


def measure(name: str, m: int, n: int, k: int, kernels: dict, samples: int, graphs: bool = False) -> tuple:
    dev = "cuda"
    a, sa, b, sb, a16, b16 = block_scaled(m, n, k)
    bias = torch.randn(n, device=dev).to(torch.bfloat16)
    s = torch.tensor(0.25, device=dev)
    if "identity" not in kernels:
        kernels["identity"] = evtc.compile(identity, {"a": (a, sa), "b": (b, sb)})
        kernels["float32"] = evtc.compile(to_float32, {"a": (a, sa), "b": (b, sb)})
        kernels["fused"] = evtc.compile(fused, {"a": (a, sa), "b": (b, sb), "bias": bias, "s": s})
    ki, k32, kf = kernels["identity"], kernels["float32"], kernels["fused"]
    calls = {
        "evtc": lambda: ki((a, sa), (b, sb)),
        "torch": lambda: torch_blockwise(a, sa, b, sb),
        "bf16": lambda: torch.matmul(a16, b16),
        "evtc_f": lambda: kf((a, sa), (b, sb), bias=bias, s=s),
        "eager_f": lambda: eager_fused(a, sa, b, sb, bias, s),
        "dequant": lambda: eager_dequant(a, sa, b, sb),
    }
    times = time_calls(calls, samples, graphs)
    err_evtc, err_torch = errors(m, n, k, to_float32, k32,
                                 lambda: torch_blockwise(a, sa, b, sb, torch.float32), a, sa, b, sb)
    return (name, m, n, k, times["torch"] / times["evtc"], times["bf16"] / times["evtc"],
            times["eager_f"] / times["evtc_f"], times["dequant"] / times["evtc"], times["evtc"] * 1e3,
            err_evtc, err_torch)


def measure_swiglu(name: str, m: int, n: int, k: int, kernels: dict, samples: int,
                   graphs: bool = False) -> tuple:
    """A gate/up layer (N: both halves) with the SwiGLU in the epilogue (see ``--swiglu``)."""
    a, sa, b, sb, a16, b16 = block_scaled(m, n, k)
    s = torch.tensor(0.25, device="cuda")
    if "swiglu" not in kernels:
        kernels["swiglu"] = evtc.compile(swiglu, {"a": (a, sa), "b": (b, sb)})
        kernels["swiglu32"] = evtc.compile(swiglu_float32, {"a": (a, sa), "b": (b, sb)})
        kernels["swiglu8"] = evtc.compile(swiglu_fp8, {"a": (a, sa), "b": (b, sb), "s": s})
    kg, k32, k8 = kernels["swiglu"], kernels["swiglu32"], kernels["swiglu8"]
    calls = {
        "evtc": lambda: kg((a, sa), (b, sb)),
        "torch": lambda: swiglu(torch_blockwise(a, sa, b, sb)),
        "bf16": lambda: swiglu(torch.matmul(a16, b16)),
        "evtc_f": lambda: k8((a, sa), (b, sb), s=s),
        "eager_f": lambda: swiglu_fp8(torch_blockwise(a, sa, b, sb), s),  # the epilogue is PyTorch
    }
    times = time_calls(calls, samples, graphs)
    err_evtc, err_torch = errors(m, n, k, swiglu_float32, k32,
                                 lambda: swiglu(torch_blockwise(a, sa, b, sb, torch.float32)), a, sa, b, sb)
    return (name, m, n, k, times["torch"] / times["evtc"], times["bf16"] / times["evtc"],
            times["eager_f"] / times["evtc_f"], times["evtc"] * 1e3, err_evtc, err_torch)


def main() -> None:
    p = row_parser(__doc__, "128,2048,8192", 11)
    p.add_argument("--swiglu", action="store_true", help="the gate/up layers with a SwiGLU epilogue")
    args = p.parse_args()
    ms, keep = row_selection(args)
    torch.manual_seed(0)
    kernels: dict[str, evtc.Kernel] = {}
    if args.swiglu:
        rows = run_rows(ms, keep or ["gate_up"],
                        lambda name, m, n, k: measure_swiglu(name, m, n, k, kernels, args.samples,
                                                             args.graphs),
                        f"{'torch':>6} {'bf16':>6} {'fused':>6}", "{:6.3f} {:6.3f} {:6.3f}")
        print_summary(rows, ms, ("SwiGLU vs torch blockwise + eager SwiGLU", "vs bf16 GEMM + eager SwiGLU",
                                 "SwiGLU, e4m3 out, amax vs torch blockwise + eager"),
                      "float32 results; baseline: torch blockwise + SwiGLU")
        return
    rows = run_rows(ms, keep,
                    lambda name, m, n, k: measure(name, m, n, k, kernels, args.samples, args.graphs),
                    f"{'torch':>6} {'bf16':>6} {'fused':>6} {'dequant':>7}",
                    "{:6.3f} {:6.3f} {:6.3f} {:7.3f}")
    print_summary(rows, ms, ("vs torch blockwise", "vs bf16 GEMM",
                             "fused (bias, GELU, e4m3 out, amax) vs torch blockwise + eager",
                             "vs eager dequantization + bf16 GEMM"),
                  "float32 results; baseline: torch blockwise")


if __name__ == "__main__":
    main()
