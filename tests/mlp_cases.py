"""Activations and output epilogues shared by the evtc.nn.MLP tests (CPU and GPU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(acc):
    gate, up = acc.chunk(2, dim=-1)
    return F.silu(gate) * up


def geglu_tanh(acc):
    gate, up = acc.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def bias_gelu(acc, bias):
    return F.gelu(acc + bias)


def relu_squared(acc):
    return torch.relu(acc) ** 2


def add_residual(acc, residual):
    return acc + residual


def residual_bias(acc, bias, residual):
    return acc + bias + residual
