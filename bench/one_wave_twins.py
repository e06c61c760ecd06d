"""A cooperative tile's epilogue buffers against one more A/B stage, where each CTA runs one tile
(evtc.plan.selector.one_wave_twins): the identity against cuBLAS and a bf16 residual against
``torch.addmm``, each in its tile as the family plans it and in the twin plans. CUDA graphs cycle
through copies of the weight (so it streams from HBM), one process, shuffled order per sample,
medians; ratio = the baseline's time / evtc's (above 1: evtc faster).

    bash .devkit/gpu.sh python3 bench/one_wave_twins.py
    bash .devkit/gpu.sh python3 bench/one_wave_twins.py --epilogue residual --shapes 512x3584x14336x112

A shape is MxNxKxW: the problem and the cooperative tile's width W (128 rows, 2x1 clusters). The
plans are (load_stages, epi_stages) pinned; "planned" pins neither (docs/performance.md, "One tile
per CTA").
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = ("512x3584x18944x112,512x3584x3584x112,512x4608x3584x144,512x6144x4096x192,"
          "512x8192x8192x256,512x3584x14336x112,512x6144x14336x192")
# (load_stages, epi_stages): None leaves it to the planner. An identity epilogue has no loads.
PLANS = {"identity": [(None, None), (None, 2), (None, 1)],
         "residual": [(None, None), (3, 2), (3, 1), (2, 2), (2, 1)]}


def identity(acc):
    return acc


def residual(acc, C):
    return acc + C


def parse_shapes(text: str) -> list[tuple[int, int, int, int]]:
    return [tuple(int(v) for v in s.split("x")) for s in text.split(",") if s]


def plan_name(plan: tuple[int | None, int | None]) -> str:
    load, epi = plan
    if plan == (None, None):
        return "planned"
    return (f"loads {load} " if load is not None else "") + f"D {epi}"


def knobs(width: int, plan: tuple[int | None, int | None]) -> dict:
    load, epi = plan
    out = {"schedule": "cooperative", "tile_m": 128, "tile_n": width, "cluster": (2, 1)}
    if width % 32:
        out["epi_tile_n"] = 16  # 112 and 144 take 16-column subtiles
    if load is not None:
        out["load_stages"] = load
    if epi is not None:
        out["epi_stages"] = epi
    return out


def measure(shape: tuple[int, int, int, int], epilogue: str, samples: int) -> str:
    import shapes as suite
    import torch

    import evtc
    from evtc.timing import time_paired

    m, n, k, width = shape
    dt = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    x = torch.randn(m, k, device="cuda", generator=g).to(dt)
    C = torch.randn(m, n, device="cuda", generator=g).to(dt)
    copies = max(2, math.ceil((256 << 20) / (n * k * 2)))
    ws = [(torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).to(dt) for _ in range(min(copies, 32))]
    out = torch.empty(m, n, device="cuda", dtype=dt)
    if epilogue == "identity":
        fn, ex, extra = identity, {"a": x, "b": ws[0].t()}, {}
        calls = {"baseline": lambda w: torch.matmul(x, w.t(), out=out)}
        ref = x.double() @ ws[0].double().t()
    else:
        fn, ex, extra = residual, {"a": x, "b": ws[0].t(), "C": C}, {"C": C}
        calls = {"baseline": lambda w: torch.addmm(C, x, w.t(), out=out)}
        ref = torch.addmm(C.double(), x.double(), ws[0].double().t())
    labels = {}
    for plan in PLANS[epilogue]:
        try:
            kernel = evtc.compile(fn, ex, config=knobs(width, plan))
        except evtc.CompileError as exc:  # the plan does not fit this tile: say so, go on
            labels[plan_name(plan)] = f"n/a ({str(exc).splitlines()[0][:60]})"
            continue
        got = kernel(x, ws[0].t(), **extra)
        err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
        if err > 2e-2:
            raise AssertionError(f"{shape} {plan}: relative error {err:.2e}")
        name = f"{plan_name(plan)} (A/B {kernel.stages['ab']})"
        calls[name] = lambda w, kernel=kernel: kernel(x, w.t(), out=out, **extra)
    reps = max(1, min(300, math.ceil(1e3 / max(2.0, m * n * k * 2 / 600e12 * 1e6))))
    graphs = {name: suite.capture(call, ws, reps).replay for name, call in calls.items()}
    names = list(graphs)
    ms = time_paired([graphs[name] for name in names], 2, samples, 1)
    us = dict(zip(names, (t / reps * 1e3 for t in ms), strict=True))
    cells = [f"{name} {us['baseline'] / us[name]:.3f}" for name in names[1:]]
    cells += [f"{name} {why}" for name, why in labels.items()]
    return f"{m}x{n}x{k} 128x{width} {epilogue}: baseline {us['baseline']:.1f} us | " + "  ".join(cells)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=SHAPES, help="comma list of MxNxKxW")
    p.add_argument("--epilogue", choices=sorted(PLANS), action="append",
                   help="identity and/or residual (default: both)")
    p.add_argument("--samples", type=int, default=11)
    args = p.parse_args()
    import shapes as suite

    suite.load_torch()  # bench/shapes.py imports torch lazily
    for epilogue in args.epilogue or sorted(PLANS):
        for shape in parse_shapes(args.shapes):
            print(measure(shape, epilogue, args.samples), flush=True)


if __name__ == "__main__":
    main()
