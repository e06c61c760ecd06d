"""``python -m evtc``: the demo, a look at a user's epilogue, and the disk cache.

    python -m evtc demo [--shape 4096x4096x1024] [--picture demo.svg]
    python -m evtc show path/to/file.py:function [--shape MxNxK] [--kind bias=row] [--picture g.svg]
    python -m evtc cache list | clear [--dir DIR]

Without a GPU, kernels are compiled for sm_90a (source, graph and PTX) and the demo checks the
reference path on the CPU instead of running the kernel.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import evtc
from evtc.errors import EpilogueError
from evtc.ir.dtypes import MASK_D_NOTE
from evtc.plan.operand_kinds import KINDS as OPERAND_KINDS
from evtc.runtime.cache import DiskCache

DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}
# --kind names: an operand kind, or "scalar" for a Python number ("device_scalar" is the IR's
# "scalar": a one-element tensor).
CLI_KINDS = ("tile", "row", "col", "scalar", "device_scalar")


def _has_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _arch() -> str | None:
    """None with a Hopper GPU (compile for it), else sm_90a (compile without running)."""
    return None if _has_gpu() else "sm_90a"


def _parse_shape(text: str) -> tuple[int, int, int]:
    try:
        m, n, k = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--shape must look like 4096x4096x1024, got {text!r}") from None
    if min(m, n, k) < 1:
        raise SystemExit(f"--shape needs sizes of at least 1, got {text!r}")
    return m, n, k


def _check_picture(path: str | None) -> None:
    """Refuse a --picture path before the compile that precedes it: a format the renderer does not
    write, or a folder that does not exist."""
    if path is None:
        return
    target = Path(path)
    if target.suffix.lower() not in (".svg", ".png", ".dot"):
        raise SystemExit(f"--picture must end in .svg, .png or .dot, got {path!r}")
    if not target.parent.is_dir():
        raise SystemExit(f"--picture: the folder {str(target.parent)!r} does not exist")


# ---- PTX statistics -----------------------------------------------------------------------------

PTX_COUNTS = {
    "wgmma.mma_async": r"wgmma\.mma_async",
    "TMA loads": r"cp\.async\.bulk\.tensor\.\dd\.shared::\w+\.global",
    "TMA stores": r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta",
    "stmatrix": r"\bstmatrix\.",
    "ldmatrix": r"\bldmatrix\.",
    "setmaxnreg": r"setmaxnreg\.",
}


def ptx_statistics(ptx: str) -> str:
    counts = ", ".join(f"{name} {len(re.findall(rx, ptx))}" for name, rx in PTX_COUNTS.items())
    return f"PTX: {len(ptx.splitlines())} lines; {counts}"


def _print_kernel(k: evtc.Kernel, picture: str | None) -> None:
    print("# the optimized graph\n" + str(k.graph) + "\n")
    print("# the generated epilogue source (what was compiled)\n" + k.source)
    print("# the kernel\n" + k.explain())
    print(ptx_statistics(k.ptx))
    if picture:
        print(f"picture of the graph: {k.graph.render(picture)}")


# ---- demo ----------------------------------------------------------------------------------------


@evtc.epilogue
def bias_gelu_residual(acc, bias, residual, alpha: float):
    """The demo's epilogue: a scaled GEMM, a bias, GELU, a residual; y is a second output."""
    y = F.gelu(alpha * acc + bias)
    return y + residual, y


def _demo_inputs(m: int, n: int, k: int, device: str, dtype: torch.dtype) -> dict[str, Any]:
    g = None if device == "meta" else torch.Generator(device=device).manual_seed(0)
    scale = k ** -0.25  # keeps acc near unit size

    def randn(*shape, dt=dtype):
        if device == "meta":
            return torch.empty(shape, dtype=dt, device="meta")
        return (torch.randn(shape, device=device, generator=g) * scale).to(dt)

    # A bias of a's dtype, as a model's layer has (a float32 one would make the outputs float32,
    # as torch promotes them).
    return dict(a=randn(m, k), b=randn(k, n), bias=randn(n), residual=randn(m, n), alpha=0.5)


def demo(args: argparse.Namespace) -> int:
    m, n, k = _parse_shape(args.shape)
    _check_picture(args.picture)
    dtype = DTYPES[args.dtype]
    gpu = _has_gpu()
    print(f"evtc {evtc.__version__} demo: D, y = bias_gelu_residual(a @ b, bias, residual, alpha) at "
          f"{m}x{n}x{k}, {args.dtype}; {'GPU: ' + torch.cuda.get_device_name() if gpu else 'no SM90 GPU: '}"
          f"{'' if gpu else 'compiling for sm_90a and checking the reference on the CPU'}\n")
    print(inspect.getsource(bias_gelu_residual.fn))
    t0 = time.perf_counter()
    meta = _demo_inputs(256, 512, 128, "meta", dtype) if not gpu else None
    kernel = evtc.compile(bias_gelu_residual, meta or _demo_inputs(256, 512, 128, "cuda", dtype),
                          arch=_arch(), cache_dir=args.cache_dir)
    print(f"compiled in {time.perf_counter() - t0:.2f} s ({kernel.origin})\n")
    _print_kernel(kernel, args.picture)
    if not gpu:
        return _demo_reference_on_cpu(m, n, k, dtype)
    return _demo_on_gpu(kernel, m, n, k, dtype)


def _demo_reference_on_cpu(m: int, n: int, k: int, dtype: torch.dtype) -> int:
    """evtc.reference (the graph evaluated in float32) against the function on float64 tensors."""
    m, n, k = min(m, 256), min(n, 256), min(k, 128)
    x = _demo_inputs(m, n, k, "cpu", dtype)
    ref_d, ref_y = evtc.reference(bias_gelu_residual, x)
    acc = x["a"].double() @ x["b"].double()
    want_d, want_y = bias_gelu_residual(acc, x["bias"].double(), x["residual"].double(), x["alpha"])
    err = max(_rel_err(ref_d, want_d), _rel_err(ref_y, want_y))
    ok = err <= 1e-5
    print(f"\nreference check on the CPU at {m}x{n}x{k}: relative error {err:.1e} against float64 "
          f"({'ok' if ok else 'FAILED'}). Running the kernel needs an SM90 GPU.")
    return 0 if ok else 1


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def _demo_on_gpu(kernel: evtc.Kernel, m: int, n: int, k: int, dtype: torch.dtype) -> int:
    from evtc.timing import time_paired

    x = _demo_inputs(m, n, k, "cuda", dtype)
    a, b, alpha = x["a"], x["b"], x["alpha"]
    ops = dict(bias=x["bias"], residual=x["residual"], alpha=alpha)
    d, y = kernel(a, b, **ops)
    ref_d, ref_y = evtc.reference(bias_gelu_residual, x)
    err = max(_rel_err(d, ref_d), _rel_err(y, ref_y))
    ok = err <= 1e-2
    print(f"\nresult against evtc.reference (float32): relative error {err:.1e} ({'ok' if ok else 'FAILED'})")
    out = (torch.empty_like(d), torch.empty_like(y))

    def eager():
        return bias_gelu_residual(a @ b, x["bias"], x["residual"], alpha)

    t_cublas, t_evtc, t_eager = time_paired(
        [lambda: torch.matmul(a, b), lambda: kernel(a, b, out=out, **ops), eager],
        warmup=10, samples=15, reps=10)
    print(f"time per call (CUDA events, medians): cuBLAS GEMM alone {t_cublas:.3f} ms, evtc fused "
          f"{t_evtc:.3f} ms ({t_evtc / t_cublas:.2f}x the GEMM), eager PyTorch {t_eager:.3f} ms "
          f"({t_eager / t_evtc:.2f}x slower than evtc)")
    return 0 if ok else 1


# ---- show ----------------------------------------------------------------------------------------


def _load_function(target: str) -> Callable[..., Any]:
    path_text, sep, name = target.rpartition(":")
    if not sep or not path_text or not name:
        raise SystemExit(f"show needs path/to/file.py:function, got {target!r}")
    path = Path(path_text)
    if not path.is_file():
        raise SystemExit(f"show: no such file: {path}")
    spec = importlib.util.spec_from_file_location(f"evtc_show_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent.resolve()))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        raise SystemExit(f"show: {path} has no function {name!r}")
    inputs = getattr(module, f"{name}_inputs", None)
    if inputs is not None:
        fn.__dict__["_evtc_show_inputs"] = inputs
    return fn


def example_inputs(fn: Callable[..., Any], m: int, n: int, k: int, dtype: torch.dtype,
                   kinds: dict[str, str]) -> dict[str, Any]:
    """Meta example inputs from the signature: parameters annotated ``float``/``int`` (or with a
    number as default) are scalars, others are (M, N) tiles unless ``kinds`` says row, col or
    device_scalar."""
    params = list(inspect.signature(evtc.frontend.epilogue.unwrap(fn)).parameters.values())[1:]
    known = {p.name for p in params}
    unknown = sorted(set(kinds) - known)
    if unknown:
        raise SystemExit(f"--kind names {unknown}, which the epilogue does not take ({sorted(known)})")
    ex: dict[str, Any] = {"a": torch.empty(m, k, dtype=dtype, device="meta"),
                          "b": torch.empty(k, n, dtype=dtype, device="meta")}
    for p in params:
        kind = kinds.get(p.name)
        if kind is None:
            numeric = p.annotation in (float, int, "float", "int") or isinstance(p.default, int | float)
            kind = "scalar" if numeric else "tile"
        if kind == "scalar":
            ex[p.name] = p.default if isinstance(p.default, int | float) else 1.0
        else:
            shape = OPERAND_KINDS["scalar" if kind == "device_scalar" else kind].example_shape(m, n)
            ex[p.name] = torch.empty(shape, dtype=dtype if kind == "tile" else torch.float32, device="meta")
    return ex


def _parse_kinds(items: Sequence[str]) -> dict[str, str]:
    kinds = {}
    for item in items:
        name, sep, kind = item.partition("=")
        if not sep or kind not in CLI_KINDS:
            raise SystemExit(f"--kind takes NAME=KIND with KIND one of {CLI_KINDS}, got {item!r}")
        kinds[name] = kind
    return kinds


def show(args: argparse.Namespace) -> int:
    fn = _load_function(args.target)
    m, n, k = _parse_shape(args.shape)
    provided = getattr(fn, "__dict__", {}).get("_evtc_show_inputs")
    _check_picture(args.picture)
    if provided is not None and not args.kind:
        ex = provided() if callable(provided) else provided
        source = f"{args.target.rpartition(':')[2]}_inputs"
        if not isinstance(ex, Mapping):
            raise SystemExit(f"{source} must be a dict of example inputs (or a function returning one), "
                             f"got {type(ex).__name__}")
        ex = dict(ex)
    else:
        ex = example_inputs(fn, m, n, k, DTYPES[args.dtype], _parse_kinds(args.kind))
        source = "the signature (" + ", ".join(
            f"{nm}: {'scalar' if not isinstance(v, torch.Tensor) else tuple(v.shape)}"
            for nm, v in ex.items() if nm not in ("a", "b")) + ")"
    print(f"example inputs from {source}\n")
    kernel = evtc.compile(fn, ex, arch=_arch(), cache_dir=args.cache_dir)
    _print_kernel(kernel, args.picture)
    return 0


# ---- cache ---------------------------------------------------------------------------------------


def _mask_d(entry: dict) -> bool:
    """Whether a cache entry's kernel stores a mask as its D (its configuration names the float8
    storage of the mask's bytes), read from the plan in its manifest; False where that is unreadable."""
    try:
        outputs = json.loads(entry["plan"])["plan"]["outputs"]
        return bool(outputs) and outputs[0]["dtype"] == "bool"
    except (KeyError, TypeError, ValueError, IndexError):
        return False


def cache(args: argparse.Namespace) -> int:
    disk = DiskCache(args.cache_dir)
    if args.action == "clear":
        removed = disk.clear()
        print(f"removed {removed} kernel(s) from {disk.root}")
        return 0
    entries = disk.entries()
    total = sum(e["bytes"] for e in entries)
    print(f"{disk.root}: {len(entries)} kernel(s), {total / 1e6:.1f} MB")
    for e in entries:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(e["mtime"]))
        config = re.sub(r"^GemmConfig\(|\)$", "", e.get("config", ""))
        if _mask_d(e):
            config += f" ({MASK_D_NOTE})"
        print(f"  {e['key'][:16]}  {when}  {e['bytes'] / 1e6:5.1f} MB  {e.get('epilogue', '?'):<24} "
              f"{e.get('arch', '')}  {config}")
    return 0


# ---- entry point -----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m evtc", description=__doc__.split("\n")[0])
    parser.add_argument("--cache-dir", default=None, help="the disk cache (default: $EVTC_CACHE_DIR or "
                        "~/.cache/evtc)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="compile and run a typical epilogue end to end")
    p.add_argument("--shape", default="4096x4096x1024", help="MxNxK of the timed run")
    p.add_argument("--dtype", default="f16", choices=list(DTYPES))
    p.add_argument("--picture", default=None, help="write a picture of the graph (.svg, .png, .dot)")
    p.set_defaults(run=demo)

    p = sub.add_parser("show", help="the graph, the generated source and PTX statistics of an epilogue")
    p.add_argument("target", help="path/to/file.py:function")
    p.add_argument("--shape", default="256x512x128", help="MxNxK of the example inputs")
    p.add_argument("--dtype", default="f16", choices=list(DTYPES))
    p.add_argument("--kind", action="append", default=[],
                   help=f"NAME=KIND for an operand, KIND one of {CLI_KINDS} (default: tile, or scalar for "
                        "float/int parameters); without --kind, a module-level <function>_inputs dict "
                        "(or function returning one) is used when present")
    p.add_argument("--picture", default=None, help="write a picture of the graph (.svg, .png, .dot)")
    p.set_defaults(run=show)

    p = sub.add_parser("cache", help="list or clear the disk cache")
    p.add_argument("action", choices=["list", "clear"])
    p.set_defaults(run=cache)
    for command in sub.choices.values():
        # Also after the command (`cache list --cache-dir X`); unset there, the option before it holds.
        command.add_argument("--cache-dir", default=argparse.SUPPRESS, help="the disk cache, as above")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except EpilogueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
