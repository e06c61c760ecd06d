"""Compiled kernels as PyTorch custom operators (``torch.library``).

``torch.compile`` cannot trace into a kernel launched through the CuTe DSL; as a custom operator with
a fake implementation (output shapes and dtypes from the input shapes) the kernel is one opaque node
of the compiler's graph: no graph break, and the compiler may reorder it like any functional op.
CUDA graph capture needs nothing more than a launch on the current stream, which every call makes.

Operator names are ``evtc::<epilogue name>_<hash>``, stable across processes for the same kernel, so
a compiler's caches stay valid.
"""

from __future__ import annotations

import re
import threading
from typing import TYPE_CHECKING, Any

import torch

from evtc.errors import CallError
from evtc.runtime.call_checks import check_gemm_shapes, check_operand_shapes
from evtc.runtime.out_aliasing import distinct_outputs

if TYPE_CHECKING:
    from evtc.runtime.kernel import Kernel

_LIBRARY = torch.library.Library("evtc", "FRAGMENT")
_OPS: dict[str, Any] = {}
# The Kernel object each operator runs (see register).
_BOUND: dict[str, Any] = {}
_LOCK = threading.Lock()


def op_name(kernel: Kernel) -> str:
    """``<epilogue>_<key prefix>``, with suffixes for kernels that choose their cluster per call, that
    autotune, and for call interfaces (strict, unused parameters): kernels that share compiled code
    but not their behaviour get operators of their own."""
    base = re.sub(r"\W", "_", kernel.plan.name) or "epilogue"
    auto = f"_c{kernel.launch_tag}" if kernel.chooses_clusters else ""
    tuned = "_t" if kernel.autotunes else ""
    return f"{base}_{kernel.key[:16]}{auto}{tuned}{kernel.interface.tag()}"


def schema(kernel: Kernel, name: str) -> str:
    plan = kernel.plan
    args = ["Tensor a", "Tensor b"]
    if plan.a_scales is not None:  # block-scaled float8: the scales of a and b follow them
        args += ["Tensor a_scales", "Tensor b_scales"]
    for operand in plan.operand_names:
        args.append(f"float {operand}" if plan.kind_of(operand) == "arg" else f"Tensor {operand}")
    n_out = len(plan.output_order)
    returns = "Tensor" if n_out == 1 else "(" + ", ".join(["Tensor"] * n_out) + ")"
    return f"{name}({', '.join(args)}) -> {returns}"


def register(kernel: Kernel):
    """Define (once per process) the operator of ``kernel`` and return its OpOverload.

    Kernel objects of one name (the same key and call interface: the same compiled code) may be
    several in a process (an ``evtc.Linear``'s twin is compiled from a new wrapper function each
    time); the operator runs the one that asked for it last, so that its ``last_path`` and
    ``saved_accumulators`` are the ones its caller reads."""
    name = op_name(kernel)
    kernel._op_name, kernel._op_binding = name, _BOUND  # Kernel.op binds it again on later uses
    with _LOCK:
        _BOUND[name] = kernel
        op = _OPS.get(name)
        if op is not None:
            return op
        plan = kernel.plan
        names = plan.operand_names
        single = len(plan.output_order) == 1
        scaled = plan.a_scales is not None

        def run(a, b, *operands):
            if scaled:
                (a_scales, b_scales, *operands) = operands
                a, b = (a, a_scales), (b, b_scales)
            outs = distinct_outputs(_BOUND[name].run(a, b, dict(zip(names, operands, strict=True))),
                                    (a, b, *operands))
            return outs[0] if single else tuple(outs)

        def fake(a, b, *operands):
            # The real call's shape checks: a traced or exported graph fails where its run would.
            check_gemm_shapes(plan, a, b)
            check_operand_shapes(kernel.call_spec, a, b,
                                 dict(zip(names, operands[2:] if scaled else operands, strict=True)))
            # The batch of the result: a 2-d ``a`` beside a batched ``b``, or a batch of 1 beside
            # one of L, broadcast as torch does (the real call takes such batches too).
            batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) if plan.batched else ()
            batches = batch[0] if batch else 1
            meta = kernel.output_meta(a.shape[-2], b.shape[-1], batches)
            outs = [a.new_empty(shape, dtype=dt) for shape, dt in meta]
            if plan.d_major == "m":  # column-major D, as the kernel allocates it
                outs[0] = outs[0].transpose(-1, -2).contiguous().transpose(-1, -2)
            return outs[0] if single else tuple(outs)

        _LIBRARY.define(schema(kernel, name))
        _LIBRARY.impl(name, run, "CUDA")
        # CPU tensors reach the same checks, which name the tensor that is not on the GPU.
        _LIBRARY.impl(name, run, "CPU")
        torch.library.register_fake(f"evtc::{name}", fake, lib=_LIBRARY)
        if scaled:  # no derivative through block-scaled float8 inputs (docs/fp8.md, limits)
            op = getattr(torch.ops.evtc, name).default
            _OPS[name] = op
            return op

        def setup_context(ctx, inputs, output):
            # A kernel whose epilogue returns its accumulator last (evtc.Linear's saving twin, which
            # sets saved_accumulators after compiling, so it is read here): the backward reads it
            # instead of recomputing a @ b. The operator returns outputs in the kernel's output
            # order (tiles before reductions), so they are found by name.
            acc_count = _BOUND[name].saved_accumulators
            a, b, *operands = inputs
            tensors = [t for t in (a, b, *operands) if isinstance(t, torch.Tensor)]
            outs = output if isinstance(output, tuple | list) else (output,)
            saved_acc = ()
            if acc_count:
                acc_names = plan.structure.names[len(plan.structure.names) - acc_count:]
                saved_acc = tuple(outs[plan.output_order.index(name)] for name in acc_names)
            ctx.acc_count = len(saved_acc)
            ctx.save_for_backward(*tensors, *saved_acc)
            ctx.scalars = [None if isinstance(v, torch.Tensor) else v for v in operands]

        def backward(ctx, *grads):
            from evtc.runtime.op_autograd import joined_accumulator, op_backward

            saved = ctx.saved_tensors
            inputs, saved_acc = saved[:len(saved) - ctx.acc_count], saved[len(saved) - ctx.acc_count:]
            a, b, *tensors = inputs
            rest = iter(tensors)
            operands = [next(rest) if v is None else v for v in ctx.scalars]
            acc = None
            if saved_acc and torch.is_grad_enabled() and not torch.compiler.is_compiling():
                # backward(create_graph=True) through an accumulator the kernel saved: the gradient
                # of this gradient would miss every term through it (a recomputed one has them).
                raise CallError("a second derivative (create_graph=True) through an evtc kernel that saved "
                                "its accumulator is not supported: its backward is differentiated once only")
            if saved_acc:  # the gate and up halves side by side, as the accumulator
                acc = joined_accumulator(saved_acc)
            needs = ctx.needs_input_grad
            return op_backward(_BOUND[name], a, b, operands, grads, acc=acc, need_a=needs[0], need_b=needs[1],
                               need_operands=needs[2:])

        torch.library.register_autograd(f"evtc::{name}", backward, setup_context=setup_context, lib=_LIBRARY)
        op = getattr(torch.ops.evtc, name).default
        _OPS[name] = op
        return op
