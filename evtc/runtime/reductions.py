"""Finishing reductions: the buffers a launch needs for them, and the host finish where the kernel
does not finish them itself.

A kernel whose plan has ``kernel_finish`` stores its reductions' outputs itself (the last tile of
each block of rows or columns, and for reductions per batch or over everything the last such block,
:class:`evtc.sm90.operands.KernelFinish`): :class:`ReductionFinish` then only allocates those outputs
(flat) and the counters, and a call returns them reshaped. Otherwise:

The kernel writes, per reduction, float32 partials into a flat workspace (spare elements last, see
:mod:`evtc.sm90.operands`):

* per row (``ReductionOverN``, also behind per-batch and whole-output reductions): each row's partial
  of each tile, (L, n tiles, M);
* per column (``ReductionOverM``): each column's partial of each tile (the warps' partials combined
  in shared memory), (L, m tiles, N).

:class:`ReductionFinish` reduces them over the partials with one torch op each (a fixed order, so the
result is the same bit for bit on every run), then over rows and batches for per-batch and
whole-output reductions, and runs the plan's finish steps: what the epilogue computes from
finished reductions (the 1/N of a mean, ``sqrt(ms + eps)``, a scale). Everything is prepared from
the plan once; a call runs torch ops only (no sympy, no graph).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from evtc.ir.dtypes import as_kernel_storage, round_to, torch_dtype
from evtc.ir.ops import ELEMENTWISE
from evtc.plan.kernel_plan import KernelPlan, ReductionPartials
from evtc.plan.smem import TWO_LEVEL_FINISH_AXES
from evtc.runtime import stream_buffers

_REDUCE = {"sum": torch.sum, "max": torch.amax, "min": torch.amin}


def _tiles(size: int, tile: int) -> int:
    return -(-size // tile)


def size_function(expr: str):
    """``expr`` (Python source over L, M, N, see :class:`evtc.plan.kernel_plan.KernelInput`) as a
    function of the problem size (called per call: only a quotient pays for the zero guard)."""
    fn = eval(f"lambda L, M, N: {expr}", {"math": math, "__builtins__": {}})  # noqa: S307 - our own plan
    if "/" not in expr and "**" not in expr:
        return fn

    def quotient(L, M, N):  # noqa: N803 - the plan's size names
        try:
            return fn(L, M, N)
        except ZeroDivisionError:
            # 1/N of a mean over an empty dim: torch's mean is then NaN (its sum 0 times this).
            # (A negative power of a size of 0 raises in Python, so torch's epilogue would too:
            # its result has no elements to hold the value.)
            return math.inf

    return quotient


def _cast(value, dtype: torch.dtype):
    """A value of ``dtype`` held in float32 (rounded through ``dtype`` where narrower), as the
    reference evaluator casts."""
    if not isinstance(value, torch.Tensor):
        return float(value)
    if value.dtype == torch.bool:
        value = value.to(torch.float32)
    if dtype == torch.float32:
        return value.to(torch.float32)
    return round_to(value.to(torch.float32), dtype)


#: The largest output (L x M x N elements) whose reductions the kernel finishes itself. Above it
#: the kernel counts no tile and the host finishes. Measured (bench/kernel_finish.py, H100,
#: docs/performance.md): at 16M output elements the kernel's finish costs the same GPU time as the
#: host's few torch ops (0.96 to 1.03) and saves their host time (calls 3 to 8% faster, twice as
#: fast at 4M and below); at 64M and K = 1024 its count (a barrier and an atomic round trip per
#: tile) and its last tiles' loads cost 4 to 9% of GPU time, and the host's ops overlap the next
#: kernel.
KERNEL_FINISH_MAX_OUTPUT = 1 << 24


@dataclass(frozen=True)
class SizeLayout:
    """What a launch of one problem size needs for its reductions, worked out once per size."""

    #: Whether the kernel finishes this problem's reductions (else the host does).
    in_kernel: bool
    #: Elements of each reduction's workspace.
    numels: tuple[int, ...]
    #: The kernel-finished outputs, flat: (elements, dtype) in argument order.
    flats: tuple[tuple[int, torch.dtype], ...] = ()
    #: The finish's int32 counters.
    counters: int = 0
    #: The host outputs in the plan's order, for a kernel finish: (index among ``flats``, the shape
    #: to view it as, or None where the flat tensor already has it).
    views: tuple[tuple[int, tuple[int, ...] | None], ...] = ()


class ReductionFinish:
    """The host half of a kernel's reductions (see the module docstring): the buffers a launch
    needs for them, and the outputs finished from them."""

    def __init__(self, plan: KernelPlan, tile_m: int, out_tile_n: int) -> None:
        self.reductions = plan.reductions
        self.tile_m = tile_m
        self.out_tile_n = out_tile_n
        self.literals = {s.node: size_function(s.expr) for s in plan.finish if s.op == "literal"}
        self.steps = plan.finish
        #: Whether the kernel finishes the reductions (see the module docstring).
        self.in_kernel = bool(plan.kernel_finish)
        dtypes = {h.name: torch_dtype(h.dtype) for h in plan.host_outputs}
        # The kernel's finished outputs in argument order: (name, axis, dtype).
        self.finished = [(name, axis, dtypes[name]) for axis, names in plan.kernel_finish for name in names]
        #: Whether a finished output is bool (a mask): the kernel writes its bytes as float8
        #: (:meth:`kernel_views`).
        self.finishes_masks = any(dt == torch.bool for _, _, dt in self.finished)
        #: Whether a finish has a second level (per batch or over everything), whose blocks' values
        #: follow the partials in the workspaces.
        self.two_level = any(axis in TWO_LEVEL_FINISH_AXES for axis, _ in plan.kernel_finish)
        self.host_dims = {h.name: h.dims for h in plan.host_outputs}
        self.host_names = [h.name for h in plan.host_outputs]
        self._layouts: dict[tuple[int, int, int, int], SizeLayout] = {}

    def kernel_finishes(self, m: int, n: int, batches: int) -> bool:
        """Whether the launch of an (L, M, N) problem finishes the reductions in the kernel."""
        return self.layout(m, n, batches).in_kernel

    def layout(self, m: int, n: int, batches: int) -> SizeLayout:
        """The :class:`SizeLayout` of an (L, M, N) problem (kept per size: the per-call path)."""
        key = (m, n, batches, KERNEL_FINISH_MAX_OUTPUT)  # the limit: tests move it
        found = self._layouts.get(key)
        if found is None:
            if len(self._layouts) > 4096:  # many distinct sizes: start over rather than grow
                self._layouts.clear()
            found = self._layouts[key] = self._work_out(m, n, batches)
        return found

    def _work_out(self, m: int, n: int, batches: int) -> SizeLayout:
        numels = tuple(self.workspace_numels(m, n, batches))
        if not (self.in_kernel and m and n and batches and m * n * batches <= KERNEL_FINISH_MAX_OUTPUT):
            return SizeLayout(False, numels)
        per_axis = {"row": batches * m, "col": batches * n, "batch": batches, "all": 1}
        flats = tuple((per_axis[axis], dt) for _, axis, dt in self.finished)
        sizes = {"M": m, "N": n, "L": batches, "1": 1}
        index = {name: i for i, (name, _, _) in enumerate(self.finished)}
        views = tuple((index[name], None if len(self.host_dims[name]) == 1
                       else tuple(sizes[d] for d in self.host_dims[name])) for name in self.host_names)
        return SizeLayout(True, numels, flats, self._counters(m, n, batches), views)

    def buffers(self, m: int, n: int, batches: int, device) -> list[torch.Tensor]:
        """The buffers a launch passes after its full-tile outputs: each reduction's workspace, then
        for a kernel that can finish its reductions its outputs (flat) and its counters (zero
        between launches, reused on the current stream), or, where the host finishes this problem,
        placeholders the kernel never touches (one counter turns its finish off). An empty problem
        gets the workspaces only (no kernel runs)."""
        layout = self.layout(m, n, batches)
        if layout.in_kernel:
            # Read back by the kernel itself: buffers reused on this stream.
            stream = stream_buffers.stream_key(device)
            # An allocation per output, as torch's ops return them: pieces cut from one would be
            # views of one storage, which torch refuses to change in place while autograd records
            # (a function returning several views), and which torch.save writes whole.
            flats = [torch.empty(numel, dtype=dtype, device=device) for numel, dtype in layout.flats]
            return (stream_buffers.scratch_workspaces(device, layout.numels, stream) + flats
                    + [stream_buffers.counters(device, layout.counters, pool="finish", stream=stream)])
        numels = layout.numels
        if len(numels) == 1:
            workspaces = [torch.empty(numels[0], dtype=torch.float32, device=device)]
        else:  # one allocation, split
            workspaces = list(torch.empty(sum(numels), dtype=torch.float32, device=device).split(numels))
        if self.in_kernel and m and n and batches:
            # A per-batch output's length is tied to a's batch size in the compiled signature:
            # its placeholder has L elements (one element failed the launch for L > 1).
            workspaces += _placeholders(device, [(dt, batches if axis == "batch" else 1)
                                                 for _, axis, dt in self.finished])
        return workspaces

    def kernel_views(self, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        """``buffers`` as the compiled function takes them: a bool output (and its placeholder) as a
        float8 view of its bytes, which the kernel's finish writes as 0 and 1 (as_kernel_storage)."""
        if not self.finishes_masks:
            return buffers
        return [as_kernel_storage(t) for t in buffers]

    def _counters(self, m: int, n: int, batches: int) -> int:
        """The counters a launch's finish uses (see :class:`evtc.sm90.operands.KernelFinish`): per
        block of rows, per block of columns, and where a finish has a second level (per batch,
        over everything) a block of rows and a batch for each of the two."""
        tiles_m = _tiles(m, self.tile_m)
        count = batches * (tiles_m + _tiles(n, self.out_tile_n))
        if self.two_level:
            count += 2 * batches * (tiles_m + 1)
        return count

    def partial_rows(self, r: ReductionPartials, m: int, n: int) -> tuple[int, int]:
        """(partials per reduced value, reduced values) of one batch: (n tiles, M) per row, (m tiles,
        N) per column."""
        if r.axis == "col":
            return _tiles(m, self.tile_m), n
        return _tiles(n, self.out_tile_n), m

    def workspace_numels(self, m: int, n: int, batches: int) -> list[int]:
        """Per reduction: the partials of every batch, for a finish with a second level the
        blocks' values (L x m tiles), and at least one spare element (the kernel's
        branch-free stores go to the last), rounded up to 16 bytes so that the workspaces can be
        cut from one allocation, each aligned as TMA and the kernel need."""
        out = []
        for r in self.reductions:
            parts, values = self.partial_rows(r, m, n)
            numel = parts * values * batches + 1
            if self.two_level:
                numel += batches * _tiles(m, self.tile_m)  # the blocks' values, (L, m tiles)
            out.append(-(-numel // 4) * 4)
        return out

    def __call__(self, buffers: Sequence[torch.Tensor], m: int, n: int, batches: int,
                 operands: Mapping[str, Any]) -> list[torch.Tensor]:
        """The host outputs in the plan's order: those the kernel finished, or computed here from
        the partials (also for a kernel that finishes them, when the problem was empty and no
        kernel ran). ``buffers``: what :meth:`buffers` gave the launch."""
        layout = self.layout(m, n, batches)
        if layout.in_kernel:
            flats = buffers[len(self.reductions):]
            return [flats[i] if shape is None else flats[i].view(shape) for i, shape in layout.views]
        workspaces = buffers
        sizes = {"M": m, "N": n, "L": batches, "1": 1}
        values: dict[int, Any] = {}
        for r, ws in zip(self.reductions, workspaces, strict=False):  # finish buffers follow
            reduce = _REDUCE[r.op]
            parts, count = self.partial_rows(r, m, n)
            value = reduce(ws[:batches * parts * count].view(batches, parts, count), dim=1)  # (L, M) / (L, N)
            if r.axis == "batch":
                value = reduce(value, dim=1)
            elif r.axis == "all":
                value = reduce(value)
            values[r.node] = value.reshape([sizes[d] for d in r.dims])
        outputs: dict[str, torch.Tensor] = {}
        device = workspaces[0].device if workspaces else None
        for step in self.steps:
            op = step.op
            if op == "store":
                outputs[step.name] = values[step.inputs[0]].to(torch_dtype(step.dtype))
            elif op == "literal":
                values[step.node] = float(self.literals[step.node](batches, m, n))
            elif op == "arg":
                values[step.node] = float(operands[step.name])
            elif op == "load":
                values[step.node] = operands[step.name].to(device=device, dtype=torch.float32)
            elif op == "cast":
                values[step.node] = _cast(values[step.inputs[0]], torch_dtype(step.dtype))
            else:
                definition = ELEMENTWISE[op]
                args = [values[i] for i in step.inputs]
                if not any(isinstance(a, torch.Tensor) for a in args):
                    args[0] = torch.full((), args[0], dtype=torch.float32, device=device)  # capturable
                result = definition.evaluate(*args, **dict(step.params))
                values[step.node] = result if definition.boolean else _cast(result, torch_dtype(step.dtype))
        return [outputs[name] for name in self.host_names]


_PLACEHOLDERS: dict = {}


def _placeholders(device, outputs: list) -> list[torch.Tensor]:
    """Tensors of ``outputs``' (dtype, elements) and one int32 counter, kept per device: the
    arguments of a launch whose finish is off (never read or written)."""
    key = (str(device), tuple(outputs))
    cached = _PLACEHOLDERS.get(key)
    if cached is None:
        def make():
            return ([torch.empty(numel, dtype=dt, device=device) for dt, numel in outputs]
                    + [torch.zeros(1, dtype=torch.int32, device=device)])
        if device.type == "cuda" and stream_buffers.stream_key(device) is None:
            return make()  # under stream capture: nothing is kept
        if len(_PLACEHOLDERS) > 256:  # many batch sizes: start over rather than grow
            _PLACEHOLDERS.clear()
        with stream_buffers.kept(device):
            cached = _PLACEHOLDERS[key] = make()
    return cached


__all__ = ["KERNEL_FINISH_MAX_OUTPUT", "ReductionFinish", "SizeLayout", "size_function"]
