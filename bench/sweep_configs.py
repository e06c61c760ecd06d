"""Sweep kernel configurations (tile M x N, cluster, schedule, split count) over problem shapes and
time each against torch.matmul (cuBLAS), for fitting and checking the launch selector
(:mod:`evtc.plan.selector`).

    python3 bench/sweep_configs.py --shapes 64x4096x4096,16x14336x4096 --json out.json
    python3 bench/sweep_configs.py --family small      # decode-sized LLM layers
    python3 bench/sweep_configs.py --family large      # prefill-sized layers
    python3 bench/sweep_configs.py --family past_m --auto-only   # last row of tiles past M
    python3 bench/sweep_configs.py --shapes 1x3584x18944 --candidates decode_launches --splits 1,2,3

A candidate is a compiled pin (its knobs passed to ``evtc.compile``), or, marked ``"launch": True``,
a launch of the default kernel itself: its tile in the candidate's cluster shape and split count,
loading only the problem's rows of A where the tile has more, as the selector's launches do (a
pinned compile loads whole tiles). Sets ``past_m`` and ``decode_launches`` are of this kind.

Identity epilogue, B K-major (``nn.Linear`` weights). Every call runs in a CUDA graph of R calls
that cycles through enough copies of the weight to stream it from HBM (not from the 50 MB L2).
Every candidate of a shape is timed in one ``time_paired`` call with cuBLAS, in shuffled order per
sample; ratio = cuBLAS time / candidate time (> 1: the candidate is faster). The row also shows
what the selector picks (``auto``: the default kernel with no knobs).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import decode_launches  # noqa: E402  (bench/decode_launches.py: handles that pin a launch)
import shapes as shape_suite  # noqa: E402
import torch  # noqa: E402

import evtc  # noqa: E402
from evtc.timing import time_paired  # noqa: E402

FAMILIES = {
    # M = 40-128, where the last row of tiles (or of a tile) reaches past M: the TMA unit spends on
    # A's rows past M about what it spends on data (docs/performance.md, "Rows of A past M"). Qwen2.5
    # qkv, Llama-3 8B qkv, Llama-3 70B o_proj, DeepSeek-V3 expert down.
    "past_m": [f"{m}x{n}x{k}" for n, k in ((4608, 3584), (6144, 4096), (8192, 8192), (7168, 2048))
               for m in (40, 48, 65, 72, 80, 96, 104, 112, 120, 128)],
    # (M, N, K): Llama-3 8B / 70B attention and MLP layers, DeepSeek-V3 and Mixtral experts, at
    # decode-sized M.
    "small": [f"{m}x{n}x{k}" for m in (16, 64, 128)
              for n, k in ((4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (8192, 8192),
                           (8192, 28672), (4096, 2048), (2048, 7168))],
    "medium": [f"{m}x{n}x{k}" for m in (256, 512, 1024)
               for n, k in ((4096, 4096), (28672, 4096), (4096, 14336), (8192, 8192))],
    "large": ["4096x4096x4096", "8192x8192x8192", "16384x57344x8192", "16384x8192x28672",
              "4096x28672x4096", "4096x4096x14336", "16384x4096x4096", "16384x6144x4096",
              "2048x128256x4096", "16384x1024x8192"],
}
SMALL_CANDIDATES = [
    {"tile_m": tm, "tile_n": tn, "cluster": cl, "schedule": "pingpong"}
    for tm, tn in ((128, 128), (128, 64), (64, 128), (64, 64), (64, 256))
    for cl in ((1, 1), (1, 2), (2, 1))
]
LARGE_CANDIDATES = [
    {"tile_m": 128, "tile_n": tn, "cluster": cl, "schedule": "pingpong"}
    for tn in (128,) for cl in ((1, 2), (2, 1))
] + [
    {"tile_m": 128, "tile_n": tn, "cluster": cl, "schedule": "cooperative"}
    for tn in (128, 256) for cl in ((1, 1), (1, 2), (2, 1))
]
# One wave or less of 128-row tiles (M = 128 to 1024): a ping-pong CTA with a single tile leaves
# its second consumer warpgroup idle, where a cooperative one splits the tile between both.
MEDIUM_CANDIDATES = [
    {"tile_m": 128, "tile_n": tn, "cluster": cl, "schedule": "pingpong"}
    for tn in (128, 64) for cl in ((1, 2), (2, 1))
] + [
    {"tile_m": 128, "tile_n": tn, "cluster": cl, "schedule": "cooperative"}
    for tn in (128, 192, 256) for cl in ((1, 1), (1, 2), (2, 1))
] + [{"tile_m": 64, "tile_n": 192, "cluster": (1, 2), "schedule": "pingpong"}]
# Few 128-row tiles (M = 128 to 512, N up to 8192): ping-pong and cooperative at the same tile.
NARROW_CANDIDATES = [
    {"tile_m": 128, "tile_n": 64, "cluster": cl, "schedule": "pingpong"} for cl in ((1, 2), (2, 1))
] + [
    {"tile_m": 128, "tile_n": tn, "cluster": cl, "schedule": "cooperative"}
    for tn in (64, 128) for cl in ((1, 1), (1, 2), (2, 1))
] + [{"tile_m": 64, "tile_n": tn, "cluster": cl, "schedule": "pingpong"}
       for tn, cl in ((64, (1, 2)), (128, (1, 2)), (128, (2, 1)))]
# Rasterization of the default tile on problems with many tiles (LM heads: 1000 columns of tiles).
RASTER_CANDIDATES = [
    {"tile_m": 128, "tile_n": 128, "cluster": (1, 2), "schedule": "pingpong", "raster": r, "swizzle": sw}
    for r, sw in (("m", 1), ("m", 4), ("m", 8), ("m", 16), ("m", 32), ("n", 4), ("n", 8), ("n", 16))
]

# Pipeline depth of the small tiles (weight streaming at decode sizes wants many loads in flight),
# and wider clusters that multicast A to more CTAs.
DEPTH_CANDIDATES = [
    {"tile_m": 64, "tile_n": 64, "cluster": (1, 2), "schedule": "pingpong", "ab_stages": s}
    for s in (8, 10, 13)
] + [
    {"tile_m": 64, "tile_n": 64, "cluster": (1, 4), "schedule": "pingpong", "ab_stages": 13},
    {"tile_m": 64, "tile_n": 128, "cluster": (1, 2), "schedule": "pingpong", "ab_stages": 6},
    {"tile_m": 64, "tile_n": 128, "cluster": (1, 2), "schedule": "pingpong", "ab_stages": 8, "epi_stages": 2},
    {"tile_m": 128, "tile_n": 64, "cluster": (1, 1), "schedule": "cooperative", "ab_stages": 6},
    {"tile_m": 128, "tile_n": 64, "cluster": (1, 1), "schedule": "cooperative", "ab_stages": 8},
]

# The tiles of few-tile problems (M <= 512) in every cluster shape that multicasts along one side,
# for fitting the cluster choice of memory-bound launches.
WIDE_CANDIDATES = [
    {"tile_m": tm, "tile_n": tn, "cluster": cl, "schedule": sch}
    for sch, tm, tn in (("pingpong", 64, 64), ("pingpong", 64, 128), ("pingpong", 64, 256),
                        ("pingpong", 128, 128), ("cooperative", 128, 64), ("cooperative", 128, 128),
                        ("cooperative", 128, 192))
    for cl in ((1, 2), (2, 1), (1, 4))
]

# The decode tiles in the clusters that share the most per K step, for fitting split counts.
DECODE4_CANDIDATES = [
    {"tile_m": 64, "tile_n": tn, "cluster": cl, "schedule": "pingpong"}
    for tn, cl in ((64, (1, 4)), (128, (1, 4)), (64, (2, 1)), (64, (1, 2)))
]

# The decode tiles in every cluster shape, one split: for fitting the cluster choice where the
# weight streams (M = 33 to 128; below that the selector loads only A's first rows, which pinned
# candidates do not).
CLUSTERS_CANDIDATES = [
    {"tile_m": 64, "tile_n": tn, "cluster": cl, "schedule": "pingpong"}
    for tn, cls in ((64, ((1, 1), (1, 2), (1, 4), (2, 1))), (128, ((1, 1), (1, 2), (1, 4))))
    for cl in cls
]
# Cooperative 128-row tiles of every width the kernel takes, for fitting one wave of tiles
# (cuBLAS runs 112- and 144-wide tiles at M = 512).
WAVES_CANDIDATES = [
    {"tile_m": 128, "tile_n": tn, "cluster": cl, "schedule": "cooperative",
     "epi_tile_n": 16 if tn % 32 else 32}
    for tn in (112, 128, 144, 160, 192) for cl in ((1, 1), (2, 1), (1, 2))
]


# Many tiles at M = 512-2048 (several waves): the wave-fitted widths against 128 x 128 ping-pong and
# the cooperative 128 x 256 tile, in the clusters that share B (2x1) or A (1x2).
MID_CANDIDATES = WAVES_CANDIDATES + [
    {"tile_m": 128, "tile_n": 128, "cluster": cl, "schedule": "pingpong"} for cl in ((1, 2), (2, 1))
] + [
    {"tile_m": 128, "tile_n": 256, "cluster": cl, "schedule": "cooperative"} for cl in ((1, 2), (2, 1))
]


# Two rows of 64-row tiles (M = 65-128) in 2x1 clusters (each weight tile multicast to both rows) at
# the widths that make one wave, against the cooperative 128-row tiles of the few-tiles rule
# (evtc.plan.selector, TWO_ROW_WIDTHS).
TWO_ROWS_CANDIDATES = [
    {"tile_m": 64, "tile_n": tn, "cluster": (2, 1), "schedule": "pingpong",
     "epi_tile_n": 16 if tn % 32 else 32}
    for tn in (64, 80, 96, 112, 128, 160)
] + [
    {"tile_m": 128, "tile_n": tn, "cluster": cl, "schedule": "cooperative",
     "epi_tile_n": 16 if tn % 32 else 32}
    for tn, cl in ((64, (1, 1)), (64, (1, 4)), (128, (1, 2)))
]

# Launches of the default kernel itself rather than compiled pins ("launch": True): its tile in a
# chosen cluster shape, loading only the problem's rows of A where the tile has more rows than the
# problem (a pinned compile loads whole tiles). For fitting the cluster choice at M = 33-128, where
# trimmed loads change what each cluster shape costs.
PAST_M_CANDIDATES = [
    {"tile_m": 128, "tile_n": 64, "cluster": cl, "schedule": "cooperative", "launch": True}
    for cl in ((1, 1), (1, 2), (1, 4))
] + [
    {"tile_m": 64, "tile_n": tn, "cluster": cl, "schedule": "pingpong", "launch": True}
    for tn, cl in ((64, (1, 1)), (64, (1, 2)), (64, (1, 4)), (64, (2, 1)), (128, (2, 1)))
]
# The decode tiles as the default kernel launches them at M <= 32 (A's first rows only), in the
# cluster shapes the trimmed costs rank, for fitting split counts where few tiles stream a long K.
DECODE_LAUNCH_CANDIDATES = [
    {"tile_m": 64, "tile_n": tn, "cluster": cl, "schedule": "pingpong", "launch": True}
    for tn, cl in ((64, (1, 1)), (64, (1, 2)), (128, (1, 2)))
]


def family_candidates() -> list[dict]:
    """Every tile shape the selector may launch (evtc.plan.selector.FAMILY) in every cluster shape
    it may choose: the sweep then covers what the rules choose from, whatever they become."""
    from evtc.plan.config import CLUSTERS, ConfigError, GemmConfig
    from evtc.plan.selector import FAMILY

    out = []
    for schedule, tile_m, tile_n in FAMILY:
        for cluster in CLUSTERS:
            knobs = {"tile_m": tile_m, "tile_n": tile_n, "cluster": cluster, "schedule": schedule}
            if tile_n % 32:
                knobs["epi_tile_n"] = 16  # the widths 112 and 144 take 16-column subtiles
            try:
                GemmConfig(ab_dtype="bfloat16", d_dtype="bfloat16", b_major="k", **knobs).validate()
            except ConfigError:
                continue
            out.append(knobs)
    return out


CANDIDATE_SETS = {"small": SMALL_CANDIDATES, "medium": MEDIUM_CANDIDATES, "narrow": NARROW_CANDIDATES,
                  "large": LARGE_CANDIDATES, "raster": RASTER_CANDIDATES,
                  "depth": DEPTH_CANDIDATES, "wide": WIDE_CANDIDATES,
                  "decode4": DECODE4_CANDIDATES, "clusters": CLUSTERS_CANDIDATES,
                  "waves": WAVES_CANDIDATES, "mid": MID_CANDIDATES, "two_rows": TWO_ROWS_CANDIDATES,
                  "past_m": PAST_M_CANDIDATES, "decode_launches": DECODE_LAUNCH_CANDIDATES,
                  "family": family_candidates()}


def identity(acc):
    return acc


def describe_choice(kernel, m: int, n: int, k: int) -> str:
    """What the default kernel runs an (M, N, K) problem with."""
    config, splits = kernel.launch_for(m, n, k)
    return name_of({"tile_m": config.tile_m, "tile_n": config.tile_n, "cluster": config.cluster,
                    "schedule": config.schedule, "a_rows": config.a_rows,
                    "epi_stages": config.epi_stages}, splits)


def name_of(config: dict, splits: int) -> str:
    short = {"pingpong": "pp", "cooperative": "co"}[config["schedule"]]
    cl = config["cluster"]
    raster = f" r{config['raster']}{config.get('swizzle', 8)}" if "raster" in config else ""
    rows = f" a{config['a_rows']}" if config.get("a_rows") else ""
    depth = f" ab{config['ab_stages']}" if config.get("ab_stages") else ""
    depth += f" d{config['epi_stages']}" if config.get("epi_stages") else ""
    return f"{short} {config['tile_m']}x{config['tile_n']} {cl[0]}x{cl[1]}{raster}{rows}{depth} S{splits}"


def launch_config(auto, knobs: dict, m: int):
    """The configuration the default kernel ``auto`` runs a launch candidate with on a problem of
    ``m`` rows: the tile and schedule of ``knobs`` from its family, in ``knobs``' cluster shape,
    loading only the problem's rows of A where that is fewer than a tile; None where the family
    lacks the tile or the cluster shape is invalid for it."""
    from evtc.plan.config import ConfigError
    from evtc.plan.selector import with_a_rows_for

    base = next((c for c in auto.family if (c.schedule, c.tile_m, c.tile_n)
                 == (knobs["schedule"], knobs["tile_m"], knobs["tile_n"])), None)
    if base is None:
        return None
    try:
        config = with_a_rows_for(base.replace(cluster=tuple(knobs["cluster"])), m)
        config.validate()
    except ConfigError:
        return None
    return config


def timed_splits(config: dict, m: int, n: int, split_list: list[int], sms: int,
                 multi_wave: bool = False) -> list[int]:
    """The split counts of ``split_list`` a candidate is timed with: those whose units fit in one
    wave (or all, with ``multi_wave``)."""
    tiles = -(-m // config["tile_m"]) * -(-n // config["tile_n"])
    return [s for s in split_list if s == 1 or multi_wave or tiles * s <= sms]


def launch_handles(auto, shape: str, candidates: list[dict], split_list: list[int], sms: int,
                   multi_wave: bool = False) -> dict:
    """{label: a handle of the default kernel ``auto`` that launches that candidate} for the launch
    candidates of ``candidates`` on one M x N x K shape, in each of their timed split counts."""
    m, n, _ = (int(x) for x in shape.split("x"))
    handles = {}
    for knobs in candidates:
        config = launch_config(auto, knobs, m) if knobs.get("launch") else None
        for s in timed_splits(knobs, m, n, split_list, sms, multi_wave) if config is not None else ():
            handles[name_of({**knobs, "a_rows": config.a_rows}, s)] = \
                decode_launches.launch_handle(auto, config, s)
    return handles


def sweep_shape(shape: str, args, kernel, auto, dtype, split_list, sms: int, twins=None) -> dict:
    """Time every candidate of one shape (and cuBLAS, and the default kernel) in one paired run."""
    m, n, k = (int(x) for x in shape.split("x"))
    which = args.candidates or ("small" if m <= 1024 else "large")
    candidates = CANDIDATE_SETS[which]
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n * 13 + k)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    copies = max(2, math.ceil((args.rotate_mb << 20) / (n * k * 2)))
    weights = [(torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).to(dtype)
               for _ in range(min(copies, 64))]
    ref = x.double() @ weights[0].double().t()
    out = torch.empty(m, n, device="cuda", dtype=dtype)
    calls = {"cublas": lambda w: torch.matmul(x, w.t())}
    for config in ([] if args.auto_only else candidates):
        if config.get("launch"):
            continue  # below, as handles of the default kernel
        for s in timed_splits(config, m, n, split_list, sms, args.multi_wave_splits):
            # One split: the plain kernel, as the selector launches it (a split-K build run with
            # one split reads up to 10% slower); more: the split-K build.
            kern = kernel(config, s > 1)
            if kern.config.split_k:
                kern.pin_splits(s)
            got = kern(x, weights[0].t(), out=out)
            err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
            assert err < 2e-2, (shape, config, s, err)

            def call(w, kern=kern, s=s):
                return kern(x, w.t(), out=out)
            calls[name_of(config, s)] = (kern, s, call)
    launches = {} if args.auto_only else launch_handles(auto, shape, candidates, split_list, sms,
                                                        args.multi_wave_splits)
    for label, handle in launches.items():
        got = handle(x, weights[0].t(), out=out)
        err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < 2e-2, (shape, label, err)
        calls[label] = lambda w, handle=handle: handle(x, w.t(), out=out)
    calls["auto"] = lambda w: auto(x, w.t(), out=out)
    for label, twin in (twins or {}).items():
        calls[label] = lambda w, twin=twin: twin(x, w.t(), out=out)
    reps = max(1, min(500, math.ceil(args.sample_ms * 1e3 / max(2.0, m * n * k * 2 / 600e12 * 1e6))))
    graphs = {}
    for name, item in calls.items():
        if isinstance(item, tuple):
            kern, s, fn = item
            if kern.config.split_k:
                kern.pin_splits(s)  # captured with this split count
            graphs[name] = shape_suite.capture(fn, weights, reps).replay
        else:
            graphs[name] = shape_suite.capture(item, weights, reps).replay
    names = list(graphs)
    ms = time_paired([graphs[nm] for nm in names], 2, args.samples, 1)
    us = {nm: t / reps * 1e3 for nm, t in zip(names, ms, strict=True)}
    base = us["cublas"]
    ranked = sorted((nm for nm in names if nm not in ("cublas", "auto", *(twins or {}))),
                    key=lambda nm: us[nm])
    best = ranked[0] if ranked else "auto"
    chosen = describe_choice(auto, m, n, k)
    print(f"{shape:>18}: cuBLAS {base:8.1f} us ({n * k * 2 / base / 1e6:4.2f} TB/s)  best {best} "
          f"{base / us[best]:5.2f}  auto [{chosen}] {base / us['auto']:5.2f}  "
          + "".join(f"{label} {base / us[label]:5.2f}  " for label in twins or {}) + "| "
          + "  ".join(f"{nm} {base / us[nm]:4.2f}" for nm in ranked[:6]), flush=True)
    return {"shape": shape, "m": m, "n": n, "k": k, "us": us, "auto": chosen}


def _compile_one(config: dict, dtype_name: str, split_k: bool = True) -> None:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    example = {"a": torch.empty(8, 64, dtype=dtype, device="meta"),
               "b": torch.empty(64, 64, dtype=dtype, device="meta").t()}
    evtc.compile(identity, example, config={**config, "split_k": split_k})


def precompile(configs: list[dict], dtype_name: str, split_k: bool = True) -> None:
    """Compile the candidates in parallel processes into the disk cache, which the sweep then loads
    from (compiling them one by one in the timing process takes minutes)."""
    import concurrent.futures
    import multiprocessing
    import os

    start = time.time()
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(min(len(configs), os.cpu_count() or 2),
                                                mp_context=ctx) as pool:
        for f in [pool.submit(_compile_one, c, dtype_name, split_k) for c in configs]:
            f.result()
    print(f"precompiled {len(configs)} candidates in {time.time() - start:.0f} s", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="", help="comma list of MxNxK")
    p.add_argument("--family", default="", help=f"one of {sorted(FAMILIES)}")
    p.add_argument("--candidates", default="", choices=["", *CANDIDATE_SETS],
                   help="candidate set (default: small for M <= 1024, large beyond)")
    p.add_argument("--splits", default="1,2,3,4,6", help="split counts tried where they fit in a wave")
    p.add_argument("--multi-wave-splits", action="store_true",
                   help="also try split counts whose units take more than one wave")
    p.add_argument("--samples", type=int, default=9)
    p.add_argument("--sample-ms", type=float, default=1.0)
    p.add_argument("--rotate-mb", type=int, default=256, help="weight copies cycled per graph, in MB")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--auto-only", action="store_true", help="time only the default kernel against cuBLAS")
    p.add_argument("--pdl-twin", action="store_true",
                   help="also time the default kernel with programmatic dependent launch on")
    p.add_argument("--json", help="write every measurement here (rewritten after each shape)")
    p.add_argument("--time-budget", type=float, default=0.0, help="stop starting shapes after this")
    args = p.parse_args()
    shapes = [s for s in args.shapes.split(",") if s] + FAMILIES.get(args.family, [])
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    example = {"a": torch.empty(8, 64, dtype=dtype, device="meta"),
               "b": torch.empty(64, 64, dtype=dtype, device="meta").t()}
    kernels: dict = {}

    def kernel(config: dict, split_k: bool):
        key = json.dumps([config, split_k], sort_keys=True)
        if key not in kernels:
            kernels[key] = evtc.compile(identity, example, config={**config, "split_k": split_k})
        return kernels[key]

    split_list = [int(s) for s in args.splits.split(",")]
    if not args.auto_only:
        configs_with_launches = [
            c for which in sorted({args.candidates or ("small" if int(sh.split("x")[0]) <= 1024
                                                        else "large") for sh in shapes})
            for c in CANDIDATE_SETS[which]]
        configs = [c for c in configs_with_launches if not c.get("launch")]
        # Plain kernels for one split, split-K builds for more.
        for split_k in sorted({s > 1 for s in split_list}) if configs else ():
            precompile(configs, args.dtype, split_k)
    shape_suite.load_torch()  # bench/shapes.py imports torch lazily
    auto = evtc.compile(identity, example)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if not args.auto_only:
        # The launch candidates' variants, built in parallel before any shape is timed.
        start = time.time()
        jobs = [(handle, [tuple(int(x) for x in shape.split("x"))]) for shape in shapes
                for handle in launch_handles(auto, shape, configs_with_launches, split_list, sms,
                                             args.multi_wave_splits).values()]
        count, _ = shape_suite.build_variants(jobs, max(1, (os.cpu_count() or 2) // 2))
        print(f"prebuilt {count} launch variants in {time.time() - start:.0f} s", flush=True)
    # The default kernel has PDL off: its twin with PDL on runs the same launches with it.
    twins = {"pdl": evtc.compile(identity, example, config={"pdl": True})} if args.pdl_twin else {}
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; {sms} SMs", flush=True)
    results = []
    start = time.time()
    for shape in shapes:
        if args.time_budget and time.time() - start > args.time_budget:
            print(f"time budget spent: {shape} and later not run", flush=True)
            break
        row = sweep_shape(shape, args, kernel, auto, dtype, split_list, sms, twins)
        results.append(row)
        if args.json:
            Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                   "results": results}, indent=1))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
