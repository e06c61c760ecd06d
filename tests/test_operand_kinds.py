"""The operand-kind registry (evtc.plan.operand_kinds) against the parts of evtc that read it: the
IR's kinds, the frontend's inference from example shapes, the generated operand classes and the
kernel views."""

from __future__ import annotations

import pytest
import torch

import evtc
import evtc.sm90  # noqa: F401 - the device classes must exist (imports the DSL)
from evtc.ir.graph import OPERAND_KINDS
from evtc.plan.operand_kinds import KINDS, TENSOR_KINDS, kind_of


def test_the_registry_covers_the_ir_kinds_and_the_runtime_arguments():
    assert TENSOR_KINDS == OPERAND_KINDS
    assert set(KINDS) == {*OPERAND_KINDS, "arg", "literal"}
    assert [k for k in KINDS if KINDS[k].runtime_scalar] == ["arg", "literal"]
    assert {k for k in KINDS if KINDS[k].staged_load} == {"tile", "row", "col"}
    assert {k for k in KINDS if KINDS[k].uniform} == {"scalar", "arg", "literal"}


def test_every_device_class_exists():
    from evtc.sm90 import operands

    for kind in KINDS.values():
        assert hasattr(operands, kind.device_class), kind


@pytest.mark.parametrize(("varying", "kind"), [
    ({"M", "N"}, "tile"), ({"N"}, "row"), ({"M"}, "col"), (set(), "scalar"), ({"L", "N"}, "row"),
    ({"L"}, "scalar"),
])
def test_kind_of(varying, kind):
    assert kind_of(varying) == kind


def test_example_shapes_trace_back_to_their_kind():
    """An example built with a kind's example_shape is inferred as that kind by the frontend."""
    m, n, k = 48, 80, 32
    for name in TENSOR_KINDS:
        shape = KINDS[name].example_shape(m, n)

        def fn(acc, x):
            return acc + x

        ex = {"a": torch.empty(m, k, dtype=torch.float16, device="meta"),
              "b": torch.empty(k, n, dtype=torch.float16, device="meta"),
              "x": torch.empty(shape, dtype=torch.float32, device="meta")}
        graph = evtc.trace(fn, ex)
        assert graph.operands["x"].kind == name, (name, shape)


def test_generated_operands_use_the_registrys_classes(tmp_path):
    def every_kind(acc, C, bias, rowscale, s, alpha: float):
        return alpha * acc * rowscale + C + bias + s

    m, n, k = 64, 128, 32
    ex = {"a": torch.empty(m, k, dtype=torch.float16, device="meta"),
          "b": torch.empty(k, n, dtype=torch.float16, device="meta"),
          "C": torch.empty(m, n, dtype=torch.float16, device="meta"),
          "bias": torch.empty(n, dtype=torch.float32, device="meta"),
          "rowscale": torch.empty(m, 1, dtype=torch.float32, device="meta"),
          "s": torch.empty(1, dtype=torch.float32, device="meta"), "alpha": 1.0}
    source = evtc.compile(every_kind, ex, arch="sm_90a", cache_dir=tmp_path).source
    for name in ("tile", "row", "col", "scalar", "arg"):
        assert f"{KINDS[name].device_class}(" in source, name
