"""The first layer's dZ as an epilogue of the GEMM that makes its incoming gradient
(evtc.ir.backward_epilogue), and evtc.nn.MLP, the pair that uses it.

The generated epilogue is plain torch: run on tensors in float64, it must equal torch.autograd's
gradient of the forward epilogue with respect to its accumulator. Epilogues whose dZ is not one
elementwise pass get none. On the CPU, evtc.nn.MLP takes the unfused backward (the fused kernel is
GPU-only; tests/test_mlp_gpu.py runs it): its gradients against torch.autograd in float32."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from mlp_cases import add_residual, bias_gelu, geglu_tanh, relu_squared, residual_bias, swiglu

import evtc
from evtc.ir.autodiff import backward
from evtc.ir.backward_epilogue import dz_epilogue

F64 = torch.float64


def gated_relu_bias(acc, bias):
    gate, up = acc.chunk(2, dim=-1)
    return torch.relu(gate) * (up + bias)


def scaled_leaky(acc, scale, alpha: float):
    return F.leaky_relu(acc * scale * alpha, 0.2)


def softplus_mish(acc):
    return F.softplus(acc, beta=2.0, threshold=10.0) + F.mish(acc)


def hard_ones(acc):
    return F.hardswish(acc) * F.hardsigmoid(acc) + torch.clamp(acc, -1.0, 1.0)


def linear_only(acc, residual):
    return 0.5 * acc + residual


def constant_bases(acc):
    # pow's gradient in the exponent masks base == 0 where the exponent is >= 0: a comparison of
    # constants beside one of the accumulator in the backward graph.
    return 10.0 ** (acc * 0.25) + 0.0 ** (acc * acc + 1.0)


ACTIVATIONS = [
    (swiglu, {}),
    (geglu_tanh, {}),
    (gated_relu_bias, {"bias": (12,)}),
    (bias_gelu, {"bias": (12,)}),
    (scaled_leaky, {"scale": (7, 1), "alpha": 1.5}),
    (relu_squared, {}),
    (softplus_mish, {}),
    (hard_ones, {}),
    (linear_only, {"residual": (7, 12)}),
    (constant_bases, {}),
]


def _gated(fn) -> bool:
    return fn in (swiglu, geglu_tanh, gated_relu_bias)


@pytest.mark.parametrize("fn, spec", ACTIVATIONS, ids=[f.__name__ for f, _ in ACTIVATIONS])
def test_generated_dz_equals_autograd(fn, spec):
    g = torch.Generator().manual_seed(1)
    m, k, width = 7, 9, 12
    n = 2 * width if _gated(fn) else width
    a, b = torch.randn(m, k, generator=g, dtype=F64), torch.randn(k, n, generator=g, dtype=F64)
    ops = {name: torch.randn(*shape, generator=g, dtype=F64) if isinstance(shape, tuple) else shape
           for name, shape in spec.items()}
    as_f32 = {k: v.float() if isinstance(v, torch.Tensor) else v for k, v in ops.items()}
    graph = evtc.trace(fn, {"a": a.float(), "b": b.float(), **as_f32})
    epilogue = dz_epilogue(backward(graph), F64, name=graph.name)
    assert epilogue is not None, epilogue
    assert epilogue.gated == _gated(fn)

    acc = (a @ b).requires_grad_()
    y = fn(acc, **ops)
    dy = torch.randn(y.shape, generator=g, dtype=F64)
    (want,) = torch.autograd.grad(y, acc, dy)

    saved = dict(zip(("saved_gate", "saved_up"), acc.detach().chunk(2, dim=-1), strict=True)) \
        if epilogue.gated else {"saved": acc.detach()}
    feeds = {name: saved[name] for name in epilogue.saved}
    feeds.update({name: ops[name] for name in epilogue.operands})
    got = epilogue.fn(dy, **feeds)
    got = torch.cat(got, dim=-1) if epilogue.gated else got
    # (Literals of the rules such as 1/6 are kept at float32 precision, as the kernel computes.)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)
    # Readable: one line per value, the halves returned as two outputs.
    assert epilogue.source.startswith(f"def {graph.name}_dz(grad")
    if fn is linear_only:
        assert epilogue.saved == ()  # dZ = 0.5 * dY reads nothing of the forward


def test_a_generated_epilogue_with_constant_masks_traces():
    """A mask op with a constant side is that side or the other one in the generated source: the
    tracer takes no Python bool in a mask op (the fused dZ kernel could not compile)."""
    ex = {"a": torch.randn(8, 16), "b": torch.randn(16, 32)}
    epilogue = dz_epilogue(backward(evtc.trace(constant_bases, ex)), torch.bfloat16)
    assert epilogue is not None and "False" not in epilogue.source and "True" not in epilogue.source
    evtc.trace(epilogue.fn, {**ex, "saved": torch.randn(8, 32)})


def test_the_generated_epilogue_traces_to_two_outputs():
    meta = {"device": "meta", "dtype": torch.bfloat16}
    graph = evtc.trace(swiglu, {"a": torch.empty(8, 16, **meta), "b": torch.empty(16, 32, **meta)})
    epilogue = dz_epilogue(backward(graph), torch.bfloat16, name="swiglu")
    assert epilogue.saved == ("saved_gate", "saved_up")
    dz = evtc.trace(epilogue.fn, {"a": torch.empty(8, 16, **meta), "b": torch.empty(16, 24, **meta),
                                  "saved_gate": torch.empty(8, 24, **meta),
                                  "saved_up": torch.empty(8, 24, **meta)})
    assert [s.dtype for s in dz.stores] == [torch.bfloat16, torch.bfloat16]
    assert dz.count("acc") == 1 and dz.count("sigmoid") == 1


def two_outputs(acc):
    return torch.relu(acc), acc.sum(-1)


def wide_operand_gated(acc, scale):
    gate, up = (acc * scale).chunk(2, dim=-1)
    return F.silu(gate) * up


def row_max_output(acc):
    y = torch.tanh(acc)
    return y, y.amax(-1)


@pytest.mark.parametrize("fn, ops", [
    (two_outputs, {}),                                 # dZ sums two incoming gradients: two accumulators
    (row_max_output, {}),                              # the forward's row maxima inside dZ
], ids=["two_outputs", "row_max_output"])
def test_no_dz_epilogue_where_it_is_not_one_elementwise_pass(fn, ops):
    meta = {"device": "meta", "dtype": torch.float32}
    example = {"a": torch.empty(7, 9, **meta), "b": torch.empty(9, 24, **meta),
               **{name: torch.empty(*shape, **meta) for name, shape in ops.items()}}
    graph = evtc.trace(fn, example)
    back = backward(graph)
    assert dz_epilogue(back, torch.bfloat16) is None
    # With the incoming gradients as operands (the layer's pass, the operator's recomputing GEMM),
    # two outputs' gradients are two operands; a reduction of the forward stays out.
    assert (dz_epilogue(back, torch.bfloat16, grad_operand=True) is None) == (fn is row_max_output)


def test_mlp_dz_epilogue_reads_an_operand_as_wide_as_the_gemm_as_its_halves():
    """A gated activation over ``acc * scale`` with ``scale`` as wide as the forward's GEMM (before
    the split): in the MLP's form (the incoming gradient as the accumulator, as wide as one half),
    the scale is taken as its gate and up halves, and dZ (and, trained, the scale's gradient from
    dZ's two halves) equals torch autograd's in float64."""
    g = torch.Generator().manual_seed(4)
    meta = {"device": "meta", "dtype": torch.float32}
    graph = evtc.trace(wide_operand_gated, {"a": torch.empty(7, 9, **meta), "b": torch.empty(9, 24, **meta),
                                            "scale": torch.empty(7, 24, **meta)})
    back = backward(graph)
    acc = torch.randn(7, 24, generator=g, dtype=F64).requires_grad_()
    scale = torch.randn(7, 24, generator=g, dtype=F64).requires_grad_()
    dy = torch.randn(7, 12, generator=g, dtype=F64)
    want_dz, want_scale = torch.autograd.grad(wide_operand_gated(acc, scale), [acc, scale], dy)
    for trained in ((), ("scale",)):
        epilogue = dz_epilogue(back, F64, operand_grads=trained)
        assert epilogue is not None and epilogue.gated
        assert [(operand, index) for _, operand, index in epilogue.halves] == [("scale", 0), ("scale", 1)]
        feeds = dict(zip(epilogue.saved, [h.detach() for h in acc.chunk(2, -1)], strict=True))
        feeds.update({param: scale.detach()[:, 12 * index:12 * (index + 1)]
                      for param, _, index in epilogue.halves})
        gate, up, *rest = epilogue.fn(dy, **feeds)
        torch.testing.assert_close(torch.cat([gate, up], -1), want_dz, rtol=1e-12, atol=1e-12)
        if trained:
            assert epilogue.split_grads == ("scale",)
            torch.testing.assert_close(torch.cat(rest, -1), want_scale, rtol=1e-12, atol=1e-12)
        else:
            assert rest == []


@pytest.mark.parametrize("activation, output, bias", [
    (swiglu, add_residual, False),
    (bias_gelu, residual_bias, True),
    (relu_squared, None, False),
])
def test_mlp_gradients_against_autograd(activation, output, bias):
    torch.manual_seed(0)
    block = evtc.nn.MLP(16, 24, activation, output, bias=bias, dtype=torch.float32)
    assert block.gated == (activation is swiglu)
    assert block.up.weight.shape == ((48 if block.gated else 24), 16)
    x = torch.randn(3, 5, 16, requires_grad=True)
    operands = {} if output is None else {"residual": x}
    y = block(x, **operands)

    params = [p.detach().clone().requires_grad_() for p in block.parameters()]
    names = [name for name, _ in block.named_parameters()]
    ref = dict(zip(names, params, strict=True))
    xr = x.detach().clone().requires_grad_()
    h = xr @ ref["up.weight"].t()
    h = activation(h, ref["up.bias"]) if bias else activation(h)
    out = h @ ref["down.weight"].t()
    kw = {"residual": xr} if output is not None else {}
    if bias:
        kw["bias"] = ref["down.bias"]
    want = output(out, **kw) if output is not None else out
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)

    dy = torch.randn(want.shape)
    mine = torch.autograd.grad(y, [x, *block.parameters()], dy)
    theirs = torch.autograd.grad(want, [xr, *params], dy)
    for name, got, exp in zip(["x", *names], mine, theirs, strict=True):
        torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-5, msg=name)


def test_mlp_without_grad_is_the_two_layers():
    block = evtc.nn.MLP(8, 12, swiglu, add_residual, dtype=torch.float32)
    x = torch.randn(4, 8)
    with torch.no_grad():
        got = block(x, residual=x)
        want = block.down(block.up(x), residual=x)
    torch.testing.assert_close(got, want)


def test_mlp_refuses_an_activation_with_two_outputs():
    block = evtc.nn.MLP(8, 12, two_outputs, dtype=torch.float32)
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(evtc.CallError, match="activation must return one tensor"):
        block(x)


def _random_programs(count: int):
    """Fuzzer programs of seed 11 (as tests/test_autodiff.py takes them; ``EVTC_DZ_SEED`` names
    another) with float64 inputs on the CPU: (name, traced graph, inputs), those evtc traces."""
    from epilogue_cases import make_inputs as case_inputs
    from epilogue_cases import random_case

    for index in range(count):
        case = random_case(int(os.environ.get("EVTC_DZ_SEED", 11)), index)
        m, n, k = 20, 24 * (2 if case.gated else 1), 16
        inputs = case_inputs(case, m, n, k, device="cpu", seed=index)
        if not all(isinstance(inputs[x], torch.Tensor) for x in ("a", "b")):
            continue  # block-scaled float8 pairs: no derivative through them
        traced = {name: (v.float() if isinstance(v, torch.Tensor) and v.dtype.is_floating_point else v)
                  for name, v in inputs.items()}
        try:
            graph = evtc.trace(case.function(), traced, out_dtypes=case.output_dtypes())
        except evtc.EpilogueError:
            continue
        wide = {name: (v.to(F64) if isinstance(v, torch.Tensor) and v.dtype.is_floating_point else v)
                for name, v in inputs.items()}
        yield case.name, graph, wide


def test_generated_dz_of_random_programs_equals_the_backward_graph():
    """Over random programs, each of the three forms of the generated dZ epilogue (the incoming
    gradient as the accumulator, as evtc.nn.MLP compiles it; as a tile operand beside the saved
    accumulator, with every float operand's gradient, as evtc.dz_pass compiles it for a layer;
    and beside the recomputed accumulator, as for a kernel's operator; the last two with each
    output's incoming gradient an operand of its own where the program has several outputs), run
    on float64 tensors, equals the backward graph evaluated by the interpreter: dZ and the
    operands' gradients. The
    generator writes every op of the graph it accepts as torch code, so a wrong spelling (an
    argument order, a constant, a sum's axis) shows here."""
    from evtc.ir.interpreter import accumulator, evaluate
    from evtc.ir.shapes import L, M, N, evaluate_shape

    forms = {"mlp": 0, "mlp, operands trained": 0, "layer": 0, "operator": 0, "layer, operands frozen": 0}
    mlp_forms = ("mlp", "mlp, operands trained")
    several = {"layer": 0, "operator": 0}  # of those, programs of several outputs
    wide_halves = wide_grads = 0  # forms given a wide operand's halves, and giving its gradient
    for name, graph, inputs in _random_programs(300):
        back = backward(graph)
        if graph.acc_name not in back.input_grads:
            continue
        g = torch.Generator().manual_seed(len(name))
        acc = accumulator(inputs["a"], inputs["b"], F64)
        operands = {k: v for k, v in inputs.items() if k not in ("a", "b")}
        sizes = {M: acc.shape[-2], N: acc.shape[-1] // (2 if graph.gated else 1),
                 L: acc.shape[0] if acc.dim() == 3 else 1}
        dys = {grad: torch.randn(evaluate_shape(back.grad_shapes[grad], sizes), generator=g, dtype=F64)
               for grad in back.output_grads.values()}
        want = evaluate(back.graph, {graph.acc_name: acc, **dys, **operands}, compute_dtype=F64,
                        cast_outputs=False)
        want_dz = want[graph.acc_name].expand(acc.shape)
        trained = tuple(k for k, v in operands.items() if isinstance(v, torch.Tensor)
                        and v.dtype.is_floating_point and k in back.input_grads)
        halves = {"saved": acc, **dict(zip(("saved_gate", "saved_up"), acc.chunk(2, dim=-1), strict=True))}
        for form in forms:
            with_grads = form in ("layer", "operator", "mlp, operands trained")
            # Casts to float32 hold float64 here, as the interpreter's compute dtype holds them.
            epilogue = dz_epilogue(back, F64, name=graph.name, grad_operand=form not in mlp_forms,
                                   operand_grads=trained if with_grads else (), recompute=form == "operator",
                                   compute_dtype=F64)
            if epilogue is None or (form == "operator" and not epilogue.reads_acc):
                continue
            feeds = {k: halves[k] for k in epilogue.saved}
            feeds.update({k: operands[k] for k in epilogue.operands})
            for param, operand, index in epilogue.halves:
                half = operands[operand].shape[-1] // 2
                feeds[param] = operands[operand][..., index * half:(index + 1) * half]
            wide_halves += bool(epilogue.halves)
            wide_grads += bool(epilogue.split_grads)
            grads = {param: dys[back.output_grads[output]] for param, output in epilogue.grads}
            if form in mlp_forms:
                (dy,) = grads.values()
                result = epilogue.fn(dy, **feeds)
            else:
                # The layer's form never reads its acc (its pass's GEMM, as wide as the saved halves
                # of a gated epilogue), only its sizes: a value that would show if it did.
                width = acc.shape[-1] // (2 if epilogue.gated else 1)
                pass_tile = acc[..., :width].clone().fill_(float("nan"))
                result = epilogue.fn(acc if form == "operator" else pass_tile, **grads, **feeds)
            outs = result if isinstance(result, tuple) else (result,)
            count = 2 if epilogue.gated else 1
            dz = torch.cat(outs[:count], dim=-1) if epilogue.gated else outs[0]
            torch.testing.assert_close(dz.expand(acc.shape), want_dz, rtol=1e-9, atol=1e-12,
                                       msg=lambda m, n=name, f=form: f"{n} ({f}): dZ: {m}")
            rest = list(outs[count:])
            for operand in epilogue.operand_grads:
                # A wide operand's gradient comes as its two halves.
                parts = 2 if operand in epilogue.split_grads else 1
                got, rest = (rest[0] if parts == 1 else torch.cat(rest[:2], dim=-1)), rest[parts:]
                ref = want[operand]
                shape = operands[operand].shape
                ref = ref.expand(shape) if ref.numel() == 1 else ref.reshape(shape)
                # The sums run in float32 by design (as the kernel's reductions do): their rounding.
                torch.testing.assert_close(got.to(F64).reshape(shape), ref, rtol=1e-5,
                                           atol=1e-5 * ref.abs().max().item() + 1e-12,
                                           msg=lambda m, n=name, o=operand: f"{n}: gradient of {o}: {m}")
            forms[form] += 1
            if len(back.output_grads) > 1 and form in several:
                several[form] += 1
    # Not vacuous: each form was generated and compared for a good share of the programs.
    assert min(forms.values()) >= 15 and min(several.values()) >= 15, (forms, several)
    # Gated programs with a wide operand (5 and 1 of the 300; tests/test_linear_autograd.py has more).
    assert wide_halves >= 3 and wide_grads >= 1, (wide_halves, wide_grads)


def test_operand_gradients_leave_as_sums_in_float32_and_tiles_in_their_dtype():
    """A bias used twice (its gradient a sum of two column sums) and a tile operand, both trained,
    bfloat16: the bias's gradient stays float32 (as every sum), the tile's is written in bfloat16
    (``tile_grad_dtypes``), and both equal torch.autograd's."""
    def fn(acc, bias, C):
        return F.gelu(acc + bias) * bias * C

    g = torch.Generator().manual_seed(3)
    m, k, n = 6, 8, 12
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    bias, C = torch.randn(n, generator=g), torch.randn(m, n, generator=g)
    graph = evtc.trace(fn, {"a": a.bfloat16(), "b": b.bfloat16(), "bias": bias.bfloat16(), "C": C.bfloat16()})
    epilogue = dz_epilogue(backward(graph), torch.bfloat16, name="f", grad_operand=True,
                           operand_grads=("bias", "C"),
                           tile_grad_dtypes={"bias": torch.bfloat16, "C": torch.bfloat16})
    acc = (a @ b).double().requires_grad_()
    bias64, C64 = bias.double().requires_grad_(), C.double().requires_grad_()
    dy = torch.randn(m, n, generator=g, dtype=F64)
    want = torch.autograd.grad(fn(acc, bias64, C64), [acc, bias64, C64], dy)
    dz, d_bias, d_C = epilogue.fn(None, dy.float(), acc.detach().float(), bias.bfloat16(), C.bfloat16())
    assert (dz.dtype, d_bias.dtype, d_C.dtype) == (torch.bfloat16, torch.float32, torch.bfloat16)
    for name, got, ref in zip(["dZ", "bias", "C"], (dz, d_bias, d_C), want, strict=True):
        err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < 2e-2, f"{name}: relative error {err:.3g}"


def scaled_by_sizes(acc, bias):
    y = torch.tanh(acc + bias) * (acc.shape[-2] / acc.shape[-1])
    return y, y.mean(-1)


def gated_mean_of_rows(acc, bias):
    gate, up = (acc + bias).chunk(2, dim=-1)
    h = F.silu(gate) * up
    return h, h.mean(-1, keepdim=True)


@pytest.mark.parametrize("fn, gated", [(scaled_by_sizes, False), (gated_mean_of_rows, True)])
def test_sizes_of_the_forward_in_dz(fn, gated):
    """Literals of the forward's sizes (a mean's 1/N, a function's own ``acc.shape``): each form of
    the generated dZ reads them from its GEMM's accumulator (``size_n`` twice its width where that
    GEMM is as wide as a gated epilogue's halves), and equals torch autograd in float64; the
    recomputing form of a gated epilogue splits ``acc + bias`` as the forward does, with the bias
    as wide as the GEMM, and a layer's pass computes each half from the saved halves and the
    bias's halves."""
    g = torch.Generator().manual_seed(2)
    m, k, n = 7, 9, 24
    a, b = torch.randn(m, k, generator=g, dtype=F64), torch.randn(k, n, generator=g, dtype=F64)
    bias = torch.randn(n, generator=g, dtype=F64)
    graph = evtc.trace(fn, {"a": a.float(), "b": b.float(), "bias": bias.float()})
    back = backward(graph)
    acc = (a @ b).requires_grad_()
    outs = fn(acc, bias)
    dys = [torch.randn(o.shape, generator=g, dtype=F64) for o in outs]
    (want,) = torch.autograd.grad(outs, acc, dys)
    by_output = dict(zip(back.output_grads, dys, strict=True))
    halves = {"saved": acc.detach(),
              **dict(zip(("saved_gate", "saved_up"), acc.detach().chunk(2, dim=-1), strict=True))}
    for form in ("layer", "operator"):
        epilogue = dz_epilogue(back, F64, name=graph.name, grad_operand=True, recompute=form == "operator")
        assert epilogue is not None, form
        # A layer's gated pass takes the wide bias as two halves, beside the saved halves.
        assert [(operand, index) for _, operand, index in epilogue.halves] == (
            [("bias", 0), ("bias", 1)] if gated and form == "layer" else [])
        assert "size_n = " in epilogue.source and "size_m" in epilogue.source
        grads = {param: by_output[output].reshape(_shape(back, output, m, n))
                 for param, output in epilogue.grads}
        feeds = {name: halves[name] for name in epilogue.saved}
        feeds.update({name: bias for name in epilogue.operands})
        feeds.update({param: bias.chunk(2)[index] for param, _, index in epilogue.halves})
        # The layer's pass multiplies zeros of the tile's shape (never read); the operator's GEMM
        # is the forward's.
        width = n // 2 if epilogue.gated and form == "layer" else n
        tile = acc.detach() if form == "operator" else torch.full_like(acc.detach()[:, :width], float("nan"))
        got = epilogue.fn(tile, **grads, **feeds)
        dz = torch.cat(got[:2], dim=-1) if epilogue.gated else (got[0] if isinstance(got, tuple) else got)
        torch.testing.assert_close(dz, want, rtol=1e-9, atol=1e-12, msg=lambda msg, f=form: f"{f}: {msg}")


def _shape(back, output, m, n):
    from evtc.ir.shapes import L, M, N, evaluate_shape

    return evaluate_shape(back.grad_shapes[back.output_grads[output]], {M: m, N: n, L: 1})


def wide_bias_then_its_half_name(acc, bias, bias_gate):
    gate, up = (acc + bias).chunk(2, dim=-1)
    return F.silu(gate) * up * bias_gate


def half_name_then_wide_bias(acc, bias_gate, bias):
    gate, up = (acc + bias).chunk(2, dim=-1)
    return F.silu(gate) * up * bias_gate


def scaled_before_the_split(acc, alpha: float):
    gate, up = (acc * alpha).chunk(2, dim=-1)
    return F.silu(gate) * up


def mean_of_all(acc):
    return torch.tanh(acc).mean()


def _traced(fn, ops, n=24):
    meta = {"device": "meta", "dtype": torch.float32}
    example = {"a": torch.empty(7, 9, **meta), "b": torch.empty(9, n, **meta), **ops}
    return backward(evtc.trace(fn, example))


@pytest.mark.parametrize("fn", [wide_bias_then_its_half_name, half_name_then_wide_bias])
def test_an_operand_named_as_a_wide_operands_half_is_no_parameter_of_it(fn):
    """A user's operand named ``bias_gate`` beside a wide ``bias`` (a layer's gated pass passes the
    bias's halves as ``bias_gate`` and ``bias_up``): no epilogue, in either order of the operands.
    (The wide bias loaded first made the user's ``bias_gate`` the bias's half, silently.)"""
    meta = {"device": "meta", "dtype": torch.float32}
    back = _traced(fn, {"bias": torch.empty(24, **meta), "bias_gate": torch.empty(7, 12, **meta)})
    for trained in ((), ("bias",), ("bias", "bias_gate")):
        assert dz_epilogue(back, F64, grad_operand=True, operand_grads=trained) is None, trained


def test_dz_after_the_join_in_the_recomputing_form_is_none():
    """``(acc * alpha).chunk(2, -1)``: dZ is an op of the joined halves, which the recomputing form
    does not write as half outputs: no epilogue (it raised a KeyError)."""
    back = _traced(scaled_before_the_split, {"alpha": 0.5})
    assert dz_epilogue(back, F64, grad_operand=True, recompute=True) is None


def test_sizes_from_an_accumulator_that_is_no_tile_are_not_read():
    """The MLP form reads the forward's sizes from its accumulator ``grad``, the output's incoming
    gradient: for a reduction's output (a mean of the tile) that is no tile, so no epilogue (its
    ``size_n`` was 1). The forms that read ``acc`` take it."""
    back = _traced(mean_of_all, {})
    assert dz_epilogue(back, F64) is None
    assert dz_epilogue(back, F64, grad_operand=True, recompute=True) is not None
