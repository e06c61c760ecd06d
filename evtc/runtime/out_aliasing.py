"""Tensors that share memory: out= tensors the kernel may not write in place, and results that
must be tensors of their own.

A tile's outputs are stored while other CTAs may still read the GEMM's inputs (a's rows, b's
columns) and the epilogue's operands: an ``out=`` tensor that overlaps any of them would be a
silent race. Such targets get a fresh tensor for the launch, copied into the target after it.
"""

from __future__ import annotations

import math

import numpy as np
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


def _dims_outermost_first(t: torch.Tensor) -> list[tuple[int, int]]:
    """``t``'s (size, stride) pairs of the dims that reach other addresses (longer than 1, not
    expanded), by stride from the largest: the same addresses in the order that makes a transposed
    view's contiguous dim the last (its columns are runs as a row-major matrix's rows are)."""
    return sorted(((n, stride) for n, stride in zip(t.shape, t.stride(), strict=True) if n != 1 and stride),
                  key=lambda dim: -dim[1])


def _run_dims(t: torch.Tensor) -> tuple[int, list[tuple[int, int]]]:
    """``t``'s memory as contiguous runs: (bytes per run, [(count, byte stride)] of the dims that
    place the runs, outermost first). Contiguous inner dims lengthen the run; a dim that steps over
    exactly the dims inside it merges with them, so a matrix's rows (or a transposed one's columns)
    are one dim of runs however many leading dims they had."""
    size = t.element_size()
    dims = [(n, stride * size) for n, stride in _dims_outermost_first(t)]
    length = size
    while dims and dims[-1][1] == length:  # contiguous dims make the run longer
        length *= dims.pop()[0]
    while len(dims) >= 2 and dims[-2][1] == dims[-1][0] * dims[-1][1]:  # nested dims make one
        (outer, _), (inner, step) = dims[-2], dims[-1]
        dims[-2:] = [(outer * inner, step)]
    return length, dims


def _pieces(t: torch.Tensor) -> tuple[np.ndarray, int] | None:
    """``t``'s memory as equally long byte ranges (:func:`_run_dims`): (their first bytes, their
    length), or None past :data:`_MAX_PIECES` ranges. Host arithmetic in numpy: the same torch CPU
    ops on 8192 row starts took 26 ms a call on the H200 machine's 32-core host, and a CUDA default
    device would copy them to the GPU, which a CUDA graph capture refuses."""
    length, dims = _run_dims(t)
    if math.prod(n for n, _ in dims) > _MAX_PIECES:
        return None
    starts = np.array([t.data_ptr()], dtype=np.int64)
    for n, step in dims:
        starts = (starts[:, None] + np.arange(n, dtype=np.int64)[None, :] * step).reshape(-1)
    return starts, length


def _runs(t: torch.Tensor) -> tuple[int, int, int, int] | None:
    """``t``'s memory as equally long contiguous byte runs at one stride: (first byte, bytes per
    run, runs, bytes from one run's start to the next), or None where it is not (a block of a 3-D
    tensor, say, whose runs need more than one stride)."""
    length, dims = _run_dims(t)
    if len(dims) > 1:
        return None
    runs, step = dims[0] if dims else (1, 0)
    return t.data_ptr(), length, runs, step


def _runs_meet(x: tuple[int, int, int, int], y: tuple[int, int, int, int]) -> bool | None:
    """Whether two sequences of runs (:func:`_runs`) share a byte, by arithmetic on their starts,
    or None where their strides differ. Run i of x and run k of y meet when
    ``-y_len < d + (k - i) * step < x_len`` (d: y's first byte less x's), so they share a byte when
    an integer u = k - i in [1 - x_runs, y_runs - 1] satisfies it."""
    x0, x_len, x_runs, x_step = x
    y0, y_len, y_runs, y_step = y
    if x_runs == 1:
        x_step = y_step
    if y_runs == 1:
        y_step = x_step
    if x_step != y_step:
        return None
    d = y0 - x0
    if x_step == 0:  # every run of each at one place
        return -y_len < d < x_len
    lowest = max((-y_len - d) // x_step + 1, 1 - x_runs)
    highest = min(-((d - x_len) // x_step) - 1, y_runs - 1)
    return lowest <= highest


def overlap(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether two tensors share an element's memory, exactly: side by side views of one buffer
    (its left and right columns) interleave in address but share nothing. Worked out on the host
    from sizes and strides (no device work: it runs under CUDA graph capture too), only where the
    two tensors' spans meet: by arithmetic where each is runs of bytes at one stride (rows of a
    matrix, the halves of a gated output), else run by run."""
    if x.device != y.device or not x.numel() or not y.numel():
        return False
    if not spans_meet(storage_span(x), storage_span(y)):
        return False
    # The answer is a function of the two tensors' addresses, sizes, strides and element sizes only:
    # remembered for the targets a caller passes on every call (dZ's halves of one buffer, as the
    # MLP's backward writes them), where working it out again cost 8 us a call.
    key = (x.data_ptr(), x.shape, x.stride(), x.element_size(), y.data_ptr(), y.shape, y.stride(),
           y.element_size())
    known = _OVERLAPS.get(key)
    if known is None:
        if len(_OVERLAPS) >= _OVERLAPS_KEPT:
            _OVERLAPS.clear()
        known = _OVERLAPS[key] = _overlap_of_meeting_spans(x, y)
    return known


#: Answers of :func:`overlap` by the tensors' geometry; cleared when full.
_OVERLAPS: dict[tuple, bool] = {}
_OVERLAPS_KEPT = 256


def _overlap_of_meeting_spans(x: torch.Tensor, y: torch.Tensor) -> bool:
    """:func:`overlap` of two tensors whose storages' spans meet."""
    if not spans_meet(_memory_span(x), _memory_span(y)):
        return False
    x_runs, y_runs = _runs(x), _runs(y)
    if x_runs is not None and y_runs is not None:
        meet = _runs_meet(x_runs, y_runs)
        if meet is not None:
            return meet
    x_pieces, y_pieces = _pieces(x), _pieces(y)
    if x_pieces is None or y_pieces is None:
        return True
    (xs, x_len), (ys, y_len) = x_pieces, y_pieces
    ys = np.sort(ys)
    # For each piece of x, the piece of y that starts last before x's piece ends: the one that
    # reaches furthest (they are equally long), so it meets x's piece if any does.
    last = np.searchsorted(ys, xs + x_len, side="left") - 1
    found = last >= 0
    return bool((ys[np.maximum(last, 0)][found] + y_len > xs[found]).any())


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
