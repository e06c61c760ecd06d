"""dZ of one fused linear's backward as one elementwise kernel (issue "Training", item 3).

A layer seen alone (:mod:`evtc.linear_autograd`) receives its incoming gradient dY as a tensor in
memory. Its ``dZ = df/dacc * dY`` is elementwise over the tile, and the reference backward evaluates
it as torch operations in float32 (:func:`evtc.runtime.op_autograd.epilogue_gradients`): one kernel
per operation, each reading and writing a whole float32 tile (5.1 ms for SwiGLU's dZ at 8192 x
28672 on an H200, where eager autograd's bf16 kernels take 1.0 ms).

Here dZ is one evtc kernel instead (0.65 ms there). :func:`evtc.ir.backward_epilogue.dz_epilogue`
writes dZ as an epilogue (as for :class:`evtc.nn.MLP`'s fused step), with the incoming gradient as
a tile operand ``grad`` rather than the accumulator; the epilogue reads the accumulator the forward
saved (its gate and up halves for a gated epilogue) and the forward's operands, computes in float32
in registers, and stores dZ in the inputs' 16-bit dtype (a gated one's halves into the halves of
one tensor). The operands that need a gradient get it from the same kernel, as reductions of the
tile (a bias's over the rows, a per-row scale's over the columns, a scalar's over both) or, for a
tile operand, one more output. The kernel's GEMM is one whose product the epilogue never reads: a
and b are zeros with K = 16, one MMA per tile, so that the kernel is the epilogue's loads,
arithmetic and stores streaming over the tiles.

It runs where all of these hold, else the reference backward does (same gradients, within the
float32 arithmetic's rounding):

* 16-bit x and weight on the GPU (the reference runs float32 GEMMs otherwise);
* the forward saved its accumulator, and dZ reads it (a dZ that does not, such as a bias's or a
  residual's, is the incoming gradient or a product with an operand: cheap as it is);
* dZ and the wanted operands' gradients are one elementwise pass with those reductions
  (``dz_epilogue`` is not None) and the kernel compiles;
* not under torch.compile (which fuses the reference's operations itself) and, before the kernel
  was first built, not inside a CUDA graph capture.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from evtc.errors import CallError

if TYPE_CHECKING:
    from evtc.ir.backward_epilogue import DzEpilogue
    from evtc.linear import Linear
    from evtc.runtime.kernel import Kernel

log = logging.getLogger("evtc")

# K of the zero product under the epilogue: one 16-deep MMA step, rows of 32 bytes (TMA's 16-byte
# alignment holds for 16-bit inputs).
PASS_K = 16
# The kernel's configuration: cooperative 128 x 128 tiles without clusters (a cluster shares A and B
# loads, of which this kernel has next to none). At 8192 x 14336 (SwiGLU's dZ, three tiles in and two
# out, H200) it streamed 2.61 TB/s, as the cooperative 128 x 256 tile did, where the selector's
# choice for such a heavy epilogue (ping-pong 128 x 128 in 1 x 2 clusters) made 2.34 TB/s
# (bench/mlp_parts.py --layer-dz --layer-dz-configs). Where it does not compile (an epilogue's
# shared memory), the kernel is compiled with the selector's choices.
PASS_CONFIG = {"schedule": "cooperative", "tile_n": 128, "cluster": (1, 1)}


def build(lin: Linear, operand_grads: tuple[str, ...] = ()) -> tuple[Kernel, DzEpilogue] | None:
    """The dZ pass of ``lin`` that also returns the gradients of ``operand_grads`` (its kernel and
    generated epilogue), or None where it has none. Compiled from ``lin``'s examples: the forward's
    operands keep their kinds and layouts."""
    from evtc.compile import compile as compile_kernel
    from evtc.errors import CompileError
    from evtc.ir.backward_epilogue import dz_epilogue
    from evtc.runtime.dtype_variants import meta_copy

    example = lin._example
    if example is None or lin._saving_kernel() is None:
        return None
    a, b = example["a"], example["b"]
    back = lin.backward_graph()
    epilogue = dz_epilogue(back, a.dtype, name=lin.kernel.plan.name, grad_operand=True,
                           operand_grads=operand_grads)
    if epilogue is None or not epilogue.saved:
        return None
    width = b.shape[-1] // 2 if epilogue.gated else b.shape[-1]
    # At least two rows: an example of one would compile the incoming gradient and the saved
    # accumulator as row vectors (broadcast over M). The operands keep their examples' shapes, and
    # with them the kinds the forward compiled them as.
    rows = max(a.shape[0], 2)
    meta = {"device": "meta", "dtype": a.dtype}
    # The incoming gradient has its output's dtype (float32 for an epilogue that returns float32;
    # the backward graph itself takes every incoming gradient as float32).
    (output,) = back.output_grads
    kernel_order = lin.kernel.call_spec.kernel_order
    out_dtypes = dict(zip(kernel_order, (dt for _, dt in lin.kernel.output_meta(rows, b.shape[-1], 1)),
                          strict=True))
    grad_dtype = out_dtypes.get(output)
    if grad_dtype is None:
        return None
    inputs: dict[str, Any] = {"a": torch.empty(rows, PASS_K, **meta),
                              "b": torch.empty(width, PASS_K, **meta).t(),
                              "grad": torch.empty(rows, width, device="meta", dtype=grad_dtype)}
    for name in epilogue.saved:
        inputs[name] = torch.empty(rows, width, **meta)
    for name in epilogue.operands:
        inputs[name] = meta_copy(example[name])
    options = {k: v for k, v in lin._compile_options.items() if k in ("arch", "cache_dir")}
    try:
        try:
            kernel = compile_kernel(epilogue.fn, inputs, config=PASS_CONFIG, **options)
        except CompileError:
            kernel = compile_kernel(epilogue.fn, inputs, **options)
    except Exception as exc:  # noqa: BLE001 - the reference backward gives the same gradients
        log.warning("%r: the dZ kernel of the backward does not compile (%s); the backward runs dZ as "
                    "torch operations", lin.kernel.plan.name, str(exc).splitlines()[0])
        return None
    return kernel, epilogue


def applies(x: torch.Tensor, weight: torch.Tensor, saved: tuple[torch.Tensor, ...]) -> bool:
    """Whether a backward with these inputs may take the dZ pass (the conditions it can tell
    without the backward graph; see the module docstring)."""
    return (bool(saved) and x.is_cuda and weight.dtype == x.dtype
            and x.dtype in (torch.float16, torch.bfloat16) and not torch.compiler.is_compiling())


def gradients(lin: Linear, x2: torch.Tensor, operands: dict[str, Any], grads: dict[str, torch.Tensor | None],
              saved: tuple[torch.Tensor, ...], needed: tuple[str, ...] = ()
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
    """(dZ, {operand: gradient}) of ``lin``'s backward from the pass, or None where it does not
    apply (the caller then runs the reference). dZ is (M, N) in x's dtype; the gradients of the
    operands in ``needed``, in their flat shapes and dtypes. ``x2``: x with its rows flattened;
    ``operands``: the forward's, flattened alike; ``grads``: the incoming gradients by output name;
    ``saved``: the saved accumulator's pieces, flattened alike."""
    state = lin._dz_passes.get(needed)
    if state is None:
        if x2.is_cuda and torch.cuda.is_current_stream_capturing():
            return None  # building a kernel inside a capture: the reference is capture-safe
        state = lin._dz_passes[needed] = build(lin, needed) or False
    if not state:
        return None
    kernel, epilogue = state
    (output,) = lin.backward_graph().output_grads  # the one output dZ depends on
    grad = grads.get(output)
    if grad is None or grad.dtype != kernel.call_spec.operand_dtypes.get("grad", grad.dtype):
        return None
    m, width = x2.shape[0], saved[0].shape[-1]
    feeds: dict[str, Any] = {"grad": grad.reshape(m, width)}
    pieces = dict(zip(("saved_gate", "saved_up") if epilogue.gated else ("saved",), saved, strict=True))
    for name in epilogue.saved:
        feeds[name] = pieces[name]
    for name in epilogue.operands:
        feeds[name] = operands[name]
    try:
        return _run(kernel, epilogue, feeds, operands, m, width, x2, needed)
    except CallError as err:
        # An operand the forward took in another shape than its example (a (1, N) bias beside an
        # (N,) example, a 1-d x's tile operand): the forward's views do not apply to the pass's
        # reductions. The reference backward takes it.
        log.info("%r: the dZ kernel refuses this call (%s); the backward runs dZ as torch operations",
                 lin.kernel.plan.name, str(err).splitlines()[0])
        return None


def _run(kernel, epilogue, feeds, operands, m, width, x2, needed):
    """The pass's launch: (dZ, {operand: gradient})."""
    zeros_a = torch.zeros(m, PASS_K, dtype=x2.dtype, device=x2.device)
    zeros_b = torch.zeros(width, PASS_K, dtype=x2.dtype, device=x2.device).t()
    if epilogue.gated and not needed:
        # The halves written into one tensor; with operand gradients too, out= would need every
        # output allocated here, and the halves are joined after (a copy of dZ in 16 bits).
        dz = torch.empty(m, 2 * width, dtype=x2.dtype, device=x2.device)
        kernel(zeros_a, zeros_b, **feeds, out=(dz[:, :width], dz[:, width:]))
        return dz, {}
    result = kernel(zeros_a, zeros_b, **feeds)
    outs = result if isinstance(result, tuple) else (result,)
    count = 2 if epilogue.gated else 1
    dz = torch.cat(outs[:count], dim=-1) if epilogue.gated else outs[0]
    by_name = {}
    for name, value in zip(epilogue.operand_grads, outs[count:], strict=True):
        flat = operands[name]
        by_name[name] = value.reshape(flat.shape).to(flat.dtype)
    return dz, by_name


__all__ = ["PASS_CONFIG", "PASS_K", "applies", "build", "gradients"]
