"""Checks of a compiled kernel's call arguments, with messages that name the argument and the rule.

They run only when a call is rejected (the compiled code checks the same rules first, cheaply), or
on a machine without a GPU, so they cost nothing on the fast path.
"""

from __future__ import annotations

import torch

from evtc.errors import CallError


def check_tensor(name: str, t, spec, dtype: torch.dtype, sizes: dict, *, layout: bool = True) -> None:
    """Raise a CallError unless ``t`` fits ``spec`` (checks the kernel also makes, with messages).
    ``layout=False`` leaves out strides and alignment (which the staged path handles)."""
    if not isinstance(t, torch.Tensor):
        raise CallError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != spec.rank:
        raise CallError(f"{name} must be {spec.rank}-d like its example ({', '.join(spec.dims)}), got shape "
                        f"{tuple(t.shape)}")
    if t.dtype != dtype:
        raise CallError(f"{name} must be {dtype} (as compiled), got {t.dtype}")
    want = tuple(1 if d == "1" else sizes[d] for d in spec.dims)
    if tuple(t.shape) != want:
        dims = ", ".join(spec.dims)
        raise CallError(f"{name} has shape {tuple(t.shape)}, inconsistent with a and b: expected ({dims}) = "
                        f"{want}")
    if layout and spec.contiguous is not None:
        strides = t.stride()
        c = spec.contiguous
        if strides[c] != 1 and t.shape[c] > 1:
            raise CallError(f"{name} must be contiguous along {spec.dims[c]} (stride 1, as compiled), got "
                            f"strides {strides}")
        align = spec.align_elems()
        for i, d in enumerate(spec.dims):
            if i != c and d != "1" and t.shape[i] > 1 and strides[i] % align:
                raise CallError(
                    f"{name} has strides {strides}: stride {i} must be a multiple of {align} elements "
                    f"(16 bytes, TMA's rule); make it contiguous or pad the rows"
                )
        if t.data_ptr() % 16:
            raise CallError(f"{name}'s data pointer is not 16-byte aligned (TMA needs 16 bytes; a view "
                            f"offset by {t.storage_offset()} elements); pass a copy (.clone())")


def check_device(name: str, t, device) -> None:
    if t.device != device:
        raise CallError(f"{name} is on {t.device} but a is on {device}: all tensors must share a device")
