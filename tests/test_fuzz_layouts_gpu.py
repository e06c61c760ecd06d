"""Random epilogue programs (tests/fuzz_layouts.py) crossed with random layouts, sizes, dtypes and
out= buffers at the call, each call checked elementwise against an independent float64 torch
reference of the same function.

What it adds to tests/test_random_programs_gpu.py and tests/test_fuzz_gpu.py (random programs on
operands in their compiled layouts, or another major) and tests/test_layouts_gpu.py (awkward
layouts of a few fixed epilogues): every random program is called with random layouts of a, b and
every operand (transposed, expanded along M or N or the batch, pitched, odd-pitched, every other
element, misaligned offsets, permuted batches, a 2-d a or b beside a 3-d other), at decode, odd and
large sizes, with new runtime scalars, sometimes an operand of another vector/scalar shape or dtype
than compiled (which evtc must run as torch does, or refuse with a CallError), and out= buffers in
random layouts (NaN-filled; bool ones filled with the negation of the expected mask), some of them
an operand itself, on kernels compiled with the default launch-per-size family or a pinned
configuration. 72 programs, 3 calls each: 216 cases.

Checks per call: the structure, dtype and shape of every output against torch (the function on
meta tensors of the call's shapes and dtypes, acc in a's dtype); out= tensors returned as
themselves; inputs unchanged; values against the function evaluated by torch in float64
(acc = a.double() @ b.double()). Masks must be torch's bit for bit (exact programs hold small
integers only, so acc and every value a comparison reads are exact). Other values within
  2u|ref| + 16 eps32 |ref| + 4 eps32 rms(ref)
  + 2 * (how far the float64 function moves when acc moves by its float32 accumulation error,
    2^-23 ((8 + sqrt(K)/2 + K/128) (|a| @ |b|) + 4 |acc|), in smooth programs; an exact program's
    acc is exact)
  + 2 * (how far it moves when every inexact intermediate moves by 4 float32 roundings of random
    sign: the reference twin marks them, exact values and so every mask stay as they are)
  + (for outputs of reductions) how far they move when each reduction moves by its own bound,
    (16 + 2 sqrt n) eps32 sum|y| plus twice the propagated movement of what it reduces
or within 4x torch float32's own error against float64 (u: the output dtype's unit roundoff).

A case evtc refuses with an evtc.EpilogueError at compile time, or with an evtc.CallError at the
call, is skipped with the message (`-rs` lists them); any other exception fails.

Run on a Hopper GPU (skips itself elsewhere), about a minute:

    python3 -m pytest -q -n 15 -rs tests/test_fuzz_layouts_gpu.py

Kernels compile once per program and process into one shared disk cache ($EVTC_FUZZ_LAYOUTS_CACHE,
default evtc-fuzz-layouts in the temporary directory), so xdist workers load what another built.
EVTC_FUZZ_LAYOUTS_DEVICE=cpu runs the same cases on evtc's torch path (kernels still compile for
sm_90a): a check of the harness and its references, not of the kernels.
EVTC_FUZZ_LAYOUTS_LIMIT=n keeps the first n cases, EVTC_FUZZ_LAYOUTS_CASES=3,17,40 those cases.
`python3 tests/test_fuzz_layouts_gpu.py 17` prints case 17's program and call.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import sys
import tempfile

import pytest
import torch
from fuzz_layouts import CASES_PER_PROGRAM, N_CASES, Case, Program, Reduction, make_case

import evtc

DEVICE = os.environ.get("EVTC_FUZZ_LAYOUTS_DEVICE", "cuda")
ON_GPU = DEVICE != "cpu"
CACHE = os.environ.get("EVTC_FUZZ_LAYOUTS_CACHE", os.path.join(tempfile.gettempdir(), "evtc-fuzz-layouts"))

# The CPU dry run carries no gpu marker: tests/conftest.py skips marked tests without a Hopper GPU.
pytestmark = [pytest.mark.gpu] if ON_GPU else []

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
EPS32 = 2.0 ** -23
UNIT = {F16: 2.0 ** -11, BF16: 2.0 ** -8, F32: 2.0 ** -24}
TINY = {F16: 2.0 ** -24, BF16: 1e-30, F32: 1e-30}
NAN = float("nan")


def _selected() -> list[int]:
    ids = list(range(N_CASES))
    if os.environ.get("EVTC_FUZZ_LAYOUTS_CASES"):
        ids = [int(x) for x in os.environ["EVTC_FUZZ_LAYOUTS_CASES"].split(",") if x.strip()]
    if os.environ.get("EVTC_FUZZ_LAYOUTS_LIMIT"):
        ids = ids[: int(os.environ["EVTC_FUZZ_LAYOUTS_LIMIT"])]
    return ids


# ------------------------------------------------------------------------------ programs, kernels

# Per process: each program's three cases load and compile it once.
_PROGRAMS: dict = {}
_KERNELS: dict = {}


def _write(path, text):
    """Write `text` unless the file already holds it, atomically: xdist workers share the directory."""
    if os.path.exists(path):
        with open(path) as fh:
            if fh.read() == text:
                return
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def load(prog: Program):
    """(fn, ref namespace, path): fn imported from a file (so evtc can name its lines); the reference
    twin exec'd in a namespace whose `_H` hook the caller sets."""
    if prog.pid in _PROGRAMS:
        return _PROGRAMS[prog.pid]
    directory = os.path.join(CACHE, "programs")
    os.makedirs(directory, exist_ok=True)
    digest = hashlib.sha256(prog.src.encode()).hexdigest()[:10]
    name = f"fuzz_layouts_p{prog.pid:03d}_{digest}"
    path = os.path.join(directory, f"{name}.py")
    _write(path, prog.src)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ref_path = os.path.join(directory, f"{name}_ref.py")
    _write(ref_path, prog.ref_src)
    namespace: dict = {}
    exec(compile(prog.ref_src, ref_path, "exec"), namespace)  # noqa: S102 - the program's reference twin
    _PROGRAMS[prog.pid] = (module.f, namespace, path)
    return _PROGRAMS[prog.pid]


def example_inputs(prog: Program):
    """The compile example: the program's operand kinds, dtypes and majors at a fixed small size."""
    L, M, N, K = 2, 64, 128, 64
    lead = (L,) if prog.batched else ()

    def empty(*shape, dtype):
        return torch.empty(shape, device=DEVICE, dtype=dtype)

    if prog.a_mmajor:
        a = empty(*lead, K, M, dtype=prog.ab_dtype).transpose(-1, -2)
    else:
        a = empty(*lead, M, K, dtype=prog.ab_dtype)
    if prog.b_kmajor:
        b = empty(*lead, N, K, dtype=prog.ab_dtype).transpose(-1, -2)
    else:
        b = empty(*lead, K, N, dtype=prog.ab_dtype)
    example = {"a": a, "b": b}
    for o in prog.operands:
        if o.kind == "arg":
            example[o.name] = 0.5
            continue
        shape = o.shape(L, M, N)
        if o.kind == "tile" and o.major == "m":
            example[o.name] = empty(*shape[:-2], shape[-1], shape[-2], dtype=o.dtype).transpose(-1, -2)
        else:
            example[o.name] = empty(*shape, dtype=o.dtype)
    return example


def kernel(prog: Program):
    """The compiled kernel, or the exception that compiling raised (kept per process, so that every
    case of a program sees the same outcome: an evtc.EpilogueError is a refusal, anything else a
    failure)."""
    if prog.pid not in _KERNELS:
        fn, _, _ = load(prog)
        try:
            _KERNELS[prog.pid] = evtc.compile(fn, example_inputs(prog), cache_dir=CACHE, config=prog.config)
        except Exception as exc:  # noqa: BLE001 - returned, and judged by the caller
            _KERNELS[prog.pid] = exc
    return _KERNELS[prog.pid]


# ------------------------------------------------------------------------------ inputs and layouts


class _Rng:
    """float64 CPU draws from a seeded generator (the call's values are a function of its seed)."""

    def __init__(self, seed):
        self.gen = torch.Generator().manual_seed(seed)

    def randint(self, lo, hi, shape):
        return torch.randint(lo, hi + 1, shape, generator=self.gen).double()

    def randn(self, shape):
        return torch.randn(shape, generator=self.gen, dtype=torch.float64)

    def rand(self, shape):
        return torch.rand(shape, generator=self.gen, dtype=torch.float64)

    def choice(self, vals, shape):
        idx = torch.randint(0, len(vals), shape, generator=self.gen)
        return torch.tensor(vals, dtype=torch.float64)[idx]


def values(rng: _Rng, exact: bool, what: str, shape, K=1):
    """float64 CPU values for an operand of kind `what` (a, b, tile, row, col, scalar): small
    integers and halves in exact programs (acc and every product stay exact), else normal data
    scaled so that acc and the operands are of order 1."""
    if exact:
        if what == "a":
            return rng.randint(-2, 2, shape)
        if what == "b":
            return rng.randint(-1, 1, shape)
        if what == "tile":
            return rng.randint(-3, 3, shape)
        if what == "row":
            return rng.randint(-4, 4, shape) * 0.5
        if what == "col":
            return rng.choice([0.5, 1.0, 2.0, -1.0, -0.5, 1.5], shape)
        return rng.choice([0.5, 2.0, -1.0, 1.5, 0.25], shape)
    if what == "a":
        return rng.randn(shape)
    if what == "b":
        return rng.randn(shape) / math.sqrt(max(K, 1))
    if what == "tile":
        return rng.randn(shape)
    if what == "row":
        return rng.randn(shape) * 0.5
    if what == "col":
        return 0.5 + rng.rand(shape)
    return 0.5 + 1.5 * rng.rand(shape)


def _nanbuf(shape, dtype):
    return torch.full(shape, NAN, device=DEVICE, dtype=dtype)


def place(v: torch.Tensor, dtype, lay: str) -> torch.Tensor:
    """A device tensor of `dtype` showing values `v` (float64, CPU) in layout `lay`. Padding that a
    kernel should never read holds NaN. Layouts that expand take v's first row/column/batch."""
    shape = tuple(v.shape)
    if lay == "contig" or (v.dim() == 0 and lay != "view"):
        return v.to(dtype).to(DEVICE)
    if lay == "transposed":
        return v.transpose(-1, -2).contiguous().to(dtype).to(DEVICE).transpose(-1, -2)
    if lay in ("pitch", "odd_pitch"):
        extra = 8 if lay == "pitch" else 3
        buf = _nanbuf((*shape[:-1], shape[-1] + extra), dtype)
        t = buf[..., : shape[-1]]
        t.copy_(v.to(dtype).to(DEVICE))
        return t
    if lay in ("every_other", "strided"):
        buf = _nanbuf((*shape[:-1], 2 * shape[-1]), dtype)
        t = buf[..., ::2]
        t.copy_(v.to(dtype).to(DEVICE))
        return t
    if lay == "offset":
        n = v.numel()
        buf = _nanbuf((n + 3,), dtype)
        t = buf[3:].view(shape)
        t.copy_(v.to(dtype).to(DEVICE))
        return t
    if lay == "expand_m":  # constant along dim -2
        return v[..., :1, :].contiguous().to(dtype).to(DEVICE).expand(shape)
    if lay == "expand_n":  # constant along dim -1
        return v[..., :1].contiguous().to(dtype).to(DEVICE).expand(shape)
    if lay == "expanded":  # a vector from one element
        return v.reshape(-1)[:1].reshape((1,) * len(shape)).to(dtype).to(DEVICE).expand(shape)
    if lay == "from_row":  # (..., M, 1) as the transpose of (..., 1, M)
        return v.transpose(-1, -2).contiguous().to(dtype).to(DEVICE).transpose(-1, -2)
    if lay == "col_strided":  # (..., M, 1) as one column of (..., M, 3)
        buf = _nanbuf((*shape[:-1], 3), dtype)
        t = buf[..., 1:2]
        t.copy_(v.to(dtype).to(DEVICE))
        return t
    if lay == "permuted":  # (L, M, N) stored as (M, L, N)
        return v.transpose(0, 1).contiguous().to(dtype).to(DEVICE).transpose(0, 1)
    if lay == "batch_expand":
        return v[:1].contiguous().to(dtype).to(DEVICE).expand(shape)
    if lay == "view":  # a scalar inside a larger buffer, at an odd offset
        buf = _nanbuf((7,), dtype)
        buf[5] = v.reshape(()).to(dtype).to(DEVICE)
        return buf[5:6].reshape(shape) if len(shape) else buf[5]
    raise KeyError(lay)


def place_matrix(v, dtype, lay, compiled_major_t: bool):
    """a or b: `compiled_major_t` says the compiled layout is the transpose (m-major a, k-major b);
    `lay` is same/other major, pitched, odd-pitched, offset, or the batch layouts."""
    t_major = compiled_major_t
    if lay == "other":
        t_major, lay = not compiled_major_t, "contig"
    elif lay in ("same", "2d"):
        lay = "contig"
    if lay in ("permuted", "batch_expand", "expand_m"):
        return place(v, dtype, lay)
    if lay == "mmajor":
        return place(v, dtype, "transposed")
    if t_major:
        return place(v.transpose(-1, -2), dtype, lay).transpose(-1, -2)
    return place(v, dtype, lay)


def build_call(case: Case):
    """The call's a, b and operands (device tensors and floats)."""
    prog = case.prog
    rng = _Rng(case.seed)
    L, M, N, K = case.L, case.M, case.N, case.K
    lead = (L,) if L else ()
    a_shape = (M, K) if case.a_lay == "2d" else (*lead, M, K)
    b_shape = (K, N) if case.b_lay == "2d" else (*lead, K, N)
    a = place_matrix(values(rng, prog.exact, "a", a_shape), prog.ab_dtype, case.a_lay, prog.a_mmajor)
    b = place_matrix(values(rng, prog.exact, "b", b_shape, K), prog.ab_dtype, case.b_lay, prog.b_kmajor)
    ops = {}
    for o in prog.operands:
        if o.kind == "arg":
            ops[o.name] = case.args[o.name]
            continue
        swap = case.swaps.get(o.name)
        dtype = swap if isinstance(swap, torch.dtype) else o.dtype
        shape = o.shape(L or 1, M, N)
        if swap in ("s0", "s1", "s11"):
            shape = {"s0": (), "s1": (1,), "s11": (1, 1)}[swap]
        elif swap == "row2":
            shape = (1, shape[-1])
        elif swap == "row":
            shape = (shape[-1],)
        elif swap == "nobatch":
            shape = shape[1:]
        kind = {"tile": "tile", "row": "row", "row2": "row", "wrow": "row", "col": "col"}.get(o.kind)
        v = values(rng, prog.exact, kind or "scalar", shape)
        lay = case.op_lay.get(o.name, "contig")
        if o.kind == "col" and lay == "strided":
            lay = "col_strided"
        if lay in ("permuted", "batch_expand") and len(shape) < 3:  # a swap dropped the batch dim
            lay = "contig"
        ops[o.name] = place(v, dtype, lay)
    return a, b, ops


# ------------------------------------------------------------------------------ references


def flat(x):
    """(keys, values) of a program's result: a dict's keys, a tuple's or list's positions, or
    [None] for one tensor."""
    if isinstance(x, dict):
        return list(x.keys()), list(x.values())
    if isinstance(x, tuple | list):
        return list(range(len(x))), list(x)
    return [None], [x]


class Hook:
    """The reference twin's `_H`: records each reduced value, and shifts reductions by given
    tensors (to propagate a reduction's tolerance through the post-math that follows it)."""

    def __init__(self, shift=None, rounding=None):
        self.aux = {}
        self.shift = shift or {}
        self.rounding = rounding  # None, or a torch.Generator: perturb inexact values

    def p(self, t):
        """An inexact intermediate: as it is, or moved by 4 float32 roundings of random sign."""
        if self.rounding is None or not isinstance(t, torch.Tensor) or not t.is_floating_point():
            return t
        s = torch.randint(0, 2, t.shape, generator=self.rounding, device="cpu").to(t.device, t.dtype) * 2 - 1
        return t * (1 + 4 * EPS32 * s)

    def red(self, key, y, r):
        self.aux[key] = y
        if key in self.shift:
            r = r + self.shift[key].to(r.dtype)
        return r


def _as_dtype(v, dtype):
    return v.to(dtype) if isinstance(v, torch.Tensor) else v


def run_ref(namespace, acc, ops, dtype, shift=None, rounding=None):
    """The reference twin on `acc` and the operands in `dtype`: its outputs and reduced values."""
    hook = Hook(shift, rounding)
    namespace["_H"] = hook
    out = namespace["f"](acc, **{k: _as_dtype(v, dtype) for k, v in ops.items()})
    return flat(out)[1], hook.aux


def native(fn, a, b, ops):
    """Output structure, dtypes and shapes as torch gives them (acc = a @ b in a's dtype)."""
    am = torch.empty(a.shape, dtype=a.dtype, device="meta")
    bm = torch.empty(b.shape, dtype=b.dtype, device="meta")
    om = {k: (torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, torch.Tensor) else v)
          for k, v in ops.items()}
    return fn(torch.matmul(am, bm), **om)


def _reduce(t, red: Reduction, how):
    if red.dims is None:
        return getattr(t, how)()
    return getattr(t, how)(dim=red.dims, keepdim=red.keepdim)


def references(case: Case, namespace, a, b, ops):
    """float64 outputs, the allowance per output (accumulation and reduction propagation), and
    torch's float32 outputs."""
    prog = case.prog
    a64, b64 = a.double(), b.double()
    acc = torch.matmul(a64, b64)
    outs, aux = run_ref(namespace, acc, ops, torch.float64)
    allow = [torch.zeros(o.shape, dtype=torch.float64, device=o.device) if o.dtype != torch.bool else None
             for o in outs]
    pert_y = {k: torch.zeros_like(y, dtype=torch.float64) for k, y in aux.items()}
    # How far the function moves (1) when acc moves by its float32 accumulation error (smooth
    # programs; an exact program's acc is exact) and (2) when each inexact intermediate moves by a
    # few float32 roundings (exact values, and so every mask, stay as they are).
    sign_gen = torch.Generator().manual_seed(case.seed + 1)
    runs = [(acc, torch.Generator().manual_seed(case.seed + 2)),
            (acc, torch.Generator().manual_seed(case.seed + 3))]
    if not prog.exact:
        K = case.K
        delta = EPS32 * ((8 + math.sqrt(K) / 2 + K / 128) * torch.matmul(a64.abs(), b64.abs())
                         + 4 * acc.abs())
        signs = (torch.randint(0, 2, acc.shape, generator=sign_gen).double() * 2 - 1).to(acc.device)
        runs += [(acc + delta, None), (acc - delta, None), (acc + delta * signs, None)]
    for acc_p, rounding in runs:
        po, paux = run_ref(namespace, acc_p, ops, torch.float64, rounding=rounding)
        for i, (x, y) in enumerate(zip(outs, po, strict=True)):
            if allow[i] is not None:
                allow[i] = torch.maximum(allow[i], 2 * (y.double() - x.double()).abs().nan_to_num(0.0))
        for k in pert_y:
            pert_y[k] = torch.maximum(pert_y[k], (paux[k].double() - aux[k].double()).abs().nan_to_num(0.0))
    if prog.reductions:
        # each reduction's bound: float32 summation plus the accumulation error of what it reduces
        tol_r = {}
        for red in prog.reductions:
            y = aux[red.name].double()
            n = y.numel() // max(1, _reduce(y, red, "sum").numel())
            if red.op in ("sum", "mean"):
                t = (2 * _reduce(pert_y[red.name], red, "sum")
                     + (16 + 2 * math.sqrt(n)) * EPS32 * _reduce(y.abs(), red, "sum"))
                if red.op == "mean":
                    t = t / max(n, 1)
            else:
                t = 2 * _reduce(pert_y[red.name], red, "amax") + 16 * EPS32 * _reduce(y.abs(), red, "amax")
            tol_r[red.name] = t.nan_to_num(0.0)
        # every reduction shifted up, down, and alternately both ways, through the post-math
        names = [red.name for red in prog.reductions]
        patterns = [[1] * len(names), [-1] * len(names), [(-1) ** i for i in range(len(names))],
                    [-((-1) ** i) for i in range(len(names))]]
        for pat in patterns:
            shift = {k: s * tol_r[k] for k, s in zip(names, pat, strict=True)}
            so, _ = run_ref(namespace, acc, ops, torch.float64, shift)
            for i, (x, y) in enumerate(zip(outs, so, strict=True)):
                if allow[i] is not None:
                    allow[i] = torch.maximum(allow[i], (y.double() - x.double()).abs().nan_to_num(0.0))
    acc32 = torch.matmul(a.float(), b.float())
    outs32, _ = run_ref(namespace, acc32, ops, torch.float32)
    return outs, allow, outs32


def check_values(got, ref, allow, ref32, what):
    if got.dtype == torch.bool:
        want = ref.to(torch.bool).to(got.device)
        bad = got != want
        assert not bool(bad.any()), (
            f"{what}: mask differs in {int(bad.sum())}/{bad.numel()} elements, first at "
            f"{tuple(bad.nonzero()[0].tolist())}")
        return
    if got.numel() == 0:
        return
    dt = got.dtype
    g = got.double()
    r = ref.double().to(g.device)
    rr = r.to(dt).double()  # the float64 result rounded to the output dtype
    t = ref32.to(dt).double().to(g.device) if ref32.dtype != torch.bool else ref32.double().to(g.device)
    fin = torch.isfinite(r)
    rms = r[fin].square().mean().sqrt().item() if bool(fin.any()) else 0.0
    u = UNIT[dt]
    tol = 2 * u * r.abs() + 16 * EPS32 * r.abs() + 4 * EPS32 * rms + allow.to(g.device) + TINY[dt]
    err = (g - r).abs()
    ok = (err <= tol) | (g == rr) | (torch.isnan(g) & torch.isnan(r))
    # or no worse than a few times torch float32's own error against float64
    ok |= torch.isfinite(g) & torch.isfinite(t) & (err <= 4 * (t - r).abs() + 2 * u * r.abs() + TINY[dt])
    if not bool(ok.all()):
        bad = ~ok
        idx = [tuple(i) for i in bad.nonzero()[:4].tolist()]
        raise AssertionError(
            f"{what} ({dt}, {tuple(got.shape)}): {int(bad.sum())}/{bad.numel()} elements off; at {idx}: got "
            f"{[g[i].item() for i in idx]}, float64 {[r[i].item() for i in idx]}, tol "
            f"{[tol[i].item() for i in idx]}, torch float32 {[t[i].item() for i in idx]}; rms(ref) {rms:.3g}")


# ------------------------------------------------------------------------------ out= buffers


def out_buffer(shape, dtype, lay, want):
    """A buffer of `shape`/`dtype` in layout `lay`: NaN-filled, or for a mask the negation of the
    expected one, so that an element the call does not write shows."""
    shape = tuple(shape)
    if len(shape) < 2 and lay in ("transposed", "every_other", "odd_pitch"):
        lay = "strided"
    if len(shape) == 0:
        lay = "contig"
    if lay == "contig":
        t = torch.empty(shape, dtype=dtype, device=DEVICE)
    elif lay == "transposed":
        t = torch.empty((*shape[:-2], shape[-1], shape[-2]), dtype=dtype, device=DEVICE).transpose(-1, -2)
    elif lay == "odd_pitch":
        t = torch.empty((*shape[:-1], shape[-1] + 3), dtype=dtype, device=DEVICE)[..., 1: 1 + shape[-1]]
    elif lay in ("every_other", "strided"):
        t = torch.empty((*shape[:-1], 2 * shape[-1]), dtype=dtype, device=DEVICE)[..., 1::2]
    elif lay == "offset":
        n = math.prod(shape)
        t = torch.empty((n + 1,), dtype=dtype, device=DEVICE)[1:].view(shape)
    else:
        raise KeyError(lay)
    if dtype == torch.bool:
        t.copy_(~want.to(torch.bool).to(DEVICE))
    else:
        t.fill_(NAN)
    return t


# ------------------------------------------------------------------------------ the test


def run_case(cid: int):
    case = make_case(cid)
    prog = case.prog
    fn, namespace, path = load(prog)
    what = f"case {cid} ({path}; {case.describe()})"
    kern = kernel(prog)
    if isinstance(kern, evtc.EpilogueError):
        pytest.skip(f"refused at compile time: {type(kern).__name__}: {str(kern)[:300]}")
    if isinstance(kern, Exception):
        raise kern
    a, b, ops = build_call(case)
    nat = native(fn, a, b, ops)
    nkeys, nvals = flat(nat)
    refs, allows, refs32 = references(case, namespace, a, b, ops)
    assert len(refs) == len(nvals)
    out = None
    aliased = None
    if case.use_out:
        bufs = [out_buffer(n.shape, n.dtype, lay, r)
                for n, lay, r in zip(nvals, case.out_lays, refs, strict=True)]
        # an operand as the out= of the first output of its shape and dtype (not expanded): written in place
        if case.out_alias:
            for i, n in enumerate(nvals):
                cand = [v for v in ops.values() if isinstance(v, torch.Tensor) and v.dtype == n.dtype
                        and tuple(v.shape) == tuple(n.shape) and 0 not in v.stride()]
                if cand:
                    bufs[i] = aliased = cand[0]
                    what += f" [out {nkeys[i]} is an operand]"
                    break
        if isinstance(nat, dict):
            out = dict(zip(nkeys, bufs, strict=True))
        elif isinstance(nat, tuple | list):
            out = type(nat)(bufs)
        else:
            out = bufs[0]
    # the aliased operand is an out= buffer: written by the call
    before = [(x, x.clone()) for x in [a, b, *ops.values()]
              if isinstance(x, torch.Tensor) and x is not aliased]
    try:
        if case.positional:
            got = kern(a, b, *[ops[o.name] for o in prog.operands], out=out)
        else:
            got = kern(a, b, **ops, out=out)
    except evtc.CallError as e:
        pytest.skip(f"refused call: {str(e)[:300]}")
    if ON_GPU:
        torch.cuda.synchronize()
    what += f" path={kern.last_path}"
    for x, x0 in before:
        assert torch.equal(x.isnan(), x0.isnan()) and torch.equal(x.nan_to_num(0.0), x0.nan_to_num(0.0)), (
            f"{what}: an input was modified")
    gkeys, gvals = flat(got)
    assert type(got) is type(nat), f"{what}: returned {type(got).__name__}, torch {type(nat).__name__}"
    assert gkeys == nkeys, f"{what}: output keys {gkeys}, torch {nkeys}"
    if out is not None:
        _, ovals = flat(out)
        for i, (g, o) in enumerate(zip(gvals, ovals, strict=True)):
            assert g is o, f"{what}: output {gkeys[i]} is not its out= tensor"
    for key, g, n, r, al, r32 in zip(gkeys, gvals, nvals, refs, allows, refs32, strict=True):
        w = f"{what}: output {key}"
        assert isinstance(g, torch.Tensor), f"{w}: not a tensor ({type(g).__name__})"
        assert g.dtype == n.dtype, f"{w}: dtype {g.dtype}, torch {n.dtype}"
        assert tuple(g.shape) == tuple(n.shape), f"{w}: shape {tuple(g.shape)}, torch {tuple(n.shape)}"
        assert g.device.type == a.device.type, f"{w}: on {g.device}"
        assert tuple(r.shape) == tuple(n.shape), f"{w}: reference shape {tuple(r.shape)} (harness)"
        check_values(g, r, al, r32, w)


@pytest.mark.parametrize("cid", _selected(), ids=lambda i: f"c{i:03d}-p{i // CASES_PER_PROGRAM:02d}")
def test_random_program_in_random_layouts(cid):
    run_case(cid)


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        case = make_case(int(arg))
        print(case.prog.describe())
        print(case.describe())
        print(case.prog.src)
