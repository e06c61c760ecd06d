"""Opt-in autotuning of the launch: time the candidate configurations of a kernel on the problem at
hand and keep the fastest, per GPU model and size bucket, in the disk cache.

The default launch comes from the fitted rules of :mod:`evtc.plan.selector`. With autotuning on
(``evtc.compile(..., autotune=True)`` or ``EVTC_AUTOTUNE=1``), the first call in a size bucket times
the candidates instead: every configuration of the kernel's family (cluster chosen for it as the
selector would), each with the split counts that fit one wave (or, past one wave, that split a
thin last round), and the selector's own choice. The
winner is written to ``<cache>/autotune/<gpu>/<kernel key>.json`` and used by every later call in
the bucket, in this process and the next.

Candidates run on the call's own inputs, into scratch outputs (the caller's outputs, which may alias
its inputs, are written once, by the real launch). A call made while a CUDA graph is being captured
is never tuned: it takes the selector's choice.
"""

from __future__ import annotations

import json
import os
import re
import statistics
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from evtc.plan.clusters import ceil_div
from evtc.plan.config import GemmConfig
from evtc.plan.selector import is_one_wave_twin, with_cluster_for
from evtc.plan.split_k import MAX_SPLITS, cta_tile_grid, tail_split_limit

#: Environment variable that turns autotuning on for every kernel ("1", "true", "yes").
ENV = "EVTC_AUTOTUNE"
# Split counts tried per configuration (those that fit one wave and leave a K tile per split).
SPLIT_COUNTS = (1, 2, 3, 4, 6, 8)
# Timing per candidate: warm-up launches, then samples of REPS launches between two events.
WARMUP = 2
SAMPLES = 5
REPS = 3


def enabled_by_env() -> bool:
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def bucket(m: int, n: int, k: int, batches: int) -> str:
    """The size bucket of a problem: M rounded up to a power of two (at least 16), N, K and L as
    they are (they are the layer's weight: a model has few of them)."""
    rounded = 16
    while rounded < m:
        rounded *= 2
    return f"{rounded}x{n}x{k}x{batches}"


def candidates(m: int, n: int, k: int, batches: int, family: Sequence[GemmConfig],
               slots_of: Callable[[tuple[int, int]], int], choose_cluster: bool,
               default: tuple[GemmConfig, int]) -> list[tuple[GemmConfig, int]]:
    """The launches worth timing: ``default`` first, then each configuration of ``family`` (its
    cluster chosen for the problem where ``choose_cluster``) with every split count of
    SPLIT_COUNTS that fits in one wave of CTAs (1 always); past one wave, the split counts of a
    partly filled last round that its idle clusters take (at most MAX_TAIL_SPLITS; only that
    round is split, see :mod:`evtc.plan.split_k`)."""
    out = [default]
    k_tiles = ceil_div(k, default[0].tile_k)
    for config in family:
        if choose_cluster:
            config = with_cluster_for(config, m, n, batches, slots_of)
        tiles = cta_tile_grid(m, n, batches, config, config.cluster)
        slots = slots_of(config.cluster)
        # A one-wave twin (evtc.plan.selector.one_wave_twins) runs as the rules run it: one wave of
        # tiles, unsplit.
        twin = is_one_wave_twin(config, family[0])
        if twin and tiles > slots:
            continue
        if tiles > slots:  # past one wave: only a partly filled last round may split
            most = min(tail_split_limit(tiles, slots, config.cluster[0] * config.cluster[1]), k_tiles)
        else:
            most = min(slots // max(tiles, 1), k_tiles, MAX_SPLITS)
        for splits in SPLIT_COUNTS:
            if splits > 1 and (splits > most or twin):
                continue
            if (config, splits) not in out:
                out.append((config, splits))
    return out


def time_us(run: Callable[[], object]) -> float:
    """Median microseconds of one ``run()`` on the current stream (CUDA events)."""
    import torch

    for _ in range(WARMUP):
        run()
    samples = []
    for _ in range(SAMPLES):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPS):
            run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / REPS)
    return statistics.median(samples)


def fastest(timed: Iterable[tuple[tuple[GemmConfig, int], float]]) -> tuple[GemmConfig, int]:
    """The launch with the lowest time (the first of equals: the default wins ties)."""
    best, best_us = None, float("inf")
    for launch, us in timed:
        if us < best_us:
            best, best_us = launch, us
    if best is None:
        raise ValueError("no candidate was timed")
    return best


class Store:
    """Tuned launches of one kernel on one GPU model: ``<root>/autotune/<gpu>/<key>.json``, a map
    from size bucket to the configuration (its fields) and split count."""

    def __init__(self, root: Path, gpu: str, key: str) -> None:
        self.path = Path(root) / "autotune" / re.sub(r"\W+", "_", gpu) / f"{key}.json"
        self._entries: dict | None = None

    def _load(self) -> dict:
        if self._entries is None:
            try:
                data = json.loads(self.path.read_text())
                self._entries = data if isinstance(data, dict) else {}
            except (OSError, ValueError):
                self._entries = {}
        return self._entries

    def get(self, size: str) -> tuple[GemmConfig, int] | None:
        entry = self._load().get(size)
        try:
            config, splits = GemmConfig(**entry["config"]).validate(), entry["splits"]
        except (TypeError, KeyError, ValueError):
            return None
        if not isinstance(splits, int) or not 1 <= splits <= MAX_SPLITS:
            return None
        return config, splits

    def put(self, size: str, launch: tuple[GemmConfig, int], times: dict[str, float]) -> None:
        import dataclasses
        import tempfile

        self._entries = None  # merge with what other processes wrote since we read it
        entries = dict(self._load())
        entries[size] = {"config": dataclasses.asdict(launch[0]), "splits": launch[1], "us": times}
        self._entries = entries
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(entries, indent=1))
            os.replace(tmp, self.path)
        except OSError:
            pass  # a read-only cache: tuned again in the next process


def describe(launch: tuple[GemmConfig, int]) -> str:
    config, splits = launch
    # A one-wave twin (evtc.plan.selector.one_wave_twins) differs from its tile only in these.
    twin = "" if config.epi_stages is None else f" d{config.epi_stages} l{config.load_stages}"
    return (f"{config.schedule} {config.tile_m}x{config.tile_n} {config.cluster[0]}x{config.cluster[1]} "
            f"S{splits}{twin}")


__all__ = ["ENV", "Store", "bucket", "candidates", "describe", "enabled_by_env", "fastest", "time_us"]
