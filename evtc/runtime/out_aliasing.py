"""out= tensors the kernel may not write in place.

A tile's outputs are stored while other CTAs may still read the GEMM's inputs (a's rows, b's
columns) and the epilogue's operands: an ``out=`` tensor that overlaps any of them would be a
silent race. Such targets get a fresh tensor for the launch, copied into the target after it.
"""

from __future__ import annotations

import torch


def _memory_span(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, last byte + 1) of ``t``'s elements (non-negative strides, as torch's)."""
    start = t.data_ptr()
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return start, start + (last + 1) * t.element_size()


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
    spans = [(t, _memory_span(t), gemm) for t, gemm in shared if t.numel()]
    outs = []
    for target in targets:
        fresh = target
        if target.numel():
            lo, hi = _memory_span(target)
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


__all__ = ["unaliased"]
