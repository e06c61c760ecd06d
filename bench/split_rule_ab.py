"""The split-count rule against the previous one, launch by launch: for each problem, the default
kernel's tile and cluster with the split count the selector chooses now (``modelled_splits``
within ``choose_splits``' bounds) and the count the bounds alone gave (the rule before the model),
timed only where the two differ, in CUDA graphs of back-to-back calls cycling weight copies (so the
weight streams from HBM), paired with cuBLAS in shuffled order. Ratio = cuBLAS time / evtc time.

    python3 bench/split_rule_ab.py
    python3 bench/split_rule_ab.py --ms 1,16,64 --weights 2048x7168,3072x7168
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from shapes import capture as graph_of  # noqa: E402  (a CUDA graph of calls cycling weights)

import evtc  # noqa: E402
from evtc.plan import selector  # noqa: E402
from evtc.timing import time_paired  # noqa: E402

# (N, K) of decode-sized LLM and MoE layers: Llama-3 8B / 70B, Qwen2.5 7B, Mixtral and DeepSeek-V3
# experts, and few-tile expert widths.
WEIGHTS = ("4096x4096,6144x4096,14336x4096,4096x14336,28672x4096,8192x8192,10240x8192,8192x28672,"
           "2048x7168,7168x2048,4096x7168,1536x2048,2048x768,1024x8192,3072x7168,2560x8192,512x14336,"
           "768x16384,1536x7168,2048x14336,1408x2048,2816x2048,1024x4096,3584x3584")


def identity(acc):
    return acc


def launch(kernel, m: int, n: int, k: int, previous: bool):
    """(config, splits) of the kernel's launch, under the current rule or the previous one."""
    model = selector.modelled_splits
    if previous:
        selector.modelled_splits = lambda most, *args: most
    kernel.pin_splits(None)
    try:
        return kernel.launch_for(m, n, k)
    finally:
        selector.modelled_splits = model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ms", default="1,16,64,128,256")
    p.add_argument("--weights", default=WEIGHTS, help="comma list of NxK")
    p.add_argument("--samples", type=int, default=15)
    p.add_argument("--reps", type=int, default=30, help="calls per graph")
    args = p.parse_args()
    bf = torch.bfloat16
    kernel = evtc.compile(identity, {"a": torch.empty(64, 64, dtype=bf, device="meta"),
                                     "b": torch.empty(64, 64, dtype=bf, device="meta").t()})
    new_ratios, old_ratios, same = [], [], 0
    for shape in args.weights.split(","):
        n, k = (int(v) for v in shape.split("x"))
        copies = max(1, min(16, math.ceil((256 << 20) / (n * k * 2))))
        weights = [torch.randn(n, k, device="cuda").to(bf) for _ in range(copies)]
        for m in (int(v) for v in args.ms.split(",")):
            config, s_new = launch(kernel, m, n, k, previous=False)
            config_old, s_old = launch(kernel, m, n, k, previous=True)
            assert config == config_old
            if s_new == s_old:
                same += 1
                continue
            x = torch.randn(m, k, device="cuda").to(bf)
            d = torch.empty(m, n, device="cuda", dtype=bf)
            ref = x.float() @ weights[0].float().t()
            graphs = [graph_of(lambda w, x=x, d=d: torch.matmul(x, w.t(), out=d), weights, args.reps)]
            for s in (s_new, s_old):
                kernel.pin_splits(s)
                graphs.append(graph_of(lambda w, x=x, d=d: kernel(x, w.t(), out=d), weights, args.reps))
                kernel(x, weights[0].t(), out=d)
                torch.cuda.synchronize()
                assert (d.float() - ref).abs().max() <= 0.02 * ref.abs().max(), (m, n, k, s)
            kernel.pin_splits(None)
            t = time_paired([g.replay for g in graphs], 3, args.samples, 1)
            new_ratios.append(t[0] / t[1])
            old_ratios.append(t[0] / t[2])
            print(f"{m:5d}x{n}x{k}: {config.short_name()}  cuBLAS {t[0] / args.reps * 1e3:6.1f} us  "
                  f"now S{s_new} {t[0] / t[1]:.3f}  before S{s_old} {t[0] / t[2]:.3f}", flush=True)
    if not new_ratios:
        print(f"no launch changes its split count ({same} launches)")
        return

    def geomean(v):
        return math.exp(statistics.mean(map(math.log, v)))
    print(f"{len(new_ratios)} launches change, {same} do not; now: geomean {geomean(new_ratios):.3f}, worst "
          f"{min(new_ratios):.3f}; before: geomean {geomean(old_ratios):.3f}, worst {min(old_ratios):.3f}")


if __name__ == "__main__":
    main()
