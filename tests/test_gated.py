"""CPU: gated epilogues (acc.chunk(2, dim=-1)) through tracing, the reference, the split pass and the
generated code, and the errors for what the kernel cannot do."""

from __future__ import annotations

import pytest
import sympy
import torch
import torch.nn.functional as F

import evtc
from evtc.ir.passes.gated import is_gated, kernel_graph, split_halves
from evtc.ir.shapes import HALF_N, M, N


def inputs(m=64, n=256, k=32, **extra):
    g = torch.Generator().manual_seed(0)
    out = {"a": torch.randn(m, k, generator=g).half(), "b": torch.randn(k, n, generator=g).half()}
    for name, shape in extra.items():
        out[name] = torch.randn(shape, generator=g).half()
    return out


def swiglu_bias_residual(acc, bias, residual):
    gate, up = (acc + bias).chunk(2, dim=-1)
    return F.silu(gate) * up + residual, (gate * up).sum(-1)


def test_reference_is_torch_on_the_halves():
    x = inputs(bias=(256,), residual=(64, 128))
    y, sums = evtc.reference(swiglu_bias_residual, x)
    acc = x["a"].float() @ x["b"].float() + x["bias"].float()
    gate, up = acc[:, :128], acc[:, 128:]
    torch.testing.assert_close(y, F.silu(gate) * up + x["residual"].float())
    torch.testing.assert_close(sums, (gate * up).sum(-1))


@pytest.mark.parametrize("split", [
    lambda acc: acc.chunk(2, dim=-1),
    lambda acc: torch.chunk(acc, 2, -1),
    lambda acc: acc.split(128, dim=-1),
    lambda acc: torch.split(acc, [128, 128], dim=1),
    lambda acc: torch.split(acc, [acc.shape[-1] // 2, acc.shape[-1] // 2], -1),
])
def test_every_spelling_of_the_split(split):
    def fn(acc):
        gate, up = split(acc)
        return gate * up

    graph = evtc.trace(fn, inputs())
    assert is_gated(graph) and graph.count("half") == 2
    assert graph.stores[0].shape == (M, HALF_N)


def test_split_pass_halves_wide_values_and_renames_n():
    graph = evtc.trace(swiglu_bias_residual, inputs(bias=(256,), residual=(64, 128)))
    assert graph.operands["bias"].shape == (N,) and graph.operands["residual"].shape == (M, HALF_N)
    split = split_halves(graph)
    assert split.gated and not is_gated(split)  # no half nodes left
    assert list(split.operands) == ["bias.gate", "bias.up", "residual"]
    assert split.operands["bias.up"].half_of == ("bias", 1)
    assert split.operands["bias.gate"].shape == (N,) and split.operands["residual"].shape == (M, N)
    assert sorted(n.attrs["half"] for n in split.nodes if n.op == "acc") == [0, 1]
    # every shape is in the output's width now: no N/2 anywhere
    assert all(sympy.sympify(d) != HALF_N for n in split.nodes for d in n.shape)
    assert "%acc.gate" in str(split) and "(a @ b).chunk(2, -1)[1]" in str(split)


def test_split_graph_keeps_the_mean_of_a_half_right():
    def fn(acc):
        gate, up = acc.chunk(2, -1)
        return gate * up, (gate * up).mean(-1)

    split = kernel_graph(evtc.trace(fn, inputs()))
    literals = [sympy.sympify(n.attrs["value"]) for n in split.nodes if n.op == "literal"]
    assert 1 / N in literals  # 1/(N/2) of the user's N is 1/N of the output's


def test_generated_fragment_takes_both_halves(tmp_path):
    meta = {k: v.to("meta") for k, v in inputs(bias=(256,), residual=(64, 128)).items()}
    k = evtc.compile(swiglu_bias_residual, meta, cache_dir=tmp_path)
    assert k.config.gated and "gated" in k.config.short_name()
    assert "def fragment(self, acc_gate, acc_up, bias_gate, bias_up, residual)" in k.source
    assert "gated = True" in k.source
    assert k.operand_names == ["bias", "residual"]
    assert "wgmma.mma_async" in k.ptx and "rcp.approx" in k.ptx


def test_full_width_outputs_and_reductions_are_rejected_at_the_line():
    def returns_acc(acc):
        gate, up = acc.chunk(2, -1)
        return gate * up, acc * 2  # error here

    def reduces_acc(acc):
        gate, up = acc.chunk(2, -1)
        return gate * up, acc.sum(-1)  # error here

    meta = {k: v.to("meta") for k, v in inputs().items()}
    with pytest.raises(evtc.ShapeError, match="half as wide") as err:
        evtc.compile(returns_acc, meta)
    assert "error here" in str(err.value)
    with pytest.raises(evtc.ReductionError, match="as wide as the accumulator") as err:
        evtc.compile(reduces_acc, meta)
    assert "error here" in str(err.value)


@pytest.mark.parametrize("body, message", [
    (lambda acc: acc.chunk(3, dim=-1)[0], "2 halves only"),
    (lambda acc: acc.chunk(2, dim=0)[0], "only the last dim"),
    (lambda acc: acc.split(64, dim=-1)[0], "2 equal halves"),
    # q, k, v of a fused projection: the hint is to split the result, not to chunk in two
    (lambda acc: acc.split([128, 64, 64], dim=-1)[0], r"makes 3 parts .*split the result after the call"),
    (lambda acc: acc.split([200, 56], dim=-1)[0], r"write x.chunk\(2, dim=-1\)"),
])
def test_other_splits_are_rejected(body, message):
    def fn(acc):
        return body(acc)

    with pytest.raises(evtc.UnsupportedOpError, match=message):
        evtc.trace(fn, inputs())


def test_chunk_of_a_narrow_value_is_a_shape_error():
    def fn(acc, s):
        gate, up = (acc.chunk(2, -1)[0] * s).chunk(2, -1)
        return gate * up

    with pytest.raises(evtc.ShapeError, match="only values as wide as the accumulator"):
        evtc.trace(fn, inputs(s=(128,)))


def test_split_graph_evaluates_like_the_users():
    x = inputs(bias=(256,), residual=(64, 128))
    graph = evtc.trace(swiglu_bias_residual, x)
    got = kernel_graph(graph).evaluate(x)
    want = graph.evaluate(x)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_odd_n_and_bad_dims_are_rejected_when_tracing():
    def fn(acc):
        gate, up = acc.chunk(2, dim=-1)
        return gate * up

    def dim3(acc):
        return acc.chunk(2, dim=3)[0]

    with pytest.raises(evtc.UnsupportedOpError, match="even N"):
        evtc.trace(fn, inputs(n=255))
    with pytest.raises(evtc.UnsupportedOpError, match="only the last dim"):
        evtc.trace(dim3, inputs())


def test_halves_of_an_n_major_b_must_be_whole_swizzle_rows(tmp_path):
    meta = {k: v.to("meta") for k, v in inputs().items()}
    for tile_n, schedule in ((64, "pingpong"), (192, "cooperative")):
        with pytest.raises(evtc.CompileError, match=f"halves of {tile_n // 2} columns, not a multiple of 64"):
            evtc.compile(_swiglu, {"a": meta["a"], "b": meta["b"]},
                         config={"tile_n": tile_n, "schedule": schedule}, cache_dir=tmp_path)
    # K-major B (a linear layer's weight) has no such limit
    w = torch.empty(256, 32, dtype=torch.float16, device="meta")
    k = evtc.compile(_swiglu, {"a": meta["a"], "b": w.t()}, config={"tile_n": 64}, cache_dir=tmp_path)
    assert k.config.gated and k.config.out_tile_n == 32


def _swiglu(acc):
    gate, up = acc.chunk(2, dim=-1)
    return F.silu(gate) * up


def test_call_errors_name_the_users_tensors(tmp_path):
    """On CPU tensors the checks run before the missing GPU is reported."""
    x = inputs(bias=(256,), residual=(64, 128))
    meta = {k: v.to("meta") for k, v in x.items()}
    k = evtc.compile(swiglu_bias_residual, meta, cache_dir=tmp_path)
    a, b = x["a"], x["b"]
    ops = {"bias": x["bias"], "residual": x["residual"]}
    with pytest.raises(evtc.CallError, match="unexpected argument"):
        k(a, b, **ops, typo=1.0)
    with pytest.raises(evtc.CallError, match=r"bias must be a tensor whose last dim is N = 256"):
        k(a, b, bias=torch.randn(257).half(), residual=ops["residual"])
    with pytest.raises(evtc.CallError, match="bias must be a tensor"):
        k(a, b, bias=1.0, residual=ops["residual"])
    with pytest.raises(evtc.CallError, match="N must be even"):
        k(a, torch.randn(32, 255).half(), **ops)
    # Halves of 60 (120 bytes, not a multiple of 16) are no error: the GPU stages them
    # (tests/test_call_paths_gpu.py) and on the CPU the torch path computes the function.
    odd = dict(a=a, b=torch.randn(32, 2 * 60).half(), bias=torch.randn(120).half(),
               residual=torch.randn(64, 60).half())
    if not torch.cuda.is_available():
        got, want = k(**odd), evtc.reference(swiglu_bias_residual, odd)
        torch.testing.assert_close(got[0].float(), want[0].half().float(), rtol=2e-3, atol=2e-3)
        assert got[1].dtype == torch.float16  # a sum of float16 values, as in torch
        torch.testing.assert_close(got[1].float(), want[1].half().float(), rtol=2e-3, atol=2e-3)


def test_a_broadcast_gated_operand_is_told_to_expand(tmp_path):
    """A per-expert bias of a gated batched kernel given as (1, 1, 2N): its halves are views, not
    broadcast; the message names the rule and the full shape."""
    def moe_gated(acc, bias):
        gate, up = (acc + bias).chunk(2, dim=-1)
        return F.silu(gate) * up

    a, b = torch.randn(3, 8, 32).half(), torch.randn(3, 32, 64).half()
    k = evtc.compile(moe_gated, dict(a=a, b=b, bias=torch.randn(3, 1, 64).half()), cache_dir=tmp_path)
    with pytest.raises(evtc.CallError, match=r"split into gate and up halves, which are not broadcast: "
                                             r"pass it at its full shape \(3, 1, 64\)"):
        k(a, b, bias=torch.randn(1, 1, 64).half())


def test_joined_graph_evaluates_like_the_users():
    """join_halves undoes split_halves: the kernel's split graph, joined again, computes what the
    user's graph computes (the backward of a gated kernel's operator is derived from it), with the
    accumulator and wide operands whole and the mean of a half still over the half."""
    from compile_catalogue import CATALOGUE, make_inputs

    from evtc.ir.passes.gated import join_halves

    def mean_of_half(acc, bias):
        gate, up = (acc + bias).chunk(2, dim=-1)
        y = F.silu(gate) * up
        return y, y.mean(-1)  # 1/N of the half's width, N/2 in the user's coordinates

    cases = [(swiglu_bias_residual, inputs(bias=(256,), residual=(64, 128)), None),
             (mean_of_half, inputs(bias=(256,)), None)]
    for entry in CATALOGUE:
        x = make_inputs(entry, 64, 256, 32, 2 if entry.batched else None, torch.float32, device="cpu")
        if is_gated(evtc.trace(entry.fn, x, out_dtypes=entry.out_dtypes)):
            cases.append((entry.fn, x, entry.out_dtypes))
    assert len(cases) >= 5
    for fn, x, out_dtypes in cases:
        graph = evtc.trace(fn, x, out_dtypes=out_dtypes)
        joined = join_halves(kernel_graph(graph))
        assert not joined.gated and any(n.op == "half" for n in joined.nodes)
        assert list(joined.operands) == list(graph.operands), fn.__name__
        got, want = joined.evaluate(x), graph.evaluate(x)
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        for g, w in zip(got, want, strict=True):
            # Not bit for bit: torch's vectorised gelu rounds a strided half differently by an ulp.
            torch.testing.assert_close(g, w, rtol=2e-6, atol=1e-5, msg=fn.__name__)


def test_a_split_no_output_reads_is_refused_by_name(tmp_path):
    """chunk(2) whose halves no output reads leaves values half as wide as the GEMM that no kernel
    computes from: a ShapeError at the user's line (it crashed with KeyError 'N/2' in the launcher)."""
    def halves_unused(acc, C):
        gate, up = acc.chunk(2, dim=-1)
        return C * 2.0

    a, b, C = torch.randn(9, 5).half(), torch.randn(5, 12).half(), torch.randn(9, 6)
    with pytest.raises(evtc.ShapeError, match="no output reads either half") as info:
        evtc.compile(halves_unused, dict(a=a, b=b, C=C), cache_dir=tmp_path)
    assert "test_gated.py" in str(info.value)


def test_an_unused_operand_half_as_wide_is_not_a_split(tmp_path):
    """An operand that happens to be N/2 wide but is never read does not make an epilogue gated."""
    def maybe_residual(acc, R, use: bool = False):
        return acc + R if use else acc * 2

    a, b, R = torch.randn(9, 5).half(), torch.randn(5, 64).half(), torch.randn(9, 32)
    k = evtc.compile(maybe_residual, dict(a=a, b=b, R=R), cache_dir=tmp_path)
    torch.testing.assert_close(k(a, b, R=R).float(), (a.float() @ b.float() * 2).half().float())


def test_a_literal_split_fixes_n(tmp_path):
    """split(128, -1) makes two halves only where N is 256 (torch's function fails for another N):
    the kernel refuses other Ns by name, through its plan's JSON too; chunk(2) serves every N."""
    def fixed(acc):
        gate, up = acc.split(128, dim=-1)
        return F.silu(gate) * up

    x = inputs()
    k = evtc.compile(fixed, x, cache_dir=tmp_path)
    assert k.plan.interface.fixed_n == 256
    assert type(k.plan).from_json(k.plan.to_json()).interface.fixed_n == 256
    if not torch.cuda.is_available():
        want = evtc.reference(fixed, x).half().float()
        torch.testing.assert_close(k(**x).float(), want, rtol=2e-3, atol=2e-3)
    with pytest.raises(evtc.CallError, match="halves of a fixed size"):
        k(x["a"], torch.randn(x["b"].shape[0], 512).half())
    with pytest.raises(ValueError):  # torch's own function fails there too (4 pieces for 2 names)
        fixed(x["a"].float() @ torch.randn(x["b"].shape[0], 512))
    free = evtc.compile(_swiglu, x, cache_dir=tmp_path)
    assert free.plan.interface.fixed_n is None
