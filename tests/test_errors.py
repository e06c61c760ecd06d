"""Every user error is a clear evtc.EpilogueError that names the problem and the user's line."""

from __future__ import annotations

import inspect
import re
import traceback

import pytest
import torch
import torch.nn.functional as F
from support import gemm_inputs, rand

import evtc

EX = gemm_inputs(16, 24, 8, None) | {"C": rand(16, 24, seed=1), "bias": rand(24, seed=2)}


def _marked_lines(fn) -> set[int]:
    """The lines of `fn` that carry the comment `# error here`."""
    lines, start = inspect.getsourcelines(fn)
    return {start + offset for offset, line in enumerate(lines) if "# error here" in line}


def _marked_line(fn) -> int:
    (line,) = _marked_lines(fn)
    return line


def _trace_error(fn, inputs, error, exact=False):
    """Trace `fn` expecting `error`; unless `exact`, inputs it has no parameter for are dropped."""
    if not exact:
        params = set(inspect.signature(fn).parameters) | {"a", "b"}
        inputs = {k: v for k, v in inputs.items() if k in params}
    with pytest.raises(error) as info:
        evtc.trace(fn, inputs)
    err = info.value
    assert isinstance(err, evtc.EpilogueError)
    return err


def _assert_points_at_marked_line(err, fn):
    assert err.loc is not None, "the error names no line"
    assert err.loc.filename == __file__
    assert err.loc.lineno == _marked_line(fn), str(err)
    assert f"{__file__}:{err.loc.lineno}" in str(err)


def test_unsupported_torch_function_is_named():
    def epilogue(acc, C):
        y = acc + C
        return torch.softmax(y, dim=-1)  # error here

    err = _trace_error(epilogue, EX, evtc.UnsupportedOpError)
    assert "torch.softmax" in str(err) or "softmax" in str(err)
    _assert_points_at_marked_line(err, epilogue)


def test_unsupported_functional_and_method_are_named():
    def functional(acc):
        return F.layer_norm(acc, (24,))  # error here

    err = _trace_error(functional, EX, evtc.UnsupportedOpError)
    assert "layer_norm" in str(err)
    _assert_points_at_marked_line(err, functional)

    def method(acc):
        return acc.cumsum(-1)  # error here

    err = _trace_error(method, EX, evtc.UnsupportedOpError)
    assert "Tensor.cumsum" in str(err)
    _assert_points_at_marked_line(err, method)


def _matmul_operator(acc, C):
    return acc @ C  # error here


def _matmul_reflected(acc, C):
    return C @ acc  # error here


def _torch_matmul(acc, C):
    return torch.matmul(acc, C)  # error here


def _tensor_mm(acc, C):
    return acc.mm(C)  # error here


def _linear(acc, C):
    return F.linear(acc, C)  # error here


def _einsum(acc, C):
    return torch.einsum("mn,kn->mk", acc, C)  # error here


@pytest.mark.parametrize("fn", [_matmul_operator, _matmul_reflected, _torch_matmul, _tensor_mm, _linear,
                                _einsum])
def test_a_matrix_product_in_an_epilogue_says_it_needs_a_second_compile(fn):
    err = _trace_error(fn, EX, evtc.UnsupportedOpError)
    assert "matrix product" in str(err) and "second evtc.compile" in str(err)
    _assert_points_at_marked_line(err, fn)


def _lora_operator(acc, xa, lora_b, scale: float):
    return acc + scale * (xa @ lora_b)  # error here


def _lora_linear(acc, xa, lora_b, scale: float):
    return acc + scale * F.linear(xa, lora_b)  # error here


@pytest.mark.parametrize("fn, lora_b", [(_lora_operator, (8, 16)), (_lora_linear, (16, 8))])
def test_operands_shaped_for_a_matrix_product_name_the_product(fn, lora_b):
    """LoRA written inside the epilogue: the (M, r) operand fails the operand checks before the
    trace reaches the product; the error names the product at its line, not only the shape."""
    ex = {**EX, "xa": torch.randn(EX["a"].shape[0], 8), "lora_b": torch.randn(*lora_b), "scale": 0.5}
    err = _trace_error(fn, ex, evtc.UnsupportedOpError)
    assert "matrix product" in str(err) and "second evtc.compile" in str(err) and "'xa'" in str(err)
    _assert_points_at_marked_line(err, fn)


def _unbound_relu(acc):
    return torch.Tensor.relu(acc)  # error here


def _unbound_add(acc, C):
    return torch.Tensor.add(acc, C)  # error here


@pytest.mark.parametrize("fn, method", [(_unbound_relu, "relu"), (_unbound_add, "add")])
def test_tensor_methods_called_through_the_class_say_how_to_write_them(fn, method):
    err = _trace_error(fn, EX, evtc.UnsupportedOpError)
    assert f"torch.Tensor.{method}(x, ...), a Tensor method called through the class" in str(err)
    assert f"write x.{method}(...)" in str(err) and "TracedValue" not in str(err)
    _assert_points_at_marked_line(err, fn)


def test_a_tensor_method_as_the_epilogue_says_to_wrap_it():
    err = _trace_error(torch.Tensor.relu, {"a": EX["a"], "b": EX["b"]}, evtc.UnsupportedOpError, exact=True)
    assert "lambda acc: acc.relu()" in str(err)


def _hardtanh_bounds_crossed(acc):
    return F.hardtanh(acc, 1.0, -1.0)  # error here


def _celu_alpha_zero(acc):
    return F.celu(acc, alpha=0.0)  # error here


def _lerp_mixed_dtypes(acc, bias):
    return torch.lerp(acc, bias, 0.5)  # error here (float16 acc, float32 bias)


def _clamp_tensor_and_number(acc, bias):
    return torch.clamp(acc, min=bias, max=1.0)  # error here


def _prelu_number_weight(acc):
    return F.prelu(acc, 0.25)  # error here


def _prelu_mixed_dtypes(acc, bias):
    return F.prelu(acc, bias)  # error here (float16 acc, float32 weight)


def _heaviside_mixed_dtypes(acc, bias):
    return torch.heaviside(acc, bias)  # error here


def _softshrink_negative(acc):
    return F.softshrink(acc, -0.5)  # error here


def _threshold_by_a_tensor(acc, bias):
    return F.threshold(acc, bias, 1.0)  # error here


def _round_to_float_decimals(acc):
    return torch.round(acc, decimals=0.5)  # error here


@pytest.mark.parametrize("fn, message", [
    (_prelu_number_weight, "argument 'weight' .* must be Tensor, not float"),  # torch's own message
    (_prelu_mixed_dtypes, "prelu of a torch.float16 value by a torch.float32 weight, which torch refuses"),
    (_heaviside_mixed_dtypes, "heaviside of tensors of different dtypes, which torch refuses"),
    (_softshrink_negative, "softshrink with lambd = -0.5, which torch refuses"),
    (_threshold_by_a_tensor, "threshold's threshold must be a number"),
    (_round_to_float_decimals, "round\\(\\) received an invalid combination of arguments"),
    (_hardtanh_bounds_crossed, "min_val 1.0 is greater than max_val -1.0, which torch refuses"),
    (_celu_alpha_zero, "celu with alpha = 0, which torch refuses"),
    (_lerp_mixed_dtypes, r"lerp of tensors of dtypes \['torch.float16', 'torch.float32'\], which torch"),
    (_clamp_tensor_and_number, "clamp with a tensor for one bound and a number for the other"),
])
def test_calls_torch_refuses_are_refused_at_their_line(fn, message):
    """Each of these fails in PyTorch; evtc traced them, and the interpreter (the torch path)
    then failed inside torch."""
    acc = EX["a"] @ EX["b"]
    args = (acc, EX["bias"]) if "bias" in inspect.signature(fn).parameters else (acc,)
    with pytest.raises((RuntimeError, TypeError, ValueError)):
        fn(*args)  # torch itself
    err = _trace_error(fn, EX, evtc.UnsupportedOpError)
    assert re.search(message, str(err))
    _assert_points_at_marked_line(err, fn)


def test_zero_dim_bounds_and_weights_torch_reads_as_numbers_are_accepted():
    """torch reads a 0-dim tensor as a number for clamp's bounds and lerp's weight: legal beside a
    number bound, or of another dtype than lerp's input (the refusals above are for others)."""
    s = torch.tensor(0.25)
    inputs = {**EX, "s": s}
    for fn in (lambda acc, s: torch.clamp(acc, min=s, max=1.0), lambda acc, s: torch.lerp(acc, acc * 2, s)):
        params = set(inspect.signature(fn).parameters) | {"a", "b"}
        graph = evtc.trace(fn, {k: v for k, v in inputs.items() if k in params})
        assert graph is not None


def test_glu_of_an_odd_n_is_refused_at_its_line():
    def fn(acc):
        return F.glu(acc, dim=-1)  # error here

    odd = gemm_inputs(16, 23, 8, None)
    err = _trace_error(fn, odd, evtc.UnsupportedOpError)
    assert "glu of N = 23 columns" in str(err)
    _assert_points_at_marked_line(err, fn)


def test_python_max_of_a_runtime_scalar_says_to_compute_it_on_the_host():
    def fn(acc, alpha: float):
        return acc * max(alpha, 1e-6)  # error here

    err = _trace_error(fn, {**EX, "alpha": 0.5}, evtc.ControlFlowError)
    assert "on a runtime scalar" in str(err) and "compute it before the call" in str(err)
    assert "torch.where" not in str(err)
    _assert_points_at_marked_line(err, fn)


def test_indexing_is_rejected():
    def epilogue(acc):
        return acc[:, :4]  # error here

    err = _trace_error(epilogue, EX, evtc.UnsupportedOpError)
    assert "indexing" in str(err)
    _assert_points_at_marked_line(err, epilogue)


@pytest.mark.parametrize("form", ["if", "bool", "while", "float", "and"])
def test_data_dependent_control_flow(form):
    def epilogue(acc):
        y = acc * 2
        if form == "if":
            if y > 0:  # error here
                y = y + 1
        elif form == "bool":
            bool(y.amax())  # error here
        elif form == "while":
            while y.sum() > 0:  # error here
                y = y - 1
        elif form == "float":
            return acc * float(y.amax())  # error here
        else:
            return y > 0 and y < 1  # error here
        return y

    err = _trace_error(epilogue, EX, evtc.ControlFlowError)
    assert "control flow" in str(err) and "torch.where" in str(err)
    assert err.loc.lineno in _marked_lines(epilogue)


def test_size_dependent_python_is_rejected():
    def epilogue(acc):
        if acc.shape[-1] > 8:  # error here
            return acc
        return -acc

    err = _trace_error(epilogue, EX, evtc.ControlFlowError)
    assert "run time" in str(err)
    _assert_points_at_marked_line(err, epilogue)


def test_len_of_a_traced_value_names_its_size_and_the_way_out():
    """len(acc) is a size, not data: the message says so and offers acc.shape[0] (it spoke of
    data-dependent control flow and torch.where)."""
    def epilogue(acc):
        return acc / len(acc)  # error here

    err = _trace_error(epilogue, EX, evtc.ControlFlowError)
    assert "problem size known only at run time" in str(err) and "x.shape[0]" in str(err)
    assert "torch.where" not in str(err)
    _assert_points_at_marked_line(err, epilogue)


@pytest.mark.parametrize("how", ["iadd", "method", "functional"])
def test_inplace_on_acc(how):
    def epilogue(acc, C):
        if how == "iadd":
            acc += C  # error here
        elif how == "method":
            acc.mul_(2.0)  # error here
        else:
            F.relu(acc, inplace=True)  # error here
        return acc

    err = _trace_error(epilogue, EX, evtc.InPlaceError)
    assert "'acc'" in str(err) and "in-place" in str(err)
    assert err.loc.lineno in _marked_lines(epilogue)


def test_inplace_on_an_operand():
    def epilogue(acc, C):
        C.add_(1.0)  # error here
        return acc + C

    err = _trace_error(epilogue, EX, evtc.InPlaceError)
    assert "'C'" in str(err)
    _assert_points_at_marked_line(err, epilogue)


@pytest.mark.parametrize("shape", [(24, 16), (16, 23), (5, 16, 24), (3,)])
def test_operand_that_cannot_broadcast(shape):
    def epilogue(acc, x):
        return acc + x

    err = _trace_error(epilogue, gemm_inputs(16, 24, 8, None) | {"x": rand(*shape)}, evtc.ShapeError)
    assert "'x'" in str(err) and str(tuple(shape)) in str(err)
    assert err.loc is not None and err.loc.lineno == epilogue.__code__.co_firstlineno


def test_symbolic_broadcast_mismatch_even_when_m_equals_n():
    def epilogue(acc):
        return acc + acc.sum(-1)  # error here

    err = _trace_error(epilogue, gemm_inputs(16, 16, 8, None), evtc.ShapeError)
    assert "broadcast" in str(err)
    _assert_points_at_marked_line(err, epilogue)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.bool])
def test_unsupported_operand_dtype(dtype):
    def epilogue(acc, x):
        return acc + x

    x = torch.ones(16, 24, dtype=dtype)
    err = _trace_error(epilogue, gemm_inputs(16, 24, 8, None) | {"x": x}, evtc.DTypeError)
    assert str(dtype) in str(err)


def test_unsupported_gemm_and_cast_dtypes():
    err = _trace_error(lambda acc: acc, gemm_inputs(8, 8, 8, None, dtype=torch.float64), evtc.DTypeError)
    assert "'a'" in str(err)
    mixed = gemm_inputs(8, 8, 8, None) | {"b": torch.ones(8, 8, dtype=torch.bfloat16)}
    err = _trace_error(lambda acc: acc, mixed, evtc.DTypeError)
    assert "must match" in str(err)

    def cast(acc):
        return acc.to(torch.int8)  # error here

    err = _trace_error(cast, EX, evtc.DTypeError)
    _assert_points_at_marked_line(err, cast)

    def fp8_math(acc):
        return acc.to(torch.float8_e4m3fn) * 2  # error here

    err = _trace_error(fp8_math, EX, evtc.DTypeError)
    assert "float8" in str(err)
    _assert_points_at_marked_line(err, fp8_math)


def test_missing_and_extra_example_inputs():
    def epilogue(acc, C, bias):
        return acc + C + bias

    inputs = gemm_inputs(16, 24, 8, None)
    err = _trace_error(epilogue, inputs | {"C": EX["C"]}, evtc.InputError, exact=True)
    assert "missing" in str(err) and "'bias'" in str(err)
    assert err.loc.lineno == epilogue.__code__.co_firstlineno
    err = _trace_error(epilogue, EX | {"gamma": 1.0}, evtc.InputError, exact=True)
    assert "'gamma'" in str(err)
    err = _trace_error(epilogue, {"C": EX["C"], "bias": EX["bias"], "b": EX["b"]}, evtc.InputError,
                       exact=True)
    assert "'a'" in str(err)
    err = _trace_error(epilogue, EX | {"acc": EX["C"]}, evtc.InputError, exact=True)
    assert "accumulator" in str(err)


def test_reserved_parameter_names():
    def epilogue(acc, a):
        return acc + a

    err = _trace_error(epilogue, EX, evtc.InputError, exact=True)
    assert "'a'" in str(err) and "reserved" in str(err)


@pytest.mark.parametrize("case", ["batch_dim", "of_vector", "nested", "two_pass", "bool", "max_dim"])
def test_reductions_that_cannot_be_computed(case):
    inputs = gemm_inputs(16, 24, 8, 2) | {"bias": rand(24)}

    def epilogue(acc, bias):
        if case == "batch_dim":
            return acc.sum(0)  # error here
        if case == "of_vector":
            return acc + bias.sum()  # error here
        if case == "nested":
            return acc.sum(-1).amax()  # error here
        if case == "two_pass":
            return acc - acc.amax(-1, keepdim=True)  # error here
        if case == "bool":
            return (acc > 0).sum()  # error here
        return acc.max(-1)  # error here

    err = _trace_error(epilogue, inputs, evtc.ReductionError)
    assert err.loc is not None and err.loc.lineno in _marked_lines(epilogue), str(err)


def test_returned_non_tensor_and_nothing():
    def nothing(acc):
        acc * 2

    err = _trace_error(nothing, EX, evtc.OutputError)
    assert "returns nothing" in str(err)

    def number(acc):
        return acc, 3.0

    err = _trace_error(number, EX, evtc.OutputError)
    assert "float" in str(err) and "'D1'" in str(err)

    def vector(acc, bias):
        return acc, bias * 2  # error here

    err = _trace_error(vector, EX, evtc.OutputError)
    assert "tile" in str(err)
    _assert_points_at_marked_line(err, vector)


def test_closure_tensor_is_rejected():
    weight = torch.ones(24)

    def epilogue(acc):
        return acc * weight  # error here

    err = _trace_error(epilogue, EX, evtc.InputError)
    assert "pass it as a parameter" in str(err)
    _assert_points_at_marked_line(err, epilogue)


def test_error_traceback_hides_evtc_internals():
    def epilogue(acc):
        return torch.cumsum(acc, -1)

    with pytest.raises(evtc.UnsupportedOpError) as info:
        evtc.trace(epilogue, {"a": EX["a"], "b": EX["b"]})
    frames = traceback.extract_tb(info.value.__traceback__)
    internal = [f for f in frames if "/evtc/frontend/" in f.filename or "/evtc/ir/" in f.filename]
    assert not internal, [f.filename for f in frames]
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_python_math_on_a_runtime_scalar_says_so():
    import math

    def epilogue(acc, alpha):
        return acc * math.exp(alpha)  # error here

    err = _trace_error(epilogue, EX | {"alpha": 0.5}, evtc.ControlFlowError)
    assert "runtime scalar 'alpha'" in str(err)
    _assert_points_at_marked_line(err, epilogue)


def test_a_torch_call_with_arguments_it_does_not_take_is_named_at_its_line():
    """torch's own TypeError (torch.add given one argument) reached the user raw, from deep in the
    tracer; it is an UnsupportedOpError at the user's line, with torch's message."""
    def epilogue(acc, C):
        y = acc * 2
        return torch.add(y)  # error here

    err = _trace_error(epilogue, EX, evtc.UnsupportedOpError)
    assert "add()" in str(err) and "does not take the arguments" in str(err)
    _assert_points_at_marked_line(err, epilogue)
    with pytest.raises(evtc.UnsupportedOpError, match="add"):  # a builtin epilogue needing more
        evtc.trace(torch.add, gemm_inputs(16, 24, 8, None))


@pytest.mark.parametrize("builtin", [torch.relu, torch.sigmoid, torch.tanh, F.gelu, F.silu],
                         ids=lambda f: f.__name__)
def test_a_torch_function_of_the_accumulator_is_an_epilogue(builtin, tmp_path):
    """torch.relu or F.gelu as the epilogue itself (as an evtc.nn activation): builtins have no
    signature to read, and were refused; they are functions of the accumulator alone."""
    inputs = gemm_inputs(16, 24, 8, None, dtype=torch.float32)
    k = evtc.compile(builtin, inputs, arch="sm_90a", cache_dir=tmp_path)
    a, b = rand(16, 8, seed=3), rand(8, 24, seed=4)
    want = builtin(a.double() @ b.double())
    assert torch.allclose(k(a, b).double(), want, atol=1e-5, rtol=1e-5)


def test_a_module_is_an_epilogue(tmp_path):
    """An activation module (nn.GELU()) is called through __call__(*args, **kwargs), and was
    refused for those; its forward names its parameters. Two modules of one class that differ in
    their attributes are two kernels (a module is not digested into the cache's quick key)."""
    inputs = gemm_inputs(16, 24, 8, None, dtype=torch.float32)
    a, b = rand(16, 8, seed=3), rand(8, 24, seed=4)
    acc = a.double() @ b.double()
    for module in (torch.nn.GELU(), torch.nn.GELU(approximate="tanh"),
                   torch.nn.Sequential(torch.nn.SiLU(), torch.nn.Tanh())):
        k = evtc.compile(module, inputs, arch="sm_90a", cache_dir=tmp_path)
        assert torch.allclose(k(a, b).double(), module(acc), atol=1e-6, rtol=1e-6), module
    assert evtc.trace(torch.nn.GELU(), inputs).name == "GELU"


def _caught_by_the_epilogue(acc):
    try:
        return torch.special.ndtr(acc)  # error here
    except Exception:
        return 0.5 * (1 + torch.erf(acc))


def _data_dependent_branch_caught(acc, C):
    try:
        if C.sum() > 0:  # error here
            return acc + C
    except Exception:
        pass
    return acc


@pytest.mark.parametrize("fn, error", [(_caught_by_the_epilogue, evtc.UnsupportedOpError),
                                       (_data_dependent_branch_caught, evtc.ControlFlowError)])
def test_errors_the_epilogue_catches_itself_still_fail_the_trace(fn, error):
    """An evtc error that the function's own try/except swallows would leave a graph of the
    branch torch never takes (the except), silently: the trace fails with the first such error,
    at its line."""
    err = _trace_error(fn, EX, error)
    assert err.loc is not None and err.loc.lineno == _marked_line(fn)
    assert "caught this error itself" in str(err)


_GLOBAL_SCALE = torch.tensor(2.0)
_LEARNED = torch.nn.Parameter(torch.tensor(0.5))


def _global_scale(acc):
    return acc * _GLOBAL_SCALE  # error here


def _learned_scale(acc):
    return acc * (_LEARNED * 2)  # error here


@pytest.mark.parametrize("fn", [_global_scale, _learned_scale])
def test_one_element_tensors_from_outside_are_inputs_not_constants(fn):
    """A one-element tensor from outside the function (a global, a module's parameter, or one
    computed from it) is refused like any other: as a constant it would keep today's value after
    an optimizer step or a fill_, and get no gradient."""
    err = _trace_error(fn, EX, evtc.InputError)
    assert err.loc.lineno == _marked_line(fn) and "not one of its inputs" in str(err)


def test_constants_made_in_the_epilogue_are_literals():
    def made(acc):
        return acc * torch.tensor(2.0) + torch.sqrt(torch.ones(()) * 4.0)

    a, b = EX["a"], EX["b"]
    got = evtc.trace(made, {"a": a, "b": b}).evaluate({"a": a, "b": b})
    want = made(a.float() @ b.float())
    torch.testing.assert_close(got.float(), want.half().float(), rtol=0, atol=0)


def _add_if_tensor(x, bias):
    return x + bias if torch.is_tensor(bias) else x  # error here


def _is_tensor_in_a_helper(acc, bias):
    return F.gelu(_add_if_tensor(acc, bias))


def _isinstance_of_an_operand(acc, bias):
    if isinstance(bias, torch.Tensor):  # error here
        return acc + bias
    return acc


def _isinstance_of_a_runtime_scalar(acc, alpha: float):
    return acc * alpha if isinstance(alpha, float) else acc  # error here


@pytest.mark.parametrize("fn", [_is_tensor_in_a_helper, _isinstance_of_an_operand,
                                _isinstance_of_a_runtime_scalar])
def test_type_checks_on_traced_values_are_refused(fn):
    """While tracing, tensors and runtime scalars are stand-ins: isinstance or torch.is_tensor on
    one would take the other branch than torch (a kernel without the bias), so it is refused at
    the line of the check."""
    inputs = EX | {"alpha": 0.5}
    err = _trace_error(fn, inputs, evtc.UnsupportedOpError)
    assert err.loc is not None and err.loc.lineno == _marked_line(
        _add_if_tensor if fn is _is_tensor_in_a_helper else fn)
    assert "on a traced value" in str(err)


_SCALE_HOLDER = type("Holder", (), {"scale": 2.0})()


def _type_checks_on_other_values(acc, bias=None, s=2.0):
    y = acc * _SCALE_HOLDER.scale if isinstance(_SCALE_HOLDER.scale, float) else acc
    y = y * s if isinstance(s, float) else y
    y = y + 1.0 if isinstance(acc.shape, tuple) else y
    return y + bias if isinstance(bias, torch.Tensor) else y - 1.0


def test_type_checks_on_other_values_trace():
    """Type checks on what is not a stand-in (None, a constant default, an attribute of a global,
    acc's shape) answer as in torch."""
    a, b = EX["a"], EX["b"]
    got = evtc.trace(_type_checks_on_other_values, {"a": a, "b": b}).evaluate({"a": a, "b": b})
    want = _type_checks_on_other_values(a.float() @ b.float())
    torch.testing.assert_close(got.float(), want.half().float())


def _half_changed_then_base_read(acc):
    y = acc * 1.0
    gate, up = y.chunk(2, -1)
    gate.mul_(0.0)  # error here
    return y


def _base_changed_then_half_read(acc):
    y = acc * 1.0
    gate, up = y.chunk(2, -1)
    y.mul_(2.0)  # error here
    return gate * up


def _half_of_acc_changed(acc):
    gate, up = acc.split(acc.shape[-1] // 2, -1)
    gate *= 2.0  # error here
    return gate * up


def _cast_changed_then_base_read(acc):
    y = acc.float() * 2.0
    z = y.float()
    y.add_(1.0)  # error here
    return z


@pytest.mark.parametrize("fn", [_half_changed_then_base_read, _base_changed_then_half_read,
                                _half_of_acc_changed, _cast_changed_then_base_read])
def test_inplace_on_values_that_share_memory(fn):
    """chunk/split halves are views of what was split, and x.float() of a float32 x is x: torch's
    in-place op on one changes the others, which a graph of values cannot say (it silently read
    the old values), so it is refused at its line."""
    err = _trace_error(fn, EX, evtc.InPlaceError)
    assert err.loc.lineno == _marked_line(fn) and "shares" in str(err)


def test_inplace_ops_torch_refuses_are_refused():
    """An in-place op whose result is larger than its target (row += tile) and a float written into
    a mask in place raise in torch; they were traced as rebinding the name."""
    def grow(acc, bias):
        y = bias * 2.0
        y += acc  # error here
        return y

    def mask_float(acc):
        m = acc > 0
        m += 0.5  # error here
        return acc * m

    ex = {**EX, "bias": torch.randn(EX["b"].shape[-1])}
    for fn, match in ((grow, "is larger than the value it writes into"), (mask_float, "into a boolean mask")):
        err = _trace_error(fn, ex if fn is grow else EX, evtc.InPlaceError)
        assert err.loc.lineno == _marked_line(fn) and match in str(err)


def test_inplace_ops_on_python_numbers_rebind_the_name():
    """A value computed from runtime scalars is a Python number: += rebinds its name, whatever the
    result (torch's in-place rules are for tensors)."""
    def grow(acc, alpha: float):
        s = alpha * 2.0
        s += acc
        return s

    def flag(acc, alpha: float):
        on = alpha > 0.0
        on += 0.5
        return acc * on

    a, b = EX["a"], EX["b"]
    for fn in (grow, flag):
        got = evtc.trace(fn, {"a": a, "b": b, "alpha": 0.75}).evaluate({"a": a, "b": b, "alpha": 0.75})
        torch.testing.assert_close(got.float(), fn(a.float() @ b.float(), 0.75).half().float())


def test_a_copying_cast_may_be_changed_in_place():
    def epilogue(acc):
        y = acc.to(torch.float32, copy=True)
        y.mul_(2.0)
        return y + acc

    a, b = EX["a"], EX["b"]
    got = evtc.trace(epilogue, {"a": a, "b": b}).evaluate({"a": a, "b": b})
    assert got.dtype == torch.float32  # float32 + float16, as in torch
    torch.testing.assert_close(got, epilogue(a.float() @ b.float()))


def _string_default(acc, mode="relu"):
    return acc.relu() if mode == "relu" else acc


def test_a_default_that_is_not_a_number_is_named():
    err = _trace_error(_string_default, EX, evtc.InputError)
    assert "'mode' defaults to a str" in str(err) and "close over it" in str(err)


def test_a_reduction_dim_given_twice_is_refused():
    def epilogue(acc):
        return acc.sum((-1, -1))  # error here

    err = _trace_error(epilogue, EX, evtc.ReductionError)
    assert "more than once" in str(err) and err.loc.lineno == _marked_line(epilogue)


@pytest.mark.parametrize("kwargs, match", [
    ({"config": {"split_k": 4}}, "knob split_k must be True or False"),
    ({"config": {"tile_n": 128.0}}, "knob tile_n must be an int"),
    ({"config": {"cluster": 2}}, "knob cluster must be a pair"),
    ({"config": {"tile": 128}}, "unknown knob 'tile'"),
    ({"config": {"a_major": "n"}}, "a_major is not a knob"),
    ({"config": "fast"}, "config must be a dict"),
    ({"arch": "sm_80"}, "arch='sm_80'"),
    ({"out_dtypes": 5}, "out_dtypes must be"),
])
def test_compile_arguments_are_checked_by_name(kwargs, match, tmp_path):
    """Wrong knobs, architectures and out_dtypes are named before anything is traced (a float
    tile_n, an int split_k or an unknown arch failed deep in the DSL or the cache key)."""
    def two(acc):
        return acc, acc * 2

    with pytest.raises(evtc.EpilogueError, match=match):
        evtc.compile(two, gemm_inputs(16, 24, 8, None), cache_dir=tmp_path, **({"arch": "sm_90a"} | kwargs))


@pytest.mark.parametrize("examples", [None, [1, 2]])
def test_example_inputs_that_are_not_a_dict(examples, tmp_path):
    with pytest.raises(evtc.InputError, match="example inputs must be a dict"):
        evtc.compile(lambda acc: acc, examples, arch="sm_90a", cache_dir=tmp_path)
    with pytest.raises(evtc.CallError, match="example_inputs must be a dict"):
        evtc.linear(lambda acc: acc, examples, arch="sm_90a", cache_dir=tmp_path)


def test_operands_passed_by_position_are_taken_as_the_function_takes_them(tmp_path):
    ex = gemm_inputs(16, 24, 8, None) | {"C": rand(16, 24, seed=1)}
    k = evtc.compile(lambda acc, C: acc + C, ex, arch="sm_90a", cache_dir=tmp_path)
    assert torch.equal(k(ex["a"], ex["b"], ex["C"]), k(ex["a"], ex["b"], C=ex["C"]))
    with pytest.raises(evtc.CallError, match="at most 3 positional"):
        k(ex["a"], ex["b"], ex["C"], ex["C"])


def test_operands_compiled_from_one_element_examples_say_so(tmp_path):
    """With M = N = 1 examples, a (1, 1) C is a one-element scalar operand: a later call with an
    (M, N) C is refused, and the message says where the scalar came from."""
    ex = gemm_inputs(1, 1, 8, None) | {"C": rand(1, 1, seed=1)}
    k = evtc.compile(lambda acc, C: acc + C, ex, arch="sm_90a", cache_dir=tmp_path)
    big = gemm_inputs(16, 24, 8, None)
    with pytest.raises(evtc.CallError, match="compiled as a one-element scalar operand"):
        k(big["a"], big["b"], C=rand(16, 24, seed=2))


def test_linear_examples_are_named_in_its_own_terms(tmp_path):
    """evtc.linear names x and weight (not the GEMM's a and b) for a K mismatch, and refuses an
    epilogue parameter that shadows them."""
    x, w = rand(2, 5, 8, seed=1), rand(24, 9, seed=2)
    with pytest.raises(evtc.CallError, match="x has 8 input features, weight 9"):
        evtc.linear(lambda acc: acc, {"x": x, "weight": w}, arch="sm_90a", cache_dir=tmp_path)

    def shadowing(acc, x):
        return acc + x

    with pytest.raises(evtc.CallError, match="parameter named 'x'"):
        evtc.linear(shadowing, {"x": x, "weight": rand(24, 8, seed=3)}, arch="sm_90a", cache_dir=tmp_path)


def test_type_checks_of_libraries_on_traced_values_pass():
    """The standard library's and installed packages' own checks (inspect.isfunction(acc), typing,
    torch.compile's frame analysis when a kernel is built inside a compiled region) see a stand-in
    as they see any object: only the user's code is refused."""
    import inspect as inspect_module

    def epilogue(acc, bias):
        assert not inspect_module.isfunction(acc)
        return F.gelu(acc + bias)

    a, b = EX["a"], EX["b"]
    ex = {"a": a, "b": b, "bias": EX["bias"]}
    got = evtc.trace(epilogue, ex).evaluate(ex)
    want = epilogue(a.float() @ b.float(), EX["bias"].float())
    assert got.dtype == EX["bias"].dtype == torch.float32  # a float32 bias promotes, as in torch
    torch.testing.assert_close(got, want)


def test_size_past_the_rank_raises_torchs_index_error():
    expected = r"Dimension out of range \(expected to be in range of \[-2, 1\], but got 5\)"
    with pytest.raises(IndexError, match=expected):
        evtc.trace(lambda acc: acc * acc.size(5), {"a": EX["a"], "b": EX["b"]})


def test_a_reduction_times_a_row_operand_names_the_operand():
    """amax(-1, keepdim=True) * an (M, 1) scale is per row, not a tile: the refusal says that the
    finish takes numbers and reductions only, not that it needs a second pass over the tile."""
    def scaled_amax(acc, sa):
        return acc, acc.abs().amax(-1, keepdim=True) * sa

    ex = EX | {"sa": rand(16, 1, seed=4)}
    err = _trace_error(scaled_amax, ex, evtc.ReductionError)
    assert "[M, 1]" in str(err) and "second pass" not in str(err)
    err = _trace_error(lambda acc: acc - acc.amax(-1, keepdim=True), EX, evtc.ReductionError)
    assert "second pass" in str(err)


def test_random_numbers_inside_an_epilogue_are_refused_at_the_line():
    """torch.randn / torch.rand / an in-place uniform_ inside the function would be drawn once while
    tracing and frozen into the kernel: refused at the user's line. Made constants still trace."""
    a, b = torch.randn(8, 16).half(), torch.randn(16, 8).half()
    for fn in (lambda acc: acc + torch.randn(1), lambda acc: acc * torch.rand(()),
               lambda acc: acc + torch.zeros(()).uniform_(), lambda acc: acc + torch.randn_like(acc)):
        with pytest.raises(evtc.UnsupportedOpError, match="random numbers") as info:
            evtc.trace(fn, {"a": a, "b": b})
        assert "test_errors.py" in str(info.value)
    evtc.trace(lambda acc: acc + torch.empty(()).fill_(2.0) + torch.tensor(1.0), {"a": a, "b": b})


@pytest.mark.parametrize("name", ["out", "self"])
def test_parameters_named_like_the_calls_own_are_refused(name):
    """A parameter named ``out`` or ``self`` compiled, then could not be passed (k's own ``out=``,
    its ``self``): refused at the definition, as ``a`` and ``b`` are."""
    namespace: dict = {}
    exec(f"def fn(acc, {name}):\n    return acc + {name}\n", namespace)
    a, b = torch.randn(8, 16).half(), torch.randn(16, 8).half()
    with pytest.raises(evtc.InputError, match=f"parameter '{name}' clashes"):
        evtc.trace(namespace["fn"], {"a": a, "b": b, name: torch.randn(8, 8)})


def test_launch_for_names_a_size_that_is_no_problem_size(tmp_path):
    a, b = torch.empty(64, 64, dtype=torch.bfloat16, device="meta"), torch.empty(64, 64, dtype=torch.bfloat16,
                                                                              device="meta")
    k = evtc.compile(lambda acc: acc, {"a": a, "b": b.t()}, arch="sm_90a", cache_dir=tmp_path)
    for args in [(0, 4096, 4096), (64, -1, 4096), ("64", 64, 64), (64, 64, None)]:
        with pytest.raises(evtc.CallError, match="must be a positive int"):
            k.launch_for(*args)
    config, splits = k.launch_for(64, 1024, 8192)
    assert splits >= 1 and config.tile_m in (64, 128)


def test_nested_tensors_are_named(tmp_path):
    """A nested (ragged) tensor has no one shape to tile: refused by name in examples, calls and the
    layers (torch's "NestedTensorImpl doesn't support sizes" before)."""
    from evtc.nn import FusedLinear

    a, b, C = torch.randn(8, 16), torch.randn(16, 8), torch.randn(8, 8)
    nested = torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(5, 8)])
    with pytest.raises(evtc.InputError, match="'C' is a nested tensor"):
        evtc.trace(lambda acc, C: acc + C, {"a": a, "b": b, "C": nested})
    k = evtc.compile(lambda acc, C: acc + C, {"a": a, "b": b, "C": C}, cache_dir=tmp_path)
    with pytest.raises(evtc.CallError, match="C is a nested tensor"):
        k(a, b, C=nested)
    with pytest.raises(evtc.CallError, match="x is a nested tensor"):
        FusedLinear(8, 4, torch.relu, bias=False, cache_dir=tmp_path)(nested)


def test_linear_refuses_a_and_b_in_its_examples_and_compile_a_cache_dir_that_is_no_path(tmp_path):
    x, w = torch.randn(4, 16), torch.randn(8, 16)
    with pytest.raises(evtc.CallError, match="builds itself from x and weight"):
        evtc.linear(torch.relu, {"x": x, "weight": w, "a": x.t().contiguous()}, cache_dir=tmp_path)
    with pytest.raises(evtc.CompileError, match="cache_dir must be a path"):
        evtc.compile(torch.relu, {"a": x, "b": w.t()}, cache_dir=5)


def test_dropout_probability_and_compile_flags_are_checked(tmp_path):
    a, b = torch.randn(8, 16).half(), torch.randn(16, 8).half()
    with pytest.raises(evtc.UnsupportedOpError, match="between 0 and 1"):
        evtc.trace(lambda acc: F.dropout(acc, p=1.5, training=False), {"a": a, "b": b})
    evtc.trace(lambda acc: F.dropout(acc, p=0.5, training=False), {"a": a, "b": b})
    with pytest.raises(evtc.CompileError, match="strict must be True or False"):
        evtc.compile(torch.relu, {"a": a, "b": b}, strict="yes", cache_dir=tmp_path)
    with pytest.raises(evtc.CompileError, match="autotune must be"):
        evtc.compile(torch.relu, {"a": a, "b": b}, autotune={"x": 1}, cache_dir=tmp_path)


def test_an_int_literal_beyond_int64_is_refused_at_its_line():
    """torch refuses a Python int beyond int64 in an op (OverflowError); evtc took it as the float
    1.27e30 (``acc * 2**100``): refused at the line, as torch refuses it."""
    def huge(acc):
        return acc * 2**100  # error here

    err = _trace_error(huge, EX, evtc.DTypeError)
    assert "beyond int64" in str(err)
    _assert_points_at_marked_line(err, huge)
    with pytest.raises(OverflowError):  # the reference: torch refuses it too
        huge(torch.randn(2, 2))
    evtc.trace(lambda acc: acc * 2**62 + acc * -(2**63), gemm_inputs(16, 24, 8, None))  # int64 itself


@pytest.mark.parametrize("kind", ["max", "min"])
def test_max_over_everything_with_keepdim_is_refused_as_torch_refuses_it(kind):
    """torch's x.max() over everything takes no keepdim (a TypeError); evtc returned a (1, 1)
    value: refused at the line, naming amax((-2, -1), keepdim=True)."""
    def over_all(acc):
        return getattr(acc, kind)(keepdim=True)  # error here

    with pytest.raises(TypeError):  # the reference: torch refuses it
        over_all(torch.randn(2, 3))
    err = _trace_error(over_all, EX, evtc.ReductionError)
    assert f"a{kind}((-2, -1), keepdim=True)" in str(err)
    _assert_points_at_marked_line(err, over_all)


def test_an_operand_returned_as_it_came_in_is_named_at_the_return():
    """A loaded operand was made at the def line; returned unchanged, its store and its refusal name
    the return statement, not the decorator."""
    def row_output(acc, bias):
        y = acc + 1.0
        return y, bias  # error here

    err = _trace_error(row_output, EX, evtc.OutputError)
    _assert_points_at_marked_line(err, row_output)

    def tile_copy(acc, C):
        y = acc + 1.0
        return y, C  # error here

    graph = evtc.trace(tile_copy, {k: EX[k] for k in ("a", "b", "C")})
    (copy,) = [s for s in graph.stores if s.attrs["name"] == "D1"]
    assert copy.loc.lineno == _marked_line(tile_copy)


def test_a_profiler_the_user_set_is_left_in_place():
    """Tracing runs a profile hook of its own (type checks, and where the epilogue returns): it
    passes every event on to a profiler the user set, and puts that profiler back."""
    import sys

    calls = []

    def profiler(frame, event, arg):
        calls.append(event)

    def row_output(acc, bias):
        return acc, bias  # error here

    sys.setprofile(profiler)
    try:
        with pytest.raises(evtc.OutputError) as info:
            evtc.trace(row_output, {k: EX[k] for k in ("a", "b", "bias")})
        assert sys.getprofile() is profiler
    finally:
        sys.setprofile(None)
    assert "return" in calls, "the user's profiler missed the epilogue's events"
    _assert_points_at_marked_line(info.value, row_output)


def test_in_place_on_a_value_that_was_detached_is_refused():
    """x.detach() shares x's memory in torch: an in-place op on either changes both, which the
    graph (where the detached copy is a node of its own) cannot say."""
    def epilogue(acc):
        y = acc * 2.0
        d = y.detach()
        y.add_(1.0)  # error here
        return d

    err = _trace_error(epilogue, EX, evtc.InPlaceError)
    assert "detached" in str(err)
    _assert_points_at_marked_line(err, epilogue)


def test_graph_evaluated_without_an_input_names_every_missing_one():
    """``Graph.evaluate`` with an input the graph reads left out: an InputError naming each missing
    input and what the graph reads (it was a bare KeyError of the first missing name)."""
    def ep(acc, bias, scale: float):
        return acc * scale + bias

    a, b = torch.randn(4, 8), torch.randn(8, 6)
    graph = evtc.trace(ep, {"a": a, "b": b, "bias": torch.randn(6), "scale": 2.0})
    with pytest.raises(evtc.InputError, match="without its input\\(s\\) bias, scale; it reads acc, "):
        graph.evaluate({"acc": a @ b})
    with pytest.raises(evtc.InputError, match="acc \\(or a and b\\)"):
        graph.evaluate({"bias": torch.randn(6), "scale": 2.0})
    got = graph.evaluate({"a": a, "b": b, "bias": torch.ones(6), "scale": 2.0})
    torch.testing.assert_close(got, (a @ b) * 2 + 1)


@evtc.epilogue
def _times_a_row_value(acc, s):
    return acc * s.unsqueeze(-1)


def test_an_operand_shape_error_names_the_def_line_and_the_column_shape():
    """An (M,) operand meant per row: the error is at the function's ``def`` line (it was the
    decorator's, ``@evtc.epilogue``, above it) and says a per-row column is (M, 1)."""
    a, b = torch.randn(6, 8), torch.randn(8, 5)
    with pytest.raises(evtc.ShapeError, match=r"per-row column of M = 6 values is \(6, 1\)") as info:
        evtc.trace(_times_a_row_value, {"a": a, "b": b, "s": torch.randn(6)})
    decorator_line = inspect.getsourcelines(_times_a_row_value)[1]
    assert f"test_errors.py:{decorator_line + 1}: def _times_a_row_value" in str(info.value), str(info.value)


def test_a_product_with_a_transpose_is_named_as_a_matrix_product():
    """``acc @ acc.t()``: the transpose fails first while tracing, but the line asks for a matrix
    product, and the error says so (it said ``Tensor.t is not supported``). A transpose alone keeps
    its own message."""
    a, b = torch.randn(6, 8), torch.randn(8, 6)
    with pytest.raises(evtc.UnsupportedOpError, match="the @ operator is a matrix product") as info:
        evtc.trace(lambda acc: acc @ acc.t(), {"a": a, "b": b})
    assert "test_errors.py" in str(info.value)
    with pytest.raises(evtc.UnsupportedOpError, match="matrix product"):
        evtc.trace(lambda acc: torch.matmul(acc, acc.transpose(0, 1)), {"a": a, "b": b})
    with pytest.raises(evtc.UnsupportedOpError, match="Tensor.t is not supported"):
        evtc.trace(lambda acc: acc.t() + acc, {"a": a, "b": b})


def test_an_int_example_scalar_beyond_int64_is_refused_at_compile_time():
    """An example scalar torch could not take (an int beyond int64) was accepted by the trace and
    refused only at the first call: now the compile names it, at the epilogue's definition."""
    def scaled(acc, s: int):
        return acc * s

    with pytest.raises(OverflowError):  # the reference: torch refuses such an int scalar
        torch.randn(2, 2) * 2**70
    with pytest.raises(evtc.InputError, match="example input 's'.*does not fit in int64") as info:
        evtc.trace(scaled, {"a": EX["a"], "b": EX["b"], "s": 2**70})
    assert info.value.loc is not None and info.value.loc.filename == __file__
    evtc.trace(scaled, {"a": EX["a"], "b": EX["b"], "s": 2**63 - 1})  # int64's largest is fine


def test_a_math_function_on_a_traced_value_is_named_with_the_torch_one():
    """``math.exp(acc)`` reached float() and was told about data-dependent control flow: the
    message now names the math function and the torch function to use, at the user's line."""
    import math
    from math import sqrt

    def qualified(acc):
        return math.exp(acc)  # error here

    def imported(acc):
        return sqrt(acc)  # error here

    for fn, written, torch_name in ((qualified, "math.exp()", "torch.exp"),
                                    (imported, "sqrt()", "torch.sqrt")):
        err = _trace_error(fn, EX, evtc.ControlFlowError)
        assert written in str(err) and torch_name in str(err) and "control flow" not in str(err), str(err)
        _assert_points_at_marked_line(err, fn)

    def branch(acc):
        return acc if float(acc) > 0 else -acc  # error here (no math function: control flow)

    err = _trace_error(branch, EX, evtc.ControlFlowError)
    assert "control flow" in str(err)
    _assert_points_at_marked_line(err, branch)


def test_a_builtin_epilogue_that_needs_more_than_the_accumulator_says_to_wrap_it():
    """``torch.add`` as the epilogue (no readable signature: called with the accumulator alone)
    failed with torch's message naming evtc's stand-in class; now it says to wrap the builtin."""
    with pytest.raises(evtc.UnsupportedOpError) as info:
        evtc.trace(torch.add, {"a": EX["a"], "b": EX["b"]})
    message = str(info.value)
    assert "torch.add, used as the epilogue, is a builtin" in message
    assert "lambda acc, other: torch.add(acc, other)" in message and "TracedValue" not in message
    assert info.value.loc is not None and info.value.loc.filename == __file__


def test_an_operand_read_only_for_its_shape_is_refused_at_compile_time():
    """``acc * C.size(0)`` with C used nowhere else: the kernel takes no C, so a call dropped it
    unchecked and computed with the compiled size whatever C it got (silently wrong); refused at
    compile time, at the def line, for its last dim too (torch would read a C of any width)."""
    a, b = torch.randn(8, 16), torch.randn(16, 12)

    def epilogue(acc, C):  # error here
        return acc * C.size(0)

    with pytest.raises(evtc.CompileError, match="reads the shape or dtype of C") as info:
        evtc.compile(epilogue, {"a": a, "b": b, "C": torch.randn(8, 12)})
    assert info.value.loc.lineno in _marked_lines(epilogue)
    with pytest.raises(evtc.CompileError, match="reads the shape or dtype of C"):
        evtc.compile(lambda acc, C: acc / C.shape[-1], {"a": a, "b": b, "C": torch.randn(8, 12)})
    # Its dtype alone likewise: torch's acc.to(C.dtype) follows the C of each call.
    with pytest.raises(evtc.CompileError, match="reads the shape or dtype of C"):
        evtc.compile(lambda acc, C: acc.to(C.dtype), {"a": a, "b": b, "C": torch.randn(8, 12)})
    k = evtc.compile(lambda acc, C: (acc + C) / C.shape[-1], {"a": a, "b": b, "C": torch.randn(8, 12)})
    C = torch.randn(8, 12)
    torch.testing.assert_close(k(a, b, C=C), (a @ b + C) / 12, rtol=1e-5, atol=1e-5)
