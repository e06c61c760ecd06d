"""Checks of a compiled kernel's call arguments, with messages that name the argument and the rule,
and the reasons a call takes the torch path instead of the kernel.

They run only when a call is rejected (the compiled code checks the same rules first, cheaply), or
on a machine without a GPU, so they cost nothing on the fast path. The few that every call needs
(:func:`without_unused`, :func:`unpair`, :func:`scales_fit`) are written to be cheap.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

from evtc.errors import CallError, nested_tensor_message
from evtc.ir.block_scales import SCALE_BLOCK, is_pair, scale_problem
from evtc.ir.dtypes import beyond_int64, short_name, torch_dtype, variant_name
from evtc.numpy_scalars import is_numpy_scalar
from evtc.plan.config import GATED_SCALE_CHUNK
from evtc.plan.tensor_spec import TensorSpec
from evtc.runtime.call_spec import CallSpec
from evtc.runtime.out_aliasing import overlap, storage_span

#: Operand dtypes a call may pass for a tensor compiled with another float dtype (torch path).
FLOAT_OPERAND_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: The largest int a runtime scalar may be, as torch takes one.
#: The largest size (M, N, K, L) and workspace length the kernel's 32-bit arguments hold.
INT32_MAX = (1 << 31) - 1


@functools.cache
def gpu_problem() -> str | None:
    """None when a Hopper GPU can run the kernel, else why not."""
    if not torch.cuda.is_available():
        return "this machine has no CUDA GPU"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return f"the GPU is sm_{major}{minor}; the kernel needs an SM90 (Hopper) GPU"
    return None


def tf32_allowed() -> bool:
    """Whether torch multiplies float32 matrices in tf32 now. Torch 2.9 and later keep the setting as
    ``fp32_precision`` (its old ``allow_tf32`` flag raises once the new API has been used); older
    versions only have the flag."""
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)
    if precision is None:
        return bool(matmul.allow_tf32)
    return precision == "tf32"


def is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def check_tensor(name: str, t, spec, dtype: torch.dtype, sizes: dict, *, layout: bool = True,
                 output: bool = False, rank_refusal: str | None = None) -> None:
    """Raise a CallError unless ``t`` fits ``spec`` (checks the kernel also makes, with messages).
    ``layout=False`` leaves out strides and alignment (which the staged path handles); ``output``:
    ``t`` is an ``out=`` target, written whole, never broadcast; ``rank_refusal``: the message for
    a rank other than compiled, where the broadcasts found why torch's would differ
    (evtc.runtime.broadcasts)."""
    if not isinstance(t, torch.Tensor):
        hint = ""
        if isinstance(t, int | float) and all(d in ("1", "L") for d in spec.dims):
            hint = (f" ({name} was compiled as a device scalar, from a one-element tensor example; for "
                    "a Python number per call, compile with a Python number as its example)")
        raise CallError(f"{name} must be a torch.Tensor, got {type(t).__name__}{hint}")
    if t.dtype != dtype:
        hint = ""
        if t.dtype == torch.float64:
            hint = (" (epilogue tensors are float32, float16 or bfloat16; for a scale, a Python number "
                    f"or {name}.float() does)")
        elif t.device.type in ("cuda", "cpu") and torch.is_autocast_enabled(t.device.type):
            hint = (" (torch.autocast does not cast a compiled kernel's tensors: it runs the dtypes it "
                    "was compiled for, and its outputs keep theirs; cast them, or use evtc.nn's "
                    "modules, which follow autocast as nn.Linear does)")
        raise CallError(f"{name} must be {dtype} (as compiled), got {t.dtype}{hint}")
    want = tuple(1 if d == "1" else sizes[d] for d in spec.dims)
    if rank_refusal is not None and t.dim() != spec.rank:
        raise CallError(rank_refusal)
    if output and tuple(t.shape) != want:
        # torch resizes an out= tensor of another shape (or writes a broadcast result whole): no
        # view of the caller's tensor would do, so the hints for operands do not apply.
        raise CallError(f"{name} must have the output's shape {want}, got {tuple(t.shape)} (an out= "
                        f"tensor with elements is written whole; evtc does not resize it as torch would)")
    if t.dim() != spec.rank or tuple(t.shape) != want:
        _refuse_shape(name, t, spec, want)
    if layout and spec.contiguous is not None:
        strides = t.stride()
        c = spec.contiguous
        if strides[c] != 1 and t.shape[c] > 1:
            raise CallError(f"{name} must be contiguous along {spec.dims[c]} (stride 1, as compiled), got "
                            f"strides {strides}")
        align = spec.align_elems()
        for i, d in enumerate(spec.dims):
            if i != c and d != "1" and t.shape[i] > 1 and strides[i] % align:
                raise CallError(
                    f"{name} has strides {strides}: stride {i} must be a multiple of {align} elements "
                    f"(16 bytes, TMA's rule); make it contiguous or pad the rows"
                )
        if t.data_ptr() % 16:
            raise CallError(f"{name}'s data pointer is not 16-byte aligned (TMA needs 16 bytes; a view "
                            f"offset by {t.storage_offset()} elements); pass a copy (.clone())")


def _refuse_shape(name: str, t: torch.Tensor, spec, want: tuple[int, ...]) -> None:
    """Raise the CallError for a tensor of another rank or shape than ``want``, with a hint where
    the example's shape explains it."""
    dims = ", ".join(spec.dims)
    # Whether torch would broadcast t to the compiled shape (trailing dims aligned).
    broadcastable = all(size in (1, full) for size, full in zip(t.shape[::-1], want[::-1], strict=False))
    narrower = (f" (torch would broadcast it, but {name} was compiled as ({dims}) from its example's "
                f"shape, and the kind is part of the kernel: pass {name}.expand{want}, or compile from "
                "an example of this shape)")
    if t.dim() != spec.rank:
        hint = ""
        if t.dim() < spec.rank and not name.endswith(" half)") and broadcastable:
            hint = narrower
        elif t.dim() > spec.rank and t.dim() == 3 and t.shape[0] > 1:
            # Shapes torch would broadcast, but a batch of its own is another operand kind.
            hint = (f" ({name} has a batch of {t.shape[0]} where its example had none, so it was "
                    "compiled as shared by all batches; the kind is part of the kernel: compile from "
                    "an example of this rank to pass one per batch)")
        elif t.dim() > spec.rank and _kind_name(spec.dims):
            hint = _kind_hint(name, spec.dims)
        raise CallError(f"{name} must be {spec.rank}-d like its example ({dims}), got shape "
                        f"{tuple(t.shape)}{hint}")
    hint = ""
    if all(d in ("1", "L") for d in spec.dims) and t.numel() > max(want, default=1):
        # A one-element example is a scalar operand whatever its rank: examples of M = 1 or
        # N = 1 make a (M, N) or (N,) example one.
        hint = (f" ({name} was compiled as a one-element scalar operand, from its example's shape: "
                "give examples with M and N above 1 for a tile, row or column operand)")
    elif spec.rank == 3 and spec.dims[0] == "1" and t.shape[0] > 1:
        # A (1, M, N) example beside a and b of a larger batch is an operand shared by all.
        hint = (f" ({name} was compiled as shared by all batches, from an example of batch 1 "
                "beside a and b of a larger batch; the kind is part of the kernel: compile from "
                "an example with a batch of its own to pass one per batch)")
    elif any(d == "1" and size > 1 for d, size in zip(spec.dims, t.shape, strict=True)):
        # A row or a column where the call passes more: deliberately, or from an example of M = 1
        # (one token), which makes an (M, N) operand a row (N = 1, a column).
        hint = _kind_hint(name, spec.dims)
    elif name.endswith(" half)") and broadcastable:
        # A gated operand's halves are views of the user's tensor: they are not broadcast.
        full = (*want[:-1], 2 * want[-1])
        hint = (f" (a gated epilogue's operand is split into gate and up halves, which are not "
                f"broadcast: pass it at its full shape {full}, e.g. .expand{full})")
    elif broadcastable:
        # Fewer varying dims than compiled: torch broadcasts it, the kernel reads another kind.
        hint = narrower
    raise CallError(f"{name} has shape {tuple(t.shape)}, inconsistent with a and b: expected ({dims}) = "
                    f"{want}{hint}")


def numbers_read_as_python(operands: dict) -> dict:
    """``operands`` with NumPy scalars (np.float32(0.5)) as the Python numbers they hold, which is
    how torch reads them (the compiled function takes Python numbers only)."""
    if not any(is_numpy_scalar(v) for v in operands.values()):
        return operands
    return {k: v.item() if is_numpy_scalar(v) else v for k, v in operands.items()}


def cpu_scalars_moved(operands: dict, device) -> dict:
    """``operands`` with 0-dim CPU tensors copied to ``device``: torch takes such a tensor beside
    CUDA ones as a scalar (``acc * torch.tensor(0.5)``); the kernel reads it from GPU memory."""
    def on_cpu(v) -> bool:
        return isinstance(v, torch.Tensor) and v.dim() == 0 and v.device.type == "cpu"

    if getattr(device, "type", None) != "cuda" or not any(on_cpu(v) for v in operands.values()):
        return operands
    # A fill with the value, as torch bakes such a scalar into its kernels: a copy from host memory
    # would synchronise the stream, and a CUDA graph capture refuses it.
    return {k: torch.full((), v.item(), dtype=v.dtype, device=device) if on_cpu(v) else v
            for k, v in operands.items()}


def plain_copies(a: Any, b: Any, operands: dict, scales: tuple | None = None
                 ) -> tuple[Any, Any, dict, tuple | None, list[str]]:
    """``a``, ``b``, ``operands`` and block ``scales`` with every sparse (not strided) tensor made
    dense, as torch computes with one (``acc + C`` of a sparse C is dense), and every tensor with
    torch's negative bit (``z.conj().imag``: memory that holds the values' negation, which the
    kernel would read as it is) resolved; and what was copied. The tensors as they are when none
    is either."""
    def odd(v) -> str | None:
        if not isinstance(v, torch.Tensor):
            return None
        if v.layout != torch.strided:
            return f"a {v.layout} tensor, made dense"
        return "a view with torch's negative bit, resolved" if v.is_neg() else None

    named = [("a", a), ("b", b), *operands.items(), *(("block scales", s) for s in scales or ())]
    copied = [f"{name}: {why}" for name, v in named if (why := odd(v)) is not None]
    if not copied:
        return a, b, operands, scales, []

    def plain(v):
        if odd(v) is None:
            return v
        return v.to_dense() if v.layout != torch.strided else v.resolve_neg()

    plain_scales = None if scales is None else tuple(plain(s) for s in scales)
    return plain(a), plain(b), {k: plain(v) for k, v in operands.items()}, plain_scales, copied


def refuse_other_promotions(spec: CallSpec, operands: dict) -> None:
    """Refuse an operand of another dtype, or 0-dim where the example had dims (or the reverse),
    where torch would give an output another dtype than the compiled one (a float32 bias where a
    bfloat16 one was compiled makes acc + bias float32): the kernel's outputs have the example's
    dtypes. Checked on the tensors as the user passed them, before any view."""
    for name, allowed in spec.plan.interface.operand_variants:
        value = operands.get(name)
        if not isinstance(value, torch.Tensor) or value.dtype not in FLOAT_OPERAND_DTYPES:
            continue  # not a float tensor: the checks name what is wrong with it
        given = variant_name(value.dtype, value.dim() == 0)
        if given not in allowed:
            what = f"{'0-dim ' if value.dim() == 0 else ''}{short_name(value.dtype)} tensor"
            raise CallError(
                f"{name} is a {what}, with which torch gives the epilogue's outputs other dtypes than "
                f"the compiled kernel's (it was compiled for {name} as one of: {', '.join(allowed)}; "
                "a float32 operand promotes a 16-bit result to float32, a 0-dim one does not): "
                f"convert {name}, or compile from an example like it")


def check_device(name: str, t, device) -> None:
    if t.device != device:
        raise CallError(f"{name} is on {t.device} but a is on {device}: all tensors must share a device")


def refuse_overlapping(label: str, t: torch.Tensor) -> None:
    """Refuse an ``out=`` tensor some of whose elements share memory (an expanded view, stride 0
    along a dim of extent > 1), as torch's own ops do: every tile would store into the same
    elements, and what is left there would be whichever store came last."""
    if t.numel() and any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride(), strict=True)):
        raise CallError(f"{label} has elements that share memory (strides {tuple(t.stride())} for shape "
                        f"{tuple(t.shape)}: an expanded view); pass a tensor with one element per value, "
                        f"e.g. torch.empty_like(...) or .clone() of it")


def refuse_unwritable(label: str, t: torch.Tensor) -> None:
    """Refuse an ``out=`` tensor the kernel or a copy cannot write as torch's ``out=`` would: one
    that is not strided (sparse), a view with torch's negative bit, an inference tensor outside
    ``torch.inference_mode`` (torch refuses to update it in place), or one whose elements share
    memory."""
    if torch.compiler.is_compiling():  # fake tensors: the compiler sees a functional op
        return refuse_overlapping(label, t)
    if t.layout != torch.strided:
        raise CallError(f"{label} is a {t.layout} tensor: outputs are written into strided (dense) "
                        "tensors")
    if t.is_neg():
        raise CallError(f"{label} is a view with torch's negative bit (as z.conj().imag gives): its "
                        "memory holds the negation of its values; pass a tensor without it")
    if t.is_inference() and not torch.is_inference_mode_enabled():
        raise CallError(f"{label} is an inference tensor (made under torch.inference_mode()): torch "
                        "updates one in place only inside inference_mode; call there, or pass a "
                        "tensor made outside it")
    refuse_overlapping(label, t)


def given_outputs(spec: CallSpec, out, m: int, n: int, batches: int, *, layout: bool = True,
                  device: torch.device | None = None) -> list:
    """The full-tile outputs of ``out=`` (the structure the epilogue returns), in kernel order,
    each checked against its compiled shape, dtype and (``layout``) layout; the reductions' ones
    against their shape, dtype and ``device`` (the kernel's, where given)."""
    given = spec.tree.flatten(out, is_tensor)
    if given is None:
        raise CallError(f"out= must have the structure the epilogue returns ({spec.describe_tree()})")
    tensors = []
    plan = spec.plan
    tile_names = spec.kernel_order[:len(plan.outputs)]
    specs = zip(tile_names, plan.outputs, spec.out_dtypes, strict=True)
    for index, (name, out_spec, dt) in enumerate(specs):
        t = given[name]
        label = f"out[{name!r}]" if not spec.single_output else "out"
        free_rank = spec.batch_free.get(index)
        if free_rank is not None:
            # The same in every batch: torch's (M, N) or (1, M, N); the kernel writes a buffer of
            # the call's, whose first batch is copied in (any layout).
            dims = out_spec.dims[1:] if free_rank == 2 else ("1", *out_spec.dims[1:])
            contiguous = None if out_spec.contiguous is None else out_spec.contiguous - (free_rank == 2)
            out_spec, layout_here = TensorSpec(out_spec.name, out_spec.dtype, dims, contiguous), False
        else:
            layout_here = layout
        if isinstance(t, torch.Tensor):  # (check_tensor names anything else)
            refuse_unwritable(label, t)  # before check_tensor reads strides a sparse tensor lacks
        check_tensor(label, t, out_spec, dt, {"L": batches, "M": m, "N": n}, layout=layout_here,
                     output=True)
        tensors.append(t)
    # The reductions' outputs are copied in after the kernel: checked now, so that a refused call
    # has written none of out='s tensors.
    dims = {"M": m, "N": n, "L": batches, "1": 1}
    for name, host in zip(spec.kernel_order[len(plan.outputs):], spec.host_outputs, strict=True):
        _check_given(name, given[name], tuple(dims[d] for d in host.dims), torch_dtype(host.dtype))
        if device is not None and given[name].device != device:
            # torch's out= takes no other device (a copy across would also synchronise the call)
            raise CallError(f"out[{name!r}] is on {given[name].device} but a is on {device}: all "
                            "tensors must share a device")
    refuse_shared_targets(given)
    return tensors


def problem_sizes(spec: CallSpec, a, b) -> tuple[int, int, int] | None:
    """(M, the GEMM's N, batches) of a call on ``a`` and ``b``, as :meth:`CallSpec.output_meta`
    takes them, or None where they are not a problem's inputs (the checks then say why)."""
    if spec.scale_rows and is_pair(a) and is_pair(b):
        a, b = a[0], b[0]
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.dim() not in (2, 3) \
            or b.dim() not in (2, 3):
        return None
    n = b.shape[-1]
    if spec.gated and n % 2:
        return None
    batches = a.shape[0] if a.dim() == 3 else b.shape[0] if b.dim() == 3 else 1
    return a.shape[-2], n, batches


def resize_empty(given: dict, shapes: dict, device: torch.device) -> None:
    """torch's rule for an ``out=`` tensor with no elements (``torch.empty(0)``): it is resized to the
    output's shape (a tensor with elements and another shape stays refused, where torch resizes it
    with a deprecation warning). Only where every target then fits (its output's dtype, device and
    shape) is anything resized: a refused call leaves ``out=`` as it was."""
    resize = []
    ids = [id(t) for t in given.values()]
    for name, target in given.items():
        if name not in shapes or not isinstance(target, torch.Tensor):
            return
        shape, dtype = shapes[name]
        if target.dtype != dtype or target.device != device:
            return
        if tuple(target.shape) == shape:
            continue
        if target.numel() or ids.count(id(target)) > 1 or target.requires_grad \
                or target.layout != torch.strided or not target.untyped_storage().resizable() \
                or target.is_inference() and not torch.is_inference_mode_enabled():
            return  # refused by the checks, as it is
        resize.append((target, shape))
    for target, shape in resize:
        target.resize_(shape)


def resize_empty_outputs(spec: CallSpec, out, a, b) -> None:
    """:func:`resize_empty` for a kernel call's ``out=`` on ``a`` and ``b``."""
    # The per-call look (out= of tensors with elements) first: no structure flattened.
    leaves = (out,) if isinstance(out, torch.Tensor) else out if isinstance(out, tuple | list) else None
    if leaves is not None:
        for t in leaves:
            if not isinstance(t, torch.Tensor) or not t.numel():
                break
        else:
            return
    given = spec.tree.flatten(out, is_tensor)
    if given is None or all(not isinstance(t, torch.Tensor) or t.numel() for t in given.values()):
        return
    sizes = problem_sizes(spec, a, b)
    if sizes is None:
        return
    device = (a[0] if is_pair(a) else a).device
    resize_empty(given, output_shapes(spec, sizes), device)


def output_shapes(spec: CallSpec, sizes: tuple[int, int, int]) -> dict[str, tuple[tuple, torch.dtype]]:
    """Each output's (shape, dtype) by name for a problem of :func:`problem_sizes` ``sizes``."""
    return dict(zip(spec.kernel_order, spec.output_meta(*sizes), strict=True))


def refuse_shared_targets(given: dict) -> None:
    """Refuse ``out=`` tensors (by output name) whose memory overlaps another's: each would hold
    whichever output was stored last."""
    if len(given) < 2 or torch.compiler.is_compiling():  # fake tensors while tracing: no memory
        return
    tensors = [(name, t) for name, t in given.items() if isinstance(t, torch.Tensor) and t.numel()]
    spans = sorted(storage_span(t) for _, t in tensors)
    if all(x_hi <= y_lo for (_, x_hi), (y_lo, _) in zip(spans, spans[1:], strict=False)):
        return  # the common case: every target in memory of its own (sorted spans that never meet)

    for i, (name, t) in enumerate(tensors):
        for other, u in tensors[i + 1:]:
            if overlap(t, u):
                raise CallError(f"out[{name!r}] and out[{other!r}] share memory: each output needs a "
                                "tensor of its own")


def _check_given(name: str, target: Any, shape: tuple, dtype: torch.dtype) -> None:
    """Refuse an ``out=`` tensor that a result of ``shape`` and ``dtype`` is copied into, unless it
    is one of that shape and dtype whose elements do not share memory."""
    if not isinstance(target, torch.Tensor) or tuple(target.shape) != tuple(shape) or target.dtype != dtype:
        raise CallError(f"out[{name!r}] must be a {dtype} tensor of shape {tuple(shape)}, got "
                        f"{_describe_value(target)}")
    refuse_unwritable(f"out[{name!r}]", target)


def copy_into_given(spec: CallSpec, out, names, values) -> list[torch.Tensor]:
    """Copy ``values`` (outputs named ``names``) into ``out=``'s tensors of those names, which must
    have their shapes and dtypes; returns ``out``'s tensors."""
    given = spec.tree.flatten(out, is_tensor)
    if given is None:
        raise CallError(f"out= must have the structure the epilogue returns ({spec.describe_tree()})")
    for name, value in zip(names, values, strict=True):  # all checked before any is written
        _check_given(name, given[name], tuple(value.shape), value.dtype)
    refuse_shared_targets({name: given[name] for name in names})
    for name, value in zip(names, values, strict=True):
        given[name].copy_(value)
    return [given[name] for name in names]


# ---- what a call passes besides tensors --------------------------------------------------------------


def _same_constant(value: Any, compiled: Any) -> bool:
    if is_numpy_scalar(value):
        value = value.item()  # np.bool_(True) is True, np.float32(0.5) is 0.5, as torch reads them
    if isinstance(compiled, bool) or compiled is None:
        return value is compiled
    if type(compiled) is float and type(value) is int:
        # An int where a float was compiled (beta=0 for beta=0.0): Python's numeric tower, as a
        # `beta: float` annotation and torch's own scalars read it. Not the other way round: a
        # float where an int was compiled may have been used as a count.
        return value == compiled
    return not isinstance(value, torch.Tensor) and type(value) is type(compiled) and value == compiled


def _describe_value(value: Any) -> str:
    # A tensor's values are not printed: for a GPU tensor that would copy it to the host.
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} ({value.dtype})"
    return repr(value)


def refuse_tensor_scalars(spec: CallSpec, operands: dict) -> None:
    """A tensor for a runtime scalar (compiled from a Python number) is refused by name, as the
    eager path's :func:`validate` does; the operator would take it, and under torch.compile it
    fails inside dynamo. A device scalar is compiled from a one-element tensor."""
    for name in spec.arg_names:
        if isinstance(operands.get(name), torch.Tensor):
            raise CallError(f"{name} is a runtime scalar: pass a Python float or int, got Tensor (for a "
                            "device scalar, compile with a one-element tensor example)")


def without_unused(spec: CallSpec, operands: dict) -> dict:
    """``operands`` without the parameters the kernel does not take: unused ones are dropped,
    compile-time constants checked against their compiled value; runtime scalars left out that
    have a Python default get it. Unknown names stay, for :func:`validate` to name."""
    interface = spec.plan.interface
    constants = dict(interface.constants)
    kept = {}
    for name, value in operands.items():
        if name in constants:
            if not _same_constant(value, constants[name]):
                raise CallError(
                    f"{name}={_describe_value(value)}: {spec.plan.name!r} was compiled with {name}="
                    f"{constants[name]!r}, a compile-time constant (the trace specialised on it); "
                    "compile again with the new value")
        elif name not in interface.unused:
            kept[name] = value
    for name, default in interface.defaults:
        kept.setdefault(name, default)
    return kept


def refuse_nested(what: str, t: Any) -> None:
    """Refuse a nested (ragged) tensor ``t``, whose rows have no one shape for the kernel to tile."""
    if isinstance(t, torch.Tensor) and t.is_nested:
        raise CallError(nested_tensor_message(what))


def dense_x(what: str, x: Any) -> Any:
    """A layer's ``x`` as ``F.linear`` takes it: a nested one refused, a sparse one made dense (a
    differentiable copy); anything else as it is."""
    refuse_nested(what, x)
    if isinstance(x, torch.Tensor) and x.layout != torch.strided and not torch.compiler.is_compiling():
        return x.to_dense()
    return x


def refuse_functorch_autograd(what: str) -> None:
    """Refuse a differentiable call inside a torch.func transform (grad, vjp, jacrev, jvp, or vmap
    while autograd records): evtc's backward launches kernels the transforms cannot see through, and
    torch's own error (an autograd.Function without ``setup_context``) does not say what to do."""
    if torch._C._functorch.maybe_current_level() is not None:
        raise CallError(f"{what} is differentiable through torch.autograd only, not inside torch.func "
                        "transforms (grad, vjp, jacrev, jvp, or vmap while autograd records): compute "
                        "gradients with loss.backward() or torch.autograd.grad (per-sample ones in a loop), "
                        "or call under torch.no_grad() for vmap of the forward alone")


def by_position(params: tuple[str, ...] | list[str], positional: tuple, operands: dict, callee: str,
                leading: tuple[str, str]) -> dict:
    """``operands`` with those given by ``positional`` (after the two ``leading`` arguments, a and
    b or x and weight) named by ``params``, the epilogue's parameters in order, as calling the
    function would take them; ``callee`` names the call in the errors."""
    if len(positional) > len(params):
        names = ", ".join((*leading, *params))
        raise CallError(f"{callee} takes at most {2 + len(params)} positional arguments ({names}); got "
                        f"{2 + len(positional)}")
    named = dict(zip(params, positional, strict=False))
    twice = [name for name in named if name in operands]
    if twice:
        raise CallError(f"{callee} got multiple values for {', '.join(map(repr, twice))} (by position and by "
                        "name)")
    return {**named, **operands}


def needs_grad(a, b, operands: dict) -> bool:
    """Whether any input requires grad (on the per-call path: no tuple or generator built). Only
    tensors are asked: under torch.compile a Python number that changed between calls is a
    symbolic one, whose attributes dynamo cannot look up."""
    if isinstance(a, torch.Tensor) and a.requires_grad or isinstance(b, torch.Tensor) and b.requires_grad:
        return True
    for value in operands.values():
        if isinstance(value, torch.Tensor) and value.requires_grad:
            return True
    return False


# ---- block-scaled float8 -----------------------------------------------------------------------------


def unpair(spec: CallSpec, a, b):
    """A block-scaled kernel's a and b as (a, b, (a's scales, b's scales))."""
    for name, value in (("a", a), ("b", b)):
        if not is_pair(value):
            raise CallError(f"{name} must be a (tensor, block scales) pair: {spec.plan.name!r} was "
                            f"compiled for block-scaled float8 a and b, got {type(value).__name__} "
                            "(docs/fp8.md, 'Block scales')")
    return a[0], b[0], (a[1], b[1])


def halves_off_scale_chunk(spec: CallSpec, n: int) -> bool:
    """Whether a block-scaled gated kernel cannot take a B of ``n`` columns: its halves must
    be whole chunks of GemmConfig.scale_chunk columns (the torch path computes the others)."""
    return bool(spec.scale_rows and spec.gated and n // 2 % GATED_SCALE_CHUNK)


def scales_fit(spec: CallSpec, a, b, scales) -> bool:
    """Whether block scales have the compiled granularity's shapes, float32, on a's device: the
    per-call check (what :func:`evtc.ir.block_scales.scale_problem` checks, without building a
    message; the slow path names what is wrong). ``b``: the user's, whole when gated."""
    a_scales, b_scales = scales
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    if halves_off_scale_chunk(spec, n):
        return False  # see torch_reason
    blocks_k = -(-k // SCALE_BLOCK)
    rows = m if spec.scale_rows == 1 else -(-m // SCALE_BLOCK)
    return (a_scales.dtype == torch.float32 and b_scales.dtype == torch.float32
            and a_scales.shape[:-2] == a.shape[:-2] and b_scales.shape[:-2] == b.shape[:-2]
            and a_scales.shape[-2:] == (rows, blocks_k)
            and b_scales.shape[-2:] == (blocks_k, -(-n // SCALE_BLOCK))
            and a_scales.device == a.device and b_scales.device == a.device)


def refuse_grad(spec: CallSpec, a, b, operands) -> None:
    """A block-scaled kernel has no derivative: a call whose inputs need one is an error, not a
    result without gradients."""
    wants_grad = needs_grad(None, None, operands)
    for value in (a, b):  # a pair's tensor and its scales, or a plain tensor (named later)
        for tensor in value if is_pair(value) else (value,):
            wants_grad = wants_grad or getattr(tensor, "requires_grad", False)
    if wants_grad:
        raise CallError(f"{spec.plan.name!r} takes block-scaled float8 a and b, which have no autograd "
                        "formula, and an input requires grad; call it under torch.no_grad() or detach "
                        "the inputs (docs/fp8.md, 'Block scales')")


# ---- the slow path -------------------------------------------------------------------------------------


def torch_reason(spec: CallSpec, a, operands: dict, b=None) -> str | None:
    """Why this call cannot run the SM90 kernel (it then takes the torch path), or None."""
    interface = spec.plan.interface
    if interface.torch_only is not None:
        return interface.torch_only
    reason = gpu_problem()
    if reason is not None:
        return reason
    if a.device.type != "cuda":
        return f"the tensors are on {a.device}"
    if spec.tf32 and not tf32_allowed():
        return ("float32 a and b: the kernel multiplies them as tf32, which torch allows only with "
                "torch.backends.cuda.matmul.allow_tf32 or fp32_precision = 'tf32' "
                "(torch.set_float32_matmul_precision('high')); this call is computed in full float32")
    if a.shape[-1] == 0:
        return "K = 0 (the accumulator is all zeros)"
    if spec.batch_free and (a.dim() == 3 and a.shape[0] == 0
                            or isinstance(b, torch.Tensor) and b.dim() == 3 and b.shape[0] == 0):
        return "a batch of 0 beside an output the same in every batch (torch gives it, no kernel runs)"
    sizes = (*a.shape, *(b.shape if isinstance(b, torch.Tensor) else ()))
    if max(sizes, default=0) > INT32_MAX:
        return (f"a size past 2**31 - 1 (a {tuple(a.shape)}, b {tuple(b.shape)}): the kernel's "
                "sizes are 32-bit")
    if isinstance(b, torch.Tensor) and halves_off_scale_chunk(spec, b.shape[-1]):
        return (f"b's halves have {b.shape[-1] // 2} columns, not a multiple of {GATED_SCALE_CHUNK}: "
                "the kernel reads a gated B's block scales per 32 columns of each half")
    # An operand of another float dtype than compiled: the kernel loads the compiled one, but
    # the function widens every operand to float32 first, so the graph gives the same result
    # where torch would promote the result alike (validate refuses the others: the outputs'
    # dtypes are the example's).
    for name, dtype in spec.operand_dtypes.items():
        value = operands.get(name)
        if isinstance(value, torch.Tensor) and value.dtype != dtype and value.dtype in FLOAT_OPERAND_DTYPES:
            return f"{name} is {value.dtype}, the kernel was compiled for {dtype}"
    return None


def _kind_name(dims: tuple[str, ...]) -> str | None:
    """What an operand of ``dims`` is, in words (None for a tile or a scalar)."""
    core = tuple(d for d in dims if d != "L")
    batch = " per batch" if "L" in dims else ""
    if core in (("N",), ("1", "N")):
        return f"a row vector{batch} (one value per column)"
    if core == ("M", "1"):
        return f"a column vector{batch} (one value per row)"
    return None


def _kind_hint(name: str, dims: tuple[str, ...]) -> str:
    kind = _kind_name(dims) or "a broadcast operand"
    return (f" ({name} was compiled as {kind}, ({', '.join(dims)}), from its example's shape; the kind "
            "is part of the kernel: compile from an example of the shape you call with. An example "
            "with M = 1 or N = 1 makes a tile operand a row or a column)")


def _validate_gated(spec: CallSpec, b, operands) -> None:
    """A gated call's own rules, checked on the tensors the user passed (before splitting)."""
    n = b.shape[-1]
    if n % 2:
        raise CallError(f"b has {n} columns: this gated epilogue splits them into gate and up halves "
                        "(acc.chunk(2, dim=-1)), so N must be even")
    for name, t in [("b", b)] + [(w, operands[w]) for w in spec.wide_operands]:
        if not isinstance(t, torch.Tensor) or t.dim() < 1 or t.shape[-1] != n:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise CallError(f"{name} must be a tensor whose last dim is N = {n} (as wide as the GEMM: "
                            f"it is split into gate and up halves like acc), got {shape}")


def check_names(spec: CallSpec, operands: dict) -> None:
    """Raise a CallError for an argument the epilogue does not take, or one it takes and did not
    get (``operands`` after :func:`without_unused`)."""
    unknown = sorted(set(operands) - spec.name_set)
    if unknown:
        takes = list(spec.plan.interface.parameters) or spec.names
        raise CallError(f"unexpected argument(s) {unknown}; the epilogue takes {takes or 'no operands'}")
    missing = [nm for nm in spec.names if nm not in operands]
    if missing:
        raise CallError(f"missing argument(s) {missing}; the epilogue takes {spec.names}")


def check_gemm_shapes(plan, a, b) -> None:
    """Raise a CallError where ``a`` and ``b`` do not have the compiled ranks, share K, or batch
    as compiled. Shapes only: the operator's fake implementation runs it too, so that a traced
    graph is refused where its run would be."""
    if a.dim() != len(plan.a.dims) or b.dim() != len(plan.b.dims):
        raise CallError(f"a and b must be {len(plan.a.dims)}-d and {len(plan.b.dims)}-d as when compiled; "
                        f"got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    if b.shape[-2] != a.shape[-1]:
        raise CallError(f"a @ b: a is {tuple(a.shape)} and b is {tuple(b.shape)}; K differs")
    fixed_n = plan.interface.fixed_n
    if fixed_n is not None and b.shape[-1] != fixed_n:
        raise CallError(f"b has {b.shape[-1]} columns, but the epilogue splits acc into halves of a "
                        f"fixed size ({fixed_n // 2}, as compiled: split({fixed_n // 2}, -1)), which "
                        f"torch's split makes two halves only for N = {fixed_n}; write "
                        "acc.chunk(2, dim=-1) or split(acc.shape[-1] // 2, -1) for a kernel of every N")
    # Comparisons only (no set of sizes): under torch.compile they are symbolic, and unhashable.
    if a.dim() == 3 and b.dim() == 3 and a.shape[0] != b.shape[0] and (
            plan.broadcast_batch is None or (a.shape[0] != 1 and b.shape[0] != 1)):
        raise CallError(f"a and b have batch sizes {a.shape[0]} and {b.shape[0]}"
                        + ("" if plan.broadcast_batch else " (compiled for equal batch sizes)"))


def check_operand_shapes(spec: CallSpec, a, b, operands: dict) -> None:
    """Raise the CallError a call would for a tensor operand whose rank or shape disagrees with
    ``a`` and ``b`` (and a gated call's own rules). Shapes only, comparisons only: the operator's
    fake implementation runs it on fake tensors of possibly symbolic sizes, so that torch.compile
    and torch.export refuse a graph whose run would be refused."""
    plan = spec.plan
    if plan.gated:
        _validate_gated(spec, b, operands)
        _, operands = spec.kernel_arguments(b, operands)
    batches = [t.shape[0] for t in (a, b) if t.dim() == 3]
    sizes = {"M": a.shape[-2], "K": a.shape[-1], "N": b.shape[-1] // 2 if plan.gated else b.shape[-1],
             "L": max(batches) if batches else 1}
    for kernel_input in plan.inputs:
        value = operands.get(kernel_input.name)
        if kernel_input.kind in ("arg", "literal") or not isinstance(value, torch.Tensor):
            continue
        spec_ = kernel_input.spec
        want = tuple(1 if d == "1" else sizes[d] for d in spec_.dims)
        if value.dim() != spec_.rank or tuple(value.shape) != want:
            _refuse_shape(kernel_input.label, value, spec_, want)


def validate(spec: CallSpec, a, b, out, operands: dict, scales=None,
             rank_refusals: Mapping[str, str] | None = None) -> None:
    """Raise a CallError naming what is wrong with the arguments (the slow path of a call).
    ``rank_refusals``: by operand, why a rank change torch would broadcast is refused
    (:func:`evtc.runtime.broadcasts.to_compiled_shapes`), said where its shape is checked.

    Layouts are not checked here: a layout the kernel cannot take is staged
    (:func:`evtc.runtime.staging.stage_call`)."""
    plan = spec.plan
    for name, t in (("a", a), ("b", b)):
        if is_pair(t):
            raise CallError(f"{name} is a (tensor, scales) pair, but {plan.name!r} was compiled without "
                            "block scales: compile with pairs as example inputs (docs/fp8.md)")
        if not isinstance(t, torch.Tensor):
            raise CallError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_gemm_shapes(plan, a, b)
    check_names(spec, operands)
    batches = [t.shape[0] for t in (a, b) if t.dim() == 3]
    b_parts = [("b", b)]
    if plan.gated:
        _validate_gated(spec, b, operands)
        (gate, up), operands = spec.kernel_arguments(b, operands)
        b_parts = [("b (its gate half)", gate), ("b (its up half)", up)]
    sizes = {"M": a.shape[-2], "K": a.shape[-1], "N": b_parts[0][1].shape[-1],
             "L": max(batches) if batches else 1}
    device = a.device
    # a and b each with its own batch size (they may broadcast, on the torch path).
    check_tensor("a", a, plan.a, torch_dtype(plan.a.dtype), {**sizes, "L": a.shape[0]}, layout=False)
    for name, part in b_parts:
        check_tensor(name, part, plan.b, torch_dtype(plan.b.dtype), {**sizes, "L": b.shape[0]}, layout=False)
    refuse_tensor_scalars(spec, operands)
    for kernel_input in plan.inputs:
        if kernel_input.kind == "literal":
            continue
        value = operands[kernel_input.name]
        if kernel_input.kind == "arg":
            if not isinstance(value, int | float):  # (a tensor was refused above)
                raise CallError(f"{kernel_input.name} is a runtime scalar: pass a Python float or int, got "
                                f"{type(value).__name__}")
            if beyond_int64(value):
                # torch refuses it too (an int scalar must fit in int64)
                raise CallError(f"{kernel_input.name}, an int of {len(str(abs(value)))} digits, does not fit "
                                "in int64, which torch requires of an int scalar: pass a float")
            continue
        # Another float dtype than compiled takes the torch path (see torch_reason); one that would
        # change an output's dtype was refused before (refuse_other_promotions).
        dtype = getattr(value, "dtype", None)
        dtype = dtype if dtype in FLOAT_OPERAND_DTYPES else torch_dtype(kernel_input.spec.dtype)
        check_tensor(kernel_input.label, value, kernel_input.spec, dtype, sizes, layout=False,
                     rank_refusal=(rank_refusals or {}).get(kernel_input.user))
    outs = [] if out is None else given_outputs(spec, out, sizes["M"], sizes["N"], sizes["L"], layout=False,
                                                device=device)
    if spec.scale_rows:
        problem, _ = scale_problem(a, b, scales, spec.scale_rows)
        if problem is not None:
            raise CallError(f"{problem} (docs/fp8.md, 'Block scales')")
    tensors = [("a", a), ("b", b)] + [(p.label, operands[p.name])
                                      for p in plan.inputs if p.kind not in ("arg", "literal")]
    tensors += [(f"out[{i}]", t) for i, t in enumerate(outs)]
    for name, t in tensors:
        check_device(name, t, device)
    refuse_empty_extremes(plan, sizes["M"], sizes["N"], sizes["L"])


def refuse_empty_extremes(plan, m: int, n: int, batches: int) -> None:
    """Raise a CallError where a max or min reduction of the epilogue would run over no elements
    (M, N or the batch is 0 along a reduced dim): it has no value there, and torch raises too.
    Checked only for empty problems (the kernel path) and on the slow path, so calls pay nothing."""
    sizes = {"L": batches, "M": m, "N": n}
    for r in plan.reductions:
        if r.op not in ("max", "min"):
            continue
        empty = [d for d in ("L", "M", "N") if d not in r.dims and sizes[d] == 0]
        if empty:
            what = {"max": "amax/max", "min": "amin/min"}[r.op]
            extents = ", ".join(f"{d} = {sizes[d]}" for d in ("L", "M", "N"))
            raise CallError(f"{plan.name!r} takes the {what} of the accumulator over an empty "
                            f"{' and '.join(empty)} ({extents}): "
                            "a maximum or minimum of no elements has no value (torch raises here "
                            "too); give the call at least one row and column, or reduce with sum")
