"""The one shared-memory planner and configuration search of a fused kernel.

The kernel (:mod:`evtc.sm90.gemm`) sizes its pipelines from :meth:`GemmConfig.plan_stages`, given the
visitor's buffers; here the same arithmetic chooses, before anything is built, how deep the
epilogue's loads are staged and which subtile and schedule make the epilogue's buffers fit.
"""

from __future__ import annotations

import logging
from typing import Any

from evtc.plan.config import ConfigError, GemmConfig
from evtc.plan.operand_kinds import KINDS

log = logging.getLogger("evtc")


def fit_config(knobs: dict[str, Any], emitted, signature):
    """The configuration of ``knobs``, its epilogue loads planned, checked to fit in shared memory.

    Where the epilogue's buffers (many or wide outputs) leave too few A/B stages, and the user did not
    choose them, narrower 128 x 16 subtiles are tried, then the cooperative schedule (one epilogue's
    buffers instead of the ping-pong schedule's two). Otherwise the first error says what to shrink.
    """
    attempts: list[dict[str, Any]] = [{}]
    if "epi_tile_n" not in knobs:
        attempts.append({"epi_tile_n": 16})
    if "schedule" not in knobs and "tile_n" not in knobs and "cluster" not in knobs:
        attempts.append({"schedule": "cooperative", **attempts[-1]})
    first_error = None
    for extra in attempts:
        try:
            cfg = GemmConfig(**{**knobs, **extra}).validate()
            cfg = _plan_epilogue_loads(cfg, emitted, signature, {**knobs, **extra})
            _ab_stages(emitted, signature, cfg, cfg.c_stages)  # raises where it does not fit
        except ConfigError as exc:
            first_error = first_error or exc
            continue
        if extra:
            log.info("%r: the epilogue's buffers do not fit with the default tiles; using %s",
                     emitted.class_name, extra)
        return cfg
    assert first_error is not None
    if len(attempts) > 1:
        tried = ", ".join("128x16 subtiles" if a == {"epi_tile_n": 16} else "the cooperative schedule"
                          for a in attempts[1:])
        raise ConfigError(f"{first_error} (also tried: {tried})")
    raise first_error


def _ab_stages(emitted, signature, cfg, load_stages: int) -> int:
    """A/B stages the kernel will have with ``load_stages`` epilogue-load stages (it plans its
    shared memory the same way: the visitor's buffers, then D's unless D shares C's)."""
    from evtc.codegen.emit import operand_constructors
    from evtc.sm90.fused import d_buffer_input
    from evtc.sm90.operands import construct

    cfg = cfg.replace(load_stages=load_stages)
    in_texts, out_texts, reduction_texts = operand_constructors(emitted, signature.tile_majors,
                                                                signature.batched)
    inputs, outputs, reductions = construct(in_texts), construct(out_texts), construct(reduction_texts)
    stores = (cfg.epi_stages if cfg.epi_stages is not None else 2) * cfg.epi_groups
    # Pingpong: each consumer warpgroup has its own ring of ``load_stages`` epilogue-load buffers.
    buffers = load_stages * cfg.epi_groups
    smem = sum(o.smem_bytes(cfg.tile_shape_mnk[:2], cfg.epi_tile, buffers, stores)
               for o in inputs + outputs[1:] + reductions)
    shares_d = cfg.shares_d_with_load(d_buffer_input(inputs, outputs[1:], cfg) is not None)
    return cfg.plan_stages(smem, shares_d)[0]


def _plan_epilogue_loads(cfg, emitted, signature, knobs: dict[str, Any]):
    """Stage the epilogue's loads as deep as the A/B pipeline allows, ideally for the whole tile.

    At small K the epilogue's memory traffic is what a fused epilogue costs; loads staged for the
    whole tile land while the mainloop runs (and a C with D's dtype then holds D too, see
    `GemmConfig.shares_d_with_load`). The A/B pipeline may go down to
    `GemmConfig.overlap_ab_stages` for it (and no further: fewer stages starve the tensor cores).
    Where a whole tile of the configured subtiles does not fit, 128x16 subtiles are tried for the
    whole tile unless the user chose `epi_tile_n` (narrower subtiles cost barriers, so only the whole
    tile is worth them). Otherwise the deepest staging that keeps those A/B stages wins, and failing
    that the old rule: at least 2 stages, as deep as costs no A/B stage.
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
    depth = cfg.c_stages
    floor = min(2, depth)
    ab_at_floor = _ab_stages(emitted, signature, cfg, floor)
    while depth > floor and _ab_stages(emitted, signature, cfg, depth) < ab_at_floor:
        depth -= 1
    return cfg.replace(load_stages=depth) if depth != cfg.c_stages else cfg


__all__ = ["fit_config"]
