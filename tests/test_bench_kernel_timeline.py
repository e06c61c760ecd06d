"""bench/kernel_timeline.py without a GPU: its edits still find their places in evtc/sm90/gemm.py
(each anchor once), and the stamped kernel builds with every stamp in its PTX. The timings
themselves need the GPU (docs/performance.md, 2026-11-29)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from bench_modules import BENCH, bench_module


def test_every_edit_finds_its_place_once():
    with bench_module("kernel_timeline") as bench:
        source = bench.stamped_source()
        original = bench.KERNEL_SOURCE.read_text()
        assert len(source) > len(original)
        # Each slot named by a phase is written somewhere in the stamped kernel.
        for _, start, end in bench.PHASES:
            for slot in (start, end):
                assert f"_stamps[_stamp_row, {slot}] =" in source
        assert source.count("cute.arch.globaltimer()") == 2


def test_the_stamped_kernel_builds_with_its_stamps(tmp_path):
    # A process of its own: the bench replaces evtc.sm90.gemm in sys.modules.
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", TMPDIR=str(tmp_path))
    run = subprocess.run([sys.executable, str(BENCH / "kernel_timeline.py"), "--compile-only",
                          "--epilogue", "bias", "1x4608x3584"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    line = run.stdout.strip().splitlines()[-1]
    assert line.startswith("1x4608x3584: ") and "a8" in line, line
    clock_reads, timer_reads = (int(v) for v in re.findall(r"(\d+) (?:clock64|globaltimer) reads", line))
    with bench_module("kernel_timeline") as bench:
        stamped_slots = {slot for _, start, end in bench.PHASES for slot in (start, end)}
    assert clock_reads == len(stamped_slots) and timer_reads == 2
