"""The SM90 GEMM in the CuTe DSL: the warp-specialized persistent kernel (:mod:`evtc.sm90.gemm`),
its tile scheduler, the epilogue visitor protocol (:mod:`evtc.sm90.visitor`), one class per operand
kind (:mod:`evtc.sm90.operands`), the base class of generated visitors (:mod:`evtc.sm90.fused`) and
the jit entry point that views torch tensors for it (:mod:`evtc.sm90.launch`).

Everything here imports ``cutlass``: only a build (a cache miss) does. See docs/kernel.md."""

from evtc.sm90 import zero_sign as _zero_sign

_zero_sign.install()  # before any kernel is traced: a -0.0 constant keeps its sign (see the module)
