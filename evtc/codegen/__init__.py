"""SM90 GEMM engine: a warp-specialized persistent CuTe DSL kernel with a visitor epilogue.

See docs/kernel.md for the kernel's structure and the visitor protocol."""

from .config import ConfigError, GemmConfig
from .runtime import CompiledGemm, clear_cache, compile_gemm, config_for, gemm
from .visitor import EpilogueContext, EpilogueShape, EpilogueVisitor
from .visitors import Identity, LinearCombination

__all__ = [
    "CompiledGemm",
    "ConfigError",
    "EpilogueContext",
    "EpilogueShape",
    "EpilogueVisitor",
    "GemmConfig",
    "Identity",
    "LinearCombination",
    "clear_cache",
    "compile_gemm",
    "config_for",
    "gemm",
]
