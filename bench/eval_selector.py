"""Score launch selectors against measurements of bench/sweep_configs.py, on the CPU: for every shape,
the measured time of the candidate a selector picks over the fastest candidate measured ("regret").

    python3 bench/eval_selector.py small.json medium.json large.json

Selectors scored:

* ``evtc``: evtc.plan.selector.choose_launch over the swept family (the rules evtc runs);
* ``nvMatmulHeuristics``: NVIDIA's heuristics package (``pip install nvidia-matmul-heuristics``;
  skipped when absent), H100 SXM, CUTLASS 3 target, bf16: its ranked configurations (up to 64)
  mapped onto the first one the sweep measured (same CTA tile, cluster clipped to the shapes we
  build, split count), as a library that supports only some of its tiles would use it. Shapes where
  none of its 64 maps onto a measured candidate are counted, and scored as the best (in its favour).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from evtc.plan.clusters import cluster_costs  # noqa: E402
from evtc.plan.config import GemmConfig  # noqa: E402
from evtc.plan.selector import FAMILY, choose_launch  # noqa: E402


def parse(name: str) -> tuple[str, int, int, tuple[int, int], int]:
    schedule, tile, cluster, splits = name.split()
    tile_m, tile_n = (int(x) for x in tile.split("x"))
    return schedule, tile_m, tile_n, tuple(int(x) for x in cluster.split("x")), int(splits[1:])


def name_of(schedule: str, tile_m: int, tile_n: int, cluster, splits: int) -> str:
    return f"{schedule} {tile_m}x{tile_n} {cluster[0]}x{cluster[1]} S{splits}"


def evtc_pick(m: int, n: int, k: int, slots: int = 132) -> str:
    base = GemmConfig(ab_dtype="bfloat16", d_dtype="bfloat16", b_major="k")
    family = [base] + [
        base.replace(schedule=schedule, tile_m=tm, tile_n=tn,
                     cluster=min(cluster_costs(schedule, tm, tn), key=cluster_costs(schedule, tm, tn).get))
        for schedule, tm, tn in FAMILY if (schedule, tm, tn) != ("pingpong", 128, 128)]
    config, splits = choose_launch(m, n, k, 1, family, lambda c: slots, choose_cluster=True)
    short = "pp" if config.schedule == "pingpong" else "co"
    return name_of(short, config.tile_m, config.tile_n, config.cluster, splits)


def heuristics():
    """(pick function, description) of nvMatmulHeuristics, or None when it is not installed."""
    try:
        import nvMatmulHeuristics as nmh
    except ImportError:
        return None
    lib = nmh.NvMatmulHeuristicsInterfaceEx(
        backend=nmh.NvMatmulHeuristicsTarget.CUTLASS3,
        flags=nmh.NvMatmulHeuristicsFlags.PERF_MODEL_BASED_AUTO_TUNING,
        load_discovery_implicitly=True, gpu=nmh.NvMatmulHeuristicsNvidiaGpu.H100_SXM)
    layout = nmh.NvMatmulHeuristicsMatmulLayout.TN_ROW_MAJOR  # A K-major, B an nn.Linear weight

    def pick(m: int, n: int, k: int, measured: set[str]) -> tuple[str | None, str]:
        ranked = lib.get(lib.makeNvMatmulHeuristicsProblem(m, n, k, layout), 64, precision="BSB")
        top = ranked[0]["kernel"]
        first = f"{top.cta_tile_m}x{top.cta_tile_n}x{top.cta_tile_k} c{top.cluster_m}x{top.cluster_n}"
        for item in ranked:
            cfg = item["kernel"]
            cluster = (cfg.cluster_m, cfg.cluster_n)
            if cluster not in ((1, 1), (1, 2), (2, 1)):
                cluster = (1, 2) if cfg.cluster_n > 1 else (2, 1)
            for schedule in ("pp", "co"):
                name = name_of(schedule, cfg.cta_tile_m, cfg.cta_tile_n, cluster, cfg.split_k)
                if name in measured:
                    return name, first
        return None, first

    return pick


def geomean(values) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("json", nargs="+", help="files written by bench/sweep_configs.py --json")
    args = p.parse_args()
    rows = [row for path in args.json for row in json.loads(Path(path).read_text())["results"]]
    nmh = heuristics()
    regret: dict[str, list[float]] = {"evtc": [], "nvMatmulHeuristics": []}
    unmapped = 0
    for row in rows:
        m, n, k = row["m"], row["n"], row["k"]
        cands = {name: us for name, us in row["us"].items() if name not in ("cublas", "auto")}
        if not cands:
            continue
        best = min(cands.values())
        ours = evtc_pick(m, n, k)
        line = f"{row['shape']:>18}  evtc {ours}: {cands.get(ours, float('nan')) / best:.3f}"
        if ours in cands:
            regret["evtc"].append(cands[ours] / best)
        if nmh is not None:
            theirs, first = nmh(m, n, k, set(cands))
            if theirs is None:
                unmapped += 1
                regret["nvMatmulHeuristics"].append(1.0)
                line += f"  nvMatmulHeuristics: none of 64 maps (its first: {first})"
            else:
                regret["nvMatmulHeuristics"].append(cands[theirs] / best)
                line += f"  nvMatmulHeuristics {theirs}: {cands[theirs] / best:.3f} (its first: {first})"
        print(line)
    for who, values in regret.items():
        if values:
            print(f"{who}: regret geomean {geomean(values):.3f}, worst {max(values):.3f} over "
                  f"{len(values)} shapes" + (f" ({unmapped} unmapped, scored 1.0)"
                                             if who != "evtc" and unmapped else ""))


if __name__ == "__main__":
    main()
