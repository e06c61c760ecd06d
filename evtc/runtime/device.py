"""Facts about the GPU that the call path needs, without importing the CuTe DSL.

The persistent kernel launches as many clusters as can be resident at once. For clusters of more
than one CTA that number depends on how the GPU's SMs group into GPCs, which only the CUDA
occupancy API answers (the DSL's ``HardwareInfo`` asks it). The answer is asked once per GPU model
and cluster size and kept next to the kernel cache, so a process that loads cached kernels never
imports ``cutlass`` for it.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

import torch

from evtc.plan.split_k import H200_HBM_BYTES_PER_US, HBM_BYTES_PER_US
from evtc.runtime.dsl_lock import DSL_LOCK

#: The H100 SXM's SM count: the answer without a GPU (nothing is launched then).
H100_SM_COUNT = 132


@functools.cache
def _gpu(index: int) -> tuple[str, int]:
    props = torch.cuda.get_device_properties(index)
    return props.name, props.multi_processor_count


def _facts_file(root: Path, name: str, sms: int) -> Path:
    return root / "devices" / (re.sub(r"\W+", "_", name) + f"_{sms}sm.json")


def _ask_the_dsl(index: int, cluster_size: int) -> int:
    try:
        from cutlass.utils import HardwareInfo

        with DSL_LOCK:  # the query compiles a probe kernel (dsl_lock.py)
            return int(HardwareInfo(index).get_max_active_clusters(cluster_size))
    except Exception:  # noqa: BLE001 - any failure: the SM count bound below
        return 0


_MEMO: dict[tuple[int, int], int] = {}


def max_active_clusters(cluster_size: int, cache_root: Path) -> int:
    """Clusters of ``cluster_size`` CTAs (one CTA per SM) that the current GPU holds at once."""
    if not torch.cuda.is_available():
        return H100_SM_COUNT // cluster_size
    index = torch.cuda.current_device()
    memo_key = (index, cluster_size)
    known = _MEMO.get(memo_key)
    if known is not None:
        return known
    name, sms = _gpu(index)
    if cluster_size == 1:
        _MEMO[memo_key] = sms
        return sms
    path = _facts_file(cache_root, name, sms)
    try:
        facts = json.loads(path.read_text())
    except (OSError, ValueError):
        facts = {}
    value = facts.get(str(cluster_size)) if isinstance(facts, dict) else None
    if not isinstance(value, int) or not 0 < value <= sms // cluster_size:
        value = _ask_the_dsl(index, cluster_size)
        if not 0 < value <= sms // cluster_size:
            value = sms // cluster_size
        else:
            facts = {**(facts if isinstance(facts, dict) else {}), str(cluster_size): value}
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(facts))
                os.replace(tmp, path)
            except OSError:
                pass  # a read-only cache: asked again in the next process
    _MEMO[memo_key] = value
    return value


def hbm_bytes_per_us() -> float:
    """The current GPU's memory rate in the selector's split model (bytes per microsecond,
    :func:`evtc.plan.split_k.modelled_time_us`): the H200's where the GPU is one, else the H100's,
    on whose SMs and memory the other rules were fitted (also without a GPU)."""
    if not torch.cuda.is_available():
        return HBM_BYTES_PER_US
    name, _ = _gpu(torch.cuda.current_device())
    return H200_HBM_BYTES_PER_US if "H200" in name else HBM_BYTES_PER_US


__all__ = ["H100_SM_COUNT", "hbm_bytes_per_us", "max_active_clusters"]
