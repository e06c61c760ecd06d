"""Mask outputs are bool tensors, as torch returns them (CPU: the plan, the generated source and
the torch path; tests/test_mask_outputs_gpu.py runs the kernels)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import evtc


def gelu_and_mask(acc, bias):
    pre = acc + bias
    return F.gelu(pre), pre > 0


def test_a_returned_mask_is_planned_as_bool_and_written_as_bytes():
    # Integers and a bias between them: no value near 0, so float32 and float64 agree on every sign.
    a, b = torch.randint(-3, 4, (16, 32)).half(), torch.randint(-3, 4, (32, 24)).half()
    bias = (torch.randint(-3, 4, (24,)) + 0.5).half()
    k = evtc.compile(gelu_and_mask, {"a": a, "b": b, "bias": bias})
    assert [s.dtype for s in k.plan.outputs] == ["float16", "bool"]
    assert "op.mask_to_byte(" in k.source  # True written as the float8 value whose byte is 1
    y, mask = k(a, b, bias=bias)
    want_y, want_mask = gelu_and_mask(a.double() @ b.double(), bias.double())
    assert mask.dtype == torch.bool and torch.equal(mask, want_mask)
    torch.testing.assert_close(y.double(), want_y, rtol=2e-3, atol=2e-3)


def test_the_traced_store_of_a_mask_is_bool_for_every_input_dtype():
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        graph = evtc.trace(lambda acc: acc > 0, {"a": torch.randn(8, 16).to(dtype),
                                                 "b": torch.randn(16, 8).to(dtype)})
        assert [s.dtype for s in graph.stores] == [torch.bool]


def test_out_dtypes_bool_reads_a_number_as_torchs_bool():
    """``out_dtypes=torch.bool``: value != 0, NaN included (torch's .bool()); other dtypes that
    are not floats are refused with the list, which names bool."""
    a, b = torch.randint(-3, 4, (8, 16)).float(), torch.randint(-3, 4, (16, 8)).float()
    C = a @ b  # integers: exact in float32 and float64 alike
    C[::2] += 1
    C[1, 0] = float("nan")
    k = evtc.compile(lambda acc, C: acc - C, {"a": a, "b": b, "C": C}, out_dtypes=torch.bool)
    got = k(a, b, C=C)
    want = (a.double() @ b.double() - C.double()).bool()
    assert got.dtype == torch.bool and torch.equal(got, want)
    assert got[1, 0]  # NaN is True
    with pytest.raises(evtc.DTypeError, match="bool"):
        evtc.compile(lambda acc: acc, {"a": a, "b": b}, out_dtypes=torch.int32)


def test_a_mask_output_overridden_to_a_float_is_zero_and_one():
    a, b = torch.randint(-3, 4, (16, 32)).float(), torch.randint(-3, 4, (32, 24)).float()
    bias = torch.randint(-3, 4, (24,)) + 0.5
    k = evtc.compile(gelu_and_mask, {"a": a, "b": b, "bias": bias}, out_dtypes=[torch.float32, torch.float16])
    _, mask = k(a, b, bias=bias)
    want = (a.double() @ b.double() + bias.double() > 0).half()
    assert mask.dtype == torch.float16 and torch.equal(mask, want)


def test_the_operator_gives_bool_outputs_to_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    a, b, bias = torch.randn(16, 32), torch.randn(32, 24), torch.randn(24)
    k = evtc.compile(gelu_and_mask, {"a": a, "b": b, "bias": bias})
    with FakeTensorMode() as mode:
        fa, fb, fbias = (mode.from_tensor(t) for t in (a, b, bias))
        y, mask = k.op(fa, fb, fbias)
    assert y.dtype == torch.float32 and mask.dtype == torch.bool and mask.shape == (16, 24)


def test_out_of_another_dtype_for_a_mask_is_refused():
    a, b, bias = torch.randn(16, 32), torch.randn(32, 24), torch.randn(24)
    k = evtc.compile(gelu_and_mask, {"a": a, "b": b, "bias": bias})
    with pytest.raises(evtc.CallError, match="bool"):
        k(a, b, bias=bias, out=(torch.empty(16, 24), torch.empty(16, 24)))
    out = (torch.empty(16, 24), torch.zeros(16, 24, dtype=torch.bool))
    assert k(a, b, bias=bias, out=out)[1] is out[1]
    assert torch.equal(out[1], a @ b + bias > 0)


def test_bool_casts_are_torchs():
    """``.bool()`` and ``.to(torch.bool)``: a mask as it is, a number as != 0 (NaN is True)."""
    a, b = torch.randint(-3, 4, (8, 16)).float(), torch.randint(-3, 4, (16, 8)).float()
    C = a @ b
    C[::2] += 1
    C[1, 1] = float("nan")
    fns = [lambda acc, C: (acc > C).to(torch.bool), lambda acc, C: (acc - C).bool(),
           lambda acc, C: (acc * C).to(dtype=torch.bool), lambda acc, C: (acc > 0).bool() & (acc - C).bool()]
    for fn in fns:
        k = evtc.compile(fn, {"a": a, "b": b, "C": C})
        got, want = k(a, b, C=C), fn(a.double() @ b.double(), C.double())
        assert [s.dtype for s in k.plan.outputs] == ["bool"]
        assert got.dtype == torch.bool and torch.equal(got, want)
    with pytest.raises(evtc.DTypeError, match="may be cast to .*bool"):
        evtc.trace(lambda acc: acc.to(torch.int32), {"a": a, "b": b})


def test_a_column_major_mask_is_refused_by_name():
    ex = {"a": torch.empty(64, 32, dtype=torch.float16, device="meta"),
          "b": torch.empty(32, 48, dtype=torch.float16, device="meta")}
    with pytest.raises(evtc.CompileError, match="bool output .* is stored row-major"):
        evtc.compile(lambda acc: acc > 0, ex, config={"d_major": "m"}, arch="sm_90a")


def test_bool_of_a_value_reads_it_as_torch_holds_it():
    """``.bool()`` and ``out_dtypes=torch.bool`` of a float16 value: rounded to float16 first, as
    torch holds it (a tiny product underflows to False); of a float8 one: compared exactly."""
    # Integer entries: a @ b is exact, so torch's float16 product and evtc's float32 one agree and
    # only the rounding under test can differ.
    a, b = torch.randint(-3, 4, (16, 32)).half(), torch.randint(-3, 4, (32, 24)).half()
    tiny = evtc.compile(lambda acc: acc * 1e-8, {"a": a, "b": b}, out_dtypes=torch.bool)
    want = (a @ b * 1e-8).bool()
    assert want.any() and not want.all()  # some products underflow in float16, some do not
    assert torch.equal(tiny(a, b), want)
    for fn in (lambda acc: (acc * 1e-8).bool(), lambda acc: (acc * 1e-3).to(torch.float8_e4m3fn).bool()):
        k = evtc.compile(fn, {"a": a, "b": b})
        got, want = k(a, b), fn(a @ b)
        assert want.any() and not want.all()
        assert got.dtype == torch.bool and torch.equal(got, want)


def test_explain_names_a_mask_d_as_bool():
    """A kernel whose D is a mask: explain() names it a bool mask beside the configuration, which
    names the float8 storage its bytes go through (it read as a float8 output before)."""
    a, b = torch.randn(16, 32).half(), torch.randn(32, 24).half()
    text = evtc.compile(lambda acc: acc > 0, {"a": a, "b": b}).explain()
    gemm = next(line for line in text.splitlines() if line.strip().startswith("GEMM:"))
    assert "->e4m3" in gemm and "D is a torch.bool mask" in gemm
    plain = evtc.compile(lambda acc: acc, {"a": a, "b": b}).explain()
    assert "bool mask" not in plain
