"""Which out= tensors the kernel must not write in place (evtc.runtime.out_aliasing.unaliased): those
whose memory overlaps a or b, or part of an operand. The GPU behaviour: tests/test_call_paths_gpu.py
(test_out_overlapping_an_input_is_not_a_race)."""

from __future__ import annotations

import pytest
import torch

import evtc
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
    # Views of one buffer that interleave in address but share no element (side by side columns,
    # alternate columns) stay in place, in a's, b's or an operand's buffer; overlapping ones do not.
    wide = torch.randn(8, 16)
    assert unaliased([wide[:, ::2]], (a, b), [wide[:, 1::2]])[0].data_ptr() == wide.data_ptr()
    assert unaliased([wide[:, 8:]], (a, b), [wide[:, :8]])[0].data_ptr() == wide[:, 8:].data_ptr()
    assert unaliased([wide[:, 8:]], (wide[:, :8], b), [C])[0].data_ptr() == wide[:, 8:].data_ptr()
    (fresh,) = unaliased([wide[:, 4:12]], (a, b), [wide[:, :8]])
    assert fresh.untyped_storage().data_ptr() != wide.untyped_storage().data_ptr()
    # Disjoint halves of one buffer stay in place.
    assert unaliased([wide[:4]], (a, b), [wide[4:]])[0].data_ptr() == wide[:4].data_ptr()


def _addresses(t):
    """Every byte address of ``t``'s elements, by brute force (the independent reference)."""
    grids = torch.meshgrid(*[torch.arange(s) for s in t.shape], indexing="ij")
    index = torch.stack(grids, -1).reshape(-1, t.dim())
    starts = t.data_ptr() + (index * torch.tensor(t.stride())).sum(-1) * t.element_size()
    return {int(s) + i for s in starts for i in range(t.element_size())}


def test_overlap_is_exact():
    from evtc.runtime.out_aliasing import overlap

    buf = torch.zeros(12, 16)
    other = torch.zeros(12, 16)
    half = torch.zeros(12, 16, dtype=torch.float16)
    pairs = [(buf[:, :8], buf[:, 8:]), (buf[:, :8], buf[:, 4:12]), (buf, buf), (buf[:, ::2], buf[:, 1::2]),
             (buf.t(), buf[:, :3]), (buf[:6], buf[6:]), (buf[:, 7:9], buf[:, 8:10]), (buf, other),
             (buf[:, :0], buf), (buf[:1].expand(5, 16), buf[1:]), (buf[:1].expand(5, 16), buf[0, 3:4]),
             (buf.view(-1)[1:144].view(13, 11)[:, :5], buf[:, 8:]),
             (half[:, :8], half.view(-1)[4:].view(-1, 2)), (half[:, 1:2], half[:, :1]),
             (buf.view(torch.float16)[:, :1], buf[:, 1:]), (buf.view(torch.float16)[:, 1:2], buf[:, :1])]
    for x, y in pairs:
        want = bool(_addresses(x) & _addresses(y)) if x.numel() and y.numel() else False
        assert overlap(x, y) == want == overlap(y, x), (x.shape, x.stride(), y.shape, y.stride())


def test_out_beside_grad_inputs_and_host_outputs_on_another_device_are_refused(tmp_path):
    """torch refuses out= when an input requires grad (grad mode on), and an out= on another device
    than the inputs; a reduction's out= is checked for its device too, before anything is written."""
    def with_sums(acc):
        return acc * 2, acc.sum(-1)

    a, b = torch.randn(16, 8), torch.randn(8, 24)
    k = evtc.compile(with_sums, {"a": a.half(), "b": b.half()}, arch="sm_90a", cache_dir=tmp_path)
    a, b = a.half(), b.half()
    out = (torch.empty(16, 24, dtype=torch.float16), torch.empty(16, dtype=torch.float16))
    with pytest.raises(evtc.CallError, match="not differentiable"):
        k(a.clone().requires_grad_(), b, out=out)
    meta_sums = torch.empty(16, dtype=torch.float16, device="meta")
    with pytest.raises(evtc.CallError, match="must share a device"):
        k(a, b, out=(out[0], meta_sums))
    with torch.no_grad():
        got = k(a.clone().requires_grad_(), b, out=out)
    assert got[0] is out[0] and got[1] is out[1]
    torch.testing.assert_close(out[1].float(), (a.float() @ b.float()).sum(-1), rtol=2e-3, atol=2e-2)


def test_memory_reached_through_another_storage_is_judged_by_address(tmp_path):
    """A tensor brought back through DLPack is a storage of its own over the same bytes: out= over
    it is still redirected, two such targets are still refused, and overlap() says so."""
    from evtc.runtime.out_aliasing import overlap

    big = torch.randn(12, 8)
    alias = torch.from_dlpack(big[4:])
    assert alias.untyped_storage().data_ptr() != big.untyped_storage().data_ptr()  # the premise
    assert alias.data_ptr() == big[4:].data_ptr()
    assert overlap(alias, big[:8]) and overlap(big[:8], alias)
    assert not overlap(alias, big[:4])
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    (fresh,) = unaliased([alias], (a, b), [big[:8]])
    assert fresh is not alias and fresh.data_ptr() != alias.data_ptr()
    assert unaliased([torch.from_dlpack(big[:4])], (a, b), [big[4:]])[0].data_ptr() == big.data_ptr()

    def two(acc, C):
        return acc + C, acc * 2

    A, B, C = torch.randn(8, 16), torch.randn(16, 8), torch.randn(8, 8)
    k = evtc.compile(two, {"a": A, "b": B, "C": C}, cache_dir=tmp_path)
    kept = big.clone()
    with pytest.raises(evtc.CallError, match="share memory"):
        k(A, B, C=C, out=(big[:8], alias))
    assert torch.equal(big, kept)  # refused before anything was written
