"""Output structure, shapes and dtypes equal what the function returns on real tensors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support import SHAPES, check_epilogue, eager_dtypes, gemm_inputs, rand

import evtc


def _inputs(shape, *operands, dtype=torch.float16):
    """a, b and the named operands among C (a full tile) and bias (a row vector)."""
    m, n, k, lb = shape
    lead = () if lb is None else (lb,)
    available = {"C": rand(*lead, m, n, seed=7), "bias": rand(n, seed=8)}
    return gemm_inputs(m, n, k, lb, dtype=dtype) | {k: available[k] for k in operands}


def test_issue_example():
    def bias_gelu_residual(acc, bias, C, alpha: float):
        y = F.gelu(alpha * acc + bias)
        return y + C, y.abs().amax()

    ex = _inputs(SHAPES[1], "bias", "C") | {"alpha": 1.0}
    g = evtc.trace(bias_gelu_residual, ex)
    d, amax = g.evaluate(ex)
    # A float32 bias promotes y to float32 in torch, and so its amax.
    assert d.dtype == amax.dtype == torch.float32 and amax.shape == ()
    check_epilogue(bias_gelu_residual, ex)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(str(d) for d in s if d))
def test_reductions_every_axis(shape):
    def epilogue(acc, C, bias):
        y = acc + C
        return {
            "row_sum": y.sum(-1),
            "row_max_keep": y.amax(-1, keepdim=True),
            "col_mean": y.mean(-2),
            "col_min_keep": y.amin(dim=-2, keepdim=True),
            "tile_sum": y.sum(dim=(-2, -1)),
            "all_max": y.max(),
            "all_min": torch.min(y),
            "all_mean_keep": y.mean(dim=tuple(range(y.dim())), keepdim=True),
            "amax_abs": (y * bias).abs().amax(),
            "torch_sum": torch.sum(y, dim=-1),
            "positive_dims": y.sum(y.dim() - 1),
            "rms": torch.sqrt((y * y).mean(-1) + 1e-6),
        }

    graph = check_epilogue(epilogue, _inputs(shape, "C", "bias"))
    # row_sum, torch_sum and positive_dims are one reduction after CSE: 12 outputs, 10 reductions.
    assert graph.count("reduce") == 10
    assert all(graph.store(n).dtype == torch.float32 for n in ("row_sum", "all_max", "rms"))


def test_reduced_value_may_also_be_stored_and_used():
    def epilogue(acc, bias):
        y = F.gelu(acc + bias)
        return y, (y * y).sum(-1), y * 2

    check_epilogue(epilogue, _inputs(SHAPES[2], "bias"))


def test_output_dtypes_default_explicit_and_override():
    def epilogue(acc, C):
        return acc + C, (acc * 2).to(torch.bfloat16), acc.amax(), (acc - C).float()

    ex = _inputs(SHAPES[0]) | {"C": rand(32, 32, dtype=torch.float16, seed=7)}
    g = evtc.trace(epilogue, ex)
    # As torch: a float16 sum, an explicit bfloat16, the amax of a float16 value, an explicit float32.
    assert [s.dtype for s in g.stores] == [torch.float16, torch.bfloat16, torch.float16, torch.float32]
    assert [s.dtype for s in g.stores] == eager_dtypes(epilogue, ex)
    g = evtc.trace(epilogue, ex, out_dtypes={"D0": torch.float32, "D2": torch.bfloat16})
    assert [s.dtype for s in g.stores] == [torch.float32, torch.bfloat16, torch.bfloat16, torch.float32]
    g = evtc.trace(epilogue, ex, out_dtypes=torch.float8_e4m3fn)
    assert {s.dtype for s in g.stores} == {torch.float8_e4m3fn}
    check_epilogue(epilogue, ex, out_dtypes=[torch.float32, torch.float16, torch.float16, torch.bfloat16])
    with pytest.raises(evtc.OutputError, match="unknown output"):
        evtc.trace(epilogue, ex, out_dtypes={"E": torch.float32})
    with pytest.raises(evtc.DTypeError, match="not supported"):
        evtc.trace(epilogue, ex, out_dtypes=torch.int32)


def test_output_structures():
    ex = _inputs(SHAPES[0])
    single = evtc.trace(lambda acc: acc, ex)
    assert single.outputs.kind == "single" and isinstance(single.evaluate(ex), torch.Tensor)
    tup = evtc.trace(lambda acc: (acc, acc * 2), ex)
    assert isinstance(tup.evaluate(ex), tuple) and len(tup.evaluate(ex)) == 2
    lst = evtc.trace(lambda acc: [acc, acc + 1], ex)
    assert isinstance(lst.evaluate(ex), list)  # as the function returns it
    dct = evtc.trace(lambda acc: {"out": acc, "amax": acc.abs().amax()}, ex)
    assert list(dct.evaluate(ex)) == ["out", "amax"]


def test_returning_an_input_or_aux_store():
    def epilogue(acc, C):
        pre = acc + C
        return F.relu(pre), pre, C

    check_epilogue(epilogue, _inputs(SHAPES[3], "C"))


def test_reference_computes_in_float32_and_float64():
    ex = _inputs(SHAPES[0], "C")

    def epilogue(acc, C):
        return acc * C

    out32 = evtc.reference(epilogue, ex)
    out64 = evtc.reference(epilogue, ex, dtype=torch.float64)
    assert out32.dtype == torch.float32 and out64.dtype == torch.float64
    expected = (ex["a"].double() @ ex["b"].double()) * ex["C"].double()
    torch.testing.assert_close(out64, expected)
    assert ex["C"].dtype == torch.float32  # inputs untouched


def test_epilogue_decorator_is_callable_on_real_tensors():
    @evtc.epilogue
    def fused(acc, bias):
        return torch.relu(acc + bias)

    acc, bias = rand(4, 6), rand(6)
    torch.testing.assert_close(fused(acc, bias), torch.relu(acc + bias))
    assert fused.name == "fused" and "fused" in repr(fused)
    named = evtc.epilogue(name="other")(lambda acc: acc)
    assert named.name == "other"
    check_epilogue(fused, _inputs(SHAPES[1], "bias"))


def test_a_list_comes_back_a_list_on_every_path(tmp_path):
    """An epilogue returning a list gets a list from a call, the reference, out=, autograd, the
    custom operator under torch.compile and evtc.linear (it was a tuple)."""
    def as_list(acc, C):
        return [acc + C, (acc * 2).sum(-1)]

    a, b, C = rand(8, 16, seed=1), rand(16, 12, seed=2), rand(8, 12, seed=3)
    k = evtc.compile(as_list, dict(a=a, b=b, C=C), cache_dir=tmp_path)
    want = as_list(a.double() @ b.double(), C.double())

    def check(got):
        assert isinstance(got, list) and len(got) == 2
        for g, w in zip(got, want, strict=True):
            assert torch.allclose(g.double(), w, atol=1e-4, rtol=1e-4)

    check(k(a, b, C=C))
    check(evtc.reference(as_list, dict(a=a, b=b, C=C)))
    out = [torch.empty(8, 12), torch.empty(8)]
    got = k(a, b, C=C, out=out)
    check(got)
    assert got[0] is out[0]
    check(k(a.clone().requires_grad_(), b, C=C))
    torch._dynamo.reset()
    check(torch.compile(lambda a, b, C: k(a, b, C=C), backend="aot_eager", fullgraph=True)(a, b, C))
    w = b.t().contiguous()
    check(evtc.linear(as_list, dict(x=a, weight=w, C=C), cache_dir=tmp_path)(a, w, C=C))


def test_reference_leaves_the_callers_tensors_as_they_were():
    """evtc.reference runs the function on copies: an in-place op on a float32 operand or a given
    accumulator (whose conversion to float32 would be the tensor itself) changes nothing of the
    caller's."""
    def scale_in_place(acc, C):
        C.mul_(2)
        return acc + C

    a, b, C = torch.randn(8, 16), torch.randn(16, 4), torch.ones(8, 4)
    got = evtc.reference(scale_in_place, {"a": a, "b": b, "C": C})
    assert torch.equal(C, torch.ones(8, 4))
    torch.testing.assert_close(got, a.double().matmul(b.double()).float() + 2, rtol=1e-5, atol=1e-5)
    acc = torch.ones(8, 4)
    evtc.reference(lambda acc: acc.mul_(3), {}, acc=acc)
    assert torch.equal(acc, torch.ones(8, 4))


def test_reference_names_bad_inputs():
    def add(acc, C):
        return acc + C

    a, b, C = torch.randn(8, 16), torch.randn(16, 4), torch.randn(8, 4)
    for inputs, kwargs, error, match in [
            (None, {}, evtc.InputError, "inputs must be a dict"),
            ({"a": None, "b": b, "C": C}, {}, evtc.InputError, "a must be a tensor"),
            ({"a": a, "b": b[:15], "C": C}, {}, evtc.ShapeError, "a @ b"),
            ({"a": a, "b": b, "C": C}, {"dtype": "float64"}, evtc.InputError, "dtype must be")]:
        with pytest.raises(error, match=match):
            evtc.reference(add, inputs, **kwargs)
    with pytest.raises(evtc.InputError, match="must be a dict"):
        evtc.trace(add, [a, b])


def _shared_and_batched(acc, C):
    return acc * 2.0, C / 1.0


def test_an_output_the_same_in_every_batch_has_torchs_shape(tmp_path):
    """In a batched call, an output that reads no batched value (``C / 1.0`` of a shared (M, N) C)
    is (M, N) in torch. The kernel stores it per batch like the other outputs, and returned that
    (L, M, N) buffer (found by a random-program probe on the GPU); now the plan names it, the
    fake implementation and the call give (M, N) (the first batch), ``out=`` takes it in that
    shape, and an empty batch takes the torch path."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from evtc.plan.kernel_plan import KernelPlan

    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(2, 40, 16, generator=g), torch.randn(2, 16, 24, generator=g)
    C = torch.randn(40, 24, generator=g)
    k = evtc.compile(_shared_and_batched, {"a": a, "b": b, "C": C}, cache_dir=tmp_path)
    assert k.plan.batch_free == (("D1", 2),)
    assert KernelPlan.from_json(k.plan.to_json()).batch_free == (("D1", 2),)
    assert [shape for shape, _ in k.output_meta(40, 24, 2)] == [(2, 40, 24), (40, 24)]
    got = k(a, b, C=C)
    want = _shared_and_batched(a @ b, C)
    assert [t.shape for t in got] == [t.shape for t in want]
    torch.testing.assert_close(got[1], want[1])
    # Compiled with a (1, M, N) C: its output is (1, M, N) in torch.
    k1 = evtc.compile(_shared_and_batched, {"a": a, "b": b, "C": C[None]}, cache_dir=tmp_path)
    assert k1.plan.batch_free == (("D1", 3),)
    assert [shape for shape, _ in k1.output_meta(40, 24, 2)] == [(2, 40, 24), (1, 40, 24)]
    assert k1(a, b, C=C[None])[1].shape == (1, 40, 24)
    with FakeTensorMode() as mode:
        fake = k.op(mode.from_tensor(a), mode.from_tensor(b), mode.from_tensor(C))
    assert [t.shape for t in fake] == [(2, 40, 24), (40, 24)]
    # out= takes it in torch's shape (the kernel writes a buffer of its own, copied in).
    out = (torch.empty(2, 40, 24), torch.empty(24, 40).t())
    assert k(a, b, C=C, out=out) is not None and torch.equal(out[1], C)
    with pytest.raises(evtc.CallError, match=r"out\[1\]|D1"):
        k(a, b, C=C, out=(torch.empty(2, 40, 24), torch.empty(2, 40, 24)))
    empty = k(a[:0], b[:0], C=C)
    assert [t.shape for t in empty] == [(0, 40, 24), (40, 24)] and torch.equal(empty[1], C)
    # With the kernel path forced on this machine (no GPU: the launch is stubbed), the call's
    # own buffers come back in torch's shape, empty problems included.
    assert [k.call_spec.first_batch(i, t).shape for i, t in enumerate(k.call_spec.new_outputs(
        torch.device("cpu"), 0, 24, 2))] == [(2, 0, 24), (0, 24)]


def test_the_kernel_path_returns_an_output_the_same_in_every_batch_in_torchs_shape(tmp_path):
    """The kernel path itself (its launch emulated on the CPU: the stub writes what the kernel
    writes, every batch's tile, each output (L, M, N)): the call returns the batch-free output's
    first batch, in torch's shape, without out= and through out= (into a transposed target), at
    an empty M too; the other outputs whole."""
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(2, 40, 16, generator=g), torch.randn(2, 16, 24, generator=g)
    C = torch.randn(40, 24, generator=g)
    k = evtc.compile(_shared_and_batched, {"a": a, "b": b, "C": C}, cache_dir=tmp_path)

    def launch(a, b, outs, ins, clusters):  # what the kernel computes, per batch
        d0, d1 = outs
        d0.copy_((a @ b) * 2.0)
        d1.copy_((ins[0] / 1.0).expand_as(d1))

    k._kernel_runs = True  # as on a Hopper GPU
    for m in (40, 0):
        k._launch_memo[(m, 24, 16, 2, a.get_device())] = (launch, 1, None, k._finisher)
    got = k(a, b, C=C)
    assert k.last_path == "kernel"
    assert [t.shape for t in got] == [(2, 40, 24), (40, 24)]
    torch.testing.assert_close(got[0], (a @ b) * 2.0)
    torch.testing.assert_close(got[1], C)
    out = (torch.empty(2, 40, 24), torch.full((24, 40), float("nan")).t())
    returned = k(a, b, C=C, out=out)
    assert returned[1] is out[1] and torch.equal(out[1], C)
    empty = k(a[:, :0], b, C=C[:0])
    assert [t.shape for t in empty] == [(2, 0, 24), (0, 24)]


def _tile_and_row_sums(acc):
    return acc, acc.sum(dim=-1)


def test_a_wrong_out_for_a_reduction_names_what_was_given(tmp_path):
    """A reduction's out= of another shape or dtype is refused naming the shape and dtype it must
    have and those it was given (the message named only the first)."""
    a, b = torch.randn(8, 64).half(), torch.randn(64, 32).half()
    k = evtc.compile(_tile_and_row_sums, {"a": a, "b": b}, cache_dir=tmp_path)
    tile = torch.empty(8, 32, dtype=torch.float16)
    with pytest.raises(evtc.CallError, match=r"out\['D1'\] must be a torch.float16 tensor of shape "
                       r"\(8,\), got a tensor of shape \(4,\) \(torch.float32\)"):
        k(a, b, out=(tile, torch.empty(4)))
    with pytest.raises(evtc.CallError, match=r"shape \(8,\), got a tensor of shape \(8,\) \(torch.float32\)"):
        k(a, b, out=(tile, torch.empty(8)))
    sums = torch.full((8,), float("nan"), dtype=torch.float16)
    k(a, b, out=(tile, sums))
    torch.testing.assert_close(sums.float(), (a.double() @ b.double()).sum(-1).float(), rtol=2e-3, atol=0.5)
