"""CPU: which reductions the kernel finishes itself (evtc.codegen.emit's finish methods), and the
finish methods it writes, on traced graphs (no CuTe DSL). The GPU side is
tests/test_kernel_finish_gpu.py."""

from __future__ import annotations

import pytest
import torch

import evtc
from evtc.codegen.emit import emit


def _emitted(fn, batched=False, **operands):
    lead = (2,) if batched else ()
    ex = {"a": torch.empty(*lead, 64, 32, dtype=torch.float16, device="meta"),
          "b": torch.empty(*lead, 32, 48, dtype=torch.float16, device="meta"), **operands}
    return emit(evtc.trace(fn, ex))


def row_sum(acc):
    return acc, acc.sum(-1)


def column_min_keepdim(acc):
    return acc.amin(-2, keepdim=True)


def rms(acc, eps: float):
    return torch.sqrt((acc * acc).mean(-1) + eps)


def scaled_by_device_scalar(acc, s):
    return acc, acc.sum(-1) * s


def batched_rows(acc):
    return acc, acc.sum(-1), acc.amax(-2)


def over_everything(acc):
    return acc, acc.abs().amax()


def per_batch(acc):
    return acc, acc.sum((-2, -1))


def row_and_everything(acc):
    return acc, acc.sum(-1), acc.amax()


def rms_over_everything(acc, eps: float):
    return acc, torch.sqrt((acc * acc).mean() + eps).to(torch.bfloat16)


def batch_and_everything(acc):
    return acc, acc.sum((-2, -1)), acc.amax()


def row_over_everything(acc):
    return acc, acc.sum(-1) / acc.abs().amax()  # one output from two axes


def float8_row_max(acc):
    return acc, acc.amax(-1).to(torch.float8_e4m3fn)


def boolean_row_test(acc):
    return acc, (acc.sum(-1) > 0).float()


def boolean_row_mask(acc):
    return acc, acc.sum(-1) > 0  # a bool output, as torch's: its bytes stored by the finish


SCALAR = torch.empty((), device="meta")


@pytest.mark.parametrize("fn, operands, batched, axes", [
    (row_sum, {}, False, {"row": ["D1"]}),
    (column_min_keepdim, {}, False, {"col": ["D"]}),
    (rms, {"eps": 1e-6}, False, {"row": ["D"]}),
    (scaled_by_device_scalar, {"s": SCALAR}, False, {"row": ["D1"]}),
    (batched_rows, {}, True, {"row": ["D1"], "col": ["D2"]}),
    (over_everything, {}, False, {"all": ["D1"]}),
    (rms_over_everything, {"eps": 1e-6}, True, {"all": ["D1"]}),
    (per_batch, {}, True, {"batch": ["D1"]}),
    (row_and_everything, {}, False, {"row": ["D1"], "all": ["D2"]}),
    (batch_and_everything, {}, True, {"batch": ["D1"], "all": ["D2"]}),
    (row_over_everything, {}, False, {}),  # all or nothing: one host finish for every output
    (float8_row_max, {}, False, {}),
    (boolean_row_test, {}, False, {"row": ["D1"]}),  # a comparison, stored as float32
    (boolean_row_mask, {}, False, {"row": ["D1"]}),
], ids=lambda v: getattr(v, "__name__", None))
def test_what_the_kernel_finishes(fn, operands, batched, axes):
    emitted = _emitted(fn, batched, **operands)
    assert {f.axis: f.outputs for f in emitted.finishes} == axes
    for f in emitted.finishes:
        assert f"def {f.method}(self" in emitted.source


def test_the_finish_method_reads_per_tile_values_and_size_literals():
    emitted = _emitted(rms, eps=1e-6)
    (finish,) = emitted.finishes
    assert finish.reductions == ["r0"]
    # eps is an argument; 1/N of the mean a literal the host computes per call
    assert finish.params[0] == "eps" and finish.params[1].startswith("size_")
    body = emitted.source[emitted.source.index("def finish_rows"):]
    assert "op.sqrt(" in body and "+ eps" in body
    assert "KernelFinish('row', 'finish_rows', ('r0',), ('eps', " in emitted.source


def test_a_comparison_is_stored_as_a_float():
    body = _emitted(boolean_row_test).source.split("def finish_rows")[1]
    assert "op.mask_to_float(" in body


def test_a_mask_is_finished_as_its_bytes():
    """A bool output of a finish (a comparison of a row's sum) is stored as the bytes 0 and 1."""
    body = _emitted(boolean_row_mask).source.split("def finish_rows")[1]
    assert "op.mask_to_byte(" in body


def test_a_user_operand_named_like_a_reduction_keeps_its_name():
    def uses_r0(acc, r0):
        return acc + r0, (acc * r0).sum(-1)

    emitted = _emitted(uses_r0, r0=torch.empty(48, device="meta"))
    assert [p.ident for p in emitted.inputs] == ["r0"]
    assert [r.ident for r in emitted.reductions] == ["r0_"]
    assert emitted.finishes[0].reductions == ["r0_"]
