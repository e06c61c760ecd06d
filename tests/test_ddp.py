"""evtc's modules under DistributedDataParallel: bench/ddp.py on two processes. On a CPU machine it
runs through gloo (evtc's torch path), which checks that the modules' autograd works with DDP's
gradient hooks and all-reduce; with two GPUs it runs the kernels through NCCL (the run recorded in
docs/training.md). Either way, DDP's gradients (each rank on its slice of the batch) must equal a
single process's gradients over the whole batch, up to rounding, and so must the parameters after
a few SGD steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path, *args: str) -> list[dict]:
    env = {**os.environ, "EVTC_CACHE_DIR": str(tmp_path / "cache"), "CUTE_DSL_ARCH": "sm_90a",
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(ROOT / "bench" / "ddp.py"), *args],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and results, done.stdout[-3000:] + done.stderr[-3000:]
    return results


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                    reason="a machine with one GPU: the GPU run needs two (nvidia-h200-x2)")
def test_ddp_gradients_equal_one_process(tmp_path):
    results = _run(tmp_path, "--tokens", "128", "--hidden", "64", "--inter", "128", "--steps", "2")
    assert [r["variant"] for r in results] == ["evtc.nn.MLP", "two evtc.nn.FusedLinear"]
    for r in results:
        assert r["world"] == 2
        # The same rounding as one process: bf16 gradients, the all-reduce's order of sums.
        assert r["ddp_vs_single"] < 1e-2, r
        assert r["ddp_vs_float64"] < 2 * r["single_vs_float64"] + 1e-3, r
        assert r["params_after_steps"] < 1e-2, r
