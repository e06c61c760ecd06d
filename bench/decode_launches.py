"""Decode-sized launches pinned one by one: 64-row tiles that load only A's rows
(``GemmConfig.a_rows``), by cluster shape and A/B pipeline depth, against cuBLAS.

``a_rows`` is not a compile knob (a kernel that chooses its launch trims A's loads itself), so
``bench/sweep_configs.py`` cannot pin it. Here each candidate is a handle of the default kernel
whose launch choice returns that configuration: the same compiled family, one launch each.

    python3 bench/decode_launches.py 1x4608x3584 16x4096x14336
    python3 bench/decode_launches.py 64x3584x3584 --candidates 64:1x4,32:1x4,32:1x1:10
    python3 bench/decode_launches.py 1x4096x14336 --candidates 64:1x1,64:1x1::2   # 2 splits of K
    python3 bench/decode_launches.py 1x14336x4096 --epilogue swiglu --candidates 128:1x2,256:1x2
    python3 bench/decode_launches.py --compile-only            # build the candidates (no GPU)

Each shape's candidates and cuBLAS run in one ``time_paired`` call (CUDA graphs cycling 256 MB of
weight copies, shuffled order per sample, medians); ratio = cuBLAS time / candidate time. A
candidate's ``a_rows`` is the fewest of 8, 16 and 32 that holds M with 8 rows per CTA sharing A
(none past 32 rows: the whole tile); one that does not fit shared memory is skipped. With
``--epilogue swiglu`` the kernel is gated (SwiGLU over both halves of a 2N x K weight; a shape's N
is the output's), and the eager way (cuBLAS, then the activation) is timed too.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import evtc  # noqa: E402
from evtc.plan.config import ConfigError  # noqa: E402
from evtc.plan.selector import with_a_rows_for  # noqa: E402
from evtc.runtime.invoke import built_config  # noqa: E402
from evtc.timing import time_paired  # noqa: E402

# (tile_n, cluster, ab_stages or None for as many as fit); one split of K unless a candidate says
CANDIDATES = [
    (64, (1, 4), None), (64, (1, 4), 10), (64, (1, 2), None), (64, (1, 1), None), (64, (1, 1), 10),
    (64, (2, 1), None), (128, (1, 1), None), (128, (1, 4), None),
]


def identity(acc):
    return acc


def residual(acc, C):
    return acc + C


def swiglu(acc):
    gate, up = acc.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


# swiglu: a gated kernel, b holds both halves; residual: C of (M, N), against torch.addmm too
EPILOGUES = {"identity": identity, "residual": residual, "swiglu": swiglu}


def parse_candidates(text: str) -> list[tuple]:
    """``[tile_m x]tile_n:cluster[:ab_stages[:splits[:epi_tile_n[:load_stages]]]]`` items,
    comma-separated (``64:1x4,64x32:1x1:10,64:1x1::2,64:1x1:::16``); a tile without tile_m keeps
    the default launch's, an empty ab_stages fits as many as shared memory holds, splits (of K)
    default to one, epi_tile_n and load_stages (epilogue subtile width, C's load stages) to the
    default launch's."""
    out = []
    for item in filter(None, text.split(",")):
        tile, cluster, *rest = item.split(":")
        ab, splits, epi, loads = (rest + ["", "", "", ""])[:4]
        cm, cn = (int(c) for c in cluster.split("x"))
        tile_m, _, tile_n = tile.rpartition("x")
        out.append((int(tile_n), (cm, cn), int(ab) if ab else None, int(tile_m) if tile_m else None,
                    int(splits) if splits else 1, int(epi) if epi else None, int(loads) if loads else None))
    return out


def pinned(kernel, m: int, n: int, k: int, candidates=None) -> tuple[object, dict]:
    """(the default launch, {label: a handle of ``kernel`` that always launches that candidate of
    ``candidates``, :data:`CANDIDATES` by default})."""
    default, _ = kernel.launch_for(m, n, k)
    handles = {}
    for tile_n, cluster, ab, *rest in candidates or CANDIDATES:
        tile_m, splits, epi, loads = (rest + [None, 1, None, None][len(rest):])[:4]
        tile_m = tile_m or default.tile_m
        schedule = "pingpong" if tile_m == 64 else default.schedule
        name = f"{tile_m}x{tile_n} {cluster[0]}x{cluster[1]}"
        tail = (f" ab{ab or 'fit'}" + (f" s{splits}" if splits > 1 else "") + (f" e{epi}" if epi else "")
                + (f" l{loads}" if loads else ""))
        epi_tile_n = epi or (default.epi_tile_n if tile_n % default.epi_tile_n == 0 else 16)
        try:
            # A's rows trimmed as the selector trims them for this cluster.
            config = with_a_rows_for(default.replace(
                tile_m=tile_m, tile_n=tile_n, cluster=cluster, a_rows=None, ab_stages=ab,
                # pinned stages: D gets the two buffers it needs, no more
                epi_stages=None if ab is None else 2, schedule=schedule, epi_tile_n=epi_tile_n,
                load_stages=loads or default.load_stages), m)
        except ConfigError as exc:
            print(f"{m}x{n}x{k} {name}{tail}: skipped ({exc})")
            continue
        handles[f"{name} a{config.a_rows}{tail}"] = launch_handle(kernel, config, splits)
    return default, handles


def launch_handle(kernel, config, splits: int = 1):
    """A handle of ``kernel`` (its compiled family, a launch memo of its own) whose every call
    launches ``config`` with ``splits`` splits of K, whatever the problem's size."""
    handle = kernel._copy(_launch_memo={})
    handle.launch_for = lambda *_, **__: (config, splits)
    return handle


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("shapes", nargs="*", default=["1x4608x3584", "1x4096x14336", "16x4608x3584"])
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--candidates", default="",
                   help="[tile_m x]tile_n:cluster[:ab_stages[:splits]] items, e.g. 32:1x4,64:1x1::2")
    p.add_argument("--samples", type=int, default=9)
    p.add_argument("--epilogue", choices=sorted(EPILOGUES), default="identity",
                   help="swiglu: a gated kernel; a shape's N is the output's (the weight has 2N rows)")
    args = p.parse_args()
    example = {"a": torch.empty(8, 64, dtype=torch.bfloat16, device="meta"),
               "b": torch.empty(128, 64, dtype=torch.bfloat16, device="meta").t()}
    if args.epilogue == "residual":
        example["C"] = torch.empty(8, 128, dtype=torch.bfloat16, device="meta")
    kernel = evtc.compile(EPILOGUES[args.epilogue], example)
    candidates = parse_candidates(args.candidates) or CANDIDATES
    if args.compile_only:
        for shape in args.shapes:
            m, n, k = (int(x) for x in shape.split("x"))
            for label, handle in pinned(kernel, m, n, k, candidates)[1].items():
                try:
                    config, splits = handle.launch_for(m, n, k)
                    stages = kernel._variant(built_config(config, splits)).stages
                except ConfigError as exc:
                    print(f"{shape} {label}: skipped ({exc})")
                else:
                    print(f"{shape} {label}: {stages}")
        return
    import shapes as shape_suite  # bench/shapes.py: its CUDA-graph capture

    shape_suite.load_torch()
    for shape in args.shapes:
        time_shape(kernel, shape, args.samples, shape_suite.capture, candidates)


def time_shape(kernel, shape: str, samples: int, capture, candidates) -> None:
    """Time cuBLAS, the default launch and every candidate on one M x N x K problem; print ratios."""
    m, n, k = (int(x) for x in shape.split("x"))
    gated = kernel.plan.gated
    rows = 2 * n if gated else n  # the weight's rows: a gated weight holds both halves
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    copies = min(64, max(2, math.ceil((256 << 20) / (rows * k * 2))))
    weights = [(torch.randn(rows, k, device="cuda", generator=g) * k ** -0.5).bfloat16()
               for _ in range(copies)]
    ref = x.double() @ weights[0].double().t()
    if gated:
        ref = swiglu(ref)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    ops = {}
    if "C" in kernel.operand_names:
        ops["C"] = torch.randn(m, n, device="cuda", generator=g).bfloat16()
        ref = ref + ops["C"].double()
    default, handles = pinned(kernel, m, n, k, candidates)
    default_splits = kernel.launch_for(m, n, k)[1]
    calls = {"cublas": lambda w: torch.matmul(x, w.t()),
             "default": lambda w: kernel(x, w.t(), out=out, **ops)}
    if gated:  # cuBLAS, then the activation as separate kernels
        calls["eager"] = lambda w: swiglu(torch.matmul(x, w.t()))
    if ops:  # cuBLASLt's own fused residual
        calls["eager"] = lambda w: torch.addmm(ops["C"], x, w.t())
    for label, handle in handles.items():
        try:
            got = handle(x, weights[0].t(), out=out, **ops)
        except (ConfigError, evtc.CallError) as exc:
            print(f"{shape} {label}: skipped ({str(exc)[:80]})")
            continue
        err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < 2e-2, (shape, label, err)
        calls[label] = lambda w, handle=handle: handle(x, w.t(), out=out, **ops)
    reps = max(1, min(500, math.ceil(1e3 / max(2.0, m * n * k * 2 / 600e12 * 1e6))))
    graphs = {label: capture(fn, weights, reps).replay for label, fn in calls.items()}
    labels = list(graphs)
    times = time_paired([graphs[label] for label in labels], 2, samples, 1)
    us = {label: t / reps * 1e3 for label, t in zip(labels, times, strict=True)}
    base = us["cublas"]
    print(f"{shape}: cuBLAS {base:.1f} us; default [{default.short_name()} s{default_splits}] "
          f"{base / us['default']:.3f}; "
          + "; ".join(f"{label} {base / us[label]:.3f}" for label in labels[2:]), flush=True)

if __name__ == "__main__":
    main()
