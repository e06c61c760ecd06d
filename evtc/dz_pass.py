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
  (``dz_epilogue`` is not None; each output's incoming gradient, for an epilogue of several, is an
  operand of its own in the output's shape) and the kernel compiles;
* not under torch.compile (which fuses the reference's operations itself) and, before the kernel
  was first built, not inside a CUDA graph capture.

A kernel's own custom operator (``k(a, b, ...)`` with inputs that require grad) saves no
accumulator; its reference backward recomputes ``a @ b`` into memory (16 bits; float32 for float16)
before the float32 operations. :func:`recomputed_gradients` makes dZ the epilogue of that
recomputing GEMM instead (``dz_epilogue(..., recompute=True)``: ``fn(acc, grad, operands...)``, the
accumulator read in registers), compiled with the selector's configuration per layout of the call's
tensors and cached on the forward kernel (``Kernel.recomputed_dz``). At 8192 x 4096 -> 14336 in bf16
(H200, ``bench/layer_step.py --operator``) the operator's step takes 5.58 ms where the reference
took 10.19 (eager nn.Linear + GELU, which saves its output: 4.48). It applies under the same
conditions, not to a batched call whose operands need gradients (those also sum over the batch).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
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
    from evtc.ir.backward_epilogue import dz_epilogue

    example = lin._example
    if example is None or lin._saving_kernel() is None:
        return None
    a, b = example["a"], example["b"]
    back = lin.backward_graph()
    epilogue = dz_epilogue(back, a.dtype, name=lin.kernel.plan.name, grad_operand=True,
                           operand_grads=operand_grads,
                           tile_grad_dtypes={name: example[name].dtype for name in operand_grads})
    if epilogue is None or not epilogue.saved:
        return None
    width = b.shape[-1] // 2 if epilogue.gated else b.shape[-1]
    # At least two rows: an example of one would compile the incoming gradient and the saved
    # accumulator as row vectors (broadcast over M). The operands keep their examples' shapes, and
    # with them the kinds the forward compiled them as.
    rows = max(a.shape[0], 2)
    meta = {"device": "meta", "dtype": a.dtype}
    # Each incoming gradient has its output's dtype (float32 for an output in float32; the backward
    # graph itself takes every incoming gradient as float32) and the shape the graph gives it.
    kernel_order = lin.kernel.call_spec.kernel_order
    out_dtypes = dict(zip(kernel_order, (dt for _, dt in lin.kernel.output_meta(rows, b.shape[-1], 1)),
                          strict=True))
    inputs: dict[str, Any] = {"a": torch.empty(rows, PASS_K, **meta),
                              "b": torch.empty(width, PASS_K, **meta).t()}
    for param, output in epilogue.grads:
        if out_dtypes.get(output) is None:
            return None
        shape = _grad_shape(back.grad_shapes[back.output_grads[output]], rows, b.shape[-1], 1)
        inputs[param] = torch.empty(shape, device="meta", dtype=out_dtypes[output])
    inputs.update(saved_and_operand_examples(epilogue, example, rows, width, a.dtype))
    options = {k: v for k, v in lin._compile_options.items() if k in ("arch", "cache_dir")}
    kernel = compile_epilogue(epilogue, inputs, lin.kernel.plan.name, PASS_CONFIG, options)
    return None if kernel is None else (kernel, epilogue)


def saved_and_operand_examples(epilogue: DzEpilogue, example: dict[str, Any], rows: int, width: int,
                               dtype: torch.dtype) -> dict[str, Any]:
    """Meta examples of what a dZ epilogue reads besides its GEMM and incoming gradients: the saved
    accumulator's pieces (``rows`` x ``width``, kept as :func:`saved_accumulator_dtype` says for
    ``dtype`` inputs), and the forward's operands and wide operands' halves as ``example`` (the
    forward's) holds them, so that they keep the kinds and layouts the forward compiled."""
    from evtc.runtime.dtype_variants import meta_copy
    from evtc.runtime.op_autograd import saved_accumulator_dtype

    inputs: dict[str, Any] = {}
    for name in epilogue.saved:
        inputs[name] = torch.empty(rows, width, device="meta", dtype=saved_accumulator_dtype(dtype))
    for name in epilogue.operands:
        inputs[name] = meta_copy(example[name])
    for param, operand, index in epilogue.halves:
        inputs[param] = meta_copy(_half(example[operand], index))
    return inputs


def operand_feeds(epilogue: DzEpilogue, operands: dict[str, Any]) -> dict[str, Any]:
    """A dZ epilogue's operands from the forward's ``operands``: those it reads, and the halves of
    those as wide as a gated epilogue's GEMM (views)."""
    feeds = {name: operands[name] for name in epilogue.operands}
    for param, operand, index in epilogue.halves:
        feeds[param] = _half(operands[operand], index)
    return feeds


def compile_epilogue(epilogue: DzEpilogue, inputs: dict[str, Any], name: str, config: dict | None,
                     options: dict[str, Any]) -> Kernel | None:
    """``epilogue`` compiled on ``inputs`` with ``config`` (else, or where that does not compile,
    the selector's choices); None where it does not compile at all."""
    from evtc.compile import compile as compile_kernel
    from evtc.errors import CompileError

    try:
        if config is not None:
            try:
                return compile_kernel(epilogue.fn, inputs, config=config, **options)
            except CompileError:
                pass
        return compile_kernel(epilogue.fn, inputs, **options)
    except Exception as exc:  # noqa: BLE001 - the reference backward gives the same gradients
        log.warning("%r: the dZ kernel of the backward does not compile (%s); the backward takes its "
                    "unfused path", name, str(exc).splitlines()[0])
        return None


def applies(x: torch.Tensor, weight: torch.Tensor, saved: tuple[torch.Tensor, ...]) -> bool:
    """Whether a backward with these inputs may take the dZ pass (the conditions it can tell
    without the backward graph; see the module docstring)."""
    return bool(saved) and recompute_applies(x, weight)


def gradients(lin: Linear, x2: torch.Tensor, operands: dict[str, Any], grads: dict[str, torch.Tensor | None],
              saved: tuple[torch.Tensor, ...], operand_grads: tuple[str, ...] = ()
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
    """(dZ, {operand: gradient}) of ``lin``'s backward from the pass, or None where it does not
    apply (the caller then runs the reference). dZ is (M, N) in x's dtype; the gradients of the
    operands in ``operand_grads``, in their flat shapes and dtypes. ``x2``: x with its rows flattened;
    ``operands``: the forward's, flattened alike; ``grads``: the incoming gradients by output name;
    ``saved``: the saved accumulator's pieces, flattened alike."""
    if not all(_concrete(t) for t in (x2, *saved, *(g for g in grads.values() if g is not None))):
        return None  # torch's symbolic sizes (a trace with dynamic shapes): the reference traces
    state = built_once(lin._dz_passes, operand_grads, x2.device, lambda: build(lin, operand_grads))
    if not state:
        return None
    kernel, epilogue = state
    m, width = x2.shape[0], saved[0].shape[-1]
    incoming = _incoming(lin.backward_graph(), grads, m, 2 * width if epilogue.gated else width, 1)
    feeds: dict[str, Any] = {}
    for param, output in epilogue.grads:
        grad = incoming[output]
        if grad is None or grad.dtype != kernel.call_spec.operand_dtypes.get(param, grad.dtype):
            return None
        feeds[param] = grad.contiguous()
    pieces = dict(zip(("saved_gate", "saved_up") if epilogue.gated else ("saved",), saved, strict=True))
    for name in epilogue.saved:
        feeds[name] = pieces[name]
    feeds.update(operand_feeds(epilogue, operands))
    zeros = _zeros(max(m, width) * PASS_K, x2.dtype, x2.device)
    zeros_a = zeros[:m * PASS_K].view(m, PASS_K)
    zeros_b = zeros[:width * PASS_K].view(width, PASS_K).t()
    try:
        return _launch(kernel, epilogue, zeros_a, zeros_b, feeds, operands, width)
    except CallError as err:
        # An operand the forward took in another shape than its example (a (1, N) bias beside an
        # (N,) example, a 1-d x's tile operand): the forward's views do not apply to the pass's
        # reductions. The reference backward takes it.
        log.info("%r: the dZ kernel refuses this call (%s); the backward runs dZ as torch operations",
                 lin.kernel.plan.name, str(err).splitlines()[0])
        return None


def _half(t: torch.Tensor, index: int) -> torch.Tensor:
    """The gate (0) or up (1) half of an operand as wide as a gated epilogue's GEMM: a view."""
    half = t.shape[-1] // 2
    return t[..., index * half:(index + 1) * half]


#: Held while a dZ kernel is built, so that threads whose backwards want the same one wait for it
#: rather than compile it again (a build takes seconds; builds of different kernels wait too).
_BUILD_LOCK = threading.Lock()


def built_once(cache: dict, key: Any, device: torch.device,
                build_it: Callable[[], tuple | None]) -> tuple | bool | None:
    """``cache[key]``, built by ``build_it`` (False where it gives None) by the first thread that
    asks for it; None where it is not built yet and ``device``'s stream is being captured into a
    CUDA graph (a build launches work a capture refuses; the reference backward is capture-safe)."""
    state = cache.get(key)
    if state is not None:
        return state
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    with _BUILD_LOCK:
        state = cache.get(key)
        if state is None:
            state = cache[key] = build_it() or False
        return state


#: Zeros the pass's GEMM multiplies (its a and b are views of them), by device and dtype, grown as
#: needed: two allocations and two fills less on every call. Only read, so every stream shares them.
_ZEROS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _zeros(count: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """At least ``count`` zeros of ``dtype`` on ``device``, kept for later calls where made outside
    a CUDA graph capture (zeros made inside one are filled only when the graph replays)."""
    key = (device, dtype)
    kept = _ZEROS.get(key)
    if kept is not None and kept.numel() >= count:
        return kept
    zeros = torch.zeros(count, dtype=dtype, device=device)
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        _ZEROS[key] = zeros
    return zeros


def _launch(kernel: Kernel, epilogue: DzEpilogue, a: torch.Tensor, b: torch.Tensor, feeds: dict[str, Any],
            operands: dict[str, Any], half: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One launch of a dZ kernel on ``a @ b``: (dZ in a's dtype, {operand: gradient in the
    operand's shape and dtype}). ``half``: the width of each half of a gated epilogue's dZ."""
    rows = (*torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2])
    return launch(kernel, epilogue, a, b, feeds, operands, rows, half)


def launch(kernel: Kernel, epilogue: DzEpilogue, a: torch.Tensor, b: torch.Tensor, feeds: dict[str, Any],
           operands: dict[str, Any], rows: tuple[int, ...],
           half: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``kernel(a, b, **feeds)`` for a generated dZ epilogue: (dZ of ``rows`` rows in a's dtype, a
    gated epilogue's halves written through ``out=`` into the halves of one tensor, {operand:
    gradient in the operand's shape and dtype}). ``half``: each half's width (gated only)."""
    if not epilogue.gated:
        outs = _as_tuple(kernel(a, b, **feeds))
        return outs[0], _operand_gradients(epilogue, outs[1:], operands)
    dz = torch.empty(*rows, 2 * half, dtype=a.dtype, device=a.device)
    gate, up = dz[..., :half], dz[..., half:]
    if not epilogue.operand_grads:
        kernel(a, b, **feeds, out=(gate, up))
        return dz, {}
    # out= takes every output or none: the operands' gradients are allocated here too, as the
    # kernel would (so that dZ's halves need no join after).
    spec = kernel.call_spec
    batches = rows[0] if len(rows) == 2 else 1
    meta = dict(zip(spec.kernel_order, kernel.output_meta(rows[-1], b.shape[-1], batches), strict=True))
    names = kernel.plan.structure.names
    rest = tuple(torch.empty(meta[name][0], dtype=meta[name][1], device=a.device) for name in names[2:])
    kernel(a, b, **feeds, out=(gate, up, *rest))
    return dz, _operand_gradients(epilogue, rest, operands)


def _as_tuple(result: Any) -> tuple:
    return result if isinstance(result, tuple) else (result,)


def _operand_gradients(epilogue: DzEpilogue, outs: tuple[torch.Tensor, ...],
                       operands: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The operands' gradients from the dZ kernel's outputs after dZ, in each operand's shape and
    dtype (a wide operand's from its two halves, joined: vectors, not tiles)."""
    by_name = {}
    rest = list(outs)
    for name in epilogue.operand_grads:
        operand = operands[name]
        if name in epilogue.split_grads:  # a wide operand's, as its gate and up halves
            value, rest = torch.cat(rest[:2], dim=-1), rest[2:]
        else:
            value, rest = rest[0], rest[1:]
        by_name[name] = value.reshape(operand.shape).to(operand.dtype)
    return by_name


# ---- a kernel's own operator: dZ in the epilogue of the forward's GEMM run again -----------------

def recomputed_gradients(kernel: Kernel, a: torch.Tensor, b: torch.Tensor, operands: dict[str, Any],
                         grads: dict[str, torch.Tensor | None], operand_grads: tuple[str, ...] = ()
                         ) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
    """(dZ, {operand: gradient}) of the backward of ``kernel``'s custom operator called on ``a``, ``b``
    and ``operands`` (by name), from one evtc kernel: the forward's GEMM run again with dZ as its
    epilogue, which reads the incoming gradient ``grad`` as a tile operand and the recomputed
    accumulator in registers (the reference recomputes ``a @ b`` into memory, in 16 bits for
    bfloat16, and evaluates the backward graph over it as float32 torch operations). The operands in
    ``operand_grads`` get their gradients from the same kernel. None where it does not apply (the
    caller then runs the reference): where ``applies`` does not hold, dZ does not read the
    accumulator or is not one elementwise pass, a batched call needs operand gradients, or the
    kernel does not compile or refuses the call. Kernels are compiled on first use per layout of the
    call's tensors."""
    if not recompute_applies(a, b):
        return None
    if operand_grads and (a.dim() > 2 or b.dim() > 2):
        return None  # a batched operand's gradient also sums over batches: the reference's sum_to_size
    given = [a, b, *(v for v in operands.values() if isinstance(v, torch.Tensor)),
             *(g for g in grads.values() if g is not None)]
    if not all(_concrete(t) for t in given):
        return None  # torch's symbolic sizes (a trace with dynamic shapes): the reference traces
    back = kernel.backward_graph()
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    incoming = _incoming(back, grads, a.shape[-2], b.shape[-1], batch[0] if batch else 1)
    tensors = {"a": a, "b": b, **{k: v for k, v in operands.items() if isinstance(v, torch.Tensor)}}
    # The incoming gradients the kernel reads reach it row-major (made so below): their dtypes,
    # ranks and dims of size 1 are what it is compiled for.
    key = (operand_grads, *((name, *_layout(t)) for name, t in tensors.items()),
           *((output, None if g is None else (g.dtype, g.dim(), tuple(n == 1 for n in g.shape)))
             for output, g in incoming.items()))
    cache = kernel.recomputed_dz
    state = built_once(cache, key, a.device,
                        lambda: _build_recomputed(kernel, back, tensors, incoming, operands, operand_grads))
    if not state:
        return None
    dz_kernel, epilogue = state
    feeds = {**{param: incoming[output].contiguous() for param, output in epilogue.grads},
             **{name: operands[name] for name in epilogue.operands}}
    try:
        return _launch(dz_kernel, epilogue, a, b, feeds, operands, b.shape[-1] // 2)
    except CallError as err:
        # Not expected (the key holds what the kernel's checks judge): said once, and the reference
        # taken from then on for this key rather than a refused launch on every call.
        cache[key] = False
        log.warning("%r: the recomputing dZ kernel refuses this call (%s); the backward runs dZ as "
                    "torch operations for such calls", kernel.plan.name, str(err).splitlines()[0])
        return None


def recompute_applies(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether an operator's backward on these inputs may take the recomputing dZ kernel: 16-bit
    inputs on the GPU (where the backward's GEMMs run in 16 bits too), not under torch.compile, and
    not in a backward with ``create_graph=True`` (grad mode on): the reference's torch operations
    are then the differentiable path, and the kernel refuses ``out=`` while its inputs require
    grad (which, cached as a refusal, turned the kernel off for later backwards)."""
    from evtc.runtime import op_autograd  # the module's attribute: tests force it on CPU tensors

    return (op_autograd.low_precision(a, b) and not torch.compiler.is_compiling()
            and not torch.is_grad_enabled())


def _incoming(back, grads: dict[str, torch.Tensor | None], m: int, n: int, batches: int
              ) -> dict[str, torch.Tensor | None]:
    """The outputs' incoming gradients by output name, each viewed in the shape the backward graph
    gives it (a per-row reduction's as (M, 1), a per-column one's as (1, N): the dZ kernel then
    takes each as the kind it is, where a bare (M,) would be taken for a row vector when M equals
    N). The caller makes those the kernel reads row-major (the expanded gradient of ``y.sum()``, a
    transposed one: one pass over it, far less than the reference's float32 passes), and no
    other. None for an output that received none."""
    out: dict[str, torch.Tensor | None] = {}
    for output, grad_name in back.output_grads.items():
        g = grads.get(output)
        if g is not None:
            g = g.reshape(_grad_shape(back.grad_shapes[grad_name], m, n, batches))
        out[output] = g
    return out


def _grad_shape(shape: tuple, m: Any, n: Any, batches: Any) -> tuple[Any, ...]:
    """A backward graph's symbolic gradient shape at these sizes."""
    from evtc.ir.shapes import L, M, N, evaluate_shape

    return evaluate_shape(shape, {M: m, N: n, L: batches})


def _build_recomputed(kernel: Kernel, back, tensors: dict[str, torch.Tensor],
                      incoming: dict[str, torch.Tensor | None], operands: dict[str, Any],
                      operand_grads: tuple[str, ...]) -> tuple[Kernel, DzEpilogue] | None:
    from evtc.ir.backward_epilogue import dz_epilogue
    from evtc.runtime.dtype_variants import meta_copy

    epilogue = dz_epilogue(back, tensors["a"].dtype, name=kernel.plan.name, grad_operand=True,
                           operand_grads=operand_grads, recompute=True,
                           tile_grad_dtypes={name: operands[name].dtype for name in operand_grads})
    if epilogue is None or not epilogue.reads_acc:
        # dZ without the accumulator (a bias's, a residual's): the reference reads no GEMM either.
        return None
    if any(incoming[output] is None for _, output in epilogue.grads):
        return None  # an incoming gradient dZ reads was not given (the reference takes it as zeros)
    inputs: dict[str, Any] = {name: meta_copy(tensors[name]) for name in ("a", "b")}
    for param, output in epilogue.grads:
        grad = incoming[output]
        inputs[param] = torch.empty(grad.shape, dtype=grad.dtype, device="meta")  # row-major, as fed
    for name in epilogue.operands:
        inputs[name] = meta_copy(operands[name])
    # The selector's configuration: a real GEMM now, its epilogue reading one tile more than the
    # forward's and writing dZ (and the operands' gradients) instead of the forward's outputs.
    built = compile_epilogue(epilogue, inputs, kernel.plan.name, None, {"cache_dir": kernel.cache_root})
    return None if built is None else (built, epilogue)


def _concrete(t: torch.Tensor) -> bool:
    return all(type(d) is int for d in (*t.shape, *t.stride()))


def _layout(t: torch.Tensor) -> tuple:
    """What a compiled kernel's argument checks see of a tensor, besides its sizes: its dtype, rank,
    dims of size 1 (an example's M or N of 1 compiles a tile as a vector: a one-row call, a decode
    step, gets a kernel of its own), broadcast dims and which dim runs contiguously."""
    strides = t.stride()
    return (t.dtype, t.dim(), tuple(n == 1 for n in t.shape), tuple(s == 0 for s in strides),
            min(range(t.dim()), key=lambda i: (strides[i] != 1, i)) if t.dim() else -1)


__all__ = ["PASS_CONFIG", "PASS_K", "applies", "build", "gradients", "recompute_applies",
           "recomputed_gradients"]
