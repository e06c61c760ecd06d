"""GPU tests of evtc.compile: every catalogue epilogue against evtc.reference on an H100.

Each epilogue runs in float16 and bfloat16 at several shapes (odd sizes, M == N, L > 1 for the
batched entries). Outputs are poisoned with NaN first, so an element the kernel never writes fails
(NaN never passes). Per output, ||out - ref|| / ||ref|| <= 1e-2, with ref the epilogue computed by
torch in float32 (rounded to float8 for float8 outputs, as the IR defines the cast).

All kernels are compiled up front by a process pool into one disk cache (about 100 compiles), then
each test loads its kernel from there.
"""

from __future__ import annotations

import re

import pytest
import torch
from compile_catalogue import CATALOGUE, compile_entry, compile_job, make_inputs
from support import precompiled_cache

import evtc
from evtc.ir.dtypes import is_float8, round_to

pytestmark = pytest.mark.gpu

TOL = 1e-2
# Reductions are float32 sums / extrema of float32 values: only the GEMM's and the reduction's
# summation orders differ from torch's.
REDUCTION_TOL = 1e-4
#: One rounding of a 16-bit output (half its spacing): reductions of 16-bit values are 16-bit.
ROUNDING = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
# (M, N, K, L): odd M and K, M == N, batched. N stays a multiple of 16 (float8 outputs need
# 16-byte rows for TMA).
UNBATCHED = [(257, 384, 200, None), (512, 512, 128, None), (1000, 1040, 72, None)]
BATCHED = [(129, 256, 64, 3), (256, 256, 96, 2)]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    jobs = [(e.name, dt) for e in CATALOGUE for dt in DTYPES]
    return precompiled_cache(tmp_path_factory, "evtc-catalogue-cache", compile_job, jobs)


def _poisoned_like(value):
    if isinstance(value, dict):
        return {k: _poisoned_like(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return tuple(_poisoned_like(v) for v in value)
    return torch.full(value.shape, float("nan"), device=value.device).to(value.dtype)


def _flatten(value):
    if isinstance(value, dict):
        return list(value.items())
    if isinstance(value, tuple | list):
        return [(str(i), v) for i, v in enumerate(value)]
    return [("D", value)]


def _check(out, ref, what: str) -> None:
    got, want = _flatten(out), _flatten(ref)
    assert [k for k, _ in got] == [k for k, _ in want], f"{what}: output structure differs"
    for (key, g), (_, r) in zip(got, want, strict=True):
        assert tuple(g.shape) == tuple(r.shape), f"{what} {key}: shape {tuple(g.shape)} vs {tuple(r.shape)}"
        expected = r.float()
        if is_float8(g.dtype):
            expected = round_to(expected, g.dtype)
        diff = torch.linalg.vector_norm(g.float() - expected)
        norm = torch.linalg.vector_norm(expected).clamp_min(1e-12)
        rel = (diff / norm).item()
        assert rel <= TOL, f"{what} output {key} ({g.dtype}): relative error {rel:.3g}"


def _check_reductions(k, out, ref, what: str) -> None:
    """The outputs finished from reductions match float32 torch to within summation error."""
    host = {h.name for h in k.plan.host_outputs}
    flat_out, flat_ref = _flatten(out), _flatten(ref)
    for name, (key, g), (_, r) in zip(k.graph.outputs.names, flat_out, flat_ref, strict=True):
        if name not in host:
            continue
        expected = r.double()
        rel = ((g.double() - expected).norm() / expected.norm().clamp_min(1e-12)).item()
        # A reduction of a 16-bit value is 16-bit, as in torch: one rounding of that dtype more.
        tol = max(REDUCTION_TOL, ROUNDING.get(g.dtype, 0.0))
        assert rel <= tol, f"{what} reduction {key} ({g.dtype}): relative error {rel:.3g}"


def _run_poisoned(k, e, m, n, kk, batch, what, dtype=torch.float16, k_major_b=False):
    """Run ``k`` on fresh inputs of entry ``e`` into NaN-poisoned outputs and check the result against
    evtc.reference; returns (inputs, operands, result). ``k_major_b``: B as a linear layer's weight."""
    inputs = make_inputs(e, m, n, kk, batch, dtype, device="cuda", seed=m + n)
    if k_major_b:
        inputs["b"] = _k_major(inputs["b"])
    operands = {name: v for name, v in inputs.items() if name not in ("a", "b")}
    ref = evtc.reference(e.fn, inputs)
    out = _poisoned_like(k(inputs["a"], inputs["b"], **operands))
    result = k(inputs["a"], inputs["b"], out=out, **operands)
    torch.cuda.synchronize()
    _check(result, ref, what)
    return inputs, operands, result


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("entry", CATALOGUE, ids=[e.name for e in CATALOGUE])
def test_catalogue_matches_reference(entry, dtype, cache_dir):
    k = compile_entry(entry, DTYPES[dtype], cache_dir)
    for m, n, kk, batch in (BATCHED if entry.batched else UNBATCHED):
        inputs = make_inputs(entry, m, n, kk, batch, DTYPES[dtype], device="cuda", seed=m + n)
        operands = {name: v for name, v in inputs.items() if name not in ("a", "b")}
        ref = evtc.reference(entry.fn, inputs)
        fresh = k(inputs["a"], inputs["b"], **operands)
        out = _poisoned_like(fresh)
        result = k(inputs["a"], inputs["b"], out=out, **operands)
        torch.cuda.synchronize()
        _check(result, ref, f"{entry.name} {dtype} {(m, n, kk, batch)}")
        _check(fresh, ref, f"{entry.name} {dtype} {(m, n, kk, batch)} (fresh outputs)")
        _check_reductions(k, result, ref, f"{entry.name} {dtype} {(m, n, kk, batch)}")


def _entry(name):
    return next(e for e in CATALOGUE if e.name == name)


def test_cluster_shape_per_call(cache_dir):
    """Without a cluster knob the kernel picks the cluster shape per problem: 1x2 where every CTA of
    a cluster has a tile, 2x1 where a 1x2 cluster would leave half the CTAs idle (one column of
    tiles, more tiles than fit at once).  Every shape gives the reference result."""
    e = _entry("relu_lincomb_bias")
    k = compile_entry(e, torch.float16, cache_dir)
    assert k.config.cluster == (1, 2)
    for (m, n, kk), cluster in [((16384, 128, 64), (2, 1)), ((600, 512, 200), (1, 2)),
                                ((33792, 384, 72), (2, 1)), ((8192, 1024, 64), (1, 2))]:
        assert k.cluster_for(m, n) == cluster, (m, n)
        _run_poisoned(k, e, m, n, kk, None, f"{(m, n, kk)} cluster {cluster}")
    built = re.search(r"other shapes built: ([^)]*)\)", k.explain()).group(1).split(", ")
    # The configured tile in 2x1 clusters (33792 x 384: three columns of tiles, six waves; with
    # K = 72 this epilogue's C keeps it off the wide ping-pong tiles, evtc.plan.selector).
    assert "2x1" in built, built
    # A pinned cluster is kept for every problem.
    pinned = evtc.compile(e.fn, make_inputs(e, 256, 512, 128, None, torch.float16),
                          config={"cluster": (1, 2)}, cache_dir=cache_dir)
    assert pinned is not k and pinned.cluster_for(16384, 128) == (1, 2)


@pytest.mark.parametrize("name", ["gelu_row_sum_of_squares", "fp8_with_amax", "batched_reductions",
                                  "column_sum_max_min", "batched_rows_and_columns", "reductions_only"])
def test_reductions_are_deterministic(name, cache_dir):
    """Ten runs on the same inputs give bitwise the same reductions (partials per tile, reduced in a
    fixed order), on a problem of many tiles with ragged edges."""
    e = _entry(name)
    k = compile_entry(e, torch.float16, cache_dir)
    batch = 3 if e.batched else None
    _, operands, first = _run_poisoned(k, e, 1000, 1040, 520, batch, f"{name} first run")
    inputs = make_inputs(e, 1000, 1040, 520, batch, torch.float16, device="cuda", seed=1000 + 1040)
    first = [v.clone() for _, v in _flatten(first)]
    for _ in range(10):
        again = k(inputs["a"], inputs["b"], **operands)
        torch.cuda.synchronize()
        for x, y in zip(first, [v for _, v in _flatten(again)], strict=True):
            bits = (x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
            assert torch.equal(*bits), f"{name}: runs differ"


def test_new_scalar_values_need_no_recompile(cache_dir):
    e = _entry("relu_lincomb_bias")
    k = compile_entry(e, torch.float16, cache_dir)
    inputs = make_inputs(e, 300, 512, 64, None, torch.float16, device="cuda")
    a, b, C, bias = inputs["a"], inputs["b"], inputs["C"], inputs["bias"]
    for alpha, beta in ((1.5, 0.5), (-2.0, 3.0), (0.0, 1.0)):
        got = k(a, b, C=C, bias=bias, alpha=alpha, beta=beta)
        ref = e.fn((a.float() @ b.float()), C.float(), bias, alpha, beta)
        _check(got, ref, f"alpha={alpha} beta={beta}")
    assert compile_entry(e, torch.float16, cache_dir) is k


def test_inputs_are_not_modified_and_stream_is_honoured(cache_dir):
    e = _entry("every_kind")
    k = compile_entry(e, torch.float16, cache_dir)
    inputs = make_inputs(e, 384, 256, 128, None, torch.float16, device="cuda")
    before = {n: (v.clone() if isinstance(v, torch.Tensor) else v) for n, v in inputs.items()}
    operands = {n: v for n, v in inputs.items() if n not in ("a", "b")}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = k(inputs["a"], inputs["b"], **operands)
    stream.synchronize()
    _check(got, evtc.reference(e.fn, inputs), "side stream")
    for n, v in before.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(inputs[n], v), f"input {n} was modified"


def test_threads_on_streams_of_their_own(cache_dir):
    """Threads calling a kernel with kernel-finished reductions at once, each on a new stream (each
    stream's first call keeps its own buffers, from one memory pool: torch refuses two threads
    allocating to a pool at once, so evtc takes turns), give the results of serial calls."""
    import threading

    e = _entry("gelu_row_sum_of_squares")
    k = compile_entry(e, torch.float16, cache_dir)
    problems = [make_inputs(e, 256 + 64 * i, 256, 128, None, torch.float16, device="cuda", seed=i)
                for i in range(4)]

    def call(inputs):
        return k(inputs["a"], inputs["b"], **{n: v for n, v in inputs.items() if n not in ("a", "b")})

    serial = [[t.clone() for t in call(p)] for p in problems]
    torch.cuda.synchronize()
    failures: list[str] = []

    def work(i):
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                for rep in range(10):
                    j = (i + rep) % 4
                    got = call(problems[j])
                    stream.synchronize()
                    if not all(torch.equal(g, w) for g, w in zip(got, serial[j], strict=True)):
                        failures.append(f"thread {i} call {rep}: differs")
        except Exception as exc:  # noqa: BLE001 - reported below
            failures.append(f"thread {i}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[:3]


def test_call_errors_on_gpu(cache_dir):
    e = _entry("relu_lincomb_bias")
    k = compile_entry(e, torch.float16, cache_dir)
    inputs = make_inputs(e, 256, 512, 64, None, torch.float16, device="cuda")
    a, b, C, bias = inputs["a"], inputs["b"], inputs["C"], inputs["bias"]
    with pytest.raises(evtc.CallError, match="on cpu"):
        k(a, b, C=C.cpu(), bias=bias, alpha=1.0, beta=1.0)
    with pytest.raises(evtc.CallError, match="inconsistent with a and b"):
        k(a, b, C=C[:100], bias=bias, alpha=1.0, beta=1.0)
    with pytest.raises(evtc.CallError, match="float16"):
        k(a, b, C=C.double(), bias=bias, alpha=1.0, beta=1.0)
    # Another float dtype than compiled that leaves the output's dtype (bfloat16 for a float32 bias
    # beside float16 a: float32 either way) is no error: the torch path computes the function. One
    # that changes it (a float16 bias: a float16 output in torch) is refused by name.
    with pytest.raises(evtc.CallError, match="other dtypes than the compiled"):
        k(a, b, C=C, bias=bias.half(), alpha=1.0, beta=1.0)
    got = k(a, b, C=C, bias=bias.bfloat16(), alpha=1.0, beta=1.0)
    assert k.last_path == "torch"
    _check(got, evtc.reference(e.fn, {**inputs, "bias": bias.bfloat16(), "alpha": 1.0, "beta": 1.0}),
           "dtypes")
    # Layouts TMA cannot take (a row pitch of 516 elements, an offset bias) are no error: the call
    # runs on aligned copies (tests/test_call_paths_gpu.py has strict=True refuse them).
    wide = torch.randn(256, 516, device="cuda").half()[:, :512]
    offset = torch.randn(513, device="cuda")[1:]
    got = k(a, b, C=wide, bias=offset, alpha=1.0, beta=1.0)
    assert k.last_path == "staged"
    _check(got, evtc.reference(e.fn, {**inputs, "C": wide, "bias": offset, "alpha": 1.0, "beta": 1.0}),
           "staged call")


def test_empty_problem_returns_empty_outputs(cache_dir):
    e = _entry("relu_lincomb_bias")
    k = compile_entry(e, torch.float16, cache_dir)
    inputs = make_inputs(e, 0, 512, 64, None, torch.float16, device="cuda")
    out = k(inputs["a"], inputs["b"], C=inputs["C"], bias=inputs["bias"], alpha=1.0, beta=1.0)
    assert out.shape == (0, 512)


def test_means_over_an_empty_dim_are_nan_as_in_torch(cache_dir):
    """A mean over N = 0 columns (or M = 0 rows) is NaN, as torch's: 1/N of the mean is then
    infinite (it raised ZeroDivisionError before), and the empty sum times it NaN."""
    def means(acc):
        return acc.mean(-1), acc.mean(0)

    a = torch.randn(64, 128, device="cuda").half()
    b = torch.randn(128, 256, device="cuda").half()
    k = evtc.compile(means, {"a": a, "b": b}, cache_dir=str(cache_dir))
    for m, n in [(64, 0), (0, 256)]:
        x, w = a[:m], b[:, :n]
        rows, cols = k(x, w)
        want_rows, want_cols = means(x.float() @ w.float())
        assert rows.shape == want_rows.shape and cols.shape == want_cols.shape
        assert torch.equal(rows.isnan(), want_rows.isnan()) and torch.equal(cols.isnan(), want_cols.isnan())


def test_a_max_over_no_elements_is_refused_by_name_on_the_kernel_path(cache_dir):
    """An empty problem runs no kernel; a max over its empty extent is refused by name (it raised
    torch's RuntimeError from the host finish before), as on the torch path."""
    def stats(acc):
        return acc, acc.abs().amax()

    a = torch.randn(64, 128, device="cuda").half()
    b = torch.randn(128, 256, device="cuda").half()
    k = evtc.compile(stats, {"a": a, "b": b}, cache_dir=str(cache_dir))
    with pytest.raises(evtc.CallError, match="over an empty M"):
        k(a[:0], b)
    _, top = k(a, b)  # and the kernel still runs where the problem is not empty
    torch.testing.assert_close(top.float(), (a.float() @ b.float()).abs().amax(), rtol=1e-2, atol=1e-2)


def test_torch_legal_broadcasts_run_on_the_kernel(cache_dir):
    """A bias of (1, N) for an (N,) example, a 0-d device scalar passed as (1,) (of a's dtype, which
    torch promotes alike either way), and a batch of 1 beside batches of 3 (a kernel compiled with
    equal batches) run the kernel on views (evtc.runtime.broadcasts), with torch's result; inputs
    unmodified. A float32 (1,) scalar for a 0-d one is refused: torch would promote the result."""
    def scaled_bias(acc, bias, s):
        return torch.relu(acc * s + bias)

    a = torch.randn(128, 256, device="cuda").half()
    b = torch.randn(256, 192, device="cuda").half()
    bias, s = torch.randn(192, device="cuda").half(), torch.tensor(0.5, device="cuda").half()
    k = evtc.compile(scaled_bias, {"a": a, "b": b, "bias": bias, "s": s}, cache_dir=str(cache_dir))
    with pytest.raises(evtc.CallError, match="other dtypes than the compiled"):
        k(a, b, bias=bias, s=s[None].float())
    for call_bias, call_s in [(bias[None], s), (bias, s[None])]:
        kept = (call_bias.clone(), call_s.clone())
        got = k(a, b, bias=call_bias, s=call_s)
        assert k.last_path in ("kernel", "staged")
        want = scaled_bias(a.float() @ b.float(), call_bias.float(), call_s)
        assert got.shape == want.shape
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
        assert torch.equal(kept[0], call_bias) and torch.equal(kept[1], call_s)

    def residual(acc, C):
        return acc + C

    A = torch.randn(3, 128, 256, device="cuda").half()
    B = torch.randn(3, 256, 192, device="cuda").half()
    C = torch.randn(3, 128, 192, device="cuda").half()
    kb = evtc.compile(residual, {"a": A, "b": B, "C": C}, cache_dir=str(cache_dir))
    for x, w, c in [(A, B[:1], C), (A[:1], B, C), (A, B, C[:1])]:
        got = kb(x, w, C=c)
        assert kb.last_path in ("kernel", "staged")
        want = residual(x.float() @ w.float(), c.float())
        assert got.shape == want.shape == (3, 128, 192)
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


# ---- cooperative schedule -----------------------------------------------------------------------
# The default is the ping-pong schedule; these run the catalogue's harder entries under the other one
# (where relu_lincomb_bias stages D in C's buffers).

COOPERATIVE_ENTRIES = ["relu_lincomb_bias", "col_and_row", "every_kind", "float32_c", "aux_outputs",
                    "fp8_e4m3_aux", "four_outputs", "batched_operands", "batched_two_outputs",
                    "config_cluster2x1", "gelu_row_sum_of_squares", "column_sum_max_min",
                    "batched_rows_and_columns", "reductions_only", "swiglu", "geglu_bias_residual",
                    "reglu_outputs_and_stats"]


def _k_major(b: torch.Tensor) -> torch.Tensor:
    """The same (..., K, N) values, stored K-major."""
    return b.transpose(-1, -2).contiguous().transpose(-1, -2)


def _compile_with(e, knobs: dict, cache_dir, k_major_b=False) -> evtc.Kernel:
    """Catalogue entry ``e`` compiled (float16) with ``knobs`` on top of its own config."""
    example = make_inputs(e, 256, 512, 128, 2 if e.batched else None, torch.float16)
    if k_major_b:
        example["b"] = _k_major(example["b"])
    return evtc.compile(e.fn, example, out_dtypes=e.out_dtypes, config={**(e.config or {}), **knobs},
                        cache_dir=str(cache_dir))


@pytest.mark.parametrize("name", COOPERATIVE_ENTRIES)
def test_catalogue_cooperative(name, tmp_path):
    e = _entry(name)
    k = _compile_with(e, {"schedule": "cooperative"}, tmp_path)
    assert k.config.schedule == "cooperative"
    shapes = BATCHED if e.batched else [(64, 256, 16, None), *UNBATCHED, (8192, 768, 256, None)]
    for m, n, kk, b in shapes:
        inputs, operands, result = _run_poisoned(k, e, m, n, kk, b, f"{name} cooperative {(m, n, kk, b)}")
        first = [v.clone() for _, v in _flatten(result)]
        again = k(inputs["a"], inputs["b"], **operands)
        torch.cuda.synchronize()
        for x, y in zip(first, [v for _, v in _flatten(again)], strict=True):
            assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), \
                f"{name}: runs differ"


# ---- the launch per problem size (evtc.plan.selector) ---------------------------------------------
# The catalogue's default kernels choose their tile per call: at the sizes above (a few hundred rows)
# they already run 64 x 64 or 128 x 64 tiles. These add decode sizes (64-row tiles, split K, the
# reductions finished with the launched tile's partials) and pin the 128 x 128 ping-pong tile, which
# large problems get.

SELECTOR_ENTRIES = ["relu_lincomb_bias", "col_and_row", "every_kind", "aux_outputs", "four_outputs",
                    "batched_operands", "gelu_row_sum_of_squares", "column_sum_max_min",
                    "batched_rows_and_columns", "reductions_only", "swiglu", "reglu_outputs_and_stats"]
DECODE = [(1, 384, 520, None), (16, 1040, 4096, None), (64, 512, 8192, None), (100, 256, 3000, None)]
DECODE_BATCHED = [(3, 256, 4096, 2), (64, 128, 2048, 3)]


@pytest.mark.parametrize("name", SELECTOR_ENTRIES)
def test_catalogue_decode_sizes(name, cache_dir):
    e = _entry(name)
    k = compile_entry(e, torch.float16, cache_dir)
    for m, n, kk, b in (DECODE_BATCHED if e.batched else DECODE):
        config, splits = k.launch_for(m, n, kk, b or 1)
        if m <= 64:
            assert config.tile_m == 64, (name, m, config.short_name())
        inputs, operands, result = _run_poisoned(k, e, m, n, kk, b, f"{name} {(m, n, kk, b)} "
                                                 f"{config.short_name()} S={splits}")
        ref = evtc.reference(e.fn, inputs)
        _check_reductions(k, result, ref, f"{name} {(m, n, kk, b)}")


@pytest.mark.parametrize("name", SELECTOR_ENTRIES)
def test_catalogue_pinned_128x128(name, tmp_path):
    e = _entry(name)
    k = _compile_with(e, {"tile_m": 128, "schedule": "pingpong"}, tmp_path)
    for m, n, kk, b in (BATCHED if e.batched else UNBATCHED):
        assert k.launch_for(m, n, kk, b or 1)[0].tile_m == 128
        inputs, operands, result = _run_poisoned(k, e, m, n, kk, b, f"{name} 128x128 {(m, n, kk, b)}")
        _check_reductions(k, result, evtc.reference(e.fn, inputs), f"{name} 128x128 {(m, n, kk, b)}")


# One wave or just over (evtc.plan.selector): the default kernels switch to cooperative 128 x 128
# or 128 x 64 tiles (one tile per CTA, shared by both consumer warpgroups) or 128 x 192 ones (wave
# quantization); small K keeps these cheap.
ONE_WAVE = [((256, 8192, 136, None), 128), ((512, 6144, 72, None), 192), ((256, 4096, 72, None), 64)]
ONE_WAVE_BATCHED = [((256, 4096, 64, 2), 128), ((256, 6144, 64, 2), 192), ((128, 4096, 80, 2), 64)]


@pytest.mark.parametrize("name", SELECTOR_ENTRIES)
def test_catalogue_one_wave_sizes(name, cache_dir):
    e = _entry(name)
    k = compile_entry(e, torch.float16, cache_dir)
    for (m, n, kk, b), tile_n in (ONE_WAVE_BATCHED if e.batched else ONE_WAVE):
        config, splits = k.launch_for(m, n, kk, b or 1)
        what = f"{name} {(m, n, kk, b)} {config.short_name()} S={splits}"
        if k.config.schedule == "pingpong" and not k.config.gated:
            assert (config.schedule, config.tile_n) == ("cooperative", tile_n), what
        inputs, operands, result = _run_poisoned(k, e, m, n, kk, b, what)
        _check_reductions(k, result, evtc.reference(e.fn, inputs), what)


@pytest.mark.parametrize("name", SELECTOR_ENTRIES)
def test_catalogue_pinned_128x192_split(name, tmp_path):
    """Tiles 192 wide: six epilogue subtiles, 96 accumulator values per thread (split-K's partials
    are stored and added in batches that divide them), ragged N."""
    e = _entry(name)
    # Gated: halves of 96 columns, which an N-major B cannot load (a config error, tested on the CPU).
    gated = name in ("swiglu", "reglu_outputs_and_stats")
    k = _compile_with(e, {"schedule": "cooperative", "tile_n": 192, "split_k": True}, tmp_path,
                      k_major_b=gated)
    shapes = BATCHED if e.batched else [*UNBATCHED, (130, 1000, 3000, None)]
    for splits in (1, 3):
        k.pin_splits(splits)
        for m, n, kk, b in shapes:
            config, chosen = k.launch_for(m, n, kk, b or 1)
            # At most one split per K tile (every unit of a launch has a K tile).
            assert config.tile_n == 192 and chosen == min(splits, -(-kk // config.tile_k))
            what = f"{name} 128x192 S={splits} {(m, n, kk, b)}"
            inputs, operands, result = _run_poisoned(k, e, m, n, kk, b, what, k_major_b=gated)
            _check_reductions(k, result, evtc.reference(e.fn, inputs), what)
