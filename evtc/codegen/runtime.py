"""Host side: compile cache, torch tensor conversion, launching on the current torch CUDA stream.

    from evtc.codegen import GemmConfig, LinearCombination, compile_gemm

    gemm = compile_gemm(GemmConfig(ab_dtype="float16", d_dtype="float16"), LinearCombination("float16"))
    gemm(a, b, d, c=c, alpha=1.5, beta=0.5)   # d[...] = 1.5 * (a @ b) + 0.5 * c

Shapes follow ``torch.matmul``: a (M, K) or (L, M, K), b (K, N) or (L, K, N), d (M, N) or (L, M, N).
The config's majors must match the tensors' memory layouts (``GemmConfig.for_tensors`` infers
them).  A compiled kernel serves every M, N, K, L: sizes, strides, pointers and visitor scalars are
runtime arguments; only the config and the visitor's ``cache_key`` select a kernel.
"""

from __future__ import annotations

import functools
import tempfile
import threading
import warnings

import cutlass
import cutlass.cute as cute

from .config import DTYPE_BYTES, ConfigError, GemmConfig
from .dtypes import dtype_name, torch_dtype
from .gemm_sm90 import Sm90GemmKernel
from .visitor import EpilogueVisitor
from .visitors import Identity

H100_SM_COUNT = 132
COMPILE_OPTIONS = "--keep-ptx --keep-cubin"


# ---- tensors -----------------------------------------------------------------------------------


def _cute_view(view, contiguous_dim: int):
    from cutlass.cute.runtime import from_dlpack

    # Every extent and stride but the unit one is dynamic, so one compile serves all shapes.
    return from_dlpack(view, assumed_align=16).mark_layout_dynamic(leading_dim=contiguous_dim)


def example_tensor(dtype: str, major: str, inner_major: tuple[str, str] = ("m", "n")):
    """A small CPU tensor of the same static type as :func:`operand_to_cute` produces (compile only).

    ``major`` names the contiguous dimension among ``inner_major`` (rows, columns)."""
    import torch

    rows, cols, batches = 64, 64, 2
    base = torch.empty((batches, rows, cols), dtype=torch_dtype(dtype))
    if major == inner_major[1]:
        view = base.permute(1, 2, 0)
        return _cute_view(view, 1)
    view = base.transpose(1, 2).contiguous().permute(2, 1, 0)
    return _cute_view(view, 0)


def operand_to_cute(t, name: str, shape_rcl: tuple[int, int, int], major: str, dims: tuple[str, str]):
    """Check a torch operand and convert it to a CuTe tensor of shape (rows, cols, L).

    ``t`` is (rows, cols) or (L, rows, cols) in torch indexing; ``major`` names which of ``dims``
    (rows, cols) must be contiguous.  The other stride and the batch stride must be multiples of 16
    bytes and the data pointer 16-byte aligned (TMA's rules)."""
    import torch

    rows, cols, batches = shape_rcl
    if t.dim() == 2:
        if batches != 1 or tuple(t.shape) != (rows, cols):
            raise ValueError(
                f"{name}: expected shape {(batches, rows, cols)} or {(rows, cols)}, got {tuple(t.shape)}"
            )
        rs, cs = t.stride()
        # A size-1 batch mode still needs a TMA-legal stride: use the span of the matrix, rounded up.
        ls = ((max(rs * max(rows, 1), cs * max(cols, 1)) + 15) // 16) * 16
    elif t.dim() == 3:
        if tuple(t.shape) != (batches, rows, cols):
            raise ValueError(f"{name}: expected shape {(batches, rows, cols)}, got {tuple(t.shape)}")
        ls, rs, cs = t.stride()
        if batches == 1:
            ls = ((max(rs * max(rows, 1), cs * max(cols, 1)) + 15) // 16) * 16
    else:
        raise ValueError(f"{name}: expected a 2-D or 3-D tensor, got {t.dim()} dimensions")
    if not t.is_cuda and torch.cuda.is_available():
        raise ValueError(f"{name}: must be a CUDA tensor")
    esize = t.element_size()
    contiguous_dim = 1 if major == dims[1] else 0
    strides = [rs, cs]
    if strides[contiguous_dim] != 1 and (rows, cols)[contiguous_dim] > 1:
        raise ValueError(
            f"{name}: the config says {dims[contiguous_dim]}-major ({dims[contiguous_dim]} contiguous), "
            f"but strides are {tuple(t.stride())}"
        )
    strides[contiguous_dim] = 1
    other = strides[1 - contiguous_dim]
    if (rows, cols)[1 - contiguous_dim] == 1:
        other = 16  # a single row / column: the stride is never used, make it TMA-legal
    extent = (rows, cols)[contiguous_dim]
    if (extent * esize) % 16:
        raise ValueError(
            f"{name}: the contiguous dimension ({dims[contiguous_dim]}={extent}) must be a multiple of "
            f"{16 // esize} elements (16 bytes) for TMA"
        )
    if (other * esize) % 16 or (ls * esize) % 16:
        raise ValueError(f"{name}: strides {tuple(t.stride())} must be multiples of 16 bytes for TMA")
    if t.data_ptr() % 16:
        raise ValueError(f"{name}: data pointer must be 16-byte aligned")
    view_strides = (other, 1, ls) if contiguous_dim == 1 else (1, other, ls)
    view = torch.as_strided(t, (rows, cols, batches), view_strides)
    return _cute_view(view, contiguous_dim)


# ---- majors ------------------------------------------------------------------------------------


def _major_of(t, dims: tuple[str, str], default: str) -> str:
    rs, cs = t.stride()[-2], t.stride()[-1]
    if rs == 1 and cs == 1:  # a single row or column: either reading works
        return default
    if cs == 1:
        return dims[1]
    if rs == 1:
        return dims[0]
    raise ValueError(f"tensor with strides {tuple(t.stride())} has no unit-stride matrix dimension")


def infer_majors(a, b, d) -> dict:
    """Majors of a (M,K), b (K,N), d (M,N) from their strides (row-major wins on ties)."""
    return {
        "a_major": _major_of(a, ("m", "k"), "k"),
        "b_major": _major_of(b, ("k", "n"), "n"),
        "d_major": _major_of(d, ("m", "n"), "n"),
    }


# ---- device facts ------------------------------------------------------------------------------


@functools.cache
def max_active_clusters(cluster_size: int, device_index: int | None = None) -> int:
    """Clusters of ``cluster_size`` CTAs that can be resident at once (one CTA per SM)."""
    try:
        import torch

        if torch.cuda.is_available():
            dev = torch.cuda.current_device() if device_index is None else device_index
            try:
                from cutlass.utils import HardwareInfo

                n = HardwareInfo(dev).get_max_active_clusters(cluster_size)
                if n > 0:
                    return int(n)
            except Exception:
                pass
            return torch.cuda.get_device_properties(dev).multi_processor_count // cluster_size
    except Exception:
        pass
    return H100_SM_COUNT // cluster_size


# ---- compile cache -----------------------------------------------------------------------------

_CACHE: dict = {}
_CACHE_LOCK = threading.Lock()


def _current_stream():
    import cuda.bindings.driver as cuda
    import torch

    if torch.cuda.is_available():
        return cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    return cuda.CUstream(0)


class CompiledGemm:
    """A compiled kernel plus the host glue to call it with torch tensors."""

    def __init__(self, config: GemmConfig, visitor: EpilogueVisitor, compiled, kernel: Sm90GemmKernel):
        self.config = config
        self.visitor = visitor
        self.compiled = compiled
        self.kernel = kernel

    @property
    def ptx(self) -> str:
        return self.compiled.__ptx__

    @property
    def ab_stages(self) -> int:
        return self.kernel.ab_stages

    @property
    def d_stages(self) -> int:
        return self.kernel.d_stages

    def problem(self, a, b, d) -> tuple[int, int, int, int]:
        if a.dim() != b.dim() or a.dim() != d.dim() or a.dim() not in (2, 3):
            raise ValueError("a, b, d must all be 2-D or all 3-D (batched)")
        m, k = a.shape[-2], a.shape[-1]
        kb, n = b.shape[-2], b.shape[-1]
        batches = a.shape[0] if a.dim() == 3 else 1
        if kb != k:
            raise ValueError(f"inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
        if k == 0:
            # TMA descriptors cannot describe an empty dimension.
            raise ValueError("K = 0 is not supported")
        if a.dim() == 3 and (b.shape[0] != batches or d.shape[0] != batches):
            raise ValueError("a, b and d must have the same batch count")
        if tuple(d.shape[-2:]) != (m, n):
            raise ValueError(f"d must be {(m, n)}, got {tuple(d.shape[-2:])}")
        cfg = self.config
        for t, name, want in ((a, "a", cfg.ab_dtype), (b, "b", cfg.ab_dtype), (d, "d", cfg.d_dtype)):
            if dtype_name(t.dtype) != want:
                raise ValueError(f"{name} must be {want} for this config, got {t.dtype}")
        return m, n, k, batches

    def arguments(self, a, b, d, **visitor_args) -> tuple:
        """The compiled kernel's argument tuple (everything but the stream)."""
        m, n, k, batches = self.problem(a, b, d)
        cfg = self.config
        # CuTe convention: A (M, K, L), B (N, K, L), D (M, N, L).
        ca = operand_to_cute(a, "a", (m, k, batches), cfg.a_major, ("m", "k"))
        cb = operand_to_cute(b.transpose(-1, -2), "b", (n, k, batches),
                             "k" if cfg.b_major == "k" else "n", ("n", "k"))
        cd = operand_to_cute(d, "d", (m, n, batches), cfg.d_major, ("m", "n"))
        epi = self.visitor.runtime_args(cfg, (m, n, k, batches), **visitor_args)
        clusters = max_active_clusters(cfg.cluster[0] * cfg.cluster[1])
        return (ca, cb, cd, epi, cutlass.Int32(clusters))

    def __call__(self, a, b, d, **visitor_args):
        """d = epilogue(a @ b), launched on the current torch CUDA stream.  Returns d."""
        m, n, _, batches = self.problem(a, b, d)
        if m == 0 or n == 0 or batches == 0:
            return d
        args = self.arguments(a, b, d, **visitor_args)
        self.compiled(*args, _current_stream())
        return d

    def bind(self, a, b, d, **visitor_args):
        """A zero-argument launcher with the tensors converted once (benchmarks: least host time).
        It launches on the stream current at bind time."""
        args = self.arguments(a, b, d, **visitor_args) + (_current_stream(),)
        compiled = self.compiled

        def launch():
            compiled(*args)

        return launch


def compile_gemm(config: GemmConfig, visitor: EpilogueVisitor | None = None) -> CompiledGemm:
    """Compile (or fetch from the cache) the kernel for ``config`` and ``visitor``."""
    import cuda.bindings.driver as cuda

    visitor = visitor if visitor is not None else Identity()
    config = config.validate()
    key = (config, visitor.cache_key())
    with _CACHE_LOCK:
        hit = _CACHE.get(key)
    if hit is not None:
        return hit
    kernel = Sm90GemmKernel(config, visitor)
    a = example_tensor(config.ab_dtype, config.a_major, ("m", "k"))
    b = example_tensor(config.ab_dtype, config.b_major, ("n", "k"))
    d = example_tensor(config.d_dtype, config.d_major, ("m", "n"))
    epi = visitor.example_args(config)
    with warnings.catch_warnings():
        # An empty visitor-argument tuple is "not a JitArgument": harmless, it simply has no values.
        warnings.filterwarnings("ignore", message=".*cannot be converted to a JitArgument.*")
        compiled = cute.compile(kernel, a, b, d, epi, cutlass.Int32(1), cuda.CUstream(0),
                                options=f"{COMPILE_OPTIONS} --dump-dir={_dump_dir()}")
    result = CompiledGemm(config, visitor, compiled, kernel)
    with _CACHE_LOCK:
        _CACHE.setdefault(key, result)
        return _CACHE[key]


@functools.cache
def _dump_dir() -> str:
    """Where the DSL writes the PTX and cubin it keeps: one temporary folder per process, never the
    caller's working directory."""
    return tempfile.mkdtemp(prefix="evtc-gemm-")


def config_for(a, b, d, **overrides) -> GemmConfig:
    """A GemmConfig whose dtypes and majors match the tensors; ``overrides`` set the other knobs."""
    fields = {"ab_dtype": dtype_name(a.dtype), "d_dtype": dtype_name(d.dtype), **infer_majors(a, b, d)}
    if dtype_name(b.dtype) != fields["ab_dtype"]:
        raise ConfigError(f"a and b must have the same dtype, got {a.dtype} and {b.dtype}")
    fields.update(overrides)
    return GemmConfig(**fields).validate()


def gemm(a, b, d, visitor: EpilogueVisitor | None = None, config: GemmConfig | None = None, **visitor_args):
    """One-call API: infer the config from the tensors (unless given), compile once, launch."""
    cfg = config if config is not None else config_for(a, b, d)
    return compile_gemm(cfg, visitor)(a, b, d, **visitor_args)


def clear_cache() -> None:
    with _CACHE_LOCK:
        _CACHE.clear()


__all__ = [
    "DTYPE_BYTES",
    "CompiledGemm",
    "clear_cache",
    "compile_gemm",
    "config_for",
    "example_tensor",
    "gemm",
    "infer_majors",
    "max_active_clusters",
    "operand_to_cute",
]
