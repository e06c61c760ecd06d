"""A training step of one layer with a trained bias, ``y = gelu(x @ W^T + b)``, forward and backward,
in bf16: ``evtc.nn.FusedLinear`` against eager ``nn.Linear`` + ``F.gelu`` and torch.compile of it
(issue "Training": a layer seen alone, its dZ and the bias's gradient in one elementwise kernel,
evtc/dz_pass.py).

    python3 bench/layer_step.py                       # M = 8192 tokens, 4096 -> 14336
    python3 bench/layer_step.py --tokens 2048 --no-compile

Variants: evtc (FusedLinear, the dZ kernel); evtc reference (the same layer with the dZ kernel
turned off: the backward graph as float32 torch operations); eager; torch.compile (default mode).
Gradients are compared with eager's by relative norm before timing. Steps are timed in alternation,
in a shuffled order per sample (``evtc.timing.time_paired``); ratio = other's time / evtc's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import evtc  # noqa: E402
from evtc import dz_pass  # noqa: E402
from evtc.timing import time_paired  # noqa: E402


def bias_gelu(acc, bias):
    return F.gelu(acc + bias)


class Eager(nn.Module):
    def __init__(self, k: int, n: int, **kw) -> None:
        super().__init__()
        self.lin = nn.Linear(k, n, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.lin(x))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--n", type=int, default=14336)
    p.add_argument("--samples", type=int, default=15)
    p.add_argument("--no-compile", action="store_true")
    args = p.parse_args()
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    torch.manual_seed(0)
    eager = Eager(args.k, args.n, **kw)
    ours = evtc.nn.FusedLinear(args.k, args.n, bias_gelu, **kw)
    with torch.no_grad():
        ours.weight.copy_(eager.lin.weight)
        ours.bias.copy_(eager.lin.bias)
    x = torch.randn(args.tokens, args.k, **kw).requires_grad_()
    dy = torch.randn(args.tokens, args.n, **kw)

    def step(model):
        def run():
            model.zero_grad(set_to_none=True)
            x.grad = None
            model(x).backward(dy)
        return run

    real_applies = dz_pass.applies

    def reference():
        dz_pass.applies = lambda *a: False
        try:
            step(ours)()
        finally:
            dz_pass.applies = real_applies

    variants = {"evtc": step(ours), "evtc reference": reference, "eager": step(eager)}
    if not args.no_compile:
        variants["torch.compile"] = step(torch.compile(eager))
    step(eager)()
    want = [x.grad.clone(), eager.lin.weight.grad.clone(), eager.lin.bias.grad.clone()]
    took = []
    real_gradients = dz_pass.gradients
    dz_pass.gradients = lambda *a: took.append(real_gradients(*a)) or took[-1]
    for name, fn in variants.items():
        took.clear()
        fn()
        if name == "evtc":
            assert took and took[-1] is not None, "evtc's backward did not take the dZ kernel"
        model = ours if name.startswith("evtc") else eager.lin
        got = [x.grad, model.weight.grad, model.bias.grad]
        err = max(((g.float() - w.float()).norm() / w.float().norm()).item()
                  for g, w in zip(got, want, strict=True))
        print(f"gradients of {name} against eager: relative error {err:.2e} by norm (largest of x, W, b)")
    dz_pass.gradients = real_gradients
    ms = time_paired(list(variants.values()), 3, args.samples, 1)
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; M = {args.tokens}, "
          f"{args.k} -> {args.n}, bias + GELU, bf16; median of {args.samples}")
    for name, t in zip(variants, ms, strict=True):
        print(f"  {name:15s} {t:7.3f} ms  {name}/evtc = {t / ms[0]:.3f}")


if __name__ == "__main__":
    main()
