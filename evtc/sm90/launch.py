"""The host entry of a fused kernel: torch tensors in, CuTe views for the kernel out.

The compiled function takes the tensors exactly as the user passes them (torch layouts: ``a`` (L,)
M x K, ``b`` (L,) K x N, outputs (L,) M x N, operands in their own shapes) through the DSL's TVM-FFI
calling convention, so a call converts nothing in Python. Inside the jit function, :class:`Launcher`
rearranges the modes into the kernel's convention (A (M, K, L), B (N, K, L), D (M, N, L), operand
views as :mod:`evtc.sm90.operands` expects them): layout algebra only, free at run time.

:class:`evtc.plan.signature.TensorSpec` describes one tensor argument statically: its dtype, which
problem dim each of its dims is (``L``, ``M``, ``N``, ``K`` or ``1``) and which dim is contiguous.
:func:`fake_tensor` turns it into a compile-time placeholder whose extents are shared symbols, so
the compiled function itself checks at every call that the sizes agree (``M`` of ``a`` equals ``M``
of ``C``), that the contiguous dim has stride 1, that other strides are multiples of 16 bytes and
that data pointers are 16-byte aligned.
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from evtc.plan.config import DTYPE_BYTES
from evtc.plan.tensor_spec import TMA_ALIGN, TensorSpec
from evtc.sm90.operands import dsl_dtype


class Symbols:
    """The shared symbolic sizes of one compile."""

    def __init__(self) -> None:
        # W and V: the lengths of the reductions' flat workspaces, per row (M x n tiles x L) and per
        # column (N x m tiles x L); R and S: of the outputs a kernel finishes itself, per row (L x M)
        # and per column (L x N); Q: of its counters.
        # KB, MB and NB: block scales' counts of 128-element blocks along K, M and N. G: a gated
        # kernel's B width (gate and up halves, twice the output's N).
        self.sizes = {d: cute.sym_int32(symbol=d)
                      for d in ("L", "M", "N", "K", "W", "V", "R", "S", "Q", "KB", "MB", "NB", "G")}


def whole_dims(dims: tuple) -> tuple:
    """A half's dims (or view modes) with N renamed G, the GEMM's width (twice N)."""
    return tuple("G" if d == "N" else d for d in dims)


def whole_spec(half_spec: TensorSpec) -> TensorSpec:
    """A gated kernel's B, or an operand as wide as the GEMM, as the call passes it, whole:
    ``half_spec`` (one half, N wide) with its N dim named G (:func:`whole_dims`)."""
    return dataclasses.replace(half_spec, dims=whole_dims(half_spec.dims))


def fake_tensor(spec: TensorSpec, symbols: Symbols):
    """A compile-time placeholder for a tensor matching ``spec``."""
    from cutlass.cute.runtime import make_fake_tensor

    shape = []
    stride = []
    for i, d in enumerate(spec.dims):
        if d == "1":
            shape.append(1)
            stride.append(cute.sym_int64())  # never used: any value passes
            continue
        shape.append(symbols.sizes[d])
        if i == spec.contiguous:
            stride.append(1)
        elif spec.contiguous is None:
            stride.append(cute.sym_int64())
        else:
            stride.append(cute.sym_int64(divisibility=spec.align_elems()))
    align = TMA_ALIGN if spec.contiguous is not None else DTYPE_BYTES[spec.dtype]
    return make_fake_tensor(dsl_dtype(spec.dtype), tuple(shape), tuple(stride), assumed_align=align)


# ---- views, inside the jit function ----------------------------------------------------------------


def _mode(t, dims: tuple[str, ...], d: str):
    i = dims.index(d)
    return t.shape[i], t.stride[i]


def _span_stride(t, dims: tuple[str, ...], spec: TensorSpec):
    """A TMA-legal stride for a batch mode of extent 1: the matrix's span, rounded up to 16 B."""
    span = 1
    for i, d in enumerate(dims):
        if d != "1" and i != spec.contiguous:
            span = t.shape[i] * t.stride[i]
    align = spec.align_elems()
    return (span + (align - 1)) // align * align


def view(t, spec: TensorSpec, modes: tuple[str, ...], *, pad_batch: bool = False):
    """``t`` (torch dims ``spec.dims``) as a tensor with the given ``modes``. With ``pad_batch``, a
    missing ``L`` becomes a mode of extent 1 (the kernel's A, B and D are always (., ., L))."""
    shapes = []
    strides = []
    for d in modes:
        if d in spec.dims:
            s, st = _mode(t, spec.dims, d)
        elif d == "L" and pad_batch:
            s, st = 1, _span_stride(t, spec.dims, spec)
        else:
            raise ValueError(f"{spec.name}: no {d} dim in {spec.dims}")
        shapes.append(s)
        strides.append(st)
    return cute.make_tensor(t.iterator, cute.make_layout(tuple(shapes), stride=tuple(strides)))


def scalar_view(t):
    return cute.make_tensor(t.iterator, cute.make_layout(1))


class Launcher:
    """The jit entry point: ``(a, b, outputs, inputs, max_clusters, stream)``.

    ``outputs`` is the tuple of output tensors (the kernel's D first), ``inputs`` the tuple of the
    epilogue's inputs in the visitor's order (tensors and float32 scalars). ``plan`` gives, per
    tensor, its spec and the view the kernel or its operand wants.

    A gated kernel's operand as wide as the GEMM is two inputs of the visitor, its gate and up
    halves; the call passes it whole in the gate half's place and, in the up half's, where that half
    starts in elements (``in_halves``: per input None, or (0 or 1, the index of its gate half's
    input)), and :meth:`_input_views` makes the halves' views, as :meth:`_b_halves` does for B."""

    def __init__(self, kernel, a_spec: TensorSpec, b_spec: TensorSpec, out_specs, in_specs, in_views,
                 batched: bool, workspaces: int = 0, finished: tuple[int, ...] = (),
                 scale_specs: tuple = (), in_halves: tuple = ()):
        self.kernel = kernel
        # After the full-tile outputs: ``workspaces`` reduction workspaces; then, for a kernel that
        # finishes its reductions, the outputs of each finish (``finished``: how many per axis) and
        # the counters.
        self.workspaces = workspaces
        self.finished = tuple(finished)
        self.a_spec = a_spec
        self.b_spec = b_spec
        self.out_specs = tuple(out_specs)
        self.in_specs = tuple(in_specs)  # None for Python scalars
        self.in_views = tuple(in_views)  # modes per input ("scalar", "arg" or a tuple of modes)
        self.batched = batched
        # Block-scaled float8: the specs of a's and b's scales (ScaledLauncher).
        self.scale_specs = tuple(scale_specs)
        self.in_halves = tuple(in_halves) or (None,) * len(self.in_specs)

    def _input_view(self, t, spec, modes):
        if modes == "arg":
            return t
        if modes == "scalar":
            return scalar_view(t)
        return view(t, spec, modes)

    def _input_views(self, inputs):
        """The epilogue's inputs as the visitor takes them (see the class docstring for halves).
        The host passes an up half's offset that keeps it 16-byte aligned (N times the width's
        stride, or a padded copy's), so the alignment is assumed here, not checked."""
        halves = {}  # a gate half's input index -> (the whole's start, one half's layout)
        for index, (t, spec, modes, half) in enumerate(zip(inputs, self.in_specs, self.in_views,
                                                           self.in_halves, strict=True)):
            if half is not None and half[0] == 0:
                whole_modes = whole_dims(modes)
                whole = view(t, whole_spec(spec), whole_modes)
                extents = tuple(e // 2 if d == "G" else e
                                for e, d in zip(whole.shape, whole_modes, strict=True))
                halves[index] = (whole.iterator, cute.make_layout(extents, stride=whole.stride))
        views = []
        for t, spec, modes, half in zip(inputs, self.in_specs, self.in_views, self.in_halves, strict=True):
            if half is None:
                views.append(self._input_view(t, spec, modes))
                continue
            start, layout = halves[half[1]]
            if half[0] == 1:  # t: where the up half starts
                start = start + cute.assume(t, divby=spec.align_elems())
            views.append(cute.make_tensor(start, layout))
        return tuple(views)

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, outputs: tuple, inputs: tuple, max_clusters: Int32,
                 stream):
        self._launch(a, view(b, self.b_spec, ("N", "K", "L"), pad_batch=True), outputs, inputs,
                     max_clusters, stream)

    def _b_halves(self, b, up_offset):
        """A gated kernel's B halves, each (N, K, L) with N half of ``b``'s width: the gate half at
        ``b``'s start, the up half ``up_offset`` elements on. The host passes an offset that keeps
        the up half 16-byte aligned, as TMA needs (the gate half's offset ``N`` times the width's
        stride, or a padded copy's), so the alignment is assumed here, not checked."""
        whole = view(b, whole_spec(self.b_spec), ("G", "K", "L"), pad_batch=True)
        width, k, batches = whole.shape
        layout = cute.make_layout((width // 2, k, batches), stride=whole.stride)
        up = whole.iterator + cute.assume(up_offset, divby=self.b_spec.align_elems())
        return cute.make_tensor(whole.iterator, layout), cute.make_tensor(up, layout)

    def _scale_views(self, a_scales, b_scales):
        """Block scales as the kernel reads them: a's (M or M/128, K/128, L), b's (N/128, K/128, L)."""
        a_spec, b_spec = self.scale_specs
        rows = "M" if "M" in a_spec.dims else "MB"
        return (view(a_scales, a_spec, (rows, "KB", "L"), pad_batch=True),
                view(b_scales, b_spec, ("NB", "KB", "L"), pad_batch=True))

    def _launch(self, a, mB, outputs, inputs, max_clusters, stream, split=(), scales=()):
        """The body of the entry point, traced inline (``mB``: the kernel's view of B; ``split``:
        split-K's (splits, partials, counters), or nothing; ``scales``: block scales' views)."""
        mA = view(a, self.a_spec, ("M", "K", "L"), pad_batch=True)
        finish_args = sum(self.finished) + (1 if self.finished else 0)
        n_tiles = len(outputs) - self.workspaces - finish_args
        if cutlass.const_expr(n_tiles > 0):
            mD = view(outputs[0], self.out_specs[0], ("M", "N", "L"), pad_batch=True)
        else:
            mD = self._placeholder_d(mA, mB, outputs[0])
        aux_modes = ("M", "N", "L") if self.batched else ("M", "N")
        epi_args = self._input_views(inputs) + tuple(view(t, spec, aux_modes)
                  for t, spec in zip(outputs[1:n_tiles], self.out_specs[1:n_tiles], strict=True))
        # A reduction's flat workspace (partials, then one spare element) with the sizes the kernel
        # indexes it by.
        m, n, batches = mD.shape
        tile_m, tile_n = self.kernel.shape.tile
        tiles_m = (m + tile_m - 1) // tile_m
        tiles_n = (n + tile_n - 1) // tile_n
        workspaces = outputs[n_tiles:n_tiles + self.workspaces]
        epi_args = epi_args + tuple((t, m, n, tiles_m, tiles_n) for t in workspaces)
        if cutlass.const_expr(self.finished):
            counters = outputs[-1]
            first = n_tiles + self.workspaces
            for count in self.finished:
                epi_args = epi_args + ((counters, tuple(outputs[first:first + count]), m, n, tiles_m,
                                        tiles_n, batches),)
                first += count
        self.kernel(mA, mB, mD, epi_args, max_clusters, stream, split, scales)


    def _placeholder_d(self, mA, mB, workspace):
        """An epilogue of reductions only writes no D, but the kernel still takes D's shape (its
        tile scheduler, its TMA descriptor, which is never used): a view of that shape over the
        first workspace's address, with strides that are legal for TMA (16-byte multiples) and
        small (batches overlap: nothing is ever read or written through it)."""
        m, _, batches = mA.shape
        n = (mB[0] if cutlass.const_expr(isinstance(mB, tuple)) else mB).shape[0]
        row = (n + 7) // 8 * 8
        layout = cute.make_layout((m, n, batches), stride=(row, 1, row))
        return cute.make_tensor(cute.recast_ptr(workspace.iterator, dtype=self.kernel.d_dtype), layout)


class GatedLauncher(Launcher):
    """The entry point of a gated kernel: ``b`` is the user's whole weight (its width is the gate
    and up halves, twice the output's N) and ``up_offset`` where its up half starts, in elements
    (see :meth:`Launcher._b_halves`)."""

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, up_offset: Int64, outputs: tuple, inputs: tuple,
                 max_clusters: Int32, stream):
        self._launch(a, self._b_halves(b, up_offset), outputs, inputs, max_clusters, stream)


class SplitLauncher(Launcher):
    """The entry point of a split-K kernel: after ``max_clusters``, the number of splits of K, the
    float32 partials workspace and the int32 counters (zero between launches); sizes in
    :mod:`evtc.plan.split_k`."""

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, outputs: tuple, inputs: tuple, max_clusters: Int32,
                 splits: Int32, partials: cute.Tensor, counters: cute.Tensor, stream):
        self._launch(a, view(b, self.b_spec, ("N", "K", "L"), pad_batch=True), outputs, inputs,
                     max_clusters, stream, (splits, partials, counters))


class GatedSplitLauncher(Launcher):
    """:class:`GatedLauncher` with split-K (as :class:`SplitLauncher`)."""

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, up_offset: Int64, outputs: tuple, inputs: tuple,
                 max_clusters: Int32, splits: Int32, partials: cute.Tensor, counters: cute.Tensor, stream):
        self._launch(a, self._b_halves(b, up_offset), outputs, inputs, max_clusters, stream,
                     (splits, partials, counters))


class ScaledLauncher(Launcher):
    """The entry point of a block-scaled float8 kernel: ``a`` and ``b`` are (tensor, scales) pairs
    (:mod:`evtc.ir.block_scales`)."""

    @cute.jit
    def __call__(self, a: tuple, b: tuple, outputs: tuple, inputs: tuple, max_clusters: Int32, stream):
        self._launch(a[0], view(b[0], self.b_spec, ("N", "K", "L"), pad_batch=True), outputs, inputs,
                     max_clusters, stream, scales=self._scale_views(a[1], b[1]))


class ScaledSplitLauncher(Launcher):
    """:class:`ScaledLauncher` with split-K (as :class:`SplitLauncher`)."""

    @cute.jit
    def __call__(self, a: tuple, b: tuple, outputs: tuple, inputs: tuple, max_clusters: Int32,
                 splits: Int32, partials: cute.Tensor, counters: cute.Tensor, stream):
        self._launch(a[0], view(b[0], self.b_spec, ("N", "K", "L"), pad_batch=True), outputs, inputs,
                     max_clusters, stream, (splits, partials, counters), self._scale_views(a[1], b[1]))


class ScaledGatedLauncher(Launcher):
    """:class:`ScaledLauncher` of a gated kernel: ``b`` is (the whole weight, its scales), the scales
    covering the whole weight, and ``up_offset`` as for :class:`GatedLauncher`."""

    @cute.jit
    def __call__(self, a: tuple, b: tuple, up_offset: Int64, outputs: tuple, inputs: tuple,
                 max_clusters: Int32, stream):
        self._launch(a[0], self._b_halves(b[0], up_offset), outputs, inputs, max_clusters, stream,
                     scales=self._scale_views(a[1], b[1]))


class ScaledGatedSplitLauncher(Launcher):
    """:class:`ScaledGatedLauncher` with split-K (as :class:`SplitLauncher`)."""

    @cute.jit
    def __call__(self, a: tuple, b: tuple, up_offset: Int64, outputs: tuple, inputs: tuple,
                 max_clusters: Int32, splits: Int32, partials: cute.Tensor, counters: cute.Tensor, stream):
        self._launch(a[0], self._b_halves(b[0], up_offset), outputs, inputs, max_clusters, stream,
                     (splits, partials, counters), self._scale_views(a[1], b[1]))


def entry_point(gated: bool, split_k: bool, scaled: bool = False) -> type[Launcher]:
    """The entry point class of a kernel."""
    if scaled:
        return {(False, False): ScaledLauncher, (True, False): ScaledGatedLauncher,
                (False, True): ScaledSplitLauncher, (True, True): ScaledGatedSplitLauncher}[(gated, split_k)]
    return {(False, False): Launcher, (True, False): GatedLauncher,
            (False, True): SplitLauncher, (True, True): GatedSplitLauncher}[(gated, split_k)]


def fake_split_args():
    """Compile-time placeholders of split-K's (splits, partials, counters)."""
    from cutlass.cute.runtime import make_fake_tensor

    partials = make_fake_tensor(cutlass.Float32, (cute.sym_int32(symbol="P"),), (1,), assumed_align=16)
    counters = make_fake_tensor(cutlass.Int32, (cute.sym_int32(symbol="Q"),), (1,), assumed_align=4)
    return Int32(1), partials, counters


__all__ = ["GatedLauncher", "GatedSplitLauncher", "Launcher", "ScaledGatedLauncher",
           "ScaledGatedSplitLauncher", "ScaledLauncher", "ScaledSplitLauncher",
           "SplitLauncher", "Symbols", "entry_point",
           "fake_split_args", "fake_tensor", "view", "whole_spec"]
