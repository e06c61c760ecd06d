"""Epilogues where torch's own rules are easy to get wrong: masks in arithmetic, 16-bit reductions,
literals at the edges of float32, regrouped constants, aliases, and Python forms (positional-only
parameters, sizes divided by //, rebinding a runtime scalar). Each is checked against torch on the
same values: on the CPU through the graph (tests/test_torch_semantics.py), on the GPU through the
kernel (tests/test_torch_semantics_gpu.py). Every case returns float32 outputs (explicit casts), so
the comparison sees the epilogue's own rounding, not the output's."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def neg_inf_literal(acc):
    return torch.where(acc > 0, acc, float("-inf")).float()


def masks_added_and_multiplied(acc):
    up, down = acc > 0.5, acc < 1.0
    return ((up + down) * acc).float(), ((up * down) * acc).float(), (torch.maximum(up, down) * 1.0).float()


def masks_added_with_alpha(acc):
    # torch adds two masks in bool, alpha included: alpha * other is other for a nonzero alpha, and
    # nothing for 0; a mask beside a float value is 0 or 1 in arithmetic.
    up, down = acc > 0.5, acc < -1.0
    return ((torch.add(up, down, alpha=2) * acc).float(), (up.add(down, alpha=0) * acc).float(),
            torch.add(acc, up, alpha=0.5).float(), torch.add(up, acc, alpha=-3).float())


def activation_parameters_from_sizes(acc):
    # A leaky_relu slope and an elu alpha computed from the problem's sizes: known per call.
    return F.leaky_relu(acc, 4.0 / acc.shape[-1]).float(), F.elu(acc - 1.0, acc.shape[0] / 16.0).float()


def masks_xor_and_logical_of_floats(acc):
    return ((acc > 0) ^ (acc > 1)).float(), torch.logical_and(acc, acc - 1.0).float(), \
        torch.logical_not(acc - 1.0).float()


def half_mean_and_float_sum(acc):
    h = (acc * 3000.0).half()
    return h.mean(-1).float(), h.sum(-1, dtype=torch.float32), h.mean(-2).float()


def sums_into_16bit_dtypes(acc):
    # dtype= casts the input first, then accumulates in float32 and rounds the result once.
    y = acc * 3.0
    return y.sum(-1, dtype=torch.float16).float(), torch.mean(y, -2, dtype=torch.bfloat16).float()


def _sums_into_16bit_dtypes_on_cpu(acc):
    # CPU torch's mean(dtype=) does not cast its float32 input first; CUDA torch's does.
    y = acc * 3.0
    return y.sum(-1, dtype=torch.float16).float(), y.bfloat16().float().mean(-2).bfloat16().float()


def clamp_between_a_0dim_tensor_and_a_tile(acc, s, C):
    # torch's clamp takes a 0-dim tensor bound beside a tensor one (and beside a number).
    return torch.clamp(acc, -s, C).float(), torch.clamp(acc, s - 2.0, 0.5).float()


def masks_times_minus_one(acc, C):
    # x * -1 folds to -x, but not for a mask: torch has no negation of a bool.
    return ((acc > 0) * -1.0).float(), (acc + (C > 0) / -1.0).float()


def clamp_of_a_mask(acc, C):
    # A mask clamped by a number is a number (torch promotes it), not a mask.
    return torch.clamp(acc > 0, min=0.5).float(), (C > 0).clamp_max(0.5).float()


def zero_literals_of_both_signs(acc, C):
    # -0.0 and 0.0 are two constants in the kernel (the DSL caches constants by Python value, where
    # they are equal): each reciprocal below is an infinity whose sign shows which zero it got.
    return ((1.0 / (acc * -0.0)).float(), (1.0 / (C * 0.0)).float(),
            (1.0 / torch.relu(acc - 1000.0)).float(), F.softplus(acc, beta=-0.0).float())


def roundings(acc, C):
    # Quarters tie at .5, where torch.round goes to the even integer; round(-0.3) is -0.0.
    x = acc.float() * 0.25
    y = x + C.float()
    return (torch.round(x), torch.floor(y), torch.ceil(y), torch.trunc(y), torch.frac(y), y.fix(),
            torch.round(y, decimals=1), torch.round(x * 100.0, decimals=-2), torch.sign(y), torch.sgn(x),
            1.0 / torch.round(x * 0.1), (x > 0).sign().float())


def shrinks_and_steps(acc, C, bias, s):
    x = acc.float() * 0.125 + C.float()
    w = bias.float()
    return (F.threshold(x, 0.25, -2.0), F.hardshrink(x, 0.5), F.softshrink(x, 0.5), F.tanhshrink(x),
            F.prelu(x, w), F.prelu(x, s), torch.heaviside(x.round(), w))


def pairwise_functions(acc, C):
    x = acc.float() * 0.125
    y = torch.where(C > 1.5, float("nan"), C.float())  # NaNs where C is large
    big = torch.where(C < -1.0, float("inf"), y)          # and infinities
    return (torch.logaddexp(x, y), torch.logaddexp2(x, big), torch.logaddexp(big, big),
            torch.xlogy(x, y.abs()), torch.xlogy(x.round() * 0.0, y), torch.fmax(x, y), torch.fmin(y, x),
            torch.deg2rad(x), torch.rad2deg(y), torch.positive(x))


def hyperbolic_tan_and_log10(acc, C):
    # sinh and cosh switch formulas at |x| = 20 (x reaches about 100, past float32's overflow at
    # 89.4, where torch's are infinite too); a small x keeps its digits; 16-bit values round once.
    x = acc.float() * 4.0 + C.float() * 30.0
    small = acc.float() * 1e-3
    h = (acc * 2.0).half()
    return (torch.sinh(x), torch.cosh(x), torch.sinh(small), torch.cosh(small), x.sinh().sign(),
            torch.sinh(h).float(), torch.cosh(h * 3.0).float(), torch.tan(acc.float() * 0.5), C.float().tan(),
            torch.log10(C.float().abs()), torch.log10(acc.float().abs() * 1000.0), torch.log10(h).float())


def logit_and_sinc(acc, C):
    # logit inside and outside (0, 1), with eps clamping to [eps, 1 - eps]; sinc at 0 and its
    # integer zeros; a 16-bit sinc rounds once. (Not a 16-bit logit: CPU torch's rounds each step,
    # where CUDA torch's and evtc's round once.) logit's inputs are exact (the integer accumulator
    # scaled by powers of two): near 1 logit turns one ulp of its input into a relative error of
    # about 1e-4, so an input computed by the kernel's own sigmoid would compare that, not logit.
    p = acc.float() * 0.0078125 + 0.5
    y = C.float() * 0.75
    h = (acc * 0.25).half()
    return (torch.logit(p), torch.logit(y), torch.logit(y, eps=0.1), p.logit(1e-6),
            torch.sinc(y.round()), torch.sinc(acc.float() * 0.1), torch.special.sinc(h).float(),
            torch.logit(h.float() * 0.03125 + 0.5))


def bfloat16_mean_all(acc):
    return (acc * 512.0).bfloat16().mean().float()


def sums_not_regrouped(acc):
    return ((acc + 1e8) - 1e8).float()


def sums_cancelling_before_a_literal(acc):
    # (acc * 0 - 1) + 1 is 0, then + 1e-12: regrouped, 1 + 1e-12 is 1 in float32 and log(0) -inf.
    return torch.log((acc * 0.0 - 1.0) + 1.0 + 1e-12).float()


def power_of_a_literal_base(acc):
    # 10 ** 30 by pow, not exp2(30 * log2(10)), which is about 35 float32 ulps off.
    return (10.0 ** (acc * 0.0 + 30.0)).float(), (10.0 ** (acc * 0.0 + 2.0)).float()


def products_not_underflowing(acc):
    # The literals' products 1e-60 and 1e60 are not float32 numbers: never folded into one.
    return ((acc * 1e-30) * 1e-30).float(), ((acc * 1e30) * 1e30).float()


def one_to_the_power(acc):
    return (1.0 ** (acc * float("inf"))).float()


def literal_beyond_float32(acc):
    return (acc * 1e39).float()


def rebinding_a_scalar(acc, alpha: float):
    alpha += 1.0
    alpha *= 2.0
    return (acc * alpha).float()


def cast_to_operand_dtype(acc, C):
    return (acc + C).to(C.dtype)


def split_by_half_the_width(acc):
    gate, up = acc.split(acc.shape[-1] // 2, -1)
    return (F.silu(gate) * up).float()


def positional_only(acc, C, /, bias):
    return (acc * C + bias).float()


def narrow_values_compared_with_numbers(acc, alpha: float):
    # torch compares a float16 or bfloat16 value with a Python number (a literal or a runtime
    # scalar) in that dtype, the number rounded to it: in float32 every mask here would flip.
    h = (acc * 0.0 + 0.1).half()
    b = (acc * 0.0 + 0.1).bfloat16()
    return ((h == 0.1) * 1.0 + (h >= 0.1) * 2.0 + (b > alpha) * 4.0 + (b != 0.1) * 8.0).float()


def division_by_zero(acc):
    # Legal torch (inf, -inf, NaN at 0): 1 / 0 is not folded into a multiplication.
    return (acc / 0.0).float(), torch.div(acc, acc.shape[-1] - acc.shape[-1]).float()


def mask_changed_in_place_through_an_alias(acc):
    # torch's |= changes the mask, so the alias `seen` sees it too.
    m = acc > 0
    seen = m
    m |= acc < -1.0
    m &= acc < 4.0
    return (seen * acc).float(), (m ** 1 + m).float()


def literals_at_the_edge_of_float32(acc):
    # 3.4028235e38 (FLT_MAX as printed) is FLT_MAX, not inf; 1e308 * 0.0 in torch's add is NaN
    # (1e308 is inf in float32); a size times 1e-40 is not folded into an overflowing reciprocal.
    edge = (acc * 0.0 + 3.4028235e38) * 1e-38
    return edge.float(), acc.add(1e308, alpha=0.0).float(), ((acc * 1e-3) / (acc.shape[-1] * 1e-40)).float()


def where_between_masks(acc):
    # torch.where of two masks is a mask, usable as another where's condition.
    w = torch.where(acc > 0, acc > 1.0, acc < -1.0)
    return torch.where(w, acc, 0.0).float(), (w * 1.0).float()


def composites_with_special_values(acc, C):
    # torch functions evtc writes out with its own ops (evtc/frontend/composites.py), on values
    # that reach NaN and the infinities (acc / 0 where acc is 0 or not).
    v = acc / torch.where(acc.abs() < 0.5, 0.0, 1.0)
    y = acc.float()
    return (torch.nan_to_num(v), torch.nan_to_num(v.half(), nan=-1.0).float(),
            torch.isnan(v).float() + 2 * torch.isinf(v) + 4 * torch.isfinite(v),
            y.masked_fill(acc > 1.0, float("-inf")),
            torch.lerp(y, C.float(), 0.25) + torch.lerp(y, C.float(), 0.75),
            torch.addcmul(C, y, y, value=-0.5) + torch.addcdiv(y, C, y.abs() + 1.0, value=2.0),
            torch.rsub(y, C, alpha=3.0))


def composite_activations(acc):
    y = (acc * 8.0).float()  # into exp's tails
    return (F.selu(y), F.celu(y, alpha=0.5), F.logsigmoid(y), F.softsign(y),
            F.dropout(y, 0.2, training=False).contiguous().detach().clone())


def glu_of_the_accumulator(acc):
    # A gated epilogue: every output is half as wide.
    y = (acc * 4.0).float()
    return F.glu(y), F.glu(y, dim=-1).sum(-1)


def composites_of_16bit_values_round_once(acc, alpha: float):
    # torch runs each of these as one kernel in float32 and rounds once; evtc's ops on a float16
    # value round each step, so a float16 step would overflow (-2 h, 1.5 h, h * h) or lose digits.
    h = (acc * 16000.0).clamp(-60000.0, 60000.0).half()
    small = (acc * 2.0).half()
    return (torch.lerp(h, -h, 0.25).float(), torch.addcmul(h, h, h, value=1e-6).float(),
            torch.rsub(h, h, alpha=1.5).float(),
            torch.addcdiv(small, small, small * 3.0 + 8.0, value=0.5).float(),
            (F.selu(small) + F.celu(small, alpha=0.5) + F.logsigmoid(small)).float(),
            F.elu(small, alpha).float(), torch.relu_(small * 1.0).float())


def python_bools_of_runtime_scalars(acc, alpha: float, beta: float):
    # Comparisons of runtime scalars are Python bools when the function runs: ints in arithmetic
    # (True + True is 2, ~True is -2, True - False is 1), not masks; beside a tensor, a mask again.
    hi, lo = alpha > 0.5, beta > 0.5
    return ((acc * ((hi + hi) + lo)).float(), (acc * ~hi + ~lo).float(), (acc * (hi - lo) - (-lo)).float(),
            (acc * (hi * 3)).float(), ((acc > 0) + hi).float(), (acc * (hi & lo)).float(),
            (acc * (hi | lo)).float(), (acc * ~~hi + ~~lo).float())


def zero_dim_tensors_beside_16bit_values(acc, s, h):
    # torch computes on tensors in their common dtype: a 0-dim tensor beside a bfloat16 value does
    # not promote, and is rounded to bfloat16 first (the 0-dim tensor first: CPU torch passes a
    # second-operand 0-dim tensor to some ops unrounded, CUDA torch never).
    y = (acc * 0.37).to(torch.bfloat16)
    return (s * y).float(), (s / y).float(), (s - y).float(), (h + y).float(), (y * 0.7).float()


#: name -> (function, operands beyond a and b as shapes ("MN": a tile, "N": a row vector) or values)
CASES = {
    "neg_inf_literal": (neg_inf_literal, {}),
    "masks_added_and_multiplied": (masks_added_and_multiplied, {}),
    "masks_added_with_alpha": (masks_added_with_alpha, {}),
    "activation_parameters_from_sizes": (activation_parameters_from_sizes, {}),
    "masks_xor_and_logical_of_floats": (masks_xor_and_logical_of_floats, {}),
    "half_mean_and_float_sum": (half_mean_and_float_sum, {}),
    "bfloat16_mean_all": (bfloat16_mean_all, {}),
    "sums_into_16bit_dtypes": (sums_into_16bit_dtypes, {}),
    "masks_times_minus_one": (masks_times_minus_one, {"C": "MN"}),
    "clamp_of_a_mask": (clamp_of_a_mask, {"C": "MN"}),
    "zero_literals_of_both_signs": (zero_literals_of_both_signs, {"C": "MN"}),
    "roundings": (roundings, {"C": "MN"}),
    "shrinks_and_steps": (shrinks_and_steps, {"C": "MN", "bias": "N", "s": "0"}),
    "pairwise_functions": (pairwise_functions, {"C": "MN"}),
    "hyperbolic_tan_and_log10": (hyperbolic_tan_and_log10, {"C": "MN"}),
    "logit_and_sinc": (logit_and_sinc, {"C": "MN"}),
    "clamp_between_a_0dim_tensor_and_a_tile": (clamp_between_a_0dim_tensor_and_a_tile, {"s": "0", "C": "MN"}),
    "sums_not_regrouped": (sums_not_regrouped, {}),
    "products_not_underflowing": (products_not_underflowing, {}),
    "sums_cancelling_before_a_literal": (sums_cancelling_before_a_literal, {}),
    "power_of_a_literal_base": (power_of_a_literal_base, {}),
    "one_to_the_power": (one_to_the_power, {}),
    "literal_beyond_float32": (literal_beyond_float32, {}),
    "rebinding_a_scalar": (rebinding_a_scalar, {"alpha": 0.25}),
    "cast_to_operand_dtype": (cast_to_operand_dtype, {"C": "MN"}),
    "split_by_half_the_width": (split_by_half_the_width, {}),
    "positional_only": (positional_only, {"C": "MN", "bias": "N"}),
    "narrow_values_compared_with_numbers": (narrow_values_compared_with_numbers, {"alpha": 0.1}),
    "division_by_zero": (division_by_zero, {}),
    "mask_changed_in_place_through_an_alias": (mask_changed_in_place_through_an_alias, {}),
    "literals_at_the_edge_of_float32": (literals_at_the_edge_of_float32, {}),
    "where_between_masks": (where_between_masks, {}),
    "composites_with_special_values": (composites_with_special_values, {"C": "MN"}),
    "composite_activations": (composite_activations, {}),
    "glu_of_the_accumulator": (glu_of_the_accumulator, {}),
    "composites_of_16bit_values_round_once": (composites_of_16bit_values_round_once, {"alpha": 0.7}),
    "python_bools_of_runtime_scalars": (python_bools_of_runtime_scalars, {"alpha": 0.75, "beta": 0.25}),
    "zero_dim_tensors_beside_16bit_values": (zero_dim_tensors_beside_16bit_values, {"s": "0", "h": "0h"}),
}


def operands(spec: dict, m: int, n: int, dtype: torch.dtype, device: str, seed: int = 0) -> dict:
    """The operands of a case: tiles and row vectors of ``dtype``, numbers as they are."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, what in spec.items():
        if what == "MN":
            out[name] = torch.randn(m, n, generator=g, device=device).to(dtype)
        elif what == "N":
            out[name] = torch.randn(n, generator=g, device=device).to(dtype)
        elif what in ("0", "0h"):  # a 0-dim float32 or float16 tensor (a device scalar)
            value = torch.randn((), generator=g, device=device) + 1.3
            out[name] = value if what == "0" else value.half()
        else:
            out[name] = what
    return out


def torch_reference(fn, acc: torch.Tensor, ops: dict):
    """The function itself on the accumulator (float32) and the operands widened to float32, as
    evtc computes them: torch's rules from there."""
    ops = {k: v.float() if isinstance(v, torch.Tensor) else v for k, v in ops.items()}
    if fn is sums_into_16bit_dtypes and acc.device.type == "cpu":
        fn = _sums_into_16bit_dtypes_on_cpu
    return fn(acc, **ops) if fn is not positional_only else fn(acc, ops["C"], bias=ops["bias"])
