"""The static description of one tensor argument of a kernel (plain data, no imports of the IR)."""

from __future__ import annotations

from dataclasses import dataclass

from evtc.plan.config import DTYPE_BYTES

TMA_ALIGN = 16  # bytes: TMA's rule for strides and base addresses


@dataclass(frozen=True)
class TensorSpec:
    """A tensor argument: ``dims`` names each torch dim (``"L" "M" "N" "K"`` or ``"1"``);
    ``contiguous`` is the index of the unit-stride dim (None for a one-element tensor)."""

    name: str
    dtype: str
    dims: tuple[str, ...]
    contiguous: int | None

    @property
    def rank(self) -> int:
        return len(self.dims)

    def align_elems(self) -> int:
        return max(1, TMA_ALIGN // DTYPE_BYTES[self.dtype])

    def describe(self) -> str:
        shape = ", ".join(self.dims)
        if self.contiguous is None:
            return f"{self.name}: {self.dtype}[{shape}]"
        return f"{self.name}: {self.dtype}[{shape}], {self.dims[self.contiguous]} contiguous"


__all__ = ["TMA_ALIGN", "TensorSpec"]
