"""Epilogues of several outputs, shared by the CPU and GPU tests of the backward's dZ kernels: each
output's incoming gradient is an operand of the kernel in the output's own shape."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def four_outputs(acc, scale, C):
    """A tile, its per-row sums, its per-column sums and its total."""
    y = torch.tanh(acc) * scale
    return y + C, y.sum(-1), y.sum(0, keepdim=True), y.sum()


def tile_and_pre_residual(acc, bias, C, alpha: float):
    """The README's first example: a tile and its value before the residual."""
    y = F.gelu(alpha * acc + bias)
    return y + C, y


def gated_with_stats(acc, scale):
    """A gated epilogue's dict: the tile, its per-row sums and twice the tile."""
    gate, up = acc.chunk(2, dim=-1)
    y = F.silu(gate) * up * scale
    return {"y": y, "rows": y.sum(-1), "twice": 2 * y}


def tile_and_row_sums(acc, bias):
    y = F.gelu(acc + bias)
    return y, y.sum(-1)
