"""Building a kernel's variants ahead of the calls that need them (:meth:`evtc.Kernel.prebuild`).

A kernel that chooses its launch per problem size builds each other configuration (tile, cluster
shape, split-K) on the first call that needs it, a few seconds each. ``prebuild`` builds the ones
a list of problem sizes will launch before those calls come: at start-up, or before CUDA-graph
capture (a build during capture would load a module into a capturing process).

In the background it runs one worker process (``python -m evtc.runtime.prebuild``, jobs as JSON
on stdin), not a thread: the CuTe DSL's compiler holds the interpreter for most of a build, and a
thread would slow the caller's own work down as much as building in place. The worker writes into
the disk cache under its per-key lock, so a call that needs a variant still being built waits for
that one only, then loads it from disk; calls that need other variants never wait for it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path


class Prebuild:
    """Handle of a prebuild: the configurations it builds, and (in the background) its worker."""

    def __init__(self, configs: Sequence, process: subprocess.Popen | None = None, log=None) -> None:
        self.configs = tuple(configs)
        self._process = process
        self._log = log

    def done(self) -> bool:
        """Whether every build has finished (successfully or not)."""
        return self._process is None or self._process.poll() is not None

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the builds; raises RuntimeError (with the worker's last output) if one failed,
        and subprocess.TimeoutExpired after ``timeout`` seconds."""
        if self._process is None:
            return
        if self._process.wait(timeout=timeout) != 0:
            self._log.seek(0)
            tail = self._log.read().decode(errors="replace")[-2000:]
            raise RuntimeError(f"prebuild: a background build failed (exit {self._process.returncode}):"
                               f"\n{tail}")

    def __repr__(self) -> str:
        state = "done" if self.done() else "building"
        return f"Prebuild({len(self.configs)} configuration(s), {state})"


def start(jobs: list[dict], configs: Sequence) -> Prebuild:
    """Start one worker process that builds ``jobs`` (see :meth:`evtc.runtime.variants.VariantSource.job`).
    The jobs and the worker's messages go through files, not pipes: a worker that nobody waits for
    must never block on a full pipe."""
    if not jobs:
        return Prebuild(configs)
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="evtc-prebuild-", delete=False) as f:
        json.dump(jobs, f)
    log = tempfile.TemporaryFile()
    # The worker imports this evtc, wherever the parent found it (a sys.path entry the parent added
    # is not the child's): another copy would key and build other kernels.
    package_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p)}
    process = subprocess.Popen([sys.executable, "-m", "evtc.runtime.prebuild", f.name], env=env,
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
    return Prebuild(configs, process, log)


def main(argv: list[str]) -> int:
    """The worker: build every job of the JSON file ``argv[0]`` in order, then remove the file."""
    from evtc.runtime.variants import build_job

    path = argv[0]
    try:
        with open(path) as f:
            jobs = json.load(f)
    finally:
        os.unlink(path)
    for job in jobs:
        build_job(job)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


__all__ = ["Prebuild", "start"]
