"""Example inputs: checking them against the epilogue's signature and inferring operand kinds.

Operand kinds come from each tensor's shape against the problem's (L, M, N), with torch's
right-aligned broadcasting, never from guesses: a 1-d tensor of N elements is a row vector even when
M == N, because that is what torch does with it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import sympy
import torch

from ..errors import DTypeError, InputError, ShapeError, SourceLoc, nested_tensor_message
from ..ir.dtypes import FLOAT8_DTYPES, GEMM_INPUT_DTYPES, OPERAND_DTYPES, short_name
from ..ir.graph import Operand
from ..ir.shapes import HALF_N, ONE, L, M, N, Shape, varying_dims
from ..plan.operand_kinds import kind_of
from .epilogue import signature_of
from .source import definition_location

RESERVED = ("a", "b")


@dataclass
class Problem:
    """What the example inputs say about the GEMM: sizes, batching and input dtype."""

    batched: bool
    sizes: dict[sympy.Symbol, int]
    ab_dtype: torch.dtype


@dataclass
class Signature:
    """The epilogue's parameters: acc first, then operands, with Python defaults."""

    acc_name: str
    params: list[str]
    defaults: dict[str, Any]
    #: How many leading parameters (acc included) are positional-only (``def f(acc, C, /)``).
    positional_only: int = 0

    def call(self, fn: Callable[..., Any], acc: Any, operands: Mapping[str, Any]) -> Any:
        """``fn(acc, **operands)``, passing the positional-only parameters by position."""
        names = [self.acc_name, *self.params]
        values = {self.acc_name: acc, **operands}
        head = [values[n] for n in names[:self.positional_only]]
        return fn(*head, **{n: values[n] for n in names[self.positional_only:]})


def read_signature(fn: Callable[..., Any]) -> Signature:
    loc = definition_location(fn)
    try:
        sig = signature_of(fn)
    except (TypeError, ValueError) as exc:
        if callable(fn):
            # A builtin without a readable signature (torch.relu, F.gelu): a function of the
            # accumulator alone, passed by position.
            return Signature("acc", [], {}, positional_only=1)
        raise InputError(f"cannot read the signature of {fn!r}: {exc}", loc) from None
    params = list(sig.parameters.values())
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise InputError(
                f"epilogue parameter *{p.name} / **{p.name} is not supported: name every input", loc
            )
    if not params:
        raise InputError("an epilogue takes the accumulator as its first parameter", loc)
    names = [p.name for p in params]
    for reserved in RESERVED:
        if reserved in names:
            raise InputError(
                f"epilogue parameter {reserved!r} clashes with the GEMM input {reserved!r} "
                f"(the example-input keys 'a' and 'b' are reserved for A and B): rename it",
                loc,
            )
    for own in ("out", "self"):
        if own in names[1:]:
            raise InputError(
                f"epilogue parameter {own!r} clashes with the compiled kernel's call "
                f"(k(a, b, ..., {'out=...' if own == 'out' else 'as a method'}) takes {own!r} itself): "
                "rename it", loc)
    defaults = {p.name: p.default for p in params[1:] if p.default is not p.empty}
    positional_only = sum(p.kind == p.POSITIONAL_ONLY for p in params)
    return Signature(acc_name=names[0], params=names[1:], defaults=defaults, positional_only=positional_only)


def check_example_keys(fn: Callable[..., Any], sig: Signature, example: Mapping[str, Any]) -> None:
    loc = definition_location(fn)
    missing = [k for k in RESERVED if k not in example]
    missing += [p for p in sig.params if p not in example and p not in sig.defaults]
    if missing:
        raise InputError(f"missing example input(s): {', '.join(map(repr, missing))}", loc)
    allowed = set(RESERVED) | set(sig.params)
    extra = [k for k in example if k not in allowed]
    if extra:
        hint = ""
        if sig.acc_name in extra:
            hint = f" ({sig.acc_name!r} is the accumulator a @ b; pass 'a' and 'b' instead)"
        raise InputError(
            f"example input(s) {', '.join(map(repr, extra))} are not parameters of "
            f"{getattr(fn, '__name__', 'the epilogue')}{hint}",
            loc,
        )


def read_problem(example: Mapping[str, Any], loc: SourceLoc | None) -> Problem:
    """Sizes and batching of the GEMM from the example tensors a (..., M, K) and b (..., K, N)."""
    a, b = example["a"], example["b"]
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"example input {name!r} must be a tensor, got {type(t).__name__}", loc)
        refuse_nested(f"example input {name!r}", t, loc)
        if t.dim() not in (2, 3):
            raise ShapeError(
                f"{name!r} must be 2-d or 3-d (batched), got shape {tuple(t.shape)}", loc
            )
        if t.dtype not in GEMM_INPUT_DTYPES:
            allowed = ", ".join(short_name(d) for d in GEMM_INPUT_DTYPES)
            raise DTypeError(f"{name!r} has dtype {t.dtype}; the GEMM takes {allowed}", loc)
    if a.dtype != b.dtype and not (a.dtype in FLOAT8_DTYPES and b.dtype in FLOAT8_DTYPES):
        raise DTypeError(f"'a' is {a.dtype} but 'b' is {b.dtype}: they must match (only float8 a and b "
                         "may mix e4m3 and e5m2)", loc)
    if a.shape[-1] != b.shape[-2]:
        raise ShapeError(
            f"a @ b: a has shape {tuple(a.shape)} and b {tuple(b.shape)}; K differs "
            f"({a.shape[-1]} vs {b.shape[-2]})",
            loc,
        )
    batched = a.dim() == 3 or b.dim() == 3
    la = a.shape[0] if a.dim() == 3 else 1
    lb = b.shape[0] if b.dim() == 3 else 1
    if la != lb and 1 not in (la, lb):
        raise ShapeError(
            f"a @ b: batch sizes differ ({la} vs {lb}) and neither is 1", loc
        )
    sizes = {M: int(a.shape[-2]), N: int(b.shape[-1]), L: int(max(la, lb))}
    return Problem(batched=batched, sizes=sizes, ab_dtype=a.dtype)


def refuse_nested(what: str, t: torch.Tensor, loc: SourceLoc | None = None) -> None:
    """Refuse a nested (ragged) tensor, whose rows have no one shape for the kernel to tile."""
    if t.is_nested:
        raise InputError(nested_tensor_message(what), loc)


def classify_tensor(name: str, t: torch.Tensor, problem: Problem, loc: SourceLoc | None) -> Operand:
    """The operand kind of a tensor input, from its shape against (L, M, N)."""
    refuse_nested(f"input {name!r}", t, loc)
    if t.dtype not in OPERAND_DTYPES:
        allowed = ", ".join(short_name(d) for d in OPERAND_DTYPES)
        raise DTypeError(f"input {name!r} has dtype {t.dtype}; epilogue tensors may be {allowed}", loc)
    dims = (L, M, N) if problem.batched else (M, N)
    target = tuple(problem.sizes[d] for d in dims)
    if t.dim() > len(dims):
        raise ShapeError(
            f"input {name!r} has shape {tuple(t.shape)}, more dims than the accumulator "
            f"{target} (broadcasting would change the output's shape)",
            loc,
        )
    if t.numel() == 1:
        # A one-element tensor is a device-resident scalar (e.g. an FP8 scale).
        return Operand(name, "scalar", t.dtype, tuple(ONE for _ in t.shape), batched=False)
    aligned = dims[len(dims) - t.dim():]
    shape: list[sympy.Expr] = []
    for size, dim in zip(t.shape, aligned, strict=True):
        if size == problem.sizes[dim] and size != 1:
            shape.append(dim)
        elif dim == N and size != 1 and 2 * size == problem.sizes[N]:
            # Half of N: an operand of a gated epilogue's output (after acc.chunk(2, dim=-1)).
            shape.append(HALF_N)
        elif size == 1 and dim == L and problem.sizes[L] == 1:
            # Examples of one batch: a full-rank operand is per batch, as a and b are. A call
            # with a shared (1, M, N) operand beside a batch of L still runs: it is expanded.
            shape.append(L)
        elif size == 1:
            shape.append(ONE)
        else:
            names = "(L, M, N)" if problem.batched else "(M, N)"
            # A vector of M values is the usual slip: torch broadcasts a 1-d tensor along the last
            # dim (N), so a per-row value needs its own column dim.
            column = (dim == N and size == problem.sizes[M] and t.dim() >= 1 and t.shape[-1] == size)
            hint = (f"; a per-row column of M = {size} values is ({size}, 1) (torch broadcasts a "
                    "1-d tensor along N)") if column else ""
            raise ShapeError(
                f"input {name!r} has shape {tuple(t.shape)}, which cannot broadcast to "
                f"{names} = {target}: each dim must be 1 or the problem's size{hint}",
                loc,
            )
    sym: Shape = tuple(shape)
    varying = varying_dims(sym)
    kind = kind_of({str(d) for d in varying})
    return Operand(name, kind, t.dtype, sym, batched=L in varying)
