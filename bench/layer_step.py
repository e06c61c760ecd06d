"""A training step of one layer with a trained bias, ``y = gelu(x @ W^T + b)``, forward and backward,
in bf16: ``evtc.nn.FusedLinear`` against eager ``nn.Linear`` + ``F.gelu`` and torch.compile of it
(issue "Training": a layer seen alone, its dZ and the bias's gradient in one elementwise kernel,
evtc/dz_pass.py).

    python3 bench/layer_step.py                       # M = 8192 tokens, 4096 -> 14336
    python3 bench/layer_step.py --tokens 2048 --no-compile
    python3 bench/layer_step.py --operator            # a compiled kernel's own operator
    python3 bench/layer_step.py --operator --swiglu --n 28672
    python3 bench/layer_step.py --operator --row-sums # two outputs: y and its per-row sums
    python3 bench/layer_step.py --swiglu --bias --n 28672   # SwiGLU over acc + bias (a wide bias)

Variants: evtc (FusedLinear, the dZ kernel); evtc reference (the same layer with the dZ kernel
turned off: the backward graph as float32 torch operations); eager; torch.compile (default mode).
With ``--operator`` evtc is ``k(x, W.t(), bias=b)`` for ``k = evtc.compile(...)``, whose backward
saved no accumulator and runs the forward's GEMM again with dZ and the bias's gradient as its
epilogue (``evtc.dz_pass.recomputed_gradients``; its reference recomputes ``x @ W^T`` into memory).
``--swiglu``: ``silu(gate) * up`` over the halves of an N-wide GEMM, without a bias (with ``--bias``,
over the halves of ``acc + bias``, the trained bias as wide as the GEMM). ``--row-sums``:
bias + GELU returning ``y`` and ``y.sum(-1)`` (two outputs, each with its incoming gradient).
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


def swiglu(acc):
    gate, up = acc.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_bias(acc, bias):
    gate, up = (acc + bias).chunk(2, dim=-1)
    return F.silu(gate) * up


def bias_gelu_row_sums(acc, bias):
    y = F.gelu(acc + bias)
    return y, y.sum(-1)


class Eager(nn.Module):
    def __init__(self, k: int, n: int, gated: bool = False, row_sums: bool = False, bias: bool = False,
                 **kw) -> None:
        super().__init__()
        self.gated, self.row_sums = gated, row_sums
        self.lin = nn.Linear(k, n, bias=bias or not gated, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.gated:
            return swiglu(self.lin(x))
        y = F.gelu(self.lin(x))
        return (y, y.sum(-1)) if self.row_sums else y


class Operator(nn.Module):
    """The layer as a compiled kernel's own operator: ``k(x, W.t(), bias=b)``."""

    def __init__(self, k: int, n: int, fn, x: torch.Tensor, **kw) -> None:
        super().__init__()
        gated = fn is swiglu
        self.weight = nn.Parameter(torch.empty(n, k, **kw))
        self.bias = None if gated else nn.Parameter(torch.empty(n, **kw))
        operands = {} if gated else {"bias": self.bias}
        self.kernel = evtc.compile(fn, {"a": x, "b": self.weight.t(), **operands})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        operands = {} if self.bias is None else {"bias": self.bias}
        return self.kernel(x, self.weight.t(), **operands)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--n", type=int, default=14336)
    p.add_argument("--samples", type=int, default=15)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--operator", action="store_true", help="a compiled kernel's own operator")
    p.add_argument("--swiglu", action="store_true", help="SwiGLU over the GEMM's halves, no bias")
    p.add_argument("--row-sums", action="store_true", help="bias + GELU, returning y and y.sum(-1)")
    p.add_argument("--bias", action="store_true", help="with --swiglu: over acc + bias, the bias trained")
    args = p.parse_args()
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    torch.manual_seed(0)
    biased = args.bias or not args.swiglu
    eager = Eager(args.k, args.n, args.swiglu, args.row_sums, args.bias, **kw)
    x = torch.randn(args.tokens, args.k, **kw).requires_grad_()
    fn = (swiglu_bias if args.swiglu and args.bias else swiglu if args.swiglu
          else bias_gelu_row_sums if args.row_sums else bias_gelu)
    if args.operator:
        ours = Operator(args.k, args.n, fn, x, **kw)
    else:
        ours = evtc.nn.FusedLinear(args.k, args.n, fn, bias=biased, **kw)
    with torch.no_grad():
        ours.weight.copy_(eager.lin.weight)
        if biased:
            ours.bias.copy_(eager.lin.bias)
    dy = torch.randn(args.tokens, args.n // 2 if args.swiglu else args.n, **kw)
    grads = [dy, torch.randn(args.tokens, **kw)] if args.row_sums else [dy]
    # The entry the evtc variant must take, and the condition the reference turns off.
    entry, condition = (("recomputed_gradients", "recompute_applies") if args.operator
                        else ("gradients", "applies"))

    def step(model):
        def run():
            model.zero_grad(set_to_none=True)
            x.grad = None
            out = model(x)
            torch.autograd.backward(list(out) if isinstance(out, tuple) else [out], grads)
        return run

    real_applies = getattr(dz_pass, condition)

    def reference():
        setattr(dz_pass, condition, lambda *a: False)
        try:
            step(ours)()
        finally:
            setattr(dz_pass, condition, real_applies)

    variants = {"evtc": step(ours), "evtc reference": reference, "eager": step(eager)}
    if not args.no_compile:
        variants["torch.compile"] = step(torch.compile(eager))
    step(eager)()
    params = ["weight", "bias"] if biased else ["weight"]
    want = [x.grad.clone(), *(getattr(eager.lin, p).grad.clone() for p in params)]
    took = []
    real_gradients = getattr(dz_pass, entry)
    setattr(dz_pass, entry, lambda *a: took.append(real_gradients(*a)) or took[-1])
    for name, fn in variants.items():
        took.clear()
        fn()
        if name == "evtc":
            assert took and took[-1] is not None, "evtc's backward did not take the dZ kernel"
        model = ours if name.startswith("evtc") else eager.lin
        got = [x.grad, *(getattr(model, p).grad for p in params)]
        err = max(((g.float() - w.float()).norm() / w.float().norm()).item()
                  for g, w in zip(got, want, strict=True))
        print(f"gradients of {name} against eager: relative error {err:.2e} by norm (largest of x, {params})")
    setattr(dz_pass, entry, real_gradients)
    ms = time_paired(list(variants.values()), 3, args.samples, 1)
    what = ("SwiGLU over acc + bias" if args.swiglu and args.bias else "SwiGLU" if args.swiglu
            else "bias + GELU, y and y.sum(-1)" if args.row_sums else "bias + GELU")
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; M = {args.tokens}, "
          f"{args.k} -> {args.n}, {what}, {'operator' if args.operator else 'FusedLinear'}, bf16; "
          f"median of {args.samples}")
    for name, t in zip(variants, ms, strict=True):
        print(f"  {name:15s} {t:7.3f} ms  {name}/evtc = {t / ms[0]:.3f}")


if __name__ == "__main__":
    main()
