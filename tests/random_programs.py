"""Random epilogue programs, a pure function of a seed (first written as an adversarial probe).

`make(seed)` returns a Program: the source text of `def f(acc, ...)`, its operands and a helper that
builds inputs at concrete sizes. The programs take 0-4 operands of every documented kind (tiles,
rows, columns and scalars, shared or per batch, 0-dim/(1,)/(1, 1) tensors, runtime floats) in
float16/bfloat16/float32 beside float16/bfloat16 `a` and `b`, some with NaN, infinities, signed
zeros and ties in them; then 3-15 steps of arithmetic, documented unary math, activations with
parameters, comparisons and mask algebra, clamps, 16-bit casts mid-way, powers, in-place ops on fresh
intermediates, Python loops and reductions (with post-math), some of them gated (chunk/split of the
accumulator); and return 1-4 outputs as a value, tuple, list or dict. Only what docs/epilogues.md
documents is generated, except that a few programs (`expect_error`) use a reduction per element,
which the doc names as an error.

The generator is independent of tests/fuzz.py's (it shares no code or op tables with it), so the
two cover the documented surface in different ways.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
DT_NAME = {F16: "torch.float16", BF16: "torch.bfloat16", F32: "torch.float32"}


@dataclass
class Operand:
    name: str
    kind: str  # tile, tile3, tile1, row, row2, row3, col, col3, s0, s1, s11, arg
    dtype: torch.dtype | None
    half: bool = False  # gated: N/2 columns (used after the chunk)
    scale: float = 1.0
    special: bool = False  # sprinkle NaN / inf / zeros / ties
    positive: bool = False


@dataclass
class Program:
    seed: int
    src: str
    operands: list[Operand]
    batched: bool
    gated: bool
    ab_dtype: torch.dtype
    acc_scale: float
    discontinuous: bool  # comparisons, rounding, mid casts: outliers at thresholds allowed
    expect_error: bool = False
    tags: set = field(default_factory=set)

    def shape_of(self, op: Operand, L, M, N):
        n = N // 2 if (self.gated and op.half) else N
        return {
            "tile": (M, n), "tile3": (L, M, n), "tile1": (1, M, n),
            "row": (n,), "row2": (1, n), "row3": (L, 1, n),
            "col": (M, 1), "col3": (L, M, 1),
            "s0": (), "s1": (1,), "s11": (1, 1),
        }[op.kind]

    def inputs(self, L, M, N, K, *, device="cpu", gen_seed=0, meta=False):
        g = torch.Generator().manual_seed(self.seed * 1000 + gen_seed)
        def rnd(shape, dtype, scale, special, positive):
            t = torch.randn(shape, generator=g, dtype=torch.float64) * scale
            if positive:
                t = t.abs() + 0.05
            if special and t.numel() > 0:
                u = torch.rand(shape, generator=g, dtype=torch.float64)
                t = torch.where(u < 0.05, torch.zeros_like(t), t)
                t = torch.where((u >= 0.05) & (u < 0.10), t.round() + 0.5, t)  # ties
                t = torch.where((u >= 0.10) & (u < 0.12), torch.full_like(t, float("nan")), t)
                t = torch.where((u >= 0.12) & (u < 0.14), torch.full_like(t, float("inf")), t)
                t = torch.where((u >= 0.14) & (u < 0.16), torch.full_like(t, -float("inf")), t)
                t = torch.where((u >= 0.16) & (u < 0.18), -torch.zeros_like(t), t)
            t = t.to(dtype)
            if meta:
                return torch.empty(shape, dtype=dtype, device="meta")
            return t.to(device=device)
        if self.batched:
            a = rnd((L, M, K), self.ab_dtype, 1.0, False, False)
            b = rnd((L, K, N), self.ab_dtype, self.acc_scale / math.sqrt(K), False, False)
        else:
            a = rnd((M, K), self.ab_dtype, 1.0, False, False)
            b = rnd((K, N), self.ab_dtype, self.acc_scale / math.sqrt(K), False, False)
        out = {"a": a, "b": b}
        for op in self.operands:
            if op.kind == "arg":
                out[op.name] = op.scale
            else:
                out[op.name] = rnd(self.shape_of(op, L, M, N), op.dtype, op.scale, op.special, op.positive)
        return out


NUMS = [0.5, 2.0, -1.5, 3.0, 0.1, 1e-3, 100.0, -0.25, 7.0, 1.0, 0.0, -3.0, 1e4]


class _Gen:
    def __init__(self, seed: int):
        self.r = random.Random(seed)
        self.seed = seed
        self.lines: list[str] = []
        self.k = 0
        self.disc = False
        self.tags: set = set()

    def num(self):
        r = self.r
        return r.choice(NUMS) if r.random() < 0.8 else round(r.uniform(-5, 5), 3)

    def fresh(self, prefix="v"):
        self.k += 1
        return f"{prefix}{self.k}"

    def emit(self, line):
        self.lines.append("    " + line)

    # ---- operands ----------------------------------------------------------------------------
    def build_operands(self, batched, gated):
        r = self.r
        n = r.randint(0, 4)
        ops = []
        kinds = ["tile", "row", "row2", "col", "s0", "s1", "s11", "arg", "arg"]
        if batched:
            kinds += ["tile3", "tile3", "tile1", "row3", "col3"]
        for i in range(n):
            kind = r.choice(kinds)
            dtype = None if kind == "arg" else r.choice([F16, BF16, F32])
            scale = r.choice([1.0, 1.0, 0.01, 50.0, 3e4]) if kind != "arg" else r.choice(
                [0.5, 2.0, -1.25, 1e-3, 1000.0, 0.0, 3.0])
            op = Operand(f"p{i}", kind, dtype, scale=scale, special=r.random() < 0.2,
                         positive=r.random() < 0.2)
            if dtype in (F16,) and scale > 1e4:
                op.scale = 1e3
            if gated and kind in ("tile", "tile3", "tile1", "row", "row2", "row3"):
                op.half = r.random() < 0.6
            ops.append(op)
        return ops

    # ---- expressions ---------------------------------------------------------------------------
    def other(self, full, vecs, allow_num=True):
        """A second operand: another full value, a vector/scalar operand, or a number."""
        r = self.r
        c = r.random()
        if vecs and c < 0.35:
            return r.choice(vecs)
        if allow_num and c < 0.6:
            return repr(self.num())
        return r.choice(full)

    def unary(self, x):
        r = self.r
        ops = [
            f"-{x}", f"torch.abs({x})", f"{x}.abs()", f"torch.neg({x})", f"torch.square({x})",
            f"torch.reciprocal({x}.abs() + 0.5)", f"{x} ** 2", f"{x} ** 3", f"torch.pow({x}, 2)",
            f"{x}.abs() ** 0.5", f"({x}.abs() + 1.0) ** -0.5", f"({x}.abs() + 0.25) ** -1",
            f"{x}.abs() ** 1.5", f"2.0 ** {x}.clamp(-20, 20)", f"1.5 ** {x}.clamp(-10, 10)",
            f"torch.pow({x}, 0.0)", f"{x} ** 1.0",
            f"torch.sqrt({x}.abs())", f"torch.rsqrt({x}.abs() + 1e-3)", f"torch.exp({x}.clamp(max=30))",
            f"torch.exp2({x}.clamp(max=30))", f"torch.expm1({x}.clamp(max=30))",
            f"torch.log({x}.abs() + 1e-3)", f"torch.log2({x}.abs() + 1e-2)",
            f"torch.log1p({x}.abs())", f"torch.sin({x})", f"torch.cos({x})", f"torch.tanh({x})",
            f"torch.erf({x})", f"torch.log10({x}.abs() + 1.0)", f"torch.tan({x}.clamp(-1.4, 1.4))",
            f"torch.sinh({x}.clamp(-30, 30))", f"torch.cosh({x}.clamp(-30, 30))",
            f"torch.sinh({x})", f"torch.cosh({x})", f"{x}.sqrt()", f"{x}.exp()", f"{x}.log()",
            f"torch.round({x})", f"torch.round({x}, decimals=1)", f"torch.floor({x})",
            f"torch.ceil({x})", f"torch.trunc({x})", f"torch.fix({x})", f"torch.frac({x})",
            f"torch.relu({x})", f"F.relu6({x})", f"F.leaky_relu({x}, {abs(self.num())})",
            f"F.elu({x}, alpha={abs(self.num())})", f"F.gelu({x})", f"F.gelu({x}, approximate='tanh')",
            f"F.silu({x})",
            f"F.softplus({x}, beta={r.choice([1.0, 2.0, 0.5])}, threshold={r.choice([20.0, 5.0, 1.0])})",
            f"F.mish({x})", f"F.hardswish({x})", f"F.hardsigmoid({x})",
            f"F.hardtanh({x}, {-abs(self.num())}, {abs(self.num())})", f"torch.sigmoid({x})",
            f"F.selu({x})", f"F.celu({x}, alpha={r.choice([1.0, 0.5, 2.0])})", f"F.logsigmoid({x})",
            f"F.softsign({x})", f"F.threshold({x}, {self.num()}, {self.num()})",
            f"F.hardshrink({x}, {abs(self.num())})", f"F.softshrink({x}, {abs(self.num())})",
            f"F.tanhshrink({x})", f"torch.deg2rad({x})", f"torch.rad2deg({x})", f"torch.positive({x})",
            f"torch.logit(torch.sigmoid({x}), eps={r.choice([1e-6, 1e-3, 0.01])})",
            f"torch.logit(torch.sigmoid({x}))", f"torch.sinc({x})",
            f"F.dropout({x}, p=0.5, training=False)", f"torch.nan_to_num({x})",
            f"torch.nan_to_num({x}, nan=0.0, posinf=1.0, neginf=-1.0)", f"torch.sign({x})",
            f"torch.sgn({x})", f"{x}.contiguous()", f"{x}.clone()", f"{x}.detach()",
            f"torch.clamp({x}, {-abs(self.num())}, {abs(self.num())})", f"{x}.clamp(min={self.num()})",
            f"{x}.clip(max={self.num()})", f"torch.clamp_min({x}, {self.num()})",
            f"torch.clamp_max({x}, {self.num()})", f"torch.relu_({x}.clone())",
            f"{x}.float()", f"{x}.half().float()", f"{x}.bfloat16().float()", f"{x}.half()",
            f"{x}.to(torch.bfloat16)", f"{x}.type(torch.float16)", f"{x}.to(torch.float32)",
            f"torch.nan_to_num({x}.half())", f"torch.isnan({x}).float()", f"torch.isinf({x}).float()",
            f"{x} / {self.num() or 3.0}", f"{x} * {self.num()}", f"{x} - {self.num()}",
            f"{self.num()} - {x}", f"{abs(self.num()) + 0.5} / ({x}.abs() + 1.0)",
            f"F.prelu({x}, torch.tensor([0.25]))",
        ]
        e = r.choice(ops)
        if any(k in e for k in ("round", "floor", "ceil", "trunc", "fix", "frac", "sign", "sgn", "threshold",
                                "shrink", "half", "bfloat16", "float16", "isnan", "isinf", "relu", "clamp",
                                "clip", "hardtanh", "hardswish", "hardsigmoid", "relu6")):
            self.disc = True
        return e

    def binary(self, x, full, vecs, args):
        r = self.r
        y = self.other(full, vecs)
        yt = self.other(full, vecs, allow_num=False)  # a tensor
        ops = [
            f"{x} + {y}", f"{x} - {y}", f"{x} * {y}", f"{y} * {x}", f"{y} - {x}",
            f"{x} / ({yt}.abs() + 1.0)", f"{x} / {yt}", f"torch.add({x}, {yt}, alpha={self.num()})",
            f"torch.sub({x}, {yt}, alpha={self.num()})", f"torch.mul({x}, {y})", f"torch.div({x}, {y})",
            f"torch.minimum({x}, {yt})", f"torch.maximum({x}, {yt})", f"torch.max({x}, {yt})",
            f"torch.min({x}, {yt})", f"torch.fmax({x}, {yt})", f"torch.fmin({x}, {yt})",
            f"torch.clamp({x}, min={yt}, max={yt}.abs() + 1.0)", f"{x}.clamp(max={yt})",
            f"torch.xlogy({x}, {yt}.abs() + 0.1)", f"torch.xlogy({x}, {yt})", f"torch.logaddexp({x}, {yt})",
            f"torch.logaddexp2({x}, {yt})", f"torch.rsub({x}, {y})",
            f"torch.addcmul({x}, {yt}, {self.other(full, vecs, False)}, value={self.num()})",
            f"torch.addcdiv({x}, {yt}, {self.other(full, vecs, False)}.abs() + 1.0, value={self.num()})",
            f"torch.lerp({x}, {yt}, {r.choice([0.25, 0.75, 1.5])})",
            f"torch.heaviside({x}, {yt})",
            f"torch.where({x} > {yt}, {x}, {y})", f"{x}.where({x} <= {self.num()}, {yt})",
            f"torch.where(({x} > 0) & ({yt} < 1.0), {x} * 2.0, {yt})",
            f"torch.where(torch.logical_or({x} > {self.num()}, {yt} == 0), {x}, -{x})",
            f"torch.where(~({x} >= {yt}), {x}, 0.0)", f"torch.where({x} != {x}, 0.0, {x})",
            f"({x} > {yt}) * {self.num()} + {x}", f"(({x} > 0) + ({yt} > 0)) * 1.0 + {x}",
            f"(({x} > 0) * ({yt} < 0)).float() * {x}", f"torch.masked_fill({x}, {x} < {y}, {self.num()})",
            f"{x}.masked_fill({yt} > 0.5, 0.0)", f"torch.logical_xor({x} > 0, {yt}).float()",
            f"torch.logical_and({x}, {yt}).float() * {x}", f"torch.logical_not({x} < {y}) * {x}",
            f"torch.maximum({x} > 0, {yt} > 0) * 1.0 + {x}", f"(({x} > 0) ^ ({yt} > 0)).float() - {x}",
            f"torch.gt({x}, {y}).float() + torch.le({x}, {y}).float() * {x}",
            f"torch.eq({x}, {yt}).float() + {x}", f"torch.ne({x}, {y}) * {x}",
            f"torch.add(({x} > 0), ({yt} > 0), alpha=2) * {x}",
            f"{x} * torch.isfinite({yt})",
            f"torch.where(torch.isposinf({yt}) | torch.isneginf({yt}), 1.0, {x})",
        ]
        if args:
            a = r.choice(args)
            ops += [f"{a} * {x}", f"{x} * {a} + {yt}", f"F.leaky_relu({x}, {a})", f"F.elu({x}, {a})",
                    f"{x} - {a}", f"{a} / ({x}.abs() + 1.0)", f"torch.clamp({x}, max={a})",
                    f"{x} ** {a}", f"torch.where({x} > {a}, {x}, {yt})", f"{x} >= {a}"]
        e = r.choice(ops)
        if any(k in e for k in (">", "<", "==", "!=", "where", "heaviside", "clamp", "max", "min", "masked",
                                "logical", "isfinite", "isposinf", "fm", ".gt", ".le", ".eq", ".ne", "^",
                                "torch.add((")):
            self.disc = True
        return e

    def reduction(self, x, batched, allow_keep=True):
        r = self.r
        fn = r.choice(["sum", "mean", "amax", "amin", "sum", "mean"])
        pre = r.choice(["", "", ".float()", ".abs()", " ** 2", ".half()", ".to(torch.bfloat16)"])
        if pre == " ** 2":
            base = f"({x} ** 2)"
        elif pre:
            base = f"{x}{pre}"
        else:
            base = x
        if pre in (".half()", ".to(torch.bfloat16)"):
            self.disc = True
        dims = ["-1", "-2", "None"] + (["(-2, -1)"] if batched else [])
        d = r.choice(dims)
        if d == "None":
            if fn in ("amax", "amin") and r.random() < 0.5:
                return f"{base}.{'max' if fn == 'amax' else 'min'}()", "all", False
            style = r.random()
            if style < 0.5:
                return f"{base}.{fn}()", "all", False
            return f"torch.{fn}({base})", "all", False
        keep = allow_keep and r.random() < 0.4
        kw = ", keepdim=True" if keep else ""
        if fn in ("sum", "mean") and r.random() < 0.25:
            kw += ", dtype=torch.float32"
        style = r.random()
        axis = {"-1": "row", "-2": "col", "(-2, -1)": "batch"}[d]
        if style < 0.4:
            return f"{base}.{fn}({d}{kw})", axis, keep
        if style < 0.7:
            return f"torch.{fn}({base}, dim={d}{kw})", axis, keep
        return f"{base}.{fn}(axis={d}{kw})", axis, keep


def make(seed: int) -> Program:
    g = _Gen(seed)
    r = g.r
    batched = r.random() < 0.3
    gated = r.random() < 0.18
    ab = r.choice([F16, BF16])
    acc_scale = r.choice([1.0, 1.0, 1.0, 0.01, 30.0, 2000.0])
    ops = g.build_operands(batched, gated)
    params = ", ".join(o.name for o in ops)
    head = f"def f(acc{', ' if params else ''}{params}):"
    full_w = [o.name for o in ops if o.kind in ("tile", "tile3", "tile1") and not (gated and o.half)]
    vec_w = [o.name for o in ops if o.kind in ("row", "row2", "row3") and not (gated and o.half)]
    shared = [o.name for o in ops if o.kind in ("col", "col3", "s0", "s1", "s11")]
    args = [o.name for o in ops if o.kind == "arg"]
    half_full = [o.name for o in ops if gated and o.half and o.kind in ("tile", "tile3", "tile1")]
    half_vec = [o.name for o in ops if gated and o.half and o.kind in ("row", "row2", "row3")]

    full = ["acc"]
    if gated:
        pre = "acc"
        if full_w or vec_w or shared:
            y = r.choice(full_w + vec_w + shared)
            pre = r.choice([f"(acc + {y})", f"(acc * {y})", f"torch.add(acc, {y})"])
        sp = r.choice([f"{pre}.chunk(2, dim=-1)", f"torch.chunk({pre}, 2, -1)",
                       f"{pre}.split(acc.shape[-1] // 2, -1)", f"{pre}.chunk(2, -1)"])
        g.emit(f"gate, up = {sp}")
        full = ["gate", "up"]
        g.tags.add("gated")
        tiles, vecs = list(half_full), half_vec + shared
    else:
        tiles, vecs = list(full_w), vec_w + shared
    pool_full = full + tiles
    nsteps = r.randint(3, 15)
    reds: list[tuple[str, str, bool]] = []
    computed: list[str] = []
    expect_error = False
    for _ in range(nsteps):
        c = r.random()
        x = r.choice(computed[-3:] + pool_full if computed else pool_full)
        name = g.fresh()
        if c < 0.42:
            e = g.unary(x)
        elif c < 0.82:
            e = g.binary(x, pool_full + computed, vecs, args)
        elif c < 0.9:
            e, axis, keep = g.reduction(x, batched)
            g.emit(f"{name} = {e}")
            # finish with scalars / other reductions of the same axis and keepdim
            same = [rr for rr in reds if rr[1] == axis and rr[2] == keep]
            if same and r.random() < 0.5:
                o = r.choice(same)[0]
                combined = r.choice([f"{name} + {o}", f"{name} * {o}", f"torch.maximum({name}, {o})",
                                     f"{name} / ({o}.abs() + 1.0)"])
                g.emit(f"{name} = {combined}")
            elif r.random() < 0.5:
                post = r.choice([f"torch.sqrt({name}.abs() + 1e-6)", f"{name} * 0.5", f"{name} - 1.0",
                                 f"torch.rsqrt({name}.abs() + 1e-5)", f"torch.log1p({name}.abs())"]
                                + ([f"{name} * {r.choice(args)}"] if args else [])
                                + ([f"{name} * {r.choice([o.name for o in ops if o.kind in ('s0', 's1')])}"]
                                   if axis == "all" and any(o.kind in ('s0', 's1') for o in ops) else []))
                g.emit(f"{name} = {post}")
            if r.random() < 0.03 and keep:
                # documented error: a reduction used per element
                nm2 = g.fresh()
                g.emit(f"{nm2} = {x} - {name}")
                computed.append(nm2)
                expect_error = True
            reds.append((name, axis, keep))
            continue
        elif c < 0.95:
            # in-place ops on a fresh intermediate
            g.emit(f"{name} = {x} * 1.0")
            inpl = r.choice([f"{name}.mul_({g.num()})", f"{name}.add_({g.num()})", f"{name}.relu_()",
                             f"{name}.clamp_({-abs(g.num())}, {abs(g.num()) + 1})", f"torch.sigmoid_({name})",
                             f"{name} *= {g.num()}", f"{name} += 1.0", f"F.relu({name}, inplace=True)",
                             f"{name}.neg_()", f"{name}.abs_()", f"F.elu_({name})"])
            g.emit(inpl)
            computed.append(name)
            continue
        else:
            # helper function / loop over constants
            k = r.randint(1, 3)
            g.emit(f"{name} = {x}")
            g.emit(f"for c in {[r.choice([0.5, 1.5, -0.5, 2.0]) for _ in range(k)]}:")
            g.emit(f"    {name} = {name} * c + {r.choice(NUMS)}")
            computed.append(name)
            continue
        g.emit(f"{name} = {e}")
        computed.append(name)

    # outputs
    cands = computed or ["acc * 1.0"]
    if gated and not computed:
        cands = ["gate * up"]
    nout = r.randint(1, 4)
    outs = []
    for i in range(nout):
        if reds and r.random() < 0.3:
            o = r.choice(reds)[0]
        else:
            o = cands[-1] if i == 0 else r.choice(cands)
        if r.random() < 0.35:
            o = f"{o}.to({r.choice(['torch.float16', 'torch.bfloat16', 'torch.float32'])})"
        elif r.random() < 0.1:
            o = f"{o}.float()"
        outs.append(o)
    style = r.random()
    if nout == 1 and style < 0.6:
        g.emit(f"return {outs[0]}")
    elif style < 0.75:
        g.emit("return {" + ", ".join(f"'o{i}': {o}" for i, o in enumerate(outs)) + "}")
    elif style < 0.85:
        g.emit("return [" + ", ".join(outs) + "]")
    else:
        g.emit("return (" + ", ".join(outs) + ",)")
    src = "import torch\nimport torch.nn.functional as F\n\n\n" + head + "\n" + "\n".join(g.lines) + "\n"
    return Program(seed, src, ops, batched, gated, ab, acc_scale, g.disc, expect_error, g.tags)


def load(prog: Program, directory):
    """Write the program's source to a file (so evtc can name its lines) and import `f`."""
    import importlib.util
    import os
    path = os.path.join(str(directory), f"prog_{prog.seed}.py")
    with open(path, "w") as fh:
        fh.write(prog.src)
    spec = importlib.util.spec_from_file_location(f"randprog_{prog.seed}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.f, path


def flat_outputs(x):
    """(keys, values) of a program's result: a dict's keys, a tuple's or list's positions, or
    [None] for one tensor."""
    if isinstance(x, dict):
        return list(x.keys()), list(x.values())
    if isinstance(x, (tuple, list)):
        return list(range(len(x))), list(x)
    return [None], [x]
