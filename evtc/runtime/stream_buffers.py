"""Device buffers kept per device and stream: split-K's float32 partials and int32 counters,
and the partials and counters of kernels that finish their own reductions.

The counters are zero between launches: the last split of each tile (the last tile of each block
of rows or columns, :class:`evtc.sm90.operands.KernelFinish`) resets its own counter, so a buffer is
allocated (zeroed) once per device, stream and pool and reused by every launch on that stream
(launches on one stream never overlap; launches on two streams get two buffers; split-K and the
finishes of one launch use two pools).

Under CUDA graph capture a launch gets counters of its own, which its graph keeps for as long as
the graph lives: a slice of a per-device arena zeroed before any capture (:func:`capture_counters`).
Every replay leaves them at zero again, as every eager launch does, so the graph needs no memset
(a captured ``torch.zeros`` added a memset node, about 1.2 us per launch on the H100, to every
replay). The arena is made by the first eager launch of any size (:func:`ensure_capture_arena`).
Only where none was made yet (a capture before any eager launch on the device) or it is used up
does a capture fall back to a fresh ``torch.zeros``. Kept buffers come
from evtc's own memory pool (:func:`kept`), never from a pool another component routes allocations
to.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

import torch

from evtc.runtime.dsl_lock import reinit_after_fork

log = logging.getLogger("evtc")

_COUNTERS: dict[tuple[int, int, str], torch.Tensor] = {}
_POOLS: dict[int, object] = {}


@contextlib.contextmanager
def kept(device: torch.device) -> Iterator[None]:
    """Allocate buffers that outlive the call (kept here and in evtc.runtime.reductions) from evtc's
    own memory pool on ``device``. Calls made while another pool takes the thread's allocations
    (torch.compile's CUDA graph trees warm a graph up so, ``mode="reduce-overhead"``) would
    otherwise keep a tensor alive in that pool, which the trees refuse ("tensors in the cudagraph
    pool not tracked as outputs"). Under stream capture nothing new is kept: captured launches
    take slices of the capture arena, which was allocated here before any capture."""
    if device.type != "cuda" or not hasattr(torch.cuda, "MemPool"):
        yield
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    # One thread at a time: torch refuses a second thread routing its allocations to a pool that
    # another is allocating to ("already recording to mempool_id"). Buffers are kept once per
    # stream and size, so the lock is rarely taken.
    with _KEPT_LOCK:
        pool = _POOLS.get(index)
        if pool is None:
            pool = _POOLS[index] = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool, index):
            yield


_KEPT_LOCK = threading.RLock()
reinit_after_fork(_KEPT_LOCK._at_fork_reinit)


def stream_key(device: torch.device) -> tuple[int, int] | None:
    """(device index, current raw stream) of ``device``, or None while a CUDA graph is being
    captured: what the buffers of a launch on the current stream are kept by. The per-call path:
    torch's C entry points, not ``torch.cuda.current_stream``, which costs several microseconds of
    Python."""
    if _capturing():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return index, _raw_stream(index)


# torch's C entry points where this build has them (CUDA builds), else the public API.
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream",
                      lambda index: torch.cuda.current_stream(index).cuda_stream)


_UNKNOWN = object()


def _grown(store: dict, key, device: torch.device, numel: int, make) -> torch.Tensor:
    """``store[key]``, replaced by ``make(size)`` (allocated from evtc's pool) where it is missing or
    holds fewer than ``numel`` elements: at least doubled, so a growing size reallocates rarely."""
    buffer = store.get(key)
    if buffer is None or buffer.numel() < numel:
        size = numel if buffer is None else max(numel, 2 * buffer.numel())
        with kept(device):
            try:
                buffer = store[key] = make(size)
            except torch.OutOfMemoryError:
                if size == numel:
                    raise
                # No room to double: free the old buffer (launches queued on this stream that use
                # it still run first: the allocator reuses its memory in stream order) and take
                # exactly what this launch needs.
                del store[key], buffer
                buffer = store[key] = make(numel)
    return buffer


# Counters per device handed out to captured launches, each slice for good: 1 MiB of int32. A slice
# must outlive every replay of its graph and no other launch may share it (two graphs may replay at
# once on two streams), so slices are never reused; once the arena is used up, captures fall back to
# a captured memset.
CAPTURE_ARENA_COUNTERS = 1 << 18
_ARENAS: dict[int, list] = {}  # device index -> [int32 buffer, counters handed out]
# Two threads may capture graphs at once: a slice is handed out under this lock, so never twice.
_ARENA_LOCK = threading.Lock()
_ARENA_SPENT: set[int] = set()  # devices whose arena ran out (told once)


def ensure_capture_arena(device: torch.device, index: int | None = None) -> None:
    """Make ``device``'s capture arena if it has none (never inside a capture: zeroing it is an
    eager memset). Called by the first eager launch of every size (evtc.runtime.kernel), so that a
    warm-up at any size, split or not, prepares the captures that follow."""
    if index is None:
        index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _ARENAS:
        with kept(device):
            arena = [torch.zeros(CAPTURE_ARENA_COUNTERS, dtype=torch.int32, device=device), 0]
        # Once per device: the zeros must have landed before any graph, replayed on any stream,
        # reads a slice.
        torch.cuda.current_stream(device).synchronize()
        with _ARENA_LOCK:
            _ARENAS.setdefault(index, arena)


def capture_counters(device: torch.device, numel: int) -> torch.Tensor | None:
    """``numel`` zeroed int32 counters for a launch being captured into a CUDA graph, from the
    device's arena, never handed out again; None where there is no arena or too little is left."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    arena = _ARENAS.get(index)
    if arena is None:
        return None
    with _ARENA_LOCK:
        buffer, used = arena
        start = -(-used // 4) * 4  # 16-byte aligned slices
        if start + numel > buffer.numel():
            spent = index not in _ARENA_SPENT
            _ARENA_SPENT.add(index)
        else:
            arena[1] = start + numel
            return buffer[start:start + numel]
    if spent:
        log.warning("evtc: the CUDA graph capture arena of device %d is used up (%d counters); later "
                    "captured split-K and reduction launches zero their counters inside the graph, "
                    "about 1 us more per replayed launch", index, buffer.numel())
    return None


def counters(device: torch.device, numel: int, pool: str = "split_k", stream=_UNKNOWN) -> torch.Tensor:
    """At least ``numel`` zeroed int32 counters of ``pool`` for a launch on the current stream of
    ``device`` (``stream``: its :func:`stream_key`, where the caller has it)."""
    numel = max(numel, 1)
    if stream is _UNKNOWN:
        stream = stream_key(device)
    if stream is None:
        captured = capture_counters(device, numel)
        return torch.zeros(numel, dtype=torch.int32, device=device) if captured is None else captured
    key = (*stream, pool)
    buffer = _COUNTERS.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = _grown(_COUNTERS, key, device, numel,
                        lambda size: torch.zeros(size, dtype=torch.int32, device=device))
        ensure_capture_arena(device, stream[0])
    return buffer


_SCRATCH: dict[tuple[int, int], torch.Tensor] = {}


def scratch(device: torch.device, numel: int) -> torch.Tensor:
    """At least ``numel`` float32 elements for the partials of a launch on the current stream of
    ``device`` that reads them back itself (a kernel that finishes its reductions): reused by every
    such launch on that stream, which never overlap. Nothing outside the kernel may read them: a
    host finish enqueued after the launch could find them overwritten by a launch from another
    thread. Under CUDA graph capture each capture gets its own."""
    numel = max(numel, 4)
    key = stream_key(device)
    if key is None:
        return _floats(numel, device)
    return _grown(_SCRATCH, key, device, numel, lambda size: _floats(size, device))


_SCRATCH_VIEWS: dict = {}


def scratch_workspaces(device: torch.device, numels: tuple[int, ...], stream) -> list[torch.Tensor]:
    """Workspaces of ``numels`` elements cut from :func:`scratch` (``stream``: the current stream's
    :func:`stream_key`): the views are kept with the buffer, so a call on a size seen before cuts
    nothing. A single workspace is the whole buffer (its spare element is then further along)."""
    if stream is None:
        buffer = scratch(device, sum(numels))
        return [buffer] if len(numels) == 1 else list(buffer[:sum(numels)].split(numels))
    key = (stream, numels)
    cached = _SCRATCH_VIEWS.get(key)
    buffer = _SCRATCH.get(stream)
    if cached is None or cached[0] is not buffer:
        buffer = scratch(device, sum(numels))
        views = [buffer] if len(numels) == 1 else list(buffer[:sum(numels)].split(numels))
        if len(_SCRATCH_VIEWS) > 4096:  # many distinct sizes: start over rather than grow
            _SCRATCH_VIEWS.clear()
        cached = _SCRATCH_VIEWS[key] = (buffer, views)
    return cached[1]


_PARTIALS: dict[tuple[int, int], torch.Tensor] = {}


def partials(device: torch.device, numel: int, stream=_UNKNOWN) -> torch.Tensor:
    """At least ``numel`` float32 elements for split-K's partial sums in a launch on the current
    stream of ``device`` (``stream``: its :func:`stream_key`, where the caller has it): kept per
    device and stream like :func:`scratch`, but a buffer of their own (a launch may finish
    reductions too). Every element a launch reads it wrote first in the same launch, and launches
    on one stream never overlap, so reuse is safe; it saves a ``torch.empty`` (about 3 us of host
    time) per split call. Under CUDA graph capture each capture gets its own."""
    numel = max(numel, 4)
    if stream is _UNKNOWN:
        stream = stream_key(device)
    if stream is None:
        return _floats(numel, device)
    return _grown(_PARTIALS, stream, device, numel, lambda size: _floats(size, device))


def _floats(numel: int, device: torch.device) -> torch.Tensor:
    return torch.empty(numel, dtype=torch.float32, device=device)


__all__ = ["CAPTURE_ARENA_COUNTERS", "capture_counters", "counters", "ensure_capture_arena", "kept",
           "partials", "scratch", "scratch_workspaces", "stream_key"]
