"""``evtc.compile``: an epilogue in, a fused SM90 GEMM kernel you can call, read and trust out.

    k = evtc.compile(fn, example_inputs)
    D = k(a, b, C=C, bias=bias, alpha=0.7)    # what fn(acc, ...) returns, computed in one kernel

Steps: trace and optimize the epilogue (:func:`evtc.trace`), generate the visitor's source
(:mod:`evtc.codegen.emit`), then, unless a cache has it, write the source out, import it and compile
the kernel through the DSL's TVM-FFI calling convention. The result is kept in memory and on disk
(:mod:`evtc.cache`). A compiled kernel serves every problem size and every scalar value.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import sympy
import torch

from .api import OutDtypes, trace
from .cache import DiskCache
from .errors import EpilogueError
from .frontend.epilogue import unwrap
from .frontend.source import definition_location
from .ir.graph import Graph
from .ir.shapes import ONE, L, M, N

COMPILE_OPTIONS = "--enable-tvm-ffi --keep-ptx"
SM90_ARCH = "sm_90a"


class CompileError(EpilogueError):
    """An epilogue or configuration that evtc.compile cannot build (the message says why)."""


class CallError(EpilogueError, ValueError):
    """A call of a compiled kernel with arguments it cannot take (the message names the argument)."""


# ---- versions and keys ---------------------------------------------------------------------------


@functools.cache
def _codegen_digest() -> str:
    """A digest of evtc's code generator and kernel sources: a change to any invalidates caches."""
    here = Path(__file__).parent
    h = hashlib.sha256()
    for path in sorted((here / "codegen").glob("*.py")) + [Path(__file__)]:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


@functools.cache
def _versions() -> dict[str, str]:
    from importlib import metadata

    from . import __version__

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "unknown"

    return {
        "evtc": __version__,
        "codegen": _codegen_digest(),
        "cutlass_dsl": version("nvidia-cutlass-dsl"),
        "tvm_ffi": version("apache-tvm-ffi"),
        "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
    }


# ---- the static signature ------------------------------------------------------------------------


def _dims_of(shape) -> tuple[str, ...]:
    return tuple("1" if d == ONE else str(d) for d in shape)


def _contiguous(spec_dims: tuple[str, ...], t: torch.Tensor) -> int | None:
    strides = t.stride()
    candidates = [i for i, d in enumerate(spec_dims) if d != "1" and strides[i] == 1]
    return candidates[-1] if candidates else None


_VIEW_MODES = {
    "tile": (("M", "N", "L"), ("M", "N")),
    "row": (("N", "L"), ("N",)),
    "col": (("M", "L"), ("M",)),
}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class _Signature:
    """Everything static about one kernel besides the graph: layouts of every tensor argument."""

    def __init__(self, graph: Graph, emitted, example: Mapping[str, Any], fn: Callable[..., Any]):
        from .codegen.launch import TensorSpec

        loc = definition_location(fn)
        a, b = example["a"], example["b"]
        if a.dim() != b.dim():
            raise CompileError(
                f"a is {a.dim()}-d and b is {b.dim()}-d: evtc.compile needs both batched (L, ., .) or "
                "both unbatched; expand the unbatched one (a.expand(L, M, K).contiguous())",
                loc,
            )
        batch = ("L",) if a.dim() == 3 else ()
        if batch and a.shape[0] != b.shape[0]:
            raise CompileError(f"a and b have batch sizes {a.shape[0]} and {b.shape[0]}: they must agree",
                               loc)
        self.batched = graph.batched
        ab = _dtype_name(a.dtype)
        a_dims, b_dims = (*batch, "M", "K"), (*batch, "K", "N")
        self.a = TensorSpec("a", ab, a_dims, _contiguous(a_dims, a))
        self.b = TensorSpec("b", ab, b_dims, _contiguous(b_dims, b))
        if self.a.contiguous is None or self.b.contiguous is None:
            bad = "a" if self.a.contiguous is None else "b"
            raise CompileError(f"{bad} has no unit-stride dim (strides {tuple(example[bad].stride())})", loc)
        self.a_major = "k" if a_dims[self.a.contiguous] == "K" else "m"
        self.b_major = "n" if b_dims[self.b.contiguous] == "N" else "k"
        out_dims = (*batch, "M", "N")
        self.outputs = [TensorSpec(o.name, _dtype_name(o.dtype), out_dims, len(out_dims) - 1)
                        for o in emitted.outputs]
        self.inputs: list = []
        self.views: list = []
        self.tile_majors: dict[str, str] = {}
        for plan in emitted.inputs:
            if plan.kind in ("arg", "literal"):
                self.inputs.append(None)
                self.views.append("arg")
                continue
            operand = graph.operands[plan.name]
            t = example[plan.name]
            dims = _dims_of(operand.shape)
            if plan.kind == "scalar":
                self.inputs.append(TensorSpec(plan.name, _dtype_name(t.dtype), dims, None))
                self.views.append("scalar")
                continue
            contiguous = _contiguous(dims, t)
            spec = TensorSpec(plan.name, _dtype_name(t.dtype), dims, contiguous)
            want = {"row": ("N",), "col": ("M",), "tile": ("M", "N")}[plan.kind]
            if contiguous is None or dims[contiguous] not in want:
                along = " or ".join(want)
                raise CompileError(
                    f"input {plan.name!r} (a {plan.kind} operand of shape {tuple(t.shape)}) must have "
                    f"unit stride along {along}, got strides {tuple(t.stride())}: evtc loads it by TMA",
                    loc,
                )
            if plan.kind == "tile":
                self.tile_majors[plan.name] = "n" if dims[contiguous] == "N" else "m"
            self.inputs.append(spec)
            self.views.append(_VIEW_MODES[plan.kind][0 if operand.batched else 1])

    def describe(self) -> dict:
        return {
            "a": self.a.describe(), "b": self.b.describe(),
            "outputs": [s.describe() for s in self.outputs],
            "inputs": [s.describe() if s is not None else "scalar" for s in self.inputs],
            "views": [list(v) if isinstance(v, tuple) else v for v in self.views],
            "batched": self.batched,
        }


# ---- compile ---------------------------------------------------------------------------------------

_MEMORY: dict[str, Kernel] = {}
_MEMORY_LOCK = threading.Lock()


def compile(  # noqa: A001 - the public name, as torch.compile
    fn: Callable[..., Any],
    example_inputs: Mapping[str, Any],
    *,
    out_dtypes: OutDtypes = None,
    config: Mapping[str, Any] | Any | None = None,
    arch: str | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> Kernel:
    """Compile the epilogue ``fn`` into a fused GEMM kernel: ``D = fn(a @ b, ...)`` in one launch.

    Args:
        fn: the epilogue ``fn(acc, *operands)`` (see docs/epilogues.md).
        example_inputs: ``a``, ``b`` and one entry per operand, as for :func:`evtc.trace`. Only
            dtypes, shapes and memory layouts (which dim is contiguous) matter; sizes do not: the
            kernel serves every M, N, K, L. Meta tensors are fine.
        out_dtypes: as for :func:`evtc.trace`.
        config: knobs of the GEMM (a :class:`evtc.codegen.GemmConfig` or a dict of its fields:
            ``tile_n``, ``epi_tile_n``, ``cluster``, ...). Dtypes and majors come from the examples.
        arch: compile for this GPU architecture (``"sm_90a"``) without a GPU; defaults to the
            ``CUTE_DSL_ARCH`` environment variable or the GPU present.
        cache_dir: the on-disk cache (default ``$EVTC_CACHE_DIR`` or ``~/.cache/evtc``).

    Returns:
        a :class:`Kernel`; ``k.source`` is the generated code, ``k.ptx`` the PTX, ``k.graph`` the IR.

    Raises:
        EpilogueError: a subclass naming the problem (and the epilogue's line when there is one).
    """
    try:
        return _compile(fn, example_inputs, out_dtypes, config, arch, cache_dir)
    except EpilogueError as err:
        raise err.with_traceback(None) from None


def _compile(fn, example_inputs, out_dtypes, config, arch, cache_dir) -> Kernel:
    from .codegen.config import ConfigError, GemmConfig
    from .codegen.emit import emit

    user_fn = unwrap(fn)
    graph = trace(fn, example_inputs, out_dtypes=out_dtypes)
    loc = definition_location(user_fn)
    emitted = emit(graph)
    signature = _Signature(graph, emitted, example_inputs, user_fn)
    if signature.tile_majors:
        emitted = emit(graph, tile_majors=signature.tile_majors)

    knobs: dict[str, Any]
    if config is None:
        knobs = {}
    elif isinstance(config, GemmConfig):
        knobs = {k: getattr(config, k) for k in GemmConfig.__dataclass_fields__}
    else:
        knobs = dict(config)
    d_dtype = _dtype_name(emitted.outputs[0].dtype)
    knobs.update(ab_dtype=signature.a.dtype, d_dtype=d_dtype, a_major=signature.a_major,
                 b_major=signature.b_major, d_major="n")
    if len(emitted.outputs) > 1 and knobs.get("epi_stages") is None:
        # Extra outputs are staged like D, one buffer per D stage: fix the count so both agree.
        knobs["epi_stages"] = 2
    try:
        cfg = GemmConfig(**knobs).validate()
        cfg = _plan_epilogue_loads(cfg, emitted, signature, knobs)
    except (ConfigError, TypeError) as exc:
        raise CompileError(f"configuration: {exc}", loc) from None

    arch = arch or os.environ.get("CUTE_DSL_ARCH") or None
    meta = {
        "versions": _versions(),
        "config": repr(cfg),
        "signature": signature.describe(),
        "arch": arch or "device",
    }
    key_text = json.dumps({"source": emitted.source, **meta}, sort_keys=True)
    key = hashlib.sha256(key_text.encode()).hexdigest()

    with _MEMORY_LOCK:
        hit = _MEMORY.get(key)
    if hit is not None:
        return hit
    cache = DiskCache(cache_dir)
    with cache.lock(key):
        with _MEMORY_LOCK:
            hit = _MEMORY.get(key)
        if hit is not None:
            return hit
        kernel = Kernel(graph, emitted, signature, cfg, key, cache, arch)
        kernel._materialize(meta)
        with _MEMORY_LOCK:
            _MEMORY[key] = kernel
    return kernel


def _visitor_smem(emitted, signature, cfg, load_stages: int) -> int:
    from .codegen.emit import operand_objects

    inputs, outputs = operand_objects(emitted, signature.tile_majors, signature.batched)
    stores = (cfg.epi_stages if cfg.epi_stages is not None else 2) * cfg.epi_groups
    # Pingpong: each consumer warpgroup has its own ring of ``load_stages`` epilogue-load buffers.
    buffers = load_stages * cfg.epi_groups
    return sum(o.smem_bytes(cfg.tile_shape_mnk[:2], cfg.epi_tile, buffers, stores)
               for o in inputs + outputs[1:])


def _plan_epilogue_loads(cfg, emitted, signature, knobs: dict[str, Any]):
    """Stage the epilogue's loads for a whole tile where shared memory allows.

    At small K the epilogue's memory traffic is what a fused epilogue costs; loads staged for the
    whole tile land while the mainloop runs. The A/B pipeline may go down to OVERLAP_AB_STAGES for
    it (measured to cost nothing on the H100). Where a whole tile of 128x32 subtiles does not fit
    (16-bit C: 64 KiB plus D staging), 128x16 subtiles are tried unless the user chose
    `epi_tile_n`. Otherwise the deepest staging that keeps that many A/B stages wins, and failing
    that the old rule: at least 2 stages, as deep as costs no A/B stage.
    """
    from .codegen.config import OVERLAP_AB_STAGES, ConfigError

    if "load_stages" in knobs or not any(p.kind in ("tile", "row", "col") for p in emitted.inputs):
        return cfg
    candidates = [cfg] if "epi_tile_n" in knobs else [cfg, cfg.replace(epi_tile_n=16)]
    best = None
    for cand in candidates:
        for depth in range(cand.num_subtiles, 1, -1):
            planned = cand.replace(load_stages=depth)
            try:
                ab = planned.plan_stages(_visitor_smem(emitted, signature, planned, depth))[0]
            except ConfigError:
                continue
            if ab >= OVERLAP_AB_STAGES:
                covered = depth / cand.num_subtiles
                if best is None or covered > best[0]:
                    best = (covered, planned)
                break
        if best is not None and best[0] == 1:
            break
    if best is not None:
        return best[1]
    depth = cfg.c_stages
    floor = min(2, depth)
    ab_at_floor = cfg.plan_stages(_visitor_smem(emitted, signature, cfg, floor))[0]
    while depth > floor and cfg.plan_stages(_visitor_smem(emitted, signature, cfg, depth))[0] < ab_at_floor:
        depth -= 1
    return cfg.replace(load_stages=depth) if depth != cfg.c_stages else cfg


def clear_memory_cache() -> None:
    """Forget the kernels compiled in this process (the disk cache stays)."""
    with _MEMORY_LOCK:
        _MEMORY.clear()


# ---- the kernel ------------------------------------------------------------------------------------


@functools.cache
def _gpu_ok() -> str | None:
    """None when a Hopper GPU can run the kernel, else why not."""
    if not torch.cuda.is_available():
        return "this machine has no CUDA GPU"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return f"the GPU is sm_{major}{minor}; the kernel needs an SM90 (Hopper) GPU"
    return None


class Kernel:
    """A compiled fused GEMM + epilogue. Call it like the epilogue's math:
    ``k(a, b, **operands, out=None)`` returns what the epilogue returns."""

    def __init__(self, graph: Graph, emitted, signature: _Signature, config, key: str, cache: DiskCache,
                 arch: str | None):
        self.graph = graph
        self.source: str = emitted.source
        self.config = config
        self.key = key
        self._emitted = emitted
        self._signature = signature
        self._cache = cache
        self._arch = arch
        self._fn = None
        self._ptx: str | None = None
        self.cache_path: Path | None = None
        #: How this kernel was obtained: "compiled" or "disk" (and the seconds it took).
        self.origin = ""
        self.seconds = 0.0
        self._plan = None
        self._visitor = None
        self._stages: dict[str, int] = {}
        self._smem: dict[str, int] = {}
        self._call_setup()

    # ---- build or load -------------------------------------------------------------------------
    @property
    def function_name(self) -> str:
        return f"evtc_{self.key[:24]}"

    def _materialize(self, meta: dict) -> None:
        t0 = time.perf_counter()
        entry = self._cache.load(self.key)
        if entry is not None:
            try:
                self._load(entry)
                self.origin = "disk"
                self.seconds = time.perf_counter() - t0
                return
            except Exception:  # noqa: BLE001 - an entry that does not load is rebuilt
                self._cache.discard(self.key)
        self._build(meta)
        self.origin = "compiled"
        self.seconds = time.perf_counter() - t0

    def _load(self, entry: dict) -> None:
        import cutlass.cute as cute

        path = Path(entry["dir"])
        module = cute.runtime.load_module(str(path / "kernel.o"), enable_tvm_ffi=True)
        self._fn = getattr(module, entry["function"])
        self._module = module
        self._ptx = (path / "kernel.ptx").read_text()
        self._stages = dict(entry.get("stages", {}))
        self._smem = dict(entry.get("smem", {}))
        self.cache_path = path

    def _import_visitor(self, path: Path):
        name = f"evtc_generated_{self.key[:16]}"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return getattr(module, self._emitted.class_name)()

    def _build(self, meta: dict) -> None:
        import cutlass
        import cutlass.cute as cute
        from cutlass.runtime import make_fake_stream

        from .codegen.gemm_sm90 import Sm90GemmKernel
        from .codegen.launch import Launcher, Symbols, fake_tensor

        staged = self._cache.staging()
        try:
            source_path = staged / "epilogue.py"
            source_path.write_text(self.source)
            visitor = self._import_visitor(source_path)
            kernel = Sm90GemmKernel(self.config, visitor)
            sig = self._signature
            launcher = Launcher(kernel, sig.a, sig.b, sig.outputs, sig.inputs, sig.views, sig.batched)
            symbols = Symbols()
            fake_outs = tuple(fake_tensor(s, symbols) for s in sig.outputs)
            fake_ins = tuple(
                cutlass.Float32(1.0) if s is None else fake_tensor(s, symbols) for s in sig.inputs
            )
            options = f"{COMPILE_OPTIONS} --dump-dir={staged}"  # PTX dumps stay in the entry
            if self._arch:
                options += f" --gpu-arch {self._arch}"
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*cannot be converted to a JitArgument.*")
                compiled = cute.compile(
                    launcher, fake_tensor(sig.a, symbols), fake_tensor(sig.b, symbols), fake_outs,
                    fake_ins, cutlass.Int32(1), make_fake_stream(use_tvm_ffi_env_stream=True),
                    options=options,
                )
            self._ptx = compiled.__ptx__
            (staged / "kernel.ptx").write_text(self._ptx or "")
            compiled.export_to_c(str(staged / "kernel.o"), function_name=self.function_name)
            self._stages = {"ab": kernel.ab_stages, "d": kernel.d_stages, "load": kernel.load_stages}
            self._smem = {"visitor": visitor.smem_bytes(self.config, kernel.load_buffers),
                          "load_bytes_per_subtile": kernel.load_bytes}
            entry = self._cache.commit(
                self.key, staged, ["epilogue.py", "kernel.ptx", "kernel.o"],
                {**meta, "function": self.function_name, "stages": self._stages, "smem": self._smem},
            )
            self.cache_path = entry
            self._fn = compiled
            self._visitor = visitor
        finally:
            if staged.exists():
                shutil.rmtree(staged, ignore_errors=True)

    # ---- reading ---------------------------------------------------------------------------------
    @property
    def ptx(self) -> str:
        return self._ptx or ""

    def explain(self) -> str:
        """A summary: operands and their kinds, outputs, tile configuration, stages, shared memory,
        registers (from ptxas, when it is installed)."""
        from .codegen.config import SM90_SMEM_BYTES

        cfg = self.config
        lines = [f"evtc kernel {self.graph.name!r} ({self.origin}, {self.seconds:.2f} s)"]
        lines.append(f"  GEMM: {cfg.short_name()}; a {self._signature.a.describe()}, "
                     f"b {self._signature.b.describe()}")
        lines.append("  inputs:")
        for plan, spec in zip(self._emitted.inputs, self._signature.inputs, strict=True):
            if plan.kind == "arg":
                lines.append(f"    {plan.name}: runtime float32 scalar (kernel argument)")
            elif plan.kind == "literal":
                lines.append(f"    {plan.ident} = {plan.name}: computed from the sizes at each call")
            else:
                how = {"tile": "TMA, staged per subtile", "row": "TMA, epi_n values per subtile",
                       "col": "TMA, 128 values per subtile", "scalar": "one load per tile"}[plan.kind]
                batch = "per batch" if plan.batched else "shared by all batches"
                lines.append(f"    {spec.describe()}: {plan.kind}, {batch}; {how}")
        lines.append("  outputs:")
        for i, spec in enumerate(self._signature.outputs):
            role = "kernel D store (stmatrix + TMA)" if i == 0 else "extra TMA store"
            lines.append(f"    {spec.describe()}: {role}")
        if self._stages:
            lines.append(f"  stages: A/B {self._stages['ab']}, D {self._stages['d']}, "
                         f"epilogue loads {self._stages['load']}")
        if self._smem:
            lines.append(f"  shared memory: epilogue operands {self._smem['visitor']} B, epilogue loads "
                         f"{self._smem['load_bytes_per_subtile']} B per subtile (of {SM90_SMEM_BYTES} B)")
        lines.append(f"  registers: {self._registers()}")
        lines.append(f"  cache: {self.cache_path}")
        return "\n".join(lines)

    def _registers(self) -> str:
        ptxas = shutil.which("ptxas")
        if ptxas is None or not self.ptx:
            return "unknown (ptxas not installed); producer 40 / consumers 232 by setmaxnreg"
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "k.ptx"
            src.write_text(self.ptx)
            try:
                cmd = [ptxas, "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")]
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            except (OSError, subprocess.TimeoutExpired) as exc:
                return f"unknown (ptxas failed: {exc})"
        report = " ".join(line.split("info    : ")[-1] for line in out.stderr.splitlines()
                          if "registers" in line or "spill" in line)
        return (report or out.stderr.strip() or "unknown") + "; producer 40 / consumers 232 by setmaxnreg"

    def __repr__(self) -> str:
        return f"<evtc.Kernel {self.graph.name} {self.config.short_name()}>"

    # ---- calling ---------------------------------------------------------------------------------
    def _call_setup(self) -> None:
        graph, emitted = self.graph, self._emitted
        self._names = [p.name for p in emitted.inputs if p.kind != "literal"]
        self._name_set = frozenset(self._names)
        getters: list = []
        for p in emitted.inputs:
            if p.kind == "literal":
                fn = sympy.lambdify((L, M, N), p.expr, "math")
                getters.append(("literal", fn))
            elif p.kind == "arg":
                getters.append(("arg", p.name))
            else:
                getters.append(("tensor", p.name))
        self._getters = getters
        self._out_dtypes = [getattr(torch, s.dtype) for s in self._signature.outputs]
        # outputs in kernel order -> position in the returned structure
        self._kernel_order = [o.name for o in emitted.outputs]
        self._tree = graph.outputs

    def __call__(self, a, b, *, out=None, **operands):
        """``D = k(a, b, C=C, alpha=0.7, ...)``: the epilogue of ``a @ b``, launched on the current CUDA
        stream. ``out`` (the same structure as the result) receives the outputs instead of new tensors."""
        try:
            return self._call(a, b, out, operands)
        except EpilogueError as err:
            raise err.with_traceback(None) from None

    def _call(self, a, b, out, operands):
        reason = _gpu_ok()
        if reason is not None:
            # Say what is wrong with the arguments first; devices cannot be right without a GPU.
            self._validate(a, b, out, operands, check_devices=False)
            raise CallError(f"cannot run {self.graph.name!r}: {reason}. It was compiled (k.source, "
                            "k.ptx and k.graph are available), but running it needs an SM90 GPU")
        try:
            m = a.shape[-2]
            n = b.shape[-1]
            batches = a.shape[0] if a.dim() == 3 else 1
            k = a.shape[-1]
        except (AttributeError, IndexError, TypeError):
            self._validate(a, b, out, operands)
            raise
        ins = []
        try:
            for kind, what in self._getters:
                if kind == "tensor":
                    ins.append(operands[what])
                elif kind == "arg":
                    ins.append(float(operands[what]))
                else:
                    ins.append(float(what(batches, m, n)))
        except (KeyError, TypeError, ValueError):
            self._validate(a, b, out, operands)
            raise
        if len(operands) != len(self._names):
            self._validate(a, b, out, operands)
        outs = self._outputs(a, out, m, n, batches)
        if m == 0 or n == 0 or batches == 0:
            return self._tree.build(dict(zip(self._kernel_order, outs, strict=True)))
        if k == 0:
            raise CallError("K = 0 is not supported (the accumulator would be all zeros; compute the "
                            "epilogue of zeros with torch instead)")
        from .codegen.runtime import max_active_clusters

        clusters = max_active_clusters(self.config.cluster[0] * self.config.cluster[1])
        try:
            self._fn(a, b, tuple(outs), tuple(ins), clusters)
        except (ValueError, TypeError, RuntimeError) as exc:
            self._validate(a, b, out, operands)
            raise CallError(f"the kernel rejected its arguments: {exc}") from None
        return self._tree.build(dict(zip(self._kernel_order, outs, strict=True)))

    def _outputs(self, a, out, m, n, batches):
        shape = (batches, m, n) if self._signature.batched else (m, n)
        if out is None:
            return [torch.empty(shape, dtype=dt, device=a.device) for dt in self._out_dtypes]
        given = _flatten_outputs(out, self._tree)
        if given is None:
            raise CallError(f"out= must have the structure the epilogue returns ({self._describe_tree()})")
        tensors = []
        for name, spec, dt in zip(self._kernel_order, self._signature.outputs, self._out_dtypes, strict=True):
            t = given[name]
            _check_tensor(f"out[{name!r}]" if self._tree.kind != "single" else "out", t, spec, dt,
                          {"L": batches, "M": m, "N": n})
            tensors.append(t)
        return tensors

    def _describe_tree(self) -> str:
        if self._tree.kind == "single":
            return "one tensor"
        if self._tree.kind == "tuple":
            return f"a tuple of {len(self._tree.names)} tensors"
        return f"a dict with keys {self._tree.keys}"

    def _validate(self, a, b, out, operands, check_devices: bool = True) -> None:
        """Raise a CallError naming what is wrong with the arguments (the slow path of a call)."""
        sig = self._signature
        for name, t in (("a", a), ("b", b)):
            if not isinstance(t, torch.Tensor):
                raise CallError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if a.dim() != len(sig.a.dims) or b.dim() != len(sig.b.dims):
            want = "3-d (L, M, K) and (L, K, N)" if sig.batched else "2-d (M, K) and (K, N)"
            raise CallError(f"a and b must be {want} as when compiled; got shapes {tuple(a.shape)} and "
                            f"{tuple(b.shape)}")
        unknown = sorted(set(operands) - self._name_set)
        if unknown:
            raise CallError(f"unexpected argument(s) {unknown}; the epilogue takes "
                            f"{self._names or 'no operands'}")
        missing = [nm for nm in self._names if nm not in operands]
        if missing:
            raise CallError(f"missing argument(s) {missing}; the epilogue takes {self._names}")
        sizes = {"M": a.shape[-2], "K": a.shape[-1], "N": b.shape[-1],
                 "L": a.shape[0] if a.dim() == 3 else 1}
        if b.shape[-2] != sizes["K"]:
            raise CallError(f"a @ b: a is {tuple(a.shape)} and b is {tuple(b.shape)}; K differs")
        if sig.batched and b.shape[0] != sizes["L"]:
            raise CallError(f"a and b have batch sizes {a.shape[0]} and {b.shape[0]}")
        device = a.device
        _check_tensor("a", a, sig.a, getattr(torch, sig.a.dtype), sizes)
        _check_tensor("b", b, sig.b, getattr(torch, sig.b.dtype), sizes)
        for plan, spec in zip(self._emitted.inputs, sig.inputs, strict=True):
            if plan.kind == "literal":
                continue
            value = operands[plan.name]
            if plan.kind == "arg":
                if isinstance(value, torch.Tensor) or not isinstance(value, int | float):
                    raise CallError(f"{plan.name} is a runtime scalar: pass a Python float or int, got "
                                    f"{type(value).__name__}")
                continue
            _check_tensor(plan.name, value, spec, getattr(torch, spec.dtype), sizes)
        outs = self._outputs(a, out, sizes["M"], sizes["N"], sizes["L"]) if out is not None else []
        # Devices last: on a machine without a GPU the other checks still run on CPU tensors.
        tensors = [("a", a), ("b", b)] + [(p.name, operands[p.name]) for p in self._emitted.inputs
                                          if p.kind not in ("arg", "literal")]
        tensors += [(f"out[{i}]", t) for i, t in enumerate(outs)]
        for name, t in tensors if check_devices else ():
            _check_device(name, t, device)


def _flatten_outputs(out, tree) -> dict | None:
    if tree.kind == "single":
        return {tree.names[0]: out} if isinstance(out, torch.Tensor) else None
    if tree.kind == "tuple":
        if not isinstance(out, tuple | list) or len(out) != len(tree.names):
            return None
        return dict(zip(tree.names, out, strict=True))
    if not isinstance(out, Mapping) or set(out) != set(tree.keys or ()):
        return None
    return {n: out[k] for k, n in zip(tree.keys or (), tree.names, strict=True)}


def _check_tensor(name: str, t, spec, dtype: torch.dtype, sizes: dict) -> None:
    """Raise a CallError unless ``t`` fits ``spec`` (checks the kernel also makes, with messages)."""
    if not isinstance(t, torch.Tensor):
        raise CallError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != spec.rank:
        raise CallError(f"{name} must be {spec.rank}-d like its example ({', '.join(spec.dims)}), got shape "
                        f"{tuple(t.shape)}")
    if t.dtype != dtype:
        raise CallError(f"{name} must be {dtype} (as compiled), got {t.dtype}")
    want = tuple(1 if d == "1" else sizes[d] for d in spec.dims)
    if tuple(t.shape) != want:
        dims = ", ".join(spec.dims)
        raise CallError(f"{name} has shape {tuple(t.shape)}, inconsistent with a and b: expected ({dims}) = "
                        f"{want}")
    if spec.contiguous is not None:
        strides = t.stride()
        c = spec.contiguous
        if strides[c] != 1 and t.shape[c] > 1:
            raise CallError(f"{name} must be contiguous along {spec.dims[c]} (stride 1, as compiled), got "
                            f"strides {strides}")
        align = spec.align_elems()
        for i, d in enumerate(spec.dims):
            if i != c and d != "1" and t.shape[i] > 1 and strides[i] % align:
                raise CallError(
                    f"{name} has strides {strides}: stride {i} must be a multiple of {align} elements "
                    f"(16 bytes, TMA's rule); make it contiguous or pad the rows"
                )
        if t.data_ptr() % 16:
            raise CallError(f"{name}'s data pointer is not 16-byte aligned (TMA needs 16 bytes; a view "
                            f"offset by {t.storage_offset()} elements); pass a copy (.clone())")


def _check_device(name: str, t, device) -> None:
    if t.device.type != "cuda":
        raise CallError(f"{name} is on {t.device}; the kernel needs CUDA tensors")
    if t.device != device:
        raise CallError(f"{name} is on {t.device} but a is on {device}: all tensors must share a device")


__all__ = ["CallError", "CompileError", "Kernel", "clear_memory_cache", "compile"]

