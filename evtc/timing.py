"""Timing on the GPU, shared by the benchmarks and `python -m evtc demo`: CUDA events, warm-up,
medians, in alternation."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch


def time_paired(fns: Sequence[Callable[[], object]], warmup: int, samples: int, reps: int) -> list[float]:
    """Median milliseconds per call of each of ``fns``, timed in alternation.

    Each sample times every function once (``reps`` back-to-back launches between two events), so
    clock and temperature drift during a run affect all of them alike.
    """
    for fn in fns:
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(samples):
        for fn, bucket in zip(fns, times, strict=True):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            bucket.append(start.elapsed_time(end) / reps)
    return [statistics.median(bucket) for bucket in times]


def time_ms(fn: Callable[[], object], warmup: int, samples: int, reps: int) -> float:
    """Median milliseconds per call of ``fn``."""
    return time_paired([fn], warmup, samples, reps)[0]
