"""Each GEMM of an ``evtc.nn.MLP`` training step against the cuBLAS GEMM it replaces (issue
"Training"): where the block's time goes, kernel by kernel.

    python3 bench/mlp_parts.py                     # M = 8192, hidden 4096, intermediate 14336, bf16

* forward gate/up: evtc's SwiGLU kernel that also stores the accumulator's halves, against
  ``x @ W1^T`` alone (cuBLAS; eager then runs SwiGLU as separate kernels);
* forward down: evtc's residual kernel against ``h @ W2^T`` (cuBLAS);
* backward dZ1: evtc's kernel ``dZ1 = swiglu'(dZ2 @ W2, saved)`` against ``dZ2 @ W2`` alone.

``--configs`` and ``--forward-configs`` time the dZ1 and the forward gate/up kernel compiled with
other configurations; ``--plain-gemms`` the GEMMs cuBLAS runs in every variant as evtc kernels.

Timed in alternation, in a shuffled order per sample (``evtc.timing.time_paired``); ratio =
cuBLAS time / evtc time (> 1: evtc faster, although it does more).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from epilogue import rel_err  # noqa: E402  (bench/epilogue.py)
from train import add_residual, swiglu  # noqa: E402  (bench/train.py: the same block)

import evtc  # noqa: E402
from evtc.timing import time_paired  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--inter", type=int, default=14336)
    p.add_argument("--samples", type=int, default=30)
    p.add_argument("--configs", action="store_true",
                   help="also time the dZ1 kernel compiled with other configurations")
    p.add_argument("--forward-configs", action="store_true",
                   help="also time the forward gate/up kernel (SwiGLU, stores the accumulator's halves) "
                        "compiled with other configurations")
    p.add_argument("--layer-dz", action="store_true",
                   help="also time the first layer's dZ seen alone (evtc.nn.FusedLinear's backward): the "
                        "elementwise kernel (evtc.dz_pass), the float32 torch operations, eager's bf16 ops")
    p.add_argument("--layer-dz-configs", action="store_true",
                   help="with --layer-dz: also its kernel compiled with other configurations")
    p.add_argument("--plain-gemms", action="store_true",
                   help="also time the step's GEMMs that cuBLAS runs in both variants (dX, dW1, dW2) "
                        "as evtc identity kernels in their own layouts")
    args = p.parse_args()
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    block = evtc.nn.MLP(args.hidden, args.inter, swiglu, add_residual, **kw)
    m, hidden, inter = args.tokens, args.hidden, args.inter
    x = torch.randn(m, hidden, **kw).requires_grad_()
    y = block(x, residual=x)  # compiles the forward kernels
    y.backward(torch.randn_like(y))  # and the backward's
    w1, w2 = block.up.weight.detach(), block.down.weight.detach()
    x = x.detach()
    first = block.first_linear(x, {})
    second = block.second_linear(torch.empty(m, inter, **kw), {"residual": x})
    saving1 = first._saving_kernel()
    h, gate, up = first._call_kernel(saving1, x, w1, {})
    (kernel, epilogue), = [v for v in block._dz.values() if v]
    dz2 = torch.randn(m, hidden, **kw)
    dz1 = torch.empty(m, 2 * inter, **kw)
    pairs = {
        "forward gate/up (+SwiGLU, stores acc)": (lambda: first._call_kernel(saving1, x, w1, {}),
                                                   lambda: x @ w1.t()),
        "forward down (+residual)": (lambda: second._call(h, w2, None, {"residual": x}),
                                     lambda: h @ w2.t()),
        "backward dZ1 (dH never stored)": (
            lambda: kernel(dz2, w2, saved_gate=gate, saved_up=up, out=(dz1[:, :inter], dz1[:, inter:])),
            lambda: dz2 @ w2),
    }
    fns = [f for pair in pairs.values() for f in pair]
    ms = time_paired(fns, 3, args.samples, 1)
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; M = {m}, hidden {hidden}, "
          f"intermediate {inter}, bf16; median of {args.samples}")
    for i, name in enumerate(pairs):
        ours, theirs = ms[2 * i], ms[2 * i + 1]
        print(f"  {name:40s} evtc {ours:7.3f} ms   cuBLAS GEMM alone {theirs:7.3f} ms   "
              f"ratio {theirs / ours:.3f}")
    for name, k in (("forward gate/up", saving1), ("dZ1", kernel)):
        n_, k_ = (2 * inter, hidden) if k is saving1 else (inter, hidden)
        config, splits = k.launch_for(m, n_, k_)
        print(f"  {name} launch: {config.short_name()}, {splits} split(s)")
    if args.configs:
        time_configs(epilogue, dz2, w2, gate, up, dz1, inter, args.samples)
    if args.forward_configs:
        time_forward_configs(first, x, w1, h, gate, up, args.samples)
    if args.layer_dz:
        time_layer_dz(first, x, w1, gate, up, args.samples, args.layer_dz_configs)
    if args.plain_gemms:
        time_plain_gemms(x, w1, dz1, dz2, h, args.samples)


def identity(acc):
    return acc


def compiled_configs(fn, example: dict, configs: list[dict]):
    """(config, kernel) for each of ``configs`` that ``fn`` compiles with on ``example``; the others
    are printed with the reason."""
    for config in configs:
        try:
            yield config, evtc.compile(fn, example, config=config)
        except evtc.CompileError as exc:
            print(f"  {config}: does not compile ({str(exc).splitlines()[0]})")


def time_layer_dz(first, x, w1, gate, up, samples, configs: bool = False) -> None:
    """The first layer's dZ from an incoming gradient dH in memory, as its backward computes it when
    the layer is seen alone: the elementwise kernel of evtc.dz_pass, the reference (float32 torch
    operations over the joined accumulator), and eager autograd's bf16 SwiGLU backward."""
    from evtc import dz_pass
    from evtc.runtime.op_autograd import epilogue_gradients, joined_accumulator

    dh = torch.randn_like(gate)
    (name,) = first.output_names
    saved = (gate, up)
    passed = dz_pass.gradients(first, x, {}, {name: dh}, saved)
    if passed is None:
        print("  layer dZ: the elementwise kernel does not apply")
        return
    ours = passed[0]

    def reference():
        return epilogue_gradients(first.backward_graph(), x, w1.t(), [], [], {name: dh},
                                  acc=joined_accumulator(saved))[0]

    g_, u_ = gate.detach().requires_grad_(), up.detach().requires_grad_()
    eager_out = torch.nn.functional.silu(g_) * u_

    def eager():
        return torch.cat(torch.autograd.grad(eager_out, [g_, u_], dh, retain_graph=True), dim=-1)

    def kernel():
        return dz_pass.gradients(first, x, {}, {name: dh}, saved)

    want = reference().float()
    print(f"  layer dZ ({tuple(ours.shape)}): the kernel within {rel_err(ours, want):.1e} of the reference "
          f"by norm, eager bf16 within {rel_err(eager(), want):.1e}")
    ms = time_paired([kernel, reference, eager], 3, samples, 1)
    print(f"  layer dZ: kernel {ms[0]:.3f} ms, float32 torch ops {ms[1]:.3f} ms, eager bf16 autograd "
          f"{ms[2]:.3f} ms")
    if configs:
        time_dz_pass_configs(first, dh, gate, up, ours, samples)


DZ_PASS_CONFIGS = [
    {"schedule": "pingpong", "tile_n": 128},
    {"schedule": "pingpong", "tile_n": 128, "cluster": (1, 1)},
    {"schedule": "pingpong", "tile_n": 128, "ab_stages": 2, "load_stages": 4},
    {"schedule": "pingpong", "tile_n": 128, "ab_stages": 2, "load_stages": 4, "cluster": (1, 1)},
    {"schedule": "pingpong", "tile_n": 128, "epi_tile_n": 32},
    {"schedule": "cooperative", "tile_n": 256},
    {"schedule": "cooperative", "tile_n": 128, "cluster": (1, 1)},
    {"schedule": "cooperative", "tile_n": 256, "ab_stages": 2, "load_stages": 4, "cluster": (1, 1)},
]


def time_dz_pass_configs(first, dh, gate, up, want, samples) -> None:
    """The layer-dZ kernel (evtc.dz_pass) compiled with each of DZ_PASS_CONFIGS, its output checked
    against the default kernel's, timed against the default kernel."""
    from evtc import dz_pass

    kernel, epilogue = first._dz_passes[()]
    m, width = gate.shape
    zeros_a = torch.zeros(m, dz_pass.PASS_K, dtype=gate.dtype, device=gate.device)
    zeros_b = torch.zeros(width, dz_pass.PASS_K, dtype=gate.dtype, device=gate.device).t()
    out = torch.empty(m, 2 * width, dtype=gate.dtype, device=gate.device)
    halves = (out[:, :width], out[:, width:])
    meta = {"device": "meta", "dtype": gate.dtype}
    example = {"a": torch.empty(8, dz_pass.PASS_K, **meta),
               "b": torch.empty(width, dz_pass.PASS_K, **meta).t(),
               **{name: torch.empty(8, width, **meta) for name in ("grad", "saved_gate", "saved_up")}}
    default = kernel.launch_for(m, width, dz_pass.PASS_K)[0].short_name()
    fns = [lambda: kernel(zeros_a, zeros_b, grad=dh, saved_gate=gate, saved_up=up, out=halves)]
    names = [f"default ({default})"]
    for config, k in compiled_configs(epilogue.fn, example, DZ_PASS_CONFIGS):
        k(zeros_a, zeros_b, grad=dh, saved_gate=gate, saved_up=up, out=halves)
        print(f"  {config}: {k.launch_for(m, width, dz_pass.PASS_K)[0].short_name()}, "
              f"within {rel_err(out, want.float()):.1e} of the default kernel's dZ")
        fns.append(lambda k=k: k(zeros_a, zeros_b, grad=dh, saved_gate=gate, saved_up=up, out=halves))
        names.append(str(config))
    ms = time_paired(fns, 3, samples, 1)
    moved = 5 * m * width * gate.element_size()  # three tiles in, two out
    for name, t in zip(names, ms, strict=True):
        print(f"  {name:90s} {t:7.3f} ms  {moved / t / 1e9:5.2f} TB/s")


def time_plain_gemms(x, w1, dz1, dz2, h, samples) -> None:
    """The backward's GEMMs that both variants leave to cuBLAS, each as an evtc identity kernel
    compiled for its operands' layouts (A M-major for the weight gradients, B N-major for all
    three), against the same ``torch.matmul``."""
    gemms = {
        "dX1 = dZ1 @ W1": (dz1, w1),
        "dW1 = dZ1^T @ X": (dz1.t(), x),
        "dW2 = dZ2^T @ H": (dz2.t(), h),
    }
    fns, names = [], []
    for name, (a, b) in gemms.items():
        meta = {"a": torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta"),
                "b": torch.empty_strided(b.shape, b.stride(), dtype=b.dtype, device="meta")}
        k = evtc.compile(identity, meta)
        ours = k(a, b)
        err = rel_err(ours, a.float() @ b.float())
        config, splits = k.launch_for(a.shape[0], b.shape[1], a.shape[1])
        print(f"  {name}: {a.shape[0]} x {b.shape[1]} x {a.shape[1]}, launch {config.short_name()}, "
              f"{splits} split(s), error {err:.1e} by norm")
        fns += [lambda k=k, a=a, b=b: k(a, b), lambda a=a, b=b: a @ b]
        names.append(name)
    ms = time_paired(fns, 3, samples, 1)
    for i, name in enumerate(names):
        ours, theirs = ms[2 * i], ms[2 * i + 1]
        print(f"  {name:40s} evtc {ours:7.3f} ms   cuBLAS {theirs:7.3f} ms   ratio {theirs / ours:.3f}")


CONFIGS = [
    {"schedule": "cooperative", "tile_n": 256},
    {"schedule": "cooperative", "tile_n": 128},
    {"schedule": "cooperative", "tile_n": 256, "epi_tile_n": 64},
    {"schedule": "pingpong", "tile_n": 128, "epi_tile_n": 64},
    {"schedule": "pingpong", "tile_n": 128, "cluster": (2, 1)},
    {"schedule": "pingpong", "tile_n": 64},
    {"schedule": "cooperative", "tile_n": 256, "cluster": (2, 1)},
    {"schedule": "cooperative", "tile_n": 256, "cluster": (1, 1)},
    {"schedule": "cooperative", "tile_n": 192},
    {"schedule": "cooperative", "tile_n": 256, "epi_stages": 1},
    {"schedule": "pingpong", "tile_n": 192, "epi_tile_n": 16},
]


FORWARD_CONFIGS = [
    {"schedule": "cooperative", "tile_n": 256},
    {"schedule": "cooperative", "tile_n": 256, "cluster": (2, 1)},
    {"schedule": "cooperative", "tile_n": 256, "cluster": (1, 1)},
    {"schedule": "cooperative", "tile_n": 256, "epi_tile_n": 64},
    {"schedule": "cooperative", "tile_n": 256, "epi_stages": 1},
    {"schedule": "cooperative", "tile_n": 192},
    {"schedule": "cooperative", "tile_n": 128},
    {"schedule": "pingpong", "tile_n": 128},
    {"schedule": "pingpong", "tile_n": 128, "cluster": (2, 1)},
    {"schedule": "pingpong", "tile_n": 192},
]


def time_forward_configs(first, x, w1, h, gate, up, samples) -> None:
    """The forward gate/up kernel (the epilogue's output and the accumulator's halves) compiled with
    each of FORWARD_CONFIGS, its outputs checked against the default kernel's, timed against the bare
    cuBLAS GEMM."""
    from evtc.linear import _with_accumulator

    fn = _with_accumulator(first._fn, True)
    fns, names = [lambda: x @ w1.t()], ["cuBLAS x @ W1^T alone"]
    for config, k in compiled_configs(fn, first._example, FORWARD_CONFIGS):
        got = k(x, w1.t())
        err = max(rel_err(g, want.float()) for g, want in zip(got, (h, gate, up), strict=True))
        launch, splits = k.launch_for(x.shape[0], w1.shape[0], x.shape[1])
        print(f"  {config}: launch {launch.short_name()}, {splits} split(s), outputs within {err:.1e} "
              "of the default kernel's by norm")
        fns.append(lambda k=k: k(x, w1.t()))
        names.append(str(config))
    ms = time_paired(fns, 3, samples, 1)
    for name, t in zip(names, ms, strict=True):
        print(f"  {name:70s} {t:7.3f} ms  ratio {ms[0] / t:.3f}")


def time_configs(epilogue, dz2, w2, gate, up, dz1, inter, samples) -> None:
    """The dZ1 kernel compiled with each of CONFIGS, against the bare cuBLAS GEMM."""
    meta = {"device": "meta", "dtype": dz2.dtype}
    example = {"a": torch.empty(8, dz2.shape[1], **meta), "b": torch.empty(w2.shape, **meta),
               "saved_gate": torch.empty(8, inter, **meta), "saved_up": torch.empty(8, inter, **meta)}
    fns, names = [lambda: dz2 @ w2], ["cuBLAS dZ2 @ W2 alone"]
    out = (dz1[:, :inter], dz1[:, inter:])
    for config, k in compiled_configs(epilogue.fn, example, CONFIGS):
        fns.append(lambda k=k: k(dz2, w2, saved_gate=gate, saved_up=up, out=out))
        names.append(str(config))
    ms = time_paired(fns, 3, samples, 1)
    for name, t in zip(names, ms, strict=True):
        print(f"  {name:70s} {t:7.3f} ms  ratio {ms[0] / t:.3f}")


if __name__ == "__main__":
    main()
