"""The base class of generated epilogue visitors.

A generated visitor (see :mod:`evtc.codegen.emit`) declares its operands and two methods:

* ``inputs``: the epilogue's inputs in call order (:mod:`evtc.sm90.operands`), each owning its
  TMA atom, shared memory and registers;
* ``outputs``: the full-tile outputs; the first is written by the kernel's own D store, the others
  (:class:`~evtc.sm90.operands.TileStore`) by their own TMA stores;
* ``uniform(**scalars) -> dict``: the values that do not vary over the tile, computed once per tile;
* ``fragment(acc, **values) -> tuple``: the computation on this thread's float32 fragment of one
  subtile, returning one value per output. A gated visitor (``gated = True``) takes two
  accumulator fragments, ``fragment(acc_gate, acc_up, **values)``: the gate and up halves of one
  output subtile (see :mod:`evtc.ir.passes.gated`).

This class turns that into the kernel's visitor protocol (docs/kernel.md): every hook calls the same
hook of each operand, then ``visit`` calls ``fragment``. Parameters of ``uniform`` and ``fragment``
are matched by name with the inputs and with what ``uniform`` returns.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

from evtc.plan.config import GemmConfig
from evtc.plan.smem import d_buffer_input as plan_d_buffer_input
from evtc.sm90.operands import Operand, TileStore
from evtc.sm90.visitor import EpilogueContext, EpilogueShape, EpilogueVisitor


def d_buffer_input(inputs, aux_outputs, config: GemmConfig) -> int | None:
    """Index of the input whose staged tile buffers D can share (see
    :meth:`EpilogueVisitor.offers_d_buffer`): the planner's rule
    (:func:`evtc.plan.smem.d_buffer_input`) applied to the visitor's operands."""
    described = [(o.kind, o.dtype_name, getattr(o, "major", "n")) for o in inputs]
    return plan_d_buffer_input(described, bool(aux_outputs), config)


class FusedVisitor(EpilogueVisitor):
    name = "fused"
    inputs: tuple[Operand, ...] = ()
    outputs: tuple[TileStore, ...] = ()
    #: Reductions of tile values (ReductionOverN): ``fragment`` returns their inputs after the outputs.
    reductions: tuple[Operand, ...] = ()
    #: The reductions the kernel finishes itself, one KernelFinish per axis (each names the method
    #: of this class that computes its outputs); empty when the host finishes them.
    finishes: tuple[Operand, ...] = ()
    #: Gated: the kernel pairs gate and up columns, and ``fragment`` takes both accumulator halves.
    gated: bool = False

    def uniform(self) -> dict:
        return {}

    def fragment(self, acc):
        return (acc,)

    # ---- host, plain Python ------------------------------------------------------------------------
    @property
    def stores_d(self) -> bool:
        """False when every output is a reduction: the kernel then writes no D tile."""
        return bool(self.outputs)

    def __init__(self) -> None:
        self._uniform_params = list(inspect.signature(self.uniform).parameters)
        params = list(inspect.signature(self.fragment).parameters)
        n_acc = 2 if self.gated else 1
        self._fragment_params = params[n_acc:]
        self._aux = tuple(self.outputs[1:])

    @property
    def operands(self) -> tuple[Operand, ...]:
        """Everything that takes a kernel argument: inputs, the extra outputs, the reductions'
        workspaces, the finishes' counters and outputs."""
        return tuple(self.inputs) + self._aux + tuple(self.reductions) + tuple(self.finishes)

    def smem_bytes(self, config: GemmConfig, load_stages: int) -> int:
        stores = (config.epi_stages if config.epi_stages is not None else 2) * config.epi_groups
        return sum(o.smem_bytes(config.tile_shape_mnk[:2], config.epi_tile, load_stages, stores)
                   for o in self.operands)

    def offers_d_buffer(self, config: GemmConfig) -> bool:
        return d_buffer_input(self.inputs, self._aux, config) is not None

    def load_bytes(self, config: GemmConfig) -> int:
        return sum(o.load_bytes(config.epi_tile) for o in self.inputs if o.loads)

    # ---- host, traced ------------------------------------------------------------------------------
    def setup(self, shape: EpilogueShape, args: tuple) -> tuple:
        return tuple(o.setup(shape, a) for o, a in zip(self.operands, args, strict=True))

    # ---- device ------------------------------------------------------------------------------------
    def allocate(self, shape, params, smem):
        # Swizzled (1024 B aligned) buffers first: they then follow one another without gaps.
        storage: dict[int, object] = {}
        for first in (True, False):
            for i, (o, p) in enumerate(zip(self.operands, params, strict=True)):
                if o.swizzled == first:
                    storage[i] = o.allocate(shape, p, smem)
        return tuple(storage[i] for i in range(len(self.operands)))

    def d_buffer(self, shape, storage):
        return storage[d_buffer_input(self.inputs, self._aux, shape.config)]

    def load_tile(self, shape, params, storage, tile_coord):
        return [o.load_tile(shape, p, s, tile_coord) if o.loads else None
                for o, p, s in zip(self.inputs, params, storage, strict=False)]

    def load_subtile(self, shape, params, storage, load_state, epi_idx, stage, barrier_ptr):
        for o, p, s, ls in zip(self.inputs, params, storage, load_state, strict=False):
            if o.loads:
                o.load_subtile(shape, p, s, ls, epi_idx, stage, barrier_ptr)

    def begin(self, ctx: EpilogueContext, params, storage, tile_coord):
        states = [o.begin(ctx, p, s, tile_coord)
                  for o, p, s in zip(self.operands, params, storage, strict=True)]
        n_in, n_aux, n_red = len(self.inputs), len(self._aux), len(self.reductions)
        values = {o.name: st.value for o, st in zip(self.inputs, states[:n_in], strict=True)
                  if not o.loads}
        values.update(self.uniform(**{k: values[k] for k in self._uniform_params}))
        return SimpleNamespace(inputs=states[:n_in], aux=states[n_in:n_in + n_aux],
                               reductions=states[n_in + n_aux:n_in + n_aux + n_red],
                               finishes=states[n_in + n_aux + n_red:], values=values, outs=None)

    def previsit(self, ctx, state, epi_idx, load_stage):
        for o, st in zip(self.inputs, state.inputs, strict=True):
            if o.loads:
                o.previsit(ctx, st, epi_idx, load_stage)

    def visit(self, ctx, state, epi_idx, acc):
        values = dict(state.values)
        for o, st in zip(self.inputs, state.inputs, strict=True):
            if o.loads:
                values[o.name] = st.value
        accs = acc if self.gated else (acc,)  # gated: the kernel passes (gate, up)
        results = self.fragment(*accs, **{k: values[k] for k in self._fragment_params})
        n_out = len(self.outputs)
        state.outs = results[:n_out]
        for o, st, value in zip(self.reductions, state.reductions, results[n_out:], strict=True):
            o.accumulate(ctx, st, epi_idx, value)
        return results[0] if n_out else None  # None: no D (see stores_d)

    def postreduce(self, ctx, state, epi_idx, store_stage):
        for o, st, value in zip(self._aux, state.aux, state.outs[1:], strict=True):
            o.postreduce(ctx, st, epi_idx, store_stage, value)

    def tma_store(self, ctx, state, epi_idx, store_stage):
        for o, st in zip(self._aux, state.aux, strict=True):
            o.tma_store(ctx, st, epi_idx, store_stage)

    def end(self, ctx, state):
        for o, st in zip(self.reductions, state.reductions, strict=True):
            o.end(ctx, st)
        by_name = {o.name: (o, st) for o, st in zip(self.reductions, state.reductions, strict=True)}
        for f, fs in zip(self.finishes, state.finishes, strict=True):
            mine = [by_name[name] for name in f.reductions]  # in the order the finish method takes them
            f.finish(ctx, fs, [o for o, _ in mine], [st for _, st in mine], getattr(self, f.method),
                     [state.values[p] for p in f.params])


__all__ = ["FusedVisitor"]
