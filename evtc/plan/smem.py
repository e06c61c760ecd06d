"""The one shared-memory planner and configuration search of a fused kernel (plain Python).

The kernel (:mod:`evtc.sm90.gemm`) sizes its pipelines from :meth:`GemmConfig.plan_stages`, given the
visitor's buffers; here the same arithmetic chooses, before anything is built, how deep the
epilogue's loads are staged and which subtile and schedule make the epilogue's buffers fit. What
each epilogue operand takes in shared memory is defined here too, and the device classes of
:mod:`evtc.sm90.operands` allocate by the same functions, so the plan and the kernel cannot
disagree.
"""

from __future__ import annotations

import logging
from typing import Any

from evtc.plan.config import DTYPE_BYTES, FLOAT8_DTYPES, ConfigError, GemmConfig
from evtc.plan.operand_kinds import KINDS

log = logging.getLogger("evtc")

# TMA writes a shared-memory destination at a 128-byte boundary: each stage of a vector's buffer is
# rounded up to it, and each vector or reduction buffer allows that much alignment slack.
VECTOR_ALIGN = 128
# Rows of a column reduction's shared buffer: one per consumer warp (4 warps x 2 ping-pong
# warpgroups, or the 8 warps of a cooperative tile).
COLUMN_REDUCTION_WARP_ROWS = 8


def vector_stage_elems(elems: int, dtype: str) -> int:
    """Elements from one stage of a vector buffer to the next: ``elems`` rounded up so that every
    stage starts on a 128 B boundary (an f16 row slice of a 128x32 subtile is only 64 B)."""
    per_line = VECTOR_ALIGN // DTYPE_BYTES[dtype]
    return -(-elems // per_line) * per_line


def input_load_bytes(kind: str, dtype: str, epi_tile: tuple[int, int]) -> int:
    """Bytes one staged load of an input of ``kind`` brings (one subtile; 0 if it is not loaded)."""
    return KINDS[kind].load_elems(epi_tile) * DTYPE_BYTES[dtype]


def input_smem_bytes(kind: str, dtype: str, epi_tile: tuple[int, int], load_stages: int) -> int:
    """Shared memory of an input's staged buffers: whole swizzled subtiles for a tile; for a vector,
    stages rounded up to 128 B plus the alignment slack; nothing for scalars."""
    entry = KINDS[kind]
    if not entry.staged_load:
        return 0
    elems = entry.load_elems(epi_tile)
    if len(entry.varying) == 2:
        return elems * DTYPE_BYTES[dtype] * load_stages
    return vector_stage_elems(elems, dtype) * DTYPE_BYTES[dtype] * load_stages + VECTOR_ALIGN


def store_smem_bytes(dtype: str, epi_tile: tuple[int, int], store_stages: int) -> int:
    """Shared memory of an extra full-tile output: one subtile per store stage."""
    return epi_tile[0] * epi_tile[1] * DTYPE_BYTES[dtype] * store_stages


def column_reduction_columns(tile_n: int) -> int:
    """Columns of a column reduction's shared buffer: the tile's, and one where padding slots write
    (never read)."""
    return tile_n + 1


def reduction_smem_bytes(operand: str, tile_n: int) -> int:
    """Shared memory of a reduction (``operand``: its device class): a float32 row of the tile's
    columns per consumer warp for a reduction over M; row reductions stay in registers."""
    if operand != "ReductionOverM":
        return 0
    return column_reduction_columns(tile_n) * COLUMN_REDUCTION_WARP_ROWS * 4 + VECTOR_ALIGN


#: The flags by which a kernel that finishes its reductions tells each epilogue's threads whether
#: their tile completed a block of rows or columns (one int32 per concurrent epilogue), 16 B aligned.
FINISH_FLAGS = 2
FINISH_SMEM_BYTES = FINISH_FLAGS * 4 + 16
#: Axes whose finish has a second level (per batch, over everything): one more flag per epilogue,
#: and a float32 per consumer warp and reduction to combine a block's rows across the warps.
TWO_LEVEL_FINISH_AXES = ("batch", "all")


def finish_smem_bytes(axis: str, reductions: int) -> int:
    """Shared memory of one kernel finish (:class:`evtc.sm90.operands.KernelFinish`) of ``axis``
    over ``reductions`` reductions."""
    if axis not in TWO_LEVEL_FINISH_AXES:
        return FINISH_SMEM_BYTES
    return 2 * FINISH_FLAGS * 4 + 16 + COLUMN_REDUCTION_WARP_ROWS * reductions * 4 + VECTOR_ALIGN


def d_buffer_input(inputs: list[tuple[str, str, str]], has_aux_outputs: bool,
                   config: GemmConfig) -> int | None:
    """Index of the input whose staged tile buffers D may share (see
    :meth:`GemmConfig.shares_d_with_load`), each input given as (kind, dtype name, major): the
    first tile with D's dtype and major, and only without extra outputs (their stores pace the D
    stores through one ring)."""
    if has_aux_outputs:
        return None
    for i, (kind, dtype, major) in enumerate(inputs):
        if kind == "tile" and dtype == config.d_dtype and major == config.d_major:
            return i
    return None


def epilogue_smem_bytes(emitted, config: GemmConfig, load_buffers: int, store_stages: int) -> int:
    """Shared memory of the epilogue's own buffers (inputs' load stages, extra outputs' store
    stages, column reductions), as the visitor allocates them."""
    total = sum(input_smem_bytes(p.kind, _dtype_name(p.dtype), config.epi_tile, load_buffers)
                for p in emitted.inputs if not KINDS[p.kind].runtime_scalar)
    total += sum(store_smem_bytes(_dtype_name(o.dtype), config.epi_tile, store_stages)
                 for o in emitted.outputs[1:])
    total += sum(reduction_smem_bytes(r.operand, config.tile_n) for r in emitted.reductions)
    total += sum(finish_smem_bytes(f.axis, len(f.reductions)) for f in emitted.finishes)
    return total


def _dtype_name(dtype) -> str:
    """The kernel's dtype name ("float16") of an IR dtype (a torch dtype or its name)."""
    return str(dtype).removeprefix("torch.")


# Where an epilogue's loads at 2 stages leave fewer A/B stages than this, 128 x 16 subtiles are taken
# if they leave more. A float32 C and D in ping-pong 128 x 128 tiles leave 3 (two warpgroups' rings
# of 16 KiB subtiles); 128 x 16 subtiles leave 5, and ran 1.15-1.40x faster on the H100 at four
# shapes with K = 3584 to 14336, float32 and bf16 A and B alike (docs/performance.md, "float32
# epilogue tiles").
STARVED_AB_STAGES = 4


# The last resort of an epilogue with many tile operands and outputs (float32 ones take twice the
# bytes): one buffer per input, output and D, 128 x 16 subtiles, the cooperative schedule. Each
# subtile's load then waits for the previous one to be read, and each store for the previous one to
# drain, so it is slower than a plan with deeper staging, but it compiles what fits in no other.
SINGLE_BUFFERED = ({"schedule": "cooperative", "tile_n": 128, "epi_tile_n": 16, "load_stages": 1,
                    "epi_stages": 1},
                   {"schedule": "cooperative", "tile_n": 64, "epi_tile_n": 16, "load_stages": 1,
                    "epi_stages": 1})
# Knobs whose presence means the user chose the epilogue's staging or the tile: no last resort then.
_STAGING_KNOBS = ("schedule", "tile_m", "tile_n", "epi_tile_n", "load_stages", "ab_stages")


def fit_config(knobs: dict[str, Any], emitted, signature, *, chosen_by_evtc: frozenset[str] = frozenset()):
    """The configuration of ``knobs``, its epilogue loads planned, checked to fit in shared memory.

    Where the epilogue's buffers (many or wide outputs) leave too few A/B stages, and the user did not
    choose them, narrower 128 x 16 subtiles are tried, then the cooperative schedule (one epilogue's
    buffers instead of the ping-pong schedule's two), then single-buffered staging
    (:data:`SINGLE_BUFFERED`). Otherwise the first error says what to shrink. ``chosen_by_evtc``:
    knobs in ``knobs`` that evtc set, not the user (the last resort may change them).
    """
    attempts: list[dict[str, Any]] = [{}]
    if "epi_tile_n" not in knobs:
        attempts.append({"epi_tile_n": 16})
    # A pinned cluster alone leaves the tile to evtc (the float8 tiles below run in any cluster).
    if "schedule" not in knobs and "tile_n" not in knobs:
        attempts.append({"schedule": "cooperative", **attempts[-1]})
        if knobs.get("ab_dtype") in FLOAT8_DTYPES and not knobs.get("fast_accum"):
            # Promoting float8 partial sums keeps two accumulators (at most PROMOTING_ACC_REGS each):
            # cooperative 128 x 192 tiles, or 128 x 128 where those do not fit.
            subtiles = ({},) if "epi_tile_n" in knobs else ({}, {"epi_tile_n": 16})
            attempts += [{"schedule": "cooperative", "tile_n": n, **sub}
                         for n in (192, 128) for sub in subtiles]
    if (not any(k in knobs for k in _STAGING_KNOBS)
            and ("epi_stages" not in knobs or "epi_stages" in chosen_by_evtc)):
        attempts += SINGLE_BUFFERED
    first_error = None
    any_valid = False  # whether some attempt's knobs were valid (and only shared memory failed)
    for extra in attempts:
        try:
            cfg = GemmConfig(**{**knobs, **extra}).validate()
            any_valid = True
            cfg = _plan_epilogue_loads(cfg, emitted, signature, {**knobs, **extra})
            _ab_stages(emitted, signature, cfg, cfg.c_stages)  # raises where it does not fit
        except ConfigError as exc:
            first_error = first_error or exc
            continue
        if extra:
            why = ("a promoting float8 mainloop keeps two accumulators, too many registers for the "
                   "default tiles" if cfg.promotes and "tile_n" in extra and "load_stages" not in extra
                   else "the epilogue's buffers fit only single-buffered, which is slower"
                   if "load_stages" in extra else
                   "the epilogue's buffers do not fit with the default tiles")
            log.info("%r: %s; using %s", emitted.class_name, why, extra)
        return cfg
    assert first_error is not None
    if not any_valid:
        raise first_error  # the knobs themselves (swizzle=0, a cluster shape): not shared memory
    if len(attempts) > 1:
        tried = ", ".join(_describe_attempt(a) for a in attempts[1:])
        hint = ""
        if attempts[-1] is SINGLE_BUFFERED[-1]:
            tiles = sum(1 for p in emitted.inputs
                        if KINDS[p.kind].staged_load and len(KINDS[p.kind].varying) == 2)
            hint = (f"; the epilogue loads {tiles} tile operand(s) and stores {len(emitted.outputs)} "
                    "full-tile output(s), too many even single-buffered: compute some of the outputs "
                    "in a second kernel, or pass 16-bit tile operands (float32 ones, and the float32 "
                    "outputs they promote to, take twice the shared memory)")
        raise ConfigError(f"{first_error} (also tried: {tried}){hint}")
    raise first_error


def _describe_attempt(extra: dict[str, Any]) -> str:
    parts = []
    if "load_stages" in extra:
        return f"single-buffered 128 x {extra['tile_n']} cooperative tiles"
    if "schedule" in extra:
        tiles = f" with 128 x {extra['tile_n']} tiles" if "tile_n" in extra else ""
        parts.append(f"the cooperative schedule{tiles}")
    if "epi_tile_n" in extra:
        parts.append("128x16 subtiles")
    return " and ".join(parts)


def _ab_stages(emitted, signature, cfg, load_stages: int) -> int:
    """A/B stages the kernel will have with ``load_stages`` epilogue-load stages (it plans its
    shared memory the same way: the visitor's buffers, then D's unless D shares C's)."""
    cfg = cfg.replace(load_stages=load_stages)
    stores = (cfg.epi_stages if cfg.epi_stages is not None else 2) * cfg.epi_groups
    # Pingpong: each consumer warpgroup has its own ring of ``load_stages`` epilogue-load buffers.
    buffers = load_stages * cfg.epi_groups
    smem = epilogue_smem_bytes(emitted, cfg, buffers, stores)
    return cfg.plan_stages(smem, holds_d_in_loads(cfg, emitted, signature))[0]


def ab_stages_of(cfg, emitted, signature) -> int:
    """A/B stages the kernel of a planned configuration ``cfg`` gets with this epilogue."""
    return _ab_stages(emitted, signature, cfg, cfg.c_stages)


def holds_d_in_loads(cfg, emitted, signature) -> bool:
    """Whether the kernel of a planned configuration ``cfg`` writes D into a tile input's load
    buffers (:meth:`GemmConfig.shares_d_with_load`) with this epilogue."""
    inputs = [(p.kind, _dtype_name(p.dtype), signature.tile_majors.get(p.name, "n")) for p in emitted.inputs]
    return cfg.shares_d_with_load(d_buffer_input(inputs, len(emitted.outputs) > 1, cfg) is not None)


def _plan_epilogue_loads(cfg, emitted, signature, knobs: dict[str, Any]):
    """Stage the epilogue's loads as deep as the A/B pipeline allows, ideally for the whole tile.

    At small K the epilogue's memory traffic is what a fused epilogue costs; loads staged for the
    whole tile land while the mainloop runs (and a C with D's dtype then holds D too, see
    `GemmConfig.shares_d_with_load`). The A/B pipeline may go down to
    `GemmConfig.overlap_ab_stages` for it (and no further: fewer stages starve the tensor cores).
    Where a whole tile of the configured subtiles does not fit, 128x16 subtiles are tried for the
    whole tile unless the user chose `epi_tile_n` (narrower subtiles cost barriers, so only the whole
    tile is worth them). Otherwise the deepest staging that keeps those A/B stages wins, and failing
    that the old rule: at least 2 stages, as deep as costs no A/B stage; where that starves the A/B
    pipeline (fewer than STARVED_AB_STAGES), 128x16 subtiles if they leave it more stages.
    """
    if "load_stages" in knobs or not any(KINDS[p.kind].staged_load for p in emitted.inputs):
        return cfg

    def deepest(cand) -> int | None:
        for depth in range(cand.num_subtiles, 1, -1):
            try:
                ab = _ab_stages(emitted, signature, cand, depth)
            except ConfigError:
                continue
            if ab >= cand.overlap_ab_stages():
                return depth
        return None

    depth = deepest(cfg)
    if depth != cfg.num_subtiles and "epi_tile_n" not in knobs and cfg.epi_tile_n != 16:
        narrow = cfg.replace(epi_tile_n=16)
        if deepest(narrow) == narrow.num_subtiles:
            return narrow.replace(load_stages=narrow.num_subtiles)
    if depth is not None:
        return cfg.replace(load_stages=depth)
    planned, ab = _shallow_loads(cfg, emitted, signature)
    if ab < STARVED_AB_STAGES and "epi_tile_n" not in knobs and cfg.epi_tile_n != 16:
        try:
            narrow, narrow_ab = _shallow_loads(cfg.replace(epi_tile_n=16), emitted, signature)
        except ConfigError:  # the narrow subtiles' plan does not fit: keep the one that does
            return planned
        if narrow_ab > ab:
            return narrow
    return planned


def _shallow_loads(cfg, emitted, signature):
    """The old rule: at least 2 epilogue-load stages, as deep as costs no A/B stage. Returns the
    configuration and its A/B stages."""
    depth = cfg.c_stages
    floor = min(2, depth)
    ab_at_floor = _ab_stages(emitted, signature, cfg, floor)

    def ab_at(stages: int) -> int:
        # Deeper loads may not fit at all (the planner raises): that depth costs every A/B stage.
        try:
            return _ab_stages(emitted, signature, cfg, stages)
        except ConfigError:
            return -1

    while depth > floor and ab_at(depth) < ab_at_floor:
        depth -= 1
    return (cfg.replace(load_stages=depth) if depth != cfg.c_stages else cfg), ab_at_floor


__all__ = ["COLUMN_REDUCTION_WARP_ROWS", "SINGLE_BUFFERED", "TWO_LEVEL_FINISH_AXES", "VECTOR_ALIGN",
           "ab_stages_of", "column_reduction_columns", "d_buffer_input", "epilogue_smem_bytes",
           "finish_smem_bytes", "fit_config", "holds_d_in_loads", "input_load_bytes", "input_smem_bytes",
           "reduction_smem_bytes", "store_smem_bytes", "vector_stage_elems"]
