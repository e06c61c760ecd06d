"""A compiled fused GEMM + epilogue: built or loaded from the disk cache, read, and called."""

from __future__ import annotations

import copy
import functools
import logging
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from evtc.errors import CallError, EpilogueError
from evtc.ir.block_scales import SCALE_BLOCK, is_pair, scale_problem
from evtc.ir.dtypes import torch_dtype
from evtc.plan.clusters import planned_clusters
from evtc.plan.config import GATED_SCALE_CHUNK, GemmConfig
from evtc.plan.kernel_plan import CallInterface, KernelPlan
from evtc.plan.operand_kinds import KINDS
from evtc.runtime import reductions, stream_buffers
from evtc.runtime.build import SOURCE, Built
from evtc.runtime.cache import DiskCache
from evtc.runtime.call_checks import check_device, check_tensor
from evtc.runtime.device import max_active_clusters
from evtc.runtime.reductions import ReductionFinish, size_function

if TYPE_CHECKING:
    from evtc.runtime.prebuild import Prebuild

log = logging.getLogger("evtc")

#: Operand dtypes a call may pass for a tensor compiled with another float dtype (torch path).
_FLOAT_OPERAND_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

@functools.cache
def _gpu_ok() -> str | None:
    """None when a Hopper GPU can run the kernel, else why not."""
    if not torch.cuda.is_available():
        return "this machine has no CUDA GPU"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return f"the GPU is sm_{major}{minor}; the kernel needs an SM90 (Hopper) GPU"
    return None


def _same_constant(value: Any, compiled: Any) -> bool:
    if isinstance(compiled, bool) or compiled is None:
        return value is compiled
    return not isinstance(value, torch.Tensor) and type(value) is type(compiled) and value == compiled


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def tf32_allowed() -> bool:
    """Whether torch multiplies float32 matrices in tf32 now. Torch 2.9 and later keep the setting as
    ``fp32_precision`` (its old ``allow_tf32`` flag raises once the new API has been used); older
    versions only have the flag."""
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)
    if precision is None:
        return bool(matmul.allow_tf32)
    return precision == "tf32"


def _halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up halves of ``t`` along its last dim: views, never copies (one torch call,
    cheaper than two slices)."""
    return t.chunk(2, dim=-1)


def _needs_grad(a, b, operands: dict) -> bool:
    """Whether any input requires grad (on the per-call path: no tuple or generator built)."""
    if getattr(a, "requires_grad", False) or getattr(b, "requires_grad", False):
        return True
    for value in operands.values():
        if getattr(value, "requires_grad", False):
            return True
    return False


def _built_config(config: GemmConfig, splits: int) -> GemmConfig:
    """The configuration whose kernel runs a launch of ``config`` with ``splits`` splits of K: its
    split-K build where K is split."""
    return config.replace(split_k=True) if splits > 1 and not config.split_k else config


def _memory_span(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, last byte + 1) of ``t``'s elements (non-negative strides, as torch's)."""
    start = t.data_ptr()
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return start, start + (last + 1) * t.element_size()


def _unaliased(targets: list, gemm_inputs, operands) -> list:
    """``targets`` (the out= tensors of full-tile outputs), each replaced by a new tensor where its
    memory overlaps ``a``'s or ``b``'s (``gemm_inputs``), or an operand's other than as the very
    same view: other CTAs may still read those (a's rows, b's columns, a shifted operand) while a
    tile's outputs are stored, a silent race. A tile output written over exactly the operand it is
    computed from is safe (each element is read before it is written, by the same CTA) and stays
    in place. The caller copies the new tensors into ``targets`` after the launch."""
    # Tensors of other storages cannot overlap (the common case: one cheap comparison each).
    storages = {target.untyped_storage().data_ptr() for target in targets}
    shared = [(t, gemm) for group, gemm in ((gemm_inputs, True), (operands, False))
              for t in group if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in storages]
    if not shared:
        return targets
    spans = [(t, _memory_span(t), gemm) for t, gemm in shared if t.numel()]
    outs = []
    for target in targets:
        fresh = target
        if target.numel():
            lo, hi = _memory_span(target)
            for t, (t_lo, t_hi), gemm in spans:
                if t.device != target.device or not (t_lo < hi and lo < t_hi):
                    continue
                same_view = (t.data_ptr() == target.data_ptr() and t.shape == target.shape
                             and t.stride() == target.stride() and t.dtype == target.dtype)
                if gemm or not same_view:
                    fresh = torch.empty_like(target)
                    break
        outs.append(fresh)
    return outs


def _invoke(fn, a, b, outs: tuple, ins: tuple, clusters: int, split, device, scales=None) -> None:
    """Launch a compiled function; ``split``: split-K's (splits, partials, counters) or None;
    ``scales``: block-scaled float8's (a's, b's) scales, handed over with a and b as pairs."""
    if scales is not None:
        a, b = (a, scales[0]), (b, scales[1])
    if split is None:
        fn(a, b, outs, ins, clusters)
    else:
        splits, partials_numel, counters_numel = split
        stream = stream_buffers.stream_key(device)
        fn(a, b, outs, ins, clusters, splits, stream_buffers.partials(device, partials_numel, stream),
           stream_buffers.counters(device, counters_numel, stream=stream))


def _twin_buffers(config: GemmConfig, compiled: GemmConfig) -> str:
    """What a one-wave twin (evtc.plan.selector.one_wave_twins) changes, for explain(): its D
    buffers and its loads' depth; nothing for other configurations."""
    from evtc.plan.selector import is_one_wave_twin

    if not is_one_wave_twin(config, compiled):
        return ""
    loads = f", loads {config.load_stages} deep" if config.load_stages is not None else ""
    return f" {config.epi_stages} D buffers{loads}"


class Kernel:
    """A compiled fused GEMM + epilogue. Call it like the epilogue's math:
    ``k(a, b, **operands, out=None)`` returns what the epilogue returns."""

    #: How many of the last outputs are the accumulator (its gate and up halves: 2), stored for a
    #: backward to read (evtc.Linear's saving twin sets it); 0 for every other kernel. The custom
    #: operator's autograd then reads them instead of recomputing ``a @ b``.
    saved_accumulators: int = 0

    def __init__(self, plan: KernelPlan, config: GemmConfig | None, key: str, cache: DiskCache,
                 built: Built | None = None, *, source: str | None = None, graph=None,
                 retrace: Callable[[], Any] | None = None):
        #: The plan every call follows (:mod:`evtc.plan.kernel_plan`).
        self.plan = plan
        self.interface: CallInterface = plan.interface
        #: The GEMM's configuration; None for a kernel without SM90 code (every call takes torch).
        self.config = config
        self.key = key
        #: The path the last call took: "kernel", "staged" (aligned copies around the kernel) or
        #: "torch" (torch.matmul and the epilogue evaluated by torch); see docs/compile.md.
        self.last_path = ""
        self._paths_logged: set[str] = set()
        self._cache = cache
        self._built = built
        self._fn = built.fn if built is not None else None
        self._source = source
        self._graph = graph
        self._retrace = retrace
        # Cluster shape and split-K per call (see cluster_for, splits_for): None keeps config for
        # every problem.
        self._variant_factory = None
        self._family: tuple[GemmConfig, ...] = (config,) if config is not None else ()
        # Autotuning (evtc.runtime.autotune): off unless this is the twin autotuned() returns.
        self._autotune = False
        self._autotuned_twin: Kernel | None = None
        self._tuned: dict[str, tuple[GemmConfig, int]] = {}
        self._tune_store = None
        self._tune_lock = threading.Lock()
        self._variants: dict[GemmConfig, Kernel] = {}
        self._pinned_splits: int | None = None
        self._variant_lock = threading.Lock()
        self._op = None
        self._backward = None  # the epilogue's backward graph, derived on first use
        self._call_setup()

    @classmethod
    def torch_only(cls, plan: KernelPlan, graph, key: str, cache: DiskCache) -> Kernel:
        """A kernel with no SM90 code: every call takes the torch path (``interface.torch_only``
        says why). Its source says so and shows the graph that torch evaluates."""
        from evtc.ir.printer import format_graph

        lines = [f"# evtc: no SM90 kernel: {plan.interface.torch_only}.",
                 "# Every call runs torch.matmul, then this epilogue graph evaluated by torch:", "#"]
        lines += ["#   " + line for line in format_graph(graph).splitlines()]
        return cls(plan, None, key, cache, source="\n".join(lines) + "\n", graph=graph)

    # ---- what it is ----------------------------------------------------------------------------
    @property
    def graph(self):
        """The optimized epilogue graph (traced again on first use when the kernel came from the
        disk cache without tracing)."""
        if self._graph is None:
            if self._retrace is None:
                raise RuntimeError("this kernel has no graph")
            self._graph = self._retrace()
        return self._graph

    @property
    def source(self) -> str:
        """The generated visitor source that the kernel was compiled from."""
        if self._source is None:
            self._source = (self._built.path / SOURCE).read_text() if self._built is not None else ""
        return self._source

    @property
    def origin(self) -> str:
        """How this kernel was obtained: "compiled", "disk" or "torch" (no SM90 code)."""
        return self._built.origin if self._built is not None else "torch"

    @property
    def seconds(self) -> float:
        """Seconds the build or the load took."""
        return self._built.seconds if self._built is not None else 0.0

    @property
    def cache_path(self) -> Path | None:
        """The disk cache entry of the kernel."""
        return self._built.path if self._built is not None else None

    @property
    def function_name(self) -> str:
        return f"evtc_{self.key[:24]}"

    def _choosing_clusters(self, factory, family: tuple[GemmConfig, ...] = ()) -> Kernel:
        """A twin of this kernel that picks its launch per problem: the cluster shape and split
        count, and the tile from ``family`` (:func:`evtc.plan.selector.tile_family`; this kernel's
        configuration first) where it has more than one. ``factory(config)`` gives the kernel of
        another configuration."""
        twin = copy.copy(self)
        twin._variant_factory = factory
        twin._family = tuple(family) or (self.config,)
        twin._variants = {self.config: self}
        twin._variant_lock = threading.Lock()
        twin._launch_memo = {}
        twin._op = None
        twin._autotuned_twin = None
        return twin

    def autotuned(self) -> Kernel:
        """This kernel with autotuning on (what ``evtc.compile(..., autotune=True)`` returns): the
        first call in each size bucket times the candidate launches on its own inputs and keeps the
        fastest in the disk cache (:mod:`evtc.runtime.autotune`). The compiled code, the variants
        and every result are shared with this kernel; only the choice of launch differs."""
        if self.config is None or self._autotune:
            return self
        with self._variant_lock:
            if self._autotuned_twin is None:
                twin = copy.copy(self)
                twin._autotune = True
                twin._tuned = {}
                twin._tune_store = None
                twin._tune_lock = threading.Lock()
                twin._launch_memo = {}
                twin._op = None
                self._autotuned_twin = twin
        return self._autotuned_twin

    @property
    def launch_tag(self) -> str:
        """A short digest of how calls choose their launch (the family of configurations, whether
        the cluster is chosen per call): kernels with the same compiled code but another choice get
        operators and tuning records of their own."""
        from evtc.plan.selector import family_digest

        if self.config is None:
            return ""
        return family_digest(self._family, self._variant_factory is not None)

    @property
    def autotunes(self) -> bool:
        """Whether calls time candidate launches (see :meth:`autotuned`)."""
        return self._autotune

    def cluster_for(self, m: int, n: int, batches: int = 1) -> tuple[int, int]:
        """The cluster shape the compiled tile runs an (L, M, N) problem with.

        ``config.cluster`` unless the kernel was compiled without a cluster knob and another shape
        needs fewer waves of tiles (:func:`evtc.plan.selector.with_cluster_for`, the rule calls
        use): a 1x2 cluster over a problem with one column of tiles leaves half the CTAs idle, so
        a 2x1 (or 1x1) kernel runs instead. A kernel that also chooses its tile may launch another
        tile, with that tile's cluster: :meth:`launch_for` gives the whole launch."""
        if self._variant_factory is None:
            return self.config.cluster
        from evtc.plan.selector import with_cluster_for

        return with_cluster_for(self.config, m, n, batches, self._slots).cluster

    def _slots(self, cluster: tuple[int, int]) -> int:
        """CTAs of clusters of this shape that the selector plans to run at once on the current GPU
        (:func:`evtc.plan.clusters.planned_clusters`)."""
        size = cluster[0] * cluster[1]
        return planned_clusters(size, max_active_clusters(size, self._cache.root)) * size

    @property
    def chooses_clusters(self) -> bool:
        """Whether calls pick the cluster shape per problem (no cluster knob was given)."""
        return self._variant_factory is not None

    def _variant(self, config: GemmConfig) -> Kernel:
        variant = self._variants.get(config)
        if variant is None:
            with self._variant_lock:
                variant = self._variants.get(config)
                if variant is None:
                    log.info("%r: this problem runs faster as %s; getting that kernel (compiled on "
                             "first use)", self.plan.name, config.short_name())
                    variant = self._variant_factory(config)
                    self._variants[config] = variant
        return variant

    @property
    def _can_split(self) -> bool:
        """Whether calls may split K: a split-K kernel, or one that chooses its launch shape."""
        return self.config is not None and (self.config.split_k or self._variant_factory is not None)

    def launch_for(self, m: int, n: int, k: int, batches: int = 1) -> tuple[GemmConfig, int]:
        """(configuration, splits of K) that a call on an (L, M, N, K) problem runs with.

        A kernel compiled without tile, schedule or cluster knobs chooses per problem size
        (:func:`evtc.plan.selector.choose_launch`): the tile shape from the configurations that fit
        its epilogue (64-row tiles for M <= 64, smaller tiles where few tiles would leave SMs idle,
        a wider cooperative tile for long K), the cluster shape, and the split count. Other
        kernels keep their configuration; those compiled with ``split_k=True`` still choose the
        split count. :meth:`pin_splits` fixes the split count. An autotuning kernel reports the
        tuned launch of the problem's size bucket once it has one."""
        if self.config is None:
            raise ValueError("launch_for: this kernel has no SM90 code (every call takes the torch path)")
        from evtc.plan.selector import choose_launch

        if self._autotune:
            from evtc.runtime.autotune import bucket

            tuned = self._tuned.get(bucket(m, n, k, batches))
            if tuned is not None:
                return tuned
        config, splits = choose_launch(m, n, k, batches, self._family, self._slots,
                                       choose_cluster=self._variant_factory is not None,
                                       pinned_splits=self._pinned_splits,
                                       epilogue_tiles=self.plan.epilogue_tiles)
        if not self._can_split:
            splits = 1
        return config, splits

    def splits_for(self, m: int, n: int, k: int, batches: int = 1) -> int:
        """How many splits of K a call on an (L, M, N, K) problem runs with (1: no split-K); see
        :meth:`launch_for`. On a problem with more tiles than fit at once, only the tiles past the
        last whole round are split (docs/compile.md, "Split tail")."""
        if not self._can_split:
            return 1
        return self.launch_for(m, n, k, batches)[1]

    def pin_splits(self, splits: int | None) -> None:
        """Run every call with ``splits`` splits of K (1: none), or (None) choose per problem again.
        For kernels that choose their launch shape or were compiled with ``split_k=True``; a
        split count above K's tiles runs with one split per K tile. A problem with more
        tiles than fit at once splits only the tiles past its last whole round."""
        if splits is not None and not (isinstance(splits, int) and 1 <= splits <= 4096):
            raise ValueError(f"pin_splits: splits must be an int in [1, 4096] or None, got {splits!r}")
        if splits is not None and splits > 1 and not self._can_split:
            raise ValueError("pin_splits: this kernel has a fixed configuration without split-K; compile "
                             "it with config={'split_k': True} (or without a cluster knob)")
        self._pinned_splits = splits
        self._launch_memo.clear()
        self._tuned.clear()  # tuned under the previous rule

    def prebuild(self, shapes: Iterable[Sequence[int]], *, wait: bool = True) -> Prebuild:
        """Build now the variants that calls on ``shapes`` will launch, so that those calls compile
        nothing: at start-up, or before capturing calls into a CUDA graph.

        ``shapes``: problem sizes (M, N, K) or (M, N, K, L). The variants are the ones
        :meth:`launch_for` reports (tile, cluster shape, and the split-K build where the split count
        is above 1); those already built are skipped. ``wait=False`` builds them in one background
        process and returns at once: a call that needs a variant still being built waits for that
        one only (through the disk cache), and calls that need others never wait. Returns a
        :class:`evtc.runtime.prebuild.Prebuild` (``configs``; ``wait()``, ``done()``).

        An autotuning kernel builds the rules' launches here; its candidates are built when a size
        bucket is first tuned."""
        from evtc.runtime import prebuild

        sizes = []
        for shape in shapes:
            shape = tuple(shape)
            if len(shape) not in (3, 4) or not all(isinstance(d, int) and d > 0 for d in shape):
                raise ValueError(f"prebuild: each shape is (M, N, K) or (M, N, K, L) of positive ints, "
                                 f"got {shape!r}")
            sizes.append(shape if len(shape) == 4 else (*shape, 1))
        if self.config is None:
            return prebuild.Prebuild(())
        configs = []
        for m, n, k, batches in sizes:
            config = _built_config(*self.launch_for(m, n, k, batches))
            if config not in configs:
                configs.append(config)
        missing = [c for c in configs if c != self.config and c not in self._variants]
        if wait or not missing:
            for config in missing:
                self._variant(config)
            return prebuild.Prebuild(configs)
        return prebuild.start([self._variant_factory.job(c) for c in missing], configs)

    # ---- reading ---------------------------------------------------------------------------------
    @property
    def ptx(self) -> str:
        """The kernel's PTX ("" for a kernel without SM90 code)."""
        return self._built.read_ptx() if self._built is not None else ""

    @property
    def stages(self) -> dict[str, int]:
        """Pipeline stages the kernel planned: ``ab`` (A/B), ``d`` (D stores), ``load`` (epilogue
        loads) and ``d_in_load`` (1 when D is staged in the epilogue-load buffers of C)."""
        return dict(self._built.stages) if self._built is not None else {}

    @property
    def smem(self) -> dict[str, int]:
        """Shared memory of the epilogue: ``visitor`` (its operands' buffers, bytes) and
        ``load_bytes_per_subtile``."""
        return dict(self._built.smem) if self._built is not None else {}

    def explain(self) -> str:
        """A summary: operands and their kinds, outputs, tile configuration, stages, shared memory,
        registers (from ptxas, when it is installed)."""
        from evtc.plan.config import SM90_SMEM_BYTES
        from evtc.plan.selector import is_one_wave_twin

        cfg = self.config
        lines = [f"evtc kernel {self.plan.name!r} ({self.origin}, {self.seconds:.2f} s)"]
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
        lines.append(f"  GEMM: {cfg.short_name()}; a {self.plan.a.describe()}, b {self.plan.b.describe()}")
        if self._variant_factory is not None:
            def shape(c: GemmConfig) -> str:
                tile = "" if (c.schedule, c.tile_m, c.tile_n) == (cfg.schedule, cfg.tile_m, cfg.tile_n) \
                    else f"{c.tile_m}x{c.tile_n}{' cooperative' if c.schedule != cfg.schedule else ''} "
                return (f"{tile}{c.cluster[0]}x{c.cluster[1]}" + (" split-K" if c.split_k else "")
                        + (f" {c.a_rows} rows of A" if c.a_rows is not None else "")
                        + _twin_buffers(c, cfg))

            built = ", ".join(shape(c) for c in self._variants if c != cfg) or "none yet"
            # dict.fromkeys: a tile's one-wave twin (evtc.plan.selector.one_wave_twins) names it again.
            tiles = ", ".join(dict.fromkeys(f"{c.tile_m}x{c.tile_n}"
                                            + (" " + c.schedule if c.schedule != cfg.schedule else "")
                                            for c in self._family))
            twins = [c for c in self._family if is_one_wave_twin(c, cfg)]
            if twins:
                tiles += (" (" + ", ".join(f"{c.tile_m}x{c.tile_n}" for c in twins)
                          + " with fewer epilogue buffers and one more A/B stage where each CTA runs one "
                          "tile)")
            lines.append(f"  cluster: {cfg.cluster[0]}x{cfg.cluster[1]}, or per call another shape where "
                         f"that needs fewer waves of tiles; tile per call from {tiles}; K split where "
                         f"too few tiles fill the GPU, or for a thin last round of tiles (other shapes "
                         f"built: {built})")
        lines.append("  inputs:")
        for plan in self.plan.inputs:
            spec, how = plan.spec, KINDS[plan.kind].how
            if plan.kind == "arg":
                lines.append(f"    {plan.name}: {how}")
            elif plan.kind == "literal":
                lines.append(f"    {plan.ident} = {plan.name}: {how}")
            else:
                batch = "per batch" if plan.batched else "shared by all batches"
                lines.append(f"    {spec.describe()}: {plan.kind}, {batch}; {how}")
        lines.append("  outputs:")
        for plan in self.plan.reductions:
            axis = {"row": "per row", "col": "per column", "batch": "per batch",
                    "all": "over everything"}[plan.axis]
            parts = "per column of each tile" if plan.axis == "col" else "per row of each tile"
            if self.plan.kernel_finish:
                where = "finished in the kernel by the last tile of each block of " + {
                    "row": "rows", "col": "columns", "batch": "rows, then the last block of each batch",
                    "all": "rows, then the last block of the launch"}[plan.axis]
                where += f" (on the host above {reductions.KERNEL_FINISH_MAX_OUTPUT:,} output elements)"
            else:
                where = "finished on the host"
            lines.append(f"    {plan.ident}: {plan.op} {axis}: partials {parts} in the kernel "
                         f"(float32 workspace), {where}")
        for i, spec in enumerate(self.plan.outputs):
            how = "stmatrix" if spec.dtype in ("float16", "bfloat16") else "register-to-shared copy"
            role = f"kernel D store ({how} + TMA)" if i == 0 else "extra TMA store"
            lines.append(f"    {spec.describe()}: {role}")
        stages, smem = self.stages, self.smem
        if stages:
            d_text = (f"D in the {stages['load']} load stages (written where C was read)"
                      if stages.get("d_in_load") else f"D {stages['d']}")
            lines.append(f"  stages: A/B {stages['ab']}, {d_text}, epilogue loads {stages['load']}")
        if smem:
            lines.append(f"  shared memory: epilogue operands {smem['visitor']} B, epilogue loads "
                         f"{smem['load_bytes_per_subtile']} B per subtile (of {SM90_SMEM_BYTES} B)")
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
        return f"<evtc.Kernel {self.plan.name} {what}>"

    # ---- calling ---------------------------------------------------------------------------------
    def _kernel_arguments(self, b, operands):
        """A gated kernel's arguments: b as its (gate, up) halves and each operand as wide as the
        GEMM as its two halves, under the kernel's names for them (views, never copies)."""
        args: dict[str, Any] = {}
        halves: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for i in self.plan.inputs:
            if i.half is not None:
                if i.user in operands:
                    if i.user not in halves:
                        halves[i.user] = _halves(operands[i.user])
                    args[i.name] = halves[i.user][i.half]
            elif i.name in operands:
                args[i.name] = operands[i.name]
        return _halves(b), args

    def _split(self, b, operands):
        """A gated kernel's arguments (see :meth:`_kernel_arguments`); others pass through."""
        if not self.plan.gated:
            return b, operands
        # Anything unusual (odd N, an unknown keyword, a wide operand of another width) goes to the
        # caller's _validate, which says what is wrong.
        n = b.shape[-1]
        if n % 2 or operands.keys() != self._name_set:
            raise ValueError("not a plain gated call")
        for name in self._wide_operands:
            if operands[name].shape[-1] != n:
                raise ValueError("not a plain gated call")
        return self._kernel_arguments(b, operands)

    def _call_setup(self) -> None:
        plan = self.plan
        # The kernel's operands (a gated kernel's include the halves of wide operands, "bias.gate"
        # and "bias.up") and the names the user passes.
        self._kernel_names = [i.name for i in plan.inputs if i.kind != "literal"]
        self._names = list(plan.operand_names)
        self._name_set = frozenset(self._names)
        self._labels = {i.name: i.label for i in plan.inputs}
        self._wide_operands = plan.wide_operands
        # How each kernel input is found per call: 0 a tensor operand, 1 a runtime scalar, 2 a
        # literal computed from the sizes.
        getters: list = []
        for i in plan.inputs:
            if i.kind == "literal":
                getters.append((2, size_function(i.expr)))
            elif i.kind == "arg":
                getters.append((1, i.name))
            else:
                getters.append((0, i.name))
        self._getters = getters
        self._kernel_name_count = len(self._kernel_names)
        self._gated = plan.gated
        self._batched = plan.batched
        self._d_by_m = plan.d_major == "m"
        # (M, N, L, device) -> (compiled function, clusters at once), see _run_kernel.
        self._launch_memo: dict = {}
        self._out_dtypes = [torch_dtype(s.dtype) for s in plan.outputs]
        # Per output: (dtype, the physical order of its dims or None when row-major, the permutation
        # back): what staging.empty_in_layout does, prepared once.
        rank = 3 if plan.batched else 2
        allocs = []
        for dt, spec in zip(self._out_dtypes, plan.outputs, strict=True):
            c = spec.contiguous if spec.contiguous is not None else rank - 1
            if c == rank - 1:
                allocs.append((dt, None, None))
            else:
                order = [i for i in range(rank) if i != c] + [c]
                allocs.append((dt, order, [order.index(i) for i in range(rank)]))
        self._out_allocs = allocs
        # Outputs in kernel order: the full-tile outputs, then those finished on the host.
        self._kernel_order = list(plan.output_order)
        self._host_outputs = plan.host_outputs
        self._tree = plan.structure
        self._single_output = plan.structure.kind == "single"
        # Whether calls may try the kernel at all (decided once: no torch-only reason, a Hopper GPU).
        self._kernel_runs: bool | None = None
        self._accepts_more = bool(self.interface.unused or self.interface.constants)
        # The compiled dtype of each tensor operand, by the name the user passes.
        self._operand_dtypes = {i.user: torch_dtype(i.spec.dtype) for i in plan.inputs
                                if i.spec is not None}
        # Elements per 16 bytes of the narrowest output dtype: an N that is not a multiple of it
        # needs padded output rows (the staged path).
        self._out_align = max((16 // torch.empty((), dtype=dt).element_size() for dt in self._out_dtypes),
                              default=1)
        self._finisher = (ReductionFinish(plan, self.config.tile_m, self.config.out_tile_n)
                          if plan.reductions and self.config is not None else None)
        # Block-scaled float8: rows of a per scale (1 or 128); 0: a and b are plain tensors.
        self._scale_rows = plan.a_scale_rows
        # float32 a and b: the kernel's wgmma is tf32, so it runs only where torch would use tf32 for
        # the same matmul (read per call, as torch does); other calls take the torch path.
        self._tf32 = self.interface.torch_only is None and plan.a.dtype == "float32"

    def _unpair(self, a, b):
        """A block-scaled kernel's a and b as (a, b, (a's scales, b's scales))."""
        for name, value in (("a", a), ("b", b)):
            if not is_pair(value):
                raise CallError(f"{name} must be a (tensor, block scales) pair: {self.plan.name!r} was "
                                f"compiled for block-scaled float8 a and b, got {type(value).__name__} "
                                "(docs/fp8.md, 'Block scales')")
        return a[0], b[0], (a[1], b[1])

    def __call__(self, a, b, *, out=None, **operands):
        """``D = k(a, b, C=C, alpha=0.7, ...)``: the epilogue of ``a @ b``, launched on the current CUDA
        stream. ``out`` (the same structure as the result) receives the outputs instead of new tensors.

        Under ``torch.compile`` the call is the kernel's custom operator (:attr:`op`), which the
        compiler sees as one opaque op with a shape function: no graph break."""
        if self._scale_rows and torch.is_grad_enabled():
            self._refuse_grad(a, b, operands)
        if torch.compiler.is_compiling() or (torch.is_grad_enabled() and _needs_grad(a, b, operands)):
            # The operator has an autograd formula (evtc.runtime.op_autograd).
            return self._call_op(a, b, out, operands)
        try:
            outs = self._launch(a, b, out, operands)
        except EpilogueError as err:
            raise err.with_traceback(None) from None
        if self._single_output:
            return outs[0]
        return self._tree.build(dict(zip(self._kernel_order, outs, strict=True)))

    @property
    def op(self):
        """This kernel as a PyTorch custom operator, ``torch.ops.evtc.<name>``: ``op(a, b, *operands)``
        with the operands in :attr:`operand_names` order (a block-scaled kernel's takes ``a, b,
        a_scales, b_scales, *operands``, and has no autograd formula), returning a tensor or a
        tuple of tensors in the kernel's output order. It has a fake (meta) implementation, so
        ``torch.compile`` traces through it and CUDA graphs capture it."""
        if self._op is None:
            from evtc.runtime.torch_op import register

            self._op = register(self)
        return self._op

    def backward_graph(self):
        """The epilogue's backward graph (:func:`evtc.ir.autodiff.backward`), derived once; what the
        custom operator's autograd formula evaluates (:mod:`evtc.runtime.op_autograd`)."""
        if self._backward is None:
            from evtc.ir.autodiff import backward
            from evtc.ir.passes.gated import join_halves

            # A gated kernel's graph is split into halves: the backward is derived from it joined
            # again (the whole accumulator, and halves of it as the user's chunk takes them).
            self._backward = backward(join_halves(self.graph))
        return self._backward

    @property
    def operand_names(self) -> list[str]:
        """The epilogue's operands after ``acc``, in the order :attr:`op` takes them."""
        return list(self._names)

    def run(self, a, b, operands: dict[str, Any]) -> list[torch.Tensor]:
        """Run a call (the kernel, the staged or the torch path) and return its outputs in kernel
        order (:attr:`plan` ``.output_order``): what :attr:`op` computes."""
        return self._launch(a, b, None, operands)

    def output_meta(self, m, n, batches) -> list[tuple[tuple, torch.dtype]]:
        """(shape, dtype) of every output in kernel order for an (L, M, N) GEMM (N: the GEMM's;
        sizes may be symbolic, for fake tensors)."""
        return self._output_meta(m, n, batches)

    def _scales_fit(self, a, b, scales) -> bool:
        """Whether block scales have the compiled granularity's shapes, float32, on a's device: the
        per-call check (what :func:`evtc.ir.block_scales.scale_problem` checks, without building a
        message; the slow path names what is wrong). ``b``: the user's, whole when gated."""
        a_scales, b_scales = scales
        m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
        if self._halves_off_scale_chunk(n):
            return False  # see _torch_reason
        blocks_k = -(-k // SCALE_BLOCK)
        rows = m if self._scale_rows == 1 else -(-m // SCALE_BLOCK)
        return (a_scales.dtype == torch.float32 and b_scales.dtype == torch.float32
                and a_scales.shape[:-2] == a.shape[:-2] and b_scales.shape[:-2] == b.shape[:-2]
                and a_scales.shape[-2:] == (rows, blocks_k)
                and b_scales.shape[-2:] == (blocks_k, -(-n // SCALE_BLOCK))
                and a_scales.device == a.device and b_scales.device == a.device)

    def _halves_off_scale_chunk(self, n: int) -> bool:
        """Whether a block-scaled gated kernel cannot take a B of ``n`` columns: its halves must
        be whole chunks of GemmConfig.scale_chunk columns (the torch path computes the others)."""
        return bool(self._scale_rows and self._gated and n // 2 % GATED_SCALE_CHUNK)

    def _refuse_grad(self, a, b, operands) -> None:
        """A block-scaled kernel has no derivative: a call whose inputs need one is an error, not a
        result without gradients."""
        tensors = [*(a if is_pair(a) else (a,)), *(b if is_pair(b) else (b,)), *operands.values()]
        if any(getattr(t, "requires_grad", False) for t in tensors):
            raise CallError(f"{self.plan.name!r} takes block-scaled float8 a and b, which have no autograd "
                            "formula, and an input requires grad; call it under torch.no_grad() or detach "
                            "the inputs (docs/fp8.md, 'Block scales')")

    def _call_op(self, a, b, out, operands):
        if not self._scale_rows and (is_pair(a) or is_pair(b)):
            raise CallError(f"a or b is a (tensor, scales) pair, but {self.plan.name!r} was compiled without "
                            "block scales: compile with pairs as example inputs (docs/fp8.md)")
        if self._accepts_more:
            operands = self._without_unused(operands)
        missing = [name for name in self._names if name not in operands]
        if missing:
            raise CallError(f"missing argument(s) {missing}; the epilogue takes {self._names}")
        scales = ()
        if self._scale_rows:
            a, b, scales = self._unpair(a, b)
        result = self.op(a, b, *scales, *[operands[name] for name in self._names])
        outs = [result] if len(self._kernel_order) == 1 else list(result)
        if out is not None:
            # The operator returns new tensors (a functional op is what the compiler can reorder);
            # out= then costs one copy per output.
            given = self._tree.flatten(out, _is_tensor)
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
        scales = None
        if self._scale_rows:
            a, b, scales = self._unpair(a, b)
        if self._kernel_runs is None:
            self._kernel_runs = self.interface.torch_only is None and _gpu_ok() is None
        if self._kernel_runs and (not self._tf32 or tf32_allowed()):
            try:
                outs, workspaces, problem = self._run_kernel(a, b, out, operands, stage=False, scales=scales)
            except (ValueError, TypeError, RuntimeError, KeyError, AttributeError, IndexError):
                pass  # the slow path finds out what it was
            else:
                self.last_path = "kernel"
                return outs + self._finish(out, workspaces, *problem, operands)
        return self._launch_slow(a, b, out, operands, scales)

    def _launch_slow(self, a, b, out, operands, scales=None) -> list[torch.Tensor]:
        """A call the fast path did not take: a CallError for wrong arguments; the torch path where
        the kernel cannot run at all; otherwise the kernel with aligned copies of the tensors whose
        layout it cannot take (the staged path). ``strict`` turns both paths into CallErrors."""
        reason = self._torch_reason(a, operands, b) if isinstance(a, torch.Tensor) else None
        if reason is None and self.interface.strict:
            self._validate(a, b, out, operands, scales)  # a wrong argument is named before any layout rule
        if reason is None:
            try:
                outs, workspaces, problem = self._run_kernel(a, b, out, operands, stage=True, scales=scales)
            except CallError:
                raise
            except (ValueError, TypeError, RuntimeError, KeyError, AttributeError, IndexError) as exc:
                # Staging copies whatever it is given: the compiled function then rejects a wrong
                # argument, and the checks below name it.
                self._validate(a, b, out, operands, scales)
                raise CallError(f"the kernel rejected arguments that evtc checked and staged: {exc} (an "
                                "evtc bug: please report it with the shapes and strides of the call)"
                                ) from None
            return outs + self._finish(out, workspaces, *problem, operands)
        self._validate(a, b, out, operands, scales)
        if reason is not None:
            if self.interface.strict:
                raise CallError(f"cannot run {self.plan.name!r} as a kernel: {reason}. strict=True "
                                "refuses the torch path (torch.matmul, then the epilogue evaluated by "
                                "torch) that would compute it instead")
            self._note_path("torch", reason)
        return self._run_torch(a, b, out, operands, scales)

    def _torch_reason(self, a, operands, b=None) -> str | None:
        """Why this call cannot run the SM90 kernel (it then takes the torch path), or None."""
        if self.interface.torch_only is not None:
            return self.interface.torch_only
        reason = _gpu_ok()
        if reason is not None:
            return reason
        if a.device.type != "cuda":
            return f"the tensors are on {a.device}"
        if self._tf32 and not tf32_allowed():
            return ("float32 a and b: the kernel multiplies them as tf32, which torch allows only with "
                    "torch.backends.cuda.matmul.allow_tf32 or fp32_precision = 'tf32' "
                    "(torch.set_float32_matmul_precision('high')); this call is computed in full float32")
        if a.shape[-1] == 0:
            return "K = 0 (the accumulator is all zeros)"
        if isinstance(b, torch.Tensor) and self._halves_off_scale_chunk(b.shape[-1]):
            return (f"b's halves have {b.shape[-1] // 2} columns, not a multiple of {GATED_SCALE_CHUNK}: "
                    "the kernel reads a gated B's block scales per 32 columns of each half")
        # An operand of another float dtype than compiled: the kernel loads the compiled one, but
        # the function widens every operand to float32 first, so the graph gives the same result
        # (output dtypes follow a and b and explicit casts, never an operand's dtype).
        for name, dtype in self._operand_dtypes.items():
            value = operands.get(name)
            if isinstance(value, torch.Tensor) and value.dtype != dtype \
                    and value.dtype in _FLOAT_OPERAND_DTYPES:
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
                    "which layouts take which path", self.plan.name, what, why)

    def _run_kernel(self, a, b, out, operands, *, stage: bool, scales=None):
        """Split, gather and launch. With ``stage``, tensors whose layout the kernel cannot take go
        through aligned copies (see :mod:`evtc.runtime.staging`). Returns the outputs in kernel order (the
        host outputs not yet), the reductions' workspaces and (M, N, L).

        This is the per-call path: everything it needs was prepared from the plan in
        :meth:`_call_setup`, and the cluster choice is memoised per problem size."""
        if scales is not None and not self._scales_fit(a, b, scales):
            raise ValueError("block scales of the wrong shape")  # _validate names the problem
        b, kernel_operands = self._split(b, operands) if self._gated else (b, operands)
        m = a.shape[-2]
        n = (b[0] if self._gated else b).shape[-1]  # the output's width
        batches = a.shape[0] if a.dim() == 3 else 1
        if a.shape[-1] == 0:
            raise ValueError("K = 0 takes the torch path")
        if len(kernel_operands) != self._kernel_name_count:
            raise KeyError("unknown arguments")
        ins = [kernel_operands[what] if kind == 0 else float(kernel_operands[what]) if kind == 1
               else float(what(batches, m, n)) for kind, what in self._getters]
        if not stage and (m if self._d_by_m else n) % self._out_align:
            raise ValueError("output rows are not 16-byte multiples: staged")  # cheaper than the DSL's error
        device = a.device
        targets = self._outputs(a, out, m, n, batches, layout=not stage)
        outs = targets
        if out is not None:
            outs = _unaliased(targets, (a, *(b if self._gated else (b,))), ins)
        if stage:
            a, b, ins, outs = self._stage(a, b, ins, outs)
        empty = m == 0 or n == 0 or batches == 0
        if not empty:
            k = a.shape[-1]
            launch_key = (m, n, k, batches, a.get_device())
            chosen = self._launch_memo.get(launch_key)
            if chosen is None:
                capturing = stream_buffers.stream_key(device) is None
                if not capturing:
                    # A size's first eager call (a warm-up) prepares the CUDA graph captures that
                    # may follow, at sizes that split or finish reductions in the kernel.
                    stream_buffers.ensure_capture_arena(device)
                if self._autotune and not capturing:
                    chosen = self._tuned_launch(a, b, ins, outs, m, n, k, batches, scales)
                else:
                    chosen = self._launch_choice(m, n, k, batches)
                if len(self._launch_memo) > 4096:  # many distinct sizes: start over rather than grow
                    self._launch_memo.clear()
                if not (self._autotune and capturing):  # a tuning kernel tunes this size when eager
                    self._launch_memo[launch_key] = chosen
            fn, clusters, split, finisher = chosen
        else:
            finisher = self._finisher
        # The reductions' partials are laid out by the launched configuration's tiles.
        workspaces = finisher.buffers(m, n, batches, device) if finisher is not None else []
        if empty:
            return targets, workspaces, (m, n, batches, finisher)
        _invoke(fn, a, b, tuple(outs + workspaces), tuple(ins), clusters, split, device, scales)
        if outs is not targets:
            for written, target in zip(outs, targets, strict=True):
                if written is not target:
                    target.copy_(written)
        return targets, workspaces, (m, n, batches, finisher)

    def _launch_choice(self, m: int, n: int, k: int, batches: int):
        """(compiled function, clusters that fit at once, split-K's (splits, partials, counters) or
        None, the reductions' host finish for its tile shape) for an (L, M, N, K) problem on the
        current GPU."""
        return self._resolve(*self.launch_for(m, n, k, batches), m, n, k, batches)

    def _resolve(self, config: GemmConfig, splits: int, m: int, n: int, k: int, batches: int):
        """The launch tuple of :meth:`_launch_choice` for a chosen configuration and split count,
        capped at K's tiles: every unit must have a K tile (the mainloop overwrites the accumulator
        with its first one). The rules and the tuner never exceed it; this is the one guard every
        launch passes."""
        from evtc.plan.split_k import splits_within_k, workspace_numels

        splits = splits_within_k(splits, k, config.tile_k)
        config = _built_config(config, splits)
        if not config.runs_rows(m):
            # Loads trimmed to fewer rows than the problem has (a launch tuned or chosen for a
            # shorter problem): the kernel that loads whole tiles instead.
            config = config.replace(a_rows=None)
        kernel = self if config == self.config else self._variant(config)
        cluster = config.cluster
        clusters = max_active_clusters(cluster[0] * cluster[1], self._cache.root)
        if not config.split_k:
            return kernel._fn, clusters, None, kernel._finisher
        numels = workspace_numels(m, n, batches, config, cluster, splits, clusters)
        return kernel._fn, clusters, (splits, *numels), kernel._finisher

    def _tuned_launch(self, a, b, ins, outs, m: int, n: int, k: int, batches: int, scales=None):
        """The launch of an autotuning kernel: the tuned one of the problem's size bucket (from
        this process, the disk cache, or timed now on the call's inputs into scratch outputs laid
        out like ``outs``, the buffers the call launches into)."""
        from evtc.runtime import autotune

        size = autotune.bucket(m, n, k, batches)
        launch = self._tuned.get(size)
        if launch is None:
            with self._tune_lock:  # one timing per bucket, and one writer of the store
                launch = self._tuned.get(size)
                if launch is None:
                    if self._tune_store is None:
                        self._tune_store = autotune.Store(self._cache.root,
                                                          torch.cuda.get_device_name(a.device),
                                                          self.key + self.interface.tag() + self.launch_tag)
                    launch = self._tune_store.get(size)
                    if launch is not None and not self._tunable(launch, k):
                        launch = None  # a record this kernel may not run: tuned again
                    if launch is None:
                        launch = self._time_candidates(a, b, ins, outs, m, n, k, batches, size, scales)
                    self._tuned[size] = launch
        return self._resolve(*launch, m, n, k, batches)

    def _tunable(self, launch: tuple[GemmConfig, int], k: int) -> bool:
        from evtc.plan.split_k import splits_within_k

        config, splits = launch
        if splits > 1 and not self._can_split:
            return False
        # A pinned count above K's tiles runs as one split per K tile (see launch_for).
        if (self._pinned_splits is not None
                and splits != splits_within_k(self._pinned_splits, k, config.tile_k)):
            return False
        return any(config.replace(cluster=c.cluster, split_k=c.split_k, a_rows=c.a_rows) == c
                   for c in self._family) and (
            self._variant_factory is not None or config.cluster == self.config.cluster)

    def _time_candidates(self, a, b, ins, outs, m, n, k, batches, size: str,
                         scales=None) -> tuple[GemmConfig, int]:
        from evtc.runtime import autotune

        default = self.launch_for(m, n, k, batches)
        launches = [c for c in autotune.candidates(m, n, k, batches, self._family, self._slots,
                                                   self._variant_factory is not None, default)
                    if self._tunable(c, k)]
        # Scratch outputs with the strides of the real ones (staged calls pad their rows).
        scratch = [torch.empty_strided(o.size(), o.stride(), dtype=o.dtype, device=o.device) for o in outs]
        times: dict[str, float] = {}
        timed = []
        for launch in launches:
            try:
                fn, clusters, split, finisher = self._resolve(*launch, m, n, k, batches)
            except Exception as exc:  # noqa: BLE001 - a candidate that cannot be built is skipped
                log.warning("%r: autotuning skips %s: %s", self.plan.name, autotune.describe(launch), exc)
                continue
            # The buffers a call of this launch would get (launches on one stream never overlap).
            buffers = tuple(scratch + (finisher.buffers(m, n, batches, a.device) if finisher is not None
                                       else []))

            def run(fn=fn, buffers=buffers, clusters=clusters, split=split):
                _invoke(fn, a, b, buffers, tuple(ins), clusters, split, a.device, scales)
            try:
                us = autotune.time_us(run)
            except (RuntimeError, ValueError, TypeError) as exc:
                log.warning("%r: autotuning skips %s: %s", self.plan.name, autotune.describe(launch), exc)
                continue
            times[autotune.describe(launch)] = round(us, 2)
            timed.append((launch, us))
        best = autotune.fastest(timed) if timed else default
        if self._pinned_splits is None:  # a choice limited by a pinned split count stays in memory
            self._tune_store.put(size, best, times)
        log.info("%r: autotuned %s: %s (%d candidates; the rules chose %s)", self.plan.name, size,
                 autotune.describe(best), len(timed), autotune.describe(default))
        return best

    def _stage(self, a, b, ins, targets):
        """Aligned copies of the inputs whose layout the kernel cannot take, padded buffers for the
        outputs it cannot write in place (copied into ``targets`` after the launch)."""
        from evtc.runtime.staging import aligned_copy, aligned_empty, layout_problem

        sig = self.plan
        b_parts = [("b (its gate half)", b[0]), ("b (its up half)", b[1])] if self.plan.gated else [("b", b)]
        named = [("a", a, sig.a)] + [(name, t, sig.b) for name, t in b_parts]
        named += [(plan.label, t, plan.spec)
                  for plan, t in zip(self.plan.inputs, ins, strict=True)
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
        b = tuple(staged(half) for half in b) if self.plan.gated else staged(b)
        return staged(a), b, [staged(t) for t in ins], outs

    def _run_torch(self, a, b, out, operands, scales=None) -> list[torch.Tensor]:
        """The torch path (:mod:`evtc.runtime.fallback`): outputs in kernel order, into ``out`` if given."""
        from evtc.runtime.fallback import run

        if scales is not None:  # block-scaled float8: the pairs, as the interpreter takes them
            a, b = (a, scales[0]), (b, scales[1])
        results = run(self.graph, a, b, operands)
        values = [results[name].contiguous() for name in self._kernel_order]
        if self.plan.d_major == "m":  # the layout the kernel would give
            from evtc.runtime.staging import empty_in_layout

            d, spec = values[0], self.plan.outputs[0]
            values[0] = empty_in_layout(tuple(d.shape), d.dtype, spec, d.device).copy_(d)
        if out is None:
            return values
        given = self._tree.flatten(out, _is_tensor)
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
                        f"{name}={value!r}: {self.plan.name!r} was compiled with {name}="
                        f"{constants[name]!r}, a compile-time constant (the trace specialised on it); "
                        "compile again with the new value")
            elif name not in self.interface.unused:
                kept[name] = value
        return kept

    def _output_meta(self, m, n, batches) -> list[tuple[tuple, torch.dtype]]:
        """(shape, dtype) of every output in kernel order, for an (L, M, N) GEMM (sizes may be
        symbolic: fake tensors)."""
        if self.plan.gated:
            n = n // 2  # N is the output's width in a gated graph
        tile = (batches, m, n) if self.plan.batched else (m, n)
        meta = [(tile, dt) for dt in self._out_dtypes]
        dims = {"M": m, "N": n, "L": batches, "1": 1}
        for host in self._host_outputs:
            meta.append((tuple(dims[d] for d in host.dims), torch_dtype(host.dtype)))
        return meta

    def _finish(self, out, workspaces, m, n, batches, finisher, operands) -> list[torch.Tensor]:
        """The host outputs (reductions and what follows them, finished by ``finisher``, that of the
        launched configuration), into ``out``'s tensors if given."""
        if not self._host_outputs:
            return []
        results = finisher(workspaces, m, n, batches, operands)
        if out is None:
            return results
        given = self._tree.flatten(out, _is_tensor)
        for host, value in zip(self._host_outputs, results, strict=True):
            target = given[host.name]
            if not isinstance(target, torch.Tensor) or target.shape != value.shape \
                    or target.dtype != value.dtype:
                raise CallError(f"out[{host.name!r}] must be a {value.dtype} tensor of shape "
                                f"{tuple(value.shape)}")
            target.copy_(value)
        return [given[h.name] for h in self._host_outputs]

    def _outputs(self, a, out, m, n, batches, layout: bool = True):
        if out is None:
            # New outputs in the plan's layouts (prepared in _call_setup: this is the per-call path).
            shape = (batches, m, n) if self._batched else (m, n)
            device = a.device
            return [torch.empty(shape, dtype=dt, device=device) if order is None
                    else torch.empty([shape[i] for i in order], dtype=dt, device=device).permute(inverse)
                    for dt, order, inverse in self._out_allocs]
        given = self._tree.flatten(out, _is_tensor)
        if given is None:
            raise CallError(f"out= must have the structure the epilogue returns ({self._describe_tree()})")
        tensors = []
        tile_names = self._kernel_order[:len(self.plan.outputs)]
        for name, spec, dt in zip(tile_names, self.plan.outputs, self._out_dtypes, strict=True):
            t = given[name]
            check_tensor(f"out[{name!r}]" if self._tree.kind != "single" else "out", t, spec, dt,
                         {"L": batches, "M": m, "N": n}, layout=layout)
            tensors.append(t)
        return tensors

    def _describe_tree(self) -> str:
        return self._tree.describe()

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

    def _validate(self, a, b, out, operands, scales=None) -> None:
        """Raise a CallError naming what is wrong with the arguments (the slow path of a call).

        Layouts are not checked here: a layout the kernel cannot take is staged (:meth:`_stage`)."""
        sig = self.plan
        for name, t in (("a", a), ("b", b)):
            if is_pair(t):
                raise CallError(f"{name} is a (tensor, scales) pair, but {sig.name!r} was compiled without "
                                "block scales: compile with pairs as example inputs (docs/fp8.md)")
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
        if self.plan.gated:
            self._validate_gated(b, operands)
            (gate, up), operands = self._kernel_arguments(b, operands)
            b_parts = [("b (its gate half)", gate), ("b (its up half)", up)]
        sizes = {"M": a.shape[-2], "K": a.shape[-1], "N": b_parts[0][1].shape[-1],
                 "L": max(batches) if batches else 1}
        device = a.device
        # a and b each with its own batch size (they may broadcast, on the torch path).
        check_tensor("a", a, sig.a, torch_dtype(sig.a.dtype), {**sizes, "L": a.shape[0]}, layout=False)
        for name, part in b_parts:
            check_tensor(name, part, sig.b, torch_dtype(sig.b.dtype), {**sizes, "L": b.shape[0]},
                         layout=False)
        for plan in self.plan.inputs:
            spec = plan.spec
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
            dtype = dtype if dtype in _FLOAT_OPERAND_DTYPES else torch_dtype(spec.dtype)
            check_tensor(plan.label, value, spec, dtype, sizes,
                         layout=False)
        outs = self._outputs(a, out, sizes["M"], sizes["N"], sizes["L"], layout=False) \
            if out is not None else []
        if self._scale_rows:
            problem, _ = scale_problem(a, b, scales, self._scale_rows)
            if problem is not None:
                raise CallError(f"{problem} (docs/fp8.md, 'Block scales')")
        tensors = [("a", a), ("b", b)] + [(p.label, operands[p.name])
                                          for p in self.plan.inputs if p.kind not in ("arg", "literal")]
        tensors += [(f"out[{i}]", t) for i, t in enumerate(outs)]
        for name, t in tensors:
            check_device(name, t, device)
