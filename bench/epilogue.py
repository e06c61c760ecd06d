"""Time a fused evtc epilogue against cuBLAS, our identity GEMM, eager PyTorch and torch.compile.

    python3 bench/epilogue.py                      # the three reference shapes, float16
    python3 bench/epilogue.py --shapes 4096x4096x4096 --samples 30

The epilogue is ``relu(alpha * acc + beta * C + bias)`` with a row bias, in float16. Every variant
runs on the same random-normal inputs in the same process, timed with CUDA events in alternation
(warm-up, then ``--samples`` samples of ``--reps`` back-to-back calls; medians per call). The fused
kernel's result is checked against torch in float32 first.

Also measured: host time per call on a small problem (128x128x128; mean over many calls, timed with
a host clock after a synchronize, while the GPU work is tiny), for evtc and for torch.matmul; and,
in fresh subprocesses, the first compile of a new epilogue and its load from the disk cache.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import evtc  # noqa: E402
from evtc.timing import time_paired  # noqa: E402

DEFAULT_SHAPES = "8192x8192x8192,4096x4096x4096,8192x8192x1024"
ALPHA, BETA = 1.5, 0.5


def fused(acc, C, bias, alpha: float, beta: float):
    return torch.relu(alpha * acc + beta * C + bias)


def identity(acc):
    return acc


def eager(a, b, C, bias, alpha: float, beta: float):
    return torch.relu(alpha * torch.matmul(a, b) + beta * C + bias)


def host_us_per_call(fn, calls: int = 2000) -> float:
    """Mean host microseconds per call (the GPU work is tiny: launches never queue up for long)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        best = min(best, (t1 - t0) / calls * 1e6)
    return best


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return (torch.linalg.vector_norm(got.float() - want) / torch.linalg.vector_norm(want)).item()


_COMPILE_SCRIPT = r"""
import json, sys, time
sys.path.insert(0, {root!r})
t0 = time.perf_counter()
import torch, evtc
t1 = time.perf_counter()
def new_epilogue(acc, C, bias, alpha: float):
    return torch.sigmoid(alpha * acc + C * {salt!r} + bias)
ex = dict(a=torch.empty(64, 64, dtype=torch.float16, device="meta"),
          b=torch.empty(64, 64, dtype=torch.float16, device="meta"),
          C=torch.empty(64, 64, dtype=torch.float16, device="meta"),
          bias=torch.empty(64, dtype=torch.float16, device="meta"), alpha=1.0)
k = evtc.compile(new_epilogue, ex, cache_dir={cache!r})
t2 = time.perf_counter()
print(json.dumps(dict(origin=k.origin, compile_s=t2 - t1, kernel_s=k.seconds, import_s=t1 - t0)))
"""


def compile_times() -> dict:
    """First compile of a never-seen epilogue, then its load from the disk cache, each in a fresh
    process (so nothing is cached in memory)."""
    salt = 0.25 + (time.time_ns() % 1000) / 1e6  # a new constant: a new kernel
    with tempfile.TemporaryDirectory() as cache:
        script = _COMPILE_SCRIPT.format(root=str(ROOT), salt=salt, cache=cache)
        runs = []
        for _ in range(2):
            out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                 env=dict(os.environ), timeout=600)
            if out.returncode != 0:
                return {"error": out.stderr[-2000:]}
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {"first": runs[0], "cached": runs[1]}


def parse_configs(text: str) -> list[dict]:
    """``"load_stages=8,ab_stages=3;tile_n=128,cluster=1x2"`` -> one GemmConfig override per ``;``."""
    configs = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        cfg: dict = {}
        for pair in item.split(","):
            key, value = (x.strip() for x in pair.split("="))
            cfg[key] = tuple(int(v) for v in value.split("x")) if key == "cluster" else (
                value if key in ("raster", "schedule") else int(value))
        configs.append(cfg)
    return configs


def config_label(cfg: dict) -> str:
    return ",".join(f"{k}={'x'.join(map(str, v)) if isinstance(v, tuple) else v}" for k, v in cfg.items())


def run_shape(text, k_fused, k_ident, compiled_eager, args, gen, variants=()) -> dict:
    """Time every variant at one M x N x K and print its row."""
    m, n, kk = (int(x) for x in text.lower().split("x"))
    a = (torch.randn(m, kk, device="cuda", generator=gen) * kk ** -0.25).half()
    b = (torch.randn(kk, n, device="cuda", generator=gen) * kk ** -0.25).half()
    C = torch.randn(m, n, device="cuda", generator=gen).half()
    bias = torch.randn(n, device="cuda", generator=gen).half()
    d_fused = torch.empty(m, n, device="cuda", dtype=torch.float16)
    d_ident = torch.empty(m, n, device="cuda", dtype=torch.float16)
    kw = dict(C=C, bias=bias, alpha=ALPHA, beta=BETA)

    got = k_fused(a, b, **kw)
    want = fused(a.float() @ b.float(), C.float(), bias.float(), ALPHA, BETA)
    err = rel_err(got, want)

    fns = {
        "cublas": lambda: torch.matmul(a, b),
        "ident": lambda: k_ident(a, b, out=d_ident),
        "fused": lambda: k_fused(a, b, out=d_fused, **kw),
        "eager": lambda: eager(a, b, C, bias, ALPHA, BETA),
    }
    tc_note = ""
    if compiled_eager is not None:
        try:
            compiled_eager(a, b, C, bias, ALPHA, BETA)
            fns["tc"] = lambda: compiled_eager(a, b, C, bias, ALPHA, BETA)
        except Exception as exc:  # noqa: BLE001 - report and go on
            tc_note = f"torch.compile failed at {text}: {type(exc).__name__}: {str(exc)[:300]}"
    # Configuration variants: each fused kernel beside the identity GEMM of the same configuration.
    for i, (label, kf, ki) in enumerate(variants):
        out_f = torch.empty(m, n, device="cuda", dtype=torch.float16)
        out_i = torch.empty(m, n, device="cuda", dtype=torch.float16)
        variant_err = rel_err(kf(a, b, **kw), want)
        if not variant_err <= 1e-2:
            print(f"    variant {label}: WRONG RESULT (rel err {variant_err:.1e})")
        fns[f"fused{i}"] = lambda kf=kf, out_f=out_f: kf(a, b, out=out_f, **kw)
        fns[f"ident{i}"] = lambda ki=ki, out_i=out_i: ki(a, b, out=out_i)
    times = dict(zip(fns, time_paired(list(fns.values()), args.warmup, args.samples, args.reps),
                     strict=True))
    tc = f"{times['tc']:.3f}" if "tc" in times else "n/a"
    print(f"{text:>20} | {times['cublas']:8.3f} | {times['ident']:8.3f} | {times['fused']:10.3f} | "
          f"{times['eager']:8.3f} | {tc:>13} | {times['fused'] / times['ident']:8.3f} | "
          f"{times['eager'] / times['fused']:11.2f} | {err:.1e}")
    if tc_note:
        print("   ", tc_note)
    for i, (label, kf, _) in enumerate(variants):
        stages = kf.stages
        print(f"{'':>20}   variant {label} stages {stages}: ident {times[f'ident{i}']:.3f}  "
              f"fused {times[f'fused{i}']:.3f}  "
              f"fused/id {times[f'fused{i}'] / times[f'ident{i}']:.3f}  "
              f"fused/default-id {times[f'fused{i}'] / times['ident']:.3f}")
    return {"shape": text, "ms": times, "rel_err": err, "torch_compile_note": tc_note}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=DEFAULT_SHAPES)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--samples", type=int, default=15)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--no-torch-compile", action="store_true")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--configs", default="",
                        help="also time these GemmConfig overrides, ';'-separated, e.g. "
                             "'load_stages=8,ab_stages=3,epi_stages=2;tile_n=128'")
    parser.add_argument("--no-extras", action="store_true",
                        help="skip the host-overhead and compile-time measurements")
    args = parser.parse_args()

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    dev = torch.cuda.get_device_name()
    print(f"device: {dev}; torch {torch.__version__}; evtc {evtc.__version__}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    results: dict = {"device": dev, "shapes": []}

    ex_meta = dict(a=torch.empty(64, 64, dtype=torch.float16, device="meta"),
                   b=torch.empty(64, 64, dtype=torch.float16, device="meta"),
                   C=torch.empty(64, 64, dtype=torch.float16, device="meta"),
                   bias=torch.empty(64, dtype=torch.float16, device="meta"), alpha=1.0, beta=1.0)
    t0 = time.perf_counter()
    k_fused = evtc.compile(fused, ex_meta)
    k_ident = evtc.compile(identity, {"a": ex_meta["a"], "b": ex_meta["b"]})
    print(f"compiled (or loaded) both kernels in {time.perf_counter() - t0:.2f} s "
          f"({k_fused.origin}, {k_ident.origin})")

    variants = []
    for cfg in parse_configs(args.configs):
        variants.append((config_label(cfg), evtc.compile(fused, ex_meta, config=cfg),
                         evtc.compile(identity, {"a": ex_meta["a"], "b": ex_meta["b"]}, config=cfg)))

    compiled_eager = None
    compile_note = ""
    if not args.no_torch_compile:
        try:
            compiled_eager = torch.compile(eager, mode="max-autotune-no-cudagraphs")
        except Exception as exc:  # noqa: BLE001 - report and go on
            compile_note = f"torch.compile failed: {type(exc).__name__}: {exc}"

    header = (f"{'M x N x K':>20} | {'cuBLAS':>8} | {'evtc id':>8} | {'evtc fused':>10} | {'eager':>8} | "
              f"{'torch.compile':>13} | fused/id | eager/fused | rel err")
    print(header)
    print("-" * len(header))
    for text in args.shapes.split(","):
        results["shapes"].append(run_shape(text, k_fused, k_ident, compiled_eager, args, gen, variants))
    print("(milliseconds per call, medians; fused/id: fused epilogue over our identity GEMM)")
    if compile_note:
        print(compile_note)
        results["torch_compile_note"] = compile_note

    if args.no_extras:
        return
    # ---- host overhead per call ----
    a = torch.randn(128, 128, device="cuda").half()
    b = torch.randn(128, 128, device="cuda").half()
    C = torch.randn(128, 128, device="cuda").half()
    bias = torch.randn(128, device="cuda").half()
    out = torch.empty(128, 128, device="cuda", dtype=torch.float16)
    kw = dict(C=C, bias=bias, alpha=ALPHA, beta=BETA)
    host = {
        "torch.matmul": host_us_per_call(lambda: torch.matmul(a, b)),
        "evtc fused, out=": host_us_per_call(lambda: k_fused(a, b, out=out, **kw)),
        "evtc fused, new output": host_us_per_call(lambda: k_fused(a, b, **kw)),
        "evtc identity, out=": host_us_per_call(lambda: k_ident(a, b, out=out)),
    }
    print("\nhost time per call, 128x128x128 (us):")
    for name, us in host.items():
        print(f"  {name:>24}: {us:6.1f}")
    print(f"  evtc fused (out=) over torch.matmul: {host['evtc fused, out='] - host['torch.matmul']:+.1f} us")
    results["host_us"] = host

    ct = compile_times()
    results["compile"] = ct
    if "error" in ct:
        print("\ncompile-time measurement failed:\n" + ct["error"])
    else:
        print(f"\nnew epilogue, fresh process: first compile {ct['first']['compile_s']:.2f} s "
              f"(kernel build {ct['first']['kernel_s']:.2f} s, {ct['first']['origin']}); "
              f"disk-cache load {ct['cached']['compile_s']:.3f} s "
              f"(kernel load {ct['cached']['kernel_s'] * 1e3:.1f} ms, {ct['cached']['origin']}); "
              f"import evtc+torch {ct['cached']['import_s']:.2f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
