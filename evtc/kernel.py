"""A compiled fused GEMM + epilogue: built or loaded from the disk cache, read, and called."""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib.util
import logging
import shutil
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sympy
import torch

from .cache import DiskCache
from .call_checks import check_device, check_tensor, flatten_outputs
from .errors import CallError, EpilogueError
from .ir.dtypes import OPERAND_DTYPES
from .ir.graph import Graph
from .ir.shapes import L, M, N
from .signature import KernelSignature, kernel_arguments

COMPILE_OPTIONS = "--enable-tvm-ffi --keep-ptx"

log = logging.getLogger("evtc")


@functools.cache
def _gpu_ok() -> str | None:
    """None when a Hopper GPU can run the kernel, else why not."""
    if not torch.cuda.is_available():
        return "this machine has no CUDA GPU"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return f"the GPU is sm_{major}{minor}; the kernel needs an SM90 (Hopper) GPU"
    return None


@dataclass(frozen=True)
class CallInterface:
    """What a call accepts besides the kernel's live operands, and how it may run.

    ``parameters``: the user's function's parameters after ``acc`` (for messages); ``unused``: those
    that the passes removed (accepted and ignored at
    call time, as calling the function would accept them); ``constants``: parameters the trace
    specialised on (bools, None, defaults left out of the examples), accepted when they have the
    compiled value; ``strict``: raise instead of taking the staged or torch path;
    ``torch_only``: why no SM90 kernel exists (every call takes the torch path), or None."""

    parameters: tuple[str, ...] = ()
    unused: frozenset[str] = frozenset()
    constants: tuple[tuple[str, Any], ...] = ()
    strict: bool = False
    torch_only: str | None = None

    def tag(self) -> str:
        """A digest of this interface: kernels that share compiled code but not the interface
        must not share a Kernel object (memory cache) or a custom operator."""
        if self == CallInterface():
            return ""
        text = repr((self.parameters, sorted(self.unused), self.constants, self.strict, self.torch_only))
        return hashlib.sha256(text.encode()).hexdigest()[:8]


def user_operand_names(graph: Graph, emitted) -> list[str]:
    """The names the user passes for the kernel's live operands, in kernel order (a gated kernel's
    ``bias.gate`` and ``bias.up`` are both ``bias``)."""
    names = []
    for plan in emitted.inputs:
        if plan.kind == "literal":
            continue
        operand = graph.operands.get(plan.name)
        names.append(operand.half_of[0] if operand is not None and operand.half_of else plan.name)
    return list(dict.fromkeys(names))


def _same_constant(value: Any, compiled: Any) -> bool:
    if isinstance(compiled, bool) or compiled is None:
        return value is compiled
    return not isinstance(value, torch.Tensor) and type(value) is type(compiled) and value == compiled


class Kernel:
    """A compiled fused GEMM + epilogue. Call it like the epilogue's math:
    ``k(a, b, **operands, out=None)`` returns what the epilogue returns."""

    def __init__(self, graph: Graph, emitted, signature: KernelSignature, config, key: str, cache: DiskCache,
                 arch: str | None, interface: CallInterface | None = None):
        self.graph = graph
        self.source: str = emitted.source
        self.interface = interface or CallInterface()
        #: The path the last call took: "kernel", "staged" (aligned copies around the kernel) or
        #: "torch" (torch.matmul and the epilogue evaluated by torch); see docs/compile.md.
        self.last_path = ""
        self._paths_logged: set[str] = set()
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
        # Cluster shape per call (see cluster_for): None keeps config.cluster for every problem.
        self._variant_factory = None
        self._variants: dict[tuple[int, int], Kernel] = {}
        self._variant_lock = threading.Lock()
        self._cluster_memo: dict[tuple[int, int, int], tuple[int, int]] = {}
        self._op = None
        self._call_setup()

    @classmethod
    def torch_only(cls, graph: Graph, emitted, signature: KernelSignature, key: str, cache: DiskCache,
                   interface: CallInterface) -> Kernel:
        """A kernel with no SM90 code: every call takes the torch path (``interface.torch_only``
        says why). Its source says so and shows the graph that torch evaluates."""
        from .ir.printer import format_graph

        kernel = cls(graph, emitted, signature, None, key, cache, None, interface)
        lines = [f"# evtc: no SM90 kernel: {interface.torch_only}.",
                 "# Every call runs torch.matmul, then this epilogue graph evaluated by torch:", "#"]
        lines += ["#   " + line for line in format_graph(graph).splitlines()]
        kernel.source = "\n".join(lines) + "\n"
        kernel.origin = "torch"
        return kernel

    def _choosing_clusters(self, factory) -> Kernel:
        """A twin of this kernel that picks the cluster shape per problem; ``factory(config)`` gives
        the kernel of another cluster shape."""
        twin = copy.copy(self)
        twin._variant_factory = factory
        twin._variants = {self.config.cluster: self}
        twin._variant_lock = threading.Lock()
        twin._cluster_memo = {}
        twin._op = None
        return twin

    def cluster_for(self, m: int, n: int, batches: int = 1) -> tuple[int, int]:
        """The cluster shape a call on an (L, M, N) problem runs with.

        ``config.cluster`` unless the kernel was compiled without a cluster knob and another shape
        needs fewer waves of tiles: a 1x2 cluster over a problem with one column of tiles leaves half
        the CTAs idle, so a 2x1 (or 1x1) kernel runs instead. Those are compiled, or loaded from
        the disk cache, on first use."""
        if self._variant_factory is None:
            return self.config.cluster
        tiles_m = -(-m // self.config.tile_m)
        tiles_n = -(-n // self.config.out_tile_n)
        memo_key = (tiles_m, tiles_n, batches)
        chosen = self._cluster_memo.get(memo_key)
        if chosen is None:
            from .codegen.runtime import max_active_clusters
            from .codegen.scheduler import cluster_for_problem

            def slots(cluster):
                size = cluster[0] * cluster[1]
                return max_active_clusters(size) * size

            chosen = cluster_for_problem(tiles_m, tiles_n, batches, self.config.cluster, slots,
                                         self.config.schedule)
            self._cluster_memo[memo_key] = chosen
        return chosen

    def _variant(self, cluster: tuple[int, int]) -> Kernel:
        variant = self._variants.get(cluster)
        if variant is None:
            with self._variant_lock:
                variant = self._variants.get(cluster)
                if variant is None:
                    log.info("%r: cluster %dx%d needs fewer waves for this problem; getting that "
                             "kernel (compiled on first use)", self.graph.name, *cluster)
                    variant = self._variant_factory(self.config.replace(cluster=cluster))
                    self._variants[cluster] = variant
        return variant

    # ---- build or load -------------------------------------------------------------------------
    @property
    def function_name(self) -> str:
        return f"evtc_{self.key[:24]}"

    def _materialize(self, meta: dict) -> None:
        t0 = time.perf_counter()
        what = f"{self.graph.name!r} ({self.config.short_name()})"
        entry = self._cache.load(self.key)
        if entry is not None:
            try:
                self._load(entry)
                self.origin = "disk"
                self.seconds = time.perf_counter() - t0
                log.info("disk cache hit: %s loaded from %s in %.2f s", what, entry, self.seconds)
                return
            except Exception as exc:  # noqa: BLE001 - an entry that does not load is rebuilt
                log.warning("disk cache entry %s of %s does not load (%s); rebuilding it", entry, what, exc)
                self._cache.discard(self.key)
        else:
            log.info("disk cache miss: %s, key %s", what, self.key[:16])
        log.info("building %s: generating the kernel and compiling it with the CuTe DSL "
                 "(a few seconds, once per configuration)", what)
        self._build(meta)
        self.origin = "compiled"
        self.seconds = time.perf_counter() - t0
        log.info("built %s in %.2f s; cached in %s", what, self.seconds, self.cache_path)

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
        from .codegen.launch import GatedLauncher, Launcher, Symbols, fake_tensor

        staged = self._cache.staging()
        try:
            source_path = staged / "epilogue.py"
            source_path.write_text(self.source)
            visitor = self._import_visitor(source_path)
            kernel = Sm90GemmKernel(self.config, visitor)
            sig = self._signature
            entry = GatedLauncher if self.config.gated else Launcher
            launcher = entry(kernel, sig.a, sig.b, sig.outputs + sig.workspaces, sig.inputs, sig.views,
                             sig.batched, workspaces=len(sig.workspaces))
            symbols = Symbols()
            fake_outs = tuple(fake_tensor(s, symbols) for s in sig.outputs + sig.workspaces)
            fake_ins = tuple(
                cutlass.Float32(1.0) if s is None else fake_tensor(s, symbols) for s in sig.inputs
            )
            options = f"{COMPILE_OPTIONS} --dump-dir={staged}"  # PTX dumps stay in the entry
            if self._arch:
                options += f" --gpu-arch {self._arch}"
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*cannot be converted to a JitArgument.*")
                fake_b = fake_tensor(sig.b, symbols)
                if self.config.gated:
                    fake_b = (fake_b, fake_tensor(sig.b, symbols))  # the gate and up halves
                compiled = cute.compile(
                    launcher, fake_tensor(sig.a, symbols), fake_b, fake_outs,
                    fake_ins, cutlass.Int32(1), make_fake_stream(use_tvm_ffi_env_stream=True),
                    options=options,
                )
            self._ptx = compiled.__ptx__
            (staged / "kernel.ptx").write_text(self._ptx or "")
            compiled.export_to_c(str(staged / "kernel.o"), function_name=self.function_name)
            self._stages = {"ab": kernel.ab_stages, "d": kernel.d_stages, "load": kernel.load_stages,
                            "d_in_load": int(kernel.d_in_load_buffers)}
            self._smem = {"visitor": visitor.smem_bytes(self.config, kernel.load_buffers),
                          "load_bytes_per_subtile": kernel.load_bytes}
            entry = self._cache.commit(
                self.key, staged, ["epilogue.py", "kernel.ptx", "kernel.o"],
                {**meta, "function": self.function_name, "epilogue": self.graph.name, "stages": self._stages,
                 "smem": self._smem},
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
        if self.interface.unused:
            lines.append(f"  unused parameters (accepted and ignored): {sorted(self.interface.unused)}")
        if self.interface.constants:
            fixed = ", ".join(f"{name}={value!r}" for name, value in self.interface.constants)
            lines.append(f"  compile-time constants: {fixed}")
        if cfg is None:
            lines.append(f"  no SM90 kernel: {self.interface.torch_only}; every call runs torch.matmul "
                         "and evaluates the epilogue graph with torch")
            return "\n".join(lines)
        if self.interface.strict:
            lines.append("  strict: calls that would need aligned copies or the torch path raise")
        lines.append(f"  GEMM: {cfg.short_name()}; a {self._signature.a.describe()}, "
                     f"b {self._signature.b.describe()}")
        if self._variant_factory is not None:
            built = ", ".join(f"{c[0]}x{c[1]}" for c in self._variants if c != cfg.cluster) or "none yet"
            lines.append(f"  cluster: {cfg.cluster[0]}x{cfg.cluster[1]}, or per call another shape where "
                         f"that needs fewer waves of tiles (other shapes built: {built})")
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
        for plan in self._emitted.reductions:
            axis = {"row": "per row", "col": "per column", "batch": "per batch",
                    "all": "over everything"}[plan.axis]
            parts = "per column of each tile" if plan.axis == "col" else "per row of each tile"
            lines.append(f"    {plan.ident}: {plan.op} {axis}: partials {parts} in the kernel "
                         "(float32 workspace), finished on the host")
        for i, spec in enumerate(self._signature.outputs):
            how = "stmatrix" if spec.dtype in ("float16", "bfloat16") else "register-to-shared copy"
            role = f"kernel D store ({how} + TMA)" if i == 0 else "extra TMA store"
            lines.append(f"    {spec.describe()}: {role}")
        if self._stages:
            d_text = (f"D in the {self._stages['load']} load stages (written where C was read)"
                      if self._stages.get("d_in_load") else f"D {self._stages['d']}")
            lines.append(f"  stages: A/B {self._stages['ab']}, {d_text}, "
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
        lines = out.stderr.splitlines()
        # ptxas reports (C7517/C7519) where it serializes wgmma around register use: worth knowing,
        # not worth its full text.
        injected = sum(1 for line in lines if "C7517" in line or "C7519" in line)
        report = " ".join(line.split("info    : ")[-1].strip() for line in lines
                          if ("registers" in line or "spill" in line) and "C751" not in line)
        note = f"; ptxas injected {injected} wgmma wait(s)/arrive(s)" if injected else ""
        return (report or "unknown") + note + "; producer 40 / consumers 232 by setmaxnreg"

    def __repr__(self) -> str:
        what = self.config.short_name() if self.config is not None else "torch path"
        return f"<evtc.Kernel {self.graph.name} {what}>"

    # ---- calling ---------------------------------------------------------------------------------
    def _user_name(self, kernel_name: str) -> str:
        operand = self.graph.operands.get(kernel_name)
        return operand.half_of[0] if operand is not None and operand.half_of else kernel_name

    def _split(self, b, operands):
        """A gated kernel's arguments: b's (gate, up) halves and the halves of wide operands (views).
        Others pass through."""
        if not self.graph.gated:
            return b, operands
        # Anything unusual (odd N, an unknown keyword, a wide operand of another width) goes to the
        # caller's _validate, which says what is wrong.
        n = b.shape[-1]
        if n % 2 or operands.keys() != self._name_set:
            raise ValueError("not a plain gated call")
        for name in self._wide_operands:
            if operands[name].shape[-1] != n:
                raise ValueError("not a plain gated call")
        return kernel_arguments(self.graph, None, b, operands)

    def _call_setup(self) -> None:
        graph, emitted = self.graph, self._emitted
        # The kernel's operands (a gated kernel's include the halves of wide operands, "bias.gate"
        # and "bias.up", see kernel_arguments) and the names the user passes.
        self._kernel_names = [p.name for p in emitted.inputs if p.kind != "literal"]
        self._names = user_operand_names(graph, emitted)
        self._name_set = frozenset(self._names)
        self._user_kinds = {self._user_name(p.name): p.kind for p in emitted.inputs}
        # A gated kernel's operands as wide as the GEMM (the call splits them into halves).
        self._wide_operands = sorted({o.half_of[0] for o in graph.operands.values() if o.half_of})
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
        # Outputs finished on the host from the reductions' partials (evtc.reductions), after those.
        self._host_outputs = [s for s in graph.stores if s.attrs["name"] not in self._kernel_order]
        self._kernel_order += [s.attrs["name"] for s in self._host_outputs]
        self._tree = graph.outputs
        self._accepts_more = bool(self.interface.unused or self.interface.constants)
        # The compiled dtype of each tensor operand, by the name the user passes.
        self._operand_dtypes = {self._user_name(p.name): getattr(torch, spec.dtype)
                                for p, spec in zip(emitted.inputs, self._signature.inputs, strict=True)
                                if spec is not None}
        # Elements per 16 bytes of the narrowest output dtype: an N that is not a multiple of it
        # needs padded output rows (the staged path).
        self._out_align = max((16 // torch.empty((), dtype=dt).element_size() for dt in self._out_dtypes),
                              default=1)

    def __call__(self, a, b, *, out=None, **operands):
        """``D = k(a, b, C=C, alpha=0.7, ...)``: the epilogue of ``a @ b``, launched on the current CUDA
        stream. ``out`` (the same structure as the result) receives the outputs instead of new tensors.

        Under ``torch.compile`` the call is the kernel's custom operator (:attr:`op`), which the
        compiler sees as one opaque op with a shape function: no graph break."""
        if torch.compiler.is_compiling():
            return self._call_op(a, b, out, operands)
        try:
            outs = self._launch(a, b, out, operands)
        except EpilogueError as err:
            raise err.with_traceback(None) from None
        return self._tree.build(dict(zip(self._kernel_order, outs, strict=True)))

    @property
    def op(self):
        """This kernel as a PyTorch custom operator, ``torch.ops.evtc.<name>``: ``op(a, b, *operands)``
        with the operands in :attr:`operand_names` order, returning a tensor or a tuple of tensors
        in the kernel's output order. It has a fake (meta) implementation, so ``torch.compile``
        traces through it and CUDA graphs capture it."""
        if self._op is None:
            from .torch_op import register

            self._op = register(self)
        return self._op

    @property
    def operand_names(self) -> list[str]:
        """The epilogue's operands after ``acc``, in the order :attr:`op` takes them."""
        return list(self._names)

    def _call_op(self, a, b, out, operands):
        if self._accepts_more:
            operands = self._without_unused(operands)
        missing = [name for name in self._names if name not in operands]
        if missing:
            raise CallError(f"missing argument(s) {missing}; the epilogue takes {self._names}")
        result = self.op(a, b, *[operands[name] for name in self._names])
        outs = [result] if len(self._kernel_order) == 1 else list(result)
        if out is not None:
            # The operator returns new tensors (a functional op is what the compiler can reorder);
            # out= then costs one copy per output.
            given = flatten_outputs(out, self._tree)
            if given is None:
                raise CallError("out= must have the structure the epilogue returns "
                                f"({self._describe_tree()})")
            for name, value in zip(self._kernel_order, outs, strict=True):
                given[name].copy_(value)
            outs = [given[name] for name in self._kernel_order]
        return self._tree.build(dict(zip(self._kernel_order, outs, strict=True)))

    def _launch(self, a, b, out, operands) -> list[torch.Tensor]:
        """Launch and return the outputs in kernel order.

        The fast path hands the tensors to the compiled function as they are (it checks their
        sizes, strides and alignment itself). Anything it does not take goes to :meth:`_launch_slow`,
        which names a wrong argument or takes the staged or the torch path."""
        if self._accepts_more and not operands.keys() <= self._name_set:
            operands = self._without_unused(operands)
        if self.interface.torch_only is None and _gpu_ok() is None:
            try:
                outs, workspaces, problem = self._run_kernel(a, b, out, operands, stage=False)
            except (ValueError, TypeError, RuntimeError, KeyError, AttributeError, IndexError):
                pass  # the slow path finds out what it was
            else:
                self.last_path = "kernel"
                return outs + self._finish(out, workspaces, *problem, operands)
        return self._launch_slow(a, b, out, operands)

    def _launch_slow(self, a, b, out, operands) -> list[torch.Tensor]:
        """A call the fast path did not take: a CallError for wrong arguments; the torch path where
        the kernel cannot run at all; otherwise the kernel with aligned copies of the tensors whose
        layout it cannot take (the staged path). ``strict`` turns both paths into CallErrors."""
        reason = self._torch_reason(a, operands) if isinstance(a, torch.Tensor) else None
        if reason is None and self.interface.strict:
            self._validate(a, b, out, operands)  # a wrong argument is named before any layout rule
        if reason is None:
            try:
                outs, workspaces, problem = self._run_kernel(a, b, out, operands, stage=True)
            except CallError:
                raise
            except (ValueError, TypeError, RuntimeError, KeyError, AttributeError, IndexError) as exc:
                # Staging copies whatever it is given: the compiled function then rejects a wrong
                # argument, and the checks below name it.
                self._validate(a, b, out, operands)
                raise CallError(f"the kernel rejected arguments that evtc checked and staged: {exc} (an "
                                "evtc bug: please report it with the shapes and strides of the call)"
                                ) from None
            return outs + self._finish(out, workspaces, *problem, operands)
        self._validate(a, b, out, operands)
        if reason is not None:
            if self.interface.strict:
                raise CallError(f"cannot run {self.graph.name!r} as a kernel: {reason}. strict=True "
                                "refuses the torch path (torch.matmul, then the epilogue evaluated by "
                                "torch) that would compute it instead")
            self._note_path("torch", reason)
        return self._run_torch(a, b, out, operands)

    def _torch_reason(self, a, operands) -> str | None:
        """Why this call cannot run the SM90 kernel (it then takes the torch path), or None."""
        if self.interface.torch_only is not None:
            return self.interface.torch_only
        reason = _gpu_ok()
        if reason is not None:
            return reason
        if a.device.type != "cuda":
            return f"the tensors are on {a.device}"
        if a.shape[-1] == 0:
            return "K = 0 (the accumulator is all zeros)"
        # An operand of another float dtype than compiled: the kernel loads the compiled one, but
        # the function widens every operand to float32 first, so the graph gives the same result
        # (output dtypes follow a and b and explicit casts, never an operand's dtype).
        for name, dtype in self._operand_dtypes.items():
            value = operands.get(name)
            if isinstance(value, torch.Tensor) and value.dtype != dtype and value.dtype in OPERAND_DTYPES:
                return f"{name} is {value.dtype}, the kernel was compiled for {dtype}"
        return None

    def _note_path(self, path: str, why: str) -> None:
        """Record the path of this call; log each kind of detour once per kernel."""
        self.last_path = path
        if why in self._paths_logged:
            return
        self._paths_logged.add(why)
        what = {"torch": "runs on the torch path (torch.matmul, then the epilogue evaluated by torch; "
                         "not fused)",
                "staged": "runs the kernel on aligned copies"}[path]
        log.warning("%r %s: %s. strict=True makes this an error; docs/compile.md ('Call paths') says "
                    "which layouts take which path", self.graph.name, what, why)

    def _run_kernel(self, a, b, out, operands, *, stage: bool):
        """Split, gather and launch. With ``stage``, tensors whose layout the kernel cannot take go
        through aligned copies (see :mod:`evtc.staging`). Returns the outputs in kernel order (the
        host outputs not yet), the reductions' workspaces and (M, N, L)."""
        b, kernel_operands = self._split(b, operands)
        m = a.shape[-2]
        n = (b[0] if self.graph.gated else b).shape[-1]  # the output's width
        batches = a.shape[0] if a.dim() == 3 else 1
        if a.shape[-1] == 0:
            raise ValueError("K = 0 takes the torch path")
        ins = []
        for kind, what in self._getters:
            if kind == "tensor":
                ins.append(kernel_operands[what])
            elif kind == "arg":
                ins.append(float(kernel_operands[what]))
            else:
                ins.append(float(what(batches, m, n)))
        if len(kernel_operands) != len(self._kernel_names):
            raise KeyError("unknown arguments")
        if not stage and n % self._out_align:
            raise ValueError("output rows are not 16-byte multiples: staged")  # cheaper than the DSL's error
        targets = self._outputs(a, out, m, n, batches, layout=not stage)
        outs = targets
        if stage:
            a, b, ins, outs = self._stage(a, b, ins, targets)
        workspaces = []
        if self._host_outputs:
            from .reductions import workspace_numel

            workspaces = [torch.empty(workspace_numel(plan, m, n, batches, self.config),
                                      dtype=torch.float32, device=a.device)
                          for plan in self._emitted.reductions]
        if m == 0 or n == 0 or batches == 0:
            return targets, workspaces, (m, n, batches)
        from .codegen.runtime import max_active_clusters

        fn, cluster = self._fn, self.config.cluster
        if self._variant_factory is not None:
            chosen = self.cluster_for(m, n, batches)
            if chosen != cluster:
                fn, cluster = self._variant(chosen)._fn, chosen
        clusters = max_active_clusters(cluster[0] * cluster[1])
        fn(a, b, tuple(outs + workspaces), tuple(ins), clusters)
        for written, target in zip(outs, targets, strict=True):
            if written is not target:
                target.copy_(written)
        return targets, workspaces, (m, n, batches)

    def _stage(self, a, b, ins, targets):
        """Aligned copies of the inputs whose layout the kernel cannot take, padded buffers for the
        outputs it cannot write in place (copied into ``targets`` after the launch)."""
        from .staging import aligned_copy, aligned_empty, layout_problem

        sig = self._signature
        b_parts = [("b (its gate half)", b[0]), ("b (its up half)", b[1])] if self.graph.gated else [("b", b)]
        named = [("a", a, sig.a)] + [(name, t, sig.b) for name, t in b_parts]
        named += [(self._describe_operand(plan.name), t, spec)
                  for plan, t, spec in zip(self._emitted.inputs, ins, sig.inputs, strict=True)
                  if isinstance(t, torch.Tensor)]
        out_names = self._kernel_order[:len(sig.outputs)]
        outputs = [(f"output {name!r}", t, spec) for name, t, spec in zip(out_names, targets, sig.outputs,
                                                                         strict=True)]
        problems = {id(t): f"{name}: {why}" for name, t, spec in named + outputs
                    if (why := layout_problem(t, spec)) is not None}
        if not problems:
            return a, b, ins, targets
        if self.interface.strict:
            raise CallError(f"{'; '.join(problems.values())}. The kernel reads and writes by TMA, which "
                            "needs these layouts; strict=True refuses the aligned copies evtc would "
                            "otherwise make (docs/compile.md, 'Call paths')")
        self._note_path("staged", "; ".join(problems.values()))
        copies = {id(t): aligned_copy(t, spec) for _, t, spec in named if id(t) in problems}

        def staged(t):
            return copies.get(id(t), t) if isinstance(t, torch.Tensor) else t

        outs = [aligned_empty(tuple(t.shape), t.dtype, spec, t.device) if id(t) in problems else t
                for _, t, spec in outputs]
        b = tuple(staged(half) for half in b) if self.graph.gated else staged(b)
        return staged(a), b, [staged(t) for t in ins], outs

    def _describe_operand(self, kernel_name: str) -> str:
        """The user's name of a kernel operand (a gated kernel's ``bias.up`` is bias's up half)."""
        operand = self.graph.operands.get(kernel_name)
        if operand is not None and operand.half_of:
            source, index = operand.half_of
            return f"{source} (its {'gate' if index == 0 else 'up'} half)"
        return kernel_name

    def _run_torch(self, a, b, out, operands) -> list[torch.Tensor]:
        """The torch path (:mod:`evtc.fallback`): outputs in kernel order, into ``out`` if given."""
        from .fallback import run

        results = run(self.graph, a, b, operands)
        values = [results[name].contiguous() for name in self._kernel_order]
        if out is None:
            return values
        given = flatten_outputs(out, self._tree)
        for name, value in zip(self._kernel_order, values, strict=True):
            target = given[name]
            if not isinstance(target, torch.Tensor) or target.shape != value.shape \
                    or target.dtype != value.dtype:
                raise CallError(f"out[{name!r}] must be a {value.dtype} tensor of shape {tuple(value.shape)}")
            target.copy_(value)
        return [given[name] for name in self._kernel_order]

    def _without_unused(self, operands: dict) -> dict:
        """``operands`` without the parameters the kernel does not take: unused ones are dropped,
        compile-time constants checked against their compiled value. Unknown names stay, for
        :meth:`_validate` to name."""
        constants = dict(self.interface.constants)
        kept = {}
        for name, value in operands.items():
            if name in constants:
                if not _same_constant(value, constants[name]):
                    raise CallError(
                        f"{name}={value!r}: {self.graph.name!r} was compiled with {name}="
                        f"{constants[name]!r}, a compile-time constant (the trace specialised on it); "
                        "compile again with the new value")
            elif name not in self.interface.unused:
                kept[name] = value
        return kept

    def _output_meta(self, m, n, batches) -> list[tuple[tuple, torch.dtype]]:
        """(shape, dtype) of every output in kernel order, for an (L, M, N) GEMM (sizes may be
        symbolic: fake tensors)."""
        if self.graph.gated:
            n = n // 2  # N is the output's width in a gated graph
        tile = (batches, m, n) if self._signature.batched else (m, n)
        meta = [(tile, dt) for dt in self._out_dtypes]
        dims = {M: m, N: n, L: batches}
        for node in self._host_outputs:
            meta.append((tuple(dims.get(d, d) if not isinstance(d, int) else d for d in node.shape),
                         node.dtype))
        return [(tuple(int(d) if isinstance(d, sympy.Integer) else d for d in shape), dt)
                for shape, dt in meta]

    def _finish(self, out, workspaces, m, n, batches, operands) -> list[torch.Tensor]:
        """The host outputs (reductions and what follows them), into ``out``'s tensors if given."""
        if not self._host_outputs:
            return []
        from .reductions import finish

        done = finish(self.graph, self._emitted.reductions, workspaces, m, n, batches,
                      self.config, operands)
        results = [done[s.attrs["name"]] for s in self._host_outputs]
        if out is None:
            return results
        given = flatten_outputs(out, self._tree)
        for node, value in zip(self._host_outputs, results, strict=True):
            target = given[node.attrs["name"]]
            if not isinstance(target, torch.Tensor) or target.shape != value.shape \
                    or target.dtype != value.dtype:
                raise CallError(f"out[{node.attrs['name']!r}] must be a {value.dtype} tensor of shape "
                                f"{tuple(value.shape)}")
            target.copy_(value)
        return [given[s.attrs["name"]] for s in self._host_outputs]

    def _outputs(self, a, out, m, n, batches, layout: bool = True):
        shape = (batches, m, n) if self._signature.batched else (m, n)
        if out is None:
            return [torch.empty(shape, dtype=dt, device=a.device) for dt in self._out_dtypes]
        given = flatten_outputs(out, self._tree)
        if given is None:
            raise CallError(f"out= must have the structure the epilogue returns ({self._describe_tree()})")
        tensors = []
        tile_names = self._kernel_order[:len(self._signature.outputs)]
        for name, spec, dt in zip(tile_names, self._signature.outputs, self._out_dtypes, strict=True):
            t = given[name]
            check_tensor(f"out[{name!r}]" if self._tree.kind != "single" else "out", t, spec, dt,
                         {"L": batches, "M": m, "N": n}, layout=layout)
            tensors.append(t)
        return tensors

    def _describe_tree(self) -> str:
        if self._tree.kind == "single":
            return "one tensor"
        if self._tree.kind == "tuple":
            return f"a tuple of {len(self._tree.names)} tensors"
        return f"a dict with keys {self._tree.keys}"

    def _validate_gated(self, b, operands) -> None:
        """A gated call's own rules, checked on the tensors the user passed (before splitting)."""
        n = b.shape[-1]
        if n % 2:
            raise CallError(f"b has {n} columns: this gated epilogue splits them into gate and up halves "
                            "(acc.chunk(2, dim=-1)), so N must be even")
        for name, t in [("b", b)] + [(w, operands[w]) for w in self._wide_operands]:
            if not isinstance(t, torch.Tensor) or t.dim() < 1 or t.shape[-1] != n:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise CallError(f"{name} must be a tensor whose last dim is N = {n} (as wide as the GEMM: "
                                f"it is split into gate and up halves like acc), got {shape}")

    def _validate(self, a, b, out, operands) -> None:
        """Raise a CallError naming what is wrong with the arguments (the slow path of a call).

        Layouts are not checked here: a layout the kernel cannot take is staged (:meth:`_stage`)."""
        sig = self._signature
        for name, t in (("a", a), ("b", b)):
            if not isinstance(t, torch.Tensor):
                raise CallError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if a.dim() != len(sig.a.dims) or b.dim() != len(sig.b.dims):
            raise CallError(f"a and b must be {len(sig.a.dims)}-d and {len(sig.b.dims)}-d as when compiled; "
                            f"got shapes {tuple(a.shape)} and {tuple(b.shape)}")
        unknown = sorted(set(operands) - self._name_set)
        if unknown:
            takes = list(self.interface.parameters) or self._names
            raise CallError(f"unexpected argument(s) {unknown}; the epilogue takes "
                            f"{takes or 'no operands'}")
        missing = [nm for nm in self._names if nm not in operands]
        if missing:
            raise CallError(f"missing argument(s) {missing}; the epilogue takes {self._names}")
        if b.shape[-2] != a.shape[-1]:
            raise CallError(f"a @ b: a is {tuple(a.shape)} and b is {tuple(b.shape)}; K differs")
        batches = [t.shape[0] for t in (a, b) if t.dim() == 3]
        if len(set(batches) - {1}) > 1 or (len(set(batches)) > 1 and sig.broadcast_batch is None):
            raise CallError(f"a and b have batch sizes {a.shape[0]} and {b.shape[0]}"
                            + ("" if sig.broadcast_batch else " (compiled for equal batch sizes)"))
        b_parts = [("b", b)]
        if self.graph.gated:
            self._validate_gated(b, operands)
            (gate, up), operands = kernel_arguments(self.graph, a, b, operands)
            b_parts = [("b (its gate half)", gate), ("b (its up half)", up)]
        sizes = {"M": a.shape[-2], "K": a.shape[-1], "N": b_parts[0][1].shape[-1],
                 "L": max(batches, default=1)}
        device = a.device
        # a and b each with its own batch size (they may broadcast, on the torch path).
        check_tensor("a", a, sig.a, getattr(torch, sig.a.dtype), {**sizes, "L": a.shape[0]}, layout=False)
        for name, part in b_parts:
            check_tensor(name, part, sig.b, getattr(torch, sig.b.dtype), {**sizes, "L": b.shape[0]},
                         layout=False)
        for plan, spec in zip(self._emitted.inputs, sig.inputs, strict=True):
            if plan.kind == "literal":
                continue
            value = operands[plan.name]
            if plan.kind == "arg":
                if isinstance(value, torch.Tensor) or not isinstance(value, int | float):
                    raise CallError(f"{plan.name} is a runtime scalar: pass a Python float or int, got "
                                    f"{type(value).__name__}")
                continue
            # Another float dtype than compiled takes the torch path (see _torch_reason).
            dtype = getattr(value, "dtype", None)
            dtype = dtype if dtype in OPERAND_DTYPES else getattr(torch, spec.dtype)
            check_tensor(self._describe_operand(plan.name), value, spec, dtype, sizes,
                         layout=False)
        outs = self._outputs(a, out, sizes["M"], sizes["N"], sizes["L"], layout=False) \
            if out is not None else []
        tensors = [("a", a), ("b", b)] + [(self._describe_operand(p.name), operands[p.name])
                                          for p in self._emitted.inputs if p.kind not in ("arg", "literal")]
        tensors += [(f"out[{i}]", t) for i, t in enumerate(outs)]
        for name, t in tensors:
            check_device(name, t, device)
