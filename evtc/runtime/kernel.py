"""A compiled fused GEMM + epilogue: what it is, which launch each problem size gets, and its calls.

The call path reads only what was prepared from the plan (:mod:`evtc.runtime.call_spec`); what it
needs besides lives in one module per job: the slow path's checks (:mod:`evtc.runtime.call_checks`),
the staged and torch paths (:mod:`evtc.runtime.staging`, :mod:`evtc.runtime.fallback`), the launch
itself (:mod:`evtc.runtime.invoke`), ``out=`` aliasing (:mod:`evtc.runtime.out_aliasing`),
autotuning (:mod:`evtc.runtime.autotune`) and ``explain()`` (:mod:`evtc.runtime.explain`)."""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from evtc.errors import CallError, EpilogueError
from evtc.ir.block_scales import is_pair
from evtc.plan.clusters import planned_clusters
from evtc.plan.config import GemmConfig
from evtc.plan.kernel_plan import CallInterface, KernelPlan
from evtc.runtime import call_checks, stream_buffers
from evtc.runtime.broadcasts import to_compiled_shapes
from evtc.runtime.build import SOURCE, Built
from evtc.runtime.cache import DiskCache
from evtc.runtime.call_spec import CallSpec
from evtc.runtime.device import hbm_bytes_per_us, max_active_clusters
from evtc.runtime.invoke import built_config, invoke
from evtc.runtime.out_aliasing import unaliased
from evtc.runtime.reductions import ReductionFinish
from evtc.runtime.staging import stage_call, stage_scales

if TYPE_CHECKING:
    from evtc.runtime.prebuild import Prebuild

log = logging.getLogger("evtc")



class _SplitPin:
    """The split count :meth:`Kernel.pin_splits` fixed, shared by the handles of one kernel (the
    kernel and its autotuned twin), which forget their memoised launches when it changes."""

    def __init__(self, kernel: Kernel) -> None:
        self.splits: int | None = None
        self.handles: list[Kernel] = [kernel]


class Kernel:
    """A compiled fused GEMM + epilogue. Call it like the epilogue's math:
    ``k(a, b, **operands, out=None)`` returns what the epilogue returns."""

    #: How many of the last outputs are the accumulator (its gate and up halves: 2), stored for a
    #: backward to read (evtc.Linear's saving twin sets it); 0 for every other kernel. The custom
    #: operator's autograd then reads them instead of recomputing ``a @ b``.
    saved_accumulators: int = 0
    #: Judges calls whose operands have other dtypes than the example's
    #: (:class:`evtc.runtime.dtype_variants.DtypeVariants`; evtc.compile sets it). Without it such
    #: calls are checked operand by operand against the plan's operand_variants.
    dtype_variants = None

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
        # Autotuning (evtc.runtime.autotune.Tuner): None unless this is the twin autotuned() returns.
        self._tuner = None
        self._autotuned_twin: Kernel | None = None
        self._variants: dict[GemmConfig, Kernel] = {}
        self._pin = _SplitPin(self)
        self._variant_lock = threading.Lock()
        self._op = None
        self._backward = None  # the epilogue's backward graph, derived on first use
        #: The operator's backward as one kernel that recomputes the accumulator with dZ as its
        #: epilogue (evtc.dz_pass.recomputed_gradients), by the gradients it gives and the call's
        #: layouts; False where there is none.
        self.recomputed_dz: dict[tuple, tuple | bool] = {}
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
        twin = self._copy(_variant_factory=factory, _family=tuple(family) or (self.config,),
                          _variants={self.config: self}, _variant_lock=threading.Lock(),
                          _launch_memo={}, _autotuned_twin=None)
        twin._pin = _SplitPin(twin)
        return twin

    def _copy(self, **fields: Any) -> Kernel:
        """A shallow copy with ``fields`` replaced, and an operator of its own to bind on first use
        (the twins of :meth:`_choosing_clusters`, :meth:`autotuned` and :meth:`handle`)."""
        twin = copy.copy(self)
        twin._op = None
        twin.__dict__.update(fields)
        return twin

    def handle(self) -> Kernel:
        """Another handle of this kernel: the same compiled code, variants and launch choices, with
        call state of its own (its last path, the function its calls are judged by)."""
        twin = self._copy(dtype_variants=None)
        self._pin.handles.append(twin)  # one pin for both handles
        return twin

    def autotuned(self) -> Kernel:
        """This kernel with autotuning on (what ``evtc.compile(..., autotune=True)`` returns): the
        first call in each size bucket times the candidate launches on its own inputs and keeps the
        fastest in the disk cache (:mod:`evtc.runtime.autotune`). The compiled code, the variants
        and every result are shared with this kernel; only the choice of launch differs."""
        if self.config is None or self._tuner is not None:
            return self
        with self._variant_lock:
            if self._autotuned_twin is None:
                from evtc.runtime.autotune import Tuner

                twin = self._copy(_tuner=Tuner(), _launch_memo={})
                self._pin.handles.append(twin)  # one pin for both handles
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
        return self._tuner is not None

    @property
    def tuner(self):
        """The tuned launches of an autotuning kernel (:class:`evtc.runtime.autotune.Tuner`), else None."""
        return self._tuner

    @property
    def cache_root(self) -> Path:
        """The root of the disk cache this kernel lives in."""
        return self._cache.root

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

        return with_cluster_for(self.config, m, n, batches, self.slots, trims_a=len(self._family) > 1).cluster

    def slots(self, cluster: tuple[int, int]) -> int:
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
    def can_split(self) -> bool:
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
        for name, size in (("m", m), ("n", n), ("k", k), ("batches", batches)):
            if isinstance(size, bool) or not isinstance(size, int | torch.SymInt) \
                    or isinstance(size, int) and size < 1:
                raise CallError(f"launch_for: {name} must be a positive int (a problem with no elements "
                                f"launches nothing), got {size!r}")
        from evtc.plan.selector import choose_launch

        if self._tuner is not None:
            from evtc.runtime.autotune import bucket

            tuned = self._tuner.tuned.get(bucket(m, n, k, batches))
            if tuned is not None:
                return tuned
        config, splits = choose_launch(m, n, k, batches, self._family, self.slots,
                                       choose_cluster=self._variant_factory is not None,
                                       pinned_splits=self._pin.splits,
                                       epilogue_tiles=self.plan.epilogue_tiles,
                                       hbm_bytes_per_us=hbm_bytes_per_us())
        if not self.can_split:
            splits = 1
        return config, splits

    def splits_for(self, m: int, n: int, k: int, batches: int = 1) -> int:
        """How many splits of K a call on an (L, M, N, K) problem runs with (1: no split-K); see
        :meth:`launch_for`. On a problem with more tiles than fit at once, only the tiles past the
        last whole round are split (docs/compile.md, "Split tail")."""
        if not self.can_split:
            return 1
        return self.launch_for(m, n, k, batches)[1]

    def pin_splits(self, splits: int | None) -> None:
        """Run every call with ``splits`` splits of K (1: none), or (None) choose per problem again.
        For kernels that choose their launch shape or were compiled with ``split_k=True``; a
        split count above K's tiles runs with one split per K tile. A problem with more
        tiles than fit at once splits only the tiles past its last whole round.

        The pin belongs to the kernel, not to one handle of it: ``evtc.compile`` returns the same
        :class:`Kernel` for the same function, example inputs and options within a process, so
        every handle of it runs pinned (compile a differently named function for an unpinned one)."""
        if splits is not None and not (isinstance(splits, int) and 1 <= splits <= 4096):
            raise ValueError(f"pin_splits: splits must be an int in [1, 4096] or None, got {splits!r}")
        if splits is not None and splits > 1 and not self.can_split:
            raise ValueError("pin_splits: this kernel has a fixed configuration without split-K; compile "
                             "it with config={'split_k': True} (or without a cluster knob)")
        self._pin.splits = splits
        for handle in self._pin.handles:  # this kernel and its autotuned twin
            handle._launch_memo.clear()
            if handle._tuner is not None:
                handle._tuner.tuned.clear()  # tuned under the previous rule

    @property
    def pinned_splits(self) -> int | None:
        """The split count :meth:`pin_splits` fixed, or None (chosen per problem)."""
        return self._pin.splits

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
            config = built_config(*self.launch_for(m, n, k, batches))
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
        registers (from ptxas, when it is installed); see :mod:`evtc.runtime.explain`."""
        from evtc.runtime.explain import explain

        return explain(self)

    @property
    def family(self) -> tuple[GemmConfig, ...]:
        """The configurations calls choose their tile from (this kernel's first)."""
        return self._family

    @property
    def built_configs(self) -> tuple[GemmConfig, ...]:
        """The configurations of this kernel built in this process so far (this kernel's first)."""
        return tuple(self._variants) if self._variant_factory is not None else (self.config,)

    def __copy__(self) -> Kernel:
        # A shallow copy (the twins of _choosing_clusters, handle, autotuned), made here because
        # __reduce__ refuses pickling, which copy.copy would otherwise go through.
        twin = object.__new__(type(self))
        twin.__dict__.update(self.__dict__)
        return twin

    def __deepcopy__(self, memo: dict) -> Kernel:
        """The kernel itself: its compiled code does not change, so a deep copy of a module that
        holds one (an EMA copy, ``copy.deepcopy(model)``) shares it."""
        return self

    def __reduce__(self) -> Any:
        raise TypeError(f"an evtc kernel ({self.plan.name!r}) cannot be pickled: it holds a loaded GPU "
                        "library. Pickle what it was compiled from and call evtc.compile in the process "
                        "that loads it (a disk-cache hit, milliseconds); evtc.nn modules pickle as modules")

    def __repr__(self) -> str:
        what = self.config.short_name() if self.config is not None else "torch path"
        return f"<evtc.Kernel {self.plan.name} {what}>"

    # ---- calling ---------------------------------------------------------------------------------
    def _call_setup(self) -> None:
        #: What every call needs from the plan, prepared once (shared by every variant).
        self.call_spec = CallSpec(self.plan)
        # (M, N, K, L, device) -> (compiled function, clusters at once, split, finish): _run_kernel.
        self._launch_memo: dict = {}
        # Whether calls may try the kernel at all (decided on the first call: no torch-only
        # reason, a Hopper GPU).
        self._kernel_runs: bool | None = None
        self._finisher = (ReductionFinish(self.plan, self.config.tile_m, self.config.out_tile_n)
                          if self.plan.reductions and self.config is not None else None)

    def __call__(self, a, b, *positional, out=None, **operands):
        """``D = k(a, b, C=C, alpha=0.7, ...)``: the epilogue of ``a @ b``, launched on the current CUDA
        stream. ``out`` (the same structure as the result) receives the outputs instead of new tensors.

        Under ``torch.compile`` the call is the kernel's custom operator (:attr:`op`), which the
        compiler sees as one opaque op with a shape function: no graph break."""
        spec = self.call_spec
        if positional:
            operands = self._by_position(positional, operands)
        if out is not None and not torch.compiler.is_compiling():
            call_checks.resize_empty_outputs(spec, out, a, b)  # torch.empty(0) for out=, as torch takes it
        if out is not None and torch.is_grad_enabled():
            _refuse_out_requiring_grad(spec, out)
            if call_checks.needs_grad(a, b, operands):
                raise CallError("out= with an input that requires grad: a call into out= is not "
                                "differentiable (torch refuses it too); call under torch.no_grad(), or "
                                "without out=")
        if spec.scale_rows and torch.is_grad_enabled():
            call_checks.refuse_grad(spec, a, b, operands)
        if torch.compiler.is_compiling() or _jit_tracing() or _dispatch_modes() or (
                type(a) not in _PLAIN_TENSORS and _without_memory(a)) or (
                torch.is_grad_enabled() and call_checks.needs_grad(a, b, operands)):
            # The operator has an autograd formula (evtc.runtime.op_autograd), torch.jit.trace
            # and make_fx record it as one op (a launch they cannot see would leave only the
            # outputs' allocation), any other dispatch mode (FlopCounterMode, a debug mode) sees
            # it, and fake tensors get its shape function (the launch path would keep fake buffers
            # for later real calls).
            return self._call_op(a, b, out, operands)
        try:
            outs = self._launch(a, b, out, operands)
        except EpilogueError as err:
            raise err.with_traceback(None) from None
        except _UnderFunctorch:
            # torch.func.vmap's batched tensors, FakeTensorMode's and make_fx's tensors have no
            # memory to launch on: the custom operator, which vmap runs per sample and the others
            # run through its fake (shape) implementation or record.
            return self._call_op(a, b, out, operands)
        if out is not None:
            _bump_versions(spec, out)
        return outs[0] if spec.single_output else spec.result(outs)

    def _by_position(self, positional: tuple, operands: dict) -> dict:
        """``operands`` with the operands given by position (``k(a, b, C, bias)``) named, in the
        order of the epilogue's parameters, as calling the function would take them."""
        return call_checks.by_position(self.plan.interface.parameters, positional, operands,
                                       f"{self.plan.name!r}", ("a", "b"))

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
        elif self._op_binding.get(self._op_name) is not self:
            # Kernel objects of one compiled code share the operator, which runs the one that
            # called it last (its last_path and saved accumulators are the ones its caller reads).
            # Written only when it changes: under torch.compile a write is a side effect, which
            # dynamo refuses inside activation checkpointing (fullgraph=True).
            self._op_binding[self._op_name] = self
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
        return list(self.call_spec.names)

    def run(self, a, b, operands: dict[str, Any]) -> list[torch.Tensor]:
        """Run a call (the kernel, the staged or the torch path) and return its outputs in kernel
        order (:attr:`plan` ``.output_order``): what :attr:`op` computes. Its tensors have the
        compiled ranks and batches (the operator's shape function assumes them): no broadcast is
        made into views here, the caller (``__call__`` under autograd or torch.compile) made them."""
        return self._launch(a, b, None, operands, broadcasts=False)

    def output_meta(self, m, n, batches) -> list[tuple[tuple, torch.dtype]]:
        """(shape, dtype) of every output in kernel order for an (L, M, N) GEMM (N: the GEMM's;
        sizes may be symbolic, for fake tensors)."""
        return self.call_spec.output_meta(m, n, batches)

    def _call_op(self, a, b, out, operands):
        spec = self.call_spec
        if not spec.scale_rows and (is_pair(a) or is_pair(b)):
            raise CallError(f"a or b is a (tensor, scales) pair, but {self.plan.name!r} was compiled without "
                            "block scales: compile with pairs as example inputs (docs/fp8.md)")
        if spec.accepts_more:
            operands = call_checks.without_unused(spec, operands)
        call_checks.check_names(spec, operands)  # the operator takes spec.names only: nothing unnamed
        call_checks.refuse_tensor_scalars(spec, operands)
        self._refuse_other_dtypes(operands)
        scales = ()
        if spec.scale_rows:
            a, b, scales = call_checks.unpair(spec, a, b)
        if not torch.compiler.is_compiling():  # fake tensors are plain; a dispatch mode's may not be
            a, b, operands, scales, _ = call_checks.plain_copies(a, b, operands, scales)
        refusals: dict[str, str] = {}  # rank changes an output would take, by operand (broadcasts.py)
        views = to_compiled_shapes(self.plan, a, b, operands, scales, refusals)
        if refusals:
            # As on the call path: a more basic problem (a's dtype, another operand's shape) is
            # named first, then the rank change where its operand's shape is checked. Fake tensors
            # (torch.compile) are not checked here: the refusal itself.
            if not torch.compiler.is_compiling():
                call_checks.validate(spec, a, b, None, operands, scales, refusals)
            raise CallError(next(iter(refusals.values())))
        if views is not None:  # views autograd sees through: gradients come back in the caller's shapes
            a, b, operands, scales = views
        if torch.is_grad_enabled() and call_checks.needs_grad(a, b, operands):
            call_checks.refuse_functorch_autograd(f"{self.plan.name!r}")
        result = self.op(a, b, *scales, *[operands[name] for name in spec.names])
        outs = [result] if len(spec.kernel_order) == 1 else list(result)
        if out is not None:
            # The operator returns new tensors (a functional op is what the compiler can reorder);
            # out= then costs one copy per output.
            outs = call_checks.copy_into_given(spec, out, spec.kernel_order, outs)
        return spec.result(outs)

    def _launch(self, a, b, out, operands, *, broadcasts: bool = True) -> list[torch.Tensor]:
        """Launch and return the outputs in kernel order.

        The fast path hands the tensors to the compiled function as they are (it checks their
        sizes, strides and alignment itself). Anything it does not take goes to :meth:`_launch_slow`,
        which names a wrong argument or takes the staged or the torch path."""
        spec = self.call_spec
        if spec.accepts_more and operands.keys() != spec.name_set:
            operands = call_checks.without_unused(spec, operands)
        scales = None
        if spec.scale_rows:
            a, b, scales = call_checks.unpair(spec, a, b)
        if self._kernel_runs is None:
            self._kernel_runs = self.interface.torch_only is None and call_checks.gpu_problem() is None
        if self._kernel_runs and (not spec.tf32 or call_checks.tf32_allowed()):
            self.last_path = "kernel"  # unless the call copies a's block scales (_fast_a_scales)
            try:
                outs, workspaces, problem, pending = self._run_kernel(a, b, out, operands, stage=False,
                                                                      scales=scales)
            except torch.OutOfMemoryError:
                raise  # the caller's to handle (free memory, a smaller batch): not an argument problem
            except (ValueError, TypeError, RuntimeError, KeyError, AttributeError, IndexError, OverflowError):
                pass  # the slow path finds out what it was
            else:
                return self._finished(out, outs, workspaces, problem, operands, pending)
        return self._launch_slow(a, b, out, operands, scales, broadcasts)

    def _launch_slow(self, a, b, out, operands, scales=None, broadcasts: bool = True) -> list[torch.Tensor]:
        """A call the fast path did not take: a CallError for wrong arguments; the torch path where
        the kernel cannot run at all; otherwise the kernel with aligned copies of the tensors whose
        layout it cannot take (the staged path). ``strict`` turns both paths into CallErrors."""
        spec = self.call_spec
        for name, t in (("a", a), ("b", b), *operands.items()):
            call_checks.refuse_nested(name, t)
        if any(_without_memory(t) for t in (a, b, *operands.values()) if isinstance(t, torch.Tensor)):
            raise _UnderFunctorch
        operands = call_checks.numbers_read_as_python(operands)
        a, b, operands, scales, copied = call_checks.plain_copies(a, b, operands, scales)
        self._refuse_other_dtypes(operands)
        if isinstance(a, torch.Tensor):
            operands = call_checks.cpu_scalars_moved(operands, a.device)
        refusals: dict[str, str] = {}  # rank changes an output would take, by operand (broadcasts.py)
        views = to_compiled_shapes(self.plan, a, b, operands, scales, refusals) if broadcasts else None
        given = (a, b, operands, scales)
        if views is not None:  # torch-legal broadcasts the compiled function refused, as views
            a, b, operands, scales = views

        def validate() -> None:
            # A refusal names the shapes the caller passed, not the views made of them, and a
            # refused rank change why (where its shape is checked, after more basic checks).
            try:
                call_checks.validate(spec, a, b, out, operands, scales, refusals)
            except CallError:
                if views is not None:
                    call_checks.validate(spec, given[0], given[1], out, given[2], given[3], refusals)
                raise

        reason = call_checks.torch_reason(spec, a, operands, b) if isinstance(a, torch.Tensor) else None
        if reason is None and self.interface.strict:
            # A wrong argument is named before any layout rule.
            validate()
        if reason is None:
            try:
                outs, workspaces, problem, pending = self._run_kernel(a, b, out, operands, stage=True,
                                                                      scales=scales, copied=copied)
            except (CallError, torch.OutOfMemoryError):
                raise
            except (ValueError, TypeError, RuntimeError, KeyError, AttributeError, IndexError) as exc:
                # Staging copies whatever it is given: the compiled function then rejects a wrong
                # argument, and the checks below name it.
                validate()
                raise CallError(f"the kernel rejected arguments that evtc checked and staged: {exc} (an "
                                "evtc bug: please report it with the shapes and strides of the call)"
                                ) from None
            return self._finished(out, outs, workspaces, problem, operands, pending)
        validate()
        if self.interface.strict:
            raise CallError(f"cannot run {self.plan.name!r} as a kernel: {reason}. strict=True "
                            "refuses the torch path (torch.matmul, then the epilogue evaluated by "
                            "torch) that would compute it instead")
        self._note_path("torch", reason)
        from evtc.runtime.fallback import run_call  # the interpreter: imported only when needed

        return run_call(spec, self.graph, a, b, out, operands, scales)

    def _refuse_other_dtypes(self, operands: dict) -> None:
        """Refuse operands of other dtypes than the example's where the epilogue would compute
        otherwise with them (see :attr:`dtype_variants`)."""
        if self.dtype_variants is not None and not torch.compiler.is_compiling():
            self.dtype_variants.check(operands)
        else:
            # Under torch.compile the operands are fake tensors and nothing may be traced: operand
            # by operand, against the dtypes that leave the outputs' dtypes as compiled.
            call_checks.refuse_other_promotions(self.call_spec, operands)

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

    def _run_kernel(self, a, b, out, operands, *, stage: bool, scales=None, copied=()):
        """Split, gather and launch. With ``stage``, tensors whose layout the kernel cannot take go
        through aligned copies (see :mod:`evtc.runtime.staging`); ``copied`` names the copies the
        caller made already (sparse tensors made dense). Returns the outputs in kernel order (the
        host outputs not yet), the reductions' workspaces and (M, N, L).

        This is the per-call path: everything it needs was prepared from the plan in
        :class:`CallSpec`, and the launch is memoised per problem size."""
        spec = self.call_spec
        if scales is not None and not call_checks.scales_fit(spec, a, b, scales):
            raise ValueError("block scales of the wrong shape")  # validate names the problem
        user_a, user_b = a, b
        a_shape = a.shape
        m = a_shape[-2]
        up = None
        if spec.gated:  # b whole, and where its up half starts
            if spec.fixed_n is not None and b.shape[-1] != spec.fixed_n:
                raise ValueError("another N than the function's split fixes: the checks name it")
            b, up, kernel_operands = spec.split(b, operands, staging=stage)
            n = b.shape[-1] // 2  # the output's width
        else:
            kernel_operands = operands
            n = b.shape[-1]
        batches = a_shape[0] if len(a_shape) == 3 else 1
        k = a_shape[-1]
        if k == 0:
            raise ValueError("K = 0 takes the torch path")
        if len(kernel_operands) != spec.kernel_name_count:
            raise KeyError("unknown arguments")
        if batches == 0 and spec.batch_free:
            raise ValueError("an output the same in every batch of none: the torch path computes it")
        if m == 0 or n == 0 or batches == 0:
            return self._empty_problem(user_a, user_b, out, operands, scales, m, n, batches)
        if scales is not None and not stage:
            scales = self._fast_a_scales(scales)
        ins = spec.inputs(kernel_operands, m, n, batches)
        if not stage and _negated(a, b, ins, spec.tensor_slots, scales):
            # The kernel reads memory as it is and would drop the lazy negation.
            raise ValueError("a tensor with torch's negative bit: the slow path resolves it")
        if not stage and (m if spec.d_by_m else n) % spec.out_align:
            raise ValueError("output rows are not 16-byte multiples: staged")  # cheaper than the DSL's error
        device = a.device
        if out is None:
            targets = spec.new_outputs(device, m, n, batches)
            outs = targets
        else:
            targets = call_checks.given_outputs(spec, out, m, n, batches, layout=not stage, device=device)
            outs = unaliased(targets, (a, b, *(scales or ())), ins)  # block scales are read by every CTA too
            if spec.batch_free:  # written per batch into a buffer of the call's, then copied
                fresh = spec.new_outputs(device, m, n, batches)
                outs = [fresh[i] if i in spec.batch_free else t for i, t in enumerate(outs)]
        if stage:
            a, b, up, ins, outs, problems = stage_call(self.plan, a, b, up, ins, outs)
            if scales is not None:
                scales, scale_problems = stage_scales(self.plan, scales)
                problems = problems + scale_problems
            problems = [*copied, *problems]
            if problems:
                if self.interface.strict:
                    raise CallError(f"{'; '.join(problems)}. The kernel reads and writes by TMA, which "
                                    "needs these layouts; strict=True refuses the aligned copies evtc "
                                    "would otherwise make (docs/compile.md, 'Call paths')")
                self._note_path("staged", "; ".join(problems))
            else:  # the slow path's views (broadcasts) or checks found nothing to copy
                self.last_path = "kernel"
        launch_key = (m, n, k, batches, a.get_device())
        chosen = self._launch_memo.get(launch_key)
        if chosen is None:
            chosen = self._first_launch(a, b, up, ins, outs, m, n, k, batches, scales, launch_key)
        fn, clusters, split, finisher = chosen
        # The reductions' partials are laid out by the launched configuration's tiles.
        workspaces = finisher.buffers(m, n, batches, device) if finisher is not None else []
        kernel_buffers = spec.kernel_views(outs) + (finisher.kernel_views(workspaces) if finisher is not None
                                                     else workspaces)
        invoke(fn, a, b, tuple(kernel_buffers), tuple(ins), clusters, split, device, scales, up)
        # out= tensors that overlap an input got fresh ones: copied in after the host finish, which
        # may read that input again (a device scalar inside out=).
        pending = [] if outs is targets else [(spec.first_batch(i, w), t)
                                              for i, (w, t) in enumerate(zip(outs, targets, strict=True))
                                              if w is not t]
        return targets, workspaces, (m, n, batches, finisher), pending

    def _empty_problem(self, a, b, out, operands, scales, m: int, n: int, batches: int):
        """An empty problem (M, N or the batch 0) runs no kernel: nothing compiled checks its
        arguments, so the slow path's checks do (a wrong K, a bias of another N, a 3-d ``a`` for a
        2-d kernel were returned outputs before), and no layout matters (no TMA reads or writes
        anything: an ``out=`` of no elements takes any strides, under ``strict`` too). Its outputs
        and the host finish of its reductions (sums 0, means NaN; a max or min is refused, as
        torch refuses it) are what :meth:`_run_kernel` returns."""
        spec = self.call_spec
        call_checks.validate(spec, a, b, out, operands, scales)
        call_checks.refuse_empty_extremes(self.plan, m, n, batches)
        device = a.device
        if out is None:
            targets = spec.new_outputs(device, m, n, batches)
        else:
            targets = call_checks.given_outputs(spec, out, m, n, batches, layout=False, device=device)
        finisher = self._finisher
        workspaces = finisher.buffers(m, n, batches, device) if finisher is not None else []
        self.last_path = "kernel"
        return targets, workspaces, (m, n, batches, finisher), []

    def _fast_a_scales(self, scales: tuple) -> tuple:
        """``scales`` with a's 1 x 128 scales copied where the kernel's TMA cannot read them (M not
        a multiple of 4 in the M-major layout torch's blockwise GEMM takes: decode sizes, which
        cuBLASLt refuses), here rather than on the slow path, whose rejected launch and checks cost
        about 150 us a call on the H100's host (docs/fp8.md, 'Block scales')."""
        a_scales = scales[0]
        if self.plan.a_scales.contiguous is None:
            return scales  # any strides do (128 x 128 blocks)
        if a_scales.stride(-2) == 1 and a_scales.stride(-1) % 4 == 0:
            return scales  # the compiled function checks the rest
        staged, problems = stage_scales(self.plan, scales)
        if problems:
            if self.interface.strict:
                raise ValueError("strict: the slow path names the copy it refuses")
            self._note_path("staged", "; ".join(problems))
        return staged

    def _first_launch(self, a, b, up, ins, outs, m, n, k, batches, scales, launch_key):
        """The launch of a problem size this kernel has not run yet (then memoised)."""
        device = a.device
        capturing = stream_buffers.stream_key(device) is None
        if not capturing:
            # A size's first eager call (a warm-up) prepares the CUDA graph captures that may
            # follow, at sizes that split or finish reductions in the kernel.
            stream_buffers.ensure_capture_arena(device)
        if self._tuner is not None and not capturing:
            launch = self._tuner.launch(self, a, b, ins, outs, m, n, k, batches, scales, up)
            chosen = self.resolve(*launch, m, n, k, batches)
        else:
            chosen = self._launch_choice(m, n, k, batches)
        if len(self._launch_memo) > 4096:  # many distinct sizes: start over rather than grow
            self._launch_memo.clear()
        if self._tuner is None or (not capturing and self._tuner.settled(m, n, k, batches)):
            # A tuning kernel tunes this size when eager, on tensors its launches can read.
            self._launch_memo[launch_key] = chosen
        return chosen

    def _launch_choice(self, m: int, n: int, k: int, batches: int):
        """(compiled function, clusters that fit at once, split-K's (splits, partials, counters) or
        None, the reductions' finish for its tile shape) for an (L, M, N, K) problem on the
        current GPU."""
        return self.resolve(*self.launch_for(m, n, k, batches), m, n, k, batches)

    def resolve(self, config: GemmConfig, splits: int, m: int, n: int, k: int, batches: int):
        """The launch tuple of :meth:`_launch_choice` for a chosen configuration and split count,
        capped at K's tiles: every unit must have a K tile (the mainloop overwrites the accumulator
        with its first one). The rules and the tuner never exceed it; this is the one guard every
        launch passes."""
        from evtc.plan.split_k import splits_within_k, workspace_numels

        splits = splits_within_k(splits, k, config.tile_k)
        config = built_config(config, splits)
        if not config.runs_rows(m):
            # Loads trimmed to fewer rows than the problem has (a launch tuned or chosen for a
            # shorter problem): the kernel that loads whole tiles instead.
            config = config.replace(a_rows=None)
        kernel = self if config == self.config else self._variant(config)
        if kernel._finisher is not None:
            # Before anything is allocated or timed (the tuner resolves each candidate first).
            numels = kernel._finisher.layout(m, n, batches).numels
            if max(numels, default=0) > call_checks.INT32_MAX:
                raise CallError(
                    f"the reductions of {self.plan.name!r} need a workspace of {max(numels)} float32 "
                    f"values for M = {m}, N = {n}, L = {batches}, past the 2**31 - 1 the kernel's "
                    "32-bit lengths reach: split the call along M (or the batch)")
        cluster = config.cluster
        clusters = max_active_clusters(cluster[0] * cluster[1], self._cache.root)
        if not config.split_k:
            return kernel._fn, clusters, None, kernel._finisher
        # A split launch runs on the clusters its split count was chosen for (Kernel.slots): the
        # tiles it splits, and every split's wait on another cluster, assume that grid.
        clusters = planned_clusters(cluster[0] * cluster[1], clusters)
        numels = workspace_numels(m, n, batches, config, cluster, splits, clusters)
        if numels[0] > call_checks.INT32_MAX:
            # The kernel indexes the partials with 32-bit offsets: a pinned count that needs more
            # slots than they reach runs with as many as they do.
            slot = numels[0] // (splits - 1)
            splits = 1 + call_checks.INT32_MAX // slot
            numels = workspace_numels(m, n, batches, config, cluster, splits, clusters)
        return kernel._fn, clusters, (splits, *numels), kernel._finisher

    def _finished(self, out, outs, workspaces, problem, operands, pending) -> list[torch.Tensor]:
        """The call's outputs: the tiles ``outs``, then the host outputs (finished first, while the
        inputs are as the call gave them), then the tiles written aside copied into their out=."""
        if out is None and self.call_spec.batch_free:  # torch's shape: the first batch (a view)
            outs = [self.call_spec.first_batch(i, t) for i, t in enumerate(outs)]
        results = outs + self._finish(out, workspaces, *problem, operands)
        for written, target in pending:
            target.copy_(written)
        return results

    def _finish(self, out, workspaces, m, n, batches, finisher, operands) -> list[torch.Tensor]:
        """The host outputs (reductions and what follows them, finished by ``finisher``, that of the
        launched configuration), into ``out``'s tensors if given."""
        host_outputs = self.call_spec.host_outputs
        if not host_outputs:
            return []
        results = finisher(workspaces, m, n, batches, operands)
        if out is None:
            return results
        return call_checks.copy_into_given(self.call_spec, out, [h.name for h in host_outputs], results)


def _negated(a: torch.Tensor, b: torch.Tensor, ins: list, slots: tuple[int, ...],
             scales: tuple | None) -> bool:
    """Whether ``a``, ``b``, an operand tensor among ``ins`` or a block scale carries torch's
    negative bit (a view such as ``z.conj().imag``, whose memory holds the values' negation)."""
    if a.is_neg() or b.is_neg() or (scales is not None and any(s.is_neg() for s in scales)):
        return True
    for i in slots:
        t = ins[i]
        if isinstance(t, torch.Tensor) and t.is_neg():
            return True
    return False


#: How many torch dispatch modes are active (make_fx's proxy mode, FakeTensorMode, FlopCounterMode):
#: a launch through TVM-FFI is invisible to each, so a call under one goes through the operator.
_dispatch_modes = torch._C._len_torch_dispatch_stack


class _UnderFunctorch(Exception):  # noqa: N818 - a signal, not an error
    """A call on tensors without memory of their own (torch.func's wrapped tensors, fake or
    functional tensors): it goes through the custom operator."""


_functorch_wrapped = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor",
                             lambda t: False)


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _without_memory(t: torch.Tensor) -> bool:
    """Whether ``t`` stands for a tensor without being one a kernel could read (read on the slow
    path only: the fast path's compiled function refuses such tensors first)."""
    if not isinstance(t, torch.Tensor):  # a (tensor, block scales) pair: its tensor is checked later
        return False
    return _functorch_wrapped(t) or type(t).__name__ in ("FakeTensor", "FunctionalTensor")

#: Whether torch.jit.trace is recording (torch.jit.is_tracing without its Python wrapper: the
#: per-call path).
_jit_tracing = getattr(torch._C, "_is_tracing", torch.jit.is_tracing)


def _out_tensors(spec: CallSpec, out) -> list[torch.Tensor]:
    """The tensors of an ``out=`` of the epilogue's structure (none if it is not one: the call's
    checks name that)."""
    given = spec.tree.flatten(out, call_checks.is_tensor)
    return [] if given is None else [t for t in given.values() if isinstance(t, torch.Tensor)]


def _refuse_out_requiring_grad(spec: CallSpec, out) -> None:
    """torch refuses ``out=`` a tensor that requires grad while grad mode is on: the write could
    not be differentiated."""
    if any(t.requires_grad for t in _out_tensors(spec, out)):
        raise CallError("out= a tensor that requires grad: a call into out= is not differentiable "
                        "(torch refuses it too); call under torch.no_grad(), or without out=")


def _bump_versions(spec: CallSpec, out) -> None:
    """The kernel writes ``out`` through its pointer, which autograd does not see: count the
    write in each tensor's version, as torch's own out= does, so that a backward that saved one
    of them raises instead of reading the new values."""
    for t in _out_tensors(spec, out):
        torch.autograd.graph.increment_version(t)
