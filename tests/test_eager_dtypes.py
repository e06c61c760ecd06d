"""Output dtypes and ``x.dtype`` inside the epilogue are torch's: the function run on ``acc = a @ b``
in a's dtype (torch's promotion on meta tensors is the reference); a returned mask is bool."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support import check_epilogue, eager_dtypes, gemm_inputs, rand

import evtc

M, N, K = 24, 40, 16


def _operands(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {
        "C16": rand(M, N, dtype=dtype, seed=3),
        "C32": rand(M, N, seed=4),
        "bias16": rand(N, dtype=dtype, seed=5),
        "bias32": rand(N, seed=6),
        "row32": rand(M, 1, seed=7),
        "s0": torch.tensor(1.5),  # 0-dim: never widens a tile of its kind
        "s1": torch.tensor([0.75]),  # one element, but dimensioned: it does
        "other16": rand(N, dtype=torch.float16 if dtype == torch.bfloat16 else torch.bfloat16, seed=8),
    }


# Each takes acc and any of the operands above, and alpha (a Python float).
CASES = {
    "identity": lambda acc: acc,
    "scaled_by_number": lambda acc, alpha: alpha * acc + 1,
    "own_dtype_tile": lambda acc, C16: acc + C16,
    "float32_tile": lambda acc, C32: acc + C32,
    "float32_bias": lambda acc, bias16, bias32: F.gelu(acc + bias16) * bias32,
    "zero_dim_scale": lambda acc, s0: acc * s0,
    "one_element_scale": lambda acc, s1: acc * s1,
    "rowwise_float32": lambda acc, row32: acc * row32,
    "other_16_bit": lambda acc, other16: acc + other16,
    "explicit_float": lambda acc, C16: acc.float() + C16,
    "mid_cast_back": lambda acc, C16: F.silu(acc.float()).to(acc.dtype) * C16,
    "cast_like_operand": lambda acc, C32: (acc * 2).to(C32.dtype),
    "type_as": lambda acc, bias32: torch.tanh(acc).type_as(bias32),
    "final_bf16": lambda acc, C32: (acc + C32).to(torch.bfloat16),
    "where_float32_branch": lambda acc, C32: torch.where(acc > 0, acc, C32),
    "where_number_branch": lambda acc: torch.where(acc > 0, acc, 0.0),
    "clamp_tensor_bounds": lambda acc, bias32: torch.maximum(acc, bias32),
    "add_alpha": lambda acc, C16: torch.add(acc, C16, alpha=0.5),
    "add_alpha_float32": lambda acc, C32: torch.sub(acc, C32, alpha=2),
    "row_sum": lambda acc: (acc * acc).sum(-1),
    "row_sum_float32": lambda acc: acc.sum(-1, dtype=torch.float32),
    "row_mean_of_float": lambda acc: acc.float().pow(2).mean(-1, keepdim=True),
    "amax": lambda acc, C16: (acc + C16).abs().amax(),
    "amax_promoted": lambda acc, bias32: (acc * bias32).abs().amax(),
    "column_min": lambda acc: acc.amin(-2),
    "rms_of_float32": lambda acc, C32: torch.rsqrt((acc + C32).pow(2).mean(-1) + 1e-6),
    "several": lambda acc, C16, bias32: (acc + C16, acc + bias32, (acc * C16).sum(-1), acc.float()),
    "dict": lambda acc, s1, C16: {"y": acc * s1, "z": acc - C16},
    "mask": lambda acc: acc > 0,
}


def _inplace_widened(acc, C16, bias32):
    y = acc + C16
    y += bias32  # in place: torch keeps y's dtype
    return y


def _inplace_float(acc, bias32):
    y = acc.to(torch.float32, copy=True)
    y.mul_(bias32)
    return y


def _gated(acc, half32):
    gate, up = acc.chunk(2, dim=-1)
    return F.silu(gate.float()).to(gate.dtype) * up, (gate * up * half32).sum(-1), (gate * up).sum(-1)


CASES |= {"inplace_widened": _inplace_widened, "inplace_float": _inplace_float}


def _inputs(fn, dtype):
    params = list(__import__("inspect").signature(fn).parameters)[1:]
    ops = _operands(dtype) | {"alpha": 0.5}
    return gemm_inputs(M, N, K, None, dtype=dtype) | {p: ops[p] for p in params}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("name", sorted(CASES))
def test_output_dtypes_are_torchs(name, dtype):
    fn = CASES[name]
    ex = _inputs(fn, dtype)
    graph = check_epilogue(fn, ex)  # values, and dtypes against torch on meta tensors
    assert [s.dtype for s in graph.stores] == eager_dtypes(fn, ex)


def test_dtype_inside_the_epilogue_reads_as_torchs():
    seen = {}

    def probe(acc, C16, C32, s0, s1, alpha):
        seen.update(acc=acc.dtype, c16=C16.dtype, sum16=(acc + C16).dtype, sum32=(acc + C32).dtype,
                    scaled0=(acc * s0).dtype, scaled1=(acc * s1).dtype, by_number=(acc * alpha).dtype,
                    cast=acc.float().dtype, mask=(acc > 0).dtype, reduced=acc.sum(-1).dtype)
        return acc

    for dtype in (torch.float16, torch.bfloat16):
        ex = _inputs(probe, dtype)
        evtc.trace(probe, ex)
        assert seen == dict(acc=dtype, c16=dtype, sum16=dtype, sum32=torch.float32, scaled0=dtype,
                            scaled1=torch.float32, by_number=dtype, cast=torch.float32, mask=torch.bool,
                            reduced=dtype)


def test_gated_halves_keep_a_dtype():
    ex = gemm_inputs(M, N, K, None, dtype=torch.bfloat16) | {"half32": rand(N // 2, seed=2)}
    graph = check_epilogue(_gated, ex)
    assert [s.dtype for s in graph.stores] == [torch.bfloat16, torch.float32, torch.bfloat16]


def test_float8_keeps_its_rule():
    """torch has no float8 product without an out_dtype: tiles bfloat16, reductions float32, an
    explicit final cast wins."""
    a = rand(M, K).to(torch.float8_e4m3fn)
    b = rand(N, K, seed=2).to(torch.float8_e4m3fn).t()
    ex = {"a": a, "b": b, "s": rand(M, 1, seed=3), "C32": rand(M, N, seed=4)}

    def fp8(acc, s, C32):
        assert acc.dtype == torch.float32
        y = acc * s + C32
        return y, y.abs().amax(), y.to(torch.float8_e4m3fn)

    graph = evtc.trace(fp8, ex)
    assert [s.dtype for s in graph.stores] == [torch.bfloat16, torch.float32, torch.float8_e4m3fn]


def test_to_another_tensor_and_type_as_take_its_dtype():
    def epilogue(acc, C16, bias32):
        return acc.float().to(C16), torch.tanh(acc).type_as(bias32), (acc * 2).to(bias32, copy=True)

    ex = _inputs(epilogue, torch.bfloat16)
    graph = check_epilogue(epilogue, ex)
    assert [s.dtype for s in graph.stores] == [torch.bfloat16, torch.float32, torch.float32]


def test_calls_that_torch_would_promote_otherwise_are_refused(tmp_path):
    """A call whose operand would give an output another dtype in torch than the example's (the
    kernel's outputs have the compiled dtypes) is refused by name: a float32 or float16 bias for a
    bfloat16 one (acc + bias float32), a (1,) float32 scale for a 0-dim one. Operands that leave the
    dtypes as they are run: a 0-dim bfloat16 scale, a (1, N) bias for an (N,) one."""
    def epilogue(acc, bias, s):
        return acc * s + bias

    a, b = (t.cpu() for t in gemm_inputs(M, N, K, None, dtype=torch.bfloat16).values())
    ex = {"a": a, "b": b, "bias": rand(N, dtype=torch.bfloat16), "s": torch.tensor(2.0)}
    k = evtc.compile(epilogue, ex, arch="sm_90a", cache_dir=tmp_path)
    assert k(**ex).dtype == torch.bfloat16  # a 0-dim float32 s does not promote, as in torch
    for bias, s in ((rand(N), ex["s"]), (rand(N).half(), ex["s"]), (ex["bias"], torch.tensor([2.0]))):
        assert epilogue(a @ b, bias, s).dtype != torch.bfloat16  # torch's result would differ
        with pytest.raises(evtc.CallError, match="other dtypes than the compiled kernel's"):
            k(a, b, bias=bias, s=s)
    # The example's dtype in another rank: the message names the rank, not the dtype.
    with pytest.raises(evtc.CallError, match=r"with s a f32 tensor of shape \(1,\) where the example's "
                       r"was 0-dim, torch gives .*dtypes and ranks \(0-dim or not\)"):
        k(a, b, bias=ex["bias"], s=torch.tensor([2.0]))
    for bias, s in ((ex["bias"][None], ex["s"]), (ex["bias"], torch.tensor(2.0).bfloat16())):
        got = k(a, b, bias=bias, s=s)
        assert got.dtype == epilogue(a @ b, bias, s).dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), epilogue(a.float() @ b.float(), bias.float(), 2.0),
                                   rtol=1e-2, atol=1e-2)


def test_calls_with_other_operand_dtypes_are_judged_together_and_by_what_the_function_reads(tmp_path):
    """A call with other operand dtypes runs where the epilogue traced on them is the compiled graph,
    and is refused by name where it is not: two operands that change a promotion only together;
    a dtype the function reads (.to(C.dtype)), which fixed a cast at compile time; two changes
    that cancel out run; so does a sum(dtype=float32) whose operand changes, and a call beside
    out_dtypes, which fixes the outputs."""
    a, b = (t.cpu() for t in gemm_inputs(M, N, K, None, dtype=torch.bfloat16).values())

    def two_rows(acc, x, y):
        return acc + x + y

    k = evtc.compile(two_rows, {"a": a, "b": b, "x": rand(N).half(), "y": rand(N).half()}, cache_dir=tmp_path)
    assert k(a, b, x=rand(N).bfloat16(), y=rand(N).half()).dtype == torch.float32  # each alone: as torch
    with pytest.raises(evtc.CallError, match="with x a bf16 tensor and y a bf16 tensor, torch gives"):
        k(a, b, x=rand(N).bfloat16(), y=rand(N).bfloat16())  # together: bfloat16 in torch
    got = k(a, b, x=rand(N).bfloat16(), y=rand(N))  # float32 either way
    assert got.dtype == two_rows(a @ b, rand(N).bfloat16(), rand(N)).dtype == torch.float32

    def own_dtype(acc, C):
        return (acc.float() + C).to(C.dtype)

    k = evtc.compile(own_dtype, {"a": a, "b": b, "C": rand(M, N).half()}, cache_dir=tmp_path)
    with pytest.raises(evtc.CallError, match="with C a bf16 tensor"):
        k(a, b, C=rand(M, N).bfloat16())

    def float_sum(acc, x):
        return (acc * x).sum(-1, dtype=torch.float32)

    k = evtc.compile(float_sum, {"a": a, "b": b, "x": rand(N)}, cache_dir=tmp_path)
    x = rand(N).bfloat16()
    want = float_sum(a.float() @ b.float(), x.float())
    torch.testing.assert_close(k(a, b, x=x), want, rtol=1e-4, atol=1e-3)

    k = evtc.compile(two_rows, {"a": a, "b": b, "x": rand(N), "y": rand(N)}, cache_dir=tmp_path,
                     out_dtypes=torch.float16)
    assert k(a, b, x=rand(N).half(), y=rand(N).bfloat16()).dtype == torch.float16


def test_constants_the_function_makes_promote_as_tensors():
    """torch.tensor([2.0]) made in the epilogue is a dimensioned float32 tensor (a bfloat16 tile
    times it is float32), torch.tensor(2.0) a 0-dim one (it stays bfloat16), as in torch."""
    def made(acc):
        return acc * torch.tensor([2.0]), acc * torch.tensor(2.0), acc + torch.ones(1)

    ex = gemm_inputs(M, N, K, None, dtype=torch.bfloat16)
    graph = check_epilogue(made, ex)
    assert [s.dtype for s in graph.stores] == [torch.float32, torch.bfloat16, torch.float32]


def test_masked_fill_of_a_mask_stays_a_mask():
    def filled(acc, C32):
        m = (acc > 0).masked_fill(C32 > 0, 0.5)  # 0.5 is True in a bool tensor
        return (m * acc).float(), ((acc > 0).masked_fill(C32 > 1, 0) * acc).float()

    check_epilogue(filled, _inputs(filled, torch.bfloat16))
