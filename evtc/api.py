"""The public entry points that need no GPU: trace and reference."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .errors import DTypeError, EpilogueError, InputError, OutputError, ShapeError
from .frontend.epilogue import unwrap
from .frontend.inputs import RESERVED, read_signature
from .frontend.source import definition_location
from .frontend.tracer import trace_raw
from .ir.block_scales import is_pair, scale_problem, split_inputs
from .ir.dtypes import STORE_DTYPES, short_name
from .ir.graph import Graph, rewrite
from .ir.interpreter import accumulator
from .ir.passes import optimize

OutDtypes = torch.dtype | Sequence[torch.dtype] | Mapping[str, torch.dtype] | None


def trace(
    fn: Callable[..., Any],
    example_inputs: Mapping[str, Any],
    *,
    out_dtypes: OutDtypes = None,
    optimize_graph: bool = True,
) -> Graph:
    """Trace an epilogue on example inputs and return its optimized IR graph.

    Args:
        fn: the epilogue, `fn(acc, *operands)`, plain or decorated with `@evtc.epilogue`.
        example_inputs: `a` and `b` (the GEMM inputs, shape (L,) M, K and (L,) K, N) and one entry per
            epilogue parameter after acc: tensors (only their dtype and shape are used; `meta`
            tensors are fine) and Python scalars (runtime arguments). Block-scaled float8 `a` and
            `b` come as `(tensor, scales)` pairs (docs/fp8.md); the scales do not change the graph.
        out_dtypes: overrides output dtypes: one dtype for every output, a sequence in output order,
            or a dict by output name (`D` for a single output, `D0`, `D1`, ... for a tuple, the keys
            for a dict).
        optimize_graph: run the pass pipeline (the default); False returns the graph as traced.

    Raises:
        EpilogueError: a subclass naming the problem and the line of the epilogue.
    """
    user_fn = unwrap(fn)
    try:
        if isinstance(example_inputs, Mapping):  # (trace_raw names anything else)
            example_inputs, _ = split_inputs(example_inputs)
        graph = trace_raw(user_fn, example_inputs)
        if out_dtypes is not None:
            graph = _override_dtypes(graph, out_dtypes, user_fn)
        return optimize(graph) if optimize_graph else graph
    except EpilogueError as err:
        # The message names the user's line; evtc's own frames would only hide it.
        raise err.with_traceback(None) from None


def _override_dtypes(graph: Graph, out_dtypes: OutDtypes, fn: Callable[..., Any]) -> Graph:
    names = graph.outputs.names
    loc = definition_location(fn)
    if isinstance(out_dtypes, torch.dtype):
        wanted = {n: out_dtypes for n in names}
    elif isinstance(out_dtypes, Mapping):
        unknown = [k for k in out_dtypes if k not in names]
        if unknown:
            raise OutputError(f"out_dtypes names unknown output(s) {unknown}; outputs are {names}", loc)
        wanted = dict(out_dtypes)
    elif isinstance(out_dtypes, list | tuple):
        seq = list(out_dtypes)
        if len(seq) != len(names):
            raise OutputError(f"out_dtypes has {len(seq)} entries for {len(names)} outputs", loc)
        wanted = dict(zip(names, seq, strict=True))
    else:
        raise OutputError(f"out_dtypes must be a torch.dtype, a list or tuple of them in output order, or "
                          f"a dict by output name; got a {type(out_dtypes).__name__}", loc)
    for name, dtype in wanted.items():
        if dtype not in STORE_DTYPES:
            allowed = ", ".join(short_name(d) for d in STORE_DTYPES)
            raise DTypeError(f"out_dtypes[{name!r}] = {dtype} is not supported; outputs may be {allowed}",
                             loc)

    def visit(node, inputs, builder):  # noqa: ANN001, ANN202 - the rewrite callback
        if node.op == "store" and node.attrs["name"] in wanted:
            dtype = wanted[node.attrs["name"]]
            attrs = {**node.attrs, "dtype": dtype}
            if dtype == torch.bool and node.dtype != torch.bool:
                # torch's .bool() of the output as the function returns it: its value rounded to
                # that dtype first (a float16 product can underflow to 0).
                attrs["rounded_from"] = node.dtype
            return builder.add("store", inputs, attrs, loc=node.loc, dtype=dtype)
        return None

    return rewrite(graph, visit)


def _given_accumulator(acc: Any, inputs: Mapping[str, Any], user_fn: Callable[..., Any]) -> torch.Tensor:
    """The ``acc=`` of :func:`reference`, checked: a floating tensor of at least 2 dims, of the
    shape of ``a @ b`` where those are given."""
    where = definition_location(user_fn)
    if not isinstance(acc, torch.Tensor) or not acc.is_floating_point() or acc.dim() < 2:
        what = (f"a {acc.dtype} tensor of {acc.dim()} dims" if isinstance(acc, torch.Tensor)
                else type(acc).__name__)
        raise InputError(f"acc= must be a floating tensor (..., M, N), got {what}", where)
    a, b = inputs.get("a"), inputs.get("b")
    a, b = (a[0] if isinstance(a, tuple) else a), (b[0] if isinstance(b, tuple) else b)  # block-scaled pairs
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        want = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
        if tuple(acc.shape) != tuple(want):
            raise InputError(f"acc= has shape {tuple(acc.shape)}; a @ b is {tuple(want)}", where)
    return acc


def reference(
    fn: Callable[..., Any],
    inputs: Mapping[str, Any],
    *,
    dtype: torch.dtype = torch.float32,
    acc: torch.Tensor | None = None,
) -> Any:
    """Run the epilogue directly on real tensors, computing in `dtype` (float32 by default).

    `acc = a @ b` and every tensor operand are converted to `dtype` first, so this is the
    mathematically intended result that a fused kernel is compared with. Outputs keep the
    structure the function returns; values the function casts explicitly (`.to(torch.bfloat16)`)
    are rounded there, as torch rounds them.

    `acc`, where given, is used instead of `a @ b` (converted to `dtype`; `a` and `b` may then be
    left out of `inputs`): to see what an error in the accumulator does to each output, or to run
    the epilogue on a kernel's own accumulator (an identity kernel with a float32 output).
    """
    user_fn = unwrap(fn)
    sig = read_signature(user_fn)
    if not isinstance(inputs, Mapping):
        raise InputError(f"inputs must be a dict of name -> tensor or scalar, got {type(inputs).__name__}",
                         definition_location(user_fn))
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise InputError(f"dtype must be a floating-point torch.dtype (torch.float32 or torch.float64), "
                         f"got {dtype!r}", definition_location(user_fn))
    needed = (*(() if acc is not None else RESERVED), *sig.params)
    missing = [k for k in needed if k not in inputs and k not in sig.defaults]
    if missing:
        raise InputError(f"missing input(s): {', '.join(map(repr, missing))}", definition_location(user_fn))
    if acc is not None:
        # A copy: an in-place op of the function must not change the caller's tensor (``.to`` of
        # a float32 tensor to float32 is the tensor itself).
        acc = _given_accumulator(acc, inputs, user_fn).to(dtype, copy=True)
    else:
        plain, scales = split_inputs(inputs)
        if scales is not None:
            # Block-scaled float8 (docs/fp8.md): acc is the product of the dequantized a and b.
            problem, _ = scale_problem(plain["a"], plain["b"], scales)
            if problem is not None:
                raise InputError(problem, definition_location(user_fn))
        a, b = inputs["a"], inputs["b"]
        for name, value in (("a", a), ("b", b)):
            if not isinstance(value, torch.Tensor) and not is_pair(value):
                raise InputError(f"{name} must be a tensor (or a (tensor, scales) pair), got "
                                 f"{type(value).__name__}", definition_location(user_fn))
        try:
            acc = accumulator(a, b, dtype)
        except (RuntimeError, ValueError) as exc:
            raise ShapeError(f"a @ b: {str(exc).splitlines()[0]}", definition_location(user_fn)) from None
    kwargs: dict[str, Any] = {}
    for name in sig.params:
        value = inputs[name] if name in inputs else sig.defaults[name]
        kwargs[name] = value.to(dtype, copy=True) if isinstance(value, torch.Tensor) else value
    return sig.call(user_fn, acc, kwargs)
