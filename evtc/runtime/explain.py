"""``Kernel.explain()``: a kernel described for a reader, from its plan, its configuration and what
ptxas says of its registers."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from evtc.ir.dtypes import MASK_D_NOTE
from evtc.plan.config import SM90_SMEM_BYTES, GemmConfig
from evtc.plan.operand_kinds import KINDS
from evtc.plan.selector import is_one_wave_twin
from evtc.runtime import reductions

if TYPE_CHECKING:
    from evtc.runtime.kernel import Kernel


def twin_buffers(config: GemmConfig, compiled: GemmConfig) -> str:
    """What a one-wave twin (evtc.plan.selector.one_wave_twins) changes, for explain(): its D
    buffers and its loads' depth; nothing for other configurations."""
    if not is_one_wave_twin(config, compiled):
        return ""
    loads = f", loads {config.load_stages} deep" if config.load_stages is not None else ""
    return f" {config.epi_stages} D buffers{loads}"


def explain(kernel: Kernel) -> str:
    """A summary: operands and their kinds, outputs, tile configuration, stages, shared memory,
    registers (from ptxas, when it is installed)."""

    cfg = kernel.config
    lines = [f"evtc kernel {kernel.plan.name!r} ({kernel.origin}, {kernel.seconds:.2f} s)"]
    if kernel.interface.unused:
        lines.append(f"  unused parameters (accepted and ignored): {sorted(kernel.interface.unused)}")
    if kernel.interface.constants:
        fixed = ", ".join(f"{name}={value!r}" for name, value in kernel.interface.constants)
        lines.append(f"  compile-time constants: {fixed}")
    if cfg is None:
        lines.append(f"  no SM90 kernel: {kernel.interface.torch_only}; every call runs torch.matmul "
                     "and evaluates the epilogue graph with torch")
        return "\n".join(lines)
    if kernel.interface.strict:
        lines.append("  strict: calls that would need aligned copies or the torch path raise")
    gemm = cfg.short_name()
    if kernel.plan.outputs and kernel.plan.outputs[0].dtype == "bool":
        gemm += f" ({MASK_D_NOTE})"  # the configuration names D's storage
    lines.append(f"  GEMM: {gemm}; a {kernel.plan.a.describe()}, b {kernel.plan.b.describe()}")
    if kernel.chooses_clusters:
        def shape(c: GemmConfig) -> str:
            tile = "" if (c.schedule, c.tile_m, c.tile_n) == (cfg.schedule, cfg.tile_m, cfg.tile_n) \
                else f"{c.tile_m}x{c.tile_n}{' cooperative' if c.schedule != cfg.schedule else ''} "
            return (f"{tile}{c.cluster[0]}x{c.cluster[1]}" + (" split-K" if c.split_k else "")
                    + (f" {c.a_rows} rows of A" if c.a_rows is not None else "")
                    + twin_buffers(c, cfg))

        built = ", ".join(shape(c) for c in kernel.built_configs if c != cfg) or "none yet"
        # dict.fromkeys: a tile's one-wave twin (evtc.plan.selector.one_wave_twins) names it again.
        tiles = ", ".join(dict.fromkeys(f"{c.tile_m}x{c.tile_n}"
                                        + (" " + c.schedule if c.schedule != cfg.schedule else "")
                                        for c in kernel.family))
        twins = [c for c in kernel.family if is_one_wave_twin(c, cfg)]
        if twins:
            tiles += (" (" + ", ".join(f"{c.tile_m}x{c.tile_n}" for c in twins)
                      + " with fewer epilogue buffers and one more A/B stage where each CTA runs one "
                      "tile)")
        lines.append(f"  cluster: {cfg.cluster[0]}x{cfg.cluster[1]}, or per call another shape where "
                     f"that needs fewer waves of tiles; tile per call from {tiles}; K split where "
                     f"too few tiles fill the GPU, or for a thin last round of tiles (other shapes "
                     f"built: {built})")
    lines.append("  inputs:")
    for plan in kernel.plan.inputs:
        spec, how = plan.spec, KINDS[plan.kind].how
        if plan.kind == "arg":
            lines.append(f"    {plan.name}: {how}")
        elif plan.kind == "literal":
            lines.append(f"    {plan.ident} = {plan.name}: {how}")
        else:
            batch = "per batch" if plan.batched else "shared by all batches"
            lines.append(f"    {spec.describe()}: {plan.kind}, {batch}; {how}")
    lines.append("  outputs:")
    for plan in kernel.plan.reductions:
        axis = {"row": "per row", "col": "per column", "batch": "per batch",
                "all": "over everything"}[plan.axis]
        parts = "per column of each tile" if plan.axis == "col" else "per row of each tile"
        if kernel.plan.kernel_finish:
            where = "finished in the kernel by the last tile of each block of " + {
                "row": "rows", "col": "columns", "batch": "rows, then the last block of each batch",
                "all": "rows, then the last block of the launch"}[plan.axis]
            where += f" (on the host above {reductions.KERNEL_FINISH_MAX_OUTPUT:,} output elements)"
        else:
            where = "finished on the host"
        lines.append(f"    {plan.ident}: {plan.op} {axis}: partials {parts} in the kernel "
                     f"(float32 workspace), {where}")
    for i, spec in enumerate(kernel.plan.outputs):
        how = "stmatrix" if spec.dtype in ("float16", "bfloat16") else "register-to-shared copy"
        role = f"kernel D store ({how} + TMA)" if i == 0 else "extra TMA store"
        lines.append(f"    {spec.describe()}: {role}")
    stages, smem = kernel.stages, kernel.smem
    if stages:
        d_text = (f"D in the {stages['load']} load stages (written where C was read)"
                  if stages.get("d_in_load") else f"D {stages['d']}")
        lines.append(f"  stages: A/B {stages['ab']}, {d_text}, epilogue loads {stages['load']}")
    if smem:
        lines.append(f"  shared memory: epilogue operands {smem['visitor']} B, epilogue loads "
                     f"{smem['load_bytes_per_subtile']} B per subtile (of {SM90_SMEM_BYTES} B)")
    lines.append(f"  registers: {registers(kernel.ptx)}")
    lines.append(f"  cache: {kernel.cache_path}")
    return "\n".join(lines)


def registers(ptx: str) -> str:
    """What ptxas reports of the kernel's registers and spills (and the wgmma serialisations it
    injected), or why that is unknown."""
    ptxas = shutil.which("ptxas")
    if ptxas is None or not ptx:
        return "unknown (ptxas not installed); producer 40 / consumers 232 by setmaxnreg"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        try:
            cmd = [ptxas, "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"unknown (ptxas failed: {exc})"
    lines = out.stderr.splitlines()
    # ptxas reports (C7517/C7519) where it serializes wgmma around register use: worth knowing,
    # not worth its full text.
    injected = sum(1 for line in lines if "C7517" in line or "C7519" in line)
    report = " ".join(line.split("info    : ")[-1].strip() for line in lines
                      if ("registers" in line or "spill" in line) and "C751" not in line)
    note = f"; ptxas injected {injected} wgmma wait(s)/arrive(s)" if injected else ""
    return (report or "unknown") + note + "; producer 40 / consumers 232 by setmaxnreg"


__all__ = ["explain", "registers", "twin_buffers"]
