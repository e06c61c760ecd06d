"""Building a kernel with the CuTe DSL, and loading a built one without it.

A build (a cache miss) writes the generated visitor's source, imports it, compiles the SM90 GEMM
behind the jit entry point of :mod:`evtc.sm90.launch` through the DSL's TVM-FFI calling convention,
exports the host and device code as an object file and links it into a shared library with the
DSL's runtime library and tvm_ffi's. The cache entry keeps the source, the PTX, the object and the
library (:mod:`evtc.runtime.cache`).

Loading a cached kernel opens the library with ``tvm_ffi.load_module``: a few milliseconds, in a
process that never imports ``cutlass``. Where no library could be linked (no C compiler at build
time) or it does not load here, the object file is loaded through the DSL instead (slower to start).

Where a cold compile's 2.6 to 2.8 s go (H100 host, Python with its bytecode caches, a typical
epilogue): importing the DSL about 0.4 s once per process, the DSL tracing our kernel in Python
about 0.9 s, MLIR lowering and ptxas about 1.3 s, the export and link 0.1 s (``evtc.compile`` logs
the build's seconds; docs/performance.md, "start-up measured with bytecode caches").
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evtc.errors import CompileError
from evtc.plan.config import GemmConfig
from evtc.plan.kernel_plan import KernelPlan
from evtc.runtime.cache import DiskCache
from evtc.runtime.dsl_lock import DSL_LOCK

log = logging.getLogger("evtc")

COMPILE_OPTIONS = "--enable-tvm-ffi --keep-ptx"
SOURCE, PTX, OBJECT, LIBRARY = "epilogue.py", "kernel.ptx", "kernel.o", "kernel.so"


@dataclass
class Built:
    """A kernel ready to launch on the current stream: ``fn(a, b, outputs, inputs, max_clusters)``,
    a gated kernel's ``fn(a, b, up_offset, outputs, ...)``, split-K's with its buffers after
    ``max_clusters`` (:func:`evtc.runtime.invoke.invoke` makes the call)."""

    fn: Any
    path: Path
    function: str
    stages: dict[str, int] = field(default_factory=dict)
    smem: dict[str, int] = field(default_factory=dict)
    origin: str = ""  # "compiled" or "disk"
    seconds: float = 0.0
    ptx: str | None = None  # kept when built here; read from the entry on demand otherwise

    def read_ptx(self) -> str:
        if self.ptx is None:
            try:
                self.ptx = (self.path / PTX).read_text()
            except OSError:
                self.ptx = ""
        return self.ptx


def function_name(key: str) -> str:
    return f"evtc_{key[:24]}"


def _load_library(library: Path, function: str):
    """``function`` of a linked kernel library, opened with tvm_ffi; None if it does not load."""
    try:
        import tvm_ffi

        return tvm_ffi.load_module(str(library.resolve()))[function]
    except Exception as exc:  # noqa: BLE001 - the object file still works
        log.info("%s does not load with tvm_ffi (%s); loading the object file through the DSL", library, exc)
        return None


def load(entry: dict) -> Built:
    """The kernel of a verified cache entry (:meth:`DiskCache.load`)."""
    path = Path(entry["dir"])
    function = entry["function"]
    files = entry.get("files", {})
    fn = _load_library(path / LIBRARY, function) if LIBRARY in files else None
    if fn is None:
        if OBJECT not in files:  # only files the manifest checksums are ever loaded
            raise RuntimeError(f"the manifest lists neither {LIBRARY} nor {OBJECT}")
        import cutlass.cute as cute

        with DSL_LOCK:  # the DSL compiles one thing at a time (dsl_lock.py)
            module = cute.runtime.load_module(str(path / OBJECT), enable_tvm_ffi=True)
        fn = getattr(module, function)
    return Built(fn, path, function, dict(entry.get("stages", {})), dict(entry.get("smem", {})))


def _import_visitor(path: Path, key: str, class_name: str):
    name = f"evtc_generated_{key[:16]}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return getattr(module, class_name)()


def _link(obj: Path, library: Path) -> bool:
    """Link ``obj`` into a shared library that tvm_ffi loads without the DSL; False if it cannot."""
    import cutlass.cute as cute

    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("no C compiler: the kernel is cached as an object file only (loads through the DSL)")
        return False
    libs = list(cute.runtime.find_runtime_libraries(enable_tvm_ffi=True))
    rpaths = [f"-Wl,-rpath,{Path(lib).parent}" for lib in libs]
    cmd = [compiler, "-shared", "-o", str(library), str(obj), *rpaths, *libs]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.info("linking %s failed (%s): object file only", library, exc)
        return False
    if done.returncode != 0:
        log.info("linking %s failed: %s", library, done.stderr.strip()[-500:])
        return False
    return True


def build(plan: KernelPlan, source: str, config: GemmConfig, key: str, cache: DiskCache, arch: str | None,
          meta: dict) -> Built:
    """Compile the kernel and commit it to the cache under ``key``."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.runtime import make_fake_stream

    from evtc.sm90.gemm import Sm90GemmKernel
    from evtc.sm90.launch import Symbols, entry_point, fake_split_args, fake_tensor, whole_spec

    t0 = time.perf_counter()
    try:
        staged = cache.staging()
    except OSError as exc:
        raise UnwritableCache(cache, exc) from exc
    try:
        source_path = staged / SOURCE
        source_path.write_text(source)
        visitor = _import_visitor(source_path, key, plan.class_name)
        kernel = Sm90GemmKernel(config, visitor)
        in_specs = [i.spec for i in plan.inputs]
        # An operand as wide as a gated GEMM comes whole in its gate half's place and, in its up
        # half's, where that half starts (Launcher._input_views).
        gate_input = {i.user: index for index, i in enumerate(plan.inputs) if i.half == 0}
        in_halves = [None if i.half is None else (i.half, gate_input[i.user]) for i in plan.inputs]
        scaled = bool(config.block_scales)
        launcher = entry_point(config.gated, config.split_k, scaled)(
            kernel, plan.a, plan.b, plan.outputs + plan.workspaces + plan.finish_args, in_specs,
            [i.view for i in plan.inputs], plan.batched, workspaces=len(plan.workspaces),
            finished=tuple(len(names) for _, names in plan.kernel_finish),
            scale_specs=(plan.a_scales, plan.b_scales) if scaled else (), in_halves=in_halves)
        symbols = Symbols()
        fake_outs = tuple(fake_tensor(s, symbols) for s in plan.outputs + plan.workspaces + plan.finish_args)
        fake_ins = tuple(cutlass.Float32(1.0) if s is None
                         else fake_tensor(s, symbols) if half is None
                         else fake_tensor(whole_spec(s), symbols) if half[0] == 0 else cutlass.Int64(0)
                         for s, half in zip(in_specs, in_halves, strict=True))
        # PTX dumps stay in the entry; quoted, as the DSL splits its options like a shell (a cache
        # directory with a space in its path).
        options = f"{COMPILE_OPTIONS} --dump-dir={shlex.quote(str(staged))}"
        if arch:
            options += f" --gpu-arch {arch}"
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*cannot be converted to a JitArgument.*")
            # The DSL warns of every static loop of 64 or more iterations (for compile time); where
            # evtc's kernels have one, it is unrolled on purpose.
            warnings.filterwarnings("ignore", message="This static loop has")
            fake_a = fake_tensor(plan.a, symbols)
            # A gated kernel takes b whole, then where its up half starts (GatedLauncher).
            fake_b = fake_tensor(whole_spec(plan.b) if config.gated else plan.b, symbols)
            if scaled:  # (tensor, block scales) pairs
                fake_a = (fake_a, fake_tensor(plan.a_scales, symbols))
                fake_b = (fake_b, fake_tensor(plan.b_scales, symbols))
            up_offset = (cutlass.Int64(0),) if config.gated else ()
            split = fake_split_args() if config.split_k else ()
            compiled = cute.compile(
                launcher, fake_a, fake_b, *up_offset, fake_outs,
                fake_ins, cutlass.Int32(1), *split, make_fake_stream(use_tvm_ffi_env_stream=True),
                options=options,
            )
        ptx = compiled.__ptx__ or ""
        (staged / PTX).write_text(ptx)
        function = function_name(key)
        compiled.export_to_c(str(staged / OBJECT), function_name=function)
        files = [SOURCE, PTX, OBJECT]
        if _link(staged / OBJECT, staged / LIBRARY):
            files.append(LIBRARY)
        stages = {"ab": kernel.ab_stages, "d": kernel.d_stages, "load": kernel.load_stages,
                  "d_in_load": int(kernel.d_in_load_buffers)}
        smem = {"visitor": visitor.smem_bytes(config, kernel.load_buffers),
                "load_bytes_per_subtile": kernel.load_bytes}
        try:
            path = cache.commit(key, staged, files, {**meta, "function": function, "epilogue": plan.name,
                                                     "stages": stages, "smem": smem, "plan": plan.to_json()})
        except OSError as exc:  # a full disk, a directory made read-only meanwhile
            raise UnwritableCache(cache, exc) from exc
        # Calls go through the linked library, as after a disk-cache hit: one launcher, and its
        # call costs less host time than the DSL's JIT wrapper.
        fn = _load_library(path / LIBRARY, function) if LIBRARY in files else None
        return Built(fn or compiled, path, function, stages, smem, "compiled", time.perf_counter() - t0, ptx)
    finally:
        if staged.exists():
            shutil.rmtree(staged, ignore_errors=True)


class UnwritableCache(Exception):
    """The cache directory takes no new entry (read-only, full, not a directory)."""

    def __init__(self, cache: DiskCache, cause: OSError) -> None:
        super().__init__(f"{cache.root}: {cause}")
        self.cache, self.cause = cache, cause


def obtain(plan: KernelPlan, source: str, config: GemmConfig, key: str, cache: DiskCache, arch: str | None,
           meta: dict) -> Built:
    """The kernel of ``key``: loaded from the disk cache, or built (once across threads and
    processes). An entry that does not verify or load is rebuilt, never run."""
    what = f"{plan.name!r} ({config.short_name()})"
    with cache.lock(key):
        t0 = time.perf_counter()
        entry = cache.load(key)
        if entry is not None:
            try:
                built = load(entry)
                built.origin, built.seconds = "disk", time.perf_counter() - t0
                log.info("disk cache hit: %s loaded from %s in %.2f s", what, entry["dir"], built.seconds)
                return built
            except Exception as exc:  # noqa: BLE001 - an entry that does not load is rebuilt
                log.warning("disk cache entry %s of %s does not load (%s); rebuilding it", entry["dir"], what,
                            exc)
                cache.discard(key)
        else:
            log.info("disk cache miss: %s, key %s", what, key[:16])
        log.info("building %s: generating the kernel and compiling it with the CuTe DSL "
                 "(a few seconds, once per configuration)", what)
        with DSL_LOCK:  # the DSL compiles one thing at a time (dsl_lock.py)
            try:
                built = build(plan, source, config, key, cache, arch, meta)
            except UnwritableCache as unwritable:
                # A read-only home in a container, a full disk: the kernel is built where it can
                # be, for this process, and the user told how to keep kernels across processes.
                private = DiskCache(tempfile.mkdtemp(prefix="evtc-cache-"))
                log.warning("evtc: the kernel cache %s takes no new kernel (%s); building %s in %s for "
                            "this process only. Set EVTC_CACHE_DIR (or cache_dir=) to a writable "
                            "directory to keep kernels across processes", unwritable.cache.root,
                            unwritable.cause, what, private.root)
                try:
                    built = build(plan, source, config, key, private, arch, meta)
                except UnwritableCache as again:
                    raise CompileError(f"no directory takes the kernel's build: the cache {cache.root} "
                                       f"({unwritable.cause}) nor a temporary one ({again.cause}); free "
                                       "space or set EVTC_CACHE_DIR to a writable directory") from None
        log.info("built %s in %.2f s; cached in %s", what, built.seconds, built.path)
        return built


__all__ = ["Built", "build", "function_name", "load", "obtain"]
