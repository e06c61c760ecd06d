"""A training step of a Llama-style MLP block, forward and backward, in bf16: evtc against eager
PyTorch and torch.compile (issue "Training").

    python3 bench/train.py                        # M = 8192 tokens, hidden 4096, intermediate 14336
    python3 bench/train.py --tokens 2048 --no-compile
    python3 bench/train.py --profile             # and where each step spends its GPU time
    python3 bench/train.py --gaps                # and how long the GPU idles within steps run back to back
    python3 bench/train.py --gpt --inter 16384     # a GPT-style block (GELU, trained biases)

The block: ``h = rms_norm(x) * g``; ``a = silu(gate) * up`` of ``h @ W_gate_up^T``;
``y = x + a @ W_down^T``. A step is the forward and ``y.backward(dy)`` with a fixed random ``dy``
(gradients accumulate into the parameters, as in training; they are zeroed between checks only).

* eager: ``nn.Linear`` layers and torch ops;
* torch.compile: the eager block compiled (default mode);
* evtc: the RMS scaling in torch, then ``evtc.nn.MLP`` (SwiGLU in the gate/up GEMM's epilogue, the
  residual in the down GEMM's; its backward computes the SwiGLU's dZ in the epilogue of the GEMM
  that makes its incoming gradient);
* evtc+compile: the evtc block under torch.compile, one graph (``fullgraph=True``): the RMS scaling
  fused by it, the block's forward and backward as its two custom operators (evtc.mlp_op), which
  the eager "evtc" step registered;
* evtc layers: the same with two separate ``evtc.nn.FusedLinear`` layers (each backward on its own:
  the incoming gradient of the first goes through memory and torch's elementwise kernels).

All variants start from the same parameters and inputs. Before timing, each one's gradients are
compared with eager's by relative norm. Steps are timed in alternation, in a shuffled order per
sample (``evtc.timing.time_paired``); ratio = other's time / evtc's (> 1: evtc faster).
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
from evtc.timing import time_paired  # noqa: E402


def swiglu(acc):
    gate, up = acc.chunk(2, dim=-1)
    return F.silu(gate) * up


def add_residual(acc, residual):
    return acc + residual


def rms_scaled(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    rstd = torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps)
    return (x.float() * rstd).to(x.dtype) * weight


class EagerMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, **kw) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.ones(hidden, **kw))
        self.gate_up = nn.Linear(hidden, 2 * inter, bias=False, **kw)
        self.down = nn.Linear(inter, hidden, bias=False, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(rms_scaled(x, self.norm)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class EvtcMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, **kw) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.ones(hidden, **kw))
        self.mlp = evtc.nn.MLP(hidden, inter, swiglu, add_residual, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(rms_scaled(x, self.norm), residual=x)


class EvtcLayers(nn.Module):
    def __init__(self, hidden: int, inter: int, **kw) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.ones(hidden, **kw))
        self.gate_up = evtc.nn.FusedLinear(hidden, 2 * inter, swiglu, bias=False, **kw)
        self.down = evtc.nn.FusedLinear(inter, hidden, add_residual, bias=False, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate_up(rms_scaled(x, self.norm)), residual=x)


def bias_gelu(acc, bias):
    return F.gelu(acc + bias)


def add_bias_residual(acc, bias, residual):
    return acc + bias + residual


class EagerGPT(nn.Module):
    """A GPT-style MLP block (``--gpt``): ``x + down(gelu(up(norm(x))))``, both layers with biases."""

    def __init__(self, hidden: int, inter: int, **kw) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.ones(hidden, **kw))
        self.up = nn.Linear(hidden, inter, **kw)
        self.down = nn.Linear(inter, hidden, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(rms_scaled(x, self.norm))))


class EvtcGPT(nn.Module):
    """``--gpt`` as ``evtc.nn.MLP`` (the first bias's gradient from the fused dZ kernel); with
    ``unfused``, its backward's step 3 as before that: dH in memory, then the dZ pass."""

    def __init__(self, hidden: int, inter: int, unfused: bool = False, **kw) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.ones(hidden, **kw))
        self.mlp = evtc.nn.MLP(hidden, inter, bias_gelu, add_bias_residual, bias=True, **kw)
        if unfused:
            self.mlp.dz_kernel = lambda *args: None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(rms_scaled(x, self.norm), residual=x)


def gradient_error(model: nn.Module, reference: nn.Module) -> float:
    """Largest relative norm error of ``model``'s parameter gradients against ``reference``'s."""
    worst = 0.0
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert p.grad is not None, name
        err = ((p.grad.float() - q.grad.float()).norm() / q.grad.float().norm().clamp_min(1e-30)).item()
        worst = max(worst, err)
    return worst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--inter", type=int, default=14336)
    p.add_argument("--samples", type=int, default=15)
    p.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    p.add_argument("--profile", action="store_true",
                   help="also print where one step of each variant spends its GPU time (torch.profiler)")
    p.add_argument("--gaps", action="store_true",
                   help="also run 5 steps of each variant back to back under torch.profiler and print "
                        "per step: the wall time, the GPU's busy time and its idle time between kernels")
    p.add_argument("--gpt", action="store_true",
                   help="a GPT-style block instead: GELU, both layers with trained biases; 'evtc "
                        "unfused' is the same block with the first layer's dZ outside dZ2 @ W2")
    args = p.parse_args()
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    torch.manual_seed(0)
    if args.gpt:
        eager = EagerGPT(args.hidden, args.inter, **kw)
        ours = EvtcGPT(args.hidden, args.inter, **kw)
        second = "evtc unfused"
        layers = EvtcGPT(args.hidden, args.inter, unfused=True, **kw)
        with torch.no_grad():
            for model in (ours, layers):
                for mine, theirs in ((model.mlp.up, eager.up), (model.mlp.down, eager.down)):
                    mine.weight.copy_(theirs.weight)
                    mine.bias.copy_(theirs.bias)
    else:
        eager = EagerMLP(args.hidden, args.inter, **kw)
        ours = EvtcMLP(args.hidden, args.inter, **kw)
        second = "evtc layers"
        layers = EvtcLayers(args.hidden, args.inter, **kw)
        with torch.no_grad():
            for up, down in ((ours.mlp.up, ours.mlp.down), (layers.gate_up, layers.down)):
                up.weight.copy_(eager.gate_up.weight)
                down.weight.copy_(eager.down.weight)
    x = (torch.randn(args.tokens, args.hidden, **kw)).requires_grad_()
    dy = torch.randn(args.tokens, args.hidden, **kw)
    variants = {"evtc": ours, second: layers, "eager": eager}
    if not args.no_compile:
        variants["torch.compile"] = torch.compile(eager)
        # How a user deploys evtc inside a compiled model: torch.compile fuses the RMS scaling
        # around the evtc block, whose forward and backward are one custom operator each.
        variants["evtc+compile"] = torch.compile(ours, fullgraph=True)

    def step(model):
        def run():
            model(x).backward(dy)
        return run

    # Gradients against eager's (one step each from zeroed gradients; "evtc+compile" shares evtc's
    # parameters, so each is checked right after its own step).
    eager.zero_grad(set_to_none=True)
    step(eager)()
    for name in ("evtc", second, "evtc+compile"):
        if name not in variants:
            continue
        model = variants[name]
        model.zero_grad(set_to_none=True)
        step(model)()
        err = gradient_error(model, eager)
        print(f"gradients of {name} against eager: relative error {err:.2e} by norm "
              "(largest over parameters)")
    x.grad = None
    names = list(variants)
    ms = time_paired([step(variants[n]) for n in names], 3, args.samples, 1)
    # Forward: gate/up 2 M H (2 I) and down 2 M I H flops (up 2 M H I for --gpt); the backward
    # twice that (dX and dW).
    flops = 3 * (4 if args.gpt else 6) * args.tokens * args.hidden * args.inter
    block = "GPT-style (GELU, biases)" if args.gpt else "Llama-style (SwiGLU)"
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; {block}, M = {args.tokens}, "
          f"hidden {args.hidden}, intermediate {args.inter}, bf16; median of {args.samples}")
    for n, t in zip(names, ms, strict=True):
        ratio = t / ms[0]
        print(f"  {n:14s} {t:8.3f} ms  {flops / t / 1e9:6.0f} TFLOP/s  {n}/evtc = {ratio:.3f}")
    if args.profile:
        for n in names:
            profile_step(n, step(variants[n]))
    if args.gaps:
        print("\nback-to-back steps under torch.profiler (5 steps; per step):")
        for n in names:
            wall, busy = idle_gaps(step(variants[n]))
            print(f"  {n:14s} wall {wall:7.3f} ms  GPU busy {busy:7.3f} ms  idle {wall - busy:6.3f} ms")


def profile_step(name: str, run) -> None:
    """The GPU kernels of one step of ``run``, by total time (what a faster backward must remove)."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    print(f"\n{name}: GPU time by kernel (one step)")
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=15, max_name_column_width=70))


def idle_gaps(run, steps: int = 5) -> tuple[float, float]:
    """(wall ms, GPU-busy ms) per step of ``steps`` steps of ``run`` launched back to back: busy is
    the union of the kernels' and copies' intervals, so wall - busy is time the GPU waited for the
    host (a synchronisation or a slow launch) rather than time it ran slower."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # no CPU tracing: it slows the host
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start)
    busy, last_end = 0.0, None
    for start, end in spans:
        if last_end is None or start > last_end:
            busy += end - start
            last_end = end
        elif end > last_end:
            busy += end - last_end
            last_end = end
    wall = spans[-1][1] - spans[0][0]
    return wall / steps / 1e3, busy / steps / 1e3


if __name__ == "__main__":
    main()
