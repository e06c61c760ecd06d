"""Fast on every shape users run: evtc against cuBLAS, eager PyTorch and torch.compile on the linear
layers of public models (Llama-3 8B and 70B, Qwen2.5-7B, Mixtral and DeepSeek-V3 experts, LM heads)
plus the three reference GEMMs, over M from 1 to 16384, in bfloat16 and float16.

Each row is one layer, one M and one dtype. Two comparisons are timed in one ``time_paired`` call
(CUDA events, warm-up, medians, the order shuffled per sample):

* identity: ``torch.matmul(x, w.t())`` (cuBLAS) against evtc's ``lambda acc: acc`` kernel;
* fused: the layer's usual epilogue, evtc's fused kernel against the eager way (``F.linear`` with a
  bias; ``torch.addmm(C, x, w.t())`` for a residual add; ``F.linear`` then ``F.silu(g) * u`` for
  SwiGLU) and against torch.compile of that eager function.

ratio = baseline time / evtc time (> 1: evtc faster). Every evtc result is checked against its
baseline (max abs error relative to the baseline's max abs value) before timing; a failure is
printed loudly, listed at the end and left out of the geomeans. ``w`` is an ``nn.Linear`` weight
(N, K) read as ``w.t()`` (K-major); SwiGLU's weight is ``[W_gate; W_up]``, (2N, K).

Usage:

    python3 bench/shapes.py --dry-run                       # list the rows (no GPU needed)
    python3 bench/shapes.py --quick                         # a few shapes, M = 64 and 4096, bf16
    python3 bench/shapes.py --json out.json --plot out.svg  # everything (too long for one command)
    python3 bench/shapes.py --families llama3-8b,lm-head --ms 1,64,4096 --dtypes bf16
    python3 bench/shapes.py --layers gate_up --config '{"tile_n": 256, "schedule": "cooperative"}'
    python3 bench/shapes.py --check-only                    # correctness of every row, no timing
    python3 bench/shapes.py --merge a.json b.json --json all.json --plot all.svg   # no GPU needed
    python3 bench/shapes.py --plot-from all.json --plot all.svg                    # no GPU needed

A whole run (310 rows, 8 evtc kernels, 6 torch.compile functions) is too long for one 10-minute
device command: run it in halves and merge them (--time-budget stops starting rows in time, and
the JSON, rewritten after every row, lists what was skipped):

    bash .devkit/gpu.sh python3 bench/shapes.py --dtypes bf16 --time-budget 450 --json bf16.json
    bash .devkit/gpu.sh python3 bench/shapes.py --dtypes fp16 --time-budget 450 --json fp16.json
    python3 bench/shapes.py --merge bf16.json fp16.json --json all.json --plot all.svg

How the timing works, and why:

* Each timed function is a CUDA graph of R calls (``--no-graphs``: R back-to-back launches), R
  chosen per row so that one sample is at least ``--sample-ms`` (1 ms) of GPU time. A layer at
  M <= 128 runs for about 10 us, less than the host needs to launch it, so launches without a graph
  time the host, not the GPU.
* Weights smaller than ``--l2-rotate-mb`` (256 MB) are cycled through copies, so that every call
  reads its weight from HBM as a model's next layer would, not from the 50 MB L2 (an 8B model's
  32 MB o_proj weight would otherwise stay in L2 from one call to the next).
* Before the rows, the tile, cluster and split-K variants the rows will launch are built in
  ``--prebuild`` worker processes at once (default: half the CPUs), not one by one on each row's
  first call: on a fresh machine that is about 80 variants in 25-40 s instead of minutes.
* One evtc kernel per (epilogue, dtype): evtc kernels serve every size. torch.compile compiles
  each eager function once per dtype with ``dynamic=True`` (a static compile per shape would be
  hundreds of compiles); a first call that raises or runs past ``--torch-compile-timeout`` makes
  that column n/a.
* The device-to-device copy bandwidth (``dst.copy_(src)``, 1 GiB, read + write bytes) is measured
  once per run; rows with M <= 128 report the weight-streaming bandwidth (weight bytes / evtc time)
  and its fraction of the copy bandwidth (the bar: at least 80%).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import os
import signal
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# torch and evtc are imported where a GPU run needs them (load_torch), so that --dry-run,
# --plot-from and --merge run in a second on a machine without them.
torch = None
F = None

DEFAULT_MS = (1, 16, 64, 128, 512, 2048, 4096, 16384)
# An expert sees the tokens routed to it: a few per expert in decoding (DeepSeek-V3 routes each
# token to 8 of 256 experts), thousands in a large prefill batch, never 16384.
MOE_MS = (1, 8, 16, 32, 64, 128, 256, 512, 2048, 4096)
QUICK_MS = (64, 4096)
DTYPES = ("bf16", "fp16")
DTYPE_ALIASES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "f16": "fp16", "float16": "fp16",
                 "half": "fp16"}
# Max abs error over max abs value of the baseline. Two 16-bit roundings of the output (and, for
# eager SwiGLU, of the GEMM and of silu) give at most a few half-ulps of the largest value: 2^-8
# each in bfloat16, 2^-11 in float16. A wrong kernel is off by order 1.
TOLERANCE = {"bf16": 3e-2, "fp16": 5e-3}
STREAMING_MAX_M = 128      # rows up to this M report weight-streaming bandwidth
STREAMING_BAR = 0.8        # ... and should reach this fraction of the copy bandwidth


# ---- the suite ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Layer:
    """One linear layer: x (M, K) times an nn.Linear weight (N, K), then its epilogue. For SwiGLU,
    ``n`` is the width of the output and the weight is [W_gate; W_up] of shape (2n, k)."""

    family: str
    layer: str
    n: int
    k: int
    epilogue: str              # a key of EPILOGUES
    m: int | None = None       # fixed M (the reference GEMMs); None: every M of the run
    moe: bool = False          # an expert: defaults to MOE_MS

    @property
    def name(self) -> str:
        return f"{self.family}/{self.layer}"

    @property
    def gemm_n(self) -> int:
        """The GEMM's N: the weight's rows."""
        return 2 * self.n if self.epilogue == "swiglu" else self.n


def _model(family: str, hidden: int, qkv: int, inter: int, qkv_epilogue: str = "identity") -> list[Layer]:
    """The four linear layers of a Llama-style decoder block."""
    return [Layer(family, "qkv", qkv, hidden, qkv_epilogue),
            Layer(family, "o_proj", hidden, hidden, "residual"),
            Layer(family, "gate_up", inter, hidden, "swiglu"),
            Layer(family, "down", hidden, inter, "residual")]


def _experts(family: str, hidden: int, inter: int) -> list[Layer]:
    return [Layer(family, "expert_gate_up", inter, hidden, "swiglu", moe=True),
            Layer(family, "expert_down", hidden, inter, "residual", moe=True)]


FAMILIES: dict[str, list[Layer]] = {
    # Llama-3: 8 KV heads of 128 (qkv = hidden + 2 * 1024 or 2 * 1024), no bias.
    "llama3-8b": _model("llama3-8b", 4096, 6144, 14336),
    "llama3-70b": _model("llama3-70b", 8192, 10240, 28672),
    # Qwen2.5-7B: 28 query heads, 4 KV heads of 128 (3584 + 2 * 512 = 4608), with a qkv bias.
    "qwen2.5-7b": _model("qwen2.5-7b", 3584, 4608, 18944, qkv_epilogue="bias"),
    "mixtral-8x7b-expert": _experts("mixtral-8x7b-expert", 4096, 14336),
    "deepseek-v3-expert": _experts("deepseek-v3-expert", 7168, 2048),
    "lm-head": [Layer("lm-head", "llama3", 128256, 4096, "identity"),
                Layer("lm-head", "qwen2.5-7b", 152064, 3584, "identity")],
    # The three reference shapes of docs/performance.md (M x N x K).
    "reference": [Layer("reference", "8192x8192x8192", 8192, 8192, "identity", m=8192),
                  Layer("reference", "4096x4096x4096", 4096, 4096, "identity", m=4096),
                  Layer("reference", "8192x8192x1024", 8192, 1024, "identity", m=8192)],
}

# --quick: one layer of each epilogue and size class.
QUICK_LAYERS = ("llama3-8b/o_proj", "llama3-8b/gate_up", "qwen2.5-7b/qkv", "deepseek-v3-expert/expert_down",
                "lm-head/llama3", "reference/4096x4096x4096")


@dataclasses.dataclass(frozen=True)
class Case:
    """One row: a layer at one M in one dtype."""

    layer: Layer
    m: int
    dtype: str

    @property
    def weight_bytes(self) -> int:
        return self.layer.gemm_n * self.layer.k * 2


def build_suite(families: Sequence[str], ms: Sequence[int] | None, moe_ms: Sequence[int] | None,
                dtypes: Sequence[str], layers: Sequence[str] = ()) -> list[Case]:
    """Every (layer, M, dtype) to run, in the order of ``families``. ``ms=None``: DEFAULT_MS (MOE_MS for
    experts); ``layers``: keep only layers whose ``family/layer`` name ends with one of them."""
    cases = []
    for family in families:
        for layer in FAMILIES[family]:
            if layers and not any(layer.name == s or layer.name.endswith("/" + s) for s in layers):
                continue
            if layer.m is not None:
                layer_ms: Iterable[int] = (layer.m,)
            elif layer.moe:
                layer_ms = moe_ms or ms or MOE_MS
            else:
                layer_ms = ms or DEFAULT_MS
            cases += [Case(layer, m, dtype) for dtype in dtypes for m in layer_ms]
    return cases


# ---- epilogues: evtc's, and the eager baselines ----------------------------------------------------

def evtc_identity(acc):
    return acc


def evtc_bias(acc, bias):
    return acc + bias


def evtc_residual(acc, C):
    return acc + C


def evtc_swiglu(acc):
    gate, up = acc.chunk(2, dim=-1)
    return F.silu(gate) * up


def eager_bias(x, w, bias):
    return F.linear(x, w, bias)               # cuBLASLt's bias epilogue


def eager_residual(x, w, C):
    return torch.addmm(C, x, w.t())           # cuBLASLt's beta * C


def eager_swiglu(x, w):
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    return F.silu(gate) * up                  # separate elementwise kernels after the GEMM


@dataclasses.dataclass(frozen=True)
class Epilogue:
    evtc_fn: Callable
    eager_fn: Callable | None   # None: the identity, whose baseline is cuBLAS alone
    operands: tuple[str, ...]   # "bias" (N,), "C" (M, N)
    group: str                  # how torch runs it: in cuBLASLt's epilogue, or as separate kernels


EPILOGUES = {
    "identity": Epilogue(evtc_identity, None, (), "identity"),
    "bias": Epilogue(evtc_bias, eager_bias, ("bias",), "cuBLASLt-fusable"),
    "residual": Epilogue(evtc_residual, eager_residual, ("C",), "cuBLASLt-fusable"),
    "swiglu": Epilogue(evtc_swiglu, eager_swiglu, (), "separate-kernel"),
}

# The timed functions of a row, in table order.
IDENTITY_FNS = ("cublas", "evtc_id")
FUSED_FNS = ("eager", "compile", "evtc_fused")


# ---- estimates for --dry-run ----------------------------------------------------------------------

def estimate_call_s(case: Case) -> float:
    """A rough H100 time of one GEMM call: the longer of its flops at 700 TFLOP/s and its bytes at
    3 TB/s, plus a few microseconds. Only for splitting the suite into commands."""
    m, n, k = case.m, case.layer.gemm_n, case.layer.k
    return max(2.0 * m * n * k / 700e12, 2.0 * (m * k + n * k + m * n) / 3.0e12) + 4e-6


def estimate_row_s(case: Case, samples: int, sample_ms: float, with_compile: bool) -> float:
    """Wall time of one row: every function for warm-up, probe and samples, each sample at least
    ``sample_ms``, plus about 0.6 s of set-up (inputs, checks, graph capture)."""
    fns = 2 if EPILOGUES[case.layer.epilogue].eager_fn is None else (5 if with_compile else 4)
    per_sample = max(estimate_call_s(case), sample_ms * 1e-3)
    return 0.6 + fns * (samples + 6) * per_sample


# ---- GPU side: inputs, kernels, baselines --------------------------------------------------------

def load_torch() -> None:
    global torch, F
    import torch as _torch
    import torch.nn.functional as _F

    torch, F = _torch, _F


def torch_dtype(name: str):
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]


class Kernels:
    """evtc kernels, compiled once per (epilogue, dtype) from meta examples: sizes are runtime
    arguments, so one kernel serves every layer and M. A failed compile is remembered and raised
    again for every row that needs it (each such row is reported as a failure)."""

    def __init__(self, config: dict | None, compile_fn: Callable | None = None):
        self.config = config
        self._compile = compile_fn
        self._kernels: dict[tuple[str, str], object] = {}
        self.seconds: dict[str, float] = {}     # compile (or disk-cache load) time per kernel
        self.configs: dict[str, str] = {}       # the GEMM configuration each kernel got

    def get(self, epilogue: str, dtype: str):
        key = (epilogue, dtype)
        if key not in self._kernels:
            start = time.perf_counter()
            try:
                self._kernels[key] = self._build(epilogue, dtype)
            except Exception as exc:  # reported per row
                self._kernels[key] = exc
            self.seconds[f"{epilogue}/{dtype}"] = round(time.perf_counter() - start, 2)
            with contextlib.suppress(Exception):   # informational; absent on a fake kernel
                self.configs[f"{epilogue}/{dtype}"] = self._kernels[key].config.short_name()
        kernel = self._kernels[key]
        if isinstance(kernel, Exception):
            raise kernel
        return kernel

    def _build(self, epilogue: str, dtype: str):
        if self._compile is None:
            import evtc

            self._compile = evtc.compile
        dt = torch_dtype(dtype)

        def meta(*shape):
            return torch.empty(*shape, dtype=dt, device="meta")

        n = 128
        epi = EPILOGUES[epilogue]
        gemm_n = 2 * n if epilogue == "swiglu" else n
        example = {"a": meta(128, 64), "b": meta(gemm_n, 64).t()}   # b: an nn.Linear weight, K-major
        if "bias" in epi.operands:
            example["bias"] = meta(n)
        if "C" in epi.operands:
            example["C"] = meta(128, n)
        return self._compile(epi.evtc_fn, example, config=self.config)


class CompileTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise CompileTimeout in the main thread after ``seconds`` (SIGALRM; no limit elsewhere).
    Yields a dict whose "expired" says whether it fired: dynamo wraps exceptions raised inside a
    compile in its own, so the caller cannot rely on catching CompileTimeout itself."""
    state = {"expired": False}
    if seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield state
        return

    def expire(signum, frame):
        state["expired"] = True
        raise CompileTimeout(f"first call took more than {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield state
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class TorchCompiled:
    """torch.compile of each eager baseline, one per (epilogue, dtype), with dynamic shapes: one
    compile serves every M, N and K (size 1 is specialised, so M = 1 compiles again).

    A row's first call may compile. It runs under a time limit; one that raises or runs out makes
    the row's torch.compile column n/a, and a timeout turns torch.compile off for the rest of the run
    (an interrupted compile may leave dynamo in a state not worth trusting)."""

    def __init__(self, enabled: bool, timeout_s: float, mode: str):
        self.off_reason = None if enabled else "--no-torch-compile"
        self.timeout_s = timeout_s
        self.mode = mode
        self._fns: dict[tuple[str, str], Callable] = {}
        if enabled:
            # More graphs than dynamo's default limit (8) would silently fall back to eager.
            cfg = torch._dynamo.config
            for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                         "accumulated_recompile_limit"):
                if hasattr(cfg, name):
                    setattr(cfg, name, max(getattr(cfg, name), 256))
            if hasattr(cfg, "fail_on_recompile_limit_hit"):
                cfg.fail_on_recompile_limit_hit = True

    def first_call(self, epilogue: str, dtype: str, args: tuple):
        """(function, its first output, seconds) or (None, reason, seconds)."""
        if self.off_reason:
            return None, self.off_reason, 0.0
        key = (epilogue, dtype)
        if key not in self._fns:
            self._fns[key] = torch.compile(EPILOGUES[epilogue].eager_fn, dynamic=True, mode=self.mode)
        fn = self._fns[key]
        start = time.perf_counter()
        limit = {"expired": False}
        try:
            with time_limit(self.timeout_s) as limit:
                out = fn(*args)
                if out.is_cuda:
                    torch.cuda.synchronize()
        except Exception as exc:  # reported in the row
            seconds = time.perf_counter() - start
            if limit["expired"]:
                reason = f"its first call took more than {self.timeout_s:g} s"
                self.off_reason = f"torch.compile off for the rest of the run: {reason} in an earlier row"
                return None, reason, seconds
            return None, f"{type(exc).__name__}: {first_line(exc)}", seconds
        return fn, out, time.perf_counter() - start


def make_inputs(case: Case, gen, device: str, rotate_bytes: int) -> dict:
    """Random normal inputs (never zeros: data-dependent power changes the clock). The weight is
    scaled by K^-1/2 so that the accumulator is about N(0, 1), finite in float16 at every K. Small
    weights get copies to cycle through (see the module docstring)."""
    dt = torch_dtype(case.dtype)
    m, n, k = case.m, case.layer.n, case.layer.k
    x = torch.randn(m, k, generator=gen, device=device, dtype=dt)
    w = torch.randn(case.layer.gemm_n, k, generator=gen, device=device, dtype=dt).mul_(k ** -0.5)
    copies = 1 if rotate_bytes <= 0 else min(16, max(1, math.ceil(rotate_bytes / case.weight_bytes)))
    weights = [w] + [w.clone() for _ in range(copies - 1)]
    operands = {}
    if "bias" in EPILOGUES[case.layer.epilogue].operands:
        operands["bias"] = torch.randn(n, generator=gen, device=device, dtype=dt)
    if "C" in EPILOGUES[case.layer.epilogue].operands:
        operands["C"] = torch.randn(m, n, generator=gen, device=device, dtype=dt)
    return {"x": x, "weights": weights, "operands": operands}


def rel_max_error(got, ref) -> float:
    """max |got - ref| / max |ref|, in float32, a block of rows at a time (an LM head's output at
    M = 16384 is 4 GB in bfloat16). NaN anywhere gives NaN."""
    rows = max(1, (1 << 26) // max(1, ref.shape[-1]))
    err = scale = 0.0
    for start in range(0, ref.shape[0], rows):
        r = ref[start:start + rows].float()
        d = (got[start:start + rows].float() - r).abs().max().item()
        err = d if math.isnan(d) else max(err, d)
        scale = max(scale, r.abs().max().item())
        if math.isnan(err):
            break
    return err / scale if scale > 0 else err


def first_line(exc: BaseException, limit: int = 160) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:limit] if text else ""


def launch_info(kernel, m: int, n: int, k: int) -> str | None:
    """How evtc ran the last call: path, tile, cluster, split count (None where the kernel cannot
    say)."""
    try:
        parts = [kernel.last_path]
        config, splits = kernel.launch_for(m, n, k)
        schedule = "" if config.schedule == "pingpong" else " coop"
        # A one-wave twin (evtc.plan.selector.one_wave_twins): D buffers, and C's stages if cut
        # (below one per subtile: C no longer staged for the whole tile).
        twin = f" d{config.epi_stages}" if config.epi_stages is not None else ""
        if twin and config.load_stages is not None and config.load_stages < config.num_subtiles:
            twin += f" l{config.load_stages}"
        rows = f" a{config.a_rows}" if config.a_rows is not None else ""  # A's loads trimmed
        parts.append(f"{config.tile_m}x{config.tile_n}{schedule} c{config.cluster[0]}x{config.cluster[1]}"
                     f"{rows} s{splits}{twin}")
        return " ".join(str(p) for p in parts)
    except Exception:  # informational only
        return None


# ---- timing ---------------------------------------------------------------------------------------

def capture(call: Callable, weights: list, reps: int):
    """A CUDA graph of ``reps`` calls, cycling through ``weights``. Warmed up on a side stream first,
    as torch.cuda.graph asks (libraries set up workspaces on the first call of a stream)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for w in weights[:2]:
            call(w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            call(weights[i % len(weights)])
    return graph


def launcher(call: Callable, weights: list) -> Callable[[], object]:
    """One call per invocation, the weight cycling (for timing without graphs)."""
    cycle = itertools.cycle(weights)
    return lambda: call(next(cycle))


def time_calls(calls: dict[str, Callable], weights: list, args, timer: Callable) -> tuple[dict, int, bool]:
    """Median microseconds per call of each of ``calls`` (each takes the weight), all in one
    ``timer`` (time_paired) call. Returns (times, calls per sample R, whether graphs were used)."""
    names = list(calls)
    graphs = args.graphs and weights[0].is_cuda
    reps = 1
    if weights[0].is_cuda:
        # The first function (cuBLAS) over 8 calls sets R: a sample of at least sample_ms.
        graphs, per_call = probe(calls[names[0]], weights, timer, graphs)
        reps = max(1, min(args.max_reps, math.ceil(args.sample_ms / max(per_call, 1e-4))))
    if graphs:
        try:
            fns = [capture(calls[name], weights, reps).replay for name in names]
        except Exception as exc:  # one function that cannot be captured: time them all without
            print(f"  (CUDA graph capture failed, {type(exc).__name__}: {first_line(exc)}; timing launches)",
                  flush=True)
            torch.cuda.synchronize()
            graphs = False
    if graphs:
        ms = [t / reps for t in timer(fns, args.warmup, args.samples, 1)]
    else:
        fns = [launcher(calls[name], weights) for name in names]
        ms = timer(fns, args.warmup * reps, args.samples, reps)
    return {name: t * 1e3 for name, t in zip(names, ms, strict=True)}, reps, graphs


def probe(call: Callable, weights: list, timer: Callable, graphs: bool) -> tuple[bool, float]:
    """(whether graphs work, milliseconds per call) from 8 calls of ``call``. Without a graph the
    time of a short call is the host's launch time, longer than the GPU's: R comes out smaller."""
    if graphs:
        try:
            return True, timer([capture(call, weights, 8).replay], 2, 3, 1)[0] / 8
        except Exception:  # time_calls tries every function and reports
            torch.cuda.synchronize()
    return False, timer([_repeat(launcher(call, weights), 8)], 2, 3, 1)[0] / 8


def _repeat(fn: Callable, n: int) -> Callable[[], None]:
    def run():
        for _ in range(n):
            fn()
    return run


def copy_bandwidth(timer: Callable, samples: int) -> float:
    """Device-to-device copy bandwidth in TB/s: (read + write bytes) / time of ``dst.copy_(src)``
    over 1 GiB, timed like the rows."""
    src = torch.randn(1 << 29, device="cuda", dtype=torch.float16)   # 1 GiB
    dst = torch.empty_like(src)
    t = timer([lambda: dst.copy_(src)], 3, samples, 5)[0]
    return 2 * (1 << 30) / (t * 1e-3) / 1e12


# ---- one row --------------------------------------------------------------------------------------

def measure(case: Case, kernels: Kernels, compiled: TorchCompiled, gen, args, timer: Callable,
            device: str = "cuda", copy_tbs: float | None = None) -> dict:
    """Check, then time, one row; the row's dict (see row_template for the fields)."""
    row = row_template(case)
    row["copy_tbs"] = copy_tbs
    layer, m = case.layer, case.m
    epi = EPILOGUES[layer.epilogue]
    tol = TOLERANCE[case.dtype]
    inputs = make_inputs(case, gen, device, args.l2_rotate_mb << 20)
    x, weights, ops = inputs["x"], inputs["weights"], inputs["operands"]
    row["weight_copies"] = len(weights)

    calls: dict[str, Callable] = {"cublas": lambda w: torch.matmul(x, w.t())}
    refs = {"cublas": calls["cublas"](weights[0])}
    checks = [("evtc_id", "identity", "cublas", layer.gemm_n)]
    if epi.eager_fn is not None:
        calls["eager"] = lambda w: epi.eager_fn(x, w, **ops)
        refs["eager"] = calls["eager"](weights[0])
        checks.append(("evtc_fused", layer.epilogue, "eager", layer.n))

    # evtc: each kernel against its baseline, before any timing.
    for name, epilogue, base, out_n in checks:
        try:
            kernel = kernels.get(epilogue, case.dtype)
            kw = ops if epilogue != "identity" else {}   # the identity kernel takes no operands

            def call(w, kernel=kernel, kw=kw):
                return kernel(x, w.t(), **kw)

            got = call(weights[0])
            err = rel_max_error(got, refs[base])
            del got
        except Exception as exc:  # reported loudly in the row
            row["failures"].append(f"{name}: {type(exc).__name__}: {first_line(exc)}")
            continue
        row["err"][name] = err
        row["launch"][name] = launch_info(kernel, m, out_n, layer.k)
        if x.is_cuda and getattr(kernel, "last_path", "kernel") != "kernel":
            row["notes"].append(f"{name}: evtc took the {kernel.last_path!r} path, not the kernel alone")
        if not err <= tol:
            row["failures"].append(f"{name}: WRONG RESULT, error {err:.2e} > {tol:.0e}")
        calls[name] = call

    # torch.compile of the eager function: its first call compiles (under a time limit).
    if epi.eager_fn is not None:
        fn, out, seconds = compiled.first_call(layer.epilogue, case.dtype, (x, weights[0], *ops.values()))
        row["compile_first_call_s"] = round(seconds, 2)
        if seconds > 2:   # it compiled: worth knowing when the wall time is tight
            row["notes"].append(f"torch.compile's first call took {seconds:.1f} s")
        if fn is None:
            row["notes"].append(f"torch.compile n/a: {out}")
        else:
            err = rel_max_error(out, refs["eager"])
            row["err"]["compile"] = err
            if not err <= tol:  # not evtc's failure: note it and leave the column out
                row["notes"].append(f"torch.compile n/a: its result is off by {err:.2e}")
            else:
                calls["compile"] = lambda w, fn=fn: fn(x, w, *ops.values())
            del out
    del refs

    if args.check_only:
        return row
    order = [n for n in (*IDENTITY_FNS, *FUSED_FNS) if n in calls]
    times, reps, graphs = time_calls({n: calls[n] for n in order}, weights, args, timer)
    row.update(t_us=times, reps=reps, graphs=graphs, samples=args.samples)
    fill_ratios(row)
    return row


def row_template(case: Case) -> dict:
    layer = case.layer
    return {"family": layer.family, "layer": layer.layer, "m": case.m, "n": layer.n, "k": layer.k,
            "gemm_n": layer.gemm_n, "dtype": case.dtype, "epilogue": layer.epilogue,
            "group": EPILOGUES[layer.epilogue].group, "weight_bytes": case.weight_bytes,
            "t_us": {}, "err": {}, "launch": {}, "failures": [], "notes": []}


def fill_ratios(row: dict) -> None:
    """Ratios (baseline / evtc) and weight-streaming bandwidths from the row's times; a function whose
    check failed gets no ratio (so it is in no geomean)."""
    t = row["t_us"]
    failed = {f.split(":")[0] for f in row["failures"]}

    def ratio(base: str, ours: str) -> float | None:
        if base in t and ours in t and ours not in failed:
            return t[base] / t[ours]
        return None

    row["ratio_id"] = ratio("cublas", "evtc_id")
    row["ratio_eager"] = ratio("eager", "evtc_fused")
    row["ratio_compile"] = ratio("compile", "evtc_fused")
    if row["m"] <= STREAMING_MAX_M:
        for name in ("cublas", "evtc_id", "evtc_fused"):
            if name in t:
                row[f"weight_tbs_{name}"] = row["weight_bytes"] / (t[name] * 1e-6) / 1e12


# ---- summaries ------------------------------------------------------------------------------------

def geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def describe(row: dict) -> str:
    return f"{row['family']}/{row['layer']} M={row['m']} {row['dtype']}"


#: The issue's floors (no row below): identity 0.90x cuBLAS, a fused epilogue 1.00x the eager way.
IDENTITY_FLOOR = 0.90
FUSED_FLOOR = 1.00


def summarize_ratio(rows: Sequence[dict], key: str, floor: float | None = None) -> dict | None:
    """Geomean and worst of ``row[key]`` overall and by M (rows without that ratio left out), and
    where ``floor`` is given, how many rows fall below it (overall: which)."""
    have = [r for r in rows if r.get(key) is not None]
    if not have:
        return None

    def stats(group: Sequence[dict]) -> dict:
        worst = min(group, key=lambda r: r[key])
        out = {"geomean": geomean([r[key] for r in group]), "worst": worst[key],
               "worst_row": describe(worst), "n": len(group)}
        if floor is not None:
            below = sorted((r for r in group if r[key] < floor), key=lambda r: r[key])
            out.update(floor=floor, below=len(below),
                       below_rows=[f"{describe(r)} {r['epilogue']}: {r[key]:.3f}" for r in below])
        return out

    by_m = defaultdict(list)
    for r in have:
        by_m[r["m"]].append(r)
    by_dtype = defaultdict(list)
    for r in have:
        by_dtype[r["dtype"]].append(r)
    return {"all": stats(have), "by_m": {str(m): stats(g) for m, g in sorted(by_m.items())},
            "by_dtype": {d: stats(g) for d, g in sorted(by_dtype.items())}}


def summarize(rows: Sequence[dict]) -> dict:
    fused = [r for r in rows if r["group"] != "identity"]
    out: dict = {"identity_vs_cublas": summarize_ratio(rows, "ratio_id", IDENTITY_FLOOR)}
    for key, label in (("ratio_eager", "fused_vs_eager"), ("ratio_compile", "fused_vs_torch_compile")):
        out[label] = summarize_ratio(fused, key, FUSED_FLOOR)
        for group in ("cuBLASLt-fusable", "separate-kernel"):
            out[f"{label}/{group}"] = summarize_ratio([r for r in fused if r["group"] == group], key,
                                                      FUSED_FLOOR)
    streaming = []
    for r in rows:
        for name in ("evtc_id", "evtc_fused"):
            tbs = r.get(f"weight_tbs_{name}")
            if tbs is not None and r.get("copy_tbs") and f"{name}:" not in " ".join(r["failures"]):
                streaming.append((tbs / r["copy_tbs"], f"{describe(r)} {name}"))
    if streaming:
        worst = min(streaming)
        out["weight_streaming"] = {
            "max_m": STREAMING_MAX_M, "bar": STREAMING_BAR, "n": len(streaming),
            "geomean_fraction_of_copy": geomean([f for f, _ in streaming]),
            "worst_fraction_of_copy": worst[0], "worst_row": worst[1],
            "meeting_bar": sum(f >= STREAMING_BAR for f, _ in streaming)}
        # cuBLAS on the same rows: what the bar looks like from the other side.
        cublas = [r["weight_tbs_cublas"] / r["copy_tbs"] for r in rows
                  if r.get("weight_tbs_cublas") and r.get("copy_tbs")]
        if cublas:
            out["weight_streaming"]["cublas_geomean_fraction_of_copy"] = geomean(cublas)
    out["failures"] = [f"{describe(r)}: {f}" for r in rows for f in r["failures"]]
    return out


def print_summary(summary: dict) -> None:
    print()
    titles = {"identity_vs_cublas": "identity: cuBLAS / evtc", "fused_vs_eager": "fused: eager / evtc",
              "fused_vs_torch_compile": "fused: torch.compile / evtc"}
    for key, value in summary.items():
        if key in ("failures", "weight_streaming") or value is None:
            continue
        base, _, group = key.partition("/")
        title = titles[base] + (f" [{group}]" if group else " [all epilogues]")
        a = value["all"]
        below = f", {a['below']} below {a['floor']:.2f}" if "floor" in a else ""
        print(f"# {title}: geomean {a['geomean']:.3f}, worst {a['worst']:.3f} ({a['worst_row']}), "
              f"{a['n']} rows{below}")
        cells = [f"M={m}: {s['geomean']:.3f} (worst {s['worst']:.3f})" for m, s in value["by_m"].items()]
        for i in range(0, len(cells), 4):
            print("    " + "; ".join(cells[i:i + 4]))
        if len(value["by_dtype"]) > 1:
            print("    " + "; ".join(f"{d}: {s['geomean']:.3f}" for d, s in value["by_dtype"].items()))
    ws = summary.get("weight_streaming")
    if ws:
        print(f"# weight streaming, M <= {ws['max_m']}: geomean {ws['geomean_fraction_of_copy']:.0%} of the "
              f"copy bandwidth, worst {ws['worst_fraction_of_copy']:.0%} ({ws['worst_row']}); "
              f"{ws['meeting_bar']} of {ws['n']} at >= {ws['bar']:.0%}"
              + (f"; cuBLAS geomean {ws['cublas_geomean_fraction_of_copy']:.0%}"
                 if "cublas_geomean_fraction_of_copy" in ws else ""))
    if summary["failures"]:
        print(f"\n!!! {len(summary['failures'])} FAILURE(S), left out of every geomean:")
        for f in summary["failures"]:
            print(f"!!!   {f}")


# ---- the table ------------------------------------------------------------------------------------

COLUMNS = (("family", 19), ("layer", 16), ("M", 6), ("N", 7), ("K", 6), ("dtype", 5), ("epilogue", 8),
           ("cuBLAS", 9), ("evtc id", 9), ("ratio", 6), ("eager", 9), ("compile", 9), ("evtc fus", 9),
           ("/eager", 6), ("/comp", 6), ("wTB/s", 5), ("%copy", 5), ("err", 7), ("evtc launch", 0))


def header() -> str:
    return " ".join(f"{name:>{w}}" if w else name for name, w in COLUMNS)


def format_row(row: dict) -> str:
    t = row.get("t_us", {})

    def us(name):
        return f"{t[name]:.1f}" if name in t else "-"

    def num(value, fmt):
        return format(value, fmt) if value is not None else "-"

    tbs = row.get("weight_tbs_evtc_fused", row.get("weight_tbs_evtc_id"))
    frac = tbs / row["copy_tbs"] if tbs is not None and row.get("copy_tbs") else None
    err = max(row["err"].get("evtc_id", 0.0), row["err"].get("evtc_fused", 0.0)) if row["err"] else None
    launch = row["launch"].get("evtc_fused") or row["launch"].get("evtc_id") or ""
    cells = (row["family"], row["layer"], row["m"], row["n"], row["k"], row["dtype"], row["epilogue"],
             us("cublas"), us("evtc_id"), num(row.get("ratio_id"), ".3f"), us("eager"), us("compile"),
             us("evtc_fused"), num(row.get("ratio_eager"), ".3f"), num(row.get("ratio_compile"), ".3f"),
             num(tbs, ".2f"), num(frac, ".0%"), num(err, ".1e"), launch)
    line = " ".join(f"{c!s:>{w}}" if w else str(c) for c, (_, w) in zip(cells, COLUMNS, strict=True))
    for failure in row["failures"]:
        line += f"\n    !!! FAILURE: {failure}"
    for note in row["notes"]:
        line += f"\n    note: {note}"
    return line


# ---- the plot (hand-written SVG) ------------------------------------------------------------------

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf")
DASHES = {"bf16": "", "fp16": "6,3"}
PANELS = (("ratio_id", "identity epilogue: cuBLAS time / evtc time"),
          ("ratio_eager", "layer epilogue: eager PyTorch time / evtc fused time"),
          ("ratio_compile", "layer epilogue: torch.compile time / evtc fused time"))


def plot_series(rows: Sequence[dict], key: str, by: str) -> dict[str, list[tuple[int, float]]]:
    """Lines of one panel: per group (family, family/layer or family + dtype), the geomean of the
    group's ratios at each M."""
    points: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r.get(key) is None:
            continue
        label = {"family": r["family"], "layer": f"{r['family']}/{r['layer']}",
                 "family-dtype": f"{r['family']} {r['dtype']}"}[by]
        points[label][r["m"]].append(r[key])
    return {label: sorted((m, geomean(v)) for m, v in ms.items()) for label, ms in points.items()}


def nice_ticks(lo: float, hi: float, count: int = 6) -> list[float]:
    raw = (hi - lo) / max(1, count - 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(s * mag for s in (1, 2, 2.5, 5, 10) if s * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    return [round(first + i * step, 10) for i in range(int((hi - first) / step + 1e-9) + 1)]


def svg_panel(series: dict[str, list[tuple[int, float]]], title: str, top: float, colors: dict[str, str],
              dashes: dict[str, str]) -> list[str]:
    """One chart: x = log2 M, y = ratio, a line per series, the 1.0 line, a legend on the right."""
    left, width, height, legend_x = 70, 600, 260, 700
    ms = sorted({m for pts in series.values() for m, _ in pts})
    ys = [y for pts in series.values() for _, y in pts] + [1.0]
    x_lo, x_hi = math.log2(ms[0]) - 0.5, math.log2(ms[-1]) + 0.5
    pad = 0.05 * (max(ys) - min(ys) or 1.0)
    y_lo, y_hi = min(ys) - pad, max(ys) + pad

    def px(m):
        return left + (math.log2(m) - x_lo) / (x_hi - x_lo) * width

    def py(y):
        return top + 30 + (y_hi - y) / (y_hi - y_lo) * height

    bottom = top + 30 + height
    out = [f'<text x="{left}" y="{top + 18}" font-size="15" font-weight="bold">{esc(title)}</text>',
           f'<rect x="{left}" y="{top + 30}" width="{width}" height="{height}" fill="none" stroke="#888"/>']
    for m in ms:
        out.append(f'<line x1="{px(m):.1f}" y1="{bottom}" x2="{px(m):.1f}" y2="{bottom + 5}" stroke="#444"/>')
        out.append(f'<text x="{px(m):.1f}" y="{bottom + 18}" font-size="11" text-anchor="middle">{m}</text>')
    for y in nice_ticks(y_lo, y_hi):
        out.append(f'<line x1="{left}" y1="{py(y):.1f}" x2="{left + width}" y2="{py(y):.1f}" stroke="#eee"/>')
        out.append(f'<text x="{left - 6}" y="{py(y) + 4:.1f}" font-size="11" text-anchor="end">{y:g}</text>')
    out.append(f'<line x1="{left}" y1="{py(1.0):.1f}" x2="{left + width}" y2="{py(1.0):.1f}" stroke="#000" '
               f'stroke-width="1.5" stroke-dasharray="4,3"/>')
    out.append(f'<text x="{left + width / 2}" y="{bottom + 34}" font-size="12" text-anchor="middle">'
               f'M (log2 scale)</text>')
    mid = top + 30 + height / 2
    out.append(f'<text x="{left - 48}" y="{mid}" font-size="12" text-anchor="middle" '
               f'transform="rotate(-90 {left - 48} {mid})">ratio (&gt; 1: evtc faster)</text>')
    for i, (label, pts) in enumerate(series.items()):
        color, dash = colors[label], dashes.get(label, "")
        style = f'stroke="{color}" stroke-width="2" fill="none"'
        style += f' stroke-dasharray="{dash}"' if dash else ""
        coords = " ".join(f"{px(m):.1f},{py(y):.1f}" for m, y in pts)
        out.append(f'<polyline points="{coords}" {style}/>')
        for m, y in pts:
            out.append(f'<circle cx="{px(m):.1f}" cy="{py(y):.1f}" r="3" fill="{color}">'
                       f'<title>{esc(label)} M={m}: {y:.3f}</title></circle>')
        ly = top + 40 + 18 * i
        out.append(f'<line x1="{legend_x}" y1="{ly}" x2="{legend_x + 24}" y2="{ly}" {style}/>')
        out.append(f'<text x="{legend_x + 30}" y="{ly + 4}" font-size="12">{esc(label)}</text>')
    return out


def esc(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def write_svg(rows: Sequence[dict], path: str, by: str = "family", subtitle: str = "") -> int:
    """The panels that have data, stacked in one SVG file. Returns the number of panels."""
    panels = [(title, plot_series(rows, key, by)) for key, title in PANELS]
    panels = [(title, s) for title, s in panels if s]
    labels = sorted({label for _, s in panels for label in s})
    # Colour by family, so that a family keeps its colour in every panel (and across dtypes).
    families = sorted({label.split("/")[0].split(" ")[0] for label in labels})
    colors = {lb: PALETTE[families.index(lb.split("/")[0].split(" ")[0]) % len(PALETTE)] for lb in labels}
    if by == "layer":   # several layers per family: tell them apart by dash pattern
        dash_cycle = ("", "6,3", "2,2", "8,3,2,3")
        per_family: dict[str, int] = defaultdict(int)
        dashes = {}
        for lb in labels:
            fam = lb.split("/")[0]
            dashes[lb] = dash_cycle[per_family[fam] % len(dash_cycle)]
            per_family[fam] += 1
    else:
        dashes = {lb: DASHES.get(lb.rsplit(" ", 1)[-1], "") for lb in labels}
    legend_rows = max([len(s) for _, s in panels] + [0])
    panel_h = max(340, 60 + 18 * legend_rows)
    height = 40 + panel_h * max(1, len(panels))
    body = [f'<text x="20" y="24" font-size="13" fill="#444">{esc(subtitle)}</text>']
    for i, (title, series) in enumerate(panels):
        body += svg_panel(series, title, 40 + i * panel_h, colors, dashes)
    if not panels:
        body.append('<text x="70" y="80" font-size="14">no ratios to plot</text>')
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="1000" height="{height}" '
           f'viewBox="0 0 1000 {height}" font-family="sans-serif">',
           '<rect width="100%" height="100%" fill="white"/>', *body, "</svg>"]
    Path(path).write_text("\n".join(svg) + "\n")
    return len(panels)


# ---- command line ---------------------------------------------------------------------------------

def int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_argument_group("what to run")
    what.add_argument("--families", default=",".join(FAMILIES),
                      help=f"comma list of families (default: all): {', '.join(FAMILIES)}")
    what.add_argument("--layers", default="",
                      help="keep only these layers: comma list of 'layer' or 'family/layer' names")
    what.add_argument("--ms", type=int_list, default=None,
                      help=f"comma list of M (default {','.join(map(str, DEFAULT_MS))}; experts "
                           f"{','.join(map(str, MOE_MS))}); the reference GEMMs keep their own M")
    what.add_argument("--moe-ms", type=int_list, default=None,
                      help="M for the expert layers (default: --ms if given, else the experts' list above)")
    what.add_argument("--dtypes", default=",".join(DTYPES), help="comma list: bf16, fp16")
    what.add_argument("--quick", action="store_true",
                      help=f"a few layers ({', '.join(QUICK_LAYERS)}) at M = 64 and 4096, bf16")
    what.add_argument("--config", type=json.loads, default=None,
                      help="JSON dict passed to evtc.compile(..., config=...), e.g. '{\"tile_n\": 256}'")
    how = p.add_argument_group("how to time")
    how.add_argument("--samples", type=int, default=10)
    how.add_argument("--warmup", type=int, default=2, help="warm-up samples per function")
    how.add_argument("--sample-ms", type=float, default=1.0, help="GPU time of one sample, at least")
    how.add_argument("--max-reps", type=int, default=2000, help="most calls in one sample")
    how.add_argument("--no-graphs", dest="graphs", action="store_false",
                     help="time back-to-back launches instead of CUDA graphs of them")
    how.add_argument("--l2-rotate-mb", type=int, default=256,
                     help="cycle weights smaller than this through copies of this total size (0: off)")
    how.add_argument("--no-torch-compile", action="store_true")
    how.add_argument("--torch-compile-mode", default="default", help="torch.compile's mode")
    how.add_argument("--torch-compile-timeout", type=float, default=180.0,
                     help="seconds a row's first torch.compile call (its compile) may take")
    how.add_argument("--prebuild", type=int, default=-1, metavar="WORKERS",
                     help="build the variants the rows launch in this many worker processes before "
                          "timing (default: half the CPUs; 0: build each on its row's first call)")
    how.add_argument("--time-budget", type=float, default=0.0,
                     help="stop starting rows after this many seconds (0: no limit); the rest are listed")
    how.add_argument("--seed", type=int, default=0)
    out = p.add_argument_group("output")
    out.add_argument("--json", help="write rows and summaries here (rewritten after every row)")
    out.add_argument("--plot", help="write an SVG chart of the ratios by M here")
    out.add_argument("--plot-by", default="family", choices=("family", "layer", "family-dtype"),
                     help="one line per family (default), per layer, or per family and dtype")
    mode = p.add_argument_group("modes")
    mode.add_argument("--dry-run", action="store_true", help="list the rows and an estimate of the time")
    mode.add_argument("--check-only", action="store_true", help="check every row's results, time nothing")
    mode.add_argument("--plot-from", metavar="JSON",
                      help="no GPU: redraw --plot (and the summaries) from a JSON")
    mode.add_argument("--merge", nargs="+", metavar="JSON",
                      help="no GPU: merge the rows of several JSONs; print, and write --json / --plot")
    args = p.parse_args(argv)
    if args.quick:
        args.layers = args.layers or ",".join(QUICK_LAYERS)
        args.families = ",".join(dict.fromkeys(name.split("/")[0] for name in QUICK_LAYERS))
        args.ms = args.ms or list(QUICK_MS)
        args.moe_ms = args.moe_ms or list(QUICK_MS)
        args.dtypes = "bf16"
    args.family_list = [f for f in args.families.split(",") if f]
    for f in args.family_list:
        if f not in FAMILIES:
            p.error(f"unknown family {f!r}; choose from {', '.join(FAMILIES)}")
    try:
        args.dtype_list = list(dict.fromkeys(DTYPE_ALIASES[d] for d in args.dtypes.split(",") if d))
    except KeyError as exc:
        p.error(f"unknown dtype {exc}; choose from bf16, fp16")
    args.layer_list = [s for s in args.layers.split(",") if s]
    if args.config is not None and not isinstance(args.config, dict):
        p.error("--config must be a JSON object")
    if args.plot_from and args.merge:
        p.error("--plot-from and --merge: give one")
    return args


def suite_from_args(args: argparse.Namespace) -> list[Case]:
    return build_suite(args.family_list, args.ms, args.moe_ms, args.dtype_list, args.layer_list)


def dry_run(cases: Sequence[Case], args: argparse.Namespace) -> None:
    print(f"# {len(cases)} rows; estimated times assume an H100 and {args.samples} samples of "
          f">= {args.sample_ms} ms per function (compiles not included)")
    print(f"{'family':>19} {'layer':>16} {'M':>6} {'N':>7} {'K':>6} {'dtype':>5} {'epilogue':>8} "
          f"{'weight (N x K)':>16} {'GEMM':>22} {'timed':>40} {'est s':>6}")
    total = 0.0
    by_family: dict[str, float] = defaultdict(float)
    with_compile = not args.no_torch_compile
    for c in cases:
        lay = c.layer
        fns = list(IDENTITY_FNS)
        if EPILOGUES[lay.epilogue].eager_fn is not None:
            fns += [f for f in FUSED_FNS if with_compile or f != "compile"]
        est = estimate_row_s(c, args.samples, args.sample_ms, with_compile)
        total += est
        by_family[lay.family] += est
        print(f"{lay.family:>19} {lay.layer:>16} {c.m:>6} {lay.n:>7} {lay.k:>6} {c.dtype:>5} "
              f"{lay.epilogue:>8} {f'{lay.gemm_n}x{lay.k}':>16} {f'{c.m}x{lay.gemm_n}x{lay.k}':>22} "
              f"{','.join(fns):>40} {est:6.1f}")
    kernels = sorted({(c.layer.epilogue, c.dtype) for c in cases})
    graphs = sorted({(c.layer.epilogue, c.dtype) for c in cases if c.layer.epilogue != "identity"})
    print(f"# estimated time: {total:.0f} s of rows; by family: "
          + ", ".join(f"{f} {s:.0f} s" for f, s in by_family.items()))
    print(f"# plus compiles: {len(kernels)} evtc kernels ({', '.join('/'.join(k) for k in kernels)}; ~5-8 s "
          f"each, more for cluster and split-K variants built on first use, none from a warm disk cache)"
          + (f" and {len(graphs)} torch.compile functions (~10-60 s each, twice with M = 1)" if with_compile
             else ""))


def prebuild_variants(cases: Sequence[Case], kernels: Kernels, workers: int) -> None:
    """Build every variant (tile, cluster shape, split-K build) that the rows' evtc calls will
    launch before the rows run (:func:`build_variants`), so that no row waits for builds one at a
    time. A kernel that failed to compile is left to its rows, which report it."""
    by_kernel: dict[tuple[str, str], list[tuple[int, int, int]]] = defaultdict(list)
    for c in cases:
        by_kernel[("identity", c.dtype)].append((c.m, c.layer.gemm_n, c.layer.k))
        if EPILOGUES[c.layer.epilogue].eager_fn is not None:
            by_kernel[(c.layer.epilogue, c.dtype)].append((c.m, c.layer.n, c.layer.k))
    jobs = []
    for (epilogue, dtype), sizes in by_kernel.items():
        try:
            jobs.append((kernels.get(epilogue, dtype), sizes))
        except Exception:  # noqa: BLE001 - each of its rows reports the failure
            continue
    start = time.perf_counter()
    count, processes = build_variants(jobs, workers)
    print(f"# prebuilt {count} variants in {time.perf_counter() - start:.0f} s ({processes} workers)",
          flush=True)


def build_variants(jobs: Sequence[tuple[object, Sequence[tuple[int, int, int]]]],
                   workers: int) -> tuple[int, int]:
    """Build the variants that each (kernel or launch handle, its (M, N, K) sizes) of ``jobs``
    launches, in background processes (``Kernel.prebuild(..., wait=False)`` on a share of a job's
    sizes), at most ``workers`` at a time. Each variant is built once: one size stands for it.
    Returns (variants covered, processes started)."""
    from evtc.runtime.invoke import built_config

    seen: set = set()
    shares = []
    per_job = max(1, workers // max(1, len(jobs)))
    for kernel, sizes in jobs:
        one_each = {}
        for size in sorted(set(sizes)):
            config = built_config(*kernel.launch_for(*size))
            if config not in seen:
                seen.add(config)
                one_each[config] = size
        sizes = list(one_each.values())
        count = min(len(sizes), per_job)
        shares += [(kernel, sizes[i::count]) for i in range(count)]
    running, started = [], 0
    for kernel, sizes in shares:
        if len(running) >= workers:
            running.pop(0).wait()
        running.append(kernel.prebuild(sizes, wait=False))
        started += 1
    for build in running:
        build.wait()
    return len(seen), started


def write_json(path: str, meta: dict, rows: Sequence[dict], extra: dict | None = None) -> None:
    data = {"meta": meta, "rows": list(rows), "summary": summarize(rows), **(extra or {})}
    tmp = f"{path}.tmp"
    Path(tmp).write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)   # a command cut short still leaves a whole file


def from_json(paths: Sequence[str], args: argparse.Namespace) -> int:
    """--merge / --plot-from: rows of saved runs, printed and summarised again, redrawn."""
    rows, metas, skipped = [], [], []
    for path in paths:
        data = json.loads(Path(path).read_text())
        rows += data["rows"]
        skipped += data.get("skipped", [])
        meta = data.get("meta", {})
        metas += meta.get("runs", [meta])   # a merged file lists the runs it came from
    print(f"# {len(rows)} rows from {', '.join(paths)}")
    for meta in metas:
        if meta:
            print(f"#   {meta.get('device')}; torch {meta.get('torch')}; evtc {meta.get('evtc')}; "
                  f"copy {fmt_tbs(meta.get('copy_tbs'))}; {meta.get('command', '')}")
    print(header())
    for row in rows:
        print(format_row(row))
    summary = summarize(rows)
    print_summary(summary)
    done = {describe(r) for r in rows}
    skipped = [s for s in dict.fromkeys(skipped) if s not in done]   # run by another of the files
    if skipped:
        print(f"# {len(skipped)} rows were skipped by --time-budget in these runs, e.g. {skipped[0]}")
    if args.json:
        write_json(args.json, {"merged_from": list(paths), "runs": metas}, rows, {"skipped": skipped})
    if args.plot:
        devices = sorted({str(m.get("device")) for m in metas if m})
        n = write_svg(rows, args.plot, args.plot_by, f"{len(rows)} rows; {', '.join(devices)}")
        print(f"# wrote {args.plot} ({n} panels)")
    return 1 if summary["failures"] else 0


def fmt_tbs(value) -> str:
    return f"{value:.2f} TB/s" if value else "n/a"


def run(cases: Sequence[Case], args: argparse.Namespace) -> int:
    import evtc
    from evtc.timing import time_paired

    if not torch.cuda.is_available():
        sys.exit("bench/shapes.py needs a CUDA GPU (try --dry-run, --plot-from or --merge)")
    start = time.perf_counter()
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "evtc": evtc.__version__,
            "command": " ".join(sys.argv), "config": args.config, "samples": args.samples,
            "sample_ms": args.sample_ms, "graphs": args.graphs, "l2_rotate_mb": args.l2_rotate_mb,
            "torch_compile": None if args.no_torch_compile
            else f"mode={args.torch_compile_mode}, dynamic=True"}
    print(f"# {meta['device']}; torch {meta['torch']}; evtc {meta['evtc']}; config {args.config}; "
          f"{len(cases)} rows; {'CUDA graphs' if args.graphs else 'launches'}; "
          f"{args.samples} samples of >= {args.sample_ms} ms")
    copy_tbs = None
    if not args.check_only:
        copy_tbs = copy_bandwidth(time_paired, max(args.samples, 10))
        meta["copy_tbs"] = copy_tbs
        print(f"# device-to-device copy: {copy_tbs:.2f} TB/s (read + write of 1 GiB); weight-streaming bar "
              f"({STREAMING_BAR:.0%}): {STREAMING_BAR * copy_tbs:.2f} TB/s")
    kernels = Kernels(args.config)
    compiled = TorchCompiled(not args.no_torch_compile, args.torch_compile_timeout, args.torch_compile_mode)
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    workers = (os.cpu_count() or 2) // 2 if args.prebuild < 0 else args.prebuild
    if workers > 0:
        prebuild_variants(cases, kernels, workers)
    rows: list[dict] = []
    skipped: list[str] = []
    print(header(), flush=True)
    for case in cases:
        if args.time_budget and time.perf_counter() - start > args.time_budget:
            skipped.append(describe(row_template(case)))
            continue
        try:
            row = measure(case, kernels, compiled, gen, args, time_paired, copy_tbs=copy_tbs)
        except Exception as exc:  # out of memory and the like: a loud row, then go on
            row = row_template(case)
            row["failures"].append(f"row: {type(exc).__name__}: {first_line(exc)}")
        rows.append(row)
        print(format_row(row), flush=True)
        if args.json:
            meta.update(evtc_compile_s=kernels.seconds, evtc_configs=kernels.configs)
            write_json(args.json, meta, rows, {"skipped": skipped})
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()   # the next row's shapes differ: give back this row's buffers
        except Exception as exc:  # a sticky CUDA error (an illegal address): every later row would fail
            print(f"!!! CUDA error after this row, stopping: {type(exc).__name__}: {first_line(exc)}")
            skipped += [describe(row_template(c)) for c in cases[len(rows) + len(skipped):]]
            break
    if skipped:
        print(f"\n# --time-budget {args.time_budget:g} s reached: {len(skipped)} rows not run, e.g. "
              f"{skipped[0]} (run them with a narrower --families / --ms / --dtypes)")
    meta.update(evtc_compile_s=kernels.seconds, evtc_configs=kernels.configs)
    meta["wall_s"] = round(time.perf_counter() - start, 1)
    summary = summarize(rows)
    if not args.check_only:
        print_summary(summary)
    elif summary["failures"]:
        print("\n".join(["", *(f"!!! {f}" for f in summary["failures"])]))
    else:
        print(f"\n# every evtc result of {len(rows)} rows is within tolerance")
    print(f"# evtc kernels: {kernels.configs}; compile or load (s): {kernels.seconds}; "
          f"wall {meta['wall_s']} s")
    if args.json:
        write_json(args.json, meta, rows, {"skipped": skipped})
    if args.plot and not args.check_only:
        write_svg(rows, args.plot, args.plot_by, f"{meta['device']}; torch {meta['torch']}; copy "
                  f"{fmt_tbs(copy_tbs)}")
    return 1 if summary["failures"] else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot_from or args.merge:
        return from_json([args.plot_from] if args.plot_from else args.merge, args)
    cases = suite_from_args(args)
    if not cases:
        sys.exit("no rows: check --families / --layers")
    if args.dry_run:
        dry_run(cases, args)
        return 0
    load_torch()
    return run(cases, args)


if __name__ == "__main__":
    sys.exit(main())
