"""GPU: the cases of tests/semantics_cases.py through the kernel, against the function run by
torch on the same accumulator. a and b hold small integers, so the accumulator is exact whatever
the order of the sums, and masks, infinities and NaNs must match element for element."""

from __future__ import annotations

import pytest
import torch
from semantics_cases import CASES, operands, torch_reference
from support import flatten

import evtc

pytestmark = pytest.mark.gpu

M, N, K = 200, 256, 48
# Cases whose outputs round through 16 bits inside the epilogue: one 16-bit rounding apart at most
# (the kernel's float32 sums run in another order than torch's).
SIXTEEN_BIT = {"half_mean_and_float_sum": 2e-3, "bfloat16_mean_all": 1e-2, "cast_to_operand_dtype": 1e-3,
               "sums_into_16bit_dtypes": 2e-3}


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_matches_torch(cache, name):
    fn, spec = CASES[name]
    g = torch.Generator(device="cuda").manual_seed(7)
    a = torch.randint(-3, 4, (M, K), generator=g, device="cuda").half()
    b = torch.randint(-3, 4, (K, N), generator=g, device="cuda").half()
    ops = operands(spec, M, N, torch.float16, "cuda", seed=3)
    kernel = evtc.compile(fn, {"a": a, "b": b, **ops}, cache_dir=cache, strict=True)
    got = kernel(a, b, **ops)
    assert kernel.last_path == "kernel"
    acc = a.float() @ b.float()
    want = torch_reference(fn, acc, ops)
    if name == "cast_to_operand_dtype":
        want = (acc + ops["C"].float()).to(torch.float16)
    rtol = SIXTEEN_BIT.get(name, 1e-5)
    for (key, out), (_, ref) in zip(flatten(got), flatten(want), strict=True):
        assert (out.shape, out.dtype) == (ref.shape, ref.dtype), key
        out, ref = out.float(), ref.float()
        for what in (torch.isnan, torch.isposinf, torch.isneginf):
            assert torch.equal(what(out), what(ref)), (key, what.__name__)
        finite = ref.isfinite()
        torch.testing.assert_close(out[finite], ref[finite], rtol=rtol, atol=1e-4)
