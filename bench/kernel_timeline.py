"""Where a launch's time goes inside the kernel: per-CTA timestamps of its phases.

The SM90 kernel (``evtc/sm90/gemm.py``) is loaded with timestamp stores added at fixed places (a
text edit of its source, in this process only): ``clock64`` (the SM's cycle counter) at the entry,
after the barrier inits, before and after the first A/B load, at the first full stage a consumer
sees, halfway through and at the end of the mainloop, after the epilogue and after the last store;
``%globaltimer`` at the entry and exit, to see how far apart the CTAs start and end. Each CTA's
stamps go to a row of a torch buffer whose address is compiled into the kernel. The problem runs
over weight copies that stream from HBM, as a model's next layer would read them, and the table
gives each phase's cycles over all CTAs of all timed calls (median, 10th and 90th percentile, max).

    python3 bench/kernel_timeline.py 1x4608x3584 64x3584x3584
    python3 bench/kernel_timeline.py --epilogue bias 1x4608x3584
    python3 bench/kernel_timeline.py --compile-only 1x4608x3584      # no GPU: build and check the PTX

Only the default launch of each problem, one tile per CTA in mind (decode sizes): a CTA that runs
several tiles stamps its first tile's mainloop and its last tile's epilogue. The stamps cost a few
global stores per CTA; compare phases, not this bench's total time with other benches'.
Not a test of the kernel: a diagnostic (the 2026-11-29 section of docs/performance.md shows what
it found).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import tempfile
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

KERNEL_SOURCE = Path(__file__).resolve().parents[1] / "evtc" / "sm90" / "gemm.py"
SLOTS = 32  # int64 stamps per CTA
MAX_CTAS = 1024

# Stamp slots. ENTRY_* and EXIT_* by thread 0 / the first store warp, PRODUCER_* by the A/B load
# warp, CONSUMER_* by the first thread of the consumer warpgroup that runs the CTA's first tile.
ENTRY_TIMER, ENTRY, SM_ID, INITS_DONE = 0, 1, 2, 3
PRODUCER_FIRST_ACQUIRE, PRODUCER_FIRST_ISSUED, PRODUCER_HALF_ISSUED, PRODUCER_DONE = 4, 5, 6, 7
CONSUMER_FIRST_FULL, CONSUMER_HALF, CONSUMER_LAST_FULL, MAINLOOP_DONE = 8, 9, 10, 11
EPILOGUE_DONE, EXIT, EXIT_TIMER = 12, 13, 14

# (phase, from slot, to slot), in the order a CTA goes through them
PHASES = (
    ("entry -> barrier inits seen", ENTRY, INITS_DONE),
    ("inits -> first stage acquired", INITS_DONE, PRODUCER_FIRST_ACQUIRE),
    ("first acquire -> A and B issued", PRODUCER_FIRST_ACQUIRE, PRODUCER_FIRST_ISSUED),
    ("first issue -> first full stage", PRODUCER_FIRST_ISSUED, CONSUMER_FIRST_FULL),
    ("first full -> half of K", CONSUMER_FIRST_FULL, CONSUMER_HALF),
    ("half of K -> last full stage", CONSUMER_HALF, CONSUMER_LAST_FULL),
    ("last stage -> mainloop done", CONSUMER_LAST_FULL, MAINLOOP_DONE),
    ("mainloop done -> epilogue done", MAINLOOP_DONE, EPILOGUE_DONE),
    ("epilogue done -> exit", EPILOGUE_DONE, EXIT),
    ("entry -> exit", ENTRY, EXIT),
    ("producer: half of K -> all issued", PRODUCER_HALF_ISSUED, PRODUCER_DONE),
)


def _store(slot: int, value: str = "cute.arch.clock64()") -> str:
    return f"_stamps[_stamp_row, {slot}] = {value}"


def _block(indent: int, condition: str, *lines: str) -> str:
    pad = " " * indent
    return f"{pad}if {condition}:\n" + "".join(f"{pad}    {line}\n" for line in lines)


SETUP = (
    "        _stamps = cute.make_tensor(\n"
    "            cute.make_ptr(cutlass.Int64, _STAMPS_ADDRESS, cute.AddressSpace.gmem, assumed_align=8),\n"
    f"            cute.make_layout((_STAMPS_ROWS, {SLOTS}), stride=({SLOTS}, 1)))\n"
    "        _bx, _by, _bz = cute.arch.block_idx()\n"
    "        _gx, _gy, _gz = cute.arch.grid_dim()\n"
    "        _stamp_row = _bx + _gx * (_by + _gy * _bz)\n"
    "        _lane = cute.arch.lane_idx()\n"
    + _block(8, "tidx == 0", _store(ENTRY_TIMER, "cute.arch.globaltimer()"), _store(ENTRY),
             _store(SM_ID, "cutlass.Int64(Int32(nvvm.read_ptx_sreg_smid(cutlass.Int32.mlir_type)))"))
)

# (text in gemm.py, what follows it); each text must occur exactly once
EDITS = (
    ("        warp_group = cute.arch.make_warp_uniform(tidx // WARPGROUP_THREADS)\n", SETUP),
    ("        pipeline_init_wait(cluster_shape_mn=cluster_layout)\n",
     _block(8, "tidx == 0", _store(INITS_DONE))),
    ("                        ab_pipeline.producer_acquire(state)\n",
     _block(24, "_lane == 0", "if kk == 0:", "    " + _store(PRODUCER_FIRST_ACQUIRE))),
    ("                        ab_pipeline.producer_commit(state)\n",
     _block(24, "_lane == 0", "if kk == 0:", "    " + _store(PRODUCER_FIRST_ISSUED),
            "if kk == k_count // 2:", "    " + _store(PRODUCER_HALF_ISSUED))),
    ("                # Do not exit while peers may still release stages into our barriers.\n",
     _block(16, "_lane == 0", _store(PRODUCER_DONE))),
    ("                    ab_pipeline.consumer_wait(read_state)\n"
     "                    warpgroup.fence()\n"
     "                    tiled_mma.set(warpgroup.Field.ACCUMULATE, False)\n",
     _block(20, "epi_tidx == 0", "if tiles_done == 0:", "    " + _store(CONSUMER_FIRST_FULL))),
    ("                    for _k in cutlass.range(1, k_count, unroll=1):\n"
     "                        ab_pipeline.consumer_wait(read_state)\n",
     _block(24, "epi_tidx == 0", "if tiles_done == 0:",
            "    if _k == k_count // 2:", "        " + _store(CONSUMER_HALF),
            "    if _k == k_count - 1:", "        " + _store(CONSUMER_LAST_FULL))),
    ("                    warpgroup.wait_group(0)\n"
     "                    ab_pipeline.consumer_release(release_state)\n"
     "                    release_state.advance()\n",
     _block(20, "epi_tidx == 0", "if tiles_done == 0:", "    " + _store(MAINLOOP_DONE))),
    ("                    self.visitor.end(ctx, vstate)\n",
     _block(20, "epi_tidx == 0", _store(EPILOGUE_DONE))),
    ("                    store_pipeline.producer_tail()\n",
     _block(20, "_lane == 0", _store(EXIT), _store(EXIT_TIMER, "cute.arch.globaltimer()"))),
)


def stamped_source() -> str:
    """gemm.py with the stamps added; names the anchor that no longer matches if gemm.py moved on."""
    source = KERNEL_SOURCE.read_text()
    for anchor, addition in EDITS:
        count = source.count(anchor)
        if count != 1:
            raise SystemExit(f"kernel_timeline: this text occurs {count} times in {KERNEL_SOURCE} "
                             f"(must be once; update EDITS):\n{anchor}")
        source = source.replace(anchor, anchor + addition)
    return source


def _digest() -> str:
    """Names the stamped kernel's source file, the same in every process."""
    return hashlib.sha256(stamped_source().encode()).hexdigest()[:16]


def install_stamped_kernel(buffer: torch.Tensor) -> None:
    """Make ``evtc.sm90.gemm`` the stamped kernel, writing into ``buffer`` (kernels built after the
    call; build them into a cache directory of this process's own, see :func:`main`)."""
    import evtc.sm90.gemm  # noqa: F401  (its own imports first)

    # The DSL reads a kernel's source file to preprocess it: the stamped text must be on disk.
    path = Path(tempfile.gettempdir()) / f"evtc_kernel_timeline_{_digest()}.py"
    path.write_text(stamped_source())
    module = types.ModuleType("evtc.sm90.gemm")
    module.__file__ = str(path)
    module._STAMPS_ADDRESS = buffer.data_ptr()
    module._STAMPS_ROWS = buffer.numel() // SLOTS
    sys.modules["evtc.sm90.gemm"] = module
    exec(compile(path.read_text(), str(path), "exec"), module.__dict__)


def identity(acc):
    return acc


def bias(acc, bias):
    return acc + bias


def residual(acc, C):
    return acc + C


EPILOGUES = {"identity": identity, "bias": bias, "residual": residual}


def operands_for(epilogue: str, m: int, n: int, device) -> dict:
    if epilogue == "bias":
        return {"bias": torch.randn(n, device=device, dtype=torch.bfloat16)}
    if epilogue == "residual":
        return {"C": torch.randn(m, n, device=device, dtype=torch.bfloat16)}
    return {}


def percentiles(values: list[int]) -> tuple[int, int, int, int]:
    values = sorted(values)
    at = lambda f: values[min(len(values) - 1, int(f * len(values)))]  # noqa: E731
    return at(0.5), at(0.1), at(0.9), values[-1]


def timeline(kernel, x, weights, operands, stamps: torch.Tensor, rounds: int) -> list[torch.Tensor]:
    """The stamps of every call after a first round over the weight copies (one (CTAs, SLOTS)
    tensor per call, rows of CTAs that did not run left out)."""
    calls = []
    for round_ in range(rounds + 1):
        for w in weights:
            stamps.zero_()
            kernel(x, w.t(), **operands)
            torch.cuda.synchronize()
            if round_:
                table = stamps.view(-1, SLOTS).cpu()
                calls.append(table[table[:, ENTRY] != 0])
    return calls


def report(calls: list[torch.Tensor]) -> None:
    print(f"{'phase (cycles; all CTAs of all calls)':36s} {'median':>8s} {'p10':>8s} {'p90':>8s} {'max':>8s}")
    for name, start, end in PHASES:
        spans = [int(t[i, end] - t[i, start]) for t in calls for i in range(len(t))
                 if t[i, start] and t[i, end]]
        if spans:
            print(f"{name:36s} " + " ".join(f"{v:8d}" for v in percentiles(spans)))
    starts = [int(v) for t in calls for v in t[:, ENTRY_TIMER] - t[:, ENTRY_TIMER].min()]
    ends = [int(v) for t in calls for v in t[:, EXIT_TIMER] - t[:, ENTRY_TIMER].min() if v > 0]
    print(f"CTAs per call {len(calls[0])}, SMs {len(set(int(v) for v in calls[0][:, SM_ID]))}; "
          f"CTA start after the first: median {statistics.median(starts):.0f} ns, max {max(starts)} ns; "
          f"CTA exit: median {statistics.median(ends):.0f} ns, max {max(ends)} ns")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("shapes", nargs="*", default=["1x4608x3584"], help="M x N x K problems, bf16")
    p.add_argument("--epilogue", choices=sorted(EPILOGUES), default="identity")
    p.add_argument("--rounds", type=int, default=6, help="timed rounds over the weight copies")
    p.add_argument("--compile-only", action="store_true",
                   help="no GPU: build each problem's launch and check its PTX holds the stamps")
    args = p.parse_args()
    device = "cpu" if args.compile_only else "cuda"
    stamps = torch.zeros(MAX_CTAS * SLOTS, dtype=torch.int64, device=device)
    install_stamped_kernel(stamps)

    import evtc
    from evtc.runtime.invoke import built_config

    fn = EPILOGUES[args.epilogue]
    # A cache of this process's own: the buffer's address is compiled into the kernel, so a kernel
    # built by an earlier run would write where that run's buffer was.
    cache = Path(tempfile.mkdtemp(prefix="evtc_kernel_timeline_cache_"))
    for shape in args.shapes:
        m, n, k = (int(v) for v in shape.split("x"))
        if args.compile_only:
            meta = lambda *s: torch.empty(*s, dtype=torch.bfloat16, device="meta")  # noqa: E731
            example = {"a": meta(8, 64), "b": meta(128, 64).t(), **{
                name: meta(*t.shape) for name, t in operands_for(args.epilogue, 8, 128, "cpu").items()}}
            kernel = evtc.compile(fn, example, arch="sm_90a", cache_dir=cache)
            config, splits = kernel.launch_for(m, n, k)
            ptx = kernel._variant(built_config(config, splits)).ptx
            print(f"{shape}: {config.short_name()} splits {splits}: {ptx.count('%clock64')} clock64 "
                  f"reads, {ptx.count('%globaltimer')} globaltimer reads")
            continue
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        copies = max(2, (256 << 20) // (n * k * 2) + 1)
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        operands = operands_for(args.epilogue, m, n, "cuda")
        kernel = evtc.compile(fn, {"a": x, "b": weights[0].t(), **operands}, cache_dir=cache)
        config, splits = kernel.launch_for(m, n, k)
        print(f"\n{args.epilogue} {shape}: {config.short_name()}, {splits} split(s) of K")
        report(timeline(kernel, x, weights, operands, stamps, args.rounds))


if __name__ == "__main__":
    main()
