"""Random epilogue programs and random calls of them (tests/test_fuzz_layouts_gpu.py runs them), a
pure function of the case number.

`make_program(pid)` makes a Program: the source of `def f(acc, ...)` (what evtc compiles), a twin
source for the reference (the same lines, with each reduction routed through a hook that records the
reduced value and can shift the result, so that tolerances can be propagated through post-math, and
each inexact value through a hook that can perturb it by a few float32 roundings), its operands with
their example kinds, dtypes and layouts, the a/b dtype and majors, and the compile configuration.

Two modes, chosen per program:
  * exact ("integer") programs: a, b and every operand hold small integers or halves, so acc = a @ b
    is exact in float32 and so is every value the generator marks exact (it tracks a bound on the
    magnitude and the fraction bits of each value and only calls it exact while they fit float32's
    24 bits). Comparisons, masks, rounding to integers and discontinuous activations are generated
    only on exact values: a mask must then be torch's bit for bit.
  * smooth programs: normal data, no discontinuity (but clamps, maxima and `where` forms that are
    continuous at their switch), checked with accumulation-proportional tolerances.

`make_case(cid)` makes one call of program `cid // CASES_PER_PROGRAM`: sizes (decode M, odd N and K,
a few large M), the layout of every tensor at the call (contiguous, transposed, expanded, pitched,
every other element, misaligned offsets, permuted batches, 2-d beside 3-d), new runtime scalars,
a few shape or dtype swaps of operands that torch accepts, and out= buffers in random layouts.
Only what docs/epilogues.md and docs/compile.md document is generated.

The generator shares no code or op tables with tests/random_programs.py or tests/epilogue_cases.py,
so the three cover the documented surface in different ways.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import torch

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
DTYPE_NAMES = {F16: "torch.float16", BF16: "torch.bfloat16", F32: "torch.float32"}

N_PROGRAMS = 72
CASES_PER_PROGRAM = 3
N_CASES = N_PROGRAMS * CASES_PER_PROGRAM

# Numbers whose products with small integers stay exact (value, magnitude bits, fraction bits).
EXACT_NUMS = {0.5: (0, 1), 2.0: (1, 0), -1.0: (0, 0), 0.25: (0, 2), 1.5: (1, 1), -0.5: (0, 1),
              3.0: (2, 0), 0.75: (0, 2), -2.0: (1, 0), 0.125: (0, 3)}
EXACT_CMP = [0.0, 1.0, -1.0, 2.5, 0.5, -3.0, 4.0, -0.5]
SMOOTH_NUMS = [0.3, -1.7, 2.5, 0.01, 10.0, -0.6, 1.25, 0.9, -3.0, 0.125]
ARG_EXACT = [0.5, 2.0, -1.0, 0.25, 1.5, 0.75]
EXACT_BITS = 22  # hi + lo must stay within this for a value to count as exact in float32


@dataclass
class Operand:
    name: str
    kind: str  # tile | row | row2 | col | s0 | s1 | s11 | arg | wrow (gated: as wide as the GEMM)
    dtype: torch.dtype | None
    per_batch: bool = False  # batched programs: (L, ...) operand
    major: str = "n"  # tiles: the example's contiguous dim
    half: bool = False  # gated programs: N/2 wide
    hi: int = 0  # exact programs: a bound on log2 |value| and the fraction bits
    lo: int = 0

    def shape(self, L, M, N):
        n = N // 2 if self.half else N
        lead = (L,) if self.per_batch else ()
        return {
            "tile": (*lead, M, n), "row": (*lead, 1, n) if self.per_batch else (n,),
            "row2": (*lead, 1, n), "col": (*lead, M, 1), "wrow": (N,),
            "s0": (), "s1": (1,), "s11": (1, 1),
        }[self.kind]


@dataclass
class Value:
    name: str
    exact: bool
    hi: int = 0
    lo: int = 0


@dataclass
class Reduction:
    name: str  # the variable in the source
    op: str  # sum | mean | max (amax/amin)
    dims: tuple | None  # None: every dim
    keepdim: bool


@dataclass
class Program:
    pid: int
    src: str
    ref_src: str
    operands: list[Operand]
    ab_dtype: torch.dtype
    batched: bool
    gated: bool
    exact: bool
    config: dict | None
    a_mmajor: bool
    b_kmajor: bool
    reductions: list[Reduction]
    n_outputs: int

    @property
    def config_name(self):
        return "default" if self.config is None else ",".join(f"{k}={v}" for k, v in self.config.items())

    def describe(self):
        ops = ", ".join(f"{o.name}:{o.kind}{'/L' if o.per_batch else ''}{'/half' if o.half else ''}"
                        f"{'' if o.dtype is None else '/' + str(o.dtype).removeprefix('torch.')}"
                        f"{'/m-major' if o.major == 'm' else ''}" for o in self.operands)
        return (f"program {self.pid}: {'exact' if self.exact else 'smooth'} "
                f"{'batched ' if self.batched else ''}{'gated ' if self.gated else ''}"
                f"a/b {str(self.ab_dtype).removeprefix('torch.')} a {'m' if self.a_mmajor else 'k'}-major "
                f"b {'k' if self.b_kmajor else 'n'}-major config {self.config_name}; operands [{ops}]")


# Compile configurations and their weights: None is the default (a kernel per launch size).
CONFIGS = [(None, 40), ({"cluster": (1, 2)}, 35), ({"schedule": "cooperative"}, 10),
           ({"cluster": (2, 1)}, 10), ({"split_k": True}, 5)]


def _weighted(r, items):
    tot = sum(w for _, w in items)
    x = r.uniform(0, tot)
    for v, w in items:
        x -= w
        if x <= 0:
            return v
    return items[-1][0]


class _Gen:
    """One program's writer: its lines (and the reference twin's), the values so far with what the
    exact mode knows of each, its masks and its reductions."""

    def __init__(self, pid):
        self.r = random.Random(0xF0F2 * 1000 + pid)
        self.lines: list[str] = []  # evtc source lines
        self.ref_lines: list[str] = []  # reference twin
        self.k = 0
        self.vals: list[Value] = []
        self.masks: list[str] = []
        self.reds: list[Reduction] = []
        self.red_outs: list[str] = []  # reductions or post-math of them (outputs)
        self.used: set = set()
        self.consumed: set = set()

    def fresh(self, p="v"):
        self.k += 1
        return f"{p}{self.k}"

    def emit(self, line, ref=None):
        self.lines.append("    " + line)
        self.ref_lines.append("    " + (line if ref is None else ref))

    # ---------------------------------------------------------------- operands
    def operands(self, batched, gated):
        r = self.r
        ops = []
        n = r.choice([0, 1, 1, 2, 2, 3, 3, 4])
        kinds = ["tile", "tile", "row", "row2", "col", "s0", "s1", "s11", "arg", "arg"]
        for i in range(n):
            kind = r.choice(kinds)
            name = {"tile": "C", "row": "bias", "row2": "rowv", "col": "colv", "s0": "s", "s1": "s",
                    "s11": "s", "arg": "alpha"}[kind] + str(i)
            dtype = None if kind == "arg" else r.choice([F16, BF16, F32, F32] if kind.startswith("s")
                                                        else [F16, BF16, F32])
            op = Operand(name, kind, dtype)
            # per batch only in batched programs: beside 2-d a and b, evtc refuses an operand of three
            # dims (torch's result would be 3-d; docs/epilogues.md)
            if batched and kind in ("tile", "row", "col"):
                op.per_batch = r.random() < 0.6
            if kind == "tile":
                op.major = "m" if r.random() < 0.3 else "n"
            if gated and kind in ("tile", "row", "row2"):
                op.half = True
            op.hi, op.lo = {"tile": (2, 0), "row": (2, 1), "row2": (2, 1), "col": (1, 1)}.get(kind, (1, 2))
            ops.append(op)
        if gated and r.random() < 0.5:  # a bias as wide as the GEMM, added before the split
            ops.append(Operand(f"wb{n}", "wrow", r.choice([F16, BF16, F32]), hi=2, lo=1))
        return ops

    # ---------------------------------------------------------------- helpers
    def pick_val(self, exact_only=False):
        vs = [v for v in self.vals if v.exact] if exact_only else self.vals
        if not vs:
            return None
        # bias towards recent values
        return vs[-1] if self.r.random() < 0.75 else self.r.choice(vs)

    def num(self, exact):
        if exact:
            c = self.r.choice(list(EXACT_NUMS))
            return repr(c), EXACT_NUMS[c]
        return repr(self.r.choice(SMOOTH_NUMS)), None

    def operand_pick(self, ops):
        cands = [o for o in ops if o.kind != "wrow"]
        if not cands:
            return None
        unused = [o for o in cands if o.name not in self.used]
        o = self.r.choice(unused) if unused and self.r.random() < 0.8 else self.r.choice(cands)
        self.used.add(o.name)
        return o

    def push(self, expr, exact, hi=0, lo=0):
        self.consumed.update(re.findall(r"\b(?:v\d+|m\d+|acc|gate|up|h)\b", expr))
        name = self.fresh()
        ok = exact and hi + lo <= EXACT_BITS
        # the reference twin perturbs every inexact value by a few float32 roundings on request
        # (Hook.p), to measure how far rounding inside the epilogue can carry
        self.emit(f"{name} = {expr}", f"{name} = {expr}" if ok else f"{name} = _H.p({expr})")
        v = Value(name, ok, hi, lo)
        self.vals.append(v)
        return v

    # ---------------------------------------------------------------- steps
    def step_binary(self, ops, exact):
        """A value with an operand, a number or another value."""
        r = self.r
        x = self.pick_val()
        c = r.random()
        if c < 0.45 and any(o.kind != "wrow" for o in ops):
            o = self.operand_pick(ops)
            y, yh, yl, yexact = o.name, o.hi, o.lo, exact
            ytensor = o.kind != "arg"
        elif c < 0.75:
            y, hl = self.num(exact)
            yh, yl = hl if hl else (0, 0)
            yexact, ytensor = exact, False
        else:
            v = self.pick_val()
            y, yh, yl, yexact, ytensor = v.name, v.hi, v.lo, v.exact, True
        ex = x.exact and yexact
        forms = [
            ("{x} + {y}", "add"), ("{x} - {y}", "add"), ("{y} - {x}", "add"), ("{x} * {y}", "mul"),
            ("{y} * {x}", "mul"), ("torch.mul({x}, {y})", "mul"), ("torch.add({x}, {y}, alpha=2.0)", "add2"),
            ("torch.sub({x}, {y}, alpha=0.5)", "addh"),
        ]
        if ytensor:
            forms += [("torch.maximum({x}, {y})", "max"), ("torch.minimum({x}, {y})", "max"),
                      ("{x} / ({y}.abs() + 1.0)", "div"),
                      ("torch.clamp({x}, min={y}, max={y}.abs() + 1.0)", "max"),
                      ("torch.addcmul({x}, {y}, {y}, value=0.5)", "addcmul")]
        form, how = r.choice(forms)
        if how == "add":
            hi, lo = max(x.hi, yh) + 1, max(x.lo, yl)
        elif how == "add2":
            hi, lo = max(x.hi, yh + 1) + 1, max(x.lo, yl)
        elif how == "addh":
            hi, lo = max(x.hi, yh) + 1, max(x.lo, yl + 1)
        elif how == "mul":
            hi, lo = x.hi + yh, x.lo + yl
        elif how == "max":
            hi, lo = max(x.hi, yh) + 1, max(x.lo, yl)
        elif how == "addcmul":
            hi, lo = max(x.hi, 2 * yh) + 1, max(x.lo, 2 * yl + 1)
        else:  # div: inexact
            ex, hi, lo = False, 0, 0
        self.push(form.format(x=x.name, y=y), ex, hi, lo)

    def step_pair(self, exact):
        """Two full values combined."""
        if len(self.vals) < 2:
            return self.step_unary(exact)
        r = self.r
        x, y = r.sample(self.vals, 2)
        form = r.choice(["{x} + {y}", "{x} * {y}", "{x} - {y}", "torch.maximum({x}, {y})",
                         "torch.where({x} > {y}, {x}, {y})", "torch.fmin({x}, {y})",
                         "torch.lerp({x}.float(), {y}.float(), 0.25)"])
        if "lerp" in form:
            return self.push(form.format(x=x.name, y=y.name), False)
        if "*" in form:
            hi, lo = x.hi + y.hi, x.lo + y.lo
        else:
            hi, lo = max(x.hi, y.hi) + 1, max(x.lo, y.lo)
        self.push(form.format(x=x.name, y=y.name), x.exact and y.exact, hi, lo)

    def step_unary(self, exact):
        """A unary form: one that keeps exact values exact, or a smooth function (never exact)."""
        r = self.r
        x = self.pick_val()
        exact_forms = [
            ("-{x}", 0, 0), ("{x}.abs()", 0, 0), ("torch.abs({x})", 0, 0), ("torch.relu({x})", 0, 0),
            ("F.relu({x})", 0, 0), ("{x}.clamp(-3.0, 5.0)", 0, 0), ("torch.clamp({x}, min=-2.0)", 0, 0),
            ("{x}.clamp_max(4.0)", 0, 0), ("F.hardtanh({x}, -2.0, 3.0)", 0, 0), ("F.relu6({x})", 0, 0),
            ("F.leaky_relu({x}, 0.125)", 0, 3), ("F.leaky_relu({x}, 0.5)", 0, 1), ("{x} * 0.5", 0, 1),
            ("torch.square({x})", "sq", 0), ("{x} * {x}", "sq", 0), ("torch.neg({x})", 0, 0),
        ]
        smooth_forms = [
            "F.gelu({x})", "F.gelu({x}, approximate='tanh')", "F.silu({x})", "torch.sigmoid({x})",
            "torch.tanh({x})", "F.softplus({x})", "F.softplus({x}, beta=2.0)", "F.elu({x})",
            "F.elu({x}, alpha=0.5)", "F.mish({x})", "F.hardswish({x})", "F.hardsigmoid({x})",
            "torch.exp(-{x}.abs())", "torch.exp({x}.clamp(max=4.0))", "torch.expm1({x}.clamp(-20.0, 3.0))",
            "torch.log1p({x}.abs())", "torch.log({x}.abs() + 1.0)", "torch.log2({x} * {x} + 1.0)",
            "torch.sqrt({x}.abs() + 0.25)", "torch.rsqrt({x}.abs() + 1.0)",
            "torch.reciprocal({x}.abs() + 1.0)",
            "torch.sin({x})", "torch.cos({x})", "torch.erf({x})", "F.softsign({x})", "F.selu({x})",
            "F.celu({x}, alpha=2.0)", "{x} * torch.sigmoid(1.702 * {x})", "F.logsigmoid({x})",
            "F.gelu({x} * 0.125)", "torch.tanh({x} * 0.25) * 2.0",
        ]
        core = ["F.gelu({x})", "F.gelu({x}, approximate='tanh')", "F.silu({x})", "torch.sigmoid({x})",
                "torch.tanh({x})", "F.softplus({x})", "torch.exp(-{x}.abs())", "torch.log1p({x}.abs())"]
        if r.random() < (0.45 if exact else 0.3):
            form, h, fb = r.choice(exact_forms)
            if h == "sq":
                hi, lo = 2 * x.hi, 2 * x.lo
            else:
                hi, lo = x.hi + h, x.lo + fb
            self.push(form.format(x=x.name), x.exact, hi, lo)
        else:
            form = r.choice(core) if r.random() < 0.5 else r.choice(smooth_forms)
            self.push(form.format(x=x.name), False)

    def step_exact_only(self, exact):
        """Rounding and discontinuous activations: only on exact values of exact programs."""
        x = self.pick_val(exact_only=True)
        if x is None or not exact:
            return self.step_unary(exact)
        r = self.r
        forms = [("torch.round({x} * 0.25)", 0), ("torch.floor({x} * 0.5)", 0), ("torch.ceil({x} * 0.5)", 0),
                 ("torch.trunc({x} * 0.25)", 0), ("torch.sign({x})", "one"),
                 ("F.threshold({x}, 1.0, -2.0)", 0), ("F.hardshrink({x}, 1.0)", 0),
                 ("F.softplus({x}, beta=1.0, threshold=2.0)", "inexact"), ("torch.frac({x} * 0.25)", "frac")]
        form, how = r.choice(forms)
        if how == "one":
            self.push(form.format(x=x.name), True, 0, 0)
        elif how == "inexact":
            self.push(form.format(x=x.name), False)
        elif how == "frac":
            self.push(form.format(x=x.name), True, 0, x.lo + 2)
        else:
            # rounding to an integer drops the fraction bits; a threshold or a shrink keeps x's
            keeps_fraction = "threshold" in form or "shrink" in form
            self.push(form.format(x=x.name), True, x.hi, x.lo if keeps_fraction else 0)

    def step_compare(self, ops):
        x = self.pick_val(exact_only=True)
        if x is None:
            return False
        r = self.r
        c = r.random()
        if c < 0.5:
            y = repr(r.choice(EXACT_CMP))
        elif c < 0.75 and any(o.kind != "wrow" for o in ops):
            y = self.operand_pick(ops).name
        else:
            ys = [v for v in self.vals if v.exact and v is not x]
            y = r.choice(ys).name if ys else repr(r.choice(EXACT_CMP))
        form = r.choice(["{x} > {y}", "{x} >= {y}", "{x} < {y}", "{x} <= {y}", "{x} == {y}", "{x} != {y}",
                         "torch.gt({x}, {y})", "torch.le({x}, {y})", "{x}.ne({y})"])
        m = self.fresh("m")
        self.consumed.update({x.name, y})
        self.emit(f"{m} = {form.format(x=x.name, y=y)}")
        self.masks.append(m)
        return True

    def step_maskop(self):
        r = self.r
        if not self.masks:
            return
        m1 = r.choice(self.masks)
        m2 = r.choice(self.masks)
        form = r.choice(["{a} & {b}", "{a} | {b}", "~{a}", "{a} ^ {b}", "torch.logical_and({a}, {b})",
                         "torch.logical_not({a})", "torch.logical_or({a}, {b})"])
        m = self.fresh("m")
        self.consumed.update({m1, m2})
        self.emit(f"{m} = {form.format(a=m1, b=m2)}")
        self.masks.append(m)

    def step_mask_use(self, ops):
        r = self.r
        if not self.masks:
            return
        m = r.choice(self.masks)
        x = self.pick_val()
        c = r.random()
        if c < 0.35:
            o = self.operand_pick(ops) if r.random() < 0.5 else None
            if o is not None:
                y, yh, yl = o.name, o.hi, o.lo
                yex = True
            elif len(self.vals) > 1 and r.random() < 0.5:
                v = r.choice(self.vals)
                y, yh, yl, yex = v.name, v.hi, v.lo, v.exact
            else:
                yv, (yh, yl) = self.num(True)
                y, yex = yv, True
            self.push(f"torch.where({m}, {x.name}, {y})", x.exact and yex, max(x.hi, yh), max(x.lo, yl))
        elif c < 0.5:
            self.push(f"{x.name}.where({m}, 0.5)", x.exact, x.hi, max(x.lo, 1))
        elif c < 0.65:
            self.push(f"{x.name} * {m}", x.exact, x.hi, x.lo)
        elif c < 0.8:
            self.push(f"{x.name}.masked_fill({m}, -1.5)", x.exact, max(x.hi, 1), max(x.lo, 1))
        else:
            self.push(f"{m}.float() * 2.0 + {x.name}", x.exact, max(x.hi, 1) + 1, x.lo)

    def step_reduce(self, batched):
        """A reduction of a value (or of a mask as float), maybe with post-math; each is an output."""
        r = self.r
        src_v = self.pick_val()
        if src_v is None:
            return
        src = src_v.name
        pre = r.choice(["", "", "", ".abs()", " * 0.5", ".float()"])
        if self.masks and r.random() < 0.15:
            src, pre = r.choice(self.masks), ".float()"
        y = f"{src}{pre}" if not pre.startswith(" ") else f"({src}{pre})"
        # (kind of bound, form, dims reduced, keepdim): amin shares amax's bound
        choices = [("sum", "{y}.sum(-1)", (-1,), False), ("max", "{y}.amax(-1)", (-1,), False),
                   ("mean", "{y}.mean(-1)", (-1,), False), ("max", "{y}.amin(dim=-1)", (-1,), False),
                   ("sum", "{y}.sum(-1, keepdim=True)", (-1,), True),
                   ("sum", "torch.sum({y}, dim=-2)", (-2,), False),
                   ("max", "{y}.amax(-2)", (-2,), False), ("sum", "{y}.sum()", None, False),
                   ("max", "{y}.amax()", None, False), ("mean", "{y}.mean(-2)", (-2,), False),
                   ("max", "{y}.max()", None, False)]
        if batched:
            choices += [("sum", "{y}.sum((-2, -1))", (-2, -1), False),
                        ("max", "{y}.amax(dim=(-2, -1))", (-2, -1), False)]
        op, form, dims, keep = r.choice(choices)
        name = self.fresh("r")
        self.consumed.add(src)
        yname = f"_y_{name}"
        expr = form.format(y=y)
        self.emit(f"{name} = {expr}",
                  f"{yname} = {y}; {name} = _H.red({name!r}, {yname}, {form.format(y=yname)})")
        self.reds.append(Reduction(name, op, dims, keep))
        # post-math on the reduction, finished in the kernel (or by the host)
        c = r.random()
        if c < 0.25:
            q = self.fresh("q")
            self.emit(f"{q} = torch.sqrt({name}.abs() + 1.0) * 2.0")
            self.red_outs.append(q)
        elif c < 0.4:
            q = self.fresh("q")
            self.emit(f"{q} = {name} * 0.5 - 1.0")
            self.red_outs.append(q)
        elif c < 0.5 and op == "sum" and dims == (-1,) and not keep:
            q = self.fresh("q")
            self.emit(f"{q} = torch.rsqrt({name}.abs() * (1.0 / {src_v.name}.shape[-1]) + 2.0)")
            self.red_outs.append(q)
        else:
            self.red_outs.append(name)


def _params(ops):
    return [f"{o.name}: float" if o.kind == "arg" else o.name for o in ops]


def make_program(pid: int) -> Program:
    g = _Gen(pid)
    r = g.r
    exact = r.random() < 0.45
    ab = r.choice([F16, BF16])
    batched = r.random() < 0.22
    gated = r.random() < 0.12
    config = _weighted(r, CONFIGS)
    a_mmajor = r.random() < 0.15
    b_kmajor = r.random() < 0.5
    ops = g.operands(batched, gated)

    if gated:
        wb = next((o for o in ops if o.kind == "wrow"), None)
        src = f"(acc + {wb.name})" if wb else "acc"
        g.emit(f"gate, up = {src}.chunk(2, dim=-1)")
        gate = Value("gate", exact, 13, 1)
        up = Value("up", exact, 13, 1)
        act = r.choice(["F.silu(gate)", "F.gelu(gate)", "torch.relu(gate)",
                        "F.gelu(gate, approximate='tanh')", "torch.sigmoid(gate)"])
        # never exact, even after a relu: |gate * up| may pass 2^24
        h = Value("h", False, 26, 2)
        g.emit(f"h = {act} * up", f"h = _H.p({act} * up)")
        g.vals = [gate, up, h] if r.random() < 0.3 else [h]
    else:
        g.vals = [Value("acc", exact, 12, 0)]
        if r.random() < 0.3:  # a scaling first, as GEMM epilogues usually start
            args = [o for o in ops if o.kind == "arg"]
            if args:
                g.used.add(args[0].name)
                g.push(f"acc * {args[0].name}", exact, 13, 2)
            else:
                g.push("acc * 0.125" if exact else "acc * 0.5", exact, 12, 3)

    n_steps = r.randint(2, 8)
    n_red = 0
    for _ in range(n_steps):
        c = r.random()
        if exact and c < 0.24:
            if not g.step_compare(ops):
                g.step_binary(ops, exact)
        elif exact and c < 0.31 and g.masks:
            g.step_maskop()
        elif exact and c < 0.42 and g.masks:
            g.step_mask_use(ops)
        elif exact and c < 0.48:
            g.step_exact_only(exact)
        elif c < 0.62:
            g.step_binary(ops, exact)
        elif c < 0.70:
            g.step_pair(exact)
        elif c < 0.88:
            g.step_unary(exact)
        elif n_red < 2:
            g.step_reduce(batched)
            n_red += 1
        else:
            g.step_binary(ops, exact)
    # every operand used at least once (a second operand of the last value)
    for o in ops:
        if o.kind != "wrow" and o.name not in g.used:
            x = g.vals[-1]
            g.used.add(o.name)
            if r.random() < 0.5:
                g.push(f"{x.name} + {o.name}", x.exact and exact, max(x.hi, o.hi) + 1, max(x.lo, o.lo))
            else:
                g.push(f"{x.name} * {o.name}", x.exact and exact, x.hi + o.hi, x.lo + o.lo)

    # values and masks nothing reads: folded into the last value, so that no step is dead code
    dangling = [v for v in g.vals[:-1] if v.name not in g.consumed and v.name not in ("acc", "gate", "up")]
    for d in dangling[-2:]:
        x = g.vals[-1]
        g.push(f"{x.name} + {d.name}", x.exact and d.exact, max(x.hi, d.hi) + 1, max(x.lo, d.lo))
    keep_mask = g.masks[-1] if g.masks and r.random() < 0.8 else None
    for m in [m for m in g.masks if m not in g.consumed and m != keep_mask][-2:]:
        x = g.vals[-1]
        g.push(f"torch.where({m}, {x.name}, {x.name} * 0.5)", x.exact, x.hi, x.lo + 1)
    # outputs: the last value, maybe another value or a mask, every reduction (post-math included)
    tiles = [g.vals[-1].name]
    others = [v.name for v in g.vals[:-1] if v.name not in ("gate", "up") or gated]
    if others and r.random() < 0.35:
        tiles.append(r.choice(others))
    if keep_mask is not None:
        tiles.append(keep_mask)
    if r.random() < 0.04:
        tiles.append(tiles[0])  # one value returned twice
    outs = []
    for t in tiles:
        if t.startswith("m"):
            outs.append(t)
            continue
        c = r.random()
        if c < 0.35:
            outs.append(f"{t}.to({DTYPE_NAMES[r.choice([F16, BF16, F32])]})")
        elif c < 0.45:
            outs.append(f"{t}.float()")
        else:
            outs.append(t)
    for q in g.red_outs:
        c = r.random()
        if c < 0.15:
            outs.append(f"{q}.float()")
        elif c < 0.3:
            outs.append(f"{q}.to({DTYPE_NAMES[r.choice([F16, BF16])]})")
        else:
            outs.append(q)
    if g.red_outs and r.random() < 0.06:
        outs = [o for o in outs if o.split(".")[0].split(" ")[0] in g.red_outs]  # reductions only
    if len(outs) == 1:
        ret = outs[0]
    else:
        c = r.random()
        if c < 0.5:
            ret = "(" + ", ".join(outs) + ")"
        elif c < 0.85:
            ret = "{" + ", ".join(f"'o{i}': {o}" for i, o in enumerate(outs)) + "}"
        else:
            ret = "[" + ", ".join(outs) + "]"
    g.emit(f"return {ret}")
    params = ", ".join(["acc"] + _params(ops))
    head = ["import torch", "import torch.nn.functional as F", "", ""]
    src = "\n".join(head + [f"def f({params}):"] + g.lines) + "\n"
    ref_src = "\n".join(head + [f"def f({params}):"] + g.ref_lines) + "\n"
    return Program(pid, src, ref_src, ops, ab, batched, gated, exact, config, a_mmajor, b_kmajor, g.reds,
                   len(outs))


# ------------------------------------------------------------------------------------------ calls

M_DECODE = [1, 3, 8, 17, 64, 100, 128]
M_MID = [200, 257, 384]
M_LARGE = [512, 777, 1024, 2048]
N_CHOICES = [8, 16, 40, 64, 96, 136, 200, 264, 520, 1000]
N_ODD = [33, 77, 135]
K_CHOICES = [8, 16, 24, 64, 72, 128, 200, 256, 512, 1000, 2048]
K_ODD = [7, 33, 77]

TILE_LAYOUTS = ["contig", "contig", "transposed", "expand_m", "expand_n", "pitch", "odd_pitch", "every_other",
                "offset"]
ROW_LAYOUTS = ["contig", "contig", "strided", "offset", "expanded"]
COL_LAYOUTS = ["contig", "contig", "from_row", "strided", "expanded"]
SCALAR_LAYOUTS = ["contig", "contig", "view"]
A_LAYOUTS = ["contig", "contig", "contig", "mmajor", "pitch", "odd_pitch", "offset", "expand_m"]
B_LAYOUTS = ["same", "same", "same", "other", "pitch", "odd_pitch", "offset"]
OUT_LAYOUTS = ["contig", "contig", "transposed", "odd_pitch", "every_other", "offset"]


@dataclass
class Case:
    cid: int
    prog: Program
    L: int | None
    M: int
    N: int
    K: int
    a_lay: str
    b_lay: str
    op_lay: dict
    swaps: dict  # operand name -> "row2" / "row" / "s0" / "s1" / "s11" / "nobatch" / dtype
    args: dict  # runtime scalar values
    use_out: bool
    out_lays: list
    positional: bool
    seed: int  # of the call's values
    out_alias: bool  # an operand as the out= of an output of its shape and dtype, where one matches

    def describe(self):
        alias = " (aliasing an operand)" if self.out_alias else ""
        return (f"case {self.cid}: L={self.L} M={self.M} N={self.N} K={self.K} a:{self.a_lay} b:{self.b_lay} "
                f"operands {self.op_lay} swaps {self.swaps} args {self.args} "
                f"out={self.out_lays if self.use_out else None}{alias} positional={self.positional}")


def make_case(cid: int) -> Case:
    prog = make_program(cid // CASES_PER_PROGRAM)
    r = random.Random(0xCA5E * 100000 + cid)
    which = cid % CASES_PER_PROGRAM
    # sizes: a decode M, a mid one and a large one in turn (shuffled a little)
    orders = [["decode", "mid", "large"], ["mid", "decode", "decode"], ["large", "decode", "mid"]]
    size_class = orders[r.randrange(3)][which]
    M = r.choice({"decode": M_DECODE, "mid": M_MID, "large": M_LARGE}[size_class])
    N = r.choice(N_ODD) if r.random() < 0.15 else r.choice(N_CHOICES)
    K = r.choice(K_ODD) if r.random() < 0.12 else r.choice(K_CHOICES)
    if prog.gated:
        N = 2 * max(4, N // 2) if r.random() < 0.8 else 2 * r.choice([33, 60, 100])  # even
    if M >= 512:  # keep the references cheap
        N = min(N, 520)
        K = min(K, 1024)
    L = r.choice([2, 3]) if prog.batched else None
    if L and M >= 512:
        M = r.choice([200, 512])
    a_lay = r.choice(A_LAYOUTS + (["permuted", "batch_expand", "2d"] if L else []))
    b_lay = r.choice(B_LAYOUTS + (["batch_expand", "2d"] if L else []))
    if a_lay == "2d" and b_lay == "2d":
        b_lay = "same"
    op_lay, swaps = {}, {}
    for o in prog.operands:
        if o.kind == "tile":
            lays = TILE_LAYOUTS + (["permuted", "batch_expand"] if o.per_batch else [])
            op_lay[o.name] = r.choice(lays)
        elif o.kind in ("row", "row2", "wrow"):
            op_lay[o.name] = r.choice(ROW_LAYOUTS)
        elif o.kind == "col":
            op_lay[o.name] = r.choice(COL_LAYOUTS)
        elif o.kind.startswith("s"):
            op_lay[o.name] = r.choice(SCALAR_LAYOUTS)
        if o.kind != "arg" and r.random() < 0.08:
            if o.kind == "row" and not o.per_batch:
                swaps[o.name] = "row2"
            elif o.kind == "row2" and not o.per_batch:
                swaps[o.name] = "row"
            elif o.kind.startswith("s"):
                swaps[o.name] = r.choice([k for k in ("s0", "s1", "s11") if k != o.kind])
            elif o.per_batch and o.kind in ("tile", "row", "col"):
                swaps[o.name] = "nobatch"
        if o.kind != "arg" and o.name not in swaps and r.random() < 0.06:
            swaps[o.name] = r.choice([d for d in (F16, BF16, F32) if d != o.dtype])
    args = {}
    for o in prog.operands:
        if o.kind == "arg":
            args[o.name] = r.choice(ARG_EXACT) if prog.exact else round(r.uniform(-2.0, 2.0), 4)
    use_out = r.random() < 0.4
    out_lays = [r.choice(OUT_LAYOUTS) for _ in range(prog.n_outputs)]
    positional = r.random() < 0.2
    out_alias = use_out and r.random() < 0.6
    return Case(cid, prog, L, M, N, K, a_lay, b_lay, op_lay, swaps, args, use_out, out_lays,
                positional, 0xDA7A * 1000 + cid, out_alias)
