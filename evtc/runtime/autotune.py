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

import dataclasses
import json
import logging
import os
import re
import statistics
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from evtc.plan.clusters import ceil_div
from evtc.plan.config import GemmConfig
from evtc.plan.selector import is_one_wave_twin, with_launch_shape_for
from evtc.plan.split_k import MAX_SPLITS, cta_tile_grid, splits_within_k, tail_split_limit
from evtc.runtime.invoke import invoke

if TYPE_CHECKING:
    from evtc.runtime.kernel import Kernel

log = logging.getLogger("evtc")

#: Environment variable that turns autotuning on for every kernel ("1", "true", "yes").
ENV = "EVTC_AUTOTUNE"
# Split counts tried per configuration (those that fit one wave and leave a K tile per split).
SPLIT_COUNTS = (1, 2, 3, 4, 6, 8)
# Timing per candidate: warm-up launches, then samples of REPS launches between two events.
WARMUP = 2
SAMPLES = 5
REPS = 3
# GPU clock cycles (about 0.2 ms on an H100) to spin before each sample while its launches queue.
QUEUE_CYCLES = 350_000


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
        # As the rules launch it: its cluster, and only the rows of A a short problem has.
        config = with_launch_shape_for(config, m, n, batches, slots_of, choose_cluster=choose_cluster,
                                       chooses_tile=len(family) > 1)
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
        # The GPU spins while the host queues the sample's launches, so that they run back to
        # back: a decode-sized kernel takes less time than its launch's host side, and the gaps
        # between launches would otherwise be timed instead of the kernel.
        torch.cuda._sleep(QUEUE_CYCLES)
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
        """The record of ``size``, or None where it is absent or not one this code wrote (a
        damaged record is timed again, never run)."""
        entry = self._load().get(size)
        try:
            fields, splits = entry["config"], entry["splits"]
            if not _written_by_us(fields):
                return None
            config = GemmConfig(**fields).validate()
        except (TypeError, KeyError, ValueError):
            return None
        if type(splits) is not int or not 1 <= splits <= MAX_SPLITS:
            return None
        return config, splits

    def put(self, size: str, launch: tuple[GemmConfig, int], times: dict[str, float]) -> None:
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


def _written_by_us(fields) -> bool:
    """Whether ``fields`` (a record's configuration) has exactly the JSON types that
    ``dataclasses.asdict`` of a :class:`GemmConfig` gives: ``2.0`` or ``true`` where an int belongs
    compare equal to 2 and 1 in Python but would build another kernel than any the rules name."""
    if not isinstance(fields, dict):
        return False
    kinds = {f.name: f.type for f in dataclasses.fields(GemmConfig)}
    for name, value in fields.items():
        kind = kinds.get(name)
        if kind is None:
            return False
        if value is None:
            if "None" not in kind:
                return False
        elif kind.startswith("bool"):
            if type(value) is not bool:
                return False
        elif kind.startswith("tuple"):
            if not isinstance(value, list | tuple) or any(type(v) is not int for v in value):
                return False
        elif kind.startswith("int"):
            if type(value) is not int:
                return False
        elif not isinstance(value, str):
            return False
    return True


def describe(launch: tuple[GemmConfig, int]) -> str:
    config, splits = launch
    # A one-wave twin (evtc.plan.selector.one_wave_twins) differs from its tile only in these.
    twin = "" if config.epi_stages is None else f" d{config.epi_stages} l{config.load_stages}"
    rows = "" if config.a_rows is None else f" a{config.a_rows}"
    return (f"{config.schedule} {config.tile_m}x{config.tile_n} {config.cluster[0]}x{config.cluster[1]} "
            f"S{splits}{twin}{rows}")


def tunable(kernel: Kernel, launch: tuple[GemmConfig, int], k: int) -> bool:
    """Whether ``kernel`` may run ``launch`` (a tuned record may come from another rule or pin):
    a configuration of its family in a cluster shape it may take, a split count it may run."""
    config, splits = launch
    if splits > 1 and not kernel.can_split:
        return False
    # A pinned count above K's tiles runs as one split per K tile (see Kernel.launch_for).
    pinned = kernel.pinned_splits
    if pinned is not None and splits != splits_within_k(pinned, k, config.tile_k):
        return False
    in_family = any(config.replace(cluster=c.cluster, split_k=c.split_k, a_rows=c.a_rows) == c
                    for c in kernel.family)
    return in_family and (kernel.chooses_clusters or config.cluster == kernel.config.cluster)


class Tuner:
    """The tuned launches of one autotuning kernel: per size bucket, from this process, the disk
    cache (:class:`Store`), or timed on the first call's inputs."""

    def __init__(self) -> None:
        #: Size bucket -> (configuration, splits), for this process.
        self.tuned: dict[str, tuple[GemmConfig, int]] = {}
        self.store: Store | None = None
        self._lock = threading.Lock()  # one timing per bucket, and one writer of the store

    def launch(self, kernel: Kernel, a, b, ins, outs, m: int, n: int, k: int, batches: int,
               scales=None, up=None) -> tuple[GemmConfig, int]:
        """The tuned (configuration, splits) of the problem's size bucket, timed now on the call's
        inputs into scratch outputs laid out like ``outs`` (the buffers the call launches into)
        when neither this process nor the disk cache has it."""
        size = bucket(m, n, k, batches)
        launch = self.tuned.get(size)
        if launch is not None:
            return launch
        with self._lock:
            launch = self.tuned.get(size)
            if launch is None:
                if self.store is None:
                    import torch

                    self.store = Store(kernel.cache_root, torch.cuda.get_device_name(a.device),
                                       kernel.key + kernel.interface.tag() + kernel.launch_tag)
                launch = self.store.get(size)
                if launch is not None and not tunable(kernel, launch, k):
                    launch = None  # a record this kernel may not run: tuned again
                if launch is None:
                    launch = self._time(kernel, a, b, ins, outs, m, n, k, batches, size, scales, up)
                    if launch is None:
                        # The rules' own launch could not run on these tensors (a layout TMA cannot
                        # read: the call goes on to aligned copies, which are tuned then).
                        return kernel.launch_for(m, n, k, batches)
                self.tuned[size] = launch
        return launch

    def settled(self, m: int, n: int, k: int, batches: int) -> bool:
        """Whether the size bucket of an (L, M, N, K) problem has its launch (timed or stored)."""
        return bucket(m, n, k, batches) in self.tuned

    def _time(self, kernel: Kernel, a, b, ins, outs, m, n, k, batches, size: str,
              scales=None, up=None) -> tuple[GemmConfig, int] | None:
        """The fastest candidate, stored; None where the rules' own launch (the first candidate)
        does not run on these tensors, so that nothing untimed is stored as a winner."""
        import torch

        name = kernel.plan.name
        default = kernel.launch_for(m, n, k, batches)
        launches = [c for c in candidates(m, n, k, batches, kernel.family, kernel.slots,
                                          kernel.chooses_clusters, default)
                    if tunable(kernel, c, k)]
        # Scratch outputs with the strides of the real ones (staged calls pad their rows).
        scratch = kernel.call_spec.kernel_views(
            [torch.empty_strided(o.size(), o.stride(), dtype=o.dtype, device=o.device) for o in outs])
        if scales is not None:
            # The candidates take a's 1 x 128 scales by TMA: timed on a copy where the call's are in
            # another layout (the call itself then runs on one too), rather than all refusing them
            # and the rules' launch being stored untimed.
            from evtc.runtime.staging import stage_scales

            scales, _ = stage_scales(kernel.plan, scales)
        times: dict[str, float] = {}
        timed = []
        for launch in launches:
            try:
                fn, clusters, split, finisher = kernel.resolve(*launch, m, n, k, batches)
            except Exception as exc:  # noqa: BLE001 - a candidate that cannot be built is skipped
                log.warning("%r: autotuning skips %s: %s", name, describe(launch), exc)
                continue
            # The buffers a call of this launch would get (launches on one stream never overlap).
            buffers = tuple(scratch + (finisher.kernel_views(finisher.buffers(m, n, batches, a.device))
                                       if finisher is not None else []))

            def run(fn=fn, buffers=buffers, clusters=clusters, split=split):
                invoke(fn, a, b, buffers, tuple(ins), clusters, split, a.device, scales, up)
            try:
                us = time_us(run)
            except (RuntimeError, ValueError, TypeError) as exc:
                if launch == default:
                    log.debug("%r: not autotuned on these tensors: %s", name, exc)
                    return None
                log.warning("%r: autotuning skips %s: %s", name, describe(launch), exc)
                continue
            times[describe(launch)] = round(us, 2)
            timed.append((launch, us))
        if not timed:
            return None
        best = fastest(timed)
        if kernel.pinned_splits is None:  # a choice limited by a pinned split count stays in memory
            self.store.put(size, best, times)
        log.info("%r: autotuned %s: %s (%d candidates; the rules chose %s)", name, size,
                 describe(best), len(timed), describe(default))
        return best


__all__ = ["ENV", "Store", "Tuner", "bucket", "candidates", "describe", "enabled_by_env", "fastest",
           "time_us", "tunable"]
