"""Differential fuzzer: random epilogue programs compiled by evtc and run on the GPU against the
function itself in float32 (tests/epilogue_cases.py makes and checks the cases).

    python3 tests/fuzz.py --cases 2000 --workers 16 --seed 0       # on a Hopper GPU
    python3 tests/fuzz.py --cases 40 --workers 2 --compile-only    # anywhere (CUTE_DSL_ARCH=sm_90a)
    python3 tests/fuzz.py --seed 0 --case 137                      # one case, printed and run
    python3 tests/fuzz.py --cases 400 --tile 176                   # on the wide ping-pong tile

With ``--tile W``, each case whose kernel family has the ping-pong 128 x W tile (176 or 192: light
epilogues, evtc.plan.selector.WIDE_PINGPONG_WIDTHS) is compiled with that tile pinned, so that every
one of its small problems runs it (the selector takes it only past 5 waves of tiles); the others
count as skipped.

Case i of seed s is a pure function of (s, i). Worker processes are long-lived (importing torch and
the DSL costs seconds) and share one disk cache. A case evtc refuses at compile time with an
EpilogueError (a documented limit) counts as refused, not failed; anything else that is not an exact
match within tolerance (an exception, NaN, an unwritten element, a wrong value, a modified input) is
a failure, reported with the case's program. Exit code 1 on any failure.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

_CACHE = ""
_RUN = True
_TILE = 0


def _init(cache_dir: str, run: bool, tile: int = 0) -> None:
    global _CACHE, _RUN, _TILE
    _CACHE, _RUN, _TILE = cache_dir, run, tile
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


def _pinned_tile(case, kernel, width: int):
    """``case`` compiled with its family's ping-pong 128 x ``width`` tile pinned, or None where the
    family has none."""
    from epilogue_cases import example_inputs

    import evtc

    wide = next((c for c in kernel.family if (c.schedule, c.tile_m, c.tile_n) == ("pingpong", 128, width)),
                None)
    if wide is None:
        return None
    knobs = {"schedule": "pingpong", "tile_n": width, "epi_tile_n": wide.epi_tile_n,
             "epi_stages": wide.epi_stages, "cluster": wide.cluster}
    return evtc.compile(case.function(), example_inputs(case), cache_dir=_CACHE,
                        out_dtypes=case.output_dtypes(), config=knobs)


def run_one(seed: int, index: int) -> dict:
    """Compile and (unless compile-only) check case ``index`` of ``seed``."""
    from epilogue_cases import check_case, compile_case, random_case

    import evtc

    case = random_case(seed, index)
    result = {"index": index, "status": "passed"}
    try:
        kernel = compile_case(case, _CACHE)
        if _TILE:
            kernel = _pinned_tile(case, kernel, _TILE)
            if kernel is None:
                return {**result, "status": "skipped"}
    except evtc.EpilogueError as err:
        return {**result, "status": "refused", "error": f"{type(err).__name__}: {err}"}
    except Exception as exc:  # noqa: BLE001 - a crash is a failure, reported with its case
        return {**result, "status": "failed", "error": traceback.format_exc(limit=4) + str(exc),
                "case": case.describe()}
    if not _RUN:
        return result
    try:
        failures = check_case(case, kernel, seed=index)
    except Exception:  # noqa: BLE001
        failures = [traceback.format_exc(limit=6)]
    if failures:
        return {**result, "status": "failed", "error": "\n".join(failures), "case": case.describe()}
    return result


def _job(args: tuple[int, int]) -> dict:
    return run_one(*args)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", type=int, default=200)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--report", default=None, help="write failures (and refusals) as JSON here")
    p.add_argument("--case", type=int, default=None, help="print and run this one case")
    p.add_argument("--tile", type=int, default=0, choices=(0, 176, 192),
                   help="pin the family's wide ping-pong tile of this width (cases without one are skipped)")
    args = p.parse_args()
    cache = args.cache_dir or tempfile.mkdtemp(prefix="evtc-fuzz-")
    if args.case is not None:
        from epilogue_cases import random_case

        print(random_case(args.seed, args.case).describe())
        _init(cache, not args.compile_only, args.tile)
        result = run_one(args.seed, args.case)
        print(json.dumps(result, indent=1))
        return int(result["status"] == "failed")
    indices = range(args.start, args.start + args.cases)
    t0 = time.perf_counter()
    results: list[dict] = []
    ctx = multiprocessing.get_context("spawn")
    init = (cache, not args.compile_only, args.tile)
    with ctx.Pool(args.workers, initializer=_init, initargs=init) as pool:
        for result in pool.imap_unordered(_job, [(args.seed, i) for i in indices], chunksize=2):
            results.append(result)
            if result["status"] == "failed":
                print(f"FAILED case {result['index']} (seed {args.seed}):\n{result.get('case', '')}\n"
                      f"{result['error']}\n", flush=True)
            if len(results) % 100 == 0:
                print(f"... {len(results)} cases, {time.perf_counter() - t0:.0f} s", flush=True)
    statuses = ("passed", "failed", "refused", "skipped")
    counts = {s: sum(1 for r in results if r["status"] == s) for s in statuses}
    refused = sorted({r["error"].split("\n")[0][:160] for r in results if r["status"] == "refused"})
    for line in refused:
        print(f"refused: {line}")
    if args.report:
        Path(args.report).write_text(json.dumps([r for r in results if r["status"] != "passed"], indent=1))
    what = "compiled" if args.compile_only else "passed"
    seconds = time.perf_counter() - t0
    skipped = f", {counts['skipped']} skipped (no 128 x {args.tile} ping-pong tile)" if args.tile else ""
    print(f"fuzz: {counts['passed']} {what}, {counts['failed']} failed, {counts['refused']} refused{skipped} "
          f"(seed {args.seed}, cases {indices.start}..{indices.stop - 1}) in {seconds:.0f} s")
    return int(counts["failed"] > 0)


if __name__ == "__main__":
    sys.exit(main())
