"""The kernels of this process, and what builds a kernel's other configurations.

One :class:`~evtc.runtime.kernel.Kernel` per configuration of a generated source, call interface and
cache directory (:func:`kernel_for`): from this process's memory, the disk cache or a build
(:mod:`evtc.runtime.build`). A kernel that chooses its launch per problem size builds its family's
other configurations on first use through a :class:`VariantSource`, in this process, or describes
the build as a JSON job that a prebuild worker runs (:func:`build_job`, :mod:`evtc.runtime.prebuild`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from evtc.plan.config import GemmConfig
from evtc.plan.kernel_plan import KernelPlan
from evtc.runtime.build import obtain
from evtc.runtime.cache import DiskCache
from evtc.runtime.dsl_lock import reinit_after_fork
from evtc.runtime.front_key import versions
from evtc.runtime.kernel import Kernel

log = logging.getLogger("evtc")

# Kernels by (code key, call interface, cache directory), and the lock that guards them and
# evtc.compile's own memo of compile calls.
MEMORY: dict[str, Kernel] = {}
MEMORY_LOCK = threading.Lock()
reinit_after_fork(MEMORY_LOCK._at_fork_reinit)


def memory_key(key: str, cache: DiskCache) -> str:
    """The key of :data:`MEMORY` for ``key`` (a code key and whatever else tells kernels apart) in
    ``cache``'s directory: a user who points cache_dir somewhere new gets a kernel built or loaded
    there, not this process's kernel of another directory."""
    return f"{key}@{cache.root.resolve()}"


def kernel_key(source: str, signature: dict, cfg: GemmConfig, arch) -> tuple[str, dict]:
    """(disk cache key, build metadata) of one configuration of a generated source."""
    meta = {"versions": versions(), "config": repr(cfg), "signature": signature, "arch": arch or "device"}
    key = hashlib.sha256(json.dumps({"source": source, **meta}, sort_keys=True).encode()).hexdigest()
    return key, meta


class VariantSource:
    """What builds the kernels of a kernel's other configurations (its family's tiles, cluster
    shapes, split-K): the plan, the generated source and the call signature, which every
    configuration shares. Called with a configuration, it gives that kernel (memory, disk cache or
    a build, here); :meth:`job` describes the same build for another process
    (:mod:`evtc.runtime.prebuild`)."""

    def __init__(self, plan: KernelPlan, source: Callable[[], str], signature: dict, arch, cache_dir, *,
                 graph=None, retrace: Callable[[], Any] | None = None) -> None:
        self._plan, self._source, self._signature = plan, source, signature
        self._arch, self._cache_dir, self._graph, self._retrace = arch, cache_dir, graph, retrace

    def __call__(self, cfg: GemmConfig) -> Kernel:
        return kernel_for(self._plan, self._source(), self._signature, cfg, self._arch, self._cache_dir,
                          graph=self._graph, retrace=self._retrace)

    def job(self, cfg: GemmConfig) -> dict:
        """A JSON-able description of building ``cfg``'s kernel into the disk cache."""
        return {"plan": self._plan.to_json(), "source": self._source(), "signature": self._signature,
                "config": dataclasses.asdict(cfg), "arch": self._arch,
                "cache_dir": str(DiskCache(self._cache_dir).root)}


def build_job(job: dict) -> str:
    """Build the kernel that :meth:`VariantSource.job` describes into the disk cache (or find it
    there); returns its key. Used by prebuild worker processes."""
    plan = KernelPlan.from_json(job["plan"])
    if plan is None:
        raise ValueError("prebuild job: the plan does not parse (another evtc version?)")
    cfg = GemmConfig(**job["config"]).validate()
    key, meta = kernel_key(job["source"], job["signature"], cfg, job["arch"])
    obtain(plan, job["source"], cfg, key, DiskCache(job["cache_dir"]), job["arch"], meta)
    return key


def kernel_for(plan: KernelPlan, source: str, signature: dict, cfg: GemmConfig, arch, cache_dir, *,
               graph=None, retrace: Callable[[], Any] | None = None) -> Kernel:
    """The kernel of one configuration: from this process's memory, the disk cache, or a build."""
    key, meta = kernel_key(source, signature, cfg, arch)
    # Kernels of one compiled code but other call interfaces (unused parameters, strict) are
    # separate objects over the same disk cache entry.
    cache = DiskCache(cache_dir)
    mkey = memory_key(key + plan.interface.tag(), cache)
    with MEMORY_LOCK:
        hit = MEMORY.get(mkey)
    if hit is not None:
        log.debug("memory cache hit: %r, key %s", plan.name, key[:16])
        return hit
    built = obtain(plan, source, cfg, key, cache, arch, meta)
    kernel = Kernel(plan, cfg, key, cache, built, source=source, graph=graph, retrace=retrace)
    with MEMORY_LOCK:
        return MEMORY.setdefault(mkey, kernel)


__all__ = ["MEMORY", "MEMORY_LOCK", "VariantSource", "build_job", "kernel_for", "kernel_key", "memory_key"]
