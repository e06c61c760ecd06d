"""Handing one launch to a compiled function: the arguments its entry point takes, in its order."""

from __future__ import annotations

from evtc.plan.config import GemmConfig
from evtc.runtime import stream_buffers


def built_config(config: GemmConfig, splits: int) -> GemmConfig:
    """The configuration whose kernel runs a launch of ``config`` with ``splits`` splits of K: its
    split-K build where K is split."""
    return config.replace(split_k=True) if splits > 1 and not config.split_k else config


def invoke(fn, a, b, outs: tuple, ins: tuple, clusters: int, split, device, scales=None, up=None) -> None:
    """Launch a compiled function; ``split``: split-K's (splits, partials, counters) or None;
    ``scales``: block-scaled float8's (a's, b's) scales, handed over with a and b as pairs; ``up``:
    a gated kernel's offset of b's up half, in elements (b is then the whole weight)."""
    if scales is not None:
        a, b = (a, scales[0]), (b, scales[1])
    gemm = (a, b) if up is None else (a, b, up)
    if split is None:
        fn(*gemm, outs, ins, clusters)
    else:
        splits, partials_numel, counters_numel = split
        stream = stream_buffers.stream_key(device)
        fn(*gemm, outs, ins, clusters, splits, stream_buffers.partials(device, partials_numel, stream),
           stream_buffers.counters(device, counters_numel, stream=stream))


__all__ = ["built_config", "invoke"]
