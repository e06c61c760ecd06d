"""Where a call's host time goes: the compiled function alone, output allocation, the reduction
finish, and the whole call, each against ``x.add_(1)`` timed the same way (host time per call, no
synchronisation inside a loop of ``--reps`` calls, medians over alternating rounds).

    python3 bench/host_parts.py [--names identity,rms_per_row] [--cache DIR]

The numbers say which part of :meth:`evtc.Kernel.__call__` to make cheaper; bench/host.py gives
the bar's numbers for the whole catalogue.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def timed(parts: dict, reps: int, rounds: int) -> dict[str, float]:
    import torch

    for f in parts.values():
        for _ in range(20):
            f()
    torch.cuda.synchronize()
    samples: dict[str, list[float]] = {name: [] for name in parts}
    names = list(parts)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            f = parts[name]
            t0 = time.perf_counter()
            for _ in range(reps):
                f()
            samples[name].append((time.perf_counter() - t0) / reps * 1e6)
            torch.cuda.synchronize()
    return {name: statistics.median(s) for name, s in samples.items()}


def _parts(x, k, a, b, ops, fn, b_k, up, bufs, ins, clusters, workspaces, problem) -> dict:
    """What to time for one kernel: the baseline, the whole call and its parts (``b_k``, ``up``: b
    as the compiled function takes it, see evtc.runtime.call_spec.CallSpec.split)."""
    import torch

    from evtc.runtime.invoke import invoke

    parts = {
        "add_": lambda: x.add_(1),
        "call": lambda: k(a, b, **ops),
        "fn only": lambda: invoke(fn, a, b_k, bufs, ins, clusters, None, a.device, None, up),
        "outputs": lambda: k.call_spec.new_outputs(a.device, *problem[:3]),
        "torch.empty": lambda: torch.empty(tuple(problem[:2]), dtype=torch.float16, device=a.device),
    }
    finisher = problem[3]
    if finisher is not None:
        parts["finish"] = lambda: finisher(workspaces, *problem[:3], ops)
    return parts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--names", default="identity,relu_lincomb_bias,swiglu,aux_outputs,rms_per_row,"
                                      "column_sum_max_min,batched_reductions,uniform_value_through_a_cast")
    p.add_argument("--cache", default=None)
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--profile", action="store_true", help="also print a cProfile of 2000 calls")
    args = p.parse_args()
    cache = args.cache or tempfile.mkdtemp(prefix="evtc-parts-")

    import torch
    from compile_catalogue import CATALOGUE, make_inputs

    import evtc

    x = torch.zeros(1024, device="cuda")
    for name in args.names.split(","):
        e = next(e for e in CATALOGUE if e.name == name)
        inputs = make_inputs(e, 256, 256, 256, 2 if e.batched else None, torch.float16, "cuda")
        k = evtc.compile(e.fn, inputs, out_dtypes=e.out_dtypes, config=e.config or None, cache_dir=cache)
        a, b = inputs["a"], inputs["b"]
        ops = {n: v for n, v in inputs.items() if n not in ("a", "b")}
        k(a, b, **ops)
        assert k.last_path == "kernel", (name, k.last_path)
        m, n = a.shape[-2], b.shape[-1]
        batches = a.shape[0] if a.dim() == 3 else 1
        outs, workspaces, _, _ = k._run_kernel(a, b, None, ops, stage=False)
        spec = k.call_spec
        if spec.gated:  # b whole and its up half's offset; N is the output's width
            b_k, up, kops = spec.split(b, ops)
            n //= 2
        else:
            b_k, up, kops = b, None, ops
        ins = spec.inputs(kops, m, n, batches)
        # The launch this size runs (tile, cluster, split count); its own reductions' finish.
        fn, clusters, split, finisher = k._launch_choice(m, n, a.shape[-1], batches)
        assert split is None, f"{name}: a split-K launch at {m}x{n}; this bench times the plain one"
        bufs = tuple(outs + workspaces)
        ins_t = tuple(ins)
        parts = _parts(x, k, a, b, ops, fn, b_k, up, bufs, ins_t, clusters, workspaces,
                       (m, n, batches, finisher))
        t = timed(parts, args.reps, args.rounds)
        base = t.pop("add_")
        print(f"{name:>30}: add_ {base:5.1f} us; " + "; ".join(f"{p} {v:5.1f}" for p, v in t.items()))
        if args.profile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            for _ in range(2000):
                k(a, b, **ops)
            prof.disable()
            torch.cuda.synchronize()
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
