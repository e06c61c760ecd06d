"""The cheap key of a compile call: what ``evtc.compile`` was given, without tracing anything.

A kernel's full cache key is a digest of its generated source, which needs the tracer, the passes
and the code generator (and so sympy). A process that compiles an epilogue it compiled before should
not pay for them: the front key digests the call itself -- the epilogue's code (its bytecode,
constants, names, defaults, closure values and the module globals it reads, followed into helper
functions), the example inputs' dtypes, shapes and strides, ``out_dtypes``, ``config``, ``strict``,
the architecture and the versions of evtc's sources, the CuTe DSL, tvm_ffi, torch and Python. A
front record in the cache maps it to the kernel's entry and plan (:mod:`evtc.runtime.cache`).

Anything the digest cannot see through gives no front key: such a compile takes the full path,
every time. That is an arbitrary object in a closure or a global, a tensor captured by the function,
a module other than torch's and the standard library's (its attributes may change), a bound method
(its object's state), a library object that is not a function or a class (an ``nn.Module``
instance), a function with attributes or any other wrapper than ``@evtc.epilogue`` and
``functools.lru_cache``.
"""

from __future__ import annotations

import builtins
import functools
import hashlib
import os
import re
import sys
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch


class _Opaque(Exception):
    """A value the front key cannot digest."""


@functools.cache
def source_digest() -> str:
    """A digest of evtc's own sources: a change to any (the tracer, the passes, the code generator,
    the kernel, the runtime) invalidates every key."""
    here = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(here.rglob("*.py")):
        h.update(str(path.relative_to(here)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def versions() -> dict[str, str]:
    """Versions of everything that changes what a compile produces, and the DSL's settings that
    may change the code it generates (line info, assertions, the optimisation level, debug builds:
    a kernel built under them is another kernel; its log settings are not, and CUTE_DSL_ARCH is
    keyed as the arch). The settings are read on every compile: they may change in the process."""
    return {**_package_versions(),
            "dsl_env": ";".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                                if k.startswith("CUTE_DSL_") and k != "CUTE_DSL_ARCH"
                                and not k.startswith("CUTE_DSL_LOG"))}


@functools.cache
def _package_versions() -> dict[str, str]:
    from importlib import metadata

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "unknown"

    return {
        "evtc": version("evtc"),
        "codegen": source_digest(),
        "cutlass_dsl": version("nvidia-cutlass-dsl"),
        "tvm_ffi": version("apache-tvm-ffi"),
        "torch": torch.__version__,
        "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
    }


def _code(code: types.CodeType, seen: set[int]) -> tuple:
    consts = tuple(_code(c, seen) if isinstance(c, types.CodeType)
                   else ("c", type(c).__name__, _const_repr(c)) for c in code.co_consts)
    return (code.co_filename, code.co_firstlineno, code.co_code, code.co_linetable, consts, code.co_names,
            code.co_varnames, code.co_freevars, code.co_cellvars, code.co_argcount, code.co_kwonlyargcount,
            code.co_flags)


def _const_repr(value: Any) -> str:
    """A constant of the bytecode; a frozenset (``x in {1, 2}``) in a fixed order, as its repr's
    order changes with each process's hash seed."""
    if isinstance(value, frozenset):
        return repr(sorted(map(repr, value)))
    return repr(value)


def _names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _names(c)
    return names


def _function(fn: types.FunctionType, seen: set[int]) -> tuple:
    if id(fn) in seen:
        return ("recursion", fn.__qualname__)
    seen.add(id(fn))
    code = fn.__code__
    closure = tuple(_value(cell.cell_contents, seen) for cell in fn.__closure__ or ())
    globals_read = []
    for name in sorted(_names(code)):
        if name in fn.__globals__:
            globals_read.append((name, _value(fn.__globals__[name], seen)))
        elif hasattr(builtins, name):
            globals_read.append((name, "builtin"))
    # What the function reads through a library module (``torch.backends.cuda.matmul.allow_tf32``,
    # ``F.gelu`` replaced by a function of the user's): the module is digested by its name, and
    # these by their values.
    cells = dict(zip(code.co_freevars, (cell.cell_contents for cell in fn.__closure__ or ()), strict=True))
    for from_closure, *chain in _module_attribute_chains(code):
        start = cells if from_closure else fn.__globals__
        globals_read.append((".".join(chain), _chain_value(start, tuple(chain), seen)))
    annotations = tuple(sorted((k, repr(v)) for k, v in getattr(fn, "__annotations__", {}).items()))
    attributes = _value(dict(fn.__dict__), seen) if fn.__dict__ else None  # fn.scale read in fn
    return ("function", _code(code, seen), _value(fn.__defaults__, seen), _value(fn.__kwdefaults__, seen),
            closure, tuple(globals_read), annotations, attributes)


@functools.lru_cache(maxsize=4096)
def _module_attribute_chains(code: types.CodeType) -> tuple[tuple, ...]:
    """The attribute chains the bytecode reads from a global or a closure variable
    (``torch.backends.cuda.matmul``: ``(False, "torch", "backends", "cuda", "matmul")``, the first
    item whether it starts at a closure variable), in ``code`` and the code it nests (whose closure
    variables are the function's cells too, where they are ``code``'s own)."""
    import dis

    chains: set[tuple] = set()
    current: list = []
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_GLOBAL", "LOAD_DEREF", "LOAD_CLASSDEREF"):
            if len(current) > 2:
                chains.add(tuple(current))
            current = [ins.opname != "LOAD_GLOBAL", ins.argval]
        elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and current:
            current.append(ins.argval)
        elif ins.opname not in ("CACHE", "EXTENDED_ARG", "NOP", "PRECALL"):
            if len(current) > 2:
                chains.add(tuple(current))
            current = []
    if len(current) > 2:
        chains.add(tuple(current))
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            # A nested function's closure variables are this function's cells only where they
            # are its own free variables: others (its own cells) are not readable from here.
            chains.update(c for c in _module_attribute_chains(const)
                          if not c[0] or c[1] in code.co_freevars)
    return tuple(sorted(chains, key=repr))


#: Library functions whose results are process state (a flag set by the user), not a function of
#: their arguments: an epilogue that calls them traces differently as the state changes.
_STATE_READERS = re.compile(r"(are|is)_\w*(enabled|mode)|get_\w+|is_available|is_built")


def _chain_value(globals_: dict, chain: tuple[str, ...], seen: set[int]) -> Any:
    """The digest of what ``chain`` reads, where it starts at a library module (other values are
    digested whole, above): a module by its name, anything else by its value."""
    value = globals_.get(chain[0])  # (the function's globals, or its closure variables)
    if not (isinstance(value, types.ModuleType) and _library_name(value.__name__)):
        return None
    for depth, attribute in enumerate(chain[1:], start=2):
        try:
            value = getattr(value, attribute)
        except Exception:  # noqa: BLE001 - an attribute the trace would fail on
            return ("missing", attribute)
        if isinstance(value, types.ModuleType):
            continue
        if _STATE_READERS.fullmatch(attribute) and callable(value):
            raise _Opaque(f"{'.'.join(chain[:depth])}() reads process state")
        try:
            return _value(value, seen)
        except _Opaque:
            if depth == len(chain):
                raise
            # An object along the way (``torch.backends.cuda.matmul``): what is read from it counts.
    return ("module", value.__name__) if isinstance(value, types.ModuleType) else None


def _value(value: Any, seen: set[int]) -> Any:
    if value is None or isinstance(value, bool | int | float | complex | str | bytes):
        return (type(value).__name__, repr(value))
    if isinstance(value, torch.dtype):
        return ("dtype", str(value))
    if isinstance(value, tuple | list):
        return (type(value).__name__, tuple(_value(v, seen) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((repr(k), _value(v, seen)) for k, v in value.items()))
    if isinstance(value, types.ModuleType):
        if _library_name(value.__name__):
            return ("module", value.__name__)
        raise _Opaque(f"module {value.__name__}")  # a user module: its attributes may change
    if isinstance(value, types.FunctionType):
        return _function(value, seen)
    if isinstance(value, functools.partial):
        return ("partial", _value(value.func, seen), _value(value.args, seen), _value(value.keywords, seen))
    if _is_library_callable(value):
        return ("named", getattr(value, "__module__", None), getattr(value, "__qualname__", repr(value)))
    wrapped = getattr(value, "__wrapped__", None)  # @evtc.epilogue, functools.lru_cache
    if isinstance(value, functools._lru_cache_wrapper) and value.cache_info().currsize:
        # Results it holds were computed from the state of their time, which the digest of the
        # state of now does not see: a kernel traced with them would be recorded under today's.
        raise _Opaque("an lru_cache holding results")
    if isinstance(wrapped, types.FunctionType) and _is_plain_wrapper(value):
        return ("wrapped", type(value).__qualname__, _function(wrapped, seen))
    raise _Opaque(type(value).__name__)


def _library_name(module: str) -> bool:
    return module.split(".")[0] in ("torch", "math", "operator", "builtins", "functools")


_NAMED_KINDS = (types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType,
                types.ClassMethodDescriptorType, type)


def _is_library_callable(value: Any) -> bool:
    """A function or class of torch or the standard library, whose identity is its name: not a
    bound method (``module.forward``, ``MyFunction.apply``, a tensor's method: the object's state
    counts) and not an object (an ``nn.Module`` instance)."""
    if not isinstance(value, _NAMED_KINDS) or not _library_name(getattr(value, "__module__", None) or ""):
        return False
    owner = getattr(value, "__self__", None)
    return owner is None or isinstance(owner, types.ModuleType)


def _is_plain_wrapper(value: Any) -> bool:
    """A wrapper whose only state is the function it wraps: ``@evtc.epilogue``, functools.lru_cache."""
    from evtc.frontend.epilogue import Epilogue

    return type(value) is Epilogue or isinstance(value, functools._lru_cache_wrapper)


def _example(value: Any, seen: set[int]) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape), tuple(value.stride()), value.device.type)
    return _value(value, seen)


def _operand_example(name: str, value: Any, seen: set[int]) -> Any:
    """An example input in the key: block-scaled ``a`` and ``b`` are (tensor, scales) pairs, whose
    scales' strides do not change the kernel (a's 1 x 128 scales in another layout than its TMA
    reads run on a copy; the others are read at any strides)."""
    if name in ("a", "b") and isinstance(value, tuple | list) and len(value) == 2 \
            and all(isinstance(v, torch.Tensor) for v in value):
        tensor, scales = value
        scale_spec = (str(scales.dtype), tuple(scales.shape), scales.device.type)
        return ("scaled", _example(tensor, seen), scale_spec)
    return _example(value, seen)


def front_key(fn: Callable[..., Any], example_inputs: Mapping[str, Any], out_dtypes: Any, config: Any,
              arch: str | None, strict: bool) -> str | None:
    """The front key of a compile call, or None when the call cannot have one (see the module)."""
    from evtc.frontend.epilogue import unwrap

    user_fn = unwrap(fn)
    if not isinstance(user_fn, types.FunctionType):
        return None
    seen: set[int] = set()
    try:
        parts = (
            _function(user_fn, seen),
            tuple((name, _operand_example(name, example_inputs[name], seen))
                  for name in sorted(example_inputs)),
            _value(out_dtypes, seen),
            repr(config) if config is not None and not isinstance(config, Mapping) else _value(config, seen),
            arch or "device",
            strict,
            # Constants the epilogue makes (torch.tensor([2.0])) take the default dtype.
            str(torch.get_default_dtype()),
            tuple(sorted(versions().items())),
        )
    except (_Opaque, RecursionError, TypeError, ValueError):
        return None
    return hashlib.sha256(repr(parts).encode()).hexdigest()


__all__ = ["front_key", "source_digest", "versions"]
