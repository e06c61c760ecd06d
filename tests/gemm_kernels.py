"""The GEMM engine's configurations compiled through ``evtc.compile``, the one path every kernel takes.

The engine tests pin a whole :class:`GemmConfig` (schedule, tile, cluster, stages, majors, dtypes)
and run it with two epilogues: the identity (``D = acc``) and a linear combination
(``D = alpha * acc + beta * C``, C of a chosen dtype and major)."""

from __future__ import annotations

import dataclasses

import torch

import evtc
from evtc.plan.config import GemmConfig

TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
         "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}

# Fields that come from the example tensors, not from the config knobs.
_FROM_EXAMPLES = ("ab_dtype", "d_dtype", "a_major", "b_major", "gated", "store_d")


def identity(acc):
    return acc


def lincomb(acc, c, alpha: float, beta: float):
    return alpha * acc + beta * c


def example(rows: int, cols: int, dtype: torch.dtype, major_is_rows: bool, batches: int | None,
            device="meta") -> torch.Tensor:
    """A (batches,) rows x cols tensor, contiguous along cols unless ``major_is_rows``."""
    lead = (batches,) if batches else ()
    if major_is_rows:
        return torch.empty(lead + (cols, rows), dtype=dtype, device=device).transpose(-1, -2)
    return torch.empty(lead + (rows, cols), dtype=dtype, device=device)


def knobs(cfg: GemmConfig) -> dict:
    """Every knob of ``cfg`` that the examples do not decide, pinned (the cluster included)."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
            if f.name not in _FROM_EXAMPLES and getattr(cfg, f.name) is not None}


def compile_config(cfg: GemmConfig, c: tuple[str, str] | None = None, batched: bool = False,
                   arch: str | None = None) -> evtc.Kernel:
    """``cfg`` compiled with the identity epilogue, or with the linear combination when ``c`` gives
    C's (dtype, major)."""
    batches = 2 if batched else None
    ab = TORCH[cfg.ab_dtype]
    examples = {"a": example(64, 64, ab, cfg.a_major == "m", batches),
                "b": example(64, 64, ab, cfg.b_major == "k", batches)}
    fn = identity
    if c is not None:
        fn = lincomb
        examples.update(c=example(64, 64, TORCH[c[0]], c[1] == "m", batches), alpha=1.0, beta=1.0)
    return evtc.compile(fn, examples, out_dtypes=TORCH[cfg.d_dtype], config=knobs(cfg), arch=arch,
                        strict=True)


def uses_d_buffers_of_c(kernel: evtc.Kernel) -> bool:
    return bool(kernel.stages["d_in_load"])
