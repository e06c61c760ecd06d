"""``evtc.nn``: modules built on ``evtc.linear``.

``FusedLinear(in_features, out_features, epilogue)`` is an ``nn.Linear`` whose output goes through
``epilogue`` in the same kernel: ``epilogue(x @ weight.t(), bias=bias, **operands)``. Its weight and
bias are parameters, initialised as ``nn.Linear``'s, and it is differentiable (see
:mod:`evtc.linear_autograd`).

``MLP(in_features, hidden_features, activation, output)`` is two of them in a row, ``Linear -> act
-> Linear`` (a SwiGLU MLP with a residual, say). As a pair, its backward computes the first layer's
dZ inside the GEMM that makes its incoming gradient (see :mod:`evtc.mlp_autograd`).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from evtc.errors import CallError
from evtc.frontend.epilogue import parameter_names, unwrap
from evtc.runtime import call_checks

log = logging.getLogger("evtc")


def _refuse_own_bias(bias: torch.Tensor | None, operands: dict[str, Any], module: str) -> None:
    """A ``bias=`` operand of a module with a bias parameter would replace the parameter (which then
    gets no gradient): refused."""
    if bias is not None and "bias" in operands:
        raise CallError(f"{module}: bias= is this module's own parameter (bias=True); pass other "
                        "operands under other names, or build the module with bias=False")


def _refuse_not_an_x(x: Any, prefix: str) -> None:
    """A layer's ``x`` must be a tensor of at least one dim (``(..., in_features)``)."""
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        got = f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else f"a {type(x).__name__}"
        raise CallError(f"{prefix}x must be a (..., in_features) tensor, got {got}")


def _autocast(x: torch.Tensor, *tensors: torch.Tensor | None) -> tuple:
    """``x`` and ``tensors`` as ``nn.Linear`` takes them under ``torch.autocast``: float32 ones in
    the autocast dtype of ``x``'s device (the cast is differentiable, so float32 parameters get
    float32 gradients); unchanged where autocast is off. The epilogue's other operands are not
    cast, as ``nn.Linear`` never sees them."""
    _refuse_not_an_x(x, "")
    x = call_checks.dense_x("x", x)  # nested refused, sparse made dense, as nn.Linear takes it
    device = x.device.type
    try:
        enabled = torch.is_autocast_enabled(device)
    except RuntimeError:  # a device type autocast does not know (meta): never autocast
        enabled = False
    if not enabled:
        return (x, *tensors)
    dtype = torch.get_autocast_dtype(device)
    # As autocast casts nn.Linear's arguments: every floating-point tensor but float64, float16
    # under a bfloat16 autocast too.
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point()
                 and t.dtype not in (dtype, torch.float64) else t for t in (x, *tensors))


def _refuse_jit(module: str) -> None:
    if torch.jit.is_tracing():
        raise CallError(f"{module}: torch.jit.trace cannot record evtc's kernel launches; use "
                        "torch.compile or torch.export")


def _hooked(module: nn.Module) -> bool:
    """Whether anything hooks into ``module``'s calls (its own hooks, global module hooks, or a
    forward pre-hook that recomputes its weight, as pruning and the old weight_norm do)."""
    modules = nn.modules.module
    own = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks,
           module._backward_pre_hooks)
    shared = (modules._global_forward_hooks, modules._global_forward_pre_hooks,
              modules._global_backward_hooks, modules._global_backward_pre_hooks)
    return any(own) or any(shared)


class FusedLinear(nn.Module):
    """``y = epilogue(x @ weight.t(), bias=bias, **operands)`` in one fused kernel.

    Args:
        in_features, out_features: as for ``nn.Linear`` (a gated epilogue such as SwiGLU halves the
            output: ``out_features`` counts both halves, as the weight's rows).
        epilogue: ``fn(acc, *operands)``, as for :func:`evtc.compile`. With ``bias=True`` it must
            take a parameter named ``bias``, which receives the module's bias.
        bias: whether the module has a bias parameter.
        device, dtype: of the parameters.
        out_dtypes, config, cache_dir: as for :func:`evtc.compile`.

    The kernel is compiled on the first call (and again for inputs of another dtype or device, or
    operands of another kind with x's leading dims flattened), then kept.
    """

    def __init__(self, in_features: int, out_features: int, epilogue: Callable[..., Any], *,
                 bias: bool = True, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, out_dtypes: Any = None,
                 config: Mapping[str, Any] | None = None,
                 cache_dir: str | os.PathLike | None = None) -> None:
        super().__init__()
        params = parameter_names(epilogue)
        if bias and "bias" not in params[1:]:
            raise CallError(f"evtc.nn.FusedLinear: bias=True, but the epilogue "
                            f"{getattr(unwrap(epilogue), '__name__', 'fn')}({', '.join(params)}) has no "
                            "parameter named 'bias'; add one or pass bias=False")
        self.in_features, self.out_features = in_features, out_features
        self.epilogue = epilogue
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        self._options = {"out_dtypes": out_dtypes, "config": config, "cache_dir": cache_dir}
        self._compiled: dict[tuple, Any] = {}
        #: Keys of M = 1 or N = 1 calls served by a layer compiled under another key (_serving).
        self._served: dict[tuple, Any] = {}
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor, **operands: Any) -> Any:
        _refuse_jit("evtc.nn.FusedLinear")
        _refuse_own_bias(self.bias, operands, "evtc.nn.FusedLinear")
        x, weight, bias = _autocast(x, self.weight, self.bias)
        if bias is not None:
            operands = {"bias": bias, **operands}
        if torch.float64 in (x.dtype, weight.dtype):
            # float64 (nn.Linear's .double(), gradcheck): no kernel multiplies it, so the epilogue
            # runs on torch's product, differentiable through torch's own ops.
            return self.epilogue(F.linear(x, weight), **operands)
        lin = self._linear_for(x, operands, weight)
        return lin(x, weight, **operands)

    def _linear_for(self, x: torch.Tensor, operands: dict[str, Any], weight: torch.Tensor | None = None):
        """The Linear for ``x``, ``operands`` and ``weight`` (the parameter, or its autocast copy)."""
        from evtc.linear import linear

        weight = self.weight if weight is None else weight
        # An operand's kind (tile, row, column, scalar) follows which of its dims are 1 once x's
        # leading dims are flattened into M: part of the key (so a batch or a sequence of 1 is the
        # same kernel as any other). The epilogue too: a module whose epilogue was replaced
        # compiles the new one. x's rank is not: evtc.linear takes any leading dims, and refuses
        # those whose flattening would change the epilogue's results.
        # Loops and list comprehensions only: this runs under torch.compile's tracing, and a
        # generator expression given to all() there is the likely cause of a fullgraph failure on
        # torch 2.11 (tuple() of one is what the key always had).
        lead_dims = x.dim() - 1
        parts = [self.epilogue, x.dtype, x.device, weight.dtype]
        for name, value in operands.items():
            parts.append((name, value.dtype, _flattened_ones(value.shape, lead_dims))
                         if isinstance(value, torch.Tensor) else (name, type(value)))
        key = tuple(parts)
        lin = self._compiled.get(key)
        if lin is None:
            lin = self._served.get(key)
        if lin is None:
            one_row, one_column = bool(math.prod(x.shape[:-1]) == 1), bool(weight.shape[0] == 1)
            if one_row or one_column:
                lin = self._serving(key, one_row, one_column)
                if lin is not None and not torch.compiler.is_compiling():  # (a side effect there)
                    self._served[key] = lin
        if lin is None and torch.compiler.is_compiling():
            # Building a kernel is not traceable (under fullgraph=True dynamo fails deep inside the
            # compiler); elsewhere dynamo breaks the graph here and the build runs eagerly.
            raise RuntimeError("evtc.nn.FusedLinear under torch.compile builds no kernels: call the layer "
                               "once eagerly with operands of the same dtypes and kinds (a (B, S, N) "
                               "residual, a (N,) bias) before torch.compile(fullgraph=True)")
        if lin is None:
            # A K-major x, as nn.Linear inputs are: a first call with a transposed x would otherwise
            # compile for it, and every later (contiguous) call under this key take the torch path.
            x_example = x.detach() if x.stride(-1) == 1 else x.detach().contiguous()
            example = {"x": x_example, "weight": weight.detach(),
                       **{k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in operands.items()}}
            lin = self._compiled[key] = linear(self.epilogue, example, **self._options)
        return lin

    def _serving(self, key: tuple, one_row: bool, one_column: bool) -> Any:
        """A compiled layer that takes operands of ``key`` although its key differs where a dim of
        the problem is 1 (M = 1 or N = 1): there a (1, N) residual and a (1, N) bias broadcast
        alike, so a kernel that reads the operand as either serves the call."""
        for other, lin in list(self._compiled.items()):  # (another thread's call may add one)
            if other[:4] != key[:4] or len(other) != len(key):
                continue
            if all([_serves(theirs, ours, one_row, one_column)
                    for theirs, ours in zip(other[4:], key[4:], strict=True)]):
                return lin
        return None

    def __getstate__(self) -> dict[str, Any]:
        """``copy.deepcopy`` and pickling (``torch.save(model)``) keep the parameters and the
        options, not the compiled kernels, which hold locks and library handles: a copy compiles
        on its first call again (a disk-cache hit, milliseconds)."""
        state = super().__getstate__()
        return {**state, "_compiled": {}, "_served": {}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_served", {})  # a module pickled before it had one

    def __prepare_scriptable__(self) -> nn.Module:
        # torch.jit.script asks this first: the forward launches compiled kernels that TorchScript
        # cannot express.
        raise CallError("evtc.nn.FusedLinear cannot be scripted with torch.jit.script; use "
                        "torch.compile or torch.export")

    def extra_repr(self) -> str:
        name = getattr(unwrap(self.epilogue), "__name__", "fn")
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, epilogue={name}")


def _flattened_ones(shape: torch.Size, lead_dims: int) -> tuple[bool, ...]:
    """Which dims of an operand of ``shape`` are 1 as ``evtc.linear`` hands it to the kernel, x's
    ``lead_dims`` leading dims flattened into M (``_flatten_like``): a (B, S, N) residual is an
    (M, N) tile whether B is 1 or not, a (1, 1, N) one a row. ``bool()`` of each comparison: under
    torch.compile and torch.export a symbolic size's comparison is a guard its range decides, where
    a SymBool in the key could not be hashed."""
    if lead_dims > 1 and 2 <= len(shape) <= lead_dims + 1:
        return bool(math.prod(shape[:-1]) == 1), bool(shape[-1] == 1)
    return tuple([bool(size == 1) for size in shape])


def _serves(theirs: tuple, ours: tuple, one_row: bool, one_column: bool) -> bool:
    """Whether a layer compiled for operand pattern ``theirs`` takes ``ours``: equal, or differing
    only in a dim that is 1 in the problem too (M for the first of a 2-d operand's dims, N for the
    last of a 1-d or 2-d one)."""
    if theirs == ours:
        return True
    if len(theirs) != 3 or len(ours) != 3 or theirs[:2] != ours[:2] or len(theirs[2]) != len(ours[2]):
        return False
    wild = {1: (one_column,), 2: (one_row, one_column)}.get(len(ours[2]))
    if wild is None:
        return False
    # Conditions only, no comparison of flags: under torch.compile(dynamic=True) the call's key and
    # flags may hold symbolic booleans, which dynamo refuses to compare with a bool (a sympy
    # BooleanAtom error) but decides as a branch's condition (with a guard).
    for t, o, w in zip(theirs[2], ours[2], wild, strict=True):
        if w:
            continue
        if t:
            if not o:
                return False
        elif o:
            return False
    return True


def _identity(acc):
    return acc


class MLP(nn.Module):
    """``y = output(activation(x @ up.weight.t()) @ down.weight.t(), **operands)``: two
    :class:`FusedLinear` layers, ``up`` and ``down``, each with its epilogue fused.

    Args:
        in_features: the input's last dim.
        hidden_features: the activation's width. A gated activation (one that splits its
            accumulator, ``acc.chunk(2, dim=-1)``, as SwiGLU does) gets an ``up`` layer twice as
            wide, gate rows first.
        activation: the first epilogue, ``fn(acc)`` (``fn(acc, bias)`` with ``bias=True``).
        output: the second epilogue, ``fn(acc, **operands)`` (``add_residual(acc, residual)``, say);
            the identity by default. ``forward(x, **operands)`` passes it its operands.
        out_features: the output's last dim (default ``in_features``).
        bias: whether both layers have a bias (each epilogue then takes a ``bias`` parameter).
        device, dtype: of the parameters.
        config, cache_dir: as for :func:`evtc.compile`, for every kernel of the block.

    The backward of the pair computes the first layer's dZ in the epilogue of the GEMM
    ``dZ2 @ W2`` (so that GEMM's output, the first layer's incoming gradient, is never stored) for
    16-bit inputs on the GPU, when that dZ is elementwise over the tile (a trained first bias's
    gradient then comes from the same kernel, as a column sum); otherwise the two layers' backwards
    run one after the other (:mod:`evtc.mlp_autograd`). The results are the same either way, up to
    rounding.
    """

    def __init__(self, in_features: int, hidden_features: int, activation: Callable[..., Any],
                 output: Callable[..., Any] | None = None, *, out_features: int | None = None,
                 bias: bool = False, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, config: Mapping[str, Any] | None = None,
                 cache_dir: str | os.PathLike | None = None) -> None:
        super().__init__()
        output = _identity if output is None else output
        out_features = in_features if out_features is None else out_features
        gated = _is_gated(activation, in_features, hidden_features, bias)
        width = 2 * hidden_features if gated else hidden_features
        options = {"config": config, "cache_dir": cache_dir}
        kw = {"bias": bias, "device": device, "dtype": dtype, **options}
        self.up = FusedLinear(in_features, width, activation, **kw)
        self.down = FusedLinear(hidden_features, out_features, output, **kw)
        self.gated = gated
        self._options = options
        self._dz: dict[tuple, Any] = {}
        self._second = None
        # Custom operators for torch.compile, by call signature (evtc.mlp_op).
        self._operators: dict[tuple, Any] = {}

    def forward(self, x: torch.Tensor, **operands: Any) -> Any:
        _refuse_jit("evtc.nn.MLP")
        _refuse_not_an_x(x, "evtc.nn.MLP: ")
        if not all(type(layer) is FusedLinear and not _hooked(layer) and "forward" not in layer.__dict__
                   for layer in (self.up, self.down)):
            # A hooked layer (a forward hook, pruning's or the old weight_norm's pre-hook that
            # recomputes the weight), one whose forward is patched on the instance (an adapter's
            # way, types.MethodType) or one replaced by another module runs as itself: the fused
            # pair below would read the parameters past its forward.
            return self.down(self.up(x), **operands)
        _refuse_own_bias(self.down.bias, operands, "evtc.nn.MLP")
        if torch.float64 in (x.dtype, self.up.weight.dtype, self.down.weight.dtype):
            return self.down(self.up(x), **operands)  # float64: each layer on torch (see FusedLinear)
        x, w1, w2, b1, b2 = _autocast(x, self.up.weight, self.down.weight, self.up.bias, self.down.bias)
        ops1 = {"bias": b1} if b1 is not None else {}
        ops2 = {"bias": b2, **operands} if b2 is not None else dict(operands)
        tensors = (x, w1, w2, *ops1.values(), *ops2.values())
        if not (torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                                for t in tensors)):
            h = self.up(x)
            return self.down(h, **operands)
        names1, names2 = tuple(ops1), tuple(ops2)
        values = (*ops1.values(), *ops2.values())
        if torch.compiler.is_compiling():
            # One custom operator for the forward and one for the backward (evtc.mlp_op), which the
            # first eager call of this signature registered: dynamo cannot trace MLPFunction's
            # kernel launches, and the operators keep its fused backward.
            from evtc.mlp_op import signature, unregistered

            operator = self._operators.get(signature(x, ops1, ops2))
            if operator is None:
                raise unregistered("evtc.nn.MLP")
            outputs = operator(x, w1, w2, values)
            second = operator.second
        else:
            from evtc.mlp_autograd import MLPFunction
            from evtc.runtime.call_checks import refuse_functorch_autograd

            refuse_functorch_autograd("evtc.nn.MLP")
            outputs = MLPFunction.apply(self, x, w1, w2, names1, names2, *values)
            second = self._second  # the one MLPFunction.forward just ran
        return second.kernel.plan.structure.build(dict(zip(second.output_names, outputs, strict=True)))

    def note_eager_forward(self, x: torch.Tensor, ops1: dict[str, Any], ops2: dict[str, Any],
                           outputs: tuple, h: torch.Tensor, saved1: tuple, saved2: tuple) -> None:
        """Register the custom operators that run this call's signature under torch.compile
        (:mod:`evtc.mlp_op`), from what its eager forward returned; once per signature."""
        from evtc.mlp_op import MLPOperator, signature

        key = signature(x, ops1, ops2)
        if key not in self._operators:
            self._operators[key] = MLPOperator(self, ops1, ops2, x, outputs, h, saved1, saved2)

    # -- what MLPFunction asks of the block -------------------------------------------------------
    def first_linear(self, x: torch.Tensor, operands: dict[str, Any], weight: torch.Tensor | None = None):
        """The first layer's :class:`evtc.Linear` for ``x`` and ``operands``; it must have one output."""
        lin = self.up._linear_for(x, operands, weight)
        if len(lin.output_names) != 1:
            raise CallError(f"evtc.nn.MLP: the activation must return one tensor, the second layer's input; "
                            f"it returns {len(lin.output_names)} ({', '.join(lin.output_names)})")
        return lin

    def second_linear(self, h: torch.Tensor, operands: dict[str, Any], weight: torch.Tensor | None = None):
        """The second layer's :class:`evtc.Linear` for its input ``h``."""
        lin = self._second = self.down._linear_for(h, operands, weight)
        return lin

    def dz_kernel(self, first, dz2: torch.Tensor, w2: torch.Tensor, ops1: dict[str, Any],
                  operand_grads: tuple[str, ...] = ()):
        """The kernel of the fused backward step (``dZ1`` in the epilogue of ``dZ2 @ W2``, and the
        gradients of the first layer's operands ``operand_grads`` as its reductions) and its
        generated epilogue, or None where there is none (compiled on first use, then kept)."""
        # The first layer's Linear is part of the key: its epilogue (the activation) may be
        # replaced between calls, and the fused step differentiates that epilogue.
        key = (first, dz2.dtype, dz2.device, w2.dtype, operand_grads,
               tuple((n, v.dtype, v.dim()) if isinstance(v, torch.Tensor) else (n, type(v))
                     for n, v in ops1.items()))
        # Built once across threads, and not inside a CUDA graph capture (the unfused step is
        # capture-safe; the first backward outside one builds it).
        from evtc.dz_pass import built_once

        state = built_once(self._dz, key, dz2.device,
                           lambda: _compile_dz(first, dz2, w2, ops1, operand_grads, self._options))
        return state or None

    def __getstate__(self) -> dict[str, Any]:
        """As :meth:`FusedLinear.__getstate__`: the fused backward kernels and the torch.compile
        operators are not copied (a copy registers its own on its first eager call)."""
        state = super().__getstate__()
        return {**state, "_dz": {}, "_second": None, "_operators": {}}

    def extra_repr(self) -> str:
        return f"gated={self.gated}"


def _compile_dz(first, dz2, w2, ops1, operand_grads, options):
    """(kernel, epilogue) of the fused dZ step for the first layer ``first``, or None."""
    from evtc import dz_pass
    from evtc.ir.backward_epilogue import dz_epilogue

    epilogue = dz_epilogue(first.backward_graph(), dz2.dtype, name=first.kernel.plan.name,
                           operand_grads=operand_grads,
                           tile_grad_dtypes={name: ops1[name].dtype for name in operand_grads})
    example = first._example
    if epilogue is None or example is None:
        return None
    # Beside as many rows as the forward's example (at least two: one would compile the tiles as
    # row vectors), its operands keeping the kinds and layouts the forward compiled.
    rows = max(example["a"].shape[0], 2)
    meta = {"device": "meta", "dtype": dz2.dtype}
    inputs: dict[str, Any] = {"a": torch.empty(rows, dz2.shape[1], **meta),
                              "b": torch.empty(w2.shape[0], w2.shape[1], **meta),
                              **dz_pass.saved_and_operand_examples(epilogue, example, rows, w2.shape[1],
                                                                   dz2.dtype)}
    kernel = dz_pass.compile_epilogue(epilogue, inputs, first.kernel.plan.name, None, options)
    return None if kernel is None else (kernel, epilogue)


def _is_gated(activation: Callable[..., Any], in_features: int, hidden_features: int, bias: bool) -> bool:
    """Whether ``activation`` splits its accumulator into gate and up halves: its output is half as
    wide as the accumulator (traced on meta tensors)."""
    import sympy

    from evtc.api import trace
    from evtc.ir.shapes import N

    width = 2 * hidden_features
    example: dict[str, Any] = {"a": torch.empty(8, in_features, device="meta", dtype=torch.bfloat16),
                               "b": torch.empty(in_features, width, device="meta", dtype=torch.bfloat16)}
    if bias:
        example["bias"] = torch.empty(width, device="meta", dtype=torch.bfloat16)
    graph = trace(activation, example)
    tiles = [store for store in graph.stores if len(store.shape) == 2]
    if not tiles:  # (several outputs are refused at the call, by the first layer's own check)
        shapes = ", ".join(str(tuple(str(d) for d in store.shape)) for store in graph.stores)
        raise CallError(f"evtc.nn.MLP: the activation must return one tensor, an (M, hidden) tile (the "
                        f"second layer's input); it returns output(s) of shape {shapes}")
    return any(sympy.sympify(store.shape[-1]) == N / 2 for store in tiles)


__all__ = ["MLP", "FusedLinear"]
