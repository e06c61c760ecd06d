"""Each pass alone: what it changes in the graph, and that the graph still computes the same."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support import flatten, gemm_inputs, rand

import evtc
from evtc.ir.passes import (
    PASSES,
    PassResult,
    check_dtypes,
    eliminate_common_subexpressions,
    eliminate_dead_code,
    fold_constants,
    fuse_elementwise,
    infer_shapes,
    make_casts_explicit,
    optimize,
    validate,
)
from evtc.ir.passes.fusion import unit_inputs, unit_outputs
from evtc.ir.passes.result import fingerprint

INPUTS = gemm_inputs(12, 20, 8, 2) | {
    "C": rand(2, 12, 20, dtype=torch.bfloat16, seed=1),
    "bias": rand(20, dtype=torch.float16, seed=2),
    "col": rand(12, 1, seed=3),
    "alpha": 0.7,
}


def raw(fn):
    params = set(fn.__code__.co_varnames[: fn.__code__.co_argcount]) | {"a", "b"}
    inputs = {k: v for k, v in INPUTS.items() if k in params}
    return evtc.trace(fn, inputs, out_dtypes=torch.float32, optimize_graph=False), inputs


def assert_equivalent(before, after, inputs):
    """Both graphs, evaluated in float64 on the same inputs, give the same outputs."""
    for seed in range(2):
        trial = {k: (v + 0.1 * seed if isinstance(v, torch.Tensor) and k not in "ab" else v)
                 for k, v in inputs.items()}
        x = flatten(before.evaluate(trial, compute_dtype=torch.float64, cast_outputs=False))
        y = flatten(after.evaluate(trial, compute_dtype=torch.float64, cast_outputs=False))
        assert [k for k, _ in x] == [k for k, _ in y]
        for (_, u), (_, v) in zip(x, y, strict=True):
            torch.testing.assert_close(u, v, rtol=1e-9, atol=1e-9, equal_nan=True)


def test_infer_shapes_recomputes_and_checks():
    g, inputs = raw(lambda acc, bias, col: acc * bias + col)
    out = infer_shapes(g).graph
    assert [n.shape for n in out.nodes] == [n.shape for n in g.nodes]
    assert_equivalent(g, out, inputs)


def test_make_casts_explicit_computes_in_float32():
    def epilogue(acc, C):
        y = acc.to(torch.bfloat16) * 3.0 + 1.0  # computed in bf16 by torch, rounding each op
        return y, C * 2

    g, inputs = raw(epilogue)
    with pytest.raises(evtc.GraphError):
        validate(g, lowered=True)  # narrow arithmetic is not lowered yet
    out = make_casts_explicit(g).graph
    validate(out, lowered=True)
    compute = [n for n in out.nodes if n.op in ("mul", "add")]
    assert all(n.dtype == torch.float32 for n in compute)
    rounding = [n for n in out.nodes if n.op == "cast" and n.dtype == torch.bfloat16]
    assert len(rounding) == 3  # after the .to, after the mul, after the add
    assert_equivalent(g, out, inputs)


def test_check_dtypes_rejects_float8_arithmetic():
    g, _ = raw(lambda acc: acc.to(torch.float8_e5m2) + 1)
    with pytest.raises(evtc.DTypeError, match="float8"):
        check_dtypes(g)


def test_dead_code_elimination():
    def epilogue(acc, C, bias):
        unused = F.gelu(C) * bias  # noqa: F841 - dead on purpose
        return acc + 1

    g, inputs = raw(epilogue)
    out = eliminate_dead_code(g).graph
    assert out.count("gelu") == 0 and out.count("load") == 0
    assert len(out) < len(g)
    assert_equivalent(g, out, inputs)


def test_common_subexpression_elimination():
    def epilogue(acc, bias):
        x = torch.sigmoid(acc + bias)
        y = torch.sigmoid(bias + acc)  # commutative: the same value
        return x * y + torch.sigmoid(acc + bias)

    g, inputs = raw(epilogue)
    out = eliminate_dead_code(eliminate_common_subexpressions(g).graph).graph
    assert g.count("sigmoid") == 3 and out.count("sigmoid") == 1
    assert out.count("add") == 2
    assert_equivalent(g, out, inputs)


def test_cse_does_not_merge_different_params_or_non_commutative_ops():
    def epilogue(acc, C):
        return F.leaky_relu(acc, 0.1) + F.leaky_relu(acc, 0.2) + (acc - C) * (C - acc)

    g, inputs = raw(epilogue)
    out = eliminate_common_subexpressions(g).graph
    assert out.count("leaky_relu") == 2 and out.count("sub") == 2
    assert_equivalent(g, out, inputs)


@pytest.mark.parametrize(
    "fn,absent,present",
    [
        (lambda acc: acc * 1 - 0, ["mul", "sub"], []),
        (lambda acc: acc + 0, [], ["add"]),  # -0.0 + 0.0 is +0.0: not acc
        (lambda acc: 0 - acc, ["neg"], ["sub"]),  # 0 - 0.0 is +0.0: not -acc
        (lambda acc: (acc - 0) / 1, ["sub", "div"], []),
        (lambda acc: acc * -1, ["mul"], ["neg"]),
        (lambda acc: torch.neg(-acc), ["neg"], []),
        (lambda acc: acc / 4.0, ["div"], ["mul"]),
        (lambda acc: acc / 3.0, ["div"], ["mul"]),
        (lambda acc: acc ** 2, ["pow"], ["mul"]),
        (lambda acc: acc.abs() ** 0.5, ["pow"], ["sqrt"]),
        (lambda acc: acc.abs() ** -0.5, ["pow"], ["rsqrt"]),
        (lambda acc: acc ** -1, ["pow"], ["reciprocal"]),
        (lambda acc: 2 ** acc, ["pow"], ["exp2"]),
        (lambda acc: 10.0 ** (acc * 0.1), ["exp2"], ["pow"]),  # pow is exact where exp2 is not
        (lambda acc: acc / 1e-39, [], ["div"]),  # 1/c is not a float32 number: kept
        (lambda acc: acc * 2.0 * 3.0 + 1.0 + 2.0, ["sub"], ["mul"]),
        (lambda acc: (acc + 1e8) - 1e8, [], ["add"]),  # opposite signs: not regrouped
        (lambda acc: 1.0 ** acc, ["exp2"], ["pow"]),
        (lambda acc: acc.float(), ["cast"], []),
    ],
)
def test_fold_constants_rules(fn, absent, present):
    g, inputs = raw(fn)
    out = eliminate_dead_code(fold_constants(g).graph).graph
    for op in absent:
        assert out.count(op) == 0, (op, str(out))
    for op in present:
        assert out.count(op) >= 1, (op, str(out))
    assert_equivalent(g, out, inputs)


def test_fold_hoists_literal_chains_but_not_runtime_scalars_out_of_the_tile():
    def literals(acc, bias):
        return ((acc * 2.0) * 3.0) * 0.5 + bias

    def runtime(acc, alpha, bias):
        return ((acc * alpha) * 2.0) * (alpha + 1.0) + bias

    for fn, muls in ((literals, 1), (runtime, 3)):
        g, inputs = raw(fn)
        out = optimize(g)
        tile_muls = [n for n in out.nodes if n.op == "mul" and n.stage == "tile"]
        assert len(tile_muls) == muls, str(out)
        assert_equivalent(g, out, inputs)


def test_fold_regroups_only_where_rounding_is_all_that_changes():
    """Literal products regroup into one literal only where that changes float32 rounding alone
    (not a product that underflows or overflows); sums never (x may cancel against the first
    literal); 1 ** x is 1 at inf."""
    cases = [
        (lambda acc: acc * 2.0 * 3.0 + 1.0 + 2.0, {"mul": 1, "add": 2}),
        (lambda acc: (acc + 1.0) + 1e-12, {"add": 2}),
        (lambda acc: (acc * 1e-30) * 1e-30, {"mul": 2}),
        (lambda acc: (acc * 1e30) * 1e30, {"mul": 2}),
        (lambda acc: (acc + 1e8) - 1e8, {"add": 2}),
    ]
    for fn, counts in cases:
        g, inputs = raw(fn)
        out = eliminate_dead_code(fold_constants(g).graph).graph
        for op, count in counts.items():
            assert out.count(op) == count, (op, str(out))
    # acc = a @ b with b = 1: these values exactly, and torch in float32 step by step as the reference.
    a = torch.tensor([3.0e15, -7.0, float("inf"), 0.25, 1e-12]).reshape(1, 5, 1)
    b = torch.ones(1, 1, 1)
    for fn in (lambda acc: (acc * 1e-30) * 1e-30, lambda acc: (acc + 1e8) - 1e8,
               lambda acc: 1.0 ** acc, lambda acc: (acc * 1e-20) * 1e30,
               lambda acc: torch.log((acc * 0.0 - 1.0) + 1.0 + 1e-12), lambda acc: 10.0 ** (acc * 0.0 + 30.0),
               lambda acc: 1.0 / (acc * 0.0 + 0.0), lambda acc: 1.0 / (0.0 - acc * 0.0),
               lambda acc: 1.0 / torch.where(acc > 1e30, acc, -0.0), lambda acc: 1.0 / (acc * -0.0)):
        g, _ = raw(fn)
        got = optimize(g).evaluate({"a": a, "b": b}, cast_outputs=False)
        want = fn(a @ b)
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf()), (got, want)
        finite = want.isfinite()
        assert torch.allclose(got[finite], want[finite], rtol=1e-6, atol=0), (got, want)


def test_fold_never_regroups_runtime_scalars():
    """(acc * s1) * s2 of device scalars or float arguments stays in torch's order: their product,
    computed first, could overflow or underflow where torch's results are finite."""
    def devices(acc, s1, s2):
        return (acc * s1) * s2

    def arguments(acc, alpha: float, beta: float):
        return alpha * acc * beta

    a = torch.tensor([1e-30, 0.0, 1e30, -3.0]).reshape(1, 4, 1)
    b = torch.ones(1, 1, 1)
    for fn, values in ((devices, {"s1": torch.tensor(1e20), "s2": torch.tensor(1e20)}),
                       (devices, {"s1": torch.tensor(1e-25), "s2": torch.tensor(1e-25)}),
                       (arguments, {"alpha": 1e20, "beta": 1e20}),
                       (arguments, {"alpha": 1e-25, "beta": 1e-25})):
        g = evtc.trace(fn, {"a": a, "b": b, **values}, out_dtypes=torch.float32)
        assert g.count("mul") == 2, str(g)
        got = g.evaluate({"a": a, "b": b, **values}, cast_outputs=False)
        want = fn(a @ b, **values)
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf()), (got, want)
        torch.testing.assert_close(got[want.isfinite()], want[want.isfinite()])


def test_fold_keeps_nan_semantics():
    def epilogue(acc):
        return acc * 0 + (acc - acc)

    g, inputs = raw(epilogue)
    out = optimize(g)
    assert out.count("mul") == 1 and out.count("sub") == 1
    assert_equivalent(g, out, inputs)


def test_fold_symbolic_constants_with_sympy():
    def epilogue(acc):
        return acc.mean(-1) * 2 / acc.shape[-1]

    g, inputs = raw(epilogue)
    out = optimize(g)
    values = [str(n.attrs["value"]) for n in out.nodes if n.op == "literal"]
    assert "2/N**2" in values, values
    assert_equivalent(g, out, inputs)


def test_fusion_assigns_stages_and_units():
    def epilogue(acc, bias, alpha):
        scale = alpha * 2 + 1
        y = F.gelu(acc * scale + bias)
        return y, y.sum(-1) / 20, (y * y).amax()

    g, inputs = raw(epilogue)
    out = fuse_elementwise(make_casts_explicit(g).graph).graph
    stages = {n.op: n.stage for n in out.nodes}
    assert stages["gelu"] == "tile" and stages["reduce"] == "reduce" and stages["arg"] == "uniform"
    units = {gid: {n.stage for n in nodes} for gid, nodes in out.groups.items()}
    assert all(len(s) == 1 for s in units.values())
    assert sorted(s.pop() for s in units.values()) == ["final", "tile", "uniform"]
    tile_unit = next(gid for gid, nodes in out.groups.items() if nodes[0].stage == "tile")
    ins = {n.op for n in unit_inputs(out, tile_unit)}
    assert {"acc", "load"} <= ins
    assert any(n.op == "gelu" for n in unit_outputs(out, tile_unit))
    assert_equivalent(g, out, inputs)


def test_validate_catches_broken_graphs():
    g = optimize(raw(lambda acc, bias: acc + bias)[0])
    validate(g)
    broken = evtc.Graph(g.name, list(reversed(g.nodes)), g.operands, g.outputs, g.batched)
    with pytest.raises(evtc.GraphError, match="not before"):
        validate(broken)


def test_optimize_reaches_a_fixed_point_and_every_pass_preserves_meaning():
    def epilogue(acc, C, bias, col, alpha):
        y = (alpha * acc * 1.0 + 0.0) / 2.0 + C * bias
        z = torch.sigmoid(y) * torch.sigmoid(y) + col
        return F.silu(z), z.amax(-1), (z ** 2).mean()

    g, inputs = raw(epilogue)
    current = g
    for name, p in PASSES.items():
        nxt = p(current).graph
        assert_equivalent(current, nxt, inputs), name
        current = nxt
    final = optimize(g)
    assert_equivalent(g, final, inputs)
    assert len(optimize(final)) == len(final)


def _snapshot(graph) -> list[tuple]:
    """Everything a pass could change on a graph's nodes, by identity."""
    return [(id(n), n.id, n.op, tuple(id(i) for i in n.inputs), repr(sorted(n.attrs.items())), n.dtype,
             repr(n.shape), n.stage, n.group) for n in graph.nodes]


def test_every_pass_returns_a_new_graph_says_whether_it_changed_it_and_mutates_nothing():
    def epilogue(acc, C, bias, alpha):
        y = (alpha * acc * 1.0 + 0.0) / 2.0 + C * bias
        return F.gelu(y) + F.gelu(y), y.sum(-1)

    g, inputs = raw(epilogue)
    current = g
    for name, p in PASSES.items():
        before = _snapshot(current)
        groups_before = dict(current.groups)
        result = p(current)
        assert isinstance(result, PassResult), name
        assert _snapshot(current) == before and current.groups == groups_before, f"{name} mutated its input"
        assert result.graph is not current, name
        # changed is True exactly when the result differs structurally from the input.
        assert result.changed == (fingerprint(result.graph) != fingerprint(current)), name
        current = result.graph
    # These passes have work to do on this program: 1.0 and 0.0 folded, gelu(y) shared, the dead
    # duplicate dropped, stages assigned.
    changes = {}
    current = g
    for name, p in PASSES.items():
        current, changes[name] = p(current)
    assert all(changes[n] for n in ("fold_constants", "eliminate_common_subexpressions",
                                    "eliminate_dead_code", "fuse_elementwise")), changes
    # A float16 output needs an explicit rounding cast.
    half = evtc.trace(epilogue, inputs, out_dtypes=torch.float16, optimize_graph=False)
    assert make_casts_explicit(infer_shapes(half).graph).changed
    # At the fixed point the simplifying passes change nothing (on a graph before fusion: a rewrite
    # of a fused graph drops its stages, and says so), and fusing again changes nothing.
    simplified = make_casts_explicit(infer_shapes(g).graph).graph
    for _ in range(8):
        changed = False
        for p in (fold_constants, eliminate_common_subexpressions, eliminate_dead_code):
            simplified, did = p(simplified)
            changed |= did
        if not changed:
            break
    for p in (fold_constants, eliminate_common_subexpressions, eliminate_dead_code):
        assert not p(simplified).changed, p.__name__
    assert fold_constants(current).changed  # a fused graph loses its stages
    assert not fuse_elementwise(current).changed
    assert_equivalent(g, current, inputs)
