"""What every call of a kernel needs from its plan, worked out once when the kernel is made.

A call's host work is small only if nothing is derived from the plan per call: which names the
user passes and which the kernel takes (a gated kernel takes b and wide operands whole, with where
their up halves start), how each kernel input is found (a tensor, a runtime scalar, a literal
computed from the sizes), how each output is allocated (its dtype and the order of its dims in
memory) and how the outputs are returned (the epilogue's structure). :class:`CallSpec` holds all of
it; it depends on the plan only, not on the GEMM's configuration (every variant of a kernel builds
the same one).
"""

from __future__ import annotations

from typing import Any

import torch

from evtc.ir.dtypes import as_kernel_storage, torch_dtype
from evtc.plan.kernel_plan import KernelPlan
from evtc.runtime.reductions import size_function
from evtc.runtime.staging import compact_order, compact_strides

#: How a kernel input is found per call (the first item of :attr:`CallSpec.getters`).
TENSOR, SCALAR, LITERAL = 0, 1, 2


def halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up halves of ``t`` along its last dim: views, never copies (one torch call,
    cheaper than two slices)."""
    return t.chunk(2, dim=-1)


class NotPlainGated(ValueError):
    """A gated call the fast path does not take as it is (the slow path says what is wrong)."""


class CallSpec:
    """A kernel plan's call interface, prepared for the per-call path (see the module docstring)."""

    def __init__(self, plan: KernelPlan):
        self.plan = plan
        interface = plan.interface
        #: The names the user passes after a and b (the epilogue's live operands).
        self.names: list[str] = list(plan.operand_names)
        self.name_set = frozenset(self.names)
        #: Operands as wide as the GEMM, which a gated kernel splits into gate and up halves.
        self.wide_operands = plan.wide_operands
        #: Elements per 16 bytes of each: where its up half starts must be a multiple.
        self._wide_align = {i.user: i.spec.align_elems() for i in plan.inputs if i.half == 1}
        #: Per kernel input: (TENSOR, its name), (SCALAR, its name) or (LITERAL, a function of
        #: (L, M, N)).
        self.getters: list[tuple[int, Any]] = [
            (LITERAL, size_function(i.expr)) if i.kind == "literal"
            else (SCALAR, i.name) if i.kind == "arg" else (TENSOR, i.name)
            for i in plan.inputs]
        #: Where :meth:`inputs` puts the operands' tensors.
        self.tensor_slots = tuple(i for i, (kind, _) in enumerate(self.getters) if kind == TENSOR)
        #: How many inputs the kernel takes by name (a gated kernel's halves count twice).
        self.kernel_name_count = sum(1 for i in plan.inputs if i.kind != "literal")
        self.gated = plan.gated
        #: Elements of b per 16 bytes: a gated kernel's up half must start at a multiple.
        self.b_align = plan.b.align_elems()
        self.batched = plan.batched
        #: D's unit-stride dim is M (a column-major output), so rows of M must be 16-byte multiples.
        self.d_by_m = plan.d_major == "m"
        self.out_dtypes = [torch_dtype(s.dtype) for s in plan.outputs]
        #: Whether an output is bool (a mask): the compiled function takes it as float8 bytes
        #: (:meth:`kernel_views`).
        self.has_masks = torch.bool in self.out_dtypes
        #: Positions (kernel order) of the full-tile outputs that are the same in every batch
        #: (KernelPlan.batch_free), each with the rank torch gives it: the call returns their
        #: first batch (``t[0]``, or ``t[:1]`` for a (1, M, N) one).
        ranks = dict(plan.batch_free)
        self.batch_free = {i: ranks[s.name] for i, s in enumerate(plan.outputs) if s.name in ranks}
        rank = 3 if plan.batched else 2
        #: Per output: (dtype, the physical order of its dims or None when row-major): what
        #: staging.empty_in_layout does, prepared once.
        self.out_allocs = []
        for dt, spec in zip(self.out_dtypes, plan.outputs, strict=True):
            layout = compact_order(rank, spec.contiguous)
            self.out_allocs.append((dt, layout[0] if layout else None))
        #: Output names in kernel order: the full-tile outputs, then those finished after the tiles.
        self.kernel_order: list[str] = list(plan.output_order)
        self.host_outputs = plan.host_outputs
        #: The structure the epilogue returns (a tensor, a tuple, a dict).
        self.tree = plan.structure
        self.single_output = plan.structure.kind == "single"
        # Where each returned output is in kernel order, and a dict result's keys.
        position = {name: i for i, name in enumerate(self.kernel_order)}
        self._result_index = [position[name] for name in plan.structure.names]
        self._result_keys = tuple(plan.structure.keys or ())
        self._result_kind = plan.structure.kind
        #: Whether a call may pass parameters the kernel does not take (unused ones, constants).
        self.accepts_more = bool(interface.unused or interface.constants or interface.defaults)
        #: The runtime scalars (compiled from Python numbers), which a call passes as numbers.
        self.arg_names = tuple(i.name for i in plan.inputs if i.kind == "arg")
        #: The compiled dtype of each tensor operand, by the name the user passes.
        self.operand_dtypes = {i.user: torch_dtype(i.spec.dtype) for i in plan.inputs if i.spec is not None}
        #: Elements per 16 bytes of the narrowest output dtype: an N that is not a multiple of it
        #: needs padded output rows (the staged path).
        self.out_align = max((spec.align_elems() for spec in plan.outputs), default=1)
        #: Block-scaled float8: rows of a per scale (1 or 128); 0: a and b are plain tensors.
        self.scale_rows = plan.a_scale_rows
        #: float32 a and b: the kernel's wgmma is tf32, so it runs only where torch would use tf32.
        #: The GEMM's N where the epilogue's split fixes it (CallInterface.fixed_n), else None.
        self.fixed_n = interface.fixed_n
        self.tf32 = interface.torch_only is None and plan.a.dtype == "float32"

    # ---- gated kernels ---------------------------------------------------------------------------
    def kernel_operands(self, operands: dict, *, staging: bool = False) -> dict:
        """A gated kernel's operands under its names for them: an operand as wide as the GEMM whole
        in its gate half's place and, in its up half's, where that half starts in elements (the
        kernel makes the halves' views, see :class:`evtc.sm90.launch.Launcher`); the others as they
        are. Raises NotPlainGated for an up half off 16 bytes unless ``staging`` (which copies the
        operand so that it is aligned)."""
        args: dict[str, Any] = {}
        for i in self.plan.inputs:
            if i.half is not None:
                if i.user in operands:
                    t = operands[i.user]
                    if i.half == 0:
                        args[i.name] = t
                    else:
                        up = t.shape[-1] // 2 * t.stride(-1)
                        if up % self._wide_align[i.user] and not staging:
                            raise NotPlainGated(f"{i.user}'s up half is not 16-byte aligned: staged")
                        args[i.name] = up
            elif i.name in operands:
                args[i.name] = operands[i.name]
        return args

    def kernel_arguments(self, b, operands: dict) -> tuple[tuple, dict]:
        """A gated call as the kernel computes it, for the slow path's checks: b's (gate, up) halves,
        and every operand as wide as the GEMM as its two halves (views) under the kernel's names
        for them, the others as they are."""
        args: dict[str, Any] = {}
        split: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for i in self.plan.inputs:
            if i.half is not None:
                if i.user in operands:
                    if i.user not in split:
                        split[i.user] = halves(operands[i.user])
                    args[i.name] = split[i.user][i.half]
            elif i.name in operands:
                args[i.name] = operands[i.name]
        return halves(b), args

    def split(self, b, operands: dict, *, staging: bool = False) -> tuple[torch.Tensor, int, dict]:
        """A gated call's (b, where b's up half starts in elements, operands) as the kernel takes
        them (gated kernels only: others take b and their operands as the call passes them): b
        and operands as wide as the GEMM whole, with where their up halves start
        (:meth:`kernel_operands`). Raises NotPlainGated for anything unusual (odd N, an unknown
        keyword, a wide operand of another width, or unless ``staging``, an up half that is not
        16-byte aligned), which the slow path checks, names or stages."""
        n = b.shape[-1]
        if n % 2 or operands.keys() != self.name_set:
            raise NotPlainGated("not a plain gated call")
        for name in self.wide_operands:
            if operands[name].shape[-1] != n:
                raise NotPlainGated("not a plain gated call")
        up = n // 2 * b.stride(-1)
        if up % self.b_align and not staging:
            raise NotPlainGated("the up half is not 16-byte aligned: staged")
        return b, up, self.kernel_operands(operands, staging=staging)

    # ---- per call --------------------------------------------------------------------------------
    def inputs(self, kernel_operands: dict, m: int, n: int, batches: int) -> list:
        """The kernel's epilogue inputs in its order: tensors as passed, scalars as floats."""
        return [kernel_operands[what] if kind == TENSOR else _number(kernel_operands[what]) if kind == SCALAR
                else float(what(batches, m, n)) for kind, what in self.getters]

    def new_outputs(self, device, m: int, n: int, batches: int) -> list[torch.Tensor]:
        """Uninitialised full-tile outputs for an (L, M, N) problem, in the plan's layouts
        (``torch.empty_strided``: a third less host time than ``torch.empty``, and no permute)."""
        # Row-major strides are compact_strides(shape) written out: this runs on every call.
        pitch = max(n, 1)  # torch's strides count a dim of size 0 as 1
        if self.batched:
            shape, row_major = (batches, m, n), (max(m, 1) * pitch, pitch, 1)
        else:
            shape, row_major = (m, n), (pitch, 1)
        return [torch.empty_strided(shape, row_major if order is None else compact_strides(shape, order),
                                    dtype=dt, device=device)
                for dt, order in self.out_allocs]

    def kernel_views(self, outs: list[torch.Tensor]) -> list[torch.Tensor]:
        """``outs`` (kernel order) as the compiled function takes them: a bool output as a float8
        view of its bytes (evtc.ir.dtypes.as_kernel_storage)."""
        return [as_kernel_storage(t) for t in outs] if self.has_masks else outs

    def output_meta(self, m, n, batches) -> list[tuple[tuple, torch.dtype]]:
        """(shape, dtype) of every output in kernel order for an (L, M, N) GEMM (N: the GEMM's;
        sizes may be symbolic, for fake tensors)."""
        if self.gated:
            n = n // 2  # N is the output's width in a gated graph
        tile = (batches, m, n) if self.batched else (m, n)
        free = {2: (m, n), 3: (1, m, n)}
        meta = [(free[self.batch_free[i]] if i in self.batch_free else tile, dt)
                for i, dt in enumerate(self.out_dtypes)]
        dims = {"M": m, "N": n, "L": batches, "1": 1}
        for host in self.host_outputs:
            meta.append((tuple(dims[d] for d in host.dims), torch_dtype(host.dtype)))
        return meta

    def first_batch(self, index: int, t: torch.Tensor) -> torch.Tensor:
        """Output ``index`` (kernel order) as torch shapes it: for one the same in every batch
        (:attr:`batch_free`), the first batch of the kernel's (L, M, N) ``t``; else ``t``."""
        rank = self.batch_free.get(index)
        if rank is None:
            return t
        return t[0] if rank == 2 else t[:1]

    def result(self, outs: list):
        """The outputs (kernel order) in the structure the epilogue returns."""
        if self.single_output:
            return outs[0]
        returned = [outs[i] for i in self._result_index]
        if self._result_kind == "tuple":
            return tuple(returned)
        if self._result_kind == "list":
            return returned
        return dict(zip(self._result_keys, returned, strict=True))

    def describe_tree(self) -> str:
        return self.tree.describe()


__all__ = ["LITERAL", "SCALAR", "TENSOR", "CallSpec", "NotPlainGated", "halves"]


def _number(value) -> float:
    """A runtime scalar as the kernel takes it. Only a Python float or int (float() would also
    take a string, or a tensor at the cost of a device synchronisation): anything else is a
    TypeError, which sends the call to the slow path to be named."""
    if type(value) is float:
        return value
    if isinstance(value, int | float):
        return float(value)
    raise TypeError("a runtime scalar must be a Python float or int")
