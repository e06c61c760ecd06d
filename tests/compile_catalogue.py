"""A catalogue of epilogues for evtc.compile: every op of evtc.ir.ops, every operand kind, extra
outputs, casts. The CPU tests compile each for sm_90a; the GPU tests run each against
evtc.reference. Values stay finite on an accumulator of unit variance (inputs are scaled so), so a
NaN in a result is always a bug.

Operand specs (see `make_inputs`): "tile" (M, N) shared by all batches, "tile_b" (L, M, N), "tile_m"
(M, N) column-major, "row" (N,), "row2" (1, N), "row_b" (L, 1, N), "col" (M, 1), "col_b" (L, M, 1),
"scalar" (), "scalar1" (1,), "scalar_b" (L, 1, 1); a float is a runtime scalar argument. A dtype may follow:
("row", torch.float16).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F


@dataclass
class Entry:
    name: str
    fn: Any
    operands: dict[str, Any]
    batched: bool = False
    out_dtypes: Any = None
    config: dict = field(default_factory=dict)


CATALOGUE: list[Entry] = []


def entry(operands: dict[str, Any] | None = None, *, batched: bool = False, out_dtypes: Any = None,
          **config: Any):
    def wrap(fn):
        CATALOGUE.append(Entry(fn.__name__, fn, dict(operands or {}), batched, out_dtypes, config))
        return fn

    return wrap


# ---- arithmetic, operand kinds ------------------------------------------------------------------


@entry({"C": "tile", "bias": "row", "alpha": 1.5, "beta": 0.5})
def relu_lincomb_bias(acc, C, bias, alpha: float, beta: float):
    return torch.relu(alpha * acc + beta * C + bias)


@entry()
def identity(acc):
    return acc


@entry({"C": "tile"})
def add_sub_mul(acc, C):
    return (acc + C) * (acc - C) - C * 0.25


@entry({"C": "tile"})
def div_reciprocal(acc, C):
    return acc / (C.abs() + 1.0) + torch.reciprocal(acc.abs() + 2.0)


@entry({"C": "tile"})
def roundings_and_detach(acc, C):
    # Rounded values of C only: C is exact in the kernel and in the reference, where a rounding of
    # acc could flip with the order of its sums.
    q = torch.round(C * 4.0) * 0.25
    return acc.detach() + q + torch.floor(C) - torch.ceil(C) + torch.trunc(C * 3.0)


@entry({"C": "tile_m"})
def column_major_c(acc, C):
    return acc - 2.0 * C


@entry({"C": ("tile", torch.float32)})
def float32_c(acc, C):
    return acc * C


@entry({"C": ("tile", torch.bfloat16)})
def bfloat16_c(acc, C):
    return acc + C


@entry({"bias": ("row", torch.float16)})
def half_row_bias(acc, bias):
    return acc + bias


@entry({"bias": "row2"})
def row_1xn(acc, bias):
    return acc * bias


@entry({"scale": "col"})
def col_scale(acc, scale):
    return acc * scale


@entry({"scale": ("col", torch.bfloat16), "bias": "row"})
def col_and_row(acc, scale, bias):
    return acc * scale + bias


@entry({"s": "scalar"})
def device_scalar(acc, s):
    return acc * s


@entry({"s": ("scalar1", torch.float16), "t": "scalar"})
def device_scalars_math(acc, s, t):
    return acc * (s * 2.0 + t)


@entry({"alpha": 0.7, "beta": -1.25})
def runtime_scalars(acc, alpha: float, beta: float):
    return alpha * acc + beta


@entry({"alpha": 2.0, "s": "scalar"})
def uniform_stage(acc, alpha: float, s):
    k = torch.exp(s * alpha * 0.5) + s
    return acc * k - torch.sqrt(s.abs() + alpha)


@entry({"C": "tile", "bias": "row", "scale": "col", "s": "scalar", "alpha": 0.5})
def every_kind(acc, C, bias, scale, s, alpha: float):
    return (acc * scale + bias) * s + alpha * C


# ---- batched -------------------------------------------------------------------------------------


@entry({"C": "tile_b", "bias": "row_b", "scale": "col_b"}, batched=True)
def batched_operands(acc, C, bias, scale):
    return acc * scale + C - bias


@entry({"C": "tile", "bias": "row", "scale": "col"}, batched=True)
def shared_across_batches(acc, C, bias, scale):
    return acc * scale + C - bias


@entry({"C": "tile_b", "alpha": 0.5, "s": "scalar_b"}, batched=True)
def per_batch_device_scalars(acc, C, alpha: float, s):
    # Read at each tile's batch: a first version read batch 0's value for every batch.
    return acc + C + alpha + s, acc * s


@entry({"s": "scalar", "t": "scalar1"})
def uniform_value_through_a_cast(acc, s, t):
    # s rounded to float16 once per tile, then widened back (a cast that emits nothing): the tile
    # stage must still receive it (a first version left it out of the uniform stage's results).
    h = s.to(torch.float16)
    return h + acc, (h + acc) * t, (t.abs() + acc).sum(-2)


@entry({"s": "scalar"})
def uniform_select_then_round(acc, s):
    # leaky_relu of a scalar is a select once per tile; rounding its result needs a Float32, not
    # the bare IR value select gives (found by the fuzzer).
    return acc + F.leaky_relu(s.to(torch.bfloat16), 0.1).to(torch.float16)


@entry({"C": "tile_b", "alpha": 1.0}, batched=True)
def batched_two_outputs(acc, C, alpha: float):
    y = acc + alpha * C
    return y, torch.relu(y)


# ---- math ----------------------------------------------------------------------------------------


@entry()
def pow_sqrt_rsqrt(acc):
    x = acc.abs() + 1.0
    return x ** 1.5 + torch.sqrt(x) + torch.rsqrt(x) + torch.pow(x, 3)


@entry({"C": "tile"})
def pow_tensor(acc, C):
    return torch.pow(acc.abs() + 0.5, C * 0.5) + 2.0 ** acc


@entry()
def exp_family(acc):
    return torch.exp(acc * 0.5) + torch.exp2(acc * 0.25) + torch.expm1(acc * 0.1)


@entry()
def log_family(acc):
    x = acc.abs() + 0.5
    return torch.log(x) + torch.log2(x) + torch.log1p(x)


@entry()
def trig(acc):
    return torch.sin(acc) * torch.cos(acc * 0.5) + torch.tanh(acc)


@entry()
def erf_neg_abs(acc):
    return torch.erf(acc) - (-acc).abs()


@entry({"C": "tile"})
def min_max_clamp(acc, C):
    bounded = acc.clamp(-0.5, 0.75) + torch.clamp(acc, min=C)
    return torch.maximum(acc, C) + torch.minimum(acc, C * 0.5) + bounded


# ---- activations ---------------------------------------------------------------------------------


@entry({"bias": "row"})
def gelu_erf(acc, bias):
    return F.gelu(acc + bias)


@entry()
def gelu_tanh(acc):
    return F.gelu(acc, approximate="tanh")


@entry()
def sigmoid_silu(acc):
    return torch.sigmoid(acc) + F.silu(acc)


@entry()
def leaky_elu(acc):
    return F.leaky_relu(acc, 0.1) + F.elu(acc, alpha=0.5)


@entry()
def softplus_mish(acc):
    return F.softplus(acc * 4.0, beta=2.0, threshold=5.0) + F.mish(acc)


@entry()
def hard_activations(acc):
    x = acc * 3.0
    return F.hardswish(x) + F.hardsigmoid(x) + F.hardtanh(acc, -0.5, 0.5) + F.relu6(acc * 5.0)


# ---- comparisons and selection ---------------------------------------------------------------------


@entry({"C": "tile"})
def comparisons(acc, C):
    return (acc > C).float() + (acc >= 0.5) * 2.0 + (acc < -0.5) * 3.0 + (acc <= C) * 4.0


@entry({"C": "tile"})
def equality(acc, C):
    return (acc == C) * 1.0 + (acc != 1.0) * 2.0 + acc


@entry({"C": "tile"})
def logical_ops(acc, C):
    pos = acc > 0
    big = C.abs() > 0.5
    return torch.where(pos & big, acc, C) + torch.where(pos | big, 1.0, 0.0) + (~pos) * acc


@entry({"bias": "row"})
def where_scalar_branches(acc, bias):
    return torch.where(acc > bias, 1.0, -1.0) * acc + torch.where(acc < 0, 0.0, bias)


# ---- casts and outputs -----------------------------------------------------------------------------


@entry()
def output_float32(acc):
    return (acc * 2.0).float()


@entry(out_dtypes=torch.bfloat16)
def output_bfloat16(acc):
    return acc - 1.0


@entry()
def intermediate_rounding(acc):
    y = (acc * 3.0).to(torch.bfloat16)
    return (y * 0.5).to(torch.float16).float() + 1.0


@entry()
def aux_outputs(acc):
    y = acc * 0.5
    return y, torch.relu(y).to(torch.bfloat16), (y * y).float()


@entry({"bias": "row"})
def dict_outputs(acc, bias):
    pre = acc + bias
    return {"out": F.gelu(pre), "pre": pre}


@entry({"s": "scalar"})
def fp8_e4m3_aux(acc, s):
    y = torch.relu(acc)
    return y, (y * s).to(torch.float8_e4m3fn)


@entry()
def fp8_e5m2_aux(acc):
    return acc.float(), (acc * 8.0).to(torch.float8_e5m2)


# ---- reductions: partials per tile, finished by the kernel (rows, columns) or the host -----------


@entry({"bias": "row"})
def gelu_row_sum_of_squares(acc, bias):
    y = F.gelu(acc + bias)
    return y, (y * y).sum(-1)


@entry()
def row_max_min_keepdim(acc):
    # max and min need masking (not zeros) for the columns past N of ragged tiles
    return acc, (acc - 1000.0).amax(-1, keepdim=True), (acc + 1000.0).amin(-1)


@entry({"eps": 1e-6})
def rms_per_row(acc, eps: float):
    # a reduction, then the final stage on the host: mean's 1/N, + eps, sqrt
    return acc, torch.sqrt((acc * acc).mean(-1) + eps)


@entry({"bias": "row", "s": "scalar"})
def fp8_with_amax(acc, bias, s):
    y = acc + bias
    return (y * s).to(torch.float8_e4m3fn), y.abs().amax()


@entry(batched=True)
def batched_reductions(acc):
    # per batch, per row, and over everything
    return acc, acc.sum((-2, -1)), acc.amax(-1), acc.sum()


@entry({"bias": "row"})
def column_sum_max_min(acc, bias):
    # per column (over M): rows past M of ragged tiles must count as 0 / -inf / +inf
    y = acc + bias
    return y, y.sum(-2), (y - 1000.0).amax(0, keepdim=True), (y + 1000.0).amin(-2)


@entry({"bias": "row"})
def reductions_only(acc, bias):
    # no tile output: the kernel stores no D, only the reductions' partials
    y = F.gelu(acc + bias)
    return (y * y).sum(-1), y.abs().amax(), y.sum(-2)


@entry(batched=True)
def batched_rows_and_columns(acc):
    # per column of each batch (a mean), per row, and per column of squares
    return acc, acc.mean(-2), acc.sum(-1), (acc * acc).sum(1, keepdim=True)


# ---- gated epilogues: acc.chunk(2, dim=-1), the output half as wide ------------------------------


@entry()
def swiglu(acc):
    gate, up = acc.chunk(2, dim=-1)
    return F.silu(gate) * up


@entry({"bias": "row", "r": "tile_half"})
def geglu_bias_residual(acc, bias, r):
    # a bias as wide as the GEMM (split with acc), a residual as wide as the output
    gate, up = (acc + bias).chunk(2, dim=-1)
    return F.gelu(gate) * up + r


@entry({"C": "tile"})
def swiglu_wide_c(acc, C):
    # a C tile as wide as the GEMM: split into gate and up halves like acc
    gate, up = (acc + C).chunk(2, dim=-1)
    return F.silu(gate) * up


@entry({"s": "row_half"})
def reglu_outputs_and_stats(acc, s):
    gate, up = torch.chunk(acc, 2, dim=-1)
    y = torch.relu(gate) * up * s
    return y, y.float(), (y * y).sum(-1), y.amax(-2)


@entry({"bias": "row_b"}, batched=True)
def batched_swiglu_bias(acc, bias):
    gate, up = (acc + bias).chunk(2, -1)
    return F.silu(gate) * up


@entry({"C": "tile"})
def six_float32_outputs(acc, C):
    # Too many staged outputs for the default ping-pong tiles: compiled cooperative with 128x16.
    y = acc + C
    return y.float(), (y * 2).float(), torch.relu(y).float(), (y * y).float(), acc.float(), C.float()


@entry({f"C{i}": ("tile", torch.float32) for i in range(5)})
def five_float32_tiles_in_and_out(acc, C0, C1, C2, C3, C4):
    # Five float32 tiles in and five out: no double-buffered plan fits in shared memory, so the
    # kernel stages each one single-buffered (evtc.plan.smem.SINGLE_BUFFERED).
    y = acc + C0
    return y, y * C1, y - C2, torch.relu(y) + C3, y * C4 + C0


@entry({"bias": "row", "s": "scalar"})
def fp8_only_scaled(acc, bias, s):
    # Every output float8: the kernel's own D is the float8 tile.
    return ((acc + bias) * s).to(torch.float8_e4m3fn)


@entry()
def fp8_two_formats(acc):
    return (acc * 4.0).to(torch.float8_e5m2), acc.to(torch.float8_e4m3fn)


@entry({"C": "tile", "alpha": 1.0})
def four_outputs(acc, C, alpha: float):
    y = acc + C
    return y, y * alpha, torch.sigmoid(y), (y > 0).to(torch.float16)


@entry({"C": "tile"}, tile_n=128, epi_tile_n=64)
def config_tile128_epi64(acc, C):
    return acc - C


@entry({"bias": "row"}, tile_n=128, epi_tile_n=16)
def config_epi16(acc, bias):
    return torch.tanh(acc + bias)


@entry({"C": "tile"}, cluster=(2, 1))
def config_cluster2x1(acc, C):
    return F.silu(acc) * C


@entry({"C": "tile", "alpha": 1.0, "beta": 0.0})
def mean_of_row_free(acc, C, alpha: float, beta: float):
    n = acc.shape[-1]
    return acc * (alpha / 2.0) + beta * C + 1.0 / n


# ---- inputs ----------------------------------------------------------------------------------------


def make_inputs(e: Entry, m: int, n: int, k: int, batch: int | None, ab_dtype: torch.dtype,
                device: str | torch.device = "meta", seed: int = 0) -> dict[str, Any]:
    """Inputs for entry ``e``: a, b scaled so acc has unit variance, operands from the spec."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, dtype=torch.float32):
        if str(device) == "meta":
            return torch.empty(shape, dtype=dtype, device="meta")
        return torch.randn(shape, generator=g).to(dtype).to(device)

    lead = () if batch is None else (batch,)
    scale = k ** -0.25
    a = randn(*lead, m, k)
    b = randn(*lead, k, n)
    if str(device) != "meta":
        a, b = a * scale, b * scale
    out: dict[str, Any] = {"a": a.to(ab_dtype), "b": b.to(ab_dtype)}
    for name, spec in e.operands.items():
        if isinstance(spec, float | int):
            out[name] = float(spec)
            continue
        kind, dtype = (spec, None) if isinstance(spec, str) else spec
        L = batch or 1
        if kind == "tile":
            t = randn(m, n, dtype=dtype or ab_dtype)
        elif kind == "tile_b":
            t = randn(L, m, n, dtype=dtype or ab_dtype)
        elif kind == "tile_m":
            # Column-major, its leading dim padded to 16 bytes as TMA needs (M may be odd).
            m_pad = -(-m // 8) * 8
            t = randn(n, m_pad, dtype=dtype or ab_dtype)[:, :m].t()
        elif kind == "row":
            t = randn(n, dtype=dtype or torch.float32)
        elif kind == "row_half":  # as wide as a gated epilogue's output
            t = randn(n // 2, dtype=dtype or torch.float32)
        elif kind == "tile_half":
            t = randn(m, n // 2, dtype=dtype or ab_dtype)
        elif kind == "row2":
            t = randn(1, n, dtype=dtype or torch.float32)
        elif kind == "row_b":
            t = randn(L, 1, n, dtype=dtype or torch.float32)
        elif kind == "col":
            t = randn(m, 1, dtype=dtype or torch.float32)
        elif kind == "col_b":
            # Per-batch column vectors are loaded by TMA: their batch stride must be a multiple of
            # 16 bytes, so pad it where M is odd (an unpadded one is refused with a CallError).
            step = 16 // (dtype or torch.float32).itemsize
            t = randn(L, -(-m // step) * step, 1, dtype=dtype or torch.float32)[:, :m]
        elif kind == "scalar":
            t = randn(dtype=dtype or torch.float32)
        elif kind == "scalar1":
            t = randn(1, dtype=dtype or torch.float32)
        elif kind == "scalar_b":
            t = randn(L, 1, 1, dtype=dtype or torch.float32)
        else:
            raise ValueError(kind)
        out[name] = t
    return out


def compile_entry(e: Entry, ab_dtype: torch.dtype = torch.float16, cache_dir: Any = None):
    import evtc

    batch = 2 if e.batched else None
    example = make_inputs(e, 256, 512, 128, batch, ab_dtype)
    return evtc.compile(e.fn, example, out_dtypes=e.out_dtypes, config=e.config or None, cache_dir=cache_dir)


def compile_by_name(name: str, ab_dtype_name: str, cache_dir: str) -> str:
    """Process-pool entry point: compile one entry into the shared disk cache; returns where the
    kernel came from ("compiled" or "disk")."""
    e = next(x for x in CATALOGUE if x.name == name)
    k = compile_entry(e, getattr(torch, ab_dtype_name), cache_dir)
    return k.origin


def compile_job(name: str, ab_dtype_name: str, cache_dir: str) -> str:
    """Like compile_by_name, for support.precompiled_cache: "" (a failure raises)."""
    compile_by_name(name, ab_dtype_name, cache_dir)
    return ""
