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


def test_overlap_of_random_views_matches_their_addresses():
    """Random strided views of one buffer (offsets, sizes, strides, some 0, some dims of 1, other
    dtypes over the same bytes), against the brute-force byte sets: both the arithmetic on runs of
    one stride and the run-by-run comparison must be exact, and so must the answers remembered."""
    from evtc.runtime.out_aliasing import _runs, _runs_meet, overlap

    gen = torch.Generator().manual_seed(7)
    buf = torch.zeros(256)

    def rand(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=gen))

    def view():
        base = buf if rand(0, 3) else buf.view(torch.float16)
        dims = rand(1, 4)
        shape = [rand(1, 6) for _ in range(dims)]
        stride = [rand(0, 12) if rand(0, 4) else 1 for _ in range(dims)]
        if rand(0, 2):  # rows of a matrix: a contiguous last dim under one row stride
            stride[-1] = 1
        last = sum((n - 1) * st for n, st in zip(shape, stride, strict=True))
        offset = rand(0, base.numel() - last - 1)
        return base.as_strided(shape, stride, offset)

    meeting = by_arithmetic = 0
    for _ in range(3000):
        x, y = view(), view()
        want = bool(_addresses(x) & _addresses(y))
        assert overlap(x, y) == want == overlap(y, x), (x.shape, x.stride(), y.shape, y.stride())
        # Asked again: the remembered answer (by address, sizes, strides and element size; the
        # float16 views over the same bytes have other keys) is the same.
        assert overlap(x, y) == want == overlap(y, x)
        meeting += want
        runs = _runs(x), _runs(y)
        by_arithmetic += None not in runs and _runs_meet(*runs) is not None
    # Both answers, and both ways of finding them, were exercised.
    assert 100 < meeting < 2900 and 500 < by_arithmetic < 2500, (meeting, by_arithmetic)


def test_overlap_of_the_halves_of_a_wide_output_is_arithmetic(monkeypatch):
    """The halves of one output (a gated backward's two outputs, written side by side) are judged
    without building a run per row: the check costs the same for 8192 rows as for 8."""
    from evtc.runtime import out_aliasing

    def refused(t):
        raise AssertionError("a run per row was built")

    monkeypatch.setattr(out_aliasing, "_pieces", refused)
    wide = torch.empty(8192, 64, dtype=torch.bfloat16)
    assert not out_aliasing.overlap(wide[:, :32], wide[:, 32:])
    assert out_aliasing.overlap(wide[:, :33], wide[:, 32:])
    assert not out_aliasing.overlap(wide[:4096], wide[4096:])
    assert out_aliasing.overlap(wide.view(-1)[64:128].view(1, 64), wide[:, 10:11])  # row 1, column 10
    assert not out_aliasing.overlap(wide[1:, :1], wide[:-1, 63:])  # a row's end beside the next's start
    # The same for a column-major output's halves and blocks (its columns are the runs).
    tall = torch.empty(64, 8192, dtype=torch.bfloat16).t()
    assert not out_aliasing.overlap(tall[:, :32], tall[:, 32:])
    assert not out_aliasing.overlap(tall[:4096], tall[4096:])
    assert out_aliasing.overlap(tall[:4097, 5:6], tall[4096:, 5:6])


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
