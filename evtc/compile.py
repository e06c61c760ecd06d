"""``evtc.compile``: an epilogue in, a fused SM90 GEMM kernel you can call, read and trust out.

    k = evtc.compile(fn, example_inputs)
    D = k(a, b, C=C, bias=bias, alpha=0.7)    # what fn(acc, ...) returns, computed in one kernel

Steps: trace and optimize the epilogue (:func:`evtc.trace`), generate the visitor's source
(:mod:`evtc.codegen.emit`), plan the kernel (:mod:`evtc.plan`: layouts, configuration, shared memory,
what each call needs), then obtain it (:mod:`evtc.runtime.build`): from this process's memory, the
disk cache, or a build with the CuTe DSL. A compiled kernel serves every problem size and every
scalar value.

A call that was compiled before, in any process, skips all of that: its front key
(:mod:`evtc.runtime.front_key`) leads to the kernel's plan and its cache entry, loaded without
tracing and without the CuTe DSL.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from evtc.errors import CallError, CompileError, EpilogueError, InputError
from evtc.plan.config import ConfigError, GemmConfig, check_user_knobs
from evtc.plan.kernel_plan import CallInterface, KernelPlan, plan_kernel
from evtc.runtime.build import SOURCE, load
from evtc.runtime.cache import DiskCache
from evtc.runtime.dsl_lock import reinit_after_fork
from evtc.runtime.front_key import front_key
from evtc.runtime.kernel import Kernel
from evtc.runtime.variants import MEMORY, MEMORY_LOCK, VariantSource, kernel_for, memory_key

if TYPE_CHECKING:
    from evtc.api import OutDtypes

log = logging.getLogger("evtc")

# In-memory kernels by (front key, cache dir), and a lock per key (see _compile); guarded by
# MEMORY_LOCK, as the kernels by key (evtc.runtime.variants.MEMORY).
_FRONT: dict[tuple[str, str], Kernel] = {}
_FRONT_LOCKS: dict[tuple[str, str], threading.Lock] = {}
reinit_after_fork(_FRONT_LOCKS.clear)  # a fork's child makes new ones (a held lock would stay held)


def compile(  # noqa: A001 - the public name, as torch.compile
    fn: Callable[..., Any],
    example_inputs: Mapping[str, Any],
    *,
    out_dtypes: OutDtypes = None,
    config: Mapping[str, Any] | Any | None = None,
    arch: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    strict: bool = False,
    autotune: bool | None = None,
) -> Kernel:
    """Compile the epilogue ``fn`` into a fused GEMM kernel: ``D = fn(a @ b, ...)`` in one launch.

    Args:
        fn: the epilogue ``fn(acc, *operands)`` (see docs/epilogues.md).
        example_inputs: ``a``, ``b`` and one entry per operand, as for :func:`evtc.trace`. Only
            dtypes, shapes and memory layouts (which dim is contiguous) matter; sizes do not: the
            kernel serves every M, N, K, L. Meta tensors are fine.
        out_dtypes: as for :func:`evtc.trace`.
        config: knobs of the GEMM (a :class:`evtc.plan.config.GemmConfig` or a dict of its fields:
            ``tile_n``, ``epi_tile_n``, ``cluster``, ...). Dtypes and majors come from the examples.
        arch: compile for this GPU architecture (``"sm_90a"``) without a GPU; defaults to the
            ``CUTE_DSL_ARCH`` environment variable or the GPU present.
        cache_dir: the on-disk cache (default ``$EVTC_CACHE_DIR`` or ``~/.cache/evtc``).
        strict: raise a CallError (CompileError for float32 ``a`` and ``b``) where a call would
            otherwise take a slower path: aligned copies around the kernel, or torch.matmul and the
            epilogue evaluated by torch (docs/compile.md, "Call paths").
        autotune: time the candidate launches (tile, cluster, split count) on the first call in
            each size bucket and keep the fastest in the disk cache, per GPU model
            (:mod:`evtc.runtime.autotune`); None: on when ``$EVTC_AUTOTUNE`` is 1. Off, each call
            takes the launch of the fitted rules (docs/compile.md, "A launch per problem size").

    Returns:
        a :class:`evtc.runtime.kernel.Kernel`; ``k.source`` is the generated code, ``k.ptx`` the PTX,
        ``k.graph`` the IR, ``k.plan`` what each call does.

    Raises:
        EpilogueError: a subclass naming the problem (and the epilogue's line when there is one).
    """
    if not isinstance(strict, bool):
        raise CompileError(f"strict must be True or False, got {strict!r}")
    if autotune is not None and not isinstance(autotune, bool):
        raise CompileError(f"autotune must be True, False or None (the environment decides), got "
                           f"{autotune!r}")
    if cache_dir is not None and not isinstance(cache_dir, str | os.PathLike):
        raise CompileError(f"cache_dir must be a path (a str or os.PathLike), got {type(cache_dir).__name__}")
    try:
        kernel = _compile(fn, example_inputs, out_dtypes, config, arch, cache_dir, strict)
    except EpilogueError as err:
        raise err.with_traceback(None) from None
    if autotune is None:
        from evtc.runtime.autotune import enabled_by_env

        autotune = enabled_by_env()
    if not autotune:
        return kernel
    tuned = kernel.autotuned()
    tuned.op  # noqa: B018 - define the custom operator now, not inside a torch.compile trace
    return tuned


def _compile(fn, example_inputs, out_dtypes, config, arch, cache_dir, strict) -> Kernel:
    arch = arch or os.environ.get("CUTE_DSL_ARCH") or None
    if arch is None and not _hopper_present():
        # The DSL would target its own default architecture and fail deep inside: compile for
        # Hopper, whose kernels this machine's calls then run on the torch path.
        arch = "sm_90a"
    _check_arguments(fn, example_inputs, config, arch)
    fkey = front_key(fn, example_inputs, out_dtypes, config, arch, strict)
    if fkey is None:
        kernel, _ = _compile_traced(fn, example_inputs, out_dtypes, config, arch, cache_dir, strict)
        kernel = _judge_dtype_variants(kernel, fn, example_inputs, out_dtypes)
        kernel.op  # noqa: B018 - define the custom operator now, not inside a torch.compile trace
        return kernel
    # The directory itself, not the argument: EVTC_CACHE_DIR may change within the process.
    front_memo = (fkey, str(DiskCache(cache_dir).root))
    with MEMORY_LOCK:
        hit = _FRONT.get(front_memo)
        lock = _FRONT_LOCKS.setdefault(front_memo, threading.Lock())
    if hit is not None:
        return hit
    # One compile per front key at a time: threads asking for the same kernel wait for the first
    # and share its Kernel.
    with lock:
        with MEMORY_LOCK:
            hit = _FRONT.get(front_memo)
        if hit is not None:
            return hit
        kernel = _from_front_record(fkey, fn, example_inputs, out_dtypes, arch, cache_dir)
        if kernel is None:
            kernel, record = _compile_traced(fn, example_inputs, out_dtypes, config, arch, cache_dir, strict)
            if record is not None:
                DiskCache(cache_dir).commit_front(fkey, record)
        kernel = _judge_dtype_variants(kernel, fn, example_inputs, out_dtypes)
        kernel.op  # noqa: B018 - define the custom operator now, not inside a torch.compile trace
        with MEMORY_LOCK:
            _FRONT[front_memo] = kernel
        return kernel


def _judge_dtype_variants(kernel: Kernel, fn, example_inputs, out_dtypes) -> Kernel:
    """``kernel``, judging calls with other operand dtypes than the example's by tracing ``fn``
    again (:class:`evtc.runtime.dtype_variants.DtypeVariants`). Two functions may trace to one
    graph, and so share a kernel, on these examples and not on other dtypes (one reads
    ``C.dtype``, the other names float16): the second gets a handle of its own."""
    from evtc.runtime.dtype_variants import DtypeVariants

    if kernel.dtype_variants is not None and kernel.dtype_variants.fn is not fn:
        kernel = kernel.handle()
    if kernel.dtype_variants is None:
        kernel.dtype_variants = DtypeVariants(fn, example_inputs, out_dtypes, lambda: kernel.graph)
    return kernel


def graph_digest(graph) -> str:
    """A digest of a kernel graph's structure (ops, edges, attributes, dtypes, shapes, stages), which
    a front record keeps to check a graph traced again later."""
    from evtc.ir.passes.result import fingerprint

    return hashlib.sha256(repr(fingerprint(graph)).encode()).hexdigest()


def _retrace(fn, example_inputs, out_dtypes, digest: str):
    """The kernel's graph, traced again (for ``k.graph``, the torch path and the backward of a
    kernel loaded through its front record). It must be the graph the kernel was compiled from: a
    global, closure value or helper the epilogue reads may have changed since ``evtc.compile``
    (which the front key, computed at that time, could not see), and the torch path and the
    gradients would then compute another function than the kernel."""
    # Meta copies: the caller may reuse its dict for other compiles, and the kernel (kept in the
    # in-memory caches for the process's life) must not keep the example tensors' memory alive.
    from evtc.runtime.dtype_variants import meta_copy

    example_inputs = {name: meta_copy(value) for name, value in example_inputs.items()}

    def graph():
        from evtc.api import trace
        from evtc.ir.passes.gated import kernel_graph

        traced = kernel_graph(trace(fn, example_inputs, out_dtypes=out_dtypes))
        if graph_digest(traced) != digest:
            raise CompileError(
                f"{traced.name!r} no longer traces to the graph its kernel was compiled from: a global, "
                "closure value or helper that the epilogue reads changed after evtc.compile returned. "
                "The kernel computes the function as it was then; compile it again for the function "
                "as it is now")
        return traced

    return graph


#: The architectures evtc compiles for: Hopper's, with its warpgroup MMA and TMA.
ARCHES = ("sm_90a",)


def _hopper_present() -> bool:
    """Whether the current CUDA device may be a Hopper GPU (SM90), the one evtc's kernels run on: a
    GPU is present, and where CUDA is initialised already, it is SM90 (reading the capability
    otherwise would initialise CUDA here, which a process that forks workers later must not do)."""
    if not torch.cuda.is_available():
        return False
    return not torch.cuda.is_initialized() or torch.cuda.get_device_capability()[0] == 9


def _check_arguments(fn, example_inputs, config, arch) -> None:
    """What :func:`compile` takes besides the epilogue, checked before anything is keyed or traced:
    each mistake named here rather than failing deep in the cache key or the DSL."""
    from evtc.frontend.source import definition_location

    loc = definition_location(fn) if callable(fn) else None
    if not isinstance(example_inputs, Mapping):
        raise InputError(f"example inputs must be a dict of name -> tensor or scalar, got "
                         f"{type(example_inputs).__name__}", loc)
    if arch is not None and arch not in ARCHES:
        raise CompileError(f"arch={arch!r}: evtc compiles Hopper kernels (SM90: warpgroup MMA and TMA); "
                           f"arch must be one of {ARCHES} or None for the GPU present", loc)
    if config is None or isinstance(config, GemmConfig):
        return
    if not isinstance(config, Mapping):
        raise CompileError(f"config must be a dict of knobs or a GemmConfig, got {type(config).__name__}",
                           loc)
    try:
        check_user_knobs(config)
    except ConfigError as exc:
        raise CompileError(f"configuration: {exc}", loc) from None


def _from_front_record(fkey, fn, example_inputs, out_dtypes, arch, cache_dir) -> Kernel | None:
    """The kernel of a compile call made before, from its front record and its verified cache
    entry, or None (then the call takes the full path, which rebuilds what is missing)."""
    cache = DiskCache(cache_dir)
    record = cache.front(fkey)
    if record is None:
        return None
    try:
        plan = KernelPlan.from_json(record["plan"])
        config = GemmConfig(**record["config"])
        key, signature, chooses = record["key"], record["signature"], bool(record["clusters"])
        digest = record["graph"]
        family = tuple(GemmConfig(**c).validate() for c in record.get("family", [record["config"]]))
        if family[0] != config:
            return None
    except (KeyError, TypeError, ValueError):
        return None
    if plan is None:
        return None
    entry = cache.load(key)
    if entry is None:
        return None
    try:
        built = load(entry)
    except Exception as exc:  # noqa: BLE001 - the full path rebuilds it
        log.warning("disk cache entry %s does not load (%s); rebuilding it", entry["dir"], exc)
        return None
    built.origin = "disk"
    try:
        # Read now: the entry may be gone by the time a variant or k.source needs it (another
        # process's `python -m evtc cache clear`, a temp-file cleaner).
        source = (built.path / SOURCE).read_text()
    except OSError:
        return None
    retrace = _retrace(fn, example_inputs, out_dtypes, digest)
    kernel = Kernel(plan, config, key, cache, built, source=source, retrace=retrace)
    log.info("disk cache hit: %r loaded from %s by its front record, without tracing", plan.name, built.path)
    if chooses:
        factory = VariantSource(plan, lambda: source, signature, arch, cache_dir, retrace=retrace)
        kernel = kernel._choosing_clusters(factory, family)
    return kernel


def _float8_layout_message(signature) -> str:
    """Why float8 a and b of these layouts do not compile, and how to lay them out."""
    wrong = []
    if signature.a_major != "k":
        wrong.append("a (M, K) is column-major (M has unit stride): pass x.contiguous(), K innermost")
    if signature.b_major != "k":
        wrong.append("b (K, N) is row-major (N has unit stride): pass the weight w (N, K) as b = w.t() "
                     "with w contiguous, or b.t().contiguous().t()")
    return (f"{signature.a.dtype} a and b must both be K-major, as the H100's 8-bit tensor cores read "
            f"them (and as torch._scaled_mm takes them): {'; '.join(wrong)}. A call with another layout "
            "than the compiled one is staged through a K-major copy (docs/compile.md, 'Call paths'); "
            "an example of another layout is refused here, so that a weight is transposed once, not "
            "on every call")


def _compile_traced(fn, example_inputs, out_dtypes, config, arch, cache_dir, strict):
    """The full path: trace, optimize, generate, plan and obtain. Returns the kernel and its front
    record (None for a kernel without SM90 code)."""
    from evtc.api import trace
    from evtc.codegen.emit import emit, kernel_dtype_name
    from evtc.frontend.epilogue import unwrap
    from evtc.frontend.source import definition_location
    from evtc.ir.block_scales import scale_problem, split_inputs
    from evtc.ir.passes.gated import kernel_graph
    from evtc.plan.config import DEFAULT_SCHEDULE, FLOAT8_DTYPES, ConfigError
    from evtc.plan.signature import KernelSignature
    from evtc.plan.smem import fit_config

    user_fn = unwrap(fn)
    graph = kernel_graph(trace(fn, example_inputs, out_dtypes=out_dtypes))
    log.debug("traced %r: %d nodes, operands %s", graph.name, len(graph.nodes), list(graph.operands))
    loc = definition_location(user_fn)
    example_inputs, scales = split_inputs(example_inputs)
    emitted = emit(graph)
    signature = KernelSignature(graph, emitted, example_inputs)
    scale_rows = 0  # rows of a per block scale
    if scales is not None:
        problem, scale_rows = scale_problem(example_inputs["a"], example_inputs["b"], scales)
        if problem is not None:
            raise CompileError(f"block scales: {problem} (docs/fp8.md, 'Block scales')", loc)
        if example_inputs["a"].shape[-2] == 1:
            log.warning("%r: a has one row, so its block scales read as 1 x 128 blocks (a row each); "
                        "compile with an example of more rows for 128 x 128 blocks", graph.name)
        signature.set_block_scales(scale_rows)
    if signature.tile_majors:
        emitted = emit(graph, tile_majors=signature.tile_majors)
    interface = _call_interface(user_fn, example_inputs, graph, emitted, strict)
    shape_only = sorted(interface.unused & graph.size_reads)
    if shape_only:
        # The kernel takes no such operand, so a call could not check the shape the graph holds.
        name = shape_only[0]
        raise CompileError(f"the epilogue reads the shape or dtype of {name} ({name}.shape, .size(), .dim(), "
                           f".numel(), .dtype) but none of its values: the kernel takes no {name}, so a call "
                           "could not check that it has the compiled shape and dtype. Read sizes from acc "
                           "(acc.shape[...]), or pass a size as a Python number and a dtype as a constant",
                           loc)
    if interface.unused:
        log.info("%r: parameter(s) %s are unused after the passes: calls accept and ignore them",
                 graph.name, sorted(interface.unused))
    if signature.a.dtype == "float32" and (signature.a_major, signature.b_major) != ("k", "k"):
        # The tf32 wgmma reads both operands along K. Staging a transposed copy of the weight on
        # every call would cost more than it saves, so such examples keep torch's float32 matmul.
        wrong = [what for what, major in (("a is column-major", signature.a_major),
                                          ("b (K, N) is row-major", signature.b_major)) if major != "k"]
        reason = (f"float32 a and b run as tf32, whose wgmma reads both K-major, but {' and '.join(wrong)} "
                  "(torch.matmul follows torch.backends.cuda.matmul.allow_tf32)")
        return _torch_kernel(graph, emitted, signature, interface, cache_dir, loc, reason,
                             "Compile with a row-major a (M, K) and b = w.t() of a row-major (N, K) "
                             "weight for the tf32 kernel"), None
    if signature.a.dtype in FLOAT8_DTYPES and (signature.a_major, signature.b_major) != ("k", "k"):
        raise CompileError(_float8_layout_message(signature), loc)
    if signature.broadcast_batch is not None:
        return _torch_kernel(graph, emitted, signature, interface, cache_dir, loc, signature.broadcast_batch,
                             "Expand a or b so both have the same batch size"), None

    knobs: dict[str, Any]
    if config is None:
        knobs = {}
    elif isinstance(config, GemmConfig):
        # The fields the user set: those that differ from the defaults of its schedule.
        default = GemmConfig(schedule=config.schedule)
        knobs = {k: getattr(config, k) for k in GemmConfig.__dataclass_fields__
                 if getattr(config, k) != getattr(default, k)}
        if config.schedule != DEFAULT_SCHEDULE:
            knobs["schedule"] = config.schedule
    else:
        knobs = dict(config)
    if knobs.get("a_rows") is not None:
        raise CompileError("configuration: a_rows is not a compile knob: a kernel that chooses its launch "
                           "per problem size trims A's loads itself for problems with few rows (see "
                           "GemmConfig.a_rows)", loc)
    # Only reductions: no D (the kernel's D dtype is then that of a and b, for its unused buffer).
    d_dtype = kernel_dtype_name(emitted.outputs[0].dtype) if emitted.outputs else signature.a.dtype
    d_major = knobs.get("d_major", "n")
    if d_major == "m" and (len(emitted.outputs) != 1 or emitted.reductions):
        raise CompileError("configuration: d_major='m' (a column-major output) needs an epilogue with "
                           "one full-tile output and no reductions", loc)
    if d_major == "m" and emitted.outputs[0].dtype == torch.bool:
        raise CompileError("configuration: d_major='m' (a column-major output) needs a 16- or 32-bit "
                           "output; a bool output (a mask) is stored row-major", loc)
    signature.set_output_major(d_major)
    if signature.b.dtype != signature.a.dtype:
        knobs["b_dtype"] = signature.b.dtype  # float8 of the other format
    if knobs.get("block_scales"):
        raise CompileError("configuration: block_scales is not a compile knob: give a and b as (tensor, "
                           "scales) pairs (docs/fp8.md, 'Block scales')", loc)
    if scale_rows:
        knobs["block_scales"] = scale_rows
    knobs.update(ab_dtype=signature.a.dtype, d_dtype=d_dtype, a_major=signature.a_major,
                 b_major=signature.b_major, d_major=d_major, gated=graph.gated,
                 store_d=bool(emitted.outputs))
    chosen_by_evtc: frozenset[str] = frozenset()
    if len(emitted.outputs) > 1 and knobs.get("epi_stages") is None:
        # Extra outputs are staged like D, one buffer per D stage: fix the count so both agree.
        knobs["epi_stages"] = 2
        chosen_by_evtc = frozenset({"epi_stages"})
    try:
        cfg = fit_config(knobs, emitted, signature, chosen_by_evtc=chosen_by_evtc)
    except (ConfigError, TypeError) as exc:
        raise CompileError(f"configuration: {exc}", loc) from None
    log.info("%r: GEMM %s, epilogue loads staged %d deep%s", graph.name, cfg.short_name(), cfg.c_stages,
             "" if "cluster" in knobs else ", cluster chosen per call")
    _note_a_shallow_pipeline(graph.name, cfg, emitted, signature)

    plan = plan_kernel(graph, emitted, signature, interface)
    described = signature.describe()
    kernel = kernel_for(plan, emitted.source, described, cfg, arch, cache_dir, graph=graph)
    family = _tile_family(cfg, knobs, emitted, signature, plan)
    record = {"key": kernel.key, "graph": graph_digest(graph), "plan": plan.to_json(),
              "config": dataclasses.asdict(cfg),
              "clusters": "cluster" not in knobs, "signature": described,
              "family": [dataclasses.asdict(c) for c in family]}
    if "cluster" in knobs:
        return kernel, record
    # No cluster asked for: the cluster shape is chosen per call (Kernel.cluster_for), the other
    # shapes compiled on first use through the same caches.  A kernel of its own, since a pinned
    # cluster of the same configuration shares the plain one.
    from evtc.plan.selector import family_digest

    twin_key = memory_key(f"{kernel.key}{interface.tag()}:{family_digest(family, True)}", kernel._cache)
    with MEMORY_LOCK:
        twin = MEMORY.get(twin_key)
        if twin is None:
            source = emitted.source
            factory = VariantSource(plan, lambda: source, described, arch, cache_dir, graph=graph)
            twin = MEMORY[twin_key] = kernel._choosing_clusters(factory, family)
    return twin, record


# Knobs that fix the tile shape: with any of them the kernel keeps its tile for every problem.
_TILE_KNOBS = ("tile_m", "tile_n", "schedule", "cluster")


def _note_a_shallow_pipeline(name: str, cfg, emitted, signature) -> None:
    """Log where the epilogue's buffers leave the A/B pipeline shallower than
    `GemmConfig.overlap_ab_stages` (the depth that keeps the tensor cores fed; fewer stages measured
    up to 1.4x slower, docs/performance.md), with the knobs not yet set that may run it faster. A
    pinned ``ab_stages`` is the user's choice: nothing to say."""
    from evtc.plan.smem import ab_stages_of

    if cfg.ab_stages is not None:
        return
    stages = ab_stages_of(cfg, emitted, signature)
    if stages >= cfg.overlap_ab_stages():
        return
    knobs = ([] if cfg.epi_tile_n == 16 else ["{'epi_tile_n': 16}"]) + (
        [] if cfg.schedule == "cooperative" else ["{'schedule': 'cooperative'} (which fixes the tile)"])
    hint = f"; config={' or '.join(knobs)} may run faster" if knobs else ""
    log.info("%r: the epilogue's shared memory leaves the mainloop %d A/B stages, fewer than the %d "
             "that keep the tensor cores fed (GEMM %s)%s", name, stages, cfg.overlap_ab_stages(),
             cfg.short_name(), hint)


def _tile_family(cfg, knobs, emitted, signature, plan) -> tuple:
    """The configurations a kernel compiled without tile knobs may run a problem with
    (:func:`evtc.plan.selector.tile_family`), each planned like ``cfg`` for this epilogue, then the
    one-wave twins of its cooperative tiles (:func:`evtc.plan.selector.one_wave_twins`); just
    ``cfg`` where the user fixed the tile."""
    from evtc.plan.config import ConfigError
    from evtc.plan.selector import light_epilogue, one_wave_twins, tile_family
    from evtc.plan.smem import ab_stages_of, fit_config, holds_d_in_loads

    if any(knob in knobs for knob in _TILE_KNOBS):
        return (cfg,)
    user = {k: v for k, v in knobs.items() if k not in ("load_stages",)}

    def fit(shape: dict):
        try:
            return fit_config({**user, **shape}, emitted, signature)
        except (ConfigError, TypeError):
            return None

    light = light_epilogue(plan.epilogue_tiles, len(plan.outputs), len(plan.reductions))
    family = tile_family(cfg, fit, wide_pingpong=light)
    return family + one_wave_twins(family, lambda c: ab_stages_of(c, emitted, signature),
                                   lambda c: holds_d_in_loads(c, emitted, signature),
                                   loads_pinned="load_stages" in knobs)


def _user_operand_names(graph, emitted) -> set[str]:
    """The names the user passes for the kernel's live operands (a gated kernel's ``bias.gate`` and
    ``bias.up`` are both ``bias``)."""
    names = set()
    for p in emitted.inputs:
        if p.kind == "literal":
            continue
        operand = graph.operands.get(p.name)
        names.add(operand.half_of[0] if operand is not None and operand.half_of else p.name)
    return names


def _call_interface(user_fn, example_inputs, graph, emitted, strict: bool) -> CallInterface:
    """What calls accept besides the live operands: every parameter of the user's function is
    accepted, as calling the function would accept it (see
    :class:`evtc.plan.kernel_plan.CallInterface`)."""
    import torch

    from evtc.frontend.inputs import read_signature
    from evtc.numpy_scalars import is_numpy_scalar

    signature = read_signature(user_fn)
    live = _user_operand_names(graph, emitted)
    unused: set[str] = set()
    constants: list[tuple[str, Any]] = []
    defaults: list[tuple[str, Any]] = []
    for name in signature.params:
        default = signature.defaults.get(name)
        if name in live:
            if is_numpy_scalar(default):
                default = default.item()
            if name in example_inputs and isinstance(default, int | float) and not isinstance(default, bool) \
                    and isinstance(example_inputs[name], int | float):
                defaults.append((name, default))
            continue
        value = example_inputs[name] if name in example_inputs else signature.defaults[name]
        if is_numpy_scalar(value):
            value = value.item()  # the Python number or bool it holds, as the trace read it
        # A tensor or a runtime scalar that no output depends on; anything else specialised the trace.
        runtime = isinstance(value, torch.Tensor) or (
            isinstance(value, int | float) and not isinstance(value, bool) and name in example_inputs)
        if runtime:
            unused.add(name)
        else:
            constants.append((name, value))
    return CallInterface(parameters=tuple(signature.params), unused=frozenset(unused),
                         constants=tuple(constants), strict=strict, fixed_n=graph.fixed_n,
                         operand_variants=graph.operand_variants, defaults=tuple(defaults),
                         shape_reads=graph.shape_reads)


def _torch_kernel(graph, emitted, signature, interface, cache_dir, loc, reason: str, remedy: str) -> Kernel:
    """A kernel object for inputs the SM90 kernel cannot take at all (float32 ``a`` and ``b``, a
    batch broadcast between them): every call takes the torch path, so the API, the checks and the
    custom operator stay the same."""
    from evtc.ir.printer import format_graph

    if interface.strict:
        raise CompileError(f"{reason}; strict=True refuses the torch path. {remedy}", loc)
    interface = dataclasses.replace(interface, torch_only=reason)
    key = hashlib.sha256(json.dumps({"torch": format_graph(graph), "signature": signature.describe(),
                                     "interface": interface.tag()}, sort_keys=True).encode()).hexdigest()
    cache = DiskCache(cache_dir)
    mkey = memory_key(key, cache)
    with MEMORY_LOCK:
        kernel = MEMORY.get(mkey)
        if kernel is None:
            plan = plan_kernel(graph, emitted, signature, interface)
            kernel = MEMORY[mkey] = Kernel.torch_only(plan, graph, key, cache)
    return kernel


def clear_memory_cache() -> None:
    """Forget the kernels compiled in this process (the disk cache stays)."""
    with MEMORY_LOCK:
        MEMORY.clear()
        _FRONT.clear()
        _FRONT_LOCKS.clear()


__all__ = ["CallError", "CompileError", "Kernel", "clear_memory_cache", "compile"]
