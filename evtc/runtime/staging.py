"""Tensors the kernel cannot take as they are: aligned copies in, compact copies out.

The kernel reads and writes every tile through TMA, which needs the layout it was compiled for
(which dim has unit stride) and 16-byte multiples for every other stride and for the base address.
``torch.matmul`` takes any layout, so a call whose tensors break those rules is not refused: each
such input is copied into a fresh tensor of the compiled layout whose row pitch is rounded up to 16
bytes (the logical shape is unchanged, so TMA still sees the true extents and fills past them with
zeros), and each such output is written to a padded buffer first and then copied into a compact
tensor, the contiguous result ``torch.matmul`` would give. Tensors that already fit pass through
untouched: the fast path never comes here.
"""

from __future__ import annotations

import torch

from evtc.plan.tensor_spec import TMA_ALIGN


def _align_elems(t_or_dtype) -> int:
    dtype = t_or_dtype.dtype if isinstance(t_or_dtype, torch.Tensor) else t_or_dtype
    return max(1, TMA_ALIGN // dtype.itemsize)


def layout_problem(t: torch.Tensor, spec) -> str | None:
    """Why ``t`` cannot go to the kernel as it is (the layout of ``spec``), or None when it can.

    The rules are the ones the compiled function checks: stride 1 along ``spec.contiguous``, every
    other stride (of a dim that is not a broadcast "1") a multiple of 16 bytes, each for dims of
    more than one element, and a 16-byte aligned base address. A one-element-per-batch scalar needs
    none of them (it is read by plain loads).
    """
    c = spec.contiguous
    if c is None:
        return None
    # A dim of extent 1 is never stepped along: its stride does not matter (the compiled function
    # and call_checks.check_tensor skip it too).
    shape, strides = t.shape, t.stride()
    if strides[c] != 1 and shape[c] > 1:
        return f"{t.dim()}-d with strides {tuple(strides)}: not contiguous along {spec.dims[c]}"
    align = _align_elems(t)
    for i, d in enumerate(spec.dims):
        if i != c and d != "1" and shape[i] > 1 and strides[i] % align:
            return (f"stride {strides[i]} along {d} is not a multiple of {align} elements "
                    f"(16 bytes)")
    if t.data_ptr() % TMA_ALIGN:
        return f"its data pointer is not 16-byte aligned (storage offset {t.storage_offset()})"
    return None


def compact_order(rank: int, contiguous: int | None) -> tuple[list[int], list[int]] | None:
    """How a compact tensor of ``rank`` dims with unit stride along ``contiguous`` is laid out:
    (the dims outermost to innermost, the permutation back), or None when that is row-major."""
    c = contiguous if contiguous is not None else rank - 1
    if c == rank - 1:
        return None
    order = [i for i in range(rank) if i != c] + [c]
    return order, [order.index(i) for i in range(rank)]


def compact_strides(shape: tuple[int, ...], order: list[int] | None = None) -> tuple[int, ...]:
    """The strides of a compact tensor of ``shape`` whose dims lie outermost to innermost in
    ``order`` (row-major when None), as torch computes them: a dim of size 0 counts as 1, so the
    strides equal those of ``torch.empty`` in that order permuted back."""
    dims = range(len(shape)) if order is None else order
    strides = [0] * len(shape)
    step = 1
    for d in reversed(dims):
        strides[d] = step
        step *= max(shape[d], 1)
    return tuple(strides)


def empty_in_layout(shape: tuple[int, ...], dtype: torch.dtype, spec, device) -> torch.Tensor:
    """An uninitialised compact tensor of ``shape`` whose unit-stride dim is ``spec.contiguous``
    (a column-major output is the transpose of a row-major buffer). One ``torch.empty_strided``:
    about a third less host time than ``torch.empty``, and no ``permute``."""
    layout = compact_order(len(shape), spec.contiguous)
    return torch.empty_strided(shape, compact_strides(shape, layout and layout[0]), dtype=dtype,
                               device=device)


def aligned_empty(shape: tuple[int, ...], dtype: torch.dtype, spec, device) -> torch.Tensor:
    """An uninitialised tensor of ``shape`` in the layout of ``spec``: unit stride along
    ``spec.contiguous``, the other dims outside it in their order, the unit-stride dim's pitch
    rounded up to 16 bytes (so every other stride and the base are 16-byte multiples). One
    ``torch.empty_strided`` (an empty buffer, a permute and a narrow cost three times its host time,
    and this runs on decode calls' fast path: ``Kernel._fast_a_scales``)."""
    rank = len(shape)
    c = spec.contiguous if spec.contiguous is not None else rank - 1
    order = [i for i in range(rank) if i != c] + [c]  # outermost to innermost
    align = _align_elems(dtype)
    strides = [0] * rank
    step = 1
    for d in reversed(order):
        strides[d] = step
        extent = max(shape[d], 1)  # a dim of size 0 counts as 1, as torch counts it
        step *= -(-extent // align) * align if d == c else extent
    return torch.empty_strided(shape, strides, dtype=dtype, device=device)


def aligned_copy(t: torch.Tensor, spec) -> torch.Tensor:
    """``t``'s values in a fresh tensor of ``spec``'s layout (see :func:`aligned_empty`)."""
    staged = aligned_empty(tuple(t.shape), t.dtype, spec, t.device)
    staged.copy_(t)
    return staged


def _gated_copy(b: torch.Tensor, spec) -> tuple[torch.Tensor, int]:
    """A gated kernel's whole b (or an operand as wide as the GEMM) copied into the layout of
    ``spec`` with its up half 16-byte aligned: (the copy, where its up half starts, in elements).
    Where the width is the unit-stride dim, the halves go into one buffer of rows 2 x N' long (N'
    the half's width rounded up to 16 bytes), the up half at N'; the copy returned is that
    buffer's first 2 x N columns, so the kernel still reads N (half its width) for the halves'
    extent."""
    n = b.shape[-1] // 2
    align = spec.align_elems()
    width_dim = b.dim() - 1
    if spec.contiguous != width_dim:
        copy = aligned_copy(b, spec)  # the width's stride is a 16-byte multiple: so is n times it
        return copy, n * copy.stride(-1)
    padded = -(-n // align) * align
    buffer = aligned_empty((*b.shape[:-1], 2 * padded), b.dtype, spec, b.device)
    buffer[..., :n].copy_(b[..., :n])
    buffer[..., padded:padded + n].copy_(b[..., n:])
    return buffer.narrow(-1, 0, 2 * n), padded


def stage_scales(plan, scales: tuple) -> tuple[tuple, list[str]]:
    """Block scales as the kernels of ``plan`` take them: a's 1 x 128 scales M-contiguous with
    16-byte strides (the A/B stages bring them by TMA, ``GemmConfig.stages_a_scales``), copied
    where they are not; b's (and a's 128 x 128 ones, any strides) as they are. Returns (a's, b's)
    and the problems staged, as :func:`stage_call` names them."""
    a_scales, b_scales = scales
    why = layout_problem(a_scales, plan.a_scales)
    if why is None:
        return scales, []
    return (aligned_copy(a_scales, plan.a_scales), b_scales), [f"a's block scales: {why}"]


def stage_call(plan, a, b, up, ins, targets):
    """A call's tensors as the kernel of ``plan`` can take them: aligned copies of the inputs whose
    layout it cannot take, padded buffers for the outputs it cannot write in place (the caller
    copies them into ``targets`` after the launch). A gated kernel's ``b`` is the whole weight and
    ``up`` where its up half starts (None otherwise); a copy of b keeps that half 16-byte aligned,
    and so does a copy of an operand as wide as the GEMM (``ins`` holds it whole, and where its up
    half starts in its up half's place, as :meth:`CallSpec.kernel_operands` gives them).

    Each argument is staged for its own role, with its own layout, even where one tensor is passed
    in several (``k(x, x)``, or b again as an operand). Returns (a, b, up, ins, outs, problems):
    ``problems`` names each tensor staged and why (empty when every tensor fits, and then the
    tensors are returned as they are)."""
    problems: list[str] = []

    def fits(name: str, t, spec) -> bool:
        why = layout_problem(t, spec)
        if why is not None:
            problems.append(f"{name}: {why}")
        return why is None

    if not fits("a", a, plan.a):
        a = aligned_copy(a, plan.a)
    if not fits("b", b, plan.b):
        b, up = _gated_copy(b, plan.b) if plan.gated else (aligned_copy(b, plan.b), up)
    elif plan.gated and up % plan.b.align_elems():
        problems.append(f"b: its up half starts {up} elements in, not a multiple of 16 bytes (each half's "
                        "width must be for a row-major b)")
        b, up = _gated_copy(b, plan.b)
    ins = list(ins)
    # An operand as wide as a gated GEMM: whole in its gate half's place, and where its up half
    # starts in the up half's (evtc.sm90.launch.Launcher): staged like a gated b.
    up_input = {i.user: index for index, i in enumerate(plan.inputs) if i.half == 1}
    for index, kernel_input in enumerate(plan.inputs):
        t = ins[index]
        if not isinstance(t, torch.Tensor):
            continue
        spec = kernel_input.spec
        if kernel_input.half is None:
            if not fits(kernel_input.label, t, spec):
                ins[index] = aligned_copy(t, spec)
            continue
        up_index = up_input[kernel_input.user]
        if not fits(kernel_input.user, t, spec):
            ins[index], ins[up_index] = _gated_copy(t, spec)
        elif ins[up_index] % spec.align_elems():
            problems.append(f"{kernel_input.user}: its up half starts {ins[up_index]} elements in, not a "
                            "multiple of 16 bytes")
            ins[index], ins[up_index] = _gated_copy(t, spec)
    out_names = list(plan.output_order)[:len(plan.outputs)]
    outs = [t if fits(f"output {name!r}", t, spec) else aligned_empty(tuple(t.shape), t.dtype, spec, t.device)
            for name, t, spec in zip(out_names, targets, plan.outputs, strict=True)]
    return a, b, up, ins, outs if problems else targets, problems


__all__ = ["TMA_ALIGN", "aligned_copy", "aligned_empty", "compact_order", "empty_in_layout", "layout_problem",
           "stage_call"]
