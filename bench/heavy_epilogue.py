"""Epilogues that move several tiles besides D (tile operands read, extra outputs written): the
launch the selector chooses against the cooperative 128 x 256 tile, each against the bare cuBLAS
GEMM of the same shape (issue "Fast on every shape").

    python3 bench/heavy_epilogue.py [--shapes 8192x14336x4096,...]

Ratio = cuBLAS GEMM time / evtc time (the GEMM alone, without the epilogue's work: > 1 is faster
than cuBLAS that does less). Timed in alternation, shuffled per sample (evtc.timing.time_paired).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from epilogue import rel_err  # noqa: E402  (bench/epilogue.py)

import evtc  # noqa: E402
from evtc.timing import time_paired  # noqa: E402


def swiglu_dz(grad, saved_gate, saved_up):  # 2 tile loads, 2 outputs: 3 tiles besides D
    s = torch.sigmoid(saved_gate)
    dgate = grad * saved_up * s * (1 + saved_gate * (1 - s))
    return dgate.to(torch.bfloat16), (grad * F.silu(saved_gate)).to(torch.bfloat16)


def residual_aux(acc, C, residual):  # 2 tile loads, 2 outputs: 3 tiles besides D
    y = acc + C
    return y + residual, torch.relu(y).to(torch.bfloat16)


def lincomb(acc, C, alpha: float):  # 1 tile load: 1 tile besides D
    return alpha * acc + C


EPILOGUES = {"swiglu_dz": (swiglu_dz, ("saved_gate", "saved_up"), {}),
             "residual_aux": (residual_aux, ("C", "residual"), {}),
             "lincomb": (lincomb, ("C",), {"alpha": 0.5})}
SHAPES = "8192x14336x4096,4096x14336x4096,2048x14336x4096,8192x4096x4096,8192x4096x14336,4096x28672x4096"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=SHAPES)
    p.add_argument("--samples", type=int, default=20)
    p.add_argument("--pingpong", default="",
                   help="also time ping-pong 128-row tiles of these widths (16-column subtiles, 2 D "
                        "buffers), e.g. 128,176,192")
    args = p.parse_args()
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    wide = {"schedule": "cooperative", "tile_n": 256}
    candidates = [(f"pingpong 128x{w}", {"schedule": "pingpong", "tile_n": w, "epi_tile_n": 16,
                                          "epi_stages": 2})
                  for w in (int(v) for v in args.pingpong.split(",") if v)]
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; bf16; median of {args.samples}")
    for shape in args.shapes.split(","):
        m, n, k = (int(v) for v in shape.split("x"))
        a, b = torch.randn(m, k, **kw), torch.randn(k, n, **kw) / k ** 0.5
        fns, names = [lambda a=a, b=b: a @ b], ["cuBLAS"]
        for name, (fn, tiles, scalars) in EPILOGUES.items():
            ops = {t: torch.randn(m, n, **kw) for t in tiles}
            example = {"a": a, "b": b, **ops, **scalars}
            for label, config in (("chosen", None), ("coop 128x256", wide), *candidates):
                try:
                    kern = evtc.compile(fn, example, config=config)
                except evtc.CompileError as exc:
                    print(f"  {name} {label}: does not compile ({str(exc).splitlines()[0]})")
                    continue
                check(kern, fn, a, b, ops, scalars, f"{shape} {name} {label}")
                fns.append(lambda kern=kern, ops=ops, scalars=scalars, a=a, b=b: kern(a, b, **ops, **scalars))
                launch = kern.launch_for(m, n, k)[0].short_name() if config is None else "pinned"
                names.append(f"{name} {label} ({launch})")
        ms = time_paired(fns, 3, args.samples, 1)
        print(f"{shape}: cuBLAS {ms[0]:.3f} ms")
        for name, t in zip(names[1:], ms[1:], strict=True):
            print(f"  {name:75s} {t:7.3f} ms  ratio {ms[0] / t:.3f}")


def check(kern, fn, a, b, ops, scalars, label) -> None:
    """Each output of ``kern`` against ``fn`` on the float32 accumulator (a bench of a wrong kernel
    is no measurement): relative error by norm, printed; a large one raises."""
    got = kern(a, b, **ops, **scalars)
    want = fn(a.float() @ b.float(), **{k: v.float() for k, v in ops.items()}, **scalars)
    def as_tuple(out):
        return (out,) if isinstance(out, torch.Tensor) else tuple(out)

    errs = [rel_err(g, w.float()) for g, w in zip(as_tuple(got), as_tuple(want), strict=True)]
    if max(errs) > 2e-2:
        raise AssertionError(f"{label}: relative errors {errs}")


if __name__ == "__main__":
    main()
