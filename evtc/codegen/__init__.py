"""Code generation: an optimized epilogue graph becomes the readable source of its visitor class
(:mod:`evtc.codegen.emit`). Nothing here imports the CuTe DSL; the source it writes does, when the
runtime builds the kernel."""
