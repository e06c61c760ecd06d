"""Epilogue test cases as data: operands of every kind, GEMM layouts, programs as source text, and a
checker that runs a compiled kernel against the function itself.

Shared by the generated GPU matrix (tests/test_kind_matrix_gpu.py), the differential fuzzer
(tests/fuzz.py, tests/test_fuzz_gpu.py) and their CPU checks. A case is plain data (picklable, so
a process pool can compile it), and its program is Python source, so a failure prints the exact
function that failed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

import evtc
from evtc.ir.dtypes import is_float8, round_to

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
TILE_TOL = 1e-2
# Reductions (float32 ones, or one rounding of their 16-bit dtype more: OUTPUT_ROUNDING) may reduce
# values that pass through 16-bit casts inside the program,
# where a different summation order of acc can round an element the other way.
REDUCTION_TOL = 1e-3
#: One rounding of a 16-bit output (half its spacing), by norm at most.
OUTPUT_ROUNDING = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
#: float8 outputs: each element within one float8 spacing of the float32 result (either neighbour).
FLOAT8_SPACINGS = 1.0
FLOAT8_TOL = 2e-2  # norm-wise, against the float32 result rounded to float8: a few elements flipped
# Reductions of a program that compares acc with a threshold (torch.where), on float8 a and b: the
# tensor cores sum float8 products in fewer bits than float32 (about 1e-4 of acc, as cuBLAS does), so
# an acc within that of the threshold lands on the other branch. Seen: 3 of 18232 elements 1e-4 from
# the threshold, each moving its column's sum by 0.55, 1.3e-3 of the sums' norm. Tight enough that
# a reduction missing a ragged last row or column (1/700 of the sum at the fuzzer's sizes) still fails.
FLOAT8_BRANCH_REDUCTION_TOL = 3e-3
#: float8 a and b: how far the tensor cores' accumulation leaves acc from float64, relative to each
#: element (measured 2e-4 to 4.5e-4 by norm). A reduction whose terms cancel (a row of 256 order-1
#: values summing to -0.18: fuzz seed 2030, case 89) turns that into an error no tolerance relative
#: to the sum can allow; such an output may be off by twice what this much noise on acc moves it.
#: Tiles too: bf16(acc) - acc stored as a tile (fuzz seed 2039, case 130, float8 e5m2) is all
#: rounding residual, and was 1.27e-2 off by norm against a tile tolerance of 1e-2.
FLOAT8_ACC_NOISE = 5e-4
#: Other a and b: the kernel's float32 acc differs from torch's by the summation order alone (7e-7 by
#: norm, K = 480). A program that rounds acc to 16 bits and cancels it again (|bf16(acc)| + acc, fuzz
#: seed 2035, case 52) reduces rounding residuals, and an acc that crosses a rounding boundary moves
#: its residual by a whole 16-bit spacing: a column minimum was off by 1.4e-3, while equal to the
#: function of the kernel's own acc. Such an output may be off by twice what this much noise moves it.
SUM_ORDER_ACC_NOISE = 2e-6
#: Example sizes for compiling (only layouts and kinds matter): M, the GEMM's N and K all differ.
EXAMPLE = (96, 128, 64)


@dataclass(frozen=True)
class OperandSpec:
    """One epilogue input. ``form`` picks the shape among those of the kind: row ``"n"`` (N,) or
    ``"1n"`` (1, N); scalar ``"0"`` () or ``"1"`` (1,); per-batch ones are (L, 1, N), (L, M, 1),
    (L, 1, 1) and (L, M, N). ``major`` is a tile's contiguous dim; ``half`` means N/2 wide (an
    operand of a gated epilogue's halves), otherwise as wide as the GEMM."""

    name: str
    kind: str  # tile | row | col | scalar | arg
    dtype: str = "float32"
    batched: bool = False
    form: str = ""
    major: str = "n"
    half: bool = False

    def describe(self) -> str:
        bits = [self.kind, self.dtype if self.kind != "arg" else "float"]
        bits += ["per-batch"] if self.batched else []
        bits += [f"form={self.form}"] if self.form else []
        bits += ["m-major"] if self.kind == "tile" and self.major == "m" else []
        bits += ["half"] if self.half else []
        return f"{self.name}: {' '.join(bits)}"


@dataclass(frozen=True)
class Case:
    """A compiled epilogue and the problems it runs on."""

    name: str
    source: str  # ``def epilogue(acc, ...)``, with torch and F in scope
    operands: tuple[OperandSpec, ...]
    ab_dtype: str = "float16"
    a_major: str = "k"  # k: (M, K) row-major; m: column-major
    b_major: str = "n"  # n: (K, N) row-major; k: an nn.Linear weight's transpose
    batches: int | None = None
    gated: bool = False
    shapes: tuple[tuple[int, int, int], ...] = ((129, 136, 72),)  # (M, GEMM N, K)
    out_dtypes: tuple[tuple[str, str], ...] = ()  # output name -> dtype (others: the default)
    #: At call time, a and b in other majors than compiled (the staged path must handle that).
    call_majors: tuple[str, str] | None = None
    seed: int = 0
    #: float8 only: a and b as (tensor, block scales) pairs, a's scales per this many rows (1 or
    #: 128) and 128 elements of K, b's per 128 x 128 block (docs/fp8.md); 0: plain a and b.
    block_scales: int = 0

    def function(self):
        scope: dict[str, Any] = {"torch": torch, "F": F}
        exec(compile(self.source, f"<evtc case {self.name}>", "exec"), scope)  # noqa: S102 - test programs
        return scope["epilogue"]

    def output_dtypes(self) -> dict[str, torch.dtype] | None:
        """``out_dtypes`` for evtc.compile and evtc.trace."""
        return {name: DTYPES[dt] for name, dt in self.out_dtypes} or None

    def describe(self) -> str:
        lines = [f"case {self.name}: a/b {self.ab_dtype} a {self.a_major}-major b {self.b_major}-major, "
                 f"L={self.batches}, gated={self.gated}, shapes {list(self.shapes)}, "
                 f"out_dtypes {dict(self.out_dtypes)}, call majors {self.call_majors}"
                 + (f", block scales {self.block_scales} x 128" if self.block_scales else "")]
        lines += [f"  {op.describe()}" for op in self.operands]
        lines += ["  " + line for line in self.source.splitlines()]
        return "\n".join(lines)


# ---- inputs ------------------------------------------------------------------------------------


def _matrix(rows: int, cols: int, lead: tuple[int, ...], major_last: bool, dtype, device, g, scale=1.0):
    """A (*lead, rows, cols) tensor, row-major when ``major_last`` else column-major."""
    if major_last:
        t = torch.randn(*lead, rows, cols, generator=g) * scale
    else:
        t = (torch.randn(*lead, cols, rows, generator=g) * scale).transpose(-1, -2)
    return t.to(device=device, dtype=dtype)


def make_inputs(case: Case, m: int, n: int, k: int, device="cpu", seed: int = 0,
                majors: tuple[str, str] | None = None) -> dict[str, Any]:
    """Fresh random inputs (never zeros) for an (L,) M x N x K problem, N being the GEMM's."""
    g = torch.Generator().manual_seed(seed)
    lead = () if case.batches is None else (case.batches,)
    a_major, b_major = majors or (case.a_major, case.b_major)
    dt = DTYPES[case.ab_dtype]
    # acc ~ N(0, 1): values stay O(1) through the program.
    inputs: dict[str, Any] = {
        "a": _matrix(m, k, lead, a_major == "k", dt, device, g, scale=k ** -0.5),
        "b": _matrix(k, n, lead, b_major == "n", dt, device, g),
    }
    if case.block_scales:
        # Positive scales around 1, so that acc stays O(1); a's M-major as torch's blockwise GEMM
        # takes them (any strides are accepted).
        blocks = lambda x: -(-x // 128)  # noqa: E731
        a_rows = m if case.block_scales == 1 else blocks(m)
        a_scales = (0.5 + torch.rand(*lead, blocks(k), a_rows, generator=g)).transpose(-1, -2)
        b_scales = 0.5 + torch.rand(*lead, blocks(k), blocks(n), generator=g)
        inputs["a"] = (inputs["a"], a_scales.to(device))
        inputs["b"] = (inputs["b"], b_scales.to(device))
    for op in case.operands:
        width = n // 2 if op.half else n
        per = (case.batches,) if op.batched else ()
        odt = DTYPES[op.dtype]
        if op.kind == "arg":
            inputs[op.name] = round(random.Random(f"{seed}:{op.name}").uniform(-1.5, 1.5), 3)
        elif op.kind == "tile":
            inputs[op.name] = _matrix(m, width, per, op.major == "n", odt, device, g, scale=0.5)
        elif op.kind == "row":
            shape = (*per, 1, width) if op.batched or op.form == "1n" else (width,)
            inputs[op.name] = (torch.randn(shape, generator=g) * 0.5).to(device=device, dtype=odt)
        elif op.kind == "col":
            inputs[op.name] = (torch.randn(*per, m, 1, generator=g) * 0.5).to(device=device, dtype=odt)
        else:  # a device scalar: positive, away from zero, different per batch
            shape = (case.batches, 1, 1) if op.batched else (() if op.form == "0" else (1,))
            inputs[op.name] = (0.5 + torch.rand(shape, generator=g)).to(device=device, dtype=odt)
    return inputs


def example_inputs(case: Case) -> dict[str, Any]:
    return make_inputs(case, *EXAMPLE)


def compile_case(case: Case, cache_dir) -> evtc.Kernel:
    return evtc.compile(case.function(), example_inputs(case), cache_dir=cache_dir,
                        out_dtypes=case.output_dtypes())


# ---- checking ----------------------------------------------------------------------------------


def _leaves(value) -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return list(value.items())
    if isinstance(value, tuple | list):
        return [(str(i), v) for i, v in enumerate(value)]
    return [("D", value)]


def _poisoned(kernel: evtc.Kernel, reference) -> Any:
    """``out=`` for the kernel: NaN-filled tensors of each output's dtype and the reference's shape
    (float8 NaN too), in the structure the epilogue returns."""
    graph = kernel.graph
    shapes = [v.shape for _, v in _leaves(reference)]
    tensors = {name: torch.full(shape, float("nan"), device="cuda").to(graph.store(name).dtype)
               for name, shape in zip(graph.outputs.names, shapes, strict=True)}
    return graph.outputs.build(tensors)


#: Outputs whose values are mostly cancellation noise (x - (x + acc) + acc) are judged against this
#: RMS magnitude rather than their own.
NOISE_FLOOR = 0.05


def acc_noise_reference(fn, inputs: dict[str, Any], seed: int, noise: float = FLOAT8_ACC_NOISE) -> Any:
    """The function on acc perturbed elementwise by ``noise`` of itself, with random signs: what
    accumulation error alone does to each output (see FLOAT8_ACC_NOISE and SUM_ORDER_ACC_NOISE).
    ``inputs`` are the reference's, tf32-rounded a and b included."""
    from evtc.ir.interpreter import accumulator

    acc = accumulator(inputs["a"], inputs["b"], torch.float32)
    g = torch.Generator(device=acc.device).manual_seed(seed)
    signs = torch.randint(0, 2, acc.shape, generator=g, device=acc.device) * 2 - 1
    return evtc.reference(fn, inputs, acc=acc * (1 + noise * signs))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / max(||want||, NOISE_FLOOR * sqrt(numel)). NaN anywhere in ``got`` gives
    NaN, which never passes."""
    want = want.float()
    diff = torch.linalg.vector_norm(got.float() - want)
    floor = NOISE_FLOOR * max(1, want.numel()) ** 0.5
    return (diff / torch.linalg.vector_norm(want).clamp_min(floor)).item()


def float8_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest |got - want| in units of float8 e4m3 spacing at ``want`` (saturated to 448):
    at most 1 when every element is one of the two float8 values around the float32 result. A
    norm-wise error would not do: values that are exactly float8 midpoints (bfloat16 inputs often
    are) round either way on a float32 difference in the last bit."""
    want = want.clamp(-448.0, 448.0)
    exponent = torch.floor(torch.log2(want.abs().clamp_min(2.0 ** -6)))
    spacing = torch.exp2(exponent - 3)
    ratio = (got.float() - want).abs() / spacing
    return float("nan") if ratio.isnan().any() else ratio.max().item()


def tf32_truncated(t: torch.Tensor) -> torch.Tensor:
    """float32 ``t`` with its 13 low mantissa bits cleared: what the tf32 wgmma multiplies."""
    return (t.view(torch.int32) & ~0x1FFF).view(torch.float32)


def check_case(case: Case, kernel: evtc.Kernel, seed: int = 0) -> list[str]:
    """Run ``kernel`` on every shape of ``case`` into poisoned outputs and compare with the function
    itself in float32. Returns what failed (empty when everything matched)."""
    fn = case.function()
    failures = []
    for index, (m, n, k) in enumerate(case.shapes):
        majors = case.call_majors if index % 2 else None  # every other shape: other layouts
        inputs = make_inputs(case, m, n, k, "cuda", seed + index, majors)
        before = {name: t.clone() for name, t in inputs.items() if isinstance(t, torch.Tensor)}
        for name in ("a", "b"):  # block-scaled: (tensor, scales) pairs
            if isinstance(inputs[name], tuple):
                before.update({f"{name}[{i}]": t.clone() for i, t in enumerate(inputs[name])})
        tf32 = case.ab_dtype == "float32"
        # float32 a and b: the kernel runs while torch allows tf32, and its wgmma rounds them toward
        # zero to tf32; the reference is the function in float32 on a and b so rounded.
        reference_inputs = inputs | {"a": tf32_truncated(inputs["a"]),
                                     "b": tf32_truncated(inputs["b"])} if tf32 else inputs
        reference = evtc.reference(fn, reference_inputs)
        out = _poisoned(kernel, reference)
        where = f"{m}x{n}x{k} L={case.batches}{' ' + str(majors) if majors else ''}"
        allowed = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        try:
            got = kernel(**inputs, out=out)
        except Exception as exc:  # noqa: BLE001 - every failure is reported with its case
            failures.append(f"{where}: {type(exc).__name__}: {exc}")
            continue
        finally:
            torch.backends.cuda.matmul.allow_tf32 = allowed
        if tf32 and kernel.last_path == "torch":
            # The torch path's float32 result is within every tolerance below of the reference: only
            # the path says whether the tf32 kernel ran.
            failures.append(f"{where}: float32 a and b with tf32 allowed took the torch path")
        float8_ab = is_float8(DTYPES[case.ab_dtype])
        noise = FLOAT8_ACC_NOISE if float8_ab else SUM_ORDER_ACC_NOISE
        noisy: dict[str, Any] = {}  # computed when a reduction first misses its tolerance
        for (key, g), (_, o), (_, r) in zip(_leaves(got), _leaves(out), _leaves(reference), strict=True):
            if g is not o:
                failures.append(f"{where} output {key}: not the out= tensor")
            if tuple(g.shape) != tuple(r.shape):
                failures.append(f"{where} output {key}: shape {tuple(g.shape)}, reference {tuple(r.shape)}")
                continue
            if is_float8(g.dtype):
                # Within one spacing everywhere, or else close by norm: a 16-bit cast inside the
                # program can round one way in the kernel and the other in torch, and that one
                # rounding carries into a float8 value near zero.
                rel, tol = float8_error(g, r.float()), FLOAT8_SPACINGS
                if not rel <= tol and relative_error(g.float(), round_to(r.float(), g.dtype)) <= FLOAT8_TOL:
                    rel = tol
            else:
                tile = g.dim() >= 2 and g.shape[-1] == (n // 2 if case.gated else n) and g.shape[-2] == m
                branchy = float8_ab and "torch.where(" in case.source
                keep = None
                if g.dtype in OUTPUT_ROUNDING:
                    # A 16-bit output (a sum of 16-bit values, say) overflows to inf where torch's
                    # does: those elements must be that inf, the others close.
                    rounded = r.float().to(g.dtype)
                    over = torch.isinf(rounded) & torch.isfinite(r.float())
                    if over.any():
                        if not torch.equal(g[over], rounded[over]):
                            failures.append(f"{where} output {key}: not inf where the float32 result "
                                            f"overflows {g.dtype}")
                        keep = ~over
                        g, r = g[keep], r[keep]
                rel = relative_error(g, r)
                tol = TILE_TOL if tile else FLOAT8_BRANCH_REDUCTION_TOL if branchy else REDUCTION_TOL
                # A 16-bit reduction (of a 16-bit value, as in torch) has one rounding of its own.
                tol = max(tol, OUTPUT_ROUNDING.get(g.dtype, 0.0))
                if not rel <= tol:
                    # A cancelling reduction or tile (see FLOAT8_ACC_NOISE and SUM_ORDER_ACC_NOISE).
                    # An output that does not cancel moves by about the noise's fraction of
                    # itself, twice that is below every tolerance here, so nothing is loosened.
                    noisy = noisy or dict(_leaves(acc_noise_reference(fn, reference_inputs, seed + index,
                                                                      noise)))
                    shifted = noisy[key] if keep is None else noisy[key][keep]
                    moved = torch.linalg.vector_norm(shifted.float() - r.float())
                    if torch.linalg.vector_norm(g.float() - r.float()) <= 2 * moved:
                        rel = tol
            if not rel <= tol:
                failures.append(f"{where} output {key} ({g.dtype}, path {kernel.last_path}): relative "
                                f"error {rel:.3g} > {tol}")
        for name, t in before.items():
            now = inputs[name[0]][int(name[2])] if name.endswith("]") else inputs[name]
            if not torch.equal(now, t):
                failures.append(f"{where}: input {name} was modified")
    return failures


# ---- random programs ---------------------------------------------------------------------------

UNARY = [
    "-{x}", "{x}.abs()", "torch.sqrt({x}.abs() + 0.01)", "torch.exp(torch.clamp({x}, -3.0, 2.0))",
    "torch.tanh({x})", "torch.sigmoid({x})", "F.relu({x})", "F.gelu({x})",
    "F.gelu({x}, approximate='tanh')", "F.silu({x})", "F.leaky_relu({x}, 0.1)", "F.softplus({x})",
    "{x} * torch.tanh({x})", "{x} * 1.5", "{x} + 0.25", "{x} / 3.0", "{x}.clamp(-2.0, 2.0)",
    "F.hardswish({x})", "torch.sin({x})", "{x}.to(torch.float16)", "{x}.to(torch.bfloat16)",
    "torch.log1p({x}.abs())", "torch.erf({x})", "torch.rsqrt({x}.abs() + 1.0)",
]
BINARY = [
    "({x} + {y})", "({x} - {y})", "({x} * torch.tanh({y}))", "({x} / ({y}.abs() + 1.0))",
    "torch.maximum({x}, {y})", "torch.minimum({x}, {y})",
    # A margin: x > y on values that differ only by rounding (y = x.to(torch.float16)) would
    # compare rounding noise, which flips with the summation order of acc.
    "torch.where({x} > {y} + 0.125, {x}, {y} * 0.5)",
]
WITH_ARG = ["({x} * {s})", "({x} + {s})", "({s} * {x} - {x})"]
REDUCTIONS = {
    "row_sum": "{x}.sum(-1)", "row_amax": "{x}.amax(-1)", "row_mean_keep": "{x}.mean(-1, keepdim=True)",
    "col_sum": "{x}.sum(-2)", "col_amin": "{x}.amin(-2)", "all_abs_amax": "{x}.abs().amax()",
    "batch_sum": "{x}.sum((-2, -1))",
}
OUT_DTYPES = ["float16", "bfloat16", "float32", "float8_e4m3fn"]


def _random_operand(rng: random.Random, name: str, batched: bool, gated: bool) -> OperandSpec:
    kind = rng.choice(["tile", "tile", "row", "row", "col", "scalar", "scalar", "arg"])
    if kind == "arg":
        return OperandSpec(name, "arg")
    per_batch = batched and rng.random() < 0.5
    dtype = rng.choice(["float32", "float16", "bfloat16"]) if kind in ("tile", "row", "col") else \
        rng.choice(["float32", "float32", "float16"])
    form = {"row": rng.choice(["n", "1n"]), "scalar": rng.choice(["0", "1"])}.get(kind, "")
    major = rng.choice(["n", "n", "m"]) if kind == "tile" else "n"
    half = gated and kind in ("tile", "row") and rng.random() < 0.6
    return OperandSpec(name, kind, dtype, per_batch, form, major, half)


def random_case(seed: int, index: int) -> Case:
    """Case ``index`` of ``seed``: a random program over random operands, layouts and sizes."""
    rng = random.Random(f"evtc-fuzz:{seed}:{index}")
    batches = rng.choice([None, None, 2, 3, 4])
    gated = rng.random() < 0.2
    operands = tuple(_random_operand(rng, f"x{i}", batches is not None, gated)
                     for i in range(rng.randint(0, 4)))
    lines = []
    if gated:
        pre = "acc"
        for op in operands:
            if not op.half and op.kind in ("tile", "row"):
                pre = f"({pre} + {op.name})" if rng.random() < 0.7 else f"({pre} * torch.tanh({op.name}))"
        lines.append(f"gate, up = {pre}.chunk(2, dim=-1)")
        tiles = ["gate", "up"]
        usable = [op for op in operands if op.half or op.kind not in ("tile", "row")]
    else:
        tiles = ["acc"]
        usable = list(operands)
    tensors = list(tiles) + [op.name for op in usable if op.kind != "arg"]
    args = [op.name for op in usable if op.kind == "arg"]
    for step in range(rng.randint(1, 10)):
        name = f"v{step}"
        roll = rng.random()
        x = rng.choice(tensors)
        if roll < 0.45:
            expr = rng.choice(UNARY).format(x=x)
        elif roll < 0.9 or not args:
            expr = rng.choice(BINARY).format(x=x, y=rng.choice(tensors))
        else:
            expr = rng.choice(WITH_ARG).format(x=x, s=rng.choice(args))
        lines.append(f"{name} = {expr}")
        tensors.append(name)
    # Outputs: full tiles (a value plus a tile, in case the value is a vector or a scalar), then
    # reductions of full tiles.
    outputs = [f"{rng.choice(tensors)} + {rng.choice(tiles)}" for _ in range(rng.randint(1, 3))]
    n_tiles = len(outputs)
    reductions = [r for r in REDUCTIONS if batches is not None or r != "batch_sum"]
    for _ in range(rng.choice([0, 0, 1, 2])):
        source = f"({rng.choice(tensors)} + {rng.choice(tiles)})"
        outputs.append(REDUCTIONS[rng.choice(reductions)].format(x=source))
    single = len(outputs) == 1
    names = ["D"] if single else [f"D{i}" for i in range(len(outputs))]
    out_dtypes = tuple((names[i], rng.choice(OUT_DTYPES)) for i in range(n_tiles) if rng.random() < 0.6)
    params = ", ".join(["acc"] + [op.name for op in operands])
    body = lines + [("return " + outputs[0]) if single else "return (" + ", ".join(outputs) + ",)"]
    source = f"def epilogue({params}):\n" + "".join(f"    {line}\n" for line in body)
    fp8 = any(dt == "float8_e4m3fn" for _, dt in out_dtypes)
    shapes = tuple(_random_shape(rng, gated, fp8) for _ in range(2))
    ab_dtype, a_major, b_major = rng.choice(["float16", "bfloat16"]), rng.choice(["k", "k", "m"]), \
        rng.choice(["n", "k"])
    call_majors = (rng.choice(["k", "m"]), rng.choice(["n", "k"])) if rng.random() < 0.15 else None
    # float8 a and b in one case of five, K-major as they must be compiled (calls of other layouts
    # are staged). Drawn from a stream of their own, so that every other draw of a case is the
    # same as before float8 joined.
    ab_rng = random.Random(f"evtc-fuzz-ab:{seed}:{index}")
    block_scales = 0
    if ab_rng.random() < 0.2:
        ab_dtype = ab_rng.choice(["float8_e4m3fn", "float8_e5m2"])
        a_major, b_major = "k", "k"
        # Half of them block-scaled (gated ones too: halves of a multiple of 32 columns run the
        # kernel, others the torch path).
        if ab_rng.random() < 0.5:
            block_scales = ab_rng.choice([1, 128])
    elif random.Random(f"evtc-fuzz-tf32:{seed}:{index}").random() < 0.125:
        # float32 a and b (the tf32 kernel) in one case of ten, K-major as they compile to a kernel.
        ab_dtype, a_major, b_major = "float32", "k", "k"
    return Case(f"fuzz-{seed}-{index}", source, operands, ab_dtype, a_major, b_major, batches, gated, shapes,
                out_dtypes, call_majors=call_majors, seed=index, block_scales=block_scales)


def _random_shape(rng: random.Random, gated: bool, fp8: bool) -> tuple[int, int, int]:
    """Mostly TMA-friendly sizes (the kernel path); one in four odd (the staged path)."""
    m = rng.choice([rng.randint(1, 64), rng.randint(65, 700)])
    if rng.random() < 0.25:
        half = rng.randint(1, 260)
        return m, (2 * half if gated else rng.randint(1, 520)), rng.randint(1, 520)
    unit = 16 if fp8 else 8
    n = unit * rng.randint(1, 520 // unit)
    return m, (2 * n if gated else n), 8 * rng.randint(1, 65)


# ---- the matrix ----------------------------------------------------------------------------------

#: Each operand kind in each of its forms, shared or per batch, as the matrix crosses them.
KIND_VARIANTS = [
    ("tile", "float16", "", "n"), ("tile", "bfloat16", "", "m"), ("tile", "float32", "", "n"),
    ("row", "float32", "n", "n"), ("row", "bfloat16", "1n", "n"), ("col", "float16", "", "n"),
    ("scalar", "float32", "0", "n"), ("scalar", "float16", "1", "n"), ("arg", "float32", "", "n"),
]


@dataclass
class _Rotation:
    """Cycles through the values of the axes a matrix case does not isolate (dtypes, majors,
    output dtypes, shapes), so each value meets many kinds."""

    counter: int = 0
    values: dict[str, list] = field(default_factory=lambda: {
        "ab": ["float16", "bfloat16"], "a": ["k", "m", "k"], "b": ["n", "k"],
        "out": ["float16", "bfloat16", "float32", "float8_e4m3fn"],
    })

    def take(self, axis: str):
        values = self.values[axis]
        self.counter += 1
        return values[(self.counter * 7 + len(axis)) % len(values)]


def _shapes(gated: bool, fp8: bool) -> tuple[tuple[int, int, int], ...]:
    """An aligned odd-M shape (the kernel path) and one whose widths break TMA's 16-byte rule (the
    staged path)."""
    unit = 32 if gated and fp8 else 16 if (gated or fp8) else 8
    return ((257, 25 * unit, 136), (130, 2 * 501 if gated else 1001, 1001))


def matrix_cases() -> list[Case]:
    """Every operand kind and form x shared / per batch x full width / gated halves, each used
    alone (``acc * x + x``: a wrong batch or a wrong element shows), then combinations with several
    outputs and reductions; dtypes, majors and output dtypes rotate across them."""
    rot = _Rotation()
    cases = []
    for kind, dtype, form, major in KIND_VARIANTS:
        for batches in (None, 3):
            for per_batch in ((False, True) if batches and kind != "arg" else (False,)):
                for gated in (False, True):
                    op = OperandSpec("x", kind, dtype, per_batch, form, major,
                                     half=gated and kind in ("tile", "row") and rot.take("a") == "k")
                    out = rot.take("out")
                    if gated:
                        pre = "acc + x" if kind in ("tile", "row") and not op.half else "acc"
                        x = "x" if op.half or kind not in ("tile", "row") else "up"
                        body = [f"gate, up = ({pre}).chunk(2, dim=-1)", f"return F.silu(gate) * {x} + {x}"]
                    else:
                        body = ["return acc * x + x"]
                    source = "def epilogue(acc, x):\n" + "".join(f"    {line}\n" for line in body)
                    name = f"{kind}-{dtype}-{form or major}-{'per-batch' if per_batch else 'shared'}-" \
                           f"L{batches}-{'gated' if gated else 'full'}-out-{out}"
                    cases.append(Case(name, source, (op,), rot.take("ab"), rot.take("a"), rot.take("b"),
                                      batches, gated, _shapes(gated, out == "float8_e4m3fn"),
                                      (("D", out),), call_majors=(rot.take("a"), rot.take("b"))))
    cases += _combinations(rot)
    cases += _float8_cases(rot)
    cases += _float32_cases(rot)
    return cases


def _one_operand_program(kind: str, dtype: str, form: str, major: str, batches: int | None,
                         gated: bool) -> tuple[OperandSpec, str]:
    """The operand ``x`` (per batch where batched, on the halves' width where gated) and the program
    of a case of one operand kind with float8 or float32 a and b: ``acc * x + x``, or gated
    ``silu(gate) * up * x + x``."""
    op = OperandSpec("x", kind, dtype, batches is not None and kind != "arg", form, major,
                     half=gated and kind in ("tile", "row"))  # as wide as the output
    if gated:
        body = ["gate, up = acc.chunk(2, dim=-1)", "return F.silu(gate) * up * x + x"]
    else:
        body = ["return acc * x + x"]
    return op, "def epilogue(acc, x):\n" + "".join(f"    {line}\n" for line in body)


def _float32_cases(rot: _Rotation) -> list[Case]:
    """Every operand kind with float32 a and b (the tf32 kernel, which runs while torch allows tf32;
    check_case allows it and compares against the operands truncated to tf32), compiled K-major,
    one in three gated. The second shape breaks TMA's 16-byte rule and passes a and b in the other
    layouts: staged."""
    cases = []
    index = 0
    for kind, dtype, form, major in KIND_VARIANTS:
        for batches in (None, 3):
            gated = index % 3 == 2
            op, source = _one_operand_program(kind, dtype, form, major, batches, gated)
            out = rot.take("out")
            shapes = ((257, 2 * 160 if gated else 288, 288), (130, 2 * 501 if gated else 1001, 1001))
            width = "gated" if gated else "full"
            name = f"float32-{kind}-{dtype}-{form or major}-L{batches}-{width}-out-{out}"
            cases.append(Case(name, source, (op,), "float32", "k", "k", batches, gated, shapes, (("D", out),),
                              call_majors=("m", "n")))
            index += 1
    return cases


def _float8_cases(rot: _Rotation) -> list[Case]:
    """Every operand kind with float8 a and b (e4m3 and e5m2 in turn), compiled K-major; a third of
    them plain, a third with 1 x 128 and a third with 128 x 128 block scales, one in four gated
    (block-scaled gated ones with halves of 192 columns: the kernel reads B's scales per 32). The
    second shape breaks TMA's 16-byte rule and passes a and b in the other layouts: staged."""
    cases = []
    index = 0
    for kind, dtype, form, major in KIND_VARIANTS:
        for batches in (None, 3):
            gated = index % 4 == 3
            scales = (0, 1, 128)[index % 3]
            ab = ("float8_e4m3fn", "float8_e5m2")[index % 2]
            op, source = _one_operand_program(kind, dtype, form, major, batches, gated)
            out = rot.take("out")
            n = (384 if scales else 400) if gated else 272
            shapes = ((257, n, 272), (130, 2 * 501 if gated else 1001, 1001))
            tag = "-".join((["gated"] if gated else [])
                           + ([f"scales{scales}"] if scales or not gated else []))
            name = f"float8-{kind}-{dtype}-{form or major}-L{batches}-{ab[7:].rstrip('fn')}-{tag}-out-{out}"
            cases.append(Case(name, source, (op,), ab, "k", "k", batches, gated, shapes, (("D", out),),
                              call_majors=("m", "n"), block_scales=scales))
            index += 1
    return cases


def _combinations(rot: _Rotation) -> list[Case]:
    """Several operands, outputs and reductions together."""
    programs = [
        ("every-kind-two-outputs",
         ["y = torch.relu(acc * s + C + bias) * scale + alpha", "return y, (acc * dev).to(torch.bfloat16)"],
         ["C:tile", "bias:row", "scale:col", "s:scalar", "dev:scalar", "alpha:arg"], False),
        ("stats-rows-columns-all",
         ["y = F.gelu(acc + bias) * scale", "return y, (y * y).sum(-1), y.amax(-2), y.abs().amax()"],
         ["bias:row", "scale:col"], False),
        ("three-outputs-mean-keepdim",
         ["y = acc + C", "z = torch.where(y > 0, y, y * s)",
          "return y, z, (z * 0.5).to(torch.float16), z.mean(-1, keepdim=True)"],
         ["C:tile", "s:scalar"], False),
        ("per-batch-sums", ["y = torch.tanh(acc) + bias", "return y, y.sum((-2, -1)), y.sum(-2)"],
         ["bias:row"], True),
        ("swiglu-bias-residual-stats",
         ["gate, up = (acc + bias).chunk(2, dim=-1)", "y = F.silu(gate) * up + r",
          "return y, (y * y).sum(-1), y.amax(-2)"],
         ["bias:row-wide", "r:tile-half"], False),
        ("geglu-scales",
         ["gate, up = acc.chunk(2, dim=-1)", "return F.gelu(gate) * up * scale * s, (gate * up).sum(-1)"],
         ["scale:col", "s:scalar"], False),
    ]
    cases = []
    for name, body, ops, needs_batch in programs:
        gated = "chunk" in body[0]
        for batches in ((3,) if needs_batch else (None, 2)):
            operands = []
            for spec in ops:
                op_name, what = spec.split(":")
                kind = what.split("-")[0]
                per_batch = batches is not None and kind != "arg" and rot.take("a") != "k"
                dtype = rot.take("ab") if kind == "tile" else "float32"
                form = {"row": "n", "scalar": "1"}.get(kind, "")
                operands.append(OperandSpec(op_name, kind, dtype, per_batch, form, rot.take("b"),
                                            half=what.endswith("-half")))
            out = rot.take("out")
            source = f"def epilogue(acc, {', '.join(op.name for op in operands)}):\n" + \
                "".join(f"    {line}\n" for line in body)
            cases.append(Case(f"{name}-L{batches}-out-{out}", source, tuple(operands), rot.take("ab"),
                              rot.take("a"), rot.take("b"), batches, gated,
                              _shapes(gated, out == "float8_e4m3fn"), (("D0", out),),
                              call_majors=(rot.take("a"), rot.take("b"))))
    return cases


def case_by_name(name: str) -> Case:
    """A matrix case (by name) or a fuzz case (``fuzz-<seed>-<index>``): what worker processes
    rebuild from a name."""
    if name.startswith("fuzz-"):
        _, seed, index = name.split("-")
        return random_case(int(seed), int(index))
    for case in matrix_cases():
        if case.name == name:
            return case
    raise KeyError(name)


def compile_by_name(name: str, cache_dir: str) -> str:
    """Compile a case into ``cache_dir`` (a process-pool job); returns the error text or ''."""
    try:
        compile_case(case_by_name(name), cache_dir)
    except evtc.EpilogueError as err:
        return f"{type(err).__name__}: {err}"
    return ""


__all__ = ["Case", "OperandSpec", "case_by_name", "check_case", "compile_by_name", "compile_case",
           "example_inputs", "make_inputs", "matrix_cases", "random_case"]
