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
import json
import logging
import os
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from .api import OutDtypes, trace
from .cache import DiskCache
from .errors import CallError, CompileError, EpilogueError
from .frontend.epilogue import unwrap
from .frontend.inputs import read_signature
from .frontend.source import definition_location
from .ir.dtypes import KERNEL_INPUT_DTYPES
from .ir.passes.gated import kernel_graph
from .ir.printer import format_graph
from .kernel import CallInterface, Kernel, user_operand_names
from .signature import KernelSignature, dtype_name

# ---- versions and keys ---------------------------------------------------------------------------


@functools.cache
def _codegen_digest() -> str:
    """A digest of evtc's code generator and kernel sources: a change to any invalidates caches."""
    here = Path(__file__).parent
    h = hashlib.sha256()
    builders = [here / name for name in ("compile.py", "kernel.py", "signature.py")]
    for path in sorted((here / "codegen").glob("*.py")) + builders:
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


# ---- compile ---------------------------------------------------------------------------------------

log = logging.getLogger("evtc")

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
    strict: bool = False,
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
        strict: raise a CallError (CompileError for float32 ``a`` and ``b``) where a call would
            otherwise take a slower path: aligned copies around the kernel, or torch.matmul and the
            epilogue evaluated by torch (docs/compile.md, "Call paths").

    Returns:
        a :class:`Kernel`; ``k.source`` is the generated code, ``k.ptx`` the PTX, ``k.graph`` the IR.

    Raises:
        EpilogueError: a subclass naming the problem (and the epilogue's line when there is one).
    """
    try:
        return _compile(fn, example_inputs, out_dtypes, config, arch, cache_dir, strict)
    except EpilogueError as err:
        raise err.with_traceback(None) from None


def _compile(fn, example_inputs, out_dtypes, config, arch, cache_dir, strict) -> Kernel:
    from .codegen.config import ConfigError, GemmConfig
    from .codegen.emit import emit

    user_fn = unwrap(fn)
    graph = kernel_graph(trace(fn, example_inputs, out_dtypes=out_dtypes))
    log.debug("traced %r: %d nodes, operands %s", graph.name, len(graph.nodes), list(graph.operands))
    loc = definition_location(user_fn)
    emitted = emit(graph)
    signature = KernelSignature(graph, emitted, example_inputs)
    if signature.tile_majors:
        emitted = emit(graph, tile_majors=signature.tile_majors)
    interface = _call_interface(user_fn, example_inputs, graph, emitted, strict)
    if interface.unused:
        log.info("%r: parameter(s) %s are unused after the passes: calls accept and ignore them",
                 graph.name, sorted(interface.unused))
    if getattr(torch, signature.a.dtype) not in KERNEL_INPUT_DTYPES:
        reason = ("float32 a and b: the SM90 kernel has no tf32 or float32 mainloop yet (torch.matmul "
                  "follows torch.backends.cuda.matmul.allow_tf32)")
        return _torch_kernel(graph, emitted, signature, interface, cache_dir, loc, reason,
                             "Pass float16 or bfloat16 a and b for a fused kernel")
    if signature.broadcast_batch is not None:
        return _torch_kernel(graph, emitted, signature, interface, cache_dir, loc, signature.broadcast_batch,
                             "Expand a or b so both have the same batch size")

    knobs: dict[str, Any]
    if config is None:
        knobs = {}
    elif isinstance(config, GemmConfig):
        # The fields the user set: those that differ from the defaults of its schedule.
        default = GemmConfig(schedule=config.schedule)
        knobs = {k: getattr(config, k) for k in GemmConfig.__dataclass_fields__
                 if k == "schedule" or getattr(config, k) != getattr(default, k)}
    else:
        knobs = dict(config)
    # Only reductions: no D (the kernel's D dtype is then that of a and b, for its unused buffer).
    d_dtype = dtype_name(emitted.outputs[0].dtype) if emitted.outputs else signature.a.dtype
    knobs.update(ab_dtype=signature.a.dtype, d_dtype=d_dtype, a_major=signature.a_major,
                 b_major=signature.b_major, d_major="n", gated=graph.gated,
                 store_d=bool(emitted.outputs))
    if len(emitted.outputs) > 1 and knobs.get("epi_stages") is None:
        # Extra outputs are staged like D, one buffer per D stage: fix the count so both agree.
        knobs["epi_stages"] = 2
    try:
        cfg = _fit(knobs, emitted, signature)
    except (ConfigError, TypeError) as exc:
        raise CompileError(f"configuration: {exc}", loc) from None
    log.info("%r: GEMM %s, epilogue loads staged %d deep%s", graph.name, cfg.short_name(), cfg.c_stages,
             "" if "cluster" in knobs else ", cluster chosen per call")

    arch = arch or os.environ.get("CUTE_DSL_ARCH") or None
    kernel = _kernel_for(graph, emitted, signature, cfg, arch, cache_dir, interface)
    if "cluster" in knobs:
        kernel.op  # noqa: B018 - define the custom operator now, not inside a torch.compile trace
        return kernel
    # No cluster asked for: the cluster shape is chosen per call (Kernel.cluster_for), the other
    # shapes compiled on first use through the same caches.  A kernel of its own, since a pinned
    # cluster of the same configuration shares the plain one.
    twin_key = kernel.key + interface.tag() + ":clusters"
    with _MEMORY_LOCK:
        twin = _MEMORY.get(twin_key)
        if twin is None:
            factory = functools.partial(_kernel_for, graph, emitted, signature, arch=arch,
                                        cache_dir=cache_dir, interface=interface)
            twin = _MEMORY[twin_key] = kernel._choosing_clusters(factory)
    twin.op  # noqa: B018 - define the custom operator now, not inside a torch.compile trace
    return twin


def _call_interface(user_fn, example_inputs, graph, emitted, strict: bool) -> CallInterface:
    """What calls accept besides the live operands: every parameter of the user's function is
    accepted, as calling the function would accept it (see :class:`evtc.kernel.CallInterface`)."""
    signature = read_signature(user_fn)
    live = set(user_operand_names(graph, emitted))
    unused: set[str] = set()
    constants: list[tuple[str, Any]] = []
    for name in signature.params:
        if name in live:
            continue
        value = example_inputs[name] if name in example_inputs else signature.defaults[name]
        # A tensor or a runtime scalar that no output depends on; anything else specialised the trace.
        runtime = isinstance(value, torch.Tensor) or (
            isinstance(value, int | float) and not isinstance(value, bool) and name in example_inputs)
        if runtime:
            unused.add(name)
        else:
            constants.append((name, value))
    return CallInterface(parameters=tuple(signature.params), unused=frozenset(unused),
                         constants=tuple(constants), strict=strict)


def _torch_kernel(graph, emitted, signature, interface, cache_dir, loc, reason: str, remedy: str) -> Kernel:
    """A kernel object for inputs the SM90 kernel cannot take at all (float32 ``a`` and ``b``, a
    batch broadcast between them): every call takes the torch path, so the API, the checks and the
    custom operator stay the same."""
    if interface.strict:
        raise CompileError(f"{reason}; strict=True refuses the torch path. {remedy}", loc)
    interface = replace(interface, torch_only=reason)
    key = hashlib.sha256(json.dumps({"torch": format_graph(graph), "signature": signature.describe(),
                                     "interface": interface.tag()}, sort_keys=True).encode()).hexdigest()
    with _MEMORY_LOCK:
        kernel = _MEMORY.get(key)
        if kernel is None:
            kernel = _MEMORY[key] = Kernel.torch_only(graph, emitted, signature, key, DiskCache(cache_dir),
                                                      interface)
    kernel.op  # noqa: B018 - define the custom operator now, not inside a torch.compile trace
    return kernel


def _kernel_for(graph, emitted, signature, cfg, arch, cache_dir, interface=None) -> Kernel:
    """The kernel of one configuration: from this process's memory, the disk cache, or a build."""
    meta = {
        "versions": _versions(),
        "config": repr(cfg),
        "signature": signature.describe(),
        "arch": arch or "device",
    }
    key_text = json.dumps({"source": emitted.source, **meta}, sort_keys=True)
    key = hashlib.sha256(key_text.encode()).hexdigest()

    # Kernels of one compiled code but other call interfaces (unused parameters, strict) are
    # separate objects over the same disk cache entry.
    interface = interface or CallInterface()
    memory_key = key + interface.tag()
    with _MEMORY_LOCK:
        hit = _MEMORY.get(memory_key)
    if hit is not None:
        log.debug("memory cache hit: %r, key %s", graph.name, key[:16])
        return hit
    cache = DiskCache(cache_dir)
    with cache.lock(key):
        with _MEMORY_LOCK:
            hit = _MEMORY.get(memory_key)
        if hit is not None:
            return hit
        kernel = Kernel(graph, emitted, signature, cfg, key, cache, arch, interface)
        kernel._materialize(meta)
        with _MEMORY_LOCK:
            _MEMORY[memory_key] = kernel
    return kernel


def _fit(knobs: dict[str, Any], emitted, signature):
    """The configuration of ``knobs``, its epilogue loads planned, checked to fit in shared memory.

    Where the epilogue's buffers (many or wide outputs) leave too few A/B stages, and the user did not
    choose them, narrower 128 x 16 subtiles are tried, then the cooperative schedule (one epilogue's
    buffers instead of the ping-pong schedule's two). Otherwise the first error says what to shrink.
    """
    from .codegen.config import ConfigError, GemmConfig

    attempts: list[dict[str, Any]] = [{}]
    if "epi_tile_n" not in knobs:
        attempts.append({"epi_tile_n": 16})
    if "schedule" not in knobs and "tile_n" not in knobs and "cluster" not in knobs:
        attempts.append({"schedule": "cooperative", **attempts[-1]})
    first_error = None
    for extra in attempts:
        try:
            cfg = GemmConfig(**{**knobs, **extra}).validate()
            cfg = _plan_epilogue_loads(cfg, emitted, signature, {**knobs, **extra})
            _ab_stages(emitted, signature, cfg, cfg.c_stages)  # raises where it does not fit
        except ConfigError as exc:
            first_error = first_error or exc
            continue
        if extra:
            log.info("%r: the epilogue's buffers do not fit with the default tiles; using %s",
                     emitted.class_name, extra)
        return cfg
    assert first_error is not None
    if len(attempts) > 1:
        tried = ", ".join("128x16 subtiles" if a == {"epi_tile_n": 16} else "the cooperative schedule"
                          for a in attempts[1:])
        raise ConfigError(f"{first_error} (also tried: {tried})")
    raise first_error


def _ab_stages(emitted, signature, cfg, load_stages: int) -> int:
    """A/B stages the kernel will have with ``load_stages`` epilogue-load stages (it plans its
    shared memory the same way: the visitor's buffers, then D's unless D shares C's)."""
    from .codegen.emit import operand_objects, reduction_objects
    from .codegen.fused import d_buffer_input

    cfg = cfg.replace(load_stages=load_stages)
    inputs, outputs = operand_objects(emitted, signature.tile_majors, signature.batched)
    stores = (cfg.epi_stages if cfg.epi_stages is not None else 2) * cfg.epi_groups
    # Pingpong: each consumer warpgroup has its own ring of ``load_stages`` epilogue-load buffers.
    buffers = load_stages * cfg.epi_groups
    smem = sum(o.smem_bytes(cfg.tile_shape_mnk[:2], cfg.epi_tile, buffers, stores)
               for o in inputs + outputs[1:] + reduction_objects(emitted))
    shares_d = cfg.shares_d_with_load(d_buffer_input(inputs, outputs[1:], cfg) is not None)
    return cfg.plan_stages(smem, shares_d)[0]


def _plan_epilogue_loads(cfg, emitted, signature, knobs: dict[str, Any]):
    """Stage the epilogue's loads as deep as the A/B pipeline allows, ideally for the whole tile.

    At small K the epilogue's memory traffic is what a fused epilogue costs; loads staged for the
    whole tile land while the mainloop runs (and a C with D's dtype then holds D too, see
    `GemmConfig.shares_d_with_load`). The A/B pipeline may go down to
    `GemmConfig.overlap_ab_stages` for it (and no further: fewer stages starve the tensor cores).
    Where a whole tile of the configured subtiles does not fit, 128x16 subtiles are tried for the
    whole tile unless the user chose `epi_tile_n` (narrower subtiles cost barriers, so only the whole
    tile is worth them). Otherwise the deepest staging that keeps those A/B stages wins, and failing
    that the old rule: at least 2 stages, as deep as costs no A/B stage.
    """
    from .codegen.config import ConfigError

    if "load_stages" in knobs or not any(p.kind in ("tile", "row", "col") for p in emitted.inputs):
        return cfg

    def deepest(cand) -> int | None:
        for depth in range(cand.num_subtiles, 1, -1):
            try:
                ab = _ab_stages(emitted, signature, cand, depth)
            except ConfigError:
                continue
            if ab >= cand.overlap_ab_stages():
                return depth
        return None

    depth = deepest(cfg)
    if depth != cfg.num_subtiles and "epi_tile_n" not in knobs and cfg.epi_tile_n != 16:
        narrow = cfg.replace(epi_tile_n=16)
        if deepest(narrow) == narrow.num_subtiles:
            return narrow.replace(load_stages=narrow.num_subtiles)
    if depth is not None:
        return cfg.replace(load_stages=depth)
    depth = cfg.c_stages
    floor = min(2, depth)
    ab_at_floor = _ab_stages(emitted, signature, cfg, floor)
    while depth > floor and _ab_stages(emitted, signature, cfg, depth) < ab_at_floor:
        depth -= 1
    return cfg.replace(load_stages=depth) if depth != cfg.c_stages else cfg


def clear_memory_cache() -> None:
    """Forget the kernels compiled in this process (the disk cache stays)."""
    with _MEMORY_LOCK:
        _MEMORY.clear()


# ---- the kernel ------------------------------------------------------------------------------------


__all__ = ["CallError", "CompileError", "Kernel", "clear_memory_cache", "compile"]

