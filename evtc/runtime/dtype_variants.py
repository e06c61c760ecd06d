"""Calls whose tensor operands have other dtypes, or are 0-dim where the example was not (or the
reverse), than the example the kernel was compiled from.

The graph was traced on the example, and some of its decisions depend on the operands' dtypes:
the outputs' dtypes (torch's promotion: a float32 bias makes ``acc + bias`` float32), a value the
epilogue reads (``.to(C.dtype)``, ``torch.finfo(C.dtype)``), a comparison with a 16-bit operand
(the number is rounded to its dtype first), an in-place op's rounding, a cast that is a no-op for
one dtype and not for another. Such decisions are not one operand's alone (two operands may
change a promotion only together), so a call with other operand dtypes is judged by tracing the
epilogue again on meta tensors of the call's dtypes: the call runs where the traced graph is the
compiled one (up to the operands' own load dtypes, which the kernel widens to float32 anyway),
and is refused by name otherwise. Verdicts are kept per combination of dtypes, so each costs one
trace per kernel; calls with the example's dtypes cost a tuple comparison.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from evtc.errors import CallError, EpilogueError
from evtc.ir.dtypes import short_name
from evtc.runtime.call_checks import FLOAT_OPERAND_DTYPES

#: One tensor operand's part of a call's key: its dtype and whether it is 0-dim.
Variant = tuple[torch.dtype, bool]


def meta_copy(value: Any) -> Any:
    """``value`` with every tensor replaced by a meta tensor of its shape, strides and dtype (the
    example's storage is not kept alive by the kernel)."""
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(tuple(value.shape), tuple(value.stride()), dtype=value.dtype,
                                   device="meta")
    if isinstance(value, tuple):
        return tuple(meta_copy(v) for v in value)
    return value


def _structure(graph) -> tuple:
    """The graph's structure (as :func:`evtc.ir.passes.result.fingerprint` reads it) with the
    operands' load dtypes left out: the kernel widens each load to float32, so the widening casts
    evtc makes explicit and the loads' own dtypes say nothing; only what follows from the dtypes
    (other casts, promotions, the outputs' dtypes) tells two graphs apart. Shapes and operand kinds
    are left out too: an operand's rank is the broadcast checks' to judge (evtc.runtime.broadcasts)."""
    alias: dict[int, int] = {}  # a widening cast of a load -> the load
    kept: dict[int, int] = {}  # node id -> index among the kept nodes
    entries = []
    for node in graph.nodes:
        if (node.op == "cast" and node.attrs.get("implicit") and node.dtype == torch.float32
                and node.inputs[0].op == "load"):
            alias[node.id] = alias.get(node.inputs[0].id, node.inputs[0].id)
            continue
        inputs = tuple(kept[alias.get(i.id, i.id)] for i in node.inputs)
        attrs = {k: v for k, v in node.attrs.items()
                 if not (node.op == "load" and k in ("dtype", "shape", "kind", "batched"))}
        dtype = "" if node.op == "load" else str(node.dtype)
        kept[node.id] = len(entries)
        # Not the fusion pass's stages and unit numbers: an operand's kind (a scalar per batch or
        # one for all) moves them, and a widening cast of its own shifts them.
        entries.append((node.op, inputs, repr(sorted(attrs.items(), key=lambda kv: kv[0])), dtype))
    return tuple(entries)


def _stores(graph) -> dict[str, torch.dtype]:
    return {n.attrs["name"]: n.attrs["dtype"] for n in graph.nodes if n.op == "store"}


class DtypeVariants:
    """Judges calls whose float tensor operands differ in dtype or 0-dim-ness from the example.

    ``fn``, ``example_inputs`` and ``out_dtypes``: what the kernel was compiled from;
    ``compiled_graph()``: the kernel's graph (traced again on first use for a kernel loaded from
    the disk cache)."""

    def __init__(self, fn: Callable[..., Any], example_inputs: Mapping[str, Any], out_dtypes: Any,
                 compiled_graph: Callable[[], Any]) -> None:
        self.fn = fn
        self._example = {name: meta_copy(v) for name, v in example_inputs.items()}
        self._out_dtypes = out_dtypes
        self._compiled_graph = compiled_graph
        self._names = tuple(sorted(name for name, v in self._example.items()
                                   if name not in ("a", "b") and isinstance(v, torch.Tensor)))
        self._example_key = self._key(self._example)
        self._verdicts: dict[tuple, str | None] = {}
        self._lock = threading.Lock()

    def _key(self, operands: Mapping[str, Any]) -> tuple:
        # Other dtypes (float64, integers) are named by the call's own checks.
        key = []
        for name in self._names:
            value = operands.get(name)
            ok = isinstance(value, torch.Tensor) and value.dtype in FLOAT_OPERAND_DTYPES
            key.append((value.dtype, value.dim() == 0) if ok else None)
        return tuple(key)

    def check(self, operands: Mapping[str, Any]) -> None:
        """Raise a CallError where the call's operand dtypes make the epilogue another computation
        than the compiled one."""
        key = self._key(operands)
        if key == self._example_key:
            return
        verdict = self._verdicts.get(key, False)
        if verdict is False:
            with self._lock:
                verdict = self._verdicts.get(key, False)
                if verdict is False:
                    verdict = self._verdicts[key] = self._judge(key, operands)
        if verdict is not None:
            raise CallError(verdict)

    def _judge(self, key: tuple, operands: Mapping[str, Any]) -> str | None:
        from evtc.api import trace
        from evtc.ir.passes.gated import kernel_graph

        example = dict(self._example)
        changed = []
        ranks = False  # whether an operand came with the example's dtype and another rank
        for name, given, compiled in zip(self._names, key, self._example_key, strict=True):
            if given is None or given == compiled:
                continue  # not a float tensor: the other checks name what is wrong with it
            dtype, zero_dim = given
            if zero_dim:
                shape: tuple[int, ...] = ()
            elif compiled is not None and not compiled[1]:
                shape = tuple(self._example[name].shape)  # the example's, in the call's dtype
            else:
                shape = (1,)  # dims where the example was 0-dim: ranks are the broadcast checks' part
            example[name] = torch.empty(shape, dtype=dtype, device="meta")
            if compiled is not None and compiled[0] == dtype:
                # Only the rank changed: a 0-dim tensor takes part in torch's type promotion
                # otherwise than one with dims, so the same dtype can compute otherwise.
                given_shape = tuple(getattr(operands.get(name), "shape", shape))
                changed.append(f"{name} a {short_name(dtype)} tensor of shape {given_shape} where the "
                               f"example's was {'0-dim' if compiled[1] else 'not 0-dim'}")
                ranks = True
            else:
                changed.append(f"{name} a {'0-dim ' if zero_dim else ''}{short_name(dtype)} tensor")
        if not changed:
            return None
        what = " and ".join(changed)
        advice = ("convert the operand(s) to the example's dtypes"
                  + (" and ranks (0-dim or not)" if ranks else "")
                  + ", or compile from an example like this call")
        try:
            traced = kernel_graph(trace(self.fn, example, out_dtypes=self._out_dtypes))
        except EpilogueError as err:
            return f"with {what}, the epilogue does not trace ({str(err).splitlines()[0]}): {advice}"
        compiled = self._compiled_graph()
        if _structure(traced) == _structure(compiled):
            return None
        ours, theirs = _stores(compiled), _stores(traced)
        if ours != theirs:
            listed = ", ".join(f"{name} {short_name(dtype)}" for name, dtype in theirs.items())
            kernel = ", ".join(f"{name} {short_name(dtype)}" for name, dtype in ours.items())
            return (f"with {what}, torch gives the epilogue's outputs other dtypes than the compiled "
                    f"kernel's ({listed}, where the kernel's are {kernel}; in torch an operand with "
                    f"dims promotes a 16-bit result to float32 when it is float32 or the other 16-bit "
                    f"dtype, a 0-dim one does not): {advice}")
        return (f"with {what}, the epilogue computes otherwise than the compiled kernel (it reads the "
                "operand's dtype, as .to(C.dtype) does, compares a 16-bit operand with a number, which "
                f"rounds the number to its dtype, or rounds an in-place result to it): {advice}")


__all__ = ["DtypeVariants", "meta_copy"]
