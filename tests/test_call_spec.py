"""CPU: what a kernel prepares once for its calls (evtc.runtime.call_spec.CallSpec): a gated call's
halves, how the outputs come back in the epilogue's structure, their shapes and layouts."""

from __future__ import annotations

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


def test_a_gated_call_splits_b_and_wide_operands_into_views(tmp_path):
    k = _compile(swiglu_bias, tmp_path, bias=torch.empty(256, dtype=torch.float16, device="meta"))
    spec = k.call_spec
    b = torch.randn(256, 128, dtype=torch.float16).t()  # (K, N), K-major like nn.Linear's weight
    bias = torch.randn(256, dtype=torch.float16)
    (gate, up), args = spec.split(b, {"bias": bias})
    assert torch.equal(gate, b[:, :128]) and torch.equal(up, b[:, 128:])
    assert gate.data_ptr() == b.data_ptr()
    assert up.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    halves = sorted(args.values(), key=lambda t: t.data_ptr())
    assert [h.data_ptr() for h in halves] == [bias.data_ptr(), bias[128:].data_ptr()]
    assert all(torch.equal(h, want) for h, want in zip(halves, (bias[:128], bias[128:]), strict=True))
    # Anything but a plain call goes to the slow path, which names the problem.
    with pytest.raises(NotPlainGated):
        spec.split(torch.randn(128, 255, dtype=torch.float16), {"bias": bias})
    with pytest.raises(NotPlainGated):
        spec.split(b, {"bias": bias[:128]})
    with pytest.raises(NotPlainGated):
        spec.split(b, {"bias": bias, "other": bias})


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
