"""What each kind of epilogue input is, in one place (plain Python: no CuTe DSL).

An input's kind says which of the problem's dims (M, N) it varies along, and that decides
everything the host does with it: how the kernel views it, which dim may be its contiguous one,
which device class (:mod:`evtc.sm90.operands`) loads it, whether it is a runtime scalar or a tensor,
and how ``Kernel.explain`` describes it. The frontend infers the kind from the example's shape
(:func:`kind_of`); the planner, the code generator, the call path and the command line read the rest
from :data:`KINDS`. A new kind is an entry here and its device class.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OperandKind:
    """One kind of epilogue input."""

    #: The kind's name in the IR and the plan.
    name: str
    #: The class of :mod:`evtc.sm90.operands` that reads it in the kernel.
    device_class: str
    #: Problem dims the tensor varies along (besides L); its contiguous dim is one of them.
    varying: tuple[str, ...] = ()
    #: Passed to the kernel as a float32 argument (a Python number, or a literal of the sizes).
    runtime_scalar: bool = False
    #: How the kernel reads it, for ``Kernel.explain``.
    how: str = ""

    @property
    def uniform(self) -> bool:
        """The same value for the whole tile: computed once per tile, not per element."""
        return not self.varying

    @property
    def staged_load(self) -> bool:
        """Loaded by TMA into staged shared-memory buffers (the epilogue-load pipeline): every
        kind that varies over the tile."""
        return bool(self.varying)

    @property
    def view_modes(self) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
        """Modes of the kernel's view of the tensor (with L, without L): the dims it varies
        along. None for kinds the kernel does not view as a tensor of the tile."""
        return ((*self.varying, "L"), self.varying) if self.varying else None

    def load_elems(self, epi_tile: tuple[int, int]) -> int:
        """Elements of one staged load (one subtile): the subtile's extent along each dim the kind
        varies along; 0 for kinds that are not loaded."""
        if not self.staged_load:
            return 0
        extent = {"M": epi_tile[0], "N": epi_tile[1]}
        elems = 1
        for dim in self.varying:
            elems *= extent[dim]
        return elems

    def example_shape(self, m: int, n: int) -> tuple[int, ...]:
        """The shape of an example tensor of this kind for an M x N output (``evtc`` on the
        command line builds its example inputs with it)."""
        return {(): (1,), ("N",): (n,), ("M",): (m, 1), ("M", "N"): (m, n)}[self.varying]


KINDS: dict[str, OperandKind] = {k.name: k for k in (
    OperandKind("tile", "TileLoad", ("M", "N"), how="TMA, staged per subtile"),
    OperandKind("row", "RowVector", ("N",), how="TMA, epi_n values per subtile"),
    OperandKind("col", "ColVector", ("M",), how="TMA, 128 values per subtile"),
    OperandKind("scalar", "DeviceScalar", how="one load per tile"),
    OperandKind("arg", "ArgScalar", runtime_scalar=True, how="runtime float32 scalar (kernel argument)"),
    OperandKind("literal", "ArgScalar", runtime_scalar=True, how="computed from the sizes at each call"),
)}

#: Kinds of tensor operands, named by which of (M, N) they vary along: the IR's
#: ``evtc.ir.graph.OPERAND_KINDS`` (not imported: this module is on the per-call path, which
#: never loads sympy).
TENSOR_KINDS = ("tile", "row", "col", "scalar")


def kind_of(varying: set[str] | frozenset[str]) -> str:
    """The kind of a tensor operand that varies along the problem dims ``varying`` ("M", "N")."""
    for kind in TENSOR_KINDS:
        if set(KINDS[kind].varying) == set(varying) & {"M", "N"}:
            return kind
    raise AssertionError(f"no operand kind varies along {sorted(varying)}")


__all__ = ["KINDS", "TENSOR_KINDS", "OperandKind", "kind_of"]
