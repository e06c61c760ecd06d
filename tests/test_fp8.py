"""float8 a and b (issue "FP8 inputs"): what compiles, what is refused and why, and the torch path's
results against float64 (CPU). The kernels' results on the GPU: tests/test_fp8_gpu.py."""

from __future__ import annotations

import re

import pytest
import torch
from float8_edges import FLOAT8_EDGES, float8_edge_operands, float8_roundings

import evtc
from evtc.errors import CompileError, DTypeError
from evtc.plan.config import ConfigError, GemmConfig

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def scaled(acc, sa, sb):
    return acc * sa * sb


def rowwise_gelu(acc, sa, sb, bias):
    return torch.nn.functional.gelu(acc * sa * sb + bias)


def _fp8(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 2).to(dtype)


def _weight_t(n, k, dtype, seed):
    """b = w.t() for an (N, K) weight: K-major, as the 8-bit wgmma reads it."""
    return _fp8((n, k), dtype, seed).t()


@pytest.mark.parametrize(("a_dtype", "b_dtype", "wgmma"), [
    (E4M3, E4M3, "f32.e4m3.e4m3"), (E5M2, E5M2, "f32.e5m2.e5m2"), (E4M3, E5M2, "f32.e4m3.e5m2"),
])
def test_float8_compiles_to_the_8_bit_wgmma_with_k_blocks_of_128(tmp_path, a_dtype, b_dtype, wgmma):
    a, b = _fp8((128, 256), a_dtype, 0), _weight_t(256, 256, b_dtype, 1)
    k = evtc.compile(scaled, {"a": a, "b": b, "sa": torch.tensor(0.5), "sb": torch.tensor(2.0)},
                     cache_dir=tmp_path)
    ops = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k(\d+)\.([\w.]+)", k.ptx))
    assert ops == {("32", wgmma)}
    assert k.config.tile_k == 128 and k.config.tile_shape_mnk[2] == 128
    # The products are not stored in 8 bits unless the epilogue says so.
    assert k.plan.outputs[0].dtype == "bfloat16"


def test_tile_k_is_128_bytes_of_k():
    assert GemmConfig(ab_dtype="float16").tile_k == 64
    assert GemmConfig(ab_dtype="bfloat16").tile_k == 64
    assert GemmConfig(ab_dtype="float8_e4m3fn", b_major="k").tile_k == 128


def test_a_float8_config_must_be_k_major():
    with pytest.raises(ConfigError, match="must both be K-major"):
        GemmConfig(ab_dtype="float8_e4m3fn", b_major="n").validate()
    with pytest.raises(ConfigError, match="only float8 A and B may mix"):
        GemmConfig(ab_dtype="float16", b_dtype="bfloat16").validate()


def test_an_n_major_float8_weight_is_refused_with_the_way_to_lay_it_out(tmp_path):
    a, b = _fp8((128, 256), E4M3, 0), _fp8((256, 512), E4M3, 1)  # b (K, N) row-major
    with pytest.raises(CompileError, match=r"must both be K-major.*b = w\.t\(\)") as err:
        evtc.compile(scaled, {"a": a, "b": b, "sa": torch.tensor(1.0), "sb": torch.tensor(1.0)},
                     cache_dir=tmp_path)
    assert "test_fp8.py" in str(err.value)  # the user's file and line


def test_a_column_major_float8_a_is_refused(tmp_path):
    a = _fp8((256, 128), E4M3, 0).t()  # (M, K) with M unit stride
    with pytest.raises(CompileError, match=r"a \(M, K\) is column-major"):
        evtc.compile(scaled, {"a": a, "b": _weight_t(256, 256, E4M3, 1), "sa": torch.tensor(1.0),
                              "sb": torch.tensor(1.0)}, cache_dir=tmp_path)


def test_float8_and_16_bit_do_not_mix(tmp_path):
    with pytest.raises(DTypeError, match="only float8 a and b may mix"):
        evtc.compile(scaled, {"a": _fp8((128, 256), E4M3, 0), "b": torch.randn(512, 256).half().t(),
                              "sa": torch.tensor(1.0), "sb": torch.tensor(1.0)}, cache_dir=tmp_path)


@pytest.mark.parametrize(("a_dtype", "b_dtype"), [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E5M2)])
def test_the_torch_path_matches_float64(tmp_path, a_dtype, b_dtype):
    m, n, k = 96, 160, 272
    a, b = _fp8((m, k), a_dtype, 2), _weight_t(n, k, b_dtype, 3)
    sa, sb = torch.rand(m, 1) + 0.5, torch.rand(n) + 0.5
    bias = torch.randn(n).to(torch.bfloat16)
    ops = {"sa": sa, "sb": sb, "bias": bias}
    kernel = evtc.compile(rowwise_gelu, {"a": a, "b": b, **ops}, cache_dir=tmp_path)
    got = kernel(a, b, sa=sa, sb=sb, bias=bias)
    ref = torch.nn.functional.gelu(a.double() @ b.double() * sa.double() * sb.double() + bias.double())
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert (got.double() - ref).abs().max() <= 1e-2 * ref.abs().max()


def test_float8_promotes_partial_sums_by_default_and_fast_accum_opts_out(tmp_path):
    a, b = _fp8((128, 256), E4M3, 0), _weight_t(256, 256, E4M3, 1)
    ex = {"a": a, "b": b, "sa": torch.tensor(0.5), "sb": torch.tensor(2.0)}
    promoted = evtc.compile(scaled, ex, cache_dir=tmp_path)
    fast = evtc.compile(scaled, ex, config={"fast_accum": True}, cache_dir=tmp_path)
    assert promoted.config.promotes and not fast.config.promotes
    # The scratch accumulator's registers: tiles of at most 96 accumulator registers per thread,
    # cooperative 128 x 192 by default (128 x 128 tiles are bound by shared-memory bandwidth).
    assert all(c.acc_regs <= 96 for c in promoted._family)
    assert (promoted.config.schedule, promoted.config.tile_n) == ("cooperative", 192)
    assert any(c.acc_regs == 128 for c in fast._family)
    # The promoting mainloop waits for every K tile's wgmma; the fast one keeps one batch in flight.
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", promoted.ptx)
    assert waits and set(waits) == {"0"}
    assert "1" in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", fast.ptx)
    with pytest.raises(ConfigError, match="scratch accumulator"):
        GemmConfig(ab_dtype="float8_e4m3fn", b_major="k", schedule="pingpong", tile_n=128).validate()
    # 16-bit inputs never promote: their wgmma accumulates in float32.
    assert not GemmConfig(ab_dtype="bfloat16").promotes
    # The promoting tile keeps the subtile the user asked for.
    wide = evtc.compile(scaled, ex, config={"epi_tile_n": 64}, cache_dir=tmp_path)
    assert (wide.config.tile_n, wide.config.epi_tile_n) == (192, 64)


def identity(acc):
    return acc


def test_small_promoting_tiles_alternate_two_scratch_accumulators(tmp_path):
    """Tiles of at most PROMOTE_IN_PAIRS_MAX_ACC_REGS accumulator registers per thread issue each K
    tile's wgmma before waiting for the previous one (one batch in flight, as the 16-bit and fast
    mainloops keep), block-scaled ones too; the default 128 x 192 tile and fast-accumulating kernels
    do not."""
    from evtc.plan.config import PROMOTE_IN_PAIRS_MAX_ACC_REGS

    a, b = _fp8((128, 256), E4M3, 0), _weight_t(256, 256, E4M3, 1)
    ex = {"a": a, "b": b, "sa": torch.tensor(0.5), "sb": torch.tensor(2.0)}
    small = evtc.compile(scaled, ex, config={"schedule": "pingpong", "tile_m": 64, "tile_n": 64},
                         cache_dir=tmp_path)
    assert small.config.promotes_in_pairs and small.config.acc_regs <= PROMOTE_IN_PAIRS_MAX_ACC_REGS
    waits = set(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", small.ptx))
    assert waits == {"0", "1"}, waits
    # The selector's family: the small tiles alternate, the default one does not (96 registers a
    # scratch accumulator; a third would not fit beside the epilogue's).
    default = evtc.compile(scaled, ex, cache_dir=tmp_path)
    pairs = {(c.schedule, c.tile_m, c.tile_n) for c in default._family if c.promotes_in_pairs}
    assert ("pingpong", 64, 64) in pairs and ("cooperative", 128, 128) in pairs
    assert not default.config.promotes_in_pairs and default.config.tile_n == 192
    assert not GemmConfig(ab_dtype="float8_e4m3fn", tile_m=64, tile_n=64, fast_accum=True).promotes_in_pairs
    assert GemmConfig(ab_dtype="float8_e4m3fn", tile_m=64, tile_n=64, block_scales=128).promotes_in_pairs
    assert not GemmConfig(ab_dtype="bfloat16", tile_m=64, tile_n=64).promotes_in_pairs


@pytest.mark.parametrize("m,n,k,width", [
    (512, 3584, 18944, 112), (512, 4096, 14336, 128), (256, 8192, 28672, 128), (512, 3584, 3584, 112),
    (256, 4608, 3584, 128),  # 144 ping-pong 128 x 64 tiles spill 12 into a second round: 72 of 128 x 128
])
def test_a_promoting_kernel_counts_tiles_as_the_16_bit_one_does(tmp_path, m, n, k, width):
    """A promoting float8 kernel compiles cooperative 128 x 192; the selector's rules count 128 x 128
    tiles all the same, so one wave of them runs the cooperative tile that fits it (as in 16 bits),
    not ping-pong 128 x 64 in several rounds (0.53-0.66x cuBLAS on the H100 at these shapes; 0.88-0.92x
    after)."""
    ex = {"a": torch.empty(8, 128, dtype=E4M3, device="meta"),
          "b": torch.empty(128, 128, dtype=E4M3, device="meta").t(),
          "sa": torch.empty((), device="meta"), "sb": torch.empty((), device="meta")}
    k8 = evtc.compile(scaled, ex, arch="sm_90a", cache_dir=tmp_path)
    assert (k8.config.schedule, k8.config.tile_n) == ("cooperative", 192)
    config, splits = k8.launch_for(m, n, k)
    assert (config.schedule, config.tile_m, config.tile_n, splits) == ("cooperative", 128, width, 1), \
        config.short_name()
    bf16 = {**ex, "a": ex["a"].to(torch.bfloat16), "b": ex["b"].to(torch.bfloat16)}
    same = evtc.compile(scaled, bf16, arch="sm_90a", cache_dir=tmp_path).launch_for(m, n, k)[0]
    assert (same.schedule, same.tile_n) == (config.schedule, config.tile_n)


@pytest.mark.parametrize("m,n,k,tile_n,cluster", [
    (2048, 4096, 14336, 128, (1, 2)), (8192, 8192, 8192, 128, (1, 2)), (2048, 8192, 28672, 128, (1, 2)),
    (512, 8192, 8192, 128, (2, 1)),  # four rows of tiles: the weight tile shared (2x1)
    (8192, 8192, 28672, 192, (2, 1)),  # long K past PROMOTING_LONG_K_WAVES
    (8192, 57344, 8192, 192, (2, 1)),  # MANY_WAVES
    (2048, 4608, 3584, 192, (2, 1)),  # wave-fitted: three rounds of 128 x 192 against five of 128 x 128
])
def test_promoting_kernels_run_many_tiles_in_128_by_128_tiles_in_pairs(tmp_path, m, n, k, tile_n, cluster):
    """Past the wave-fitted sizes a promoting float8 kernel runs cooperative 128 x 128 tiles, whose
    scratch accumulators take turns, in 1x2 clusters where the problem has many rows of tiles;
    128 x 192 only for very many waves and for long K loops of many waves (evtc.plan.selector,
    PROMOTING_LONG_K_WAVES). A 16-bit kernel keeps its own rules."""
    from evtc.plan.selector import LONG_K, MANY_WAVES, PROMOTING_LONG_K_WAVES

    assert LONG_K <= 28672 and MANY_WAVES * 132 <= 64 * 448 and PROMOTING_LONG_K_WAVES * 132 < 64 * 64
    ex = {"a": torch.empty(8, 128, dtype=E4M3, device="meta"),
          "b": torch.empty(128, 128, dtype=E4M3, device="meta").t(),
          "sa": torch.empty((), device="meta"), "sb": torch.empty((), device="meta")}
    k8 = evtc.compile(scaled, ex, arch="sm_90a", cache_dir=tmp_path)
    config = k8.launch_for(m, n, k)[0]
    got = (config.schedule, config.tile_m, config.tile_n, config.cluster)
    assert got == ("cooperative", 128, tile_n, cluster), config.short_name()
    assert config.promotes_in_pairs == (tile_n == 128)
    bf16 = {**ex, "a": ex["a"].to(torch.bfloat16), "b": ex["b"].to(torch.bfloat16)}
    if (m, n, k) == (2048, 4096, 14336):
        same = evtc.compile(scaled, bf16, arch="sm_90a", cache_dir=tmp_path).launch_for(m, n, k)[0]
        # 16 bits: two rounds of 128 x 256 against four of 128 x 128 (the wave-fitted widths).
        assert (same.schedule, same.tile_n) == ("cooperative", 256)


@pytest.mark.parametrize("m,n,k,tile_n", [
    # (M, N, K, the tile's width) within WAVE_FIT_MAX_WAVES: rounds of 128 x 128 tiles against
    # rounds of 128 x 192 on 132 SMs, the wider counted BLOCK_SCALED_WIDE_SPEED (0.9) as fast
    (512, 6144, 4096, 192),  # 2 rounds of 128 (288) against 1 of 192 (208 / 0.9 = 231)
    (512, 4608, 3584, 192),  # 2 against 1
    (2048, 4608, 3584, 192),  # 5 (720) against 3 (693)
    (1024, 6144, 4096, 128),  # 3 (432) against 2 (462)
    (1024, 4608, 3584, 128),  # 3 against 2
    (1024, 4096, 4096, 128),  # 2 against 2
    (2048, 4096, 4096, 128),  # 4 (576) against 3 (693)
])
def test_block_scaled_tiles_by_their_rounds(tmp_path, m, n, k, tile_n):
    """Within WAVE_FIT_MAX_WAVES, a block-scaled kernel runs 128 x 192 (one scratch accumulator)
    only where its rounds of tiles, counted BLOCK_SCALED_WIDE_SPEED times as fast per column, cost
    less than 128 x 128's in pairs."""
    from evtc.plan.selector import BLOCK_SCALED_WIDE_SPEED, WAVE_FIT_ROUND_COST

    blocks = {"a": (torch.empty(256, 256, dtype=E4M3), torch.empty(256, 2)),
              "b": (torch.empty(256, 256, dtype=E4M3).t(), torch.empty(2, 2).t())}
    kernel = evtc.compile(identity, blocks, out_dtypes=torch.bfloat16, arch="sm_90a", cache_dir=tmp_path)
    config, splits = kernel.launch_for(m, n, k)
    assert (config.schedule, config.tile_m, config.tile_n, splits) == ("cooperative", 128, tile_n, 1)
    assert config.promotes_in_pairs == (tile_n == 128)

    def rounds(width: int) -> int:
        ctas = kernel.slots((1, 1))
        return -(-(-(-m // 128) * -(-n // width)) // ctas)

    # The model restated independently of the selector's code.
    wide_cost = rounds(192) * (192 + WAVE_FIT_ROUND_COST) / BLOCK_SCALED_WIDE_SPEED
    square_cost = rounds(128) * (128 + WAVE_FIT_ROUND_COST)
    assert (tile_n == 192) == (wide_cost < square_cost)


@pytest.mark.parametrize("m,n,k,cluster", [
    (1024, 4096, 4096, (1, 2)),  # two waves; 128 x 192 split K in two before the pairs
    (512, 8192, 8192, (2, 1)),  # four rows of tiles: 2x1
    (256, 28672, 4096, (2, 1)),  # the 16-bit rules split this in two
    (2048, 8192, 8192, (1, 2)),  # past WAVE_FIT_MAX_WAVES
    (1024, 57344, 8192, (1, 2)),
    (8192, 57344, 8192, (1, 2)),  # MANY_WAVES: tensorwise float8 keeps 128 x 192 here
    (8192, 3584, 18944, (1, 2)),  # LONG_K past PROMOTING_LONG_K_WAVES: the same
])
def test_block_scaled_kernels_run_128_by_128_in_pairs_and_never_split(tmp_path, m, n, k, cluster):
    """Block-scaled float8 (evtc.plan.selector, PROMOTING_LONG_K_WAVES's note and choose_launch):
    cooperative 128 x 128 in pairs wherever the wave fit does not pick 128 x 192, at any number of
    waves and K, in 1x2 clusters past four rows of tiles, and no split of K unless pinned (on the
    H100 the unsplit launch was as fast or faster on every row the 16-bit rules split); pinned
    splits still split."""
    from evtc.plan import split_k
    from evtc.plan.selector import LONG_K, MANY_WAVES, PROMOTING_LONG_K_WAVES

    blocks = {"a": (torch.empty(256, 256, dtype=E4M3), torch.empty(256, 2)),
              "b": (torch.empty(256, 256, dtype=E4M3).t(), torch.empty(2, 2).t())}
    kernel = evtc.compile(identity, blocks, out_dtypes=torch.bfloat16, arch="sm_90a", cache_dir=tmp_path)
    config, splits = kernel.launch_for(m, n, k)
    got = (config.schedule, config.tile_m, config.tile_n, config.cluster, splits)
    assert got == ("cooperative", 128, 128, cluster, 1), config.short_name()
    assert config.block_scales and config.promotes_in_pairs
    tiles = -(-m // 128) * -(-n // 128)
    if (m, n, k) == (8192, 57344, 8192):
        assert tiles >= MANY_WAVES * 132
    if (m, n, k) == (8192, 3584, 18944):
        assert k >= LONG_K and tiles > PROMOTING_LONG_K_WAVES * 132
    if (m, n, k) == (256, 28672, 4096):
        # The rules every other kernel follows would split this launch.
        tiles, slots = split_k.cta_tile_grid(m, n, 1, config, config.cluster), kernel.slots(config.cluster)
        most = split_k.choose_splits(k, tiles, slots, config.tile_k)
        rule = split_k.modelled_splits(most, m, n, k, 1, config)
        assert max(rule, split_k.choose_tail_splits(k, tiles, slots, 2, config.tile_k)) > 1
    kernel.pin_splits(3)
    assert kernel.launch_for(m, n, k)[1] == 3
    # A fixed block-scaled tile compiled with split_k=True still chooses its split count.
    fixed = evtc.compile(identity, blocks, out_dtypes=torch.bfloat16, arch="sm_90a", cache_dir=tmp_path,
                         config={"schedule": "cooperative", "tile_n": 192, "split_k": True})
    assert fixed.launch_for(256, 1024, 16384)[1] > 1


def test_the_float8_thin_round_rule_leaves_16_bit_cooperative_families_alone(tmp_path):
    """The thin-last-round rule's cooperative 128 x 128 candidate is for float8 families only: a
    16-bit epilogue compiled cooperative (six float32 outputs) keeps the ping-pong 64 x 256 tile at
    65 x 8704 x 4096, as before the rule (not measured for 16 bits)."""
    def six_float32_outputs(acc, C):
        y = acc + C
        return y.float(), (y * 2).float(), torch.relu(y).float(), (y * y).float(), acc.float(), C.float()

    ex = {"a": torch.empty(8, 128, dtype=torch.bfloat16, device="meta"),
          "b": torch.empty(128, 128, dtype=torch.bfloat16, device="meta").t(),
          "C": torch.empty(8, 128, dtype=torch.bfloat16, device="meta")}
    kernel = evtc.compile(six_float32_outputs, ex, arch="sm_90a", cache_dir=tmp_path)
    assert kernel.config.schedule == "cooperative"
    config = kernel.launch_for(65, 8704, 4096)[0]
    assert (config.schedule, config.tile_m, config.tile_n) == ("pingpong", 64, 256), config.short_name()


@pytest.mark.parametrize("m,n,k,tile_n,cluster", [
    (1024, 4096, 4096, 128, (2, 1)),  # in pairs up to five waves, in 2x1 clusters
    (2048, 4096, 4096, 128, (2, 1)),
    (2048, 8192, 8192, 192, (2, 1)),  # past five waves: 128 x 192
    (8192, 3584, 18944, 192, (2, 1)),
])
def test_128_by_128_a_blocks_keep_the_earlier_launch_rules(tmp_path, m, n, k, tile_n, cluster):
    """Kernels with 128 x 128 blocks of A read both operands' scales from global memory (nothing is
    staged): the rules refitted for 1 x 128 blocks, whose scales come with the stage, do not apply
    to them (128 x 128 in pairs in 2x1 clusters up to WAVE_FIT_MAX_WAVES, 128 x 192 past it)."""
    from evtc.plan.selector import WAVE_FIT_MAX_WAVES

    blocks = {"a": (torch.empty(256, 256, dtype=E4M3), torch.empty(2, 2)),
              "b": (torch.empty(256, 256, dtype=E4M3).t(), torch.empty(2, 2).t())}
    kernel = evtc.compile(identity, blocks, out_dtypes=torch.bfloat16, arch="sm_90a", cache_dir=tmp_path)
    config, splits = kernel.launch_for(m, n, k)
    assert config.block_scales == 128 and not config.stages_a_scales
    got = (config.schedule, config.tile_m, config.tile_n, config.cluster, splits)
    assert got == ("cooperative", 128, tile_n, cluster, 1), config.short_name()
    assert (-(-m // 128) * -(-n // 128) <= WAVE_FIT_MAX_WAVES * 132) == (tile_n == 128)


# ---- float8 outputs round as torch's .to does -------------------------------------------------

def test_float8_outputs_and_casts_round_as_torch_does_on_the_torch_path(tmp_path):
    """e5m2 overflows to infinity and e4m3fn saturates, as torch's .to: D, a second output, a cast
    in the middle of the epilogue and reductions cast to float8."""
    a, b, C = float8_edge_operands(96, 160, 64)
    kernel = evtc.compile(float8_roundings, {"a": a, "b": b, "C": C}, cache_dir=tmp_path)
    got = kernel(a, b, C=C)
    want = float8_roundings(a.float() @ b.float(), C)
    assert kernel.last_path == "torch"
    assert torch.isinf(want[0].float()).any() and not torch.isinf(want[1].float()).any()
    for g, w in zip(got, want, strict=True):
        # Every dtype is torch's (the float32 one too: .float() * 0.5 of an e5m2 value).
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g.float(), w.float())


def test_float8_casts_in_the_ir_round_as_torch_does():
    from evtc.ir.dtypes import round_to

    values = torch.tensor(FLOAT8_EDGES + [-v for v in FLOAT8_EDGES] + [float("nan")])
    for dtype in (E4M3, E5M2):
        got, want = round_to(values, dtype), values.to(dtype).float()
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got[~got.isnan()], want[~want.isnan()]), dtype


def test_fast_accum_is_refused_for_16_bit_inputs(tmp_path):
    """fast_accum changes only the 8-bit wgmma's accumulation: asking for it elsewhere is an error,
    not a knob that silently does nothing."""
    ex = {"a": torch.randn(64, 64).half(), "b": torch.randn(64, 64).half()}
    with pytest.raises(CompileError, match="fast_accum=True is for float8"):
        evtc.compile(lambda acc: acc, ex, config={"fast_accum": True}, cache_dir=tmp_path)
