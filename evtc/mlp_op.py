""":class:`evtc.nn.MLP` under ``torch.compile``: the block's forward and backward as two custom operators.

Eagerly, the block's autograd is :class:`evtc.mlp_autograd.MLPFunction`, whose forward and backward
launch evtc kernels from Python that dynamo cannot trace (a graph break). Under ``torch.compile`` the
same two functions (:func:`evtc.mlp_autograd.mlp_forward` and :func:`~evtc.mlp_autograd.mlp_backward`)
run as the operators ``evtc::mlp<n>`` and ``evtc::mlp<n>_backward``, with ``register_autograd``
joining them: one opaque node each, so ``fullgraph=True`` holds and the backward keeps its fused dZ
step (the first layer's backward in the epilogue of ``dZ2 @ W2``).

An operator is registered per block and call signature (x's dtype and rank, the operands' names,
kinds and dtypes) by the first eager differentiable call with that signature, which also gives the
output shapes the compiler's fake implementation reports. A compiled call with a signature no eager
call has seen is an error that says so (dynamo quotes it); the kernels are built by that eager call
too, never while the compiler traces.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any

import torch

from evtc.errors import CallError
from evtc.runtime.out_aliasing import distinct_outputs

_LIBRARY = torch.library.Library("evtc", "FRAGMENT")
_COUNTER = itertools.count()
_LOCK = threading.Lock()


def signature(x: torch.Tensor, ops1: dict[str, Any], ops2: dict[str, Any]) -> tuple:
    """What a block's operator is registered for: x's dtype and rank, and each operand's name with
    its dtype and rank (a tensor) or its type (a Python number: int and float alike, which the
    operator takes as a float; the kind of a tensor operand of one rank is the Linear's to tell)."""

    def number(v):
        return "float" if isinstance(v, int | float) and not isinstance(v, bool) else type(v).__name__

    def part(ops):
        return tuple((n, v.dtype, v.dim()) if isinstance(v, torch.Tensor) else (n, number(v))
                     for n, v in ops.items())
    return (x.dtype, x.dim(), part(ops1), part(ops2))


def _gradient_inputs(x, w1, w2, values, needs) -> list[tuple[torch.Tensor, bool]]:
    """The backward operator's inputs that get a gradient slot (x, the weights, the tensor
    operands), each with whether its gradient is wanted."""
    pairs = [(x, needs[0]), (w1, needs[1]), (w2, needs[2])]
    return pairs + [(v, n) for v, n in zip(values, needs[3:], strict=True) if isinstance(v, torch.Tensor)]


class _Shape:
    """An output's shape for the fake implementation: x's leading dims then ``tail`` (an output
    along M: a tile, a per-row reduction), or ``fixed`` (a per-column or whole-output reduction)."""

    def __init__(self, t: torch.Tensor, lead: tuple[int, ...], along_m: bool):
        self.dtype = t.dtype
        self.along_m = along_m
        self.tail = tuple(t.shape[len(lead):]) if along_m else None
        self.fixed = None if along_m else tuple(t.shape)
        self.floating = t.dtype.is_floating_point

    def empty(self, x: torch.Tensor) -> torch.Tensor:
        shape = (*x.shape[:-1], *self.tail) if self.along_m else self.fixed
        return x.new_empty(shape, dtype=self.dtype)


class MLPOperator:
    """The forward and backward operators of one :class:`evtc.nn.MLP` for one call signature."""

    def __init__(self, pair, ops1: dict[str, Any], ops2: dict[str, Any], x: torch.Tensor,
                 outputs: tuple, h: torch.Tensor, saved1: tuple, saved2: tuple):
        """From the eager call with ``x`` and each layer's operands whose
        :func:`~evtc.mlp_autograd.mlp_forward` returned ``outputs, h, saved1, saved2``: the forward
        operator returns them flattened in that order, and takes the operands as ``values``
        (the first layer's, then the second's)."""
        self.names1, self.names2 = tuple(ops1), tuple(ops2)
        values = (*ops1.values(), *ops2.values())
        self.scalar_slots = [i for i, v in enumerate(values) if not isinstance(v, torch.Tensor)]
        self.counts = (len(saved1), len(saved2))
        lead = tuple(x.shape[:-1])
        second = self.second = pair._second  # the second layer's Linear (its output structure)
        dims = {s.name: s.dims for s in second.kernel.plan.outputs}
        dims |= {h.name: h.dims for h in second.kernel.plan.host_outputs}
        self.n_out = len(outputs)
        self.shapes = [_Shape(t, lead, dims[name][:1] == ("M",))
                       for name, t in zip(second.output_names, outputs, strict=True)]
        self.shapes += [_Shape(t, lead, True) for t in (h, *saved1, *saved2)]
        with _LOCK:
            self.name = f"mlp{next(_COUNTER)}"
        # The operators must not keep the block alive (they live as long as the process).
        self._define(weakref.ref(pair), values)
        self.forward_op = getattr(torch.ops.evtc, self.name).default
        self.backward_op = getattr(torch.ops.evtc, f"{self.name}_backward").default

    def _operand_args(self, values: tuple) -> list[str]:
        return [f"float v{i}" if i in self.scalar_slots else f"Tensor v{i}" for i in range(len(values))]

    def _split(self, values):
        k = len(self.names1)
        return (dict(zip(self.names1, values[:k], strict=True)),
                dict(zip(self.names2, values[k:], strict=True)))

    def _define(self, pair_ref, values: tuple) -> None:
        from evtc.mlp_autograd import mlp_backward, mlp_forward

        def block():
            pair = pair_ref()
            if pair is None:
                raise CallError(f"evtc.nn.MLP: the block of operator evtc::{self.name} no longer exists")
            return pair

        args = ", ".join(["Tensor x", "Tensor w1", "Tensor w2", *self._operand_args(values)])
        returns = ", ".join(["Tensor"] * len(self.shapes))
        _LIBRARY.define(f"{self.name}({args}) -> ({returns})")
        n1, n2 = self.counts

        def forward(x, w1, w2, *values):
            ops1, ops2 = self._split(values)
            outputs, h, saved1, saved2 = mlp_forward(block(), x, w1, w2, ops1, ops2)
            if (len(saved1), len(saved2)) != (n1, n2):
                raise CallError("evtc.nn.MLP under torch.compile: the block saves other tensors than "
                                "when its operator was registered (an evtc bug: please report it)")
            # An operator's outputs may share storage neither with its inputs (a residual returned
            # as is) nor with each other (reductions finished in one buffer).
            return tuple(distinct_outputs([*outputs, h, *saved1, *saved2], (x, w1, w2, *values)))

        def fake(x, w1, w2, *values):
            return tuple(s.empty(x) for s in self.shapes)

        for device in ("CUDA", "CPU"):
            _LIBRARY.impl(self.name, forward, device)
        torch.library.register_fake(f"evtc::{self.name}", fake, lib=_LIBRARY)

        back_args = ", ".join(["Tensor?[] grads", "Tensor x", "Tensor w1", "Tensor w2", "Tensor h",
                               "Tensor[] saved", *self._operand_args(values), "bool[] needs"])
        _LIBRARY.define(f"{self.name}_backward({back_args}) -> Tensor[]")

        def backward(grads, x, w1, w2, h, saved, *rest):
            *values, needs = rest
            ops1, ops2 = self._split(values)
            k = len(self.names1)
            dx, dw1, dw2, g1, g2 = mlp_backward(block(), x, w1, w2, h, tuple(saved[:n1]), tuple(saved[n1:]),
                                                ops1, ops2, list(grads), tuple(needs[:3]),
                                                needs[3:3 + k], needs[3 + k:])
            tensors = [v for v in values if isinstance(v, torch.Tensor)]
            wanted = [dx, dw1, dw2, *[g for g, v in zip([*g1, *g2], values, strict=True)
                                      if isinstance(v, torch.Tensor)]]
            # The residual's gradient is the incoming one itself: an operator's output may not share
            # storage with its inputs (the compiler may reuse or update either buffer in place).
            distinct = distinct_outputs(wanted, (*grads, x, w1, w2, h, *saved, *tensors))
            # An input whose gradient is wanted gets one of its shape, as the fake says, zeros where
            # the epilogue gives it none (a where's mask); the others an empty placeholder.
            slots = _gradient_inputs(x, w1, w2, values, needs)
            return [(torch.zeros_like(t) if g is None else g) if need else x.new_empty(0)
                    for g, (t, need) in zip(distinct, slots, strict=True)]

        def backward_fake(grads, x, w1, w2, h, saved, *rest):
            *values, needs = rest
            return [t.new_empty(t.shape) if need else x.new_empty(0)
                    for t, need in _gradient_inputs(x, w1, w2, values, needs)]

        for device in ("CUDA", "CPU"):
            _LIBRARY.impl(f"{self.name}_backward", backward, device)
        torch.library.register_fake(f"evtc::{self.name}_backward", backward_fake, lib=_LIBRARY)

        def setup_context(ctx, inputs, output):
            x, w1, w2, *values = inputs
            h_at = self.n_out
            ctx.save_for_backward(x, w1, w2, output[h_at], *output[h_at + 1:],
                                  *[v for v in values if isinstance(v, torch.Tensor)])
            ctx.scalars = [None if isinstance(v, torch.Tensor) else v for v in values]
            ctx.mark_non_differentiable(*[t for t, s in zip(output, self.shapes, strict=True)
                                          if not s.floating])

        def autograd_backward(ctx, *grads):
            x, w1, w2, h, *rest = ctx.saved_tensors
            saved, tensors = rest[:n1 + n2], iter(rest[n1 + n2:])
            values = [next(tensors) if v is None else v for v in ctx.scalars]
            needs = list(ctx.needs_input_grad)
            result = self.backward_op(list(grads[:self.n_out]), x, w1, w2, h, list(saved), *values,
                                      [bool(n) for n in needs])
            produced = iter(result)
            out = [next(produced) for _ in range(3)]
            out = [g if need else None for g, need in zip(out, needs[:3], strict=True)]
            for v, need in zip(values, needs[3:], strict=True):
                if isinstance(v, torch.Tensor):
                    g = next(produced)
                    out.append(g if need else None)
                else:
                    out.append(None)
            return tuple(out)

        torch.library.register_autograd(f"evtc::{self.name}", autograd_backward,
                                        setup_context=setup_context, lib=_LIBRARY)

    def __call__(self, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, values: tuple) -> tuple:
        """The second layer's outputs, in its output order."""
        return tuple(self.forward_op(x, w1, w2, *values)[:self.n_out])


def unregistered(block_name: str) -> RuntimeError:
    """The error of a compiled call whose signature no eager call registered. A RuntimeError, not a
    CallError: dynamo cannot construct evtc's errors while it traces, and reports this one (under
    ``fullgraph=True``) by quoting its message."""
    return RuntimeError(f"{block_name} under torch.compile runs as a custom operator registered by an "
                        "eager call: call the block once eagerly, with an input that requires grad and the "
                        "same dtypes, ranks and operands, before torch.compile (that call also builds its "
                        "kernels)")


__all__ = ["MLPOperator", "signature", "unregistered"]
