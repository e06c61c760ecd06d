"""out= tensors the kernel may not write in place.

A tile's outputs are stored while other CTAs may still read the GEMM's inputs (a's rows, b's
columns) and the epilogue's operands: an ``out=`` tensor that overlaps any of them would be a
silent race. Such targets get a fresh tensor for the launch, copied into the target after it.
"""

from __future__ import annotations

import torch


def memory_span(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, last byte + 1) of ``t``'s elements (non-negative strides, as torch's)."""
    start = t.data_ptr()
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return start, start + (last + 1) * t.element_size()


def overlap(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether two tensors share an element's memory, exactly: side by side views of one buffer
    (its left and right columns) interleave in address but share nothing. Where their spans meet,
    each byte of ``x`` is marked in a scratch mask over the spans and ``y``'s bytes are read."""
    if x.device != y.device or not x.numel() or not y.numel():
        return False
    if x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr():
        return False
    (x_lo, x_hi), (y_lo, y_hi) = memory_span(x), memory_span(y)
    if not (x_lo < y_hi and y_lo < x_hi):
        return False
    base = min(x_lo, y_lo)
    mask = torch.zeros(max(x_hi, y_hi) - base, dtype=torch.uint8, device=x.device)

    def bytes_of(t: torch.Tensor) -> torch.Tensor:
        size = t.element_size()
        return mask.as_strided((*t.shape, size), (*(s * size for s in t.stride()), 1), t.data_ptr() - base)

    bytes_of(x).fill_(1)
    return bool(bytes_of(y).any())


def unaliased(targets: list, gemm_inputs, operands) -> list:
    """``targets`` (the out= tensors of full-tile outputs), each replaced by a new tensor where its
    memory overlaps ``a``'s or ``b``'s (``gemm_inputs``), or an operand's other than as the very
    same view: other CTAs may still read those (a's rows, b's columns, a shifted operand) while a
    tile's outputs are stored, a silent race. A tile output written over exactly the operand it is
    computed from is safe (each element is read before it is written, by the same CTA) and stays
    in place. The caller copies the new tensors into ``targets`` after the launch."""
    # Tensors of other storages cannot overlap (the common case: one cheap comparison each).
    storages = {target.untyped_storage().data_ptr() for target in targets}
    shared = [(t, gemm) for group, gemm in ((gemm_inputs, True), (operands, False))
              for t in group if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in storages]
    if not shared:
        return targets
    spans = [(t, memory_span(t), gemm) for t, gemm in shared if t.numel()]
    outs = []
    for target in targets:
        fresh = target
        if target.numel():
            lo, hi = memory_span(target)
            for t, (t_lo, t_hi), gemm in spans:
                if t.device != target.device or not (t_lo < hi and lo < t_hi):
                    continue
                same_view = (t.data_ptr() == target.data_ptr() and t.shape == target.shape
                             and t.stride() == target.stride() and t.dtype == target.dtype)
                if gemm or not same_view:
                    fresh = torch.empty_like(target)
                    break
        outs.append(fresh)
    return outs


__all__ = ["memory_span", "overlap", "unaliased"]
