"""The shared-memory planner (evtc.plan.smem) against the kernel's device classes: for every
catalogue epilogue and a spread of configurations, the epilogue buffers the planner counts before
anything is built are the bytes the visitor allocates, and both agree on which tile input D may
share. The planner is plain Python: it must not import the CuTe DSL or sympy."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from compile_catalogue import CATALOGUE, make_inputs

from evtc.plan.config import ConfigError, GemmConfig
from evtc.plan.smem import d_buffer_input, epilogue_smem_bytes

CONFIGS = [
    {"schedule": "pingpong", "tile_m": 128, "tile_n": 128, "epi_tile_n": 32},
    {"schedule": "pingpong", "tile_m": 64, "tile_n": 256, "epi_tile_n": 16},
    {"schedule": "cooperative", "tile_n": 256, "epi_tile_n": 32},
    {"schedule": "cooperative", "tile_n": 192, "epi_tile_n": 64},
]


def _emitted(entry):
    """The emitted epilogue and signature, as evtc.compile makes them."""
    from evtc.api import trace
    from evtc.codegen.emit import emit
    from evtc.ir.passes.gated import kernel_graph
    from evtc.plan.signature import KernelSignature

    inputs = make_inputs(entry, 256, 512, 128, 2 if entry.batched else None, torch.float16, "meta")
    graph = kernel_graph(trace(entry.fn, inputs, out_dtypes=entry.out_dtypes))
    emitted = emit(graph)
    signature = KernelSignature(graph, emitted, inputs)
    if signature.tile_majors:
        emitted = emit(graph, tile_majors=signature.tile_majors)
    return graph, emitted, signature


@pytest.mark.parametrize("entry", CATALOGUE, ids=lambda e: e.name)
def test_planner_counts_what_the_visitor_allocates(entry):
    from evtc.codegen.emit import finish_constructors, operand_constructors
    from evtc.sm90.fused import d_buffer_input as visitor_d_buffer_input
    from evtc.sm90.operands import construct

    graph, emitted, signature = _emitted(entry)
    texts = operand_constructors(emitted, signature.tile_majors, signature.batched)
    inputs, outputs, reductions = (construct(t) for t in texts)
    reductions += construct(finish_constructors(emitted))  # a kernel's own finish has its flags
    d_dtype = str(emitted.outputs[0].dtype).removeprefix("torch.") if emitted.outputs else "float16"
    checked = 0
    for knobs in CONFIGS:
        for d_major in ("n", "m"):
            try:
                cfg = GemmConfig(ab_dtype="float16", d_dtype=d_dtype, d_major=d_major, gated=graph.gated,
                                 **knobs).validate()
            except ConfigError:
                continue
            for load_stages in (1, 2, 4):
                for stores in (2, 4):
                    device = sum(o.smem_bytes(cfg.tile_shape_mnk[:2], cfg.epi_tile, load_stages, stores)
                                 for o in inputs + outputs[1:] + reductions)
                    planned = epilogue_smem_bytes(emitted, cfg, load_stages, stores)
                    assert planned == device, (knobs, load_stages)
            described = [(p.kind, str(p.dtype).removeprefix("torch."), signature.tile_majors.get(p.name, "n"))
                         for p in emitted.inputs]
            assert (d_buffer_input(described, len(emitted.outputs) > 1, cfg)
                    == visitor_d_buffer_input(inputs, outputs[1:], cfg))
            checked += 1
    assert checked >= 4


def test_footprints_by_hand():
    """Bytes worked out by hand: a float16 C tile, a float32 bias (N,) and a bfloat16 per-row scale
    (M, 1), an extra float32 output and a column sum, in 128 x 32 subtiles of 128 x 128 tiles."""
    from evtc.plan.smem import input_smem_bytes, reduction_smem_bytes, store_smem_bytes

    epi = (128, 32)
    assert input_smem_bytes("tile", "float16", epi, 4) == 128 * 32 * 2 * 4
    # 32 float32 values are 128 B: stages need no rounding; plus 128 B of alignment slack.
    assert input_smem_bytes("row", "float32", epi, 4) == 32 * 4 * 4 + 128
    # A column of 128 bfloat16 values: 256 B per stage.
    assert input_smem_bytes("col", "bfloat16", epi, 3) == 128 * 2 * 3 + 128
    # A 16-wide float16 row slice is 32 B: each stage is rounded up to 128 B.
    assert input_smem_bytes("row", "float16", (64, 16), 2) == 128 * 2 + 128
    assert input_smem_bytes("scalar", "float32", epi, 4) == 0
    assert store_smem_bytes("float32", epi, 2) == 128 * 32 * 4 * 2
    assert reduction_smem_bytes("ReductionOverM", 128) == 129 * 8 * 4 + 128
    assert reduction_smem_bytes("ReductionOverN", 128) == 0


def test_the_planner_loads_neither_the_dsl_nor_sympy():
    code = ("import sys; import evtc.plan.smem, evtc.plan.selector, evtc.plan.split_k; "
            "print('cutlass' in sys.modules, 'sympy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def _float32_residual(acc, C):
    return (acc + C).float()


@pytest.mark.parametrize("ab", [torch.float32, torch.bfloat16], ids=["tf32", "bf16"])
def test_starved_pipelines_take_narrow_subtiles(tmp_path, ab):
    """A float32 C and D in ping-pong 128 x 128 tiles: 32-column subtiles at 2 load stages leave 3 A/B
    stages, 16-column ones 5 (1.15-1.40x faster on the H100), so the planner takes those; a pinned
    epi_tile_n is kept, starved or not."""
    import evtc

    ex = {"a": torch.empty(256, 512, dtype=ab, device="meta"),
          "b": torch.empty(384, 512, dtype=ab, device="meta").t(),
          "C": torch.empty(256, 384, device="meta")}
    tile = {"schedule": "pingpong", "tile_m": 128, "tile_n": 128, "cluster": (1, 2)}
    chosen = evtc.compile(_float32_residual, ex, cache_dir=tmp_path, config=tile)
    assert chosen.config.epi_tile_n == 16 and chosen.stages["ab"] == 5, (chosen.config, chosen.stages)
    pinned = evtc.compile(_float32_residual, ex, cache_dir=tmp_path, config={**tile, "epi_tile_n": 32})
    assert pinned.config.epi_tile_n == 32 and pinned.stages["ab"] == 3, (pinned.config, pinned.stages)


def test_a_shallow_pipeline_is_logged(tmp_path, caplog):
    """A plan that leaves fewer A/B stages than overlap_ab_stages runs, and says so in the log with
    what might run it faster; one that keeps them says nothing of the kind."""
    import logging

    import evtc

    ex = {"a": torch.empty(256, 512, dtype=torch.bfloat16, device="meta"),
          "b": torch.empty(384, 512, dtype=torch.bfloat16, device="meta").t(),
          "C": torch.empty(256, 384, device="meta")}
    tile = {"schedule": "pingpong", "tile_m": 128, "tile_n": 128, "cluster": (1, 2)}
    with caplog.at_level(logging.INFO, logger="evtc"):
        shallow = evtc.compile(_float32_residual, ex, cache_dir=tmp_path, config={**tile, "epi_tile_n": 32})
    assert shallow.stages["ab"] < shallow.config.overlap_ab_stages()
    noted = [r.getMessage() for r in caplog.records if "A/B stages, fewer than" in r.getMessage()]
    assert len(noted) == 1 and f"leaves the mainloop {shallow.stages['ab']} A/B stages" in noted[0]
    assert "epi_tile_n" in noted[0]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="evtc"):
        evtc.compile(_float32_residual, ex, cache_dir=tmp_path, config=tile)  # narrow subtiles: 5 stages
    assert not [r for r in caplog.records if "A/B stages, fewer than" in r.getMessage()]


def _gated_float32_tiles(acc, x0, x1, x2):
    gate, up = (acc * torch.tanh(x0) + x1).chunk(2, dim=-1)
    return gate + gate, (x2 + gate).amin(-2), (up + gate).sum((-2, -1))


def test_loads_too_deep_to_fit_fall_back_to_two_stages(tmp_path):
    """Four float32 tile loads (two operands, each in gate and up halves), a float32 D and reductions
    per column and per batch: their default staging does not fit in shared memory at all, which once
    made the planner give up on the shallower staging that does (the fuzzer, seed 2027 case 30)."""
    import evtc

    f16 = torch.float16
    ex = {"a": torch.empty(2, 96, 64, dtype=f16), "b": torch.empty(2, 128, 64, dtype=f16).transpose(-1, -2),
          "x0": torch.empty(96, 128), "x1": torch.empty(2, 96, 128), "x2": torch.empty(2, 1, 1)}
    k = evtc.compile(_gated_float32_tiles, ex, cache_dir=tmp_path, out_dtypes={"D0": torch.float32})
    assert k.config.gated and k.config.c_stages >= 2 and k.stages["ab"] >= 2, (k.config, k.stages)


def _float32_tiles_in_and_out(count: int):
    """An epilogue of ``count`` float32 tile operands and as many float32 outputs (tracing reads the
    operands' names from the signature, so the source is written out)."""
    names = [f"C{i}" for i in range(count)]
    source = (f"def tiles_in_and_out(acc, {', '.join(names)}):\n    y = acc + C0\n"
              f"    return {', '.join(f'y * {n}' for n in names)}\n")
    scope: dict = {}
    exec(source, scope)
    return scope["tiles_in_and_out"]


def test_many_float32_tiles_compile_single_buffered(tmp_path):
    """Eight float32 tiles in and out leave no A/B stage with two buffers each, in any schedule or
    subtile: the planner falls back to one buffer per tile (cooperative, 128 x 16 subtiles), and
    says what to do where even that does not fit. A pinned tile is the user's: no fallback."""
    import evtc

    def example(count: int) -> dict:
        ex = {"a": torch.empty(256, 128, dtype=torch.bfloat16, device="meta"),
              "b": torch.empty(128, 512, dtype=torch.bfloat16, device="meta")}
        ex.update({f"C{i}": torch.empty(256, 512, device="meta") for i in range(count)})
        return ex

    k = evtc.compile(_float32_tiles_in_and_out(8), example(8), cache_dir=tmp_path)
    assert (k.config.schedule, k.config.epi_tile_n, k.config.c_stages, k.config.epi_stages) == \
        ("cooperative", 16, 1, 1), k.config
    assert k.stages["ab"] >= 2
    with pytest.raises(evtc.CompileError, match="single-buffered: compute some of the outputs"):
        evtc.compile(_float32_tiles_in_and_out(12), example(12), cache_dir=tmp_path)
    with pytest.raises(evtc.CompileError, match="A/B pipeline stage") as pinned:
        evtc.compile(_float32_tiles_in_and_out(8), example(8), cache_dir=tmp_path,
                     config={"schedule": "cooperative"})
    assert "single-buffered" not in str(pinned.value)


def test_a_pinned_cluster_alone_leaves_the_tile_to_the_planner(tmp_path):
    """config={"cluster": ...} fixes the cluster, not the tile: a promoting float8 kernel still
    gets its cooperative 128 x 192 tile (the default 128 x 128 ping-pong one cannot promote), in the
    pinned cluster."""
    import evtc

    e4 = torch.float8_e4m3fn
    ex = {"a": torch.empty(256, 512, dtype=e4, device="meta"),
          "b": torch.empty(384, 512, dtype=e4, device="meta").t(),
          "sa": torch.empty((), device="meta"), "sb": torch.empty((), device="meta")}

    def scaled(acc, sa, sb):
        return acc * sa * sb

    for cluster in ((1, 2), (2, 1)):
        k = evtc.compile(scaled, ex, config={"cluster": cluster}, cache_dir=tmp_path)
        assert (k.config.schedule, k.config.tile_n, k.config.cluster) == ("cooperative", 192, cluster)


@pytest.mark.parametrize("knobs, message", [
    ({"swizzle": 0}, "swizzle must be in"),
    ({"cluster": (2, 2)}, "cluster must be one of"),
    ({"fast_accum": True}, "fast_accum=True is for float8"),
])
def test_a_wrong_knob_is_named_not_taken_for_shared_memory(tmp_path, knobs, message):
    """A knob that no configuration accepts is reported as itself: the fallbacks that try other
    tiles and staging exist for shared memory, and their hint ("too many even single-buffered")
    would point the wrong way."""
    import evtc

    a, b = torch.randn(64, 32).half(), torch.randn(32, 64).half()
    with pytest.raises(evtc.CompileError, match=message) as info:
        evtc.compile(lambda acc: acc * 2, dict(a=a, b=b), config=knobs, cache_dir=tmp_path)
    assert "single-buffered" not in str(info.value) and "also tried" not in str(info.value)
