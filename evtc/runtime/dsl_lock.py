"""One lock for everything that runs the CuTe DSL's compiler in this process.

The DSL keeps its MLIR context per process, not per thread: two compilations at once (threads
compiling different epilogues, or one compiling while another asks the DSL for the GPU's cluster
occupancy, which compiles a probe kernel) crash it. They take turns on :data:`DSL_LOCK`. Take it
after any cache lock, never before, so that waiting for another thread's build of the same key
cannot deadlock.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

DSL_LOCK = threading.RLock()  # reentrant: a build that asked for occupancy would not deadlock


def reinit_after_fork(reset: Callable[[], None]) -> None:
    """Run ``reset`` in the child of every fork: a lock another thread held at the fork stays held
    there forever (that thread does not exist in the child), so the child's first compile would
    hang. ``reset`` makes the module's locks new."""
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=reset)


reinit_after_fork(DSL_LOCK._at_fork_reinit)
