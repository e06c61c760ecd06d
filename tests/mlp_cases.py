"""Activations and output epilogues shared by the evtc.nn.MLP tests (CPU and GPU), and a training
step the module tests under torch.compile share."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(acc):
    gate, up = acc.chunk(2, dim=-1)
    return F.silu(gate) * up


def geglu_tanh(acc):
    gate, up = acc.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def swiglu_bias(acc, bias):
    gate, up = (acc + bias).chunk(2, dim=-1)
    return F.silu(gate) * up


def bias_gelu(acc, bias):
    return F.gelu(acc + bias)


def relu_squared(acc):
    return torch.relu(acc) ** 2


def add_residual(acc, residual):
    return acc + residual


def residual_bias(acc, bias, residual):
    return acc + bias + residual


def compiled_step(compiled, params, m: int, width: int, generator, device="cuda"):
    """One training step of ``compiled`` on fresh bfloat16 inputs of ``m`` rows and ``width``
    columns (the output's width too): (y, the gradients of y . dy with respect to x and ``params``,
    float32 leaf copies of x and ``params`` for a reference, dy)."""
    x = torch.randn(m, width, device=device, generator=generator).bfloat16().requires_grad_()
    dy = torch.randn(m, width, device=device, generator=generator).bfloat16()
    y = compiled(x)
    mine = torch.autograd.grad(y, [x, *params], dy)
    ref = [p.detach().float().requires_grad_() for p in (x, *params)]
    return y, mine, ref, dy
