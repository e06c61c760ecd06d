"""Time evtc's SM90 GEMM against torch.matmul (cuBLAS) on the same random inputs, in one process.

    python3 bench/gemm.py                                  # the three reference shapes, f16 + bf16
    python3 bench/gemm.py --epi 16,32,64                   # the three epilogue tiles
    python3 bench/gemm.py --tile-n 128,256 --cluster 1x1,2x1,1x2 --dtypes f16   # pick a default
    python3 bench/gemm.py --epilogue lincomb               # alpha*acc + beta*C vs torch.addmm

Each configuration is timed with CUDA events: warm-up, then ``--samples`` samples of ``--reps``
back-to-back launches each; the table shows the median per launch.  ratio = cuBLAS time / evtc
time (> 1: evtc faster).  Inputs are random normal (never zeros or small integers: data-dependent
power draw changes the clock).  Every evtc result is checked against cuBLAS before it is timed.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import evtc  # noqa: E402
from evtc.plan.config import DEFAULT_SCHEDULE, GemmConfig  # noqa: E402
from evtc.timing import time_paired  # noqa: E402

DTYPES = {"f16": ("float16", torch.float16), "bf16": ("bfloat16", torch.bfloat16),
          "f32": ("float32", torch.float32)}
DEFAULT_SHAPES = "8192x8192x8192,4096x4096x4096,8192x8192x1024"


def parse_list(text: str, conv=str):
    """Comma list; the word ``default`` stands for GemmConfig's default (None)."""
    return [None if x == "default" else conv(x) for x in text.split(",") if x]


def parse_shape(text: str) -> tuple[int, int, int]:
    m, n, k = (int(x) for x in text.lower().split("x"))
    return m, n, k


def parse_cluster(text: str) -> tuple[int, int]:
    cm, cn = (int(x) for x in text.lower().split("x"))
    return cm, cn


def make_cublas(a, b, c, ref, alpha, beta):
    """The torch (cuBLAS) counterpart of the evtc launch, writing into ``ref``."""
    if c is not None:
        return lambda: torch.addmm(c, a, b, beta=beta, alpha=alpha, out=ref)
    if ref.dtype == a.dtype:
        return lambda: torch.matmul(a, b, out=ref)
    # cuBLAS through torch cannot write another dtype: time matmul + cast, as a user would.
    return lambda: ref.copy_(torch.matmul(a, b))


def identity(acc):
    return acc


def lincomb(acc, c, alpha: float, beta: float):
    return alpha * acc + beta * c


def compile_config(cfg: GemmConfig, a, b, c, d_dtype):
    """The kernel of ``cfg`` through ``evtc.compile`` (every knob pinned, the cluster included), the
    path every evtc kernel takes; the calls below run it through the same launcher as users do."""
    knobs = {k: v for k, v in vars(cfg).items()
             if v is not None and k not in ("ab_dtype", "d_dtype", "a_major", "b_major", "gated", "store_d")}
    if c is None:
        return evtc.compile(identity, {"a": a, "b": b}, out_dtypes=d_dtype, config=knobs, strict=True)
    return evtc.compile(lincomb, {"a": a, "b": b, "c": c, "alpha": 1.0, "beta": 1.0}, out_dtypes=d_dtype,
                        config=knobs, strict=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma list of MxNxK")
    p.add_argument("--dtypes", default="f16,bf16", help="input dtypes: f16, bf16")
    p.add_argument("--d-dtype", default=None, help="output dtype (f16, bf16, f32); default: input dtype")
    p.add_argument("--tile-n", default="default",
                   help="comma list of tile N (64, 128, 256; default: the schedule's)")
    p.add_argument("--cluster", default="default",
                   help="comma list of clusters (1x1, 2x1, 1x2; default: the schedule's)")
    p.add_argument("--epi", default="32", help="comma list of epilogue tile N (16, 32, 64)")
    p.add_argument("--epi-stages", type=int, default=None, help="D staging buffers (default: auto)")
    p.add_argument("--swizzle", default="8", help="comma list of raster swizzle widths")
    p.add_argument("--raster", default="m", help="comma list of raster orders (m, n)")
    p.add_argument("--schedule", default=DEFAULT_SCHEDULE,
                   help="comma list of consumer schedules (cooperative, pingpong)")
    p.add_argument("--a-major", default="k", choices=["k", "m"])
    p.add_argument("--b-major", default="k", choices=["k", "n"],
                   help="k: B = W.T with W (N, K) row-major (nn.Linear weights); n: B (K, N) row-major")
    p.add_argument("--epilogue", default="identity", choices=["identity", "lincomb"])
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--samples", type=int, default=30)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    if not torch.cuda.is_available():
        sys.exit("bench/gemm.py needs a CUDA GPU")
    dev = torch.cuda.get_device_name()
    print(f"# {dev}; torch {torch.__version__}; epilogue {args.epilogue}; "
          f"A {args.a_major}-major, B {args.b_major}-major; median of {args.samples} x {args.reps} launches")

    header = (f"{'M x N x K':>20} {'dtype':>9} {'config':>34} {'stages':>7} {'evtc ms':>9} {'TFLOP/s':>8} "
              f"{'cuBLAS ms':>10} {'TFLOP/s':>8} {'ratio':>6} {'rel err':>8}")
    print(header)
    print("-" * len(header))

    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    rows = []
    for shape_text, dname in itertools.product(parse_list(args.shapes), parse_list(args.dtypes)):
        m, n, k = parse_shape(shape_text)
        ab_name, ab = DTYPES[dname]
        d_name, dt = DTYPES[args.d_dtype or dname]
        a = torch.randn((m, k) if args.a_major == "k" else (k, m), device="cuda", generator=gen).to(ab)
        a = a if args.a_major == "k" else a.t()
        b = torch.randn((n, k) if args.b_major == "k" else (k, n), device="cuda", generator=gen).to(ab)
        b = b.t() if args.b_major == "k" else b
        d = torch.empty((m, n), device="cuda", dtype=dt)
        ref = torch.empty((m, n), device="cuda", dtype=dt)
        c = None
        alpha, beta = 1.5, 0.5
        if args.epilogue == "lincomb":
            c = torch.randn((m, n), device="cuda", generator=gen).to(dt)
        cublas = make_cublas(a, b, c, ref, alpha, beta)
        cublas()
        flops = 2.0 * m * n * k

        knobs = itertools.product(parse_list(args.tile_n, int), parse_list(args.cluster, parse_cluster),
                                  parse_list(args.epi, int), parse_list(args.swizzle, int),
                                  parse_list(args.raster), parse_list(args.schedule))
        for tile_n, cluster, epi_n, swizzle, raster, schedule in knobs:
            cfg = GemmConfig(ab_dtype=ab_name, d_dtype=d_name, a_major=args.a_major, b_major=args.b_major,
                             d_major="n", tile_n=tile_n, cluster=cluster, epi_tile_n=epi_n,
                             epi_stages=args.epi_stages, swizzle=swizzle, raster=raster,
                             schedule=schedule)
            label = (f"{cfg.tile_m}x{cfg.tile_n} c{cfg.cluster[0]}x{cfg.cluster[1]} epi{epi_n} "
                     f"sw{swizzle}{raster}"
                     + (" pp" if schedule == "pingpong" else ""))
            try:
                cfg.validate()
                gemm = compile_config(cfg, a, b, c, dt)
                kwargs = {} if c is None else {"c": c, "alpha": alpha, "beta": beta}

                def launch(gemm=gemm, a=a, b=b, d=d, kwargs=kwargs):
                    gemm(a, b, out=d, **kwargs)
            except Exception as exc:  # report and go on: one bad knob must not lose the table
                print(f"{shape_text:>20} {dname:>9} {label:>34}  skipped: {exc}")
                continue
            d.fill_(float("nan"))
            launch()
            torch.cuda.synchronize()
            err = ((d.float() - ref.float()).norm() / ref.float().norm()).item()
            # cuBLAS is timed again beside every configuration: ratios come from the same minutes.
            t, t_cublas = time_paired([launch, cublas], args.warmup, args.samples, args.reps)
            ratio = t_cublas / t
            stages = f"{gemm.stages['ab']}/{gemm.stages['d']}"
            row = (f"{shape_text:>20} {dname:>9} {label:>34} {stages:>7} {t:9.4f} {flops / t / 1e9:8.1f} "
                   f"{t_cublas:10.4f} {flops / t_cublas / 1e9:8.1f} {ratio:6.3f} {err:8.1e}")
            if not err <= 1e-2:
                row += "  WRONG RESULT"
            print(row, flush=True)
            rows.append((shape_text, dname, label, ratio))

    if rows:
        print()
        print("# best config per shape and dtype (ratio = cuBLAS / evtc)")
        best = {}
        for shape_text, dname, label, ratio in rows:
            key = (shape_text, dname)
            if key not in best or ratio > best[key][1]:
                best[key] = (label, ratio)
        for (shape_text, dname), (label, ratio) in best.items():
            print(f"{shape_text:>20} {dname:>9} {label:>34} {ratio:6.3f}")


if __name__ == "__main__":
    main()
