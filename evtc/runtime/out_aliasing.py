"""Tensors that share memory: out= tensors the kernel may not write in place, and results that
must be tensors of their own.

A tile's outputs are stored while other CTAs may still read the GEMM's inputs (a's rows, b's
columns) and the epilogue's operands: an ``out=`` tensor that overlaps any of them would be a
silent race. Such targets get a fresh tensor for the launch, copied into the target after it.
"""

from __future__ import annotations

import torch


def storage_span(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, last byte + 1) of ``t``'s whole storage. Two storages can hold the same memory
    (a tensor brought back through DLPack or ``__cuda_array_interface__`` is a storage of its own
    over another's bytes), so sharing memory is a question of addresses, never of storage
    identity."""
    storage = t.untyped_storage()
    start = storage.data_ptr()
    return start, start + storage.nbytes()


def spans_meet(x: tuple[int, int], y: tuple[int, int]) -> bool:
    """Whether two [first, end) byte ranges share a byte."""
    return x[0] < y[1] and y[0] < x[1]


def _memory_span(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, last byte + 1) of ``t``'s elements (non-negative strides, as torch's)."""
    start = t.data_ptr()
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return start, start + (last + 1) * t.element_size()


#: Contiguous pieces of a tensor beyond which :func:`overlap` answers yes without counting
#: (tensors with no contiguous rows in one buffer: never a layout the kernel writes).
_MAX_PIECES = 1 << 22


def _pieces(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``t``'s memory as equally long byte ranges: (their first bytes, their length); a range per
    row where the last dim is contiguous, else per element."""
    size = t.element_size()
    dims = [(n, stride) for n, stride in zip(t.shape, t.stride(), strict=True) if n != 1]
    length = size
    if dims and dims[-1][1] == 1:
        length = dims[-1][0] * size
        dims = dims[:-1]
    # Host arithmetic on addresses: on the CPU whatever torch's default device (a CUDA default
    # would copy to the GPU, which a CUDA graph capture refuses).
    starts = torch.tensor([t.data_ptr()], dtype=torch.int64, device="cpu")
    for n, stride in dims:
        offsets = torch.arange(n, dtype=torch.int64, device="cpu")[None, :] * (stride * size)
        starts = (starts[:, None] + offsets).reshape(-1)
    return starts, length


def overlap(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether two tensors share an element's memory, exactly: side by side views of one buffer
    (its left and right columns) interleave in address but share nothing. Worked out on the host
    from sizes and strides (no device work: it runs under CUDA graph capture too), only where the
    two tensors' spans meet."""
    if x.device != y.device or not x.numel() or not y.numel():
        return False
    if not spans_meet(storage_span(x), storage_span(y)) or not spans_meet(_memory_span(x), _memory_span(y)):
        return False
    (xs, x_len), (ys, y_len) = _pieces(x), _pieces(y)
    if xs.numel() > _MAX_PIECES or ys.numel() > _MAX_PIECES:
        return True
    ys = ys.sort().values
    # For each piece of x, the piece of y that starts last before x's piece ends: the one that
    # reaches furthest (they are equally long), so it meets x's piece if any does.
    last = torch.searchsorted(ys, xs + x_len, side="left") - 1
    found = last >= 0
    return bool((ys[last.clamp_min(0)][found] + y_len > xs[found]).any())


def unaliased(targets: list, gemm_inputs, operands) -> list:
    """``targets`` (the out= tensors of full-tile outputs), each replaced by a new tensor where its
    memory overlaps ``a``'s or ``b``'s (``gemm_inputs``), or an operand's other than as the very
    same view: other CTAs may still read those (a's rows, b's columns, a shifted operand) while a
    tile's outputs are stored, a silent race. A tile output written over exactly the operand it is
    computed from is safe (each element is read before it is written, by the same CTA) and stays
    in place. The caller copies the new tensors into ``targets`` after the launch."""
    # Tensors whose storages hold other memory cannot overlap (the common case: a cheap comparison
    # of address ranges each, every span computed once).
    storages = [storage_span(target) for target in targets if target.numel()]
    shared = []
    for group, gemm in ((gemm_inputs, True), (operands, False)):
        for t in group:
            if isinstance(t, torch.Tensor) and t.numel():
                lo, hi = storage_span(t)
                for s_lo, s_hi in storages:  # spans_meet, written out: this runs per out= call
                    if lo < s_hi and s_lo < hi:
                        shared.append((t, gemm))
                        break
    if not shared:
        return targets
    spans = [(t, _memory_span(t), gemm) for t, gemm in shared]
    outs = []
    for target in targets:
        fresh = target
        if target.numel():
            lo, hi = _memory_span(target)
            for t, span, gemm in spans:
                if t.device != target.device or not spans_meet(span, (lo, hi)) or not overlap(t, target):
                    continue  # side by side in one buffer (C's columns and out='s) is not a race
                same_view = (t.data_ptr() == target.data_ptr() and t.shape == target.shape
                             and t.stride() == target.stride() and t.dtype == target.dtype)
                if gemm or not same_view:
                    fresh = torch.empty_like(target)
                    break
        outs.append(fresh)
    return outs


def distinct_outputs(outs, inputs=()) -> list:
    """``outs`` with each tensor that shares storage with one of ``inputs`` or an earlier output
    replaced by a copy (None passes). An operator's outputs must be fresh tensors: the compiler may
    reuse or update the buffer of one in place while another view of it lives; and autograd
    accumulates into a gradient in place. Reductions the kernel finished come from one allocation;
    the torch path may return an operand as it is, or one tensor twice; a residual's gradient is
    the incoming gradient itself. Fake tensors (torch.compile's tracing) have no memory: their
    aliasing is the compiler's."""
    seen = {_storage(t) for t in inputs if isinstance(t, torch.Tensor)} - {None}
    fresh = []
    for t in outs:
        if isinstance(t, torch.Tensor):
            storage = _storage(t)
            if storage is not None and storage in seen:
                t = t.clone()
                storage = _storage(t)
            seen.add(storage)
        fresh.append(t)
    return fresh


def _storage(t: torch.Tensor) -> int | None:
    """Where ``t``'s storage starts, or None for no memory (no elements, a fake tensor)."""
    if not t.numel():
        return None
    try:
        return t.untyped_storage().data_ptr() or None
    except RuntimeError:  # a fake tensor has no data
        return None


__all__ = ["distinct_outputs", "overlap", "spans_meet", "storage_span", "unaliased"]
