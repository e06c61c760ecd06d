"""Which out= tensors the kernel must not write in place (evtc.runtime.out_aliasing.unaliased): those
whose memory overlaps a or b, or part of an operand. The GPU behaviour: tests/test_call_paths_gpu.py
(test_out_overlapping_an_input_is_not_a_race)."""

from __future__ import annotations

import torch

from evtc.runtime.out_aliasing import unaliased


def test_outputs_over_gemm_inputs_or_part_of_an_operand_are_redirected():
    a, b, C = torch.randn(8, 8), torch.randn(8, 8), torch.randn(8, 8)
    big = torch.randn(9, 8)
    out = torch.empty(8, 8)
    assert unaliased([out], (a, b), [C, 1.0]) == [out]  # separate storages: in place
    assert unaliased([C], (a, b), [C])[0] is C  # exactly the operand's view: in place
    for target, operands in ((a, [C]), (b, [C]), (big[1:], [big[:8]]), (C.t(), [C])):
        (fresh,) = unaliased([target], (a, b), operands)
        assert fresh is not target and fresh.shape == target.shape and fresh.dtype == target.dtype
        assert fresh.untyped_storage().data_ptr() != target.untyped_storage().data_ptr()
    # Interleaved views of one buffer whose spans overlap are redirected too (conservative).
    wide = torch.randn(8, 16)
    (fresh,) = unaliased([wide[:, ::2]], (a, b), [wide[:, 1::2]])
    assert fresh.untyped_storage().data_ptr() != wide.untyped_storage().data_ptr()
    # Disjoint halves of one buffer stay in place.
    assert unaliased([wide[:4]], (a, b), [wide[4:]])[0].data_ptr() == wide[:4].data_ptr()
