"""GPU: block-scaled float8 (DeepSeek-V3's 1 x 128 activation and 128 x 128 weight blocks) through the
SM90 kernel, against the dequantized product in float64 and against torch's blockwise
``scaled_mm`` (cuBLASLt) where it takes the inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import evtc

pytestmark = pytest.mark.gpu

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# Edges of every kind: partial M, N and K blocks, N below a block, one row, tiles that start
# mid-grid in N (N = 200: a second 128-column tile in B's second block).
SHAPES = [(128, 128, 128), (300, 384, 1000), (1, 512, 7168), (2048, 1536, 2048), (129, 200, 300),
          (64, 4096, 4096)]


def scaled_out(acc):
    return acc.float()


def bias_gelu_fp8_amax(acc, bias, s_out):
    y = F.gelu(acc + bias)
    return (y * s_out).to(torch.float8_e4m3fn), y.abs().amax()


def _blocks(x: int) -> int:
    return -(-x // 128)


def _inputs(m, n, k, rows, a_dtype=E4M3, b_dtype=E4M3, seed=0, batches=None):
    """Float8 a (M, K) and b = w.t() (K, N) with float32 scales of a wide range (so that a wrong
    block shows), a's M-major as torch's blockwise GEMM takes them."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    lead = (batches,) if batches else ()
    a = torch.randn(*lead, m, k, device="cuda", generator=g).to(a_dtype)
    w = torch.randn(*lead, n, k, device="cuda", generator=g).to(b_dtype)
    a_rows = m if rows == 1 else _blocks(m)
    sa = torch.exp2(torch.randint(-4, 5, (*lead, _blocks(k), a_rows), device="cuda", generator=g).float())
    sa = sa * (1 + torch.rand(sa.shape, device="cuda", generator=g))
    sw = torch.rand(*lead, _blocks(n), _blocks(k), device="cuda", generator=g) * 4 + 0.25
    return (a, sa.transpose(-1, -2)), (w.transpose(-1, -2), sw.transpose(-1, -2))


def _dequantized_product(a_pair, b_pair, rows):
    """a @ b in float64 from the blocks: every element times the scale its block index selects."""
    (a, sa), (b, sb) = a_pair, b_pair
    m, k = a.shape[-2:]
    n = b.shape[-1]
    dev = a.device
    a_rows = torch.arange(m, device=dev) // rows
    ks = torch.arange(k, device=dev) // 128
    b_cols = torch.arange(n, device=dev) // 128
    ad = a.double() * sa.double()[..., a_rows[:, None], ks[None, :]]
    bd = b.double() * sb.double()[..., ks[:, None], b_cols[None, :]]
    return ad @ bd


def _expected_path(kernel, a_pair, n):
    """The path a call takes: staged where a's rows of K bytes are not 16-byte multiples (TMA's
    rule, as without block scales), or where its launch brings a's 1 x 128 scales by TMA
    (GemmConfig.stages_a_scales) and they are not M-contiguous with 16-byte strides; else the
    kernel. ``n``: the output's columns."""
    a, sa = a_pair
    m, k = a.shape[-2:]
    config, _ = kernel.launch_for(m, n, k, a.shape[0] if a.dim() == 3 else 1)
    m_dim = sa.dim() - 2
    # The compiled function checks no stride of a dim of size 1 (K <= 128: one K block).
    scales_fit = (sa.stride(m_dim) == 1 and sa.data_ptr() % 16 == 0
                  and all(st % 4 == 0 for i, st in enumerate(sa.stride()) if i != m_dim and sa.shape[i] > 1))
    return "staged" if k % 16 or (config.stages_a_scales and not scales_fit) else "kernel"


def _rel(got, ref):
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


def _torch_blockwise(a_pair, b_pair):
    """torch's blockwise float8 GEMM (1 x 128 by 128 x 128, cuBLASLt), or None where it refuses."""
    (a, sa), (b, sb) = a_pair, b_pair
    try:
        from torch.nn.functional import ScalingType, scaled_mm
        return scaled_mm(a, b, sa.t().contiguous().t(), ScalingType.BlockWise1x128,
                         sb.t().contiguous().t(), ScalingType.BlockWise128x128, output_dtype=torch.float32)
    except (ImportError, RuntimeError, ValueError, TypeError):
        return None


@pytest.mark.parametrize("rows", [1, 128], ids=["1x128", "128x128"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_block_scales_against_float64(tmp_path, shape, rows):
    m, n, k = shape
    a, b = _inputs(m, n, k, rows)
    kernel = evtc.compile(scaled_out, {"a": a, "b": b}, cache_dir=tmp_path)
    got = kernel(a, b)
    assert kernel.last_path == _expected_path(kernel, a, n) and got.dtype == torch.float32
    ref = _dequantized_product(a, b, rows)
    err = _rel(got, ref)
    assert err < 1e-3, err
    # evtc's own reference agrees (to the float32 rounding of the epilogue's explicit .float()).
    assert _rel(evtc.reference(scaled_out, {"a": a, "b": b}, dtype=torch.float64), ref) < 1e-7
    if rows == 1:
        theirs = _torch_blockwise(a, b)
        if theirs is not None:
            assert err <= 1.5 * _rel(theirs, ref) + 1e-5, (err, _rel(theirs, ref))


def test_block_scales_with_fused_epilogue(tmp_path):
    """fp8 in with block scales -> GELU(acc + bias) -> fp8 out and its amax: one kernel."""
    m, n, k = 1000, 1536, 2048
    a, b = _inputs(m, n, k, 1, seed=3)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = F.gelu(_dequantized_product(a, b, 1) + bias.double())
    s_out = torch.tensor(400.0 / y.abs().max().item(), device="cuda")  # the largest value maps below 448
    kernel = evtc.compile(bias_gelu_fp8_amax, {"a": a, "b": b, "bias": bias, "s_out": s_out},
                          cache_dir=tmp_path)
    q, amax = kernel(a, b, bias=bias, s_out=s_out)
    assert kernel.last_path == "kernel" and q.dtype == E4M3
    assert abs(amax.item() - y.abs().max().item()) <= 2e-3 * y.abs().max().item()
    # Within one e4m3 step (3 mantissa bits) of the float64 result, plus the accumulation's error
    # (1e-3 of the largest value, as in the test above).
    want = y * s_out.double()
    excess = (q.double() - want).abs() - want.abs() * 2 ** -3 - 1e-3 * want.abs().max()
    assert excess.max().item() <= 0, excess.max().item()


CONFIGS = {"split-k": {"split_k": True},
           "pingpong64x128": {"schedule": "pingpong", "tile_m": 64, "tile_n": 128},
           "pingpong128x64": {"schedule": "pingpong", "tile_m": 128, "tile_n": 64},
           "cooperative128x128": {"schedule": "cooperative", "tile_n": 128}}


def _config_case(tmp_path, fn, n, seed, config):
    """``fn`` compiled with ``config`` at 384 x ``n`` x 3008 (split-K pinned to 3 splits): its
    result and the dequantized product in float64."""
    a, b = _inputs(384, n, 3008, 1, seed=seed)
    kernel = evtc.compile(fn, {"a": a, "b": b}, cache_dir=tmp_path, config=config)
    if config.get("split_k"):
        kernel.pin_splits(3)
    got = kernel(a, b)
    assert kernel.last_path == "kernel"
    return got, _dequantized_product(a, b, 1)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_block_scales_configs(tmp_path, name):
    got, product = _config_case(tmp_path, scaled_out, 640, 4, CONFIGS[name])
    assert _rel(got, product) < 1e-3


@pytest.mark.parametrize("config", [
    {"schedule": "pingpong", "tile_m": 64, "tile_n": 64, "cluster": (1, 1)},
    {"schedule": "cooperative", "tile_m": 128, "tile_n": 128, "cluster": (1, 2)},
], ids=lambda c: f"{c['schedule']}{c['tile_m']}x{c['tile_n']}")
@pytest.mark.parametrize("rows", [1, 128], ids=["1x128", "128x128"])
def test_block_scales_in_pairs_scale_every_k_tile_by_its_own_block(tmp_path, config, rows):
    """Small tiles promote in pairs with block scales too (GemmConfig.promotes_in_pairs): each
    scratch accumulator's factors are loaded while its wgmma runs and applied a K tile later. Over
    1 to 9 K tiles (an odd and an even count per unit, ragged K, whole and split), with scales that
    differ by up to 2^8 between K blocks, a factor applied to the wrong K tile's products would be
    off by far more than the accumulation's error."""
    for k, splits in [(128, 1), (256, 1), (384, 1), (1000, 1), (1152, 1), (1152, 2), (2048, 3)]:
        m, n = 300, 272
        a, b = _inputs(m, n, k, rows, seed=k + splits)
        kernel = evtc.compile(scaled_out, {"a": a, "b": b}, cache_dir=tmp_path,
                              config={**config, "split_k": splits > 1})
        assert kernel.config.promotes_in_pairs and kernel.config.block_scales == rows
        if splits > 1:
            kernel.pin_splits(splits)
            assert kernel.launch_for(m, n, k)[1] == splits
        got = kernel(a, b)
        assert kernel.last_path == ("staged" if k % 16 else "kernel")
        err = _rel(got, _dequantized_product(a, b, rows))
        assert err < 1e-3, (k, splits, err)


def test_block_scales_batched_and_mixed_formats(tmp_path):
    a, b = _inputs(200, 256, 640, 128, a_dtype=E4M3, b_dtype=E5M2, seed=5, batches=3)
    kernel = evtc.compile(scaled_out, {"a": a, "b": b}, cache_dir=tmp_path)
    got = kernel(a, b)
    assert kernel.last_path == "kernel" and got.shape == (3, 200, 256)
    assert _rel(got, _dequantized_product(a, b, 128)) < 1e-3


@pytest.mark.parametrize("rows", [1, 128], ids=["1x128", "128x128"])
def test_a_batch_of_one_runs_expanded_with_its_scales(tmp_path, rows):
    """An ``a`` or ``b`` of batch 1 beside a ``C`` of batch 3, on a kernel compiled with equal
    batches: the tensor and its block scales are expanded (batch stride 0) and run on the kernel,
    with torch's result (evtc.runtime.broadcasts)."""
    a3, b3 = _inputs(256, 384, 512, rows, seed=9, batches=3)
    C = torch.randn(3, 256, 384, device="cuda")

    def residual(acc, C):
        return acc + C

    kernel = evtc.compile(residual, {"a": a3, "b": b3, "C": C}, cache_dir=tmp_path)
    for a, b in [((a3[0][:1], a3[1][:1]), b3), (a3, (b3[0][:1], b3[1][:1]))]:
        with torch.no_grad():
            got = kernel(a, b, C=C)
        assert kernel.last_path in ("kernel", "staged") and got.shape == (3, 256, 384)
        whole = [(t.expand(3, *t.shape[1:]), sc.expand(3, *sc.shape[1:])) for t, sc in (a, b)]
        assert _rel(got, _dequantized_product(*whole, rows) + C.double()) < 1e-2  # bf16 output


def test_decode_sizes_copy_a_scales_on_the_fast_path(tmp_path):
    """M of 1, 3 and 7 with a's 1 x 128 scales M-major of pitch M (torch's blockwise layout, which
    cuBLASLt refuses at these M): the call copies the scales itself and runs the kernel
    ("staged"), with the dequantized product; strict=True refuses the copy by name."""
    a, b = _inputs(64, 512, 384, 1, seed=11)
    kernel = evtc.compile(scaled_out, {"a": a, "b": b}, cache_dir=tmp_path)
    strict = evtc.compile(scaled_out, {"a": a, "b": b}, cache_dir=tmp_path, strict=True)
    for m in (1, 3, 7):
        x, sa = _inputs(m, 512, 384, 1, seed=m)[0]
        assert sa.stride() == (1, m)
        kept = sa.clone()
        got = kernel((x, sa), b)
        assert kernel.last_path == "staged" and torch.equal(sa, kept)
        assert _rel(got, _dequantized_product((x, sa), b, 1)) < 1e-3
        with pytest.raises(evtc.CallError, match="a's block scales"):
            strict((x, sa), b)


def test_block_scales_staged_and_strided_scales(tmp_path):
    """An M-major a at the call is staged (a K-major copy); scales of any strides are read as they
    are (a row-major a-scale tensor here, a sliced b-scale one)."""
    m, n, k = 256, 384, 512
    (a, sa), (b, sb) = _inputs(m, n, k, 1, seed=7)
    kernel = evtc.compile(scaled_out, {"a": (a, sa), "b": (b, sb)}, cache_dir=tmp_path)
    a_m_major = a.t().contiguous().t()
    sa_rows = sa.contiguous()
    wide = torch.rand(sb.shape[0], 2 * sb.shape[1], device="cuda") + 0.5
    sb_sliced = wide[:, ::2]
    got = kernel((a_m_major, sa_rows), (b, sb_sliced))
    assert kernel.last_path == "staged"
    assert _rel(got, _dequantized_product((a, sa_rows), (b, sb_sliced), 1)) < 1e-3


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_wide_tiles_bring_a_scales_with_the_stage(tmp_path, gated):
    """Cooperative 128 x 192 tiles (one scratch accumulator) bring a's 1 x 128 scales into shared
    memory by TMA with each A/B stage (GemmConfig.stages_a_scales). M-major scales with 16-byte
    strides go to the kernel as they are; K-major ones, M-major ones whose pitch is not a 16-byte
    multiple, and unaligned ones run on an aligned copy (the caller's tensor untouched), all with
    the right result: ragged M (rows past M read as zeros), a split K, batches."""
    fn = swiglu_scaled if gated else scaled_out
    width = 2 if gated else 1
    config = {"schedule": "cooperative", "tile_n": 192, "cluster": (2, 1), "split_k": True}
    a, b = _inputs(512, width * 384, 1024, 1, seed=21)
    kernel = evtc.compile(fn, {"a": a, "b": b}, cache_dir=tmp_path, config=config)
    assert kernel.config.stages_a_scales and not kernel.config.promotes_in_pairs
    finish = _swiglu if gated else (lambda x: x)
    for m, n, k, splits in [(1000, 384, 1040, 1), (640, 576, 2048, 1), (333, 384, 1536, 3)]:
        kernel.pin_splits(splits)
        (x, sa), bb = _inputs(m, width * n, k, 1, seed=m + k)
        ref = finish(_dequantized_product((x, sa), bb, 1))
        pitch = -(-m // 4) * 4 + 4  # M-major in a buffer of a wider pitch: 16-byte strides, M kept
        padded = torch.full((sa.shape[1], pitch), float("nan"), device="cuda")
        padded[:, :m] = sa.t()
        unaligned = torch.empty(sa.numel() + 1, device="cuda")[1:].view(sa.shape[1], m)
        unaligned.copy_(sa.t())
        layouts = {"m-major": sa, "m-major pitched": padded[:, :m].t(), "k-major": sa.contiguous(),
                   "unaligned": unaligned.t()}
        for name, scales in layouts.items():
            before = scales.clone()
            got = kernel((x, scales), bb)
            assert torch.equal(scales.nan_to_num(7.0), before.nan_to_num(7.0)), name
            assert kernel.last_path == _expected_path(kernel, (x, scales), n), (m, name)
            want = "kernel" if name in ("m-major pitched",) or (name == "m-major" and m % 4 == 0) \
                else "staged"
            assert kernel.last_path == want, (m, name, kernel.last_path)
            err = _rel(got, ref)
            assert err < 1e-3, (m, n, k, splits, name, err)
    a3, b3 = _inputs(300, width * 384, 640, 1, seed=22, batches=3)
    batched = evtc.compile(fn, {"a": a3, "b": b3}, cache_dir=tmp_path, config=config)
    got = batched(a3, b3)
    assert batched.last_path == "kernel" and got.shape == (3, 300, 384)
    assert _rel(got, finish(_dequantized_product(a3, b3, 1))) < 1e-3


def test_block_scales_under_torch_compile(tmp_path):
    m, n, k = 256, 256, 1024
    a, b = _inputs(m, n, k, 1, seed=8)
    kernel = evtc.compile(scaled_out, {"a": a, "b": b}, cache_dir=tmp_path)

    def step(x, sx, w, sw):
        return kernel((x, sx), (w, sw)) * 2

    got = torch.compile(step, fullgraph=True)(a[0], a[1], b[0], b[1])
    assert _rel(got, 2 * _dequantized_product(a, b, 1)) < 1e-3


def swiglu_scaled(acc):
    gate, up = acc.chunk(2, dim=-1)
    return (F.silu(gate) * up).float()


def swiglu_bias_fp8_amax(acc, bias, s_out):
    gate, up = (acc + bias).chunk(2, dim=-1)
    y = F.silu(gate) * up
    return (y * s_out).to(torch.float8_e4m3fn), y.abs().amax()


def _swiglu(whole):
    gate, up = whole.chunk(2, dim=-1)
    return F.silu(gate) * up


# Gated: N is the weight's rows (both halves). Halves of 1024 columns (the up half starts on a
# block), 288 (it starts 32 columns into a block: its first chunk reads a block the gate half
# shares), 96 (under one block: both halves' scales in B's first block), ragged M and K, one row.
GATED_SHAPES = [(256, 2 * 1024, 1024), (300, 2 * 288, 1000), (129, 2 * 96, 300), (1, 2 * 512, 7168),
                (2048, 2 * 1536, 2048)]


@pytest.mark.parametrize("rows", [1, 128], ids=["1x128", "128x128"])
@pytest.mark.parametrize("shape", GATED_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gated_block_scales_against_float64(tmp_path, shape, rows):
    m, n, k = shape
    a, b = _inputs(m, n, k, rows, seed=11)
    kernel = evtc.compile(swiglu_scaled, {"a": a, "b": b}, cache_dir=tmp_path)
    # A one-row example compiles 1 x 128 blocks (a row each: the same scales), and says so.
    assert kernel.config.gated and kernel.config.block_scales == (1 if m == 1 else rows)
    got = kernel(a, b)
    assert kernel.last_path == _expected_path(kernel, a, n // 2) and got.shape == (m, n // 2)
    ref = _swiglu(_dequantized_product(a, b, rows))
    assert _rel(got, ref) < 1e-3, _rel(got, ref)


@pytest.mark.parametrize("name", ["split-k", "cooperative128x128", "pingpong64x128"])
def test_gated_block_scales_configs(tmp_path, name):
    got, product = _config_case(tmp_path, swiglu_scaled, 2 * 320, 12, CONFIGS[name])
    assert _rel(got, _swiglu(product)) < 1e-3


def test_gated_block_scales_fused_layer_and_batches(tmp_path):
    """DeepSeek-V3's expert gate/up: block-scaled float8 in -> SwiGLU(acc + bias) -> float8 out and
    its amax, one kernel; then batched experts with mixed formats."""
    m, n, k = 1000, 2 * 768, 2048
    a, b = _inputs(m, n, k, 1, seed=13)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = _swiglu(_dequantized_product(a, b, 1) + bias.double())
    s_out = torch.tensor(400.0 / y.abs().max().item(), device="cuda")
    kernel = evtc.compile(swiglu_bias_fp8_amax, {"a": a, "b": b, "bias": bias, "s_out": s_out},
                          cache_dir=tmp_path)
    q, amax = kernel(a, b, bias=bias, s_out=s_out)
    assert kernel.last_path == "kernel" and q.dtype == E4M3 and q.shape == (m, n // 2)
    assert abs(amax.item() - y.abs().max().item()) <= 2e-3 * y.abs().max().item()
    want = y * s_out.double()
    excess = (q.double() - want).abs() - want.abs() * 2 ** -3 - 1e-3 * want.abs().max()
    assert excess.max().item() <= 0, excess.max().item()

    a3, b3 = _inputs(200, 2 * 320, 640, 128, a_dtype=E4M3, b_dtype=E5M2, seed=14, batches=3)
    batched = evtc.compile(swiglu_scaled, {"a": a3, "b": b3}, cache_dir=tmp_path)
    got = batched(a3, b3)
    assert batched.last_path == "kernel" and got.shape == (3, 200, 320)
    assert _rel(got, _swiglu(_dequantized_product(a3, b3, 128))) < 1e-3


def test_gated_block_scales_halves_off_the_chunk_take_torch(tmp_path):
    """Halves of 100 columns (not a multiple of the 32-column chunk the kernel reads B's scales
    by): the torch path, with the same result; strict=True refuses it by name."""
    a, b = _inputs(256, 2 * 128, 512, 1, seed=15)
    kernel = evtc.compile(swiglu_scaled, {"a": a, "b": b}, cache_dir=tmp_path)
    a2, b2 = _inputs(256, 2 * 100, 512, 1, seed=16)
    got = kernel(a2, b2)
    assert kernel.last_path == "torch"
    assert _rel(got, _swiglu(_dequantized_product(a2, b2, 1))) < 1e-5
    strict = evtc.compile(swiglu_scaled, {"a": a, "b": b}, cache_dir=tmp_path, strict=True)
    with pytest.raises(evtc.CallError, match="multiple of 32"):
        strict(a2, b2)
