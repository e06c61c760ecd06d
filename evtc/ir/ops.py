"""The elementwise operations an epilogue graph may contain, and how to evaluate each on tensors.

One table is the single truth about an op: its arity, its constant parameters, how it prints and
how the reference interpreter evaluates it. The tracer maps torch calls onto these names, the passes
reason about them by name, and the code generator will emit each of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


@dataclass(frozen=True)
class OpDef:
    """One elementwise operation."""

    name: str
    arity: int
    evaluate: Callable[..., Tensor]
    #: Names of constant parameters kept as node attributes (e.g. leaky_relu's negative_slope).
    params: tuple[str, ...] = ()
    #: Infix symbol for printing binary ops (`a + b`); None prints as a call.
    infix: str | None = None
    commutative: bool = False
    #: True when the result is a boolean mask (comparisons, logical ops).
    boolean: bool = False


def _softplus(x: Tensor, beta: float, threshold: float) -> Tensor:
    return F.softplus(x, beta=beta, threshold=threshold)


def _clamp_bound(x: Tensor, bound: Tensor, beyond: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """``x`` clamped at ``bound`` on the side ``beyond`` tests (``torch.lt``: a lower bound), as
    torch's clamp by a number: a tie keeps ``x`` (so -0.0 at a bound of 0.0 stays -0.0, where CPU
    torch's clamp by a tensor bound may return the bound), and a NaN bound or ``x`` gives NaN."""
    bound = torch.as_tensor(bound, device=x.device)
    dtype = torch.result_type(x, bound)  # a mask's clamp is a number (torch promotes it)
    x, bound = x.to(dtype), bound.to(dtype)
    return torch.where(beyond(x, bound) | bound.isnan(), bound, x)


_TABLE: list[OpDef] = [
    # arithmetic
    OpDef("add", 2, torch.add, infix="+", commutative=True),
    OpDef("sub", 2, torch.sub, infix="-"),
    OpDef("mul", 2, torch.mul, infix="*", commutative=True),
    OpDef("div", 2, torch.div, infix="/"),
    OpDef("pow", 2, torch.pow, infix="**"),
    OpDef("neg", 1, torch.neg),
    OpDef("abs", 1, torch.abs),
    OpDef("reciprocal", 1, torch.reciprocal),
    OpDef("minimum", 2, torch.minimum, commutative=True),
    OpDef("maximum", 2, torch.maximum, commutative=True),
    # clamp's halves and hardtanh: the values of maximum / minimum, but torch's gradients at the
    # bounds (the input's gradient where x == bound, none to a bound there; hardtanh's none at either).
    OpDef("clamp_min", 2, lambda x, lo: _clamp_bound(x, lo, torch.lt)),
    OpDef("clamp_max", 2, lambda x, hi: _clamp_bound(x, hi, torch.gt)),
    OpDef("hardtanh", 1, F.hardtanh, params=("min_val", "max_val")),
    # transcendental
    OpDef("sqrt", 1, torch.sqrt),
    OpDef("rsqrt", 1, torch.rsqrt),
    OpDef("exp", 1, torch.exp),
    OpDef("exp2", 1, torch.exp2),
    OpDef("expm1", 1, torch.expm1),
    OpDef("log", 1, torch.log),
    OpDef("log2", 1, torch.log2),
    OpDef("log1p", 1, torch.log1p),
    OpDef("sin", 1, torch.sin),
    OpDef("cos", 1, torch.cos),
    OpDef("tanh", 1, torch.tanh),
    OpDef("erf", 1, torch.erf),
    # the value itself, through which no gradient flows (x.detach())
    OpDef("detach", 1, torch.Tensor.detach),
    # to an integer value (round: half to even, as torch.round); torch's gradient of each is zero
    OpDef("floor", 1, torch.floor),
    OpDef("ceil", 1, torch.ceil),
    OpDef("trunc", 1, torch.trunc),
    OpDef("round", 1, torch.round),
    # activations
    OpDef("sigmoid", 1, torch.sigmoid),
    OpDef("relu", 1, torch.relu),
    OpDef("leaky_relu", 1, lambda x, negative_slope: F.leaky_relu(x, negative_slope),
          params=("negative_slope",)),
    OpDef("elu", 1, lambda x, alpha: F.elu(x, alpha), params=("alpha",)),
    OpDef("gelu", 1, lambda x: F.gelu(x)),
    OpDef("gelu_tanh", 1, lambda x: F.gelu(x, approximate="tanh")),
    OpDef("silu", 1, F.silu),
    OpDef("softplus", 1, _softplus, params=("beta", "threshold")),
    OpDef("mish", 1, F.mish),
    OpDef("hardswish", 1, F.hardswish),
    OpDef("hardsigmoid", 1, F.hardsigmoid),
    # comparisons and selection
    OpDef("gt", 2, torch.gt, infix=">", boolean=True),
    OpDef("ge", 2, torch.ge, infix=">=", boolean=True),
    OpDef("lt", 2, torch.lt, infix="<", boolean=True),
    OpDef("le", 2, torch.le, infix="<=", boolean=True),
    OpDef("eq", 2, torch.eq, infix="==", boolean=True, commutative=True),
    OpDef("ne", 2, torch.ne, infix="!=", boolean=True, commutative=True),
    OpDef("logical_and", 2, torch.logical_and, infix="&", boolean=True, commutative=True),
    OpDef("logical_or", 2, torch.logical_or, infix="|", boolean=True, commutative=True),
    OpDef("logical_not", 1, torch.logical_not, boolean=True),
    OpDef("where", 3, torch.where),
]

ELEMENTWISE: dict[str, OpDef] = {op.name: op for op in _TABLE}

#: Reduction kinds and the torch functions that compute them.
REDUCE_FUNCS: dict[str, Callable[..., Tensor]] = {
    "sum": torch.sum,
    "max": torch.amax,
    "min": torch.amin,
}

#: What a reduction kind starts from (the identity element), for masking ragged tiles.
REDUCE_IDENTITY: dict[str, float] = {"sum": 0.0, "max": -math.inf, "min": math.inf}


def opdef(name: str) -> OpDef:
    return ELEMENTWISE[name]
