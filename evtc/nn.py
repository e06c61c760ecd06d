"""``evtc.nn``: modules built on ``evtc.linear``.

``FusedLinear(in_features, out_features, epilogue)`` is an ``nn.Linear`` whose output goes through
``epilogue`` in the same kernel: ``epilogue(x @ weight.t(), bias=bias, **operands)``. Its weight and
bias are parameters, initialised as ``nn.Linear``'s, and it is differentiable (see
:mod:`evtc.linear_autograd`).
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from evtc.errors import CallError
from evtc.frontend.epilogue import unwrap


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

    The kernel is compiled on the first call (and again for inputs of another dtype, device or
    rank), then kept.
    """

    def __init__(self, in_features: int, out_features: int, epilogue: Callable[..., Any], *,
                 bias: bool = True, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, out_dtypes: Any = None,
                 config: Mapping[str, Any] | None = None,
                 cache_dir: str | os.PathLike | None = None) -> None:
        super().__init__()
        params = list(inspect.signature(unwrap(epilogue)).parameters)
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
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor, **operands: Any) -> Any:
        if self.bias is not None:
            operands = {"bias": self.bias, **operands}
        lin = self._linear_for(x, operands)
        return lin(x, self.weight, **operands)

    def _linear_for(self, x: torch.Tensor, operands: dict[str, Any]):
        from evtc.linear import linear

        key = (x.dtype, x.device, x.dim(), self.weight.dtype,
               tuple((name, v.dtype, v.dim()) if isinstance(v, torch.Tensor) else (name, type(v))
                     for name, v in operands.items()))
        lin = self._compiled.get(key)
        if lin is None:
            example = {"x": x.detach(), "weight": self.weight.detach(),
                       **{k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in operands.items()}}
            lin = self._compiled[key] = linear(self.epilogue, example, **self._options)
        return lin

    def extra_repr(self) -> str:
        name = getattr(unwrap(self.epilogue), "__name__", "fn")
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, epilogue={name}")


__all__ = ["FusedLinear"]
