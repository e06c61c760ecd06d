"""Block-scaled float8 (issue "FP8 inputs": DeepSeek-V3's 1 x 128 and 128 x 128 blocks) on the CPU: the
PTX, the reference and the torch path against float64 written out block by block, and every refusal
with its message. The kernels' results on the GPU: tests/test_fp8_blockwise_gpu.py."""

from __future__ import annotations

import re

import pytest
import torch

import evtc
from evtc.errors import CallError, CompileError, InputError
from evtc.plan.config import ConfigError, GemmConfig
from evtc.runtime.call_checks import halves_off_scale_chunk, scales_fit

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def identity(acc):
    return acc


def bias_relu(acc, bias):
    return torch.relu(acc + bias)


def gated(acc):
    gate, up = acc.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _blocks(x: int) -> int:
    return -(-x // 128)


def _pairs(m, n, k, rows, seed=0, batches=None, a_dtype=E4M3, b_dtype=E4M3):
    """(a, a's scales) and (b = w.t(), b's scales) with scales of a wide range."""
    g = torch.Generator().manual_seed(seed)
    lead = (batches,) if batches else ()
    a = (torch.randn(*lead, m, k, generator=g) * 2).to(a_dtype)
    w = (torch.randn(*lead, n, k, generator=g) * 2).to(b_dtype)
    a_rows = m if rows == 1 else _blocks(m)
    sa = torch.exp2(torch.randint(-6, 7, (*lead, a_rows, _blocks(k)), generator=g).float())
    sw = torch.rand(*lead, _blocks(n), _blocks(k), generator=g) + 0.1
    return (a, sa), (w.transpose(-1, -2), sw.transpose(-1, -2))


def _product_by_blocks(a_pair, b_pair, rows):
    """a @ b in float64, block by block: sum over K blocks of sa * sb * (a block @ b block)."""
    (a, sa), (b, sb) = a_pair, b_pair
    m, k = a.shape[-2:]
    n = b.shape[-1]
    out = torch.zeros(*a.shape[:-2], m, n, dtype=torch.float64)
    for kb in range(_blocks(k)):
        ks = slice(kb * 128, (kb + 1) * 128)
        for i in range(_blocks(m) if rows == 128 else m):
            r = slice(i * rows, (i + 1) * rows)
            for j in range(_blocks(n)):
                c = slice(j * 128, (j + 1) * 128)
                part = a[..., r, ks].double() @ b[..., ks, c].double()
                out[..., r, c] += part * (sa[..., i, kb] * sb[..., kb, j]).double()[..., None, None]
    return out


def _shared_words_read(ptx: str) -> int:
    """32-bit values that the ld.shared instructions of ``ptx`` read (a .v2 reads two)."""
    return sum(int(vector or 1) for vector in re.findall(r"ld\.shared(?:\.v(\d))?\.[bf]32", ptx))


@pytest.mark.parametrize("rows", [1, 128], ids=["1x128", "128x128"])
def test_block_scales_compile_to_the_8_bit_wgmma_with_scaled_promotion(tmp_path, rows):
    a, b = _pairs(256, 384, 512, rows)
    k = evtc.compile(identity, {"a": a, "b": b}, cache_dir=tmp_path)
    assert k.config.block_scales == rows and k.config.promotes
    assert (k.config.schedule, k.config.tile_n) == ("cooperative", 192)
    ptx = k.ptx
    assert set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n192k32\.([\w.]+)", ptx)) == {"f32.e4m3.e4m3"}
    # Each K tile: one multiply-add per accumulator value (96 per thread) into the float32
    # accumulator after the wgmma's wait.
    loop = ptx[ptx.index("wgmma.mma_async"):]
    loop = loop[:loop.index("wgmma.fence", 1)] if "wgmma.fence" in loop[1:] else loop
    assert len(re.findall(r"fma\.rn\.f32", loop)) >= 96
    # The scales: 128 x 128 blocks of A (one per tile) loaded from global memory after the wgmma
    # is issued; 1 x 128 ones come with the A/B stage by TMA (a third copy into shared memory,
    # beside A's and B's), B's with it by the producer warp's cp.async (tracked by the stage's
    # barrier), and both are read from shared memory between the stage's wait and the wgmma's
    # fence, with no global load there to hold the fence up.
    tma_loads = re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::c\w+\.global", ptx)
    assert k.config.stages_a_scales == (rows == 1) and len(tma_loads) == (3 if rows == 1 else 2)
    if rows == 1:
        before = ptx[:ptx.index("wgmma.mma_async")]
        before = before[before.rindex("mbarrier.try_wait"):before.rindex("wgmma.fence")]
        # The thread's two rows, and B's three 64-column chunks.
        assert _shared_words_read(before) == 2 + 3
        assert not re.search(r"ld\.global", before)
        # The producer warp: one 4-byte cp.async per chunk, whose landing the stage's barrier tracks.
        assert re.search(r"cp\.async\.ca\.shared(::cta)?\.global(\.\w+)* \[[^]]+\], \[[^]]+\], 4", ptx)
        assert re.search(r"cp\.async\.mbarrier\.arrive(\.shared(::cta)?)?\.b64", ptx)
        assert not re.search(r"cp\.async\.mbarrier\.arrive\.noinc", ptx)
    else:
        assert re.search(r"ld\.global(\.\w+)*\.[bf]32", loop)


def test_block_scales_take_mixed_formats_and_batches(tmp_path):
    a, b = _pairs(200, 256, 640, 1, batches=3, a_dtype=E4M3, b_dtype=E5M2)
    k = evtc.compile(identity, {"a": a, "b": b}, cache_dir=tmp_path)
    assert "f32.e4m3.e5m2" in k.ptx and k.plan.a_scales.dims == ("L", "M", "KB")
    got = k(a, b)  # CPU: the torch path
    assert k.last_path == "torch"
    ref = _product_by_blocks(a, b, 1)
    assert (got.double() - ref).abs().max() <= 1e-2 * ref.abs().max()  # bf16 output


@pytest.mark.parametrize("rows", [1, 128], ids=["1x128", "128x128"])
def test_a_batch_of_one_is_expanded_with_its_scales(tmp_path, rows):
    """On a kernel compiled with equal batches, an ``a`` (or ``b``) of batch 1 beside a ``C`` of
    batch 3 broadcasts as torch would: the tensor and its block scales are expanded together
    (evtc.runtime.broadcasts); the error named a's scales against the expanded a before."""
    a3, b3 = _pairs(130, 256, 300, rows, seed=5, batches=3)
    C = torch.randn(3, 130, 256)

    def residual(acc, C):
        return acc + C

    kernel = evtc.compile(residual, {"a": a3, "b": b3, "C": C}, cache_dir=tmp_path)
    a1 = (a3[0][:1], a3[1][:1])
    b1 = (b3[0][:1], b3[1][:1])
    for a, b in [(a1, b3), (a3, b1)]:
        with torch.no_grad():
            got = kernel(a, b, C=C)
        a_whole, b_whole = ((t.expand(3, *t.shape[1:]), s.expand(3, *s.shape[1:])) for t, s in (a, b))
        ref = _product_by_blocks(a_whole, b_whole, rows) + C.double()
        assert got.shape == ref.shape == (3, 130, 256)
        assert (got.double() - ref).abs().max() <= 1e-2 * ref.abs().max()  # bf16 output


@pytest.mark.parametrize(("rows", "shape"), [(1, (130, 200, 300)), (128, (300, 129, 257)), (1, (1, 64, 128))],
                         ids=["1x128", "128x128", "one-row"])
def test_reference_and_torch_path_match_the_product_block_by_block(tmp_path, rows, shape):
    m, n, k = shape
    a, b = _pairs(m, n, k, rows, seed=3)
    bias = torch.randn(n)
    ref = torch.relu(_product_by_blocks(a, b, rows) + bias.double())
    mine = evtc.reference(bias_relu, {"a": a, "b": b, "bias": bias}, dtype=torch.float64)
    assert (mine - ref).abs().max() <= 1e-12 * ref.abs().max()
    kernel = evtc.compile(bias_relu, {"a": a, "b": b, "bias": bias}, cache_dir=tmp_path)
    got = kernel(a, b, bias=bias)
    assert (got.double() - ref).abs().max() <= 1e-2 * ref.abs().max()
    # Nothing the caller passed is modified.
    again = _pairs(m, n, k, rows, seed=3)
    for (t, s), (t0, s0) in zip((a, b), again, strict=True):
        assert torch.equal(t.float(), t0.float()) and torch.equal(s, s0)


@pytest.mark.parametrize("rows", [1, 128], ids=["1x128", "128x128"])
def test_gated_block_scales_read_each_half_of_b_by_its_own_columns(tmp_path, rows):
    """SwiGLU over block-scaled float8: the gate half's and the up half's 32-column chunks each read
    B's scale of their own 128-column block (the up half's start N/2 columns into B)."""
    a, b = _pairs(256, 2 * 96, 512, rows)
    k = evtc.compile(gated, {"a": a, "b": b}, cache_dir=tmp_path)
    assert k.config.gated and k.config.block_scales == rows and k.config.scale_chunk == 32
    assert (k.config.schedule, k.config.tile_n) == ("cooperative", 192)
    assert "wgmma.mma_async.sync.aligned.m64n192k32.f32.e4m3.e4m3" in k.ptx
    loop = k.ptx[k.ptx.index("wgmma.mma_async"):]
    loop = loop[:loop.index("wgmma.fence", 1)] if "wgmma.fence" in loop[1:] else loop
    # Six chunks of B (three per half) and A's scales: with 128 x 128 blocks of A, its block's and
    # B's from global memory after the wgmma is issued; with 1 x 128, its two rows' and B's six
    # from the stage before it (the producer warp copies B's, six lanes).
    if rows == 1:
        assert k.config.stages_a_scales and k.config.b_scale_chunks == 6
        before = k.ptx[:k.ptx.index("wgmma.mma_async")]
        before = before[before.rindex("mbarrier.try_wait"):before.rindex("wgmma.fence")]
        assert not re.search(r"ld\.global", before)
        assert _shared_words_read(before) == 2 + 6
    else:
        assert len(re.findall(r"ld\.global(\.\w+)*\.[bf]32", loop)) >= 6 + 1


def test_gated_kernels_take_halves_of_whole_scale_chunks(tmp_path):
    """The per-call rule that sends a gated block-scaled call to the torch path: halves of B that
    are not whole 32-column chunks (plain block-scaled kernels take any width)."""
    a, b = _pairs(256, 2 * 96, 512, 1)
    swiglu = evtc.compile(gated, {"a": a, "b": b}, cache_dir=tmp_path)
    plain = evtc.compile(identity, {"a": a, "b": b}, cache_dir=tmp_path)
    for n, off in ((2 * 96, False), (2 * 1024, False), (2 * 100, True), (2 * 48 + 2, True)):
        assert halves_off_scale_chunk(swiglu.call_spec, n) == off, n
    assert not halves_off_scale_chunk(plain.call_spec, 200)


@pytest.mark.parametrize(("rows", "shape"), [(1, (130, 2 * 160, 300)), (128, (300, 2 * 100, 257))],
                         ids=["1x128-aligned-halves", "128x128-odd-halves"])
def test_gated_block_scales_on_the_torch_path_match_the_blocks(tmp_path, rows, shape):
    """The reference and the torch path of a gated block-scaled epilogue: the dequantized product
    (block by block) split into gate and up halves, whatever N / 2 is (100 is not a multiple of 32:
    on a GPU that call takes the torch path too)."""
    m, n, k = shape
    a, b = _pairs(m, n, k, rows, seed=5)
    whole = _product_by_blocks(a, b, rows)
    gate, up = whole.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    mine = evtc.reference(gated, {"a": a, "b": b}, dtype=torch.float64)
    assert (mine - ref).abs().max() <= 1e-12 * ref.abs().max()
    kernel = evtc.compile(gated, {"a": a, "b": b}, cache_dir=tmp_path)
    got = kernel(a, b)
    assert kernel.last_path == "torch" and got.shape == (m, n // 2)
    assert (got.double() - ref).abs().max() <= 1e-2 * ref.abs().max()


def test_block_scales_under_torch_compile_are_one_op(tmp_path):
    a, b = _pairs(128, 256, 256, 1, seed=4)
    kernel = evtc.compile(identity, {"a": a, "b": b}, cache_dir=tmp_path)
    assert "Tensor a_scales, Tensor b_scales" in str(kernel.op._schema)

    def f(x, sx, w, sw):
        return kernel((x, sx), (w, sw)) + 1

    got = torch.compile(f, backend="eager", fullgraph=True)(a[0], a[1], b[0], b[1])
    ref = _product_by_blocks(a, b, 1) + 1
    assert (got.double() - ref).abs().max() <= 1e-2 * ref.abs().max()

    swiglu = evtc.compile(gated, {"a": a, "b": b}, cache_dir=tmp_path)

    def g(x, sx, w, sw):
        return swiglu((x, sx), (w, sw)) * 2

    got = torch.compile(g, backend="eager", fullgraph=True)(a[0], a[1], b[0], b[1])
    gate, up = _product_by_blocks(a, b, 1).chunk(2, dim=-1)
    ref = 2 * torch.nn.functional.silu(gate) * up
    assert got.shape == (128, 128) and (got.double() - ref).abs().max() <= 1e-2 * ref.abs().max()


def _compile_error(tmp_path, fn, inputs, match, **kw):
    with pytest.raises(CompileError, match=match) as info:
        evtc.compile(fn, inputs, cache_dir=tmp_path, **kw)
    assert "test_fp8_blockwise.py" in str(info.value)  # the user's file and line
    return info.value


def test_compile_refusals_name_the_problem(tmp_path):
    (a, sa), (b, sb) = _pairs(256, 256, 512, 1)
    _compile_error(tmp_path, identity, {"a": (a, sa), "b": b}, "b has no block scales")
    _compile_error(tmp_path, identity, {"a": (a.half(), sa), "b": (b.half(), sb)}, "scale float8 a and b")
    _compile_error(tmp_path, identity, {"a": (a, sa[:, :2]), "b": (b, sb)},
                   r"a's block scales have shape \(256, 2\); .* \(256, 4\) .* \(2, 4\)")
    _compile_error(tmp_path, identity, {"a": (a, sa), "b": (b, sb.t().contiguous()[:, :2])},
                   r"b's block scales have shape .* takes \(4, 2\)")
    _compile_error(tmp_path, identity, {"a": (a, sa.half()), "b": (b, sb)}, "must be float32")
    _compile_error(tmp_path, gated, {"a": (a, sa), "b": (b, sb)}, "halves of a multiple of 32 columns",
                   config={"schedule": "cooperative", "tile_n": 160, "epi_tile_n": 16})
    _compile_error(tmp_path, identity, {"a": (a, sa), "b": (b, sb)}, "fast_accum=True",
                   config={"fast_accum": True})
    _compile_error(tmp_path, identity, {"a": (a, sa), "b": (b, sb)}, "not a compile knob",
                   config={"block_scales": 1})
    _compile_error(tmp_path, identity, {"a": (a, sa), "b": (b, sb)}, "multiple of 64 columns",
                   config={"schedule": "cooperative", "tile_n": 160})
    with pytest.raises(ConfigError, match="scale float8"):
        GemmConfig(ab_dtype="bfloat16", block_scales=1).validate()


def test_call_refusals_name_the_problem(tmp_path):
    (a, sa), (b, sb) = _pairs(256, 256, 512, 1)
    scaled = evtc.compile(identity, {"a": (a, sa), "b": (b, sb)}, cache_dir=tmp_path)
    with pytest.raises(CallError, match=r"a must be a \(tensor, block scales\) pair"):
        scaled(a, (b, sb))
    with pytest.raises(CallError, match=r"a's block scales have shape \(256, 3\)"):
        scaled((a, sa[:, :3]), (b, sb))
    # The compiled granularity: 128 x 128 blocks of a are not 1 x 128 ones.
    with pytest.raises(CallError, match=r"\(256, 4\) \(1 x 128 blocks"):
        scaled((a, sa[:2]), (b, sb))
    plain = evtc.compile(lambda acc, s: acc * s, {"a": a, "b": b, "s": torch.tensor(2.0)},
                         cache_dir=tmp_path)
    with pytest.raises(CallError, match="compiled without block scales"):
        plain((a, sa), b, s=torch.tensor(2.0))
    # A one-row call on a 1 x 128 kernel: (1, K/128) scales.
    (a1, sa1), _ = _pairs(1, 256, 512, 1, seed=5)
    got = scaled((a1, sa1), (b, sb))
    ref = _product_by_blocks((a1, sa1), (b, sb), 1)
    assert (got.double() - ref).abs().max() <= 1e-2 * ref.abs().max()


def test_reference_names_wrong_scales():
    (a, sa), (b, sb) = _pairs(64, 128, 256, 1)
    with pytest.raises(InputError, match="b's block scales have shape"):
        evtc.reference(identity, {"a": (a, sa), "b": (b, sb.t())})


def test_the_kernel_and_the_ir_agree_on_the_block_size():
    from evtc.ir.block_scales import SCALE_BLOCK as IR_BLOCK
    from evtc.plan.config import SCALE_BLOCK

    assert IR_BLOCK == SCALE_BLOCK == 128


def test_the_granularity_is_part_of_the_kernel(tmp_path):
    rows_1 = _pairs(256, 256, 512, 1)
    rows_128 = _pairs(256, 256, 512, 128)
    k1 = evtc.compile(identity, {"a": rows_1[0], "b": rows_1[1]}, cache_dir=tmp_path)
    k128 = evtc.compile(identity, {"a": rows_128[0], "b": rows_128[1]}, cache_dir=tmp_path)
    assert (k1.config.block_scales, k128.config.block_scales) == (1, 128)
    assert k1.key != k128.key
    assert evtc.compile(identity, {"a": rows_1[0], "b": rows_1[1]}, cache_dir=tmp_path) is k1


def test_a_call_that_needs_gradients_is_refused(tmp_path):
    (a, sa), (b, sb) = _pairs(128, 256, 256, 1, seed=6)
    bias = torch.randn(256)
    kernel = evtc.compile(bias_relu, {"a": (a, sa), "b": (b, sb), "bias": bias}, cache_dir=tmp_path)
    with pytest.raises(CallError, match="no autograd formula"):
        kernel((a, sa), (b, sb), bias=bias.clone().requires_grad_())
    with pytest.raises(CallError, match="no autograd formula"):
        kernel((a, sa.clone().requires_grad_()), (b, sb), bias=bias)
    with torch.no_grad():
        kernel((a, sa), (b, sb), bias=bias.clone().requires_grad_())


def test_the_torch_path_computes_the_dequantized_product_in_float64(tmp_path):
    a, b = _pairs(100, 200, 384, 128, seed=7)
    kernel = evtc.compile(lambda acc: acc.float(), {"a": a, "b": b}, cache_dir=tmp_path)
    got = kernel(a, b)
    ref = _product_by_blocks(a, b, 128)
    assert got.dtype == torch.float32
    assert (got.double() - ref).abs().max() <= 1e-6 * ref.abs().max()


def test_a_one_row_example_compiles_1x128_blocks_and_says_so(tmp_path, caplog):
    a, b = _pairs(1, 256, 256, 1, seed=8)
    with caplog.at_level("WARNING", logger="evtc"):
        kernel = evtc.compile(identity, {"a": a, "b": b}, cache_dir=tmp_path)
    assert kernel.config.block_scales == 1
    assert "a has one row" in caplog.text


def test_the_per_call_check_agrees_with_the_named_one(tmp_path):
    """The call path checks scale shapes without building messages (call_checks.scales_fit); it must
    accept exactly what evtc.ir.block_scales.scale_problem accepts for the compiled granularity."""
    from evtc.ir.block_scales import scale_problem

    for rows in (1, 128):
        (a, sa), (b, sb) = _pairs(130, 200, 300, rows, seed=9)
        kernel = evtc.compile(identity, {"a": (a, sa), "b": (b, sb)}, cache_dir=tmp_path)
        (a3, sa3), (b3, sb3) = _pairs(130, 200, 300, rows, seed=9, batches=2)
        variants = [(a, b, sa, sb), (a, b, sa[:, :2], sb), (a, b, sa, sb[:2]), (a, b, sa.double(), sb),
                    (a, b, sa, sb.half()), (a, b, sa[:1], sb), (a, b, sa.t(), sb), (a, b, sa, sb.t()),
                    (a[:1], b, sa[:1], sb), (a3, b3, sa3, sb3), (a3, b3, sa3[0], sb3), (a3, b3, sa3, sb3[:1])]
        for x, y, sx, sy in variants:
            named = scale_problem(x, y, (sx, sy), rows)[0] is None
            assert scales_fit(kernel.call_spec, x, y, (sx, sy)) == named, (rows, sx.shape, sy.shape, sx.dtype)


def test_wide_tiles_stage_a_scales_and_the_planner_counts_them():
    """1 x 128 scales come with the A/B stage, on tiles with one scratch accumulator and on the
    small ones that promote in pairs; 128 x 128 blocks of A are read from global memory. The shared
    memory planner counts the staged scales: what it plans fits the H100 with the scales' buffer."""
    from evtc.plan.config import A_SCALES_ALIGN_SLACK, SM90_SMEM_BYTES, SMEM_RESERVED_BYTES

    def config(**kw):
        return GemmConfig(ab_dtype="float8_e4m3fn", b_major="k", d_dtype="bfloat16", **kw).validate()

    wide = config(schedule="cooperative", tile_n=192, block_scales=1)
    assert wide.stages_a_scales and not wide.promotes_in_pairs
    # A's 128 rows' scales and B's three 64-column chunks'.
    assert wide.b_scale_chunks == 3
    assert wide.ab_bytes_per_stage() == (128 + 192) * 128 + (128 + 3) * 4
    pairs = config(schedule="cooperative", tile_n=128, block_scales=1)
    assert pairs.promotes_in_pairs and pairs.stages_a_scales
    assert not config(schedule="cooperative", tile_n=192, block_scales=128).stages_a_scales
    assert not config(schedule="cooperative", tile_n=192).stages_a_scales
    plain = config(schedule="cooperative", tile_n=192, block_scales=128)
    for cfg in (wide, wide.replace(epi_stages=2), wide.replace(gated=True), pairs,
                config(schedule="pingpong", tile_m=64, tile_n=64, block_scales=1)):
        ab, d = cfg.plan_stages()
        used = ab * cfg.ab_bytes_per_stage() + d * cfg.d_bytes_per_stage() + A_SCALES_ALIGN_SLACK
        assert used <= SM90_SMEM_BYTES - SMEM_RESERVED_BYTES
    assert wide.plan_stages()[0] <= plain.plan_stages()[0]


def test_staging_copies_a_scales_the_tma_cannot_read():
    """The staged path's copy of a's 1 x 128 scales: M-contiguous, 16-byte strides and base, the
    same values; scales that fit (and b's, any strides) pass as they are."""
    from evtc.runtime.staging import layout_problem, stage_scales

    a, b = _pairs(1001, 256, 640, 1)
    kernel = evtc.compile(identity, {"a": a, "b": b}, arch="sm_90a")
    spec = kernel.plan.a_scales
    assert spec.dims[spec.contiguous] == "M"
    m_major_pitched = torch.zeros(5, 1004)[:, :1001].t()
    unaligned = torch.zeros(5 * 1001 + 1)[1:].view(5, 1001).t()
    # K-major; M-major with a pitch of 1001 (not a 16-byte multiple); M-major off 16 bytes.
    for scales in (a[1].contiguous(), a[1].t().contiguous().t(), unaligned):
        scales.copy_(torch.rand(1001, 5))
        (got, sb), problems = stage_scales(kernel.plan, (scales, b[1]))
        assert problems and layout_problem(got, spec) is None and torch.equal(got, scales) and sb is b[1]
    m_major_pitched.copy_(torch.rand(1001, 5))
    (got, _), problems = stage_scales(kernel.plan, (m_major_pitched, b[1]))
    assert not problems and got is m_major_pitched


@pytest.mark.parametrize("rows", [1, 128], ids=["1x128", "128x128"])
def test_the_fast_path_copies_a_scales_of_odd_m_itself(tmp_path, rows):
    """M-major 1 x 128 scales of an M that is not a multiple of 4 (decode sizes) are copied on the
    fast path, with no rejected launch and slow path (about 150 us a call on the H100's host):
    the launch gets an aligned copy of the same values and the call says "staged"; scales that
    fit (a pitch of a multiple of 4) and 128 x 128 ones (any strides) pass as they are. The
    compiled function is stubbed: this machine has no GPU."""
    from evtc.runtime.staging import layout_problem

    a, b = _pairs(64, 256, 640, rows)
    kernel = evtc.compile(identity, {"a": a, "b": b}, arch="sm_90a", cache_dir=tmp_path)
    kernel._kernel_runs = True  # as on a Hopper GPU
    launched = []
    for m in (7, 8):
        (x, sa), _ = _pairs(m, 256, 640, rows, seed=m)
        if rows == 1:
            sa = sa.t().contiguous().t()  # M-major, pitch M: torch's blockwise layout
        kept = sa.clone()
        kernel._launch_memo[(m, 256, 640, 1, -1)] = (
            lambda a_pair, b_pair, *rest: launched.append(a_pair[1]), 1, None, kernel._finisher)
        kernel((x, sa), b)
        got = launched[-1]
        assert torch.equal(got, sa) and torch.equal(sa, kept)
        if rows == 1 and m == 7:
            assert kernel.last_path == "staged" and got.data_ptr() != sa.data_ptr()
            assert layout_problem(got, kernel.plan.a_scales) is None
        else:
            assert kernel.last_path == "kernel" and got is sa


def test_block_scales_with_torchs_negative_bit_never_reach_the_kernel(tmp_path, monkeypatch):
    """Block scales that are views with torch's negative bit (memory holding their negation) are
    resolved before the launch (the kernel reads memory as it is): the launch is stubbed, so this
    runs the kernel path's Python on CPU tensors."""
    import evtc.runtime.kernel as kernel_module

    e4m3 = torch.float8_e4m3fn
    m = n = k = 256
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(m, k, generator=g) * 2).to(e4m3)
    w = (torch.randn(n, k, generator=g) * 2).to(e4m3)
    sa = (torch.rand(m, 2, generator=g) + 0.5).t().contiguous().t()  # M-major 1 x 128 scales
    sw = torch.rand(2, 2, generator=g) + 0.5  # 128 x 128 scales
    kern = evtc.compile(lambda acc: acc, dict(a=(a, sa), b=(w.t(), sw.t())), cache_dir=tmp_path)
    reached = []

    def stub(fn, a_, b_, outs, ins, clusters, split, device, scales=None, up=None):
        reached.append(tuple(s.is_neg() for s in scales))

    monkeypatch.setattr(kernel_module, "invoke", stub)
    # CPU tensors would take the torch path: the slow path goes on to the (stubbed) kernel instead.
    monkeypatch.setattr(kernel_module.call_checks, "torch_reason", lambda *args, **kwargs: None)
    kern._kernel_runs = True
    kern._launch_memo[(m, n, k, 1, -1)] = (None, 1, None, kern._finisher)
    for pair_a, pair_b in [((a, sa), (w.t(), torch._neg_view(sw.t()))),
                           ((a, torch._neg_view(sa)), (w.t(), sw.t()))]:
        reached.clear()
        kern(pair_a, pair_b)
        assert reached == [(False, False)] and kern.last_path == "staged"
