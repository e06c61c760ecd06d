"""Split-K's device buffers: the per-call float32 partials and the per-stream int32 counters.

The counters are zero between launches: the last split of each tile resets its own counter, so a
buffer is allocated (zeroed) once per device and stream and reused by every split-K launch on that
stream (launches on one stream never overlap; launches on two streams get two buffers). Under CUDA
graph capture a fresh zeroed buffer is allocated instead, so each replay starts from zero through
the captured memset.
"""

from __future__ import annotations

import torch

_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}


def counters(device: torch.device, numel: int) -> torch.Tensor:
    """At least ``numel`` zeroed int32 counters for a launch on the current stream of ``device``."""
    numel = max(numel, 1)
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(numel, dtype=torch.int32, device=device)
    key = (device.index if device.index is not None else torch.cuda.current_device(),
           torch.cuda.current_stream(device).stream_id)
    buffer = _COUNTERS.get(key)
    if buffer is None or buffer.numel() < numel:
        grown = numel if buffer is None else max(numel, 2 * buffer.numel())
        buffer = _COUNTERS[key] = torch.zeros(grown, dtype=torch.int32, device=device)
    return buffer


def partials(device: torch.device, numel: int) -> torch.Tensor:
    """A float32 workspace of ``numel`` partial sums (every element is written before it is read)."""
    return torch.empty(max(numel, 4), dtype=torch.float32, device=device)


__all__ = ["counters", "partials"]
