"""One lock for everything that runs the CuTe DSL's compiler in this process.

The DSL keeps its MLIR context per process, not per thread: two compilations at once (threads
compiling different epilogues, or one compiling while another asks the DSL for the GPU's cluster
occupancy, which compiles a probe kernel) crash it. They take turns on :data:`DSL_LOCK`. Take it
after any cache lock, never before, so that waiting for another thread's build of the same key
cannot deadlock.
"""

from __future__ import annotations

import threading

DSL_LOCK = threading.RLock()  # reentrant: a build that asked for occupancy would not deadlock
