"""CPU: what a kernel prepares once for its calls (evtc.runtime.call_spec.CallSpec): a gated call's
halves, how the outputs come back in the epilogue's structure, their shapes and layouts."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import evtc
from evtc.runtime.call_spec import LITERAL, SCALAR, TENSOR, NotPlainGated

A = torch.empty(64, 128, dtype=torch.float16, device="meta")
B = torch.empty(256, 128, dtype=torch.float16, device="meta").t()


def _compile(fn, tmp_path, **operands):
    return evtc.compile(fn, {"a": A, "b": B, **operands}, arch="sm_90a", cache_dir=tmp_path)


def swiglu_bias(acc, bias):
    gate, up = (acc + bias).chunk(2, dim=-1)
    return F.silu(gate) * up


def test_a_gated_call_passes_b_and_wide_operands_whole(tmp_path):
    k = _compile(swiglu_bias, tmp_path, bias=torch.empty(256, dtype=torch.float16, device="meta"))
    spec = k.call_spec
    b = torch.randn(256, 128, dtype=torch.float16).t()  # (K, N), K-major like nn.Linear's weight
    bias = torch.randn(256, dtype=torch.float16)
    whole, up, args = spec.split(b, {"bias": bias})
    # b goes whole; its up half starts N/2 columns in (each column is a K-long row here).
    assert whole is b and up == 128 * b.stride(-1)
    up_half = torch.as_strided(b, (128, 128), b.stride(), b.storage_offset() + up)
    assert torch.equal(up_half, b[:, 128:])
    # The wide bias too: whole in its gate half's place, where its up half starts in the other's.
    gate_name, up_name = (i.name for i in k.plan.inputs if i.user == "bias")
    assert args[gate_name] is bias and args[up_name] == 128
    # The slow path's checks still see the halves.
    (b_gate, b_up), checked = spec.kernel_arguments(b, {"bias": bias})
    assert torch.equal(b_up, b[:, 128:]) and torch.equal(checked[up_name], bias[128:])
    assert checked[gate_name].data_ptr() == bias.data_ptr() and checked[gate_name].shape == (128,)
    # A wide operand whose up half is off 16 bytes (a row-major C of 2 x 44 columns) is staged.
    C = torch.randn(64, 88, dtype=torch.float16)
    with pytest.raises(NotPlainGated):
        spec.kernel_operands({"bias": C[0]})
    assert spec.kernel_operands({"bias": C[0]}, staging=True)[up_name] == 44
    # Anything but a plain call goes to the slow path, which names the problem.
    with pytest.raises(NotPlainGated):
        spec.split(torch.randn(128, 255, dtype=torch.float16), {"bias": bias})
    with pytest.raises(NotPlainGated):
        spec.split(b, {"bias": bias[:128]})
    with pytest.raises(NotPlainGated):
        spec.split(b, {"bias": bias, "other": bias})


def swiglu(acc):
    gate, up = acc.chunk(2, dim=-1)
    return F.silu(gate) * up


def test_an_up_half_off_16_bytes_is_staged_with_its_halves_aligned(tmp_path):
    """A row-major b whose halves are not 16-byte multiples wide: the fast path refuses it, and the
    staged copy puts the up half on a 16-byte boundary with the same values."""
    from evtc.runtime.staging import stage_call

    b_rows = torch.empty(128, 256, dtype=torch.float16, device="meta")  # row-major (K, N)
    k = evtc.compile(swiglu, {"a": A, "b": b_rows}, arch="sm_90a", cache_dir=tmp_path)
    spec = k.call_spec
    b = torch.randn(128, 2 * 44, dtype=torch.float16)  # halves of 44 columns: 88 bytes
    with pytest.raises(NotPlainGated):
        spec.split(b, {})
    assert spec.split(b, {}, staging=True)[:2] == (b, 44)  # the staged path aligns it
    a = torch.randn(64, 128, dtype=torch.float16)
    out = torch.empty(64, 44, dtype=torch.float16)
    _, staged, up, _, _, problems = stage_call(k.plan, a, b, 44, [], [out])
    assert any("up half" in p for p in problems)
    assert up % 8 == 0 and staged.data_ptr() % 16 == 0 and staged.shape == b.shape
    # The kernel reads the up half where the offset says (past the copy's logical columns).
    up_half = torch.as_strided(staged, (128, 44), staged.stride(), staged.storage_offset() + up)
    assert torch.equal(staged[:, :44], b[:, :44]) and torch.equal(up_half, b[:, 44:])
    # A K-major b of the same widths keeps its halves aligned by its row pitch: nothing to stage.
    k_major = torch.randn(88, 128, dtype=torch.float16).t()
    assert 44 * k_major.stride(-1) % 8 == 0


def swiglu_residual(acc, C):
    gate, up = (acc + C).chunk(2, dim=-1)
    return F.silu(gate) * up


def test_a_wide_operand_off_16_bytes_is_staged_whole_with_its_up_half_aligned(tmp_path):
    """A wide tile operand (M x 2N, row-major) whose halves are 44 columns (88 bytes): the staged
    path copies it whole with its up half on a 16-byte boundary, and gives that offset in the up
    half's place; an M-major one keeps its halves aligned by its pitch and is passed as it is."""
    from evtc.runtime.staging import stage_call

    b_rows = torch.empty(128, 256, dtype=torch.float16, device="meta")
    k = evtc.compile(swiglu_residual, {"a": A, "b": b_rows, "C": torch.empty(64, 256, dtype=torch.float16,
                                                                            device="meta")},
                     arch="sm_90a", cache_dir=tmp_path)
    spec = k.call_spec
    gate_index, up_index = (i for i, ki in enumerate(k.plan.inputs) if ki.user == "C")
    a = torch.randn(64, 128, dtype=torch.float16)
    b = torch.randn(128, 2 * 48, dtype=torch.float16)  # b's halves are aligned (48 columns)
    C = torch.randn(64, 2 * 44, dtype=torch.float16)
    b88 = torch.randn(88, 128, dtype=torch.float16).t()  # K-major: b's own up half is aligned
    with pytest.raises(NotPlainGated, match="C's up half"):
        spec.split(b88, {"C": C})
    _, up_b, ops = spec.split(b88, {"C": C}, staging=True)
    ins = spec.inputs(ops, 64, 44, 1)
    assert ins[gate_index] is C and ins[up_index] == 44
    out = torch.empty(64, 44, dtype=torch.float16)
    _, _, _, staged_ins, _, problems = stage_call(k.plan, a, b88, up_b, ins, [out])
    assert any(p.startswith("C: its up half starts 44") for p in problems), problems
    staged, up = staged_ins[gate_index], staged_ins[up_index]
    assert up % 8 == 0 and staged.data_ptr() % 16 == 0 and staged.shape == C.shape
    up_half = torch.as_strided(staged, (64, 44), staged.stride(), staged.storage_offset() + up)
    assert torch.equal(staged[:, :44], C[:, :44]) and torch.equal(up_half, C[:, 44:])
    # An M-major C: each column is an M-long run, so the up half starts 48 x M elements in, a
    # 16-byte multiple whatever the width: the fast path takes it whole.
    C_m = torch.randn(96, 64, dtype=torch.float16).t()
    _, _, ops = spec.split(b, {"C": C_m})
    assert ops[k.plan.inputs[gate_index].name] is C_m and ops[k.plan.inputs[up_index].name] == 48 * 64


def outputs_out_of_kernel_order(acc):
    y = acc * 0.5
    return y.sum(-1), y, torch.relu(y).to(torch.bfloat16)


def test_outputs_come_back_in_the_epilogues_order(tmp_path):
    """The kernel orders its outputs (full tiles first, then reductions); the call returns them as
    the function does."""
    k = _compile(outputs_out_of_kernel_order, tmp_path)
    spec = k.call_spec
    assert spec.kernel_order[-1] == spec.plan.structure.names[0]  # the reduction is stored last
    by_name = {name: torch.full((1,), float(i)) for i, name in enumerate(spec.kernel_order)}
    result = spec.result([by_name[name] for name in spec.kernel_order])
    assert isinstance(result, tuple) and len(result) == 3
    assert [r.item() for r in result] == [by_name[name].item() for name in spec.plan.structure.names]
    # Shapes and dtypes per output, in kernel order, as the reference computes them.
    want = outputs_out_of_kernel_order(torch.randn(64, 256))
    meta = dict(zip(spec.kernel_order, spec.output_meta(64, 256, 1), strict=True))
    for name, ref in zip(spec.plan.structure.names, want, strict=True):
        assert meta[name][0] == tuple(ref.shape), name


def dict_result(acc, bias):
    pre = acc + bias
    return {"out": F.gelu(pre), "pre": pre}


def test_a_dict_result_keeps_its_keys(tmp_path):
    k = _compile(dict_result, tmp_path, bias=torch.empty(256, dtype=torch.float16, device="meta"))
    spec = k.call_spec
    values = [torch.full((1,), float(i)) for i in range(len(spec.kernel_order))]
    result = spec.result(values)
    assert set(result) == {"out", "pre"}
    for name, value in zip(spec.kernel_order, values, strict=True):
        key = spec.plan.structure.keys[spec.plan.structure.names.index(name)]
        assert result[key] is value


def scaled(acc, alpha: float):
    return acc * alpha + acc.shape[-1]


def test_inputs_are_found_by_kind(tmp_path):
    k = _compile(scaled, tmp_path, alpha=0.5)
    spec = k.call_spec
    kinds = [kind for kind, _ in spec.getters]
    assert SCALAR in kinds and all(kind in (TENSOR, SCALAR, LITERAL) for kind in kinds)
    values = spec.inputs({"alpha": 2}, 64, 256, 1)
    assert 2.0 in values and all(isinstance(v, float) for v in values)
    if LITERAL in kinds:  # the output's width, computed from the call's sizes
        assert 256.0 in values


def test_new_outputs_follow_the_compiled_layout(tmp_path):
    k = _compile(dict_result, tmp_path, bias=torch.empty(256, dtype=torch.float16, device="meta"))
    outs = k.call_spec.new_outputs(torch.device("cpu"), 64, 256, 1)
    assert len(outs) == 2 and all(o.shape == (64, 256) and o.is_contiguous() for o in outs)


@pytest.mark.parametrize("shape", [(64, 256), (1, 256), (64, 1), (0, 256), (64, 0), (0, 0), (3, 64, 256),
                                   (1, 1, 8), (2, 0, 8), (2, 8, 0)])
def test_compact_strides_are_torchs(shape):
    """Outputs are made by one torch.empty_strided with strides computed here: for every order of
    the dims (row-major, and the unit-stride dim elsewhere), sizes of 0 and 1 included, they equal
    torch.empty's in that order permuted back, so the outputs are the tensors they were."""
    from evtc.runtime.staging import compact_order, compact_strides

    for contiguous in range(len(shape)):
        layout = compact_order(len(shape), contiguous)
        if layout is None:
            want = torch.empty(shape)
        else:
            order, inverse = layout
            want = torch.empty([shape[i] for i in order]).permute(inverse)
        got = torch.empty_strided(shape, compact_strides(shape, layout and layout[0]))
        assert got.stride() == want.stride() and got.is_contiguous() == want.is_contiguous(), contiguous


@pytest.mark.parametrize("m,n,batches", [(64, 256, 1), (0, 256, 1), (64, 8, 3), (1, 8, 2), (5, 0, 2)])
def test_new_outputs_strides_in_each_layout(tmp_path, m, n, batches):
    """Row-major and column-major (D by M) outputs, batched or not, sizes of 0 and 1 included."""
    for batched in (False, True):
        lead = (batches,) if batched else ()
        a = torch.empty(*lead, 64, 128, dtype=torch.float16, device="meta")
        b = torch.empty(*lead, 256, 128, dtype=torch.float16, device="meta").transpose(-1, -2)
        for out_major in ("n", "m"):
            k = evtc.compile(lambda acc: acc * 2.0, {"a": a, "b": b}, config={"d_major": out_major},
                             arch="sm_90a", cache_dir=tmp_path)
            (out,) = k.call_spec.new_outputs(torch.device("cpu"), m, n, batches)
            shape = (batches, m, n) if batched else (m, n)
            assert k.plan.d_major == out_major
            # torch.empty in the physical order, viewed back (how outputs were made before).
            physical = shape if out_major == "n" else (*shape[:-2], n, m)
            want = torch.empty(physical) if out_major == "n" else torch.empty(physical).transpose(-1, -2)
            assert out.shape == shape and out.stride() == want.stride(), (batched, out_major)


def test_one_tensor_in_two_roles_is_staged_for_each(tmp_path):
    """``k(x, x)`` with a K-major b: a and b are one tensor, which fits neither role as it is; each
    role gets a copy in its own layout (a contiguous along K, b's up half aligned)."""
    from evtc.runtime.staging import stage_call

    k = evtc.compile(swiglu, {"a": A, "b": B}, arch="sm_90a", cache_dir=tmp_path)  # b K-major
    x = torch.randn(128, 136, dtype=torch.float16)[:, :128]  # row pitch 136: fine for a, not for b
    out = torch.empty(128, 64, dtype=torch.float16)
    a2, b2, up, _, outs, problems = stage_call(k.plan, x, x, 64 * x.stride(-1), [], [out])
    assert a2 is x  # a is K-contiguous with a 16-byte pitch: not copied
    assert b2 is not x and b2.stride(-2) == 1 and up % 8 == 0 and problems and problems[0].startswith("b:")
    assert torch.equal(b2[:, :64], x[:, :64])
    up_half = torch.as_strided(b2, (128, 64), b2.stride(), b2.storage_offset() + up)
    assert torch.equal(up_half, x[:, 64:]) and outs == [out]


def scaled_identity(acc):
    return acc * 2.0


def test_out_beside_inputs_that_need_grad_is_refused(tmp_path):
    """out= with inputs that need grad is refused in grad mode, right or wrong, as torch refuses it
    (the write is not differentiable); under no_grad it is written."""
    k = _compile(scaled_identity, tmp_path)
    a = torch.randn(64, 128, dtype=torch.float16, requires_grad=True)
    b = torch.randn(256, 128, dtype=torch.float16).t()
    for wrong in (torch.empty(64, 1, dtype=torch.float16), torch.empty(64, 256, dtype=torch.float32)):
        with pytest.raises(evtc.CallError, match="out"):
            k(a, b, out=wrong)
    out = torch.empty(64, 256, dtype=torch.float16)
    with pytest.raises(evtc.CallError, match="not differentiable"):
        k(a, b, out=out)  # a right out= too: as torch.matmul(a, b, out=out) refuses
    with torch.no_grad():
        got = k(a, b, out=out)
    want = (a.detach().double() @ b.double()) * 2
    assert got is out and torch.allclose(out.double(), want, atol=1e-2, rtol=1e-2)


def test_out_whose_elements_share_memory_is_refused(tmp_path):
    """An expanded out= (stride 0 along M) would take every row's store into one row: refused
    with the reason, on the plain path and the operator path, and left untouched."""
    k = _compile(scaled_identity, tmp_path)
    b = torch.randn(256, 128, dtype=torch.float16).t()
    row = torch.zeros(1, 256, dtype=torch.float16)
    a = torch.randn(64, 128, dtype=torch.float16)
    for grad in (False, True):  # the operator path under no_grad (out= with grad is refused)
        with torch.no_grad() if grad else contextlib.nullcontext():
            with pytest.raises(evtc.CallError, match="share memory.*expanded"):
                k(a.clone().requires_grad_(grad), b, out=row.expand(64, 256))
        assert not row.any()


def test_a_misspelt_argument_is_named_on_the_operator_path(tmp_path):
    """Inputs that need grad take the custom operator, which passes only the epilogue's own
    operands: an argument it does not take must be refused there too, never dropped."""
    k = _compile(swiglu_bias, tmp_path, bias=torch.empty(256, dtype=torch.float16, device="meta"))
    a = torch.randn(64, 128, dtype=torch.float16, requires_grad=True)
    b = torch.randn(256, 128, dtype=torch.float16).t()
    bias = torch.randn(256, dtype=torch.float16)
    with pytest.raises(evtc.CallError, match=r"unexpected argument\(s\) \['bais'\]"):
        k(a, b, bias=bias, bais=bias)
    with pytest.raises(evtc.CallError, match=r"missing argument\(s\) \['bias'\]"):
        k(a, b)
