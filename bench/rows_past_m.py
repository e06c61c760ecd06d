"""The default launch against cuBLAS where the last row of tiles reaches past M: problems of M = 33 to
128 rows (and any list given), on LLM weights, identity epilogue, bf16, B K-major.

    python3 bench/rows_past_m.py                                  # the default Ms and weights
    python3 bench/rows_past_m.py --ms 65,96,128 --weights 8192x8192 --json out.json

The TMA unit spends on the rows of an A box that lie past M about what it spends on data
(docs/performance.md, "Rows of A past M"), so these sizes show what a launch loses to rows it
does not need. Every call runs in a CUDA graph that cycles through enough copies of the weight to
stream it from HBM; each row's evtc and cuBLAS calls are timed in one ``time_paired`` call
(shuffled order per sample, medians). ratio = cuBLAS time / evtc time (> 1: evtc faster).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import shapes as shape_suite  # noqa: E402

DEFAULT_MS = (40, 48, 65, 72, 80, 96, 104, 112, 120, 128)
# (N, K): Qwen2.5-7B qkv, Llama-3 8B qkv, Llama-3 70B o_proj, DeepSeek-V3 expert down.
DEFAULT_WEIGHTS = ((4608, 3584), (6144, 4096), (8192, 8192), (7168, 2048))


def identity(acc):
    return acc


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ms", type=int_list, default=list(DEFAULT_MS))
    p.add_argument("--weights", default=",".join(f"{n}x{k}" for n, k in DEFAULT_WEIGHTS),
                   help="comma list of NxK")
    p.add_argument("--samples", type=int, default=9)
    p.add_argument("--rotate-mb", type=int, default=256, help="weight copies cycled per graph, in MB")
    p.add_argument("--json", help="write every measurement here")
    args = p.parse_args()
    shape_suite.load_torch()  # bench/shapes.py imports torch lazily
    import torch

    import evtc
    from evtc.timing import time_paired

    dtype = torch.bfloat16
    example = {"a": torch.empty(8, 64, dtype=dtype, device="meta"),
               "b": torch.empty(64, 64, dtype=dtype, device="meta").t()}
    kernel = evtc.compile(identity, example)
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)
    rows, ratios = [], []
    for weight in args.weights.split(","):
        n, k = (int(x) for x in weight.split("x"))
        g = torch.Generator(device="cuda").manual_seed(n + k)
        copies = max(2, math.ceil((args.rotate_mb << 20) / (n * k * 2)))
        weights = [(torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).to(dtype)
                   for _ in range(min(copies, 64))]
        for m in args.ms:
            x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
            out = torch.empty(m, n, device="cuda", dtype=dtype)
            ref = x.double() @ weights[0].double().t()
            got = kernel(x, weights[0].t(), out=out)
            err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
            assert err < 2e-2, (m, n, k, err)
            reps = 30
            calls = [lambda w, x=x: torch.matmul(x, w.t()), lambda w, x=x, out=out: kernel(x, w.t(), out=out)]
            graphs = [shape_suite.capture(call, weights, reps).replay for call in calls]
            cublas_ms, evtc_ms = time_paired(graphs, 2, args.samples, 1)
            cublas_us, evtc_us = cublas_ms / reps * 1e3, evtc_ms / reps * 1e3
            launch = kernel.launch_for(m, n, k)[0].short_name()
            ratio = cublas_us / evtc_us
            ratios.append(ratio)
            rows.append({"m": m, "n": n, "k": k, "cublas_us": cublas_us, "evtc_us": evtc_us,
                         "ratio": ratio, "launch": launch})
            print(f"{m:5d} x {n:6d} x {k:6d}: cuBLAS {cublas_us:7.1f} us  evtc {evtc_us:7.1f} us  "
                  f"{ratio:5.3f}  [{launch}]", flush=True)
    geomean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    print(f"# geomean {geomean:.3f}, worst {min(ratios):.3f}, {len(ratios)} rows", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "geomean": geomean}, indent=1))


if __name__ == "__main__":
    main()
