"""Inputs on the float8 rounding edges, shared by the CPU and GPU float8 tests: an epilogue that
casts to both float8 formats everywhere a cast can be (outputs, a cast inside, reductions)."""

from __future__ import annotations

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

#: Values around both formats' largest finite values and the points where torch's rounding turns
#: them into 448 (e4m3fn, which saturates) or infinity (e5m2, from 61440 = 57344 + half a spacing on).
FLOAT8_EDGES = [57344.0, 61439.0, 61440.0, 61441.0, 65504.0, 1e6, float("inf"), 448.0, 463.9, 464.0,
                480.0, 1e4, 3.0, 0.0]


def float8_roundings(acc, C):
    y = acc + C
    return (y.to(E5M2), y.to(E4M3), y.to(E5M2).float() * 0.5, y.amax(-1).to(E5M2), y.amin().to(E5M2))


def float8_edge_operands(m: int, n: int, k: int, device: str = "cpu", seed: int = 0):
    """Small-integer a and b (their product is exact in float32) and a C that puts acc + C on and
    around the float8 rounding edges, both signs, beside ordinary values."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(-2, 3, (m, k), generator=g).to(torch.bfloat16)
    b = torch.randint(-2, 3, (k, n), generator=g).to(torch.bfloat16)
    edges = torch.tensor(FLOAT8_EDGES)
    picks = edges[torch.randint(0, len(FLOAT8_EDGES), (m, n), generator=g)]
    signs = torch.where(torch.rand(m, n, generator=g) < 0.5, -1.0, 1.0)
    C = torch.where(torch.rand(m, n, generator=g) < 0.5, picks * signs, torch.randn(m, n, generator=g) * 3e4)
    acc = a.float() @ b.float()
    C = C - acc  # acc + C lands on the edge exactly (both are exact in float32 at these sizes)
    return a.to(device), b.to(device), C.to(device)
