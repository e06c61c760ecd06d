"""Host costs of evtc (issue "One seam per layer"): start-up, a disk-cache hit, the first call, the
per-call host time of every catalogue epilogue, and a cold compile.

    python3 bench/host.py [--cache DIR] [--runs 5]

Start-up and cache hits run in fresh processes (medians over ``--runs``); the per-call cost is host
time per call (no synchronisation inside the loop) on a small problem, against ``x.add_(1)`` timed
the same way in the same process, in alternating order: the median of the rounds, and the best
round's difference (the host is shared and noisy).

Python must be able to cache bytecode, as an installed package has it (pip compiles it at install
time). The device machines set PYTHONDONTWRITEBYTECODE=1 and their site-packages hold no bytecode, so
every process compiles torch, sympy and the DSL from source there: about 3 s more per cold compile
and 2 s more for ``import torch``. Measure there with a bytecode cache::

    env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=/tmp/pyc bash .devkit/gpu.sh python3 bench/host.py

The script warms the cache with one import process first, and says whether it could.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

CHILD_IMPORT = """
import json, sys, time
t0 = time.perf_counter(); import torch; t1 = time.perf_counter(); import evtc; t2 = time.perf_counter()
print(json.dumps({"torch": t1 - t0, "evtc": t2 - t1, "sympy": "sympy" in sys.modules,
                  "cutlass": "cutlass" in sys.modules}))
"""

CHILD_WARM = """
import torch, sympy, evtc.api, evtc.runtime.build, cutlass.cute
print("{}")
"""

CHILD_DSL = """
import json, time
import torch
t1 = time.perf_counter(); import cutlass.cute; t2 = time.perf_counter()
print(json.dumps({"dsl": t2 - t1}))
"""

CHILD_HIT = """
import json, sys, time
sys.path.insert(0, {tests!r})
import torch
import evtc
from compile_catalogue import CATALOGUE, make_inputs
e = next(e for e in CATALOGUE if e.name == {name!r})
inputs = make_inputs(e, 256, 256, 256, None, torch.float16, "cuda")
examples = {{k: v for k, v in inputs.items()}}
t0 = time.perf_counter()
k = evtc.compile(e.fn, examples, out_dtypes=e.out_dtypes, config=e.config or None, cache_dir={cache!r})
t1 = time.perf_counter()
ops = {{n: v for n, v in inputs.items() if n not in ("a", "b")}}
k(inputs["a"], inputs["b"], **ops)
torch.cuda.synchronize()
t2 = time.perf_counter()
print(json.dumps({{"hit": t1 - t0, "first_call": t2 - t1, "origin": k.origin,
                  "cutlass": "cutlass" in sys.modules, "sympy": "sympy" in sys.modules}}))
"""


def child(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def precompile(cache: str, names: list[str] | None = None) -> None:
    """Compile the catalogue (or the entries ``names``) into ``cache``, several processes at a time."""
    import concurrent.futures
    import multiprocessing
    import os

    from compile_catalogue import CATALOGUE, compile_by_name

    workers = max(1, min(8, (os.cpu_count() or 2) // 2))
    ctx = multiprocessing.get_context("spawn")
    names = names or [e.name for e in CATALOGUE]
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        list(pool.map(compile_by_name, names, ["float16"] * len(names), [cache] * len(names)))


def per_call(cache: str, reps: int = 200, rounds: int = 7,
             names: list[str] | None = None) -> list[tuple[str, float, float, float]]:
    import torch
    from compile_catalogue import CATALOGUE, make_inputs

    import evtc

    x = torch.zeros(1024, device="cuda")
    rows = []
    for e in CATALOGUE:
        if names and e.name not in names:
            continue
        inputs = make_inputs(e, 256, 256, 256, 2 if e.batched else None, torch.float16, "cuda")
        k = evtc.compile(e.fn, inputs, out_dtypes=e.out_dtypes, config=e.config or None, cache_dir=cache)
        a, b = inputs["a"], inputs["b"]
        ops = {n: v for n, v in inputs.items() if n not in ("a", "b")}

        def call(k=k, a=a, b=b, ops=ops):
            k(a, b, **ops)

        def add():
            x.add_(1)

        for f in (call, add):  # warm-up
            for _ in range(20):
                f()
        torch.cuda.synchronize()
        samples = {call: [], add: []}
        for r in range(rounds):
            for f in ((call, add) if r % 2 == 0 else (add, call)):
                t0 = time.perf_counter()
                for _ in range(reps):
                    f()
                samples[f].append((time.perf_counter() - t0) / reps * 1e6)
                torch.cuda.synchronize()
        assert k.last_path == "kernel", (e.name, k.last_path)
        # The median of the rounds, and the best round's difference: the host is shared and noisy,
        # and the best round is the cost with the least interference.
        best = min(c - d for c, d in zip(samples[call], samples[add], strict=True))
        rows.append((e.name, statistics.median(samples[call]), statistics.median(samples[add]), best))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", default=None, help="disk cache to use (default: a fresh temporary one)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--only", default="", help="comma-separated catalogue entries: their per-call cost only")
    p.add_argument("--rounds", type=int, default=7, help="rounds of 200 calls per entry")
    p.add_argument("--startup", action="store_true", help="start-up, cache hits and cold compiles only")
    args = p.parse_args()
    cache = args.cache or tempfile.mkdtemp(prefix="evtc-host-")
    only = [n for n in args.only.split(",") if n]
    if only:
        precompile(cache, only)
        _print_per_call(per_call(cache, rounds=args.rounds, names=only))
        return

    # The first imports on a machine write the bytecode caches (see the module docstring).
    t0 = time.perf_counter()
    child(CHILD_WARM)
    caching = ("off (PYTHONDONTWRITEBYTECODE): the times include compiling every module imported"
               if sys.flags.dont_write_bytecode else "on")
    print(f"bytecode caches: {caching}; a first import of torch, evtc, sympy and the DSL: "
          f"{time.perf_counter() - t0:.2f} s")
    imports = [child(CHILD_IMPORT) for _ in range(args.runs)]
    evtc_ms = [r["evtc"] * 1e3 for r in imports]
    print(f"import torch: median {statistics.median(r['torch'] for r in imports):.2f} s; import evtc on top: "
          f"median {statistics.median(evtc_ms):.1f} ms, max {max(evtc_ms):.1f} ms; sympy imported: "
          f"{any(r['sympy'] for r in imports)}, cutlass imported: {any(r['cutlass'] for r in imports)}")

    dsl = [child(CHILD_DSL)["dsl"] for _ in range(2)]
    print(f"import of the CuTe DSL in a new process: {dsl[1]:.2f} s (the first: {dsl[0]:.2f} s)")
    name = "relu_lincomb_bias"
    for cold_name in (name, "gelu_erf", "rms_per_row"):
        fresh = cache if cold_name == name else tempfile.mkdtemp(prefix="evtc-cold-")
        cold = child(CHILD_HIT.format(tests=str(ROOT / "tests"), name=cold_name, cache=fresh))
        print(f"cold compile of {cold_name!r} in a new process: {cold['hit']:.2f} s ({cold['origin']})")
    hits = [child(CHILD_HIT.format(tests=str(ROOT / "tests"), name=name, cache=cache))
            for _ in range(args.runs)]
    hit_ms = statistics.median(h["hit"] for h in hits) * 1e3
    print(f"disk-cache hit to a callable kernel: median {hit_ms:.0f} ms, "
          f"max {max(h['hit'] for h in hits) * 1e3:.0f} ms ({hits[0]['origin']}); first call "
          f"{statistics.median(h['first_call'] for h in hits) * 1e3:.1f} ms; cutlass imported: "
          f"{any(h['cutlass'] for h in hits)}, sympy imported: {any(h['sympy'] for h in hits)}")

    if args.startup:
        return
    t0 = time.perf_counter()
    precompile(cache)
    print(f"\n(catalogue compiled into the cache in {time.perf_counter() - t0:.0f} s)")
    _print_per_call(per_call(cache, rounds=args.rounds))


def _print_per_call(rows) -> None:
    print(f"\n{'epilogue':>32} {'call us':>8} {'add_ us':>8} {'over':>7} {'best':>7}")
    for n, t, base, best in rows:
        print(f"{n:>32} {t:8.1f} {base:8.1f} {t - base:7.1f} {best:7.1f}")
    over = [t - base for _, t, base, _ in rows]
    worst = max(rows, key=lambda r: r[1] - r[2])
    worst_best = max(rows, key=lambda r: r[3])
    print(f"\n{len(rows)} epilogues: median {statistics.median(over):.1f} us over x.add_(1), worst "
          f"{worst[1] - worst[2]:.1f} us ({worst[0]}); best rounds: median "
          f"{statistics.median(r[3] for r in rows):.1f} us, worst {worst_best[3]:.1f} us ({worst_best[0]})")


if __name__ == "__main__":
    main()
