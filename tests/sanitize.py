"""The GPU matrix's cases (tests/epilogue_cases.py) at small shapes, for compute-sanitizer.

    python3 tests/sanitize.py --cache-dir /tmp/evtc-san --compile        # compile once (a process pool)
    compute-sanitizer --tool memcheck --error-exitcode 1 \\
        python3 tests/sanitize.py --cache-dir /tmp/evtc-san               # then run under each tool

Each case runs at a small aligned shape (the kernel path) and a small one whose widths break
TMA's 16-byte rule (the staged path), checked against the function as in the GPU tests. Compiling
outside the sanitizer keeps the DSL's compiler out of its way: under it, kernels load from the disk
cache.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import multiprocessing
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def small(case):
    """The case at two small shapes: aligned (kernel path), odd widths (staged path)."""
    fp8 = any(dt == "float8_e4m3fn" for _, dt in case.out_dtypes)
    # A block-scaled gated case runs the kernel with halves of a multiple of 32 columns (96 here).
    unit = 64 if case.gated and case.block_scales else 32 if case.gated and fp8 else \
        16 if (case.gated or fp8) else 8
    return dataclasses.replace(case, shapes=((70, 3 * unit, 40), (33, 2 * 37 if case.gated else 37, 24)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--compile", action="store_true", help="compile every case, then stop")
    p.add_argument("--limit", type=int, default=None, help="run the first N cases only")
    p.add_argument("--only", default="", help="run the cases whose name starts with this only")
    args = p.parse_args()
    from epilogue_cases import check_case, compile_by_name, compile_case, matrix_cases

    cases = [c for c in matrix_cases() if c.name.startswith(args.only)][:args.limit]
    if args.compile:
        ctx = multiprocessing.get_context("spawn")
        names = [c.name for c in cases]
        with concurrent.futures.ProcessPoolExecutor(os.cpu_count() or 2, mp_context=ctx) as pool:
            errors = [e for e in pool.map(compile_by_name, names, [args.cache_dir] * len(names)) if e]
        print(f"compiled {len(names)} cases, {len(errors)} errors", *errors, sep="\n")
        return int(bool(errors))
    failed = 0
    for case in cases:
        failures = check_case(small(case), compile_case(case, args.cache_dir))
        if failures:
            failed += 1
            print(f"FAILED {case.name}:", *failures, sep="\n  ")
    print(f"sanitize run: {len(cases) - failed} passed, {failed} failed")
    return int(failed > 0)


if __name__ == "__main__":
    sys.exit(main())
