"""Block-scaled float8 operands: ``a`` and ``b`` given as ``(tensor, scales)`` pairs.

DeepSeek-V3's recipe quantizes activations per 1 x 128 block (one float32 scale per row and 128
elements of K) and weights per 128 x 128 block. The scales must be applied per K block, before the
products of different blocks are summed, so they cannot be epilogue operands: a call hands them over
with the tensors they scale, ``k((x, x_scales), (w.t(), w_scales.t()), ...)``, and the epilogue sees
the dequantized accumulator. Scale shapes, each in its operand's orientation (``a`` is (M, K), ``b``
is (K, N); a leading L when batched), with KB = ceil(K / 128):

* ``a``'s: (M, KB) for 1 x 128 blocks, or (ceil(M / 128), KB) for 128 x 128 blocks;
* ``b``'s: (KB, ceil(N / 128)), 128 x 128 blocks (a weight ``w`` (N, K) with scales ``sw``
  (N / 128, KB) is passed as ``(w.t(), sw.t())``).

Scales are float32 with any strides (the kernel reads ``a``'s 1 x 128 scales by TMA, M-major with
a pitch of a multiple of 4; other layouts run on a copy). This module recognises
the pairs, checks the scales' shapes and dequantizes: the accumulator of block-scaled inputs is
the product of the dequantized ``a`` and ``b`` (:func:`evtc.ir.interpreter.accumulator`, so the
reference, the interpreter and the torch path agree); the kernel applies the scales in its
promoting mainloop (:meth:`evtc.sm90.gemm.Sm90GemmKernel._load_block_factors`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

# Elements of K (and columns of b) per scale; evtc.plan.config.SCALE_BLOCK is the kernel's copy
# (the plan imports nothing from the IR; tests/test_fp8_blockwise.py checks they agree).
SCALE_BLOCK = 128
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _blocks(extent: int) -> int:
    return -(-extent // SCALE_BLOCK)


def is_pair(value: Any) -> bool:
    """Whether ``value`` is a (tensor, scales) pair."""
    # Indexed rather than all(...) over a generator: it runs several times on every call.
    return (isinstance(value, tuple | list) and len(value) == 2
            and isinstance(value[0], torch.Tensor) and isinstance(value[1], torch.Tensor))


def split_inputs(inputs: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[Any, Any] | None]:
    """``inputs`` with ``a`` and ``b`` as plain tensors, and their scales (None when neither is a
    pair). Only one of them given with scales is an error (see :func:`scale_problem`)."""
    a, b = inputs.get("a"), inputs.get("b")
    if not is_pair(a) and not is_pair(b):
        return dict(inputs), None
    plain = dict(inputs)
    scales = []
    for name in ("a", "b"):
        value = inputs.get(name)
        if is_pair(value):
            plain[name], scale = value
        else:
            scale = None
        scales.append(scale)
    return plain, (scales[0], scales[1])


def expected_shapes(a: torch.Tensor, b: torch.Tensor) -> dict[str, tuple]:
    """The accepted scale shapes for ``a`` and ``b``: ``a_rows`` (1 x 128), ``a_blocks`` (128 x 128)
    and ``b``."""
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    batch = tuple(a.shape[:-2])
    return {"a_rows": (*batch, m, _blocks(k)), "a_blocks": (*batch, _blocks(m), _blocks(k)),
            "b": (*tuple(b.shape[:-2]), _blocks(k), _blocks(n))}


def scale_problem(a: torch.Tensor, b: torch.Tensor, scales: tuple[Any, Any] | None,
                  a_rows: int | None = None) -> tuple[str | None, int]:
    """(what is wrong with these block scales or None, rows of ``a`` per scale: 1 or 128).

    ``a_rows`` given (a compiled kernel's): ``a``'s scales must have that granularity."""
    if scales is None:
        return "a and b must be given as (tensor, block scales) pairs", 0
    a_scales, b_scales = scales
    if a_scales is None or b_scales is None:
        missing = "a" if a_scales is None else "b"
        return (f"{missing} has no block scales: give both a and b as (tensor, scales) pairs, or "
                "neither"), 0
    if a.dtype not in FLOAT8 or b.dtype not in FLOAT8:
        return f"block scales scale float8 a and b; a is {a.dtype} and b is {b.dtype}", 0
    shapes = expected_shapes(a, b)
    for name, t in (("a", a_scales), ("b", b_scales)):
        if t.dtype != torch.float32:
            return f"{name}'s block scales must be float32, got {t.dtype}", 0
        if t.device != a.device:
            return f"{name}'s block scales are on {t.device}, a is on {a.device}", 0
    got = tuple(a_scales.shape)
    # Both readings fit a one-row a (M = 1); a compiled kernel keeps its own.
    fits = [rows for rows, key in ((1, "a_rows"), (128, "a_blocks")) if shapes[key] == got]
    if a_rows is not None:
        fits = [rows for rows in fits if rows == a_rows]
    if not fits:
        want = {1: f"{shapes['a_rows']} (1 x 128 blocks: a row and 128 elements of K per scale)",
                128: f"{shapes['a_blocks']} (128 x 128 blocks)"}
        accepted = [want[a_rows]] if a_rows is not None else list(want.values())
        return f"a's block scales have shape {got}; a {tuple(a.shape)} takes {' or '.join(accepted)}", 0
    if tuple(b_scales.shape) != shapes["b"]:
        return (f"b's block scales have shape {tuple(b_scales.shape)}; b {tuple(b.shape)} takes "
                f"{shapes['b']} (128 x 128 blocks, in b's (K, N) orientation: pass a weight's (N/128, "
                "K/128) scales transposed)"), 0
    return None, fits[0]


def dequantize(t: torch.Tensor, scales: torch.Tensor, rows: int, cols: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``t`` in ``dtype`` with each (rows x cols) block multiplied by its scale (blocks at the edges
    are cut short)."""
    r, c = t.shape[-2], t.shape[-1]
    full = scales.to(dtype).repeat_interleave(rows, dim=-2).repeat_interleave(cols, dim=-1)
    return t.to(dtype) * full[..., :r, :c]


def dequantized(a: torch.Tensor, b: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor],
                a_rows: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` and ``b`` in ``dtype`` with their block scales applied."""
    return (dequantize(a, scales[0], a_rows, SCALE_BLOCK, dtype),
            dequantize(b, scales[1], SCALE_BLOCK, SCALE_BLOCK, dtype))


__all__ = ["dequantize", "dequantized", "expected_shapes", "is_pair", "scale_problem",
           "split_inputs"]
