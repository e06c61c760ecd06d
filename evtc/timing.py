"""Timing on the GPU, shared by the benchmarks and `python -m evtc demo`: CUDA events, warm-up,
medians, in alternation."""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence

import torch


def time_paired(fns: Sequence[Callable[[], object]], warmup: int, samples: int, reps: int) -> list[float]:
    """Median milliseconds per call of each of ``fns``, timed in alternation.

    Each sample times every function once (``reps`` back-to-back launches between two events), so
    clock and temperature drift during a run affect all of them alike. The order is shuffled for each
    sample (with a fixed seed): a large GEMM runs at the H100's power limit, where the clock it gets
    depends on what ran just before it (after a memory-bound kernel the clock is higher), so a fixed
    order favours whichever function follows the lightest one.
    """
    for fn in fns:
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times: list[list[float]] = [[] for _ in fns]
    pairs = list(zip(fns, times, strict=True))
    order = random.Random(0)
    for _ in range(samples):
        order.shuffle(pairs)
        for fn, bucket in pairs:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            bucket.append(start.elapsed_time(end) / reps)
    return [statistics.median(bucket) for bucket in times]


def graphed(fn: Callable[[], object], calls: int) -> Callable[[], None]:
    """A function that replays ``calls`` calls of ``fn`` captured in one CUDA graph (device time
    only, no host cost per call). ``fn`` runs once first, outside the capture, to warm it up."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph.replay


def time_ms(fn: Callable[[], object], warmup: int, samples: int, reps: int) -> float:
    """Median milliseconds per call of ``fn``."""
    return time_paired([fn], warmup, samples, reps)[0]
