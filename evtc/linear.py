"""``evtc.linear``: the commonest fused GEMM, ``fn(x @ weight.t(), ...)`` with an ``nn.Linear`` weight.

The weight stays in its (out_features, in_features) layout: ``weight.t()`` is a K-major B, which the
kernel loads as it is (no copy, no transpose). ``x`` may have any leading dims, as for
``torch.nn.functional.linear``; they are flattened into M (a view when ``x`` is contiguous) and the
outputs get them back.
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from evtc.compile import compile as _compile_kernel
from evtc.compile import graph_digest
from evtc.errors import CallError, CompileError, EpilogueError
from evtc.runtime import call_checks
from evtc.runtime.call_checks import refuse_overlapping, refuse_shared_targets
from evtc.runtime.dtype_variants import meta_copy
from evtc.runtime.kernel import Kernel
from evtc.runtime.op_autograd import saved_accumulator_dtype

if TYPE_CHECKING:
    from evtc.api import OutDtypes

log = logging.getLogger("evtc")


class Linear:
    """A compiled ``fn(x @ weight.t(), **operands)``; call it as ``lin(x, weight, **operands)``.

    Operands shaped like the output (``(*lead, out_features)``) or like a per-row column
    (``(*lead, 1)``) are flattened with ``x``; row vectors (``(out_features,)``) and scalars pass as
    they are. ``lin.kernel`` is the underlying :class:`evtc.Kernel` (source, graph, PTX, explain).
    """

    def __init__(self, kernel: Kernel, fn: Callable[..., Any] | None = None,
                 example: Mapping[str, Any] | None = None, out_dtypes: OutDtypes = None,
                 compile_options: Mapping[str, Any] | None = None) -> None:
        self.kernel = kernel
        # What the backward graph is derived from (on first use): the epilogue as the user wrote it,
        # traced on meta copies of the examples (the kernel's own graph may be split for SwiGLU),
        # with their strides: the saving kernel compiles from them for the same layouts.
        self._fn = fn
        self._example = None if example is None else {k: meta_copy(v) for k, v in example.items()}
        self._out_dtypes = out_dtypes
        self._backward = None
        self._backward_reads: tuple[bool, frozenset[str]] | None = None
        # The kernel a differentiable call runs where the backward reads the accumulator: the same
        # epilogue that also stores the accumulator (see :meth:`_saving_kernel`); False where none.
        self._saving: Kernel | bool | None = None
        # The backward's dZ as one kernel (evtc.dz_pass: kernel and epilogue) by the operands whose
        # gradients it also computes, built on first use; False where there is none.
        self._dz_passes: dict[tuple[str, ...], tuple | bool] = {}
        self._compile_options = dict(compile_options or {})  # config, arch, cache_dir of the twin
        # Calls whose flattening into M gives fn's own results, by :func:`_leading_key` (see
        # _check_leading_dims); a 2-d x has nothing to flatten.
        self._exact_dims: set[Any] = {2}

    def _check_leading_dims(self, x_dims: int, n: int, operands: Mapping[str, Any]) -> None:
        """Refuse x with ``x_dims`` dims where flattening its leading dims into M would change what
        the epilogue returns (a reduction over rows, a dim read by position); checked once per
        ``x_dims`` and pattern of operands' size-1 dims (:func:`_leading_key`)."""
        key = _leading_key(x_dims, operands)
        if key in self._exact_dims or self._fn is None:
            return
        why = _flattening_changes(self.kernel, self._fn, x_dims, n, operands)
        if why is not None:
            if x_dims == 1:
                raise CallError(f"evtc.linear: {why}")
            raise CallError(f"evtc.linear: {why}. Pass x as (rows, in_features) (x.reshape(-1, "
                            "x.shape[-1])) for a reduction over all rows, or compile the epilogue with "
                            "evtc.compile on a batched a for one per leading index")
        self._exact_dims.add(key)

    def __deepcopy__(self, memo: dict) -> Linear:
        """The Linear itself: a compiled kernel does not change (see ``Kernel.__deepcopy__``)."""
        return self

    def __reduce__(self) -> Any:
        raise TypeError("an evtc.linear cannot be pickled: it holds a loaded GPU library. Call "
                        "evtc.linear again in the process that loads it (a disk-cache hit), or use "
                        "evtc.nn.FusedLinear, which pickles as a module")

    @property
    def output_names(self) -> list[str]:
        """The epilogue's outputs, by name, in the order of its return value."""
        return list(self.kernel.plan.structure.names)

    def backward_graph(self):
        """The epilogue's backward graph (:func:`evtc.ir.autodiff.backward`), derived once."""
        if self._backward is None:
            if self._fn is None:
                raise CallError("this evtc.Linear was built without its epilogue function; use "
                                "evtc.linear(...) for a differentiable one")
            from evtc.api import trace
            from evtc.ir.autodiff import backward
            from evtc.ir.passes.gated import kernel_graph

            traced = trace(self._fn, self._example, out_dtypes=self._out_dtypes)
            # The function as it is now must be the one the kernel computes: a global, closure value
            # or helper it reads may have changed since evtc.linear, and the gradients would then be
            # another function's.
            if graph_digest(kernel_graph(traced)) != graph_digest(self.kernel.graph):
                raise CompileError(
                    f"{traced.name!r} no longer traces to the graph its kernel was compiled from: a "
                    "global, closure value or helper that the epilogue reads changed after evtc.linear "
                    "returned. The kernel computes the function as it was then, and its gradients "
                    "would not; build the linear again for the function as it is now")
            self._backward = backward(traced)
        return self._backward

    def _saving_kernel(self) -> Kernel | None:
        """The kernel of a differentiable call whose backward reads the accumulator: the epilogue
        with the accumulator as extra outputs in the inputs' dtype (float32 for float16 inputs:
        :func:`~evtc.runtime.op_autograd.saved_accumulator_dtype`; its two halves for a gated
        epilogue), compiled on first use. The backward then reads them instead of recomputing
        ``x @ weight.t()``, a whole GEMM, as eager autograd reads the 16-bit output it saved. None
        where the backward never reads the accumulator, or the epilogue's outputs have their own
        dtypes (``out_dtypes``: the backward then recomputes it)."""
        if self._saving is None:
            back = self.backward_graph()
            reads_acc = any(node.op == "acc" for node in back.graph.nodes)
            if not reads_acc or self._out_dtypes is not None or self._example is None:
                self._saving = False
            else:
                try:
                    widen = saved_accumulator_dtype(self._example["a"].dtype) == torch.float32
                    self._saving = _compile_kernel(_with_accumulator(self._fn, self.kernel.plan.gated, widen),
                                                   self._example, **self._compile_options)
                    self._saving.saved_accumulators = 2 if self.kernel.plan.gated else 1
                except Exception as exc:  # noqa: BLE001 - recomputing gives the same gradients
                    # One more output may not fit a pinned configuration's shared memory: the
                    # backward then recomputes the accumulator.
                    log.warning("%r: the kernel that also stores the accumulator for the backward "
                                "does not compile (%s); the backward recomputes it",
                                self.kernel.plan.name, str(exc).splitlines()[0])
                    self._saving = False
        return self._saving or None

    def _output_leaves(self, result: Any) -> dict[str, torch.Tensor]:
        return self.kernel.plan.structure.flatten(result, lambda _: True)

    def _gradients(self, x, weight, operands, grads, saved=(), *, need_x=True, need_weight=True,
                   need_operands=None):
        from evtc.linear_autograd import backward_of_linear

        return backward_of_linear(self, x, weight, operands, grads, saved, need_x=need_x,
                                  need_weight=need_weight, need_operands=need_operands)

    def backward_reads(self) -> tuple[bool, frozenset[str]]:
        """Whether the backward graph reads the accumulator, and the names it loads (found once:
        every differentiable forward asks what to save)."""
        if self._backward_reads is None:
            from evtc.linear_autograd import backward_reads

            self._backward_reads = backward_reads(self.backward_graph())
        return self._backward_reads

    @property
    def source(self) -> str:
        return self.kernel.source

    def explain(self) -> str:
        return self.kernel.explain()

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, *positional: Any, out: Any = None,
                 **operands: Any) -> Any:
        """The epilogue's outputs. Operands go by name, or by position after ``x`` and ``weight`` in
        the order of the epilogue's parameters (``lin(x, w, C, bias)``). Differentiable in ``x``,
        ``weight`` and the tensor operands when any of them requires grad (see
        :mod:`evtc.linear_autograd`); ``out=`` is then refused."""
        if positional:
            operands = call_checks.by_position(self.kernel.plan.interface.parameters, positional, operands,
                                               f"evtc.linear {self.kernel.plan.name!r}", ("x", "weight"))
        x = call_checks.dense_x("evtc.linear: x", x)
        defaults = self.kernel.plan.interface.defaults
        if defaults:  # runtime scalars left out read their Python defaults, in the backward too
            for name, value in defaults:
                operands.setdefault(name, value)
        try:
            if torch.compiler.is_compiling():
                return self._compiled_call(x, weight, out, operands)
            if torch.is_grad_enabled() and _requires_grad(x, weight, operands):
                if out is not None:
                    raise CallError("evtc.linear: out= is not differentiable; leave it out when an "
                                    "input requires grad")
                return self._differentiable(x, weight, operands)
            return self._call(x, weight, out, operands)
        except CallError as err:
            if err.message.startswith("evtc.linear") or not isinstance(x, torch.Tensor) or x.dim() < 1:
                raise err.with_traceback(None) from None
            # The kernel's own checks speak of a, b and flattened operands: say how they came about.
            if x.dim() == 1:
                flat = f"x {tuple(x.shape)} runs as one row, a = x.reshape(1, {x.shape[-1]})"
            elif x.dim() == 2:
                flat = "x runs as a"
            else:
                rows = math.prod(x.shape[:-1])
                flat = (f"x {tuple(x.shape)} runs as a = x.reshape({rows}, {x.shape[-1]}), operands "
                        "with x's leading dims flattened alike")
            message = err.message
            if x.dim() > 2:
                # The kernel's hint names a flattened shape; a caller passes one with x's leading dims.
                lead = ", ".join(str(size) for size in x.shape[:-1])
                message = re.sub(rf"\.expand\({rows}, (\d+)\)", rf".expand({lead}, \1)", message)
            raise CallError(f"evtc.linear ({flat}, weight as b = weight.t()): {message}",
                            err.loc) from None
        except EpilogueError as err:
            raise err.with_traceback(None) from None

    def _compiled_call(self, x, weight, out, operands):
        """The call under torch.compile: through the custom operator of a kernel, which the compiler
        sees as one op with its autograd (LinearFunction runs evtc's Python call path, which it
        cannot trace). Where an eager differentiable call built the saving twin, that twin's operator
        runs and its backward reads the stored accumulator, as LinearFunction's does; otherwise the
        plain kernel's, whose backward recomputes it. Kernels are not built here: call the layer
        once eagerly (with an input that requires grad) before ``torch.compile(fullgraph=True)``."""
        saving = self._saving if isinstance(self._saving, Kernel) else None
        if saving is None or out is not None:
            return self._call(x, weight, out, operands)
        leaves = self._call_kernel(saving, x, weight, operands)
        count = len(self.output_names)
        return self.kernel.plan.structure.build(dict(zip(self.output_names, leaves[:count], strict=True)))

    def _differentiable(self, x, weight, operands):
        from evtc.linear_autograd import LinearFunction

        call_checks.refuse_functorch_autograd("evtc.linear")
        names = tuple(operands)
        outputs = LinearFunction.apply(self, x, weight, names, *operands.values())
        return self.kernel.plan.structure.build(dict(zip(self.output_names, outputs, strict=True)))

    def _call(self, x, weight, out, operands):
        return self._call_kernel(self.kernel, x, weight, operands, out)

    def _call_kernel(self, kernel: Kernel, x, weight, operands, out=None):
        """``kernel`` (this Linear's, or its saving twin) on ``x @ weight.t()`` and ``operands``,
        its outputs with ``x``'s leading dims."""
        if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
            raise CallError("evtc.linear: x and weight must be torch tensors")
        if x.dim() < 1 or weight.dim() != 2:
            raise CallError(f"evtc.linear: x must be (..., in_features) and weight (out_features, "
                            f"in_features); got {tuple(x.shape)} and {tuple(weight.shape)}")
        if x.shape[-1] != weight.shape[1]:
            raise CallError(f"evtc.linear: x has {x.shape[-1]} input features, weight {weight.shape[1]} "
                            f"(weight is (out_features, in_features) = {tuple(weight.shape)})")
        lead = tuple(x.shape[:-1])
        if lead:
            flat = {name: _flatten_like(v, lead) for name, v in operands.items()}
        else:
            flat = _one_row(kernel, operands)
        if x.dim() != 2 and _leading_key(x.dim(), operands) not in self._exact_dims:
            self._check_leading_dims(x.dim(), weight.shape[0], operands)
        if kernel.plan.interface.shape_reads:
            _refuse_reshaped_shape_reads(kernel, operands, flat)
        x2 = _rows(x)
        if out is None:
            result = kernel(x2, weight.t(), **flat)
            return self._per_output(kernel, result, lambda t: t.view(lead + tuple(t.shape[1:])))
        if torch.compiler.is_compiling():
            # Under torch.compile the kernel is a functional operator whose results are copied into
            # out= in any case; and a view of `out` that fails (below) cannot be caught while tracing.
            return self._written_into(kernel, x2, weight, flat, lead, out)
        self._resize_empty_out(kernel, x2, weight, out, lead)
        self._check_out_rows(kernel, out, lead)
        try:
            # Views only: a reshape that copied would have the kernel write the copy, not `out`.
            flat_out = self._per_output(kernel, out, lambda t: t.view(-1, *t.shape[len(lead):]))
        except RuntimeError:
            # Leading dims that no single stride spans (a slice of a longer cache, a transposed
            # (S, B, N) buffer): the kernel writes new tensors, copied into `out`.
            return self._written_into(kernel, x2, weight, flat, lead, out)
        except (TypeError, ValueError, KeyError, IndexError, AttributeError):
            flat_out = out  # not the epilogue's structure: the kernel's own check says what is wrong
        try:
            kernel(x2, weight.t(), out=flat_out, **flat)
        except CallError:
            # Where an out= tensor's shape is what is wrong, name it as the caller sees it (the
            # kernel's check names the flattened one); only here, off the calls that run.
            self._check_out_shapes(kernel, x2, weight, out, lead)
            raise
        return out

    @staticmethod
    def _out_shapes(kernel: Kernel, x2, weight, lead: tuple) -> dict | None:
        """Each output's (shape, dtype) as the caller sees it (x's leading dims where the kernel's
        have M), or None where the problem's sizes are not known (the kernel's checks name why)."""
        sizes = call_checks.problem_sizes(kernel.call_spec, x2, weight.t())
        if sizes is None:
            return None
        dims = _output_dims(kernel)
        return {name: ((*lead, *shape[1:]) if dims[name][:1] == ("M",) else shape, dtype)
                for name, (shape, dtype) in call_checks.output_shapes(kernel.call_spec, sizes).items()}

    @classmethod
    def _resize_empty_out(cls, kernel: Kernel, x2, weight, out: Any, lead: tuple) -> None:
        """Resize ``out=`` tensors with no elements to their outputs' shapes (x's leading dims where
        the kernel's have M), as torch resizes an empty ``out=`` (see call_checks.resize_empty)."""
        given = kernel.call_spec.tree.flatten(out, call_checks.is_tensor)
        if given is None or all(not isinstance(t, torch.Tensor) or t.numel() for t in given.values()):
            return
        shapes = cls._out_shapes(kernel, x2, weight, lead)
        if shapes is not None:
            call_checks.resize_empty(given, shapes, x2.device)

    @classmethod
    def _check_out_shapes(cls, kernel: Kernel, x2, weight, out: Any, lead: tuple) -> None:
        """Refuse an ``out=`` tensor of another shape than its output's, in the caller's shapes (the
        kernel's own check would name the flattened ones)."""
        given = kernel.call_spec.tree.flatten(out, call_checks.is_tensor)
        shapes = cls._out_shapes(kernel, x2, weight, lead) if given is not None else None
        if shapes is None:
            return  # not the epilogue's structure, or no sizes: the kernel's own check says why
        for name, t in given.items():
            if isinstance(t, torch.Tensor) and name in shapes and tuple(t.shape) != tuple(shapes[name][0]):
                label = "out" if kernel.call_spec.single_output else f"out[{name!r}]"
                want = tuple(shapes[name][0])
                raise CallError(f"evtc.linear: {label} must have the output's shape {want}, "
                                f"got {tuple(t.shape)} (an out= tensor with elements is written whole)")

    def _check_out_rows(self, kernel: Kernel, out: Any, lead: tuple) -> None:
        """Refuse an out= tensor along M whose leading dims are not x's (a (S, B, N) one for x of
        (B, S, K) would be filled row by row, in the wrong order, where torch resizes or refuses)."""
        def check(t):
            if isinstance(t, torch.Tensor) and t.dim() >= len(lead) and tuple(t.shape[:len(lead)]) != lead:
                raise CallError(f"evtc.linear: out has shape {tuple(t.shape)}, whose leading dims are not "
                                f"x's {lead}")
            return t

        try:
            self._per_output(kernel, out, check)
        except CallError:
            raise
        except (TypeError, ValueError, KeyError, IndexError, AttributeError):
            pass  # not the epilogue's structure: the kernel's own check says what is wrong

    def _written_into(self, kernel: Kernel, x2, weight, flat, lead, out):
        """``kernel`` on new tensors, then copied into ``out``; returns ``out``."""
        result = kernel(x2, weight.t(), **flat)
        shaped = self._per_output(kernel, result, lambda t: t.view(lead + tuple(t.shape[1:])))
        self._copy_into(kernel, shaped, out)
        return out

    @staticmethod
    def _copy_into(kernel: Kernel, result: Any, out: Any) -> None:
        """Copy ``result`` (``kernel``'s output structure) into ``out``, whose tensors must have the
        same shapes and dtypes (no broadcast, no conversion: as ``out=`` everywhere else)."""
        structure = kernel.plan.structure
        got, given = structure.flatten(result, lambda _: True), structure.flatten(out, lambda _: True)
        if given is None:
            raise CallError(f"evtc.linear: out must have the structure of the epilogue's result "
                            f"({', '.join(got)}), got {type(out).__name__}")
        for name, r in got.items():
            o = given[name]
            if not isinstance(o, torch.Tensor) or o.shape != r.shape or o.dtype != r.dtype:
                what = f"{tuple(o.shape)} {o.dtype}" if isinstance(o, torch.Tensor) else type(o).__name__
                raise CallError(f"evtc.linear: out {name!r} must be {tuple(r.shape)} {r.dtype}, got {what}")
        # Two targets sharing memory would each hold whichever output was copied last; so would
        # the elements of an expanded one.
        refuse_shared_targets({name: given[name] for name in got})
        for name in got:
            refuse_overlapping(f"evtc.linear: out {name!r}", given[name])
        for name, r in got.items():
            given[name].copy_(r)

    @staticmethod
    def _per_output(kernel: Kernel, value: Any, along_m: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        """``value`` (``kernel``'s output structure) with ``along_m`` applied to the outputs whose
        first dim is M (tiles, per-row reductions); per-column and whole-output reductions pass."""
        structure = kernel.plan.structure
        dims = _output_dims(kernel)
        leaves = structure.flatten(value, lambda _: True)
        if leaves is None:
            return value
        mapped = {name: along_m(t) if isinstance(t, torch.Tensor) and dims[name][:1] == ("M",) else t
                  for name, t in leaves.items()}
        return structure.build(mapped)


def _output_dims(kernel: Kernel) -> dict[str, tuple[str, ...]]:
    """Each output's dims (by name): ("M", "N") for a tile, ("M",) for a per-row reduction."""
    plan = kernel.plan
    return {s.name: s.dims for s in plan.outputs} | {h.name: h.dims for h in plan.host_outputs}


def _requires_grad(x, weight, operands: Mapping[str, Any]) -> bool:
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in (x, weight, *operands.values()))



def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as (rows, in_features): its leading dims flattened (also with no input features, where
    ``reshape(-1, 0)`` cannot tell how many rows)."""
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def unflatten_gradient(grad: torch.Tensor | None, value: Any, lead: tuple[int, ...]) -> torch.Tensor | None:
    """The gradient of an operand ``value`` from that of its :func:`_flatten_like` form: summed over
    the leading dims it was expanded to, as autograd sums a broadcast."""
    if grad is None or grad.numel() == value.numel():
        return None if grad is None else grad.reshape(value.shape)
    shape = (1,) * (len(lead) + 1 - value.dim()) + tuple(value.shape)
    return grad.reshape(*lead, shape[-1]).sum_to_size(shape).reshape(value.shape)


def _leading_key(x_dims: int, operands: Mapping[str, Any]) -> Any:
    """What decides whether flattening an x of ``x_dims`` dims into M keeps fn's results: the
    rank, and for each operand its rank and which of its dims are 1 (a (1, N) operand beside a
    1-d x makes torch's output (1, N); a (B, 1, N) one beside a 3-d x broadcasts over S)."""
    if x_dims == 2:
        return 2
    # (names sorted alone: dynamo sorts constants only)
    return (x_dims, *((name, tuple(bool(size == 1) for size in operands[name].shape))
                      for name in sorted(operands) if isinstance(operands[name], torch.Tensor)))


def _refuse_reshaped_shape_reads(kernel: Kernel, operands: Mapping[str, Any],
                                 flat: Mapping[str, Any]) -> None:
    """Raise a CallError where the epilogue reads the shape of an operand that evtc.linear hands
    the kernel in another shape (flattened with x's leading dims, expanded over them, or a 1-d x's
    row): the kernel's function reads the sizes it sees, torch's the ones the caller passed."""
    for name in kernel.plan.interface.shape_reads:
        given, seen = operands.get(name), flat.get(name)
        if isinstance(given, torch.Tensor) and isinstance(seen, torch.Tensor) and given.shape != seen.shape:
            raise CallError(f"evtc.linear: the epilogue reads {name}'s shape ({name}.shape, .size(), .dim() "
                            f"or .numel(), or those of a value computed from it), but {name} of shape "
                            f"{tuple(given.shape)} reaches the kernel as {tuple(seen.shape)} (flattened "
                            f"with x's leading dims): the values would differ from torch's. Pass x as "
                            f"(rows, in_features) and {name} in that shape, or read only the last dim")


def _one_row(kernel: Kernel, operands: Mapping[str, Any]) -> dict[str, Any]:
    """Operands beside an ``x`` of one dim (``F.linear``'s (in_features,), one row of M): one shaped
    (*lead, N) = (N,) or (*lead, 1) = (1,) is that row's, a (1, N) or (1, 1) view where the kernel
    reads the operand along M (a tile or a column); others stay as they are."""
    along_m = {inp.user for inp in kernel.plan.inputs
               if inp.spec is not None and inp.spec.rank == 2 and inp.spec.dims[0] == "M"}
    return {name: v.unsqueeze(0) if name in along_m and isinstance(v, torch.Tensor) and v.dim() == 1 else v
            for name, v in operands.items()}


def _describe_arg(value: Any) -> str:
    return f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) \
        else f"a {type(value).__name__}"


def _flatten_like(value: Any, lead: tuple[int, ...]) -> Any:
    """(*lead, n) -> (prod(lead), n). An operand that broadcasts over some of x's leading dims as
    torch broadcasts it ((S, n), (1, S, n) or (B, 1, n) beside an x of (B, S, k)) is expanded to
    them first (a copy, differentiable); one that broadcasts over all of them (a row (n,) or
    (1, 1, n)) and anything else stay as they are."""
    if not isinstance(value, torch.Tensor) or len(lead) == 1 or not 2 <= value.dim() <= len(lead) + 1:
        return value
    shape = (1,) * (len(lead) + 1 - value.dim()) + tuple(value.shape)
    if shape[:-1] == lead:
        return _rows(value)
    if all(s == 1 for s in shape[:-1]):
        return value.reshape(1, shape[-1]) if value.dim() > 2 else value  # a row (or one value)
    if any(s not in (1, full) for s, full in zip(shape[:-1], lead, strict=True)):
        # Not broadcastable against x's leading dims as torch broadcasts (a (B*S, n) operand
        # beside x of (B, S, k) fails in torch): refused, not read as rows of the flattened x.
        raise CallError(f"evtc.linear: an operand of shape {tuple(value.shape)} does not broadcast "
                        f"against x's leading dims {lead} (as torch broadcasts it against x @ "
                        "weight.t())")
    return value.reshape(shape).expand(*lead, shape[-1]).reshape(-1, shape[-1])


# Sizes of the probe that stands in for x's leading dims (distinct primes: a dim that fn reads by
# position then shows in the output shapes).
_PROBE_SIZES = (3, 5, 7, 11, 13, 17, 19, 23)


# What the probe noted, per thread: layers called from several threads probe at once, and one
# thread's note must not refuse (or a reset hide) another's call.
_WATCHED = threading.local()


class _SizeWatch(torch.Tensor):
    """A meta tensor whose leading sizes (the probe's, :data:`_PROBE_SIZES`) come back from
    ``shape`` and ``size()`` as :class:`_LeadingSize`, which notes any use of its value (see
    :meth:`read`), and whose rank (``dim()``, ``ndim``) notes a comparison (``if acc.dim() == 3``).
    Arithmetic on the rank (``range(y.dim() - 1)``) and uses inside torch's own functions do not
    count: they give the same results on the flattened x."""

    @staticmethod
    def make(shape: tuple, dtype: torch.dtype, device: str) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device).as_subclass(_SizeWatch)

    @staticmethod
    def start(one_row: bool = False) -> None:
        """Forget what an earlier probe in this thread noted. ``one_row``: the probe stands in for a
        1-d x, whose values are one dim short of the kernel's (a dim read from the front, shape[0],
        is N in torch and the kernel's M)."""
        _WATCHED.read = None
        _WATCHED.depth = 0
        _WATCHED.one_row = one_row

    @staticmethod
    def read() -> str | None:
        """The first use noted since :meth:`start` in this thread, or None."""
        return getattr(_WATCHED, "read", None)

    @staticmethod
    def note(what: str) -> None:
        _WATCHED.read = getattr(_WATCHED, "read", None) or what

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        depth = getattr(_WATCHED, "depth", 0)
        outermost = depth == 0
        if outermost and any(isinstance(v, _LeadingSize) for v in (*args, *kwargs.values())):
            cls.note("a leading size (in a torch function's arguments)")
        if outermost and getattr(func, "__name__", "") not in _DIM_TAKING and any(
                isinstance(v, _Rank) for v in (*args, *kwargs.values())):
            cls.note("its rank as a value (acc * acc.dim())")
        one_row = getattr(_WATCHED, "one_row", False)
        if outermost and one_row and func is torch.Tensor.size:
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if isinstance(dim, int) and dim >= 0:
                cls.note(f"a dim by position from the front (size({dim}))")
        _WATCHED.depth = depth + 1
        try:
            result = super().__torch_function__(func, types, args, kwargs)
        finally:
            _WATCHED.depth = depth
        if not outermost:
            return result
        if func in (torch.Tensor.size, torch.Tensor.shape.__get__):
            if isinstance(result, tuple):
                sizes = tuple(_LeadingSize(size) if size in _PROBE_SIZES else size for size in result)
                return _WatchedShape(sizes)
            return _LeadingSize(result) if result in _PROBE_SIZES else result
        if func in (torch.Tensor.dim, torch.Tensor.ndimension, torch.Tensor.ndim.__get__):
            return _Rank(result)
        if func is torch.Tensor.__len__ and (result in _PROBE_SIZES or one_row):
            cls.note("a leading size (len())")
        return result


def _noting(name: str):
    def method(self, *args):
        _SizeWatch.note(f"a leading size ({self._what} used in {name.strip('_')})")
        return getattr(int, name)(int(self), *args)

    return method


class _LeadingSize(int):
    """A size of one of x's leading dims in the probe: any use of its value is noted."""

    _what = "shape[...]"


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
              "__rtruediv__", "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__", "__pow__", "__rpow__",
              "__neg__", "__float__", "__index__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__",
              "__ge__", "__bool__"):
    setattr(_LeadingSize, _name, _noting(_name))
_LeadingSize.__hash__ = int.__hash__


# Torch functions that take a rank-derived number as a dim (y.sum(y.dim() - 1)): a dim counted
# from the rank is the same dim of the flattened value, so passing one there is no use of its value.
_DIM_TAKING = frozenset({
    "sum", "mean", "amax", "amin", "max", "min", "prod", "softmax", "log_softmax", "logsumexp", "cumsum",
    "cumprod", "norm", "var", "std", "argmax", "argmin", "all", "any", "count_nonzero", "chunk", "split",
    "unsqueeze", "squeeze", "transpose", "movedim", "flip", "narrow", "select", "size", "nansum", "nanmean",
    "aminmax", "tensor_split", "unbind", "var_mean", "std_mean", "vector_norm"})


class _WatchedShape(tuple):
    """The shape of a value in the probe: its length is the rank, noted as a value (torch's is
    x's rank, the kernel's 2: ``len(acc.shape)``; ``acc.dim()`` gives a rank that ``range()``
    may count dims from). For a 1-d x's probe a dim read from the front (``shape[0]``,
    unpacking) is noted too, as torch's value has one dim fewer than the kernel's (its shape[0]
    is N, the kernel's M); dims read from the end are the same."""

    def __len__(self) -> int:
        _SizeWatch.note("its rank as a value (len(x.shape); count dims with x.dim())")
        return tuple.__len__(self)

    def __getitem__(self, index):
        if getattr(_WATCHED, "one_row", False) and (isinstance(index, int) and index >= 0
                                                    or isinstance(index, slice)):
            _SizeWatch.note(f"a dim by position from the front (shape[{index}])")
        return tuple.__getitem__(self, index)

    def __iter__(self):
        if getattr(_WATCHED, "one_row", False):
            _SizeWatch.note("a dim by position from the front (its shape unpacked)")
        return tuple.__iter__(self)

    def __add__(self, other):  # (acc.shape + ())[0]: the sizes in a plain tuple
        if getattr(_WATCHED, "one_row", False):
            _SizeWatch.note("a dim by position from the front (its shape concatenated)")
        return tuple.__add__(self, other)

    def __radd__(self, other):
        if getattr(_WATCHED, "one_row", False):
            _SizeWatch.note("a dim by position from the front (its shape concatenated)")
        return tuple(other) + tuple(tuple.__iter__(self))

    def numel(self) -> int:
        return math.prod(int(size) for size in tuple.__iter__(self))  # the same flattened or not


class _Rank(int):
    """The rank of a value with x's leading dims in the probe: a comparison of it is noted (a branch
    on it would take the other way on the flattened x), and so is its use as a value (in a torch
    function other than one that takes it as a dim, or as a float). Arithmetic on it keeps it a
    rank (``y.dim() - 1``); ``range()`` of it gives dims, which are the same either way."""


def _noting_rank(name: str):
    def method(self, *other):
        compares = name in ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__")
        _SizeWatch.note("its rank in a comparison (dim(), ndim)" if compares
                        else "its rank as a value (acc * acc.dim())")
        return getattr(int, name)(int.__int__(self), *other)

    return method


for _name in ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__float__", "__truediv__",
              "__rtruediv__", "__pow__", "__rpow__", "__int__"):
    setattr(_Rank, _name, _noting_rank(_name))


def _rank_arithmetic(name: str):
    def method(self, *args):
        result = getattr(int, name)(int.__int__(self), *args)
        return _Rank(result) if isinstance(result, int) and not isinstance(result, bool) else result

    return method


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__floordiv__",
              "__rfloordiv__", "__mod__", "__rmod__", "__neg__", "__pos__", "__abs__"):
    setattr(_Rank, _name, _rank_arithmetic(_name))
_Rank.__hash__ = int.__hash__


def _flattening_changes(kernel: Kernel, fn: Callable[..., Any], x_dims: int, n: int,
                         operands: Mapping[str, Any]) -> str | None:
    """Why flattening x's leading dims into M changes ``fn``'s results (None where it does not;
    2-d x, nothing to flatten, is never asked about: ``Linear._exact_dims``):
    ``fn`` runs on meta tensors with a probe of ``x_dims - 1`` leading dims (distinct sizes, also
    distinct from ``n``, the GEMM's N), and every output's shape must be the one the flattened kernel
    gives back.
    A reduction over rows (``y.sum(0)``, ``y.amax(-2)``) or a dim read by position differs: torch
    reduces over one leading dim, the kernel over all of M. Operands with x's leading dims take the
    probe's. None also where ``fn`` does not run on meta tensors and no output reduces over rows."""
    from evtc.frontend.epilogue import unwrap

    plan = kernel.plan
    probe = tuple(size for size in _PROBE_SIZES if size != n)[:x_dims - 1]
    rows = 1
    for size in probe:
        rows *= size
    dims = {s.name: s.dims for s in plan.outputs} | {h.name: h.dims for h in plan.host_outputs}
    ours = {name: (*probe, *shape[1:]) if dims[name][:1] == ("M",) else tuple(shape)
            for name, (shape, _) in zip(plan.output_order, kernel.output_meta(rows, n, 1), strict=True)}
    structure = plan.structure

    def label(name: str) -> str:
        if structure.kind == "single":
            return "the epilogue's output"
        if structure.kind == "dict":
            return f"the epilogue's output {(structure.keys or ())[structure.names.index(name)]!r}"
        return f"the epilogue's output {structure.names.index(name)} (counting from 0)"

    def meta(value):
        if not isinstance(value, torch.Tensor):
            return value
        shape = tuple(value.shape)
        if 2 <= len(shape) <= x_dims:
            # Leading dims right-aligned with x's ((S, N) beside (B, S, K)): the probe's size where
            # the operand spans x's dim, 1 where it broadcasts (_flatten_like checked the sizes).
            aligned = probe[len(probe) - (len(shape) - 1):]
            shape = (*(1 if s == 1 else p for s, p in zip(shape[:-1], aligned, strict=True)), shape[-1])
        return tensor(shape, dtype=value.dtype, device="meta")

    watch = not torch.compiler.is_compiling()  # (a tensor subclass is not for dynamo to trace)
    if not watch and kernel.plan.interface.shape_reads:
        # Nothing can watch what fn reads while dynamo traces: refuse where it reads more than a
        # last dim (Graph.shape_reads), which the flattened kernel would read otherwise.
        read = ", ".join(sorted(kernel.plan.interface.shape_reads))
        return (f"the epilogue reads a size or the rank of {read} "
                "(more than the last dim), which flattening x's leading dims would change; under "
                "torch.compile evtc.linear cannot tell which, so it refuses x of other than 2 dims "
                "here (eager calls check each read)")
    tensor = _SizeWatch.make if watch else torch.empty
    acc = tensor((*probe, n), dtype=torch.float32, device="meta")
    _SizeWatch.start(one_row=x_dims == 1)
    try:
        result = unwrap(fn)(acc, **{name: meta(v) for name, v in operands.items()})
        if _SizeWatch.read() is not None and x_dims == 1:
            return (f"the epilogue reads {_SizeWatch.read()} of a value of a 1-d x, which has one dim "
                    "fewer in torch than in the kernel (x is the one row of its GEMM): the values "
                    "would differ. Pass x as x.unsqueeze(0), or read only dims from the end")
        if _SizeWatch.read() is not None:
            # The values, not only the shapes, would differ: torch's function reads a leading dim
            # or the rank of a value with x's leading dims, where the kernel's sees M or 2.
            return (f"the epilogue reads {_SizeWatch.read()} of a value with x's leading dims, which "
                    f"flattening x's {x_dims - 1} leading dims into M changes (read only the last "
                    "dim, acc.shape[-1], and index dims from the end)")
    except NotImplementedError:  # an op without a meta kernel: judge by the plan alone
        across = [name for name in plan.output_order if "M" not in dims[name] and dims[name]]
        return (f"{label(across[0])} reduces over rows, which flattening x's {x_dims - 1} leading dims "
                "into M changes" if across else None)
    except Exception as exc:  # noqa: BLE001 - the function itself fails on x of this rank
        return f"the epilogue fails in PyTorch on x with {x_dims - 1} leading dims ({exc})"
    leaves = structure.flatten(result, lambda t: isinstance(t, torch.Tensor))
    if leaves is None:
        return None  # the kernel's own checks say what is wrong with the structure
    for name, value in leaves.items():
        if isinstance(value, torch.Tensor) and tuple(value.shape) != ours[name]:
            if x_dims == 1:  # x is one row: its GEMM's row dim is dropped, as F.linear drops it
                hint = ("; an operand with more dims broadcasts it: pass x as x.unsqueeze(0)"
                        if value.dim() > len(ours[name]) else "")
                return (f"with a 1-d x, {label(name)} has shape {tuple(value.shape)} in PyTorch, but "
                        f"evtc.linear, which runs x as the one row of its GEMM, would return "
                        f"{ours[name]}{hint}")
            return (f"on x with {x_dims - 1} leading dims (probed with sizes {probe}), {label(name)} has "
                    f"shape {tuple(value.shape)} "
                    f"in PyTorch, but evtc.linear flattens the leading dims into M and would return "
                    f"{ours[name]}")
    return None


def linear(
    fn: Callable[..., Any],
    example_inputs: Mapping[str, Any],
    *,
    out_dtypes: OutDtypes = None,
    config: Mapping[str, Any] | Any | None = None,
    arch: str | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> Linear:
    """Compile ``fn(x @ weight.t(), ...)`` for ``nn.Linear``-style inputs.

    Args:
        fn: the epilogue ``fn(acc, *operands)``, as for :func:`evtc.compile`.
        example_inputs: ``x`` (``(..., in_features)``), ``weight`` (``(out_features, in_features)``)
            and one entry per operand; operands with ``x``'s leading dims are flattened like it.
        out_dtypes, config, arch, cache_dir: as for :func:`evtc.compile`.

    Returns:
        a :class:`Linear`: ``lin(x, weight, **operands, out=None)``.
    """
    from evtc.frontend.epilogue import parameter_names

    try:
        if not isinstance(example_inputs, Mapping):
            raise CallError(f"evtc.linear: example_inputs must be a dict with 'x', 'weight' and the "
                            f"operands, got {type(example_inputs).__name__}")
        example = dict(example_inputs)
        if "x" not in example or "weight" not in example:
            raise CallError("evtc.linear: example_inputs needs 'x' (..., in_features) and 'weight' "
                            "(out_features, in_features)")
        stray = [key for key in ("a", "b") if key in example]
        if stray:
            raise CallError(f"evtc.linear: example_inputs has {', '.join(map(repr, stray))}, which "
                            "evtc.linear builds itself from x and weight (a = x's rows, b = weight.t()): "
                            "leave it out")
        x, weight = example.pop("x"), example.pop("weight")
        if any(isinstance(v, tuple) and len(v) == 2 and all(isinstance(t, torch.Tensor) for t in v)
               for v in (x, weight)):
            raise CallError("evtc.linear: x or weight is a (tensor, scales) pair: evtc.linear takes no "
                            "block scales. Compile the epilogue with evtc.compile and a = (x, x_scales), "
                            "b = (weight.t(), weight_scales.t()) as example inputs (docs/fp8.md, 'Block "
                            "scales'); per-tensor or rowwise scales are operands of the epilogue")
        if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor) or x.dim() < 1 \
                or weight.dim() != 2:
            raise CallError("evtc.linear: example x must be a (..., in_features) tensor and weight an "
                            "(out_features, in_features) one; got "
                            f"{_describe_arg(x)} and {_describe_arg(weight)}")
        supported = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2)
        for name, value in (("x", x), ("weight", weight)):
            if value.dtype not in supported:
                raise CallError(f"evtc.linear: {name} has dtype {value.dtype}; the kernel multiplies "
                                "float16, bfloat16, float32 (as tf32) or float8 inputs")
        float8 = {torch.float8_e4m3fn, torch.float8_e5m2}
        if x.dtype != weight.dtype and not {x.dtype, weight.dtype} <= float8:
            raise CallError(f"evtc.linear: example x is {x.dtype} and weight {weight.dtype}; they must "
                            "match, as F.linear requires (only float8 ones may mix e4m3 and e5m2)")
        if x.shape[-1] != weight.shape[1]:
            raise CallError(f"evtc.linear: example x has {x.shape[-1]} input features, weight "
                            f"{weight.shape[1]} (weight is (out_features, in_features) = "
                            f"{tuple(weight.shape)})")
        clash = [p for p in parameter_names(fn)[1:] if p in ("x", "weight")]
        if clash:
            raise CallError(f"evtc.linear: the epilogue has a parameter named {clash[0]!r}, which is "
                            "evtc.linear's own input (x @ weight.t() is its accumulator): rename it")
        lead = tuple(x.shape[:-1])
        operands = example
        example = {name: _flatten_like(v, lead) for name, v in example.items()}
        flat_example = {"a": _rows(x), "b": weight.t(), **example}
        kernel = _compile_kernel(fn, flat_example, out_dtypes=out_dtypes, config=config, arch=arch,
                                 cache_dir=cache_dir)
    except EpilogueError as err:
        raise err.with_traceback(None) from None
    lin = Linear(kernel, fn, flat_example, out_dtypes,
                 {"config": config, "arch": arch, "cache_dir": cache_dir})
    lin._check_leading_dims(x.dim(), weight.shape[0], operands)
    return lin


def _with_accumulator(fn: Callable[..., Any], gated: bool, widen: bool = False) -> Callable[..., Any]:
    """``fn`` returning also its accumulator argument (or its gate and up halves, for a gated
    epilogue) as the last leaves of a tuple: ``(*fn's outputs, acc)``, in float32 with ``widen``.
    Its signature is ``fn``'s (``functools.wraps``), so it traces with the same inputs."""
    import functools

    from evtc.frontend.epilogue import unwrap
    from evtc.frontend.inputs import read_signature

    user = unwrap(fn)
    acc_name = read_signature(user).acc_name

    @functools.wraps(user)
    def with_accumulator(*args, **kwargs):
        out = user(*args, **kwargs)
        acc = args[0] if args else kwargs[acc_name]
        saved = tuple(acc.chunk(2, dim=-1)) if gated else (acc,)
        if widen:  # (float16 inputs: the accumulator kept in float32, saved_accumulator_dtype)
            saved = tuple(s.float() for s in saved)
        if isinstance(out, dict):
            return (*out.values(), *saved)
        if isinstance(out, tuple | list):
            return (*out, *saved)
        return (out, *saved)

    return with_accumulator
