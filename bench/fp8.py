"""float8 GEMMs (issue "FP8 inputs"): evtc against ``torch._scaled_mm`` (cuBLASLt) over the LLM
layers of bench/shapes.py, one process, shuffled order per sample, medians.

    bash .devkit/gpu.sh python3 bench/fp8.py [--ms 128,1024,4096,16384] [--samples 15] [--graphs]

Per (layer, M), e4m3 a (M, K) and a K-major weight (b = w.t(), w (N, K)), bf16 results:

* ``tensorwise``: ``acc * sa * sb`` with device scalars, against ``_scaled_mm`` with the same
  scalars (ratio = its time / evtc's, above 1: evtc faster);
* ``rowwise``: ``acc * sa * sb`` with sa (M, 1) and sb (N,), against ``_scaled_mm``'s rowwise
  scaling (sa (M, 1), sb (1, N));
* ``fused``: ``y = gelu(acc * sa * sb + bias)``, then ``(y * s).to(e4m3)`` and ``amax(|y|)``, one
  evtc kernel, against rowwise ``_scaled_mm`` followed by the same epilogue in eager PyTorch;
* ``dequant``: evtc's tensorwise call against an eager dequantization (bf16 copies of a and b times
  their scalars) followed by a bf16 ``torch.matmul``.

``--accum promote`` (the default) compiles evtc's kernels as they come (each K tile's partial sums
promoted into float32) and runs ``_scaled_mm`` without ``use_fast_accum`` (cuBLASLt promotes too);
``--accum fast`` compiles them with ``fast_accum=True`` against ``use_fast_accum=True``; ``--config``
adds GemmConfig knobs to every evtc kernel (a pinned tile against the selector's). Each row
also prints the largest relative error of both against float64 (tensorwise, float32 results, so
that only the accumulation differs). ``--graphs`` times every call replayed from a CUDA graph, the
kernels without the host: at M <= 512 both libraries' host time per call (about 20-35 us on the
H100's host) is above their kernels', and eager timing measures the host. Geomeans and the worst
row at the end.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import evtc  # noqa: E402
from evtc.timing import graphed, time_paired  # noqa: E402

E4M3 = torch.float8_e4m3fn
LAYERS = ["llama3-8b", "llama3-70b", "qwen2.5-7b", "mixtral-8x7b-expert", "deepseek-v3-expert", "lm-head"]


def scaled(acc, sa, sb):
    return acc * sa * sb


def fused(acc, sa, sb, bias, s):
    y = F.gelu(acc * sa * sb + bias)
    return (y * s).to(torch.float8_e4m3fn), y.abs().amax()


def scaled_to_float32(acc, sa, sb):
    return (acc * sa * sb).float()


def eager_fused(a, b, sa, sb_row, bias, s, fast: bool):
    y = F.gelu(torch._scaled_mm(a, b, scale_a=sa, scale_b=sb_row, out_dtype=torch.bfloat16,
                                use_fast_accum=fast) + bias)
    return (y * s).to(E4M3), y.abs().amax()


def eager_dequant(a, b, sa, sb):
    """The issue's other anchor: dequantize a and b in eager PyTorch (bf16 copies times their
    scales), then a bf16 GEMM."""
    return torch.matmul(a.to(torch.bfloat16) * sa, b.to(torch.bfloat16) * sb)


def shapes(ms: list[int]) -> list[tuple[str, int, int, int]]:
    from shapes import FAMILIES

    out = []
    for family in LAYERS:
        for layer in FAMILIES[family]:
            n = layer.gemm_n
            out += [(layer.name, m, n, layer.k) for m in ms]
    return out


GRAPH_CALLS = 10  # calls per CUDA graph replay (--graphs)


def time_calls(calls: dict, samples: int, graphs: bool = False) -> dict:
    """Median milliseconds of each call, timed in shuffled order per sample (after one call of each,
    which builds the kernel variants this size launches). ``graphs``: each call replayed from a
    CUDA graph of :data:`GRAPH_CALLS` calls, so that the kernels' time is measured without the
    host's (at small M both libraries' host time per call exceeds their kernels')."""
    for f in calls.values():
        f()
    torch.cuda.synchronize()
    if graphs:
        replays = [graphed(f, GRAPH_CALLS) for f in calls.values()]
        times = [t / GRAPH_CALLS for t in time_paired(replays, warmup=3, samples=samples, reps=1)]
    else:
        times = time_paired(list(calls.values()), warmup=3, samples=samples, reps=5)
    return dict(zip(calls, times, strict=True))


def config_knobs(text: str) -> dict:
    """``--config``: a JSON object of GemmConfig knobs for every evtc kernel (a pinned tile, e.g.
    ``{"schedule": "cooperative", "tile_n": 128, "cluster": [1, 2]}``); lists become tuples."""
    import json

    knobs = json.loads(text) if text else {}
    if not isinstance(knobs, dict):
        raise SystemExit(f"--config must be a JSON object of GemmConfig knobs, got {text!r}")
    return {key: tuple(v) if isinstance(v, list) else v for key, v in knobs.items()}


def measure(name: str, m: int, n: int, k: int, kernels: dict, samples: int, fast: bool,
            knobs: dict | None = None, graphs: bool = False) -> tuple:
    """One row: the three ratios, evtc's tensorwise time (us) and both errors. ``knobs``: more
    GemmConfig knobs for every kernel (``--config``)."""
    from shapes import rel_max_error
    dev = "cuda"
    a = (torch.randn(m, k, device=dev) * 2).to(E4M3)
    w = (torch.randn(n, k, device=dev) * 2).to(E4M3)
    b = w.t()
    one = torch.tensor(1.0, device=dev)
    sa_t, sb_t = torch.tensor(0.5, device=dev), torch.tensor(0.25, device=dev)
    sa_r = torch.rand(m, 1, device=dev) + 0.5
    sb_r = torch.rand(n, device=dev) / 8 + 0.01
    sb_row = sb_r.view(1, n)
    bias = torch.randn(n, device=dev).to(torch.bfloat16)
    if "scaled" not in kernels:
        cfg = {"fast_accum": fast, **(knobs or {})}
        kernels["scaled"] = evtc.compile(scaled, {"a": a, "b": b, "sa": sa_t, "sb": sb_t}, config=cfg)
        kernels["rowwise"] = evtc.compile(scaled, {"a": a, "b": b, "sa": sa_r, "sb": sb_r}, config=cfg)
        kernels["fused"] = evtc.compile(fused, {"a": a, "b": b, "sa": sa_r, "sb": sb_r, "bias": bias,
                                                "s": one}, config=cfg)
        kernels["float32"] = evtc.compile(scaled_to_float32, {"a": a, "b": b, "sa": sa_t, "sb": sb_t},
                                          config=cfg)
    kt, kr, kf, k32 = kernels["scaled"], kernels["rowwise"], kernels["fused"], kernels["float32"]
    calls = {
        "evtc_t": lambda: kt(a, b, sa=sa_t, sb=sb_t),
        "lt_t": lambda: torch._scaled_mm(a, b, scale_a=sa_t, scale_b=sb_t, out_dtype=torch.bfloat16,
                                         use_fast_accum=fast),
        "evtc_r": lambda: kr(a, b, sa=sa_r, sb=sb_r),
        "lt_r": lambda: torch._scaled_mm(a, b, scale_a=sa_r, scale_b=sb_row, out_dtype=torch.bfloat16,
                                         use_fast_accum=fast),
        "evtc_f": lambda: kf(a, b, sa=sa_r, sb=sb_r, bias=bias, s=one),
        "eager_f": lambda: eager_fused(a, b, sa_r, sb_row, bias, one, fast),
        "dequant": lambda: eager_dequant(a, b, sa_t, sb_t),
    }
    times = time_calls(calls, samples, graphs)
    err_evtc = err_lt = math.nan
    if m * n * k <= 2**37:  # a float64 reference in reasonable time and memory
        ref = a.double() @ b.double() * 0.125
        err_evtc = rel_max_error(k32(a, b, sa=sa_t, sb=sb_t), ref)
        err_lt = rel_max_error(torch._scaled_mm(a, b, scale_a=sa_t, scale_b=sb_t, out_dtype=torch.float32,
                                            use_fast_accum=fast), ref)
        del ref
    row = (name, m, n, k, times["lt_t"] / times["evtc_t"], times["lt_r"] / times["evtc_r"],
           times["eager_f"] / times["evtc_f"], times["dequant"] / times["evtc_t"], times["evtc_t"] * 1e3,
           err_evtc, err_lt)
    return row


def row_parser(doc: str | None, ms: str, samples: int) -> argparse.ArgumentParser:
    """The arguments of a bench that measures :func:`shapes` rows (this one, fp8_blockwise.py,
    tf32.py): --ms, --samples and --layers; :func:`row_selection` reads them."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ms", default=ms)
    p.add_argument("--samples", type=int, default=samples)
    p.add_argument("--layers", default="", help="comma-separated family/layer names to keep")
    p.add_argument("--graphs", action="store_true",
                   help="time each call replayed from a CUDA graph: the kernels without the host")
    return p


def row_selection(args: argparse.Namespace) -> tuple[list[int], list[str]]:
    """(M values, layer names to keep) of :func:`row_parser`'s arguments."""
    return [int(m) for m in args.ms.split(",")], [s for s in args.layers.split(",") if s]


def run_rows(ms: list[int], keep: list[str], measure_row, header: str, ratios_format: str) -> list[tuple]:
    """Measure every (layer, M) of :func:`shapes` (those whose name ends with one of ``keep``, if
    given, and whose a and b fit in memory) with ``measure_row(name, m, n, k)``, printing each row:
    (name, M, N, K, the ratios (as many as ``ratios_format`` formats), evtc's us, evtc's error,
    the baseline's error)."""
    rows = []
    planned = [(name, m, n, k) for name, m, n, k in shapes(ms)
               if (not keep or any(name.endswith(s) for s in keep)) and m * k + n * k <= 3 * 2**30]
    # A row can end the process without a Python error (the DSL aborts on some configurations):
    # the count here and the closing line tell a finished run from one cut short.
    print(f"# {len(planned)} rows to measure", flush=True)
    print(f"{'layer':>34} {'M':>6} {'N':>6} {'K':>6} | {header} | {'evtc us':>8} {'err evtc':>9} "
          f"{'err base':>9}")
    for name, m, n, k in planned:
        row = measure_row(name, m, n, k)
        rows.append(row)
        print(f"{name:>34} {m:6d} {n:6d} {k:6d} | {ratios_format.format(*row[4:-3])} | "
              f"{row[-3]:8.1f} {row[-2]:9.2e} {row[-1]:9.2e}", flush=True)
    print(f"# all {len(rows)} rows measured", flush=True)
    return rows


def print_summary(rows: list[tuple], ms: list[int], labels: tuple[str, ...], errors: str) -> None:
    """Geomean, per-M geomeans and the worst row of each ratio (one label per ratio); the largest
    errors (``errors`` names the rows and the baseline)."""

    def geomean(xs):
        return math.exp(statistics.fmean(math.log(x) for x in xs))

    for i, what in enumerate(labels, start=4):
        worst = min(rows, key=lambda r: r[i])
        print(f"{what}: geomean {geomean([r[i] for r in rows]):.3f} over {len(rows)} rows, worst "
              f"{worst[i]:.3f} ({worst[0]} M={worst[1]})")
        for m in ms:
            sel = [r[i] for r in rows if r[1] == m]
            if sel:
                print(f"    M={m}: {geomean(sel):.3f}")
    checked = [r for r in rows if not math.isnan(r[-2])]
    if checked:
        print(f"largest relative error vs float64 ({errors}, {len(checked)} rows): evtc "
              f"{max(r[-2] for r in checked):.2e}, baseline {max(r[-1] for r in checked):.2e}")


def main() -> None:
    p = row_parser(__doc__, "128,1024,4096,16384", 15)
    p.add_argument("--accum", choices=("promote", "fast"), default="promote")
    p.add_argument("--config", default="", help="JSON object of GemmConfig knobs for every evtc kernel "
                   "(a pinned tile, to compare with the selector's launches)")
    args = p.parse_args()
    knobs = config_knobs(args.config)
    ms, keep = row_selection(args)
    torch.manual_seed(0)
    kernels: dict[str, evtc.Kernel] = {}
    rows = run_rows(ms, keep,
                    lambda name, m, n, k: measure(name, m, n, k, kernels, args.samples, args.accum == "fast",
                                                  knobs, args.graphs),
                    f"{'tensorwise':>10} {'rowwise':>8} {'fused':>6} {'dequant':>7}",
                    "{:10.3f} {:8.3f} {:6.3f} {:7.3f}")
    print_summary(rows, ms, ("tensorwise", "rowwise", "fused (bias, GELU, e4m3 out, amax)",
                             "tensorwise vs eager dequantization + bf16 GEMM"),
                  "tensorwise; baseline: cuBLASLt")


if __name__ == "__main__":
    main()
