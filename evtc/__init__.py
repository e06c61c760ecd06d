"""evtc: compile plain-PyTorch GEMM epilogues into fused SM90 kernels."""

__version__ = "0.1.0"
