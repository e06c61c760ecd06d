"""The tensors an epilogue makes itself while it is traced (``torch.tensor(2.0)``).

Those are constants of the function, traced as literals; a tensor from outside it (a global, a
closure variable, a module's parameter) is not, nor one computed from such a tensor. A torch
function mode sees every torch call the function makes and keeps the results made from numbers
alone. ``torch.tensor(x)`` of a traced value is that value.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode

from ..errors import UnsupportedOpError
from . import lowering
from .proxy import SymDim, TracedValue
from .source import user_location

if TYPE_CHECKING:
    from .tracer import Tracer


class MadeTensors(TorchFunctionMode):
    """While the epilogue runs: the tensors that torch functions make from numbers alone
    (``torch.tensor(2.0)``, ``torch.ones(()) * 3``), which are constants of the function. A tensor
    computed from one that comes from outside it is not one of them."""

    def __init__(self, tracer: Tracer) -> None:
        super().__init__()
        self.tracer = tracer
        self._made: dict[int, torch.Tensor] = {}  # by id, kept alive so that no id is reused

    def holds(self, t: torch.Tensor) -> bool:
        return self._made.get(id(t)) is t

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _RANDOM or getattr(func, "__name__", None) in _RANDOM_METHODS:
            # Drawn once while tracing, the numbers would be a constant of the kernel, the same on
            # every call, where torch draws new ones.
            raise UnsupportedOpError(
                f"{getattr(func, '__name__', func)}: random numbers inside an epilogue are not supported "
                "(drawn once while tracing, they would be a constant of the kernel); draw them outside "
                "and pass them as an operand", user_location())
        if func in _FROM_DATA and args and isinstance(args[0], SymDim):
            # torch.tensor(acc.shape[-1]): the size, as a value of the epilogue.
            return _from_traced(func, self.tracer.wrap(self.tracer.node_of(args[0])), **kwargs)
        if func in _FROM_DATA and args and isinstance(args[0], TracedValue):
            return _from_traced(func, args[0], **kwargs)
        if func in _FACTORIES and "device" not in kwargs:
            # A constant is read at trace time: made on the CPU whatever the default device
            # (torch.set_default_device("cuda") or "meta", under which it would have no value).
            kwargs = {**kwargs, "device": "cpu"}
        result = func(*args, **kwargs)
        if isinstance(result, torch.Tensor) and all(self.holds(t) for t in _tensors_in((args, kwargs))):
            self._made[id(result)] = result
        return result


#: torch's functions that make a tensor from data: on a traced value (torch.tensor(alpha)), the value.
_FROM_DATA = (torch.tensor, torch.as_tensor, torch.scalar_tensor)
#: torch's random factories, and the in-place methods that fill a tensor with random numbers.
_RANDOM = (torch.rand, torch.randn, torch.randint, torch.randperm, torch.normal, torch.bernoulli,
           torch.poisson, torch.multinomial, torch.rand_like, torch.randn_like, torch.randint_like)
_RANDOM_METHODS = frozenset({"uniform_", "normal_", "random_", "exponential_", "bernoulli_", "cauchy_",
                             "log_normal_", "geometric_"})
#: Functions that make a tensor on the default device unless told another.
_FACTORIES = (*_FROM_DATA, torch.ones, torch.zeros, torch.full, torch.empty)


def _from_traced(func: Any, value: TracedValue, dtype: torch.dtype | None = None, device: Any = None,
                 requires_grad: bool = False, **_: Any) -> TracedValue:
    """``torch.tensor(alpha)`` or ``torch.as_tensor(acc)`` of a traced value (a device is the
    kernel's business). torch.tensor copies (a new value, which in-place ops may change);
    torch.as_tensor of a tensor is that tensor."""
    if dtype is not None and dtype != value.dtype:
        return lowering.cast_to(value._tracer, value, dtype)
    if func is torch.as_tensor:
        return value
    return value._tracer.wrap(value._node)


def _tensors_in(value: Any):
    """The torch tensors in ``value`` (arguments: nested tuples, lists and dicts)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, tuple | list):
        for v in value:
            yield from _tensors_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors_in(v)


__all__ = ["MadeTensors"]
