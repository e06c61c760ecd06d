"""Which part of a fused epilogue costs time: each operand kind alone, beside the identity GEMM.

    python3 bench/epilogue_parts.py                 # 8192x8192x8192 and 8192x8192x1024, float16

Every variant runs on the same random-normal inputs, timed in alternation with CUDA events
(median of ``--samples`` samples of ``--reps`` back-to-back calls); ratios are over evtc's identity
GEMM of the same run. Each result is checked against torch first.
"""

from __future__ import annotations

import argparse
import sys

import torch
from epilogue import parse_configs  # bench/ is on sys.path: the script's own folder

import evtc
from evtc.timing import time_paired

PARTS = {
    "identity": (lambda acc: acc, ()),
    "scalars": (lambda acc, alpha, beta: acc * alpha + beta, ("alpha", "beta")),
    "relu": (lambda acc: torch.relu(acc), ()),
    "row bias": (lambda acc, bias: acc + bias, ("bias",)),
    "col scale": (lambda acc, scale: acc * scale, ("scale",)),
    "C tile": (lambda acc, C: acc + C, ("C",)),
    "aux store": (lambda acc: (acc, torch.relu(acc)), ()),
    "full": (lambda acc, C, bias, alpha, beta: torch.relu(alpha * acc + beta * C + bias),
             ("C", "bias", "alpha", "beta")),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="8192x8192x8192,8192x8192x1024")
    p.add_argument("--samples", type=int, default=15)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--config", default="", help="GemmConfig overrides, as bench/epilogue.py --configs")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    config = (parse_configs(args.config) or [None])[0]
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}; config {config or 'default'}")
    for text in args.shapes.split(","):
        m, n, k = (int(x) for x in text.split("x"))
        a = (torch.randn(m, k, device="cuda", generator=gen) * k ** -0.25).half()
        b = (torch.randn(k, n, device="cuda", generator=gen) * k ** -0.25).half()
        values = {"C": torch.randn(m, n, device="cuda", generator=gen).half(),
                  "bias": torch.randn(n, device="cuda", generator=gen).half(),
                  "scale": torch.randn(m, 1, device="cuda", generator=gen).half(),
                  "alpha": 1.5, "beta": 0.5}
        fns, labels = [lambda a=a, b=b: torch.matmul(a, b)], ["cuBLAS"]
        for name, (fn, params) in PARTS.items():
            kw = {p_: values[p_] for p_ in params}
            k_ = evtc.compile(fn, {"a": a, "b": b, **kw}, config=config)
            want = evtc.reference(fn, {"a": a, "b": b, **kw})
            got = k_(a, b, **kw)
            for g_, w_ in zip(got if isinstance(got, tuple) else (got,),
                              want if isinstance(want, tuple) else (want,), strict=True):
                err = ((g_.float() - w_.float()).norm() / w_.float().norm()).item()
                if not err <= 1e-2:
                    print(f"{name}: WRONG RESULT, rel err {err:.1e}")
            outs = k_(a, b, **kw)
            fns.append(lambda k_=k_, kw=kw, outs=outs, a=a, b=b: k_(a, b, out=outs, **kw))
            labels.append(name)
        times = time_paired(fns, 5, args.samples, args.reps)
        ident = times[labels.index("identity")]
        print(f"--- {text}")
        for label, t in zip(labels, times, strict=True):
            print(f"{label:>12}: {t:.4f} ms   / identity {t / ident:.3f}")


if __name__ == "__main__":
    main()
