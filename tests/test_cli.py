"""`python -m evtc`: demo, show and cache, on a CPU (kernels compile for sm_90a; the demo checks the
reference path instead of running the kernel)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from evtc.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv("EVTC_CACHE_DIR", str(path))
    return path


def test_demo_runs_as_a_module(cache_dir, tmp_path):
    picture = tmp_path / "demo.svg"
    out = subprocess.run([sys.executable, "-m", "evtc", "demo", "--picture", str(picture)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "def bias_gelu_residual(acc, bias, residual, alpha: float):" in text   # the epilogue
    assert "store D0" in text and "F.gelu(alpha * acc + bias)" in text            # the graph
    assert "class BiasGeluResidualEpilogue(FusedVisitor):" in text                # the source
    assert "GEMM: f16->f16" in text and "PTX:" in text and "wgmma.mma_async" in text
    if not _gpu():
        assert "reference check on the CPU" in text and "(ok)" in text
    root = ET.parse(picture).getroot()
    assert root.tag.endswith("svg") and len(list(root.iter("{http://www.w3.org/2000/svg}rect"))) > 5


def _gpu() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


USER_FILE = textwrap.dedent('''
    import torch
    import torch.nn.functional as F


    def scaled_silu(acc, bias, scale: float):
        return F.silu(acc * scale + bias)


    def with_inputs(acc, C, s):
        return acc + C * s


    with_inputs_inputs = dict(
        a=torch.empty(128, 64, dtype=torch.bfloat16, device="meta"),
        b=torch.empty(64, 256, dtype=torch.bfloat16, device="meta"),
        C=torch.empty(128, 256, dtype=torch.bfloat16, device="meta"),
        s=torch.empty(1, dtype=torch.float32, device="meta"),
    )
''')


def test_show_prints_graph_source_and_ptx_statistics(cache_dir, tmp_path, capsys):
    user = tmp_path / "my_epilogues.py"
    user.write_text(USER_FILE)
    picture = tmp_path / "g.dot"
    assert main(["show", f"{user}:scaled_silu", "--kind", "bias=row", "--picture", str(picture)]) == 0
    text = capsys.readouterr().out
    assert "bias: (512,)" in text and "scale: scalar" in text
    assert "F.silu(acc * scale + bias)" in text and "class ScaledSiluEpilogue(FusedVisitor):" in text
    assert "RowVector('bias'" in text and "ArgScalar('scale')" in text
    assert "PTX:" in text and "TMA stores" in text
    assert picture.read_text().startswith('digraph "scaled_silu"')
    # A module-level <function>_inputs is used as the example inputs.
    assert main(["show", f"{user}:with_inputs"]) == 0
    text = capsys.readouterr().out
    # s is a float32 (1,) tensor: torch promotes acc + C * s to float32, and so does the kernel.
    assert "example inputs from with_inputs_inputs" in text and "bf16->f32" in text
    assert "DeviceScalar('s'" in text


def test_show_and_cache_errors_are_clear(cache_dir, tmp_path, capsys):
    user = tmp_path / "my_epilogues.py"
    user.write_text(USER_FILE)
    with pytest.raises(SystemExit, match="path/to/file.py:function"):
        main(["show", "no_colon"])
    with pytest.raises(SystemExit, match="no such file"):
        main(["show", "missing.py:f"])
    with pytest.raises(SystemExit, match="has no function 'nope'"):
        main(["show", f"{user}:nope"])
    with pytest.raises(SystemExit, match="does not take"):
        main(["show", f"{user}:scaled_silu", "--kind", "C=row"])
    with pytest.raises(SystemExit, match="NAME=KIND"):
        main(["show", f"{user}:scaled_silu", "--kind", "bias=vector"])


def test_cache_lists_and_clears(cache_dir, tmp_path, capsys):
    user = tmp_path / "my_epilogues.py"
    user.write_text(USER_FILE)
    from evtc.compile import clear_memory_cache

    clear_memory_cache()  # so the kernel lands in this test's cache directory
    assert main(["show", f"{user}:scaled_silu"]) == 0
    capsys.readouterr()
    assert main(["cache", "list"]) == 0
    text = capsys.readouterr().out
    assert f"{cache_dir}: 1 kernel(s)" in text and "scaled_silu" in text and "sm_90a" in text
    assert main(["cache", "clear"]) == 0
    assert "removed 1 kernel(s)" in capsys.readouterr().out
    assert main(["cache", "list"]) == 0
    assert ": 0 kernel(s)" in capsys.readouterr().out


def test_cache_dir_goes_before_or_after_the_command(cache_dir, tmp_path, capsys):
    """`--cache-dir` is read before the command and after it; unset after it, the one before holds."""
    other = tmp_path / "other-cache"
    other.mkdir()
    assert main(["cache", "list", "--cache-dir", str(other)]) == 0
    assert f"{other}: 0 kernel(s)" in capsys.readouterr().out
    assert main(["--cache-dir", str(other), "cache", "list"]) == 0
    assert f"{other}: 0 kernel(s)" in capsys.readouterr().out
    assert main(["cache", "list"]) == 0
    assert f"{cache_dir}:" in capsys.readouterr().out


def test_cache_clear_removes_only_what_evtc_wrote(tmp_path, capsys):
    """`cache clear` on a directory of the user's own files (a mistyped --cache-dir) removes none of
    them, also folders whose names evtc uses (two letters, front/, build-*), and still removes the
    entries evtc wrote beside them."""
    from evtc.runtime.cache import DiskCache

    own = {"go/notes.txt", "ab/keep.py", "front/index.html", "build-output/app.bin", "locks/data.db"}
    for path in own:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("mine")
    entry = tmp_path / "cd" / ("cd" + "1" * 62)
    entry.mkdir(parents=True)
    (entry / "manifest.json").write_text("{}")
    assert main(["cache", "clear", "--cache-dir", str(tmp_path)]) == 0
    capsys.readouterr()
    for path in own:
        assert (tmp_path / path).read_text() == "mine", path
    assert not (tmp_path / "cd").exists()
    DiskCache(tmp_path).clear()
    assert all((tmp_path / path).exists() for path in own)


def test_bad_arguments_are_one_line_errors_before_any_compile(tmp_path):
    user = tmp_path / "listed.py"
    user.write_text("def good(acc, C):\n    return acc + C\n\ngood_inputs = [1, 2]\n")
    for argv, match in [(["demo", "--shape", "0x0x0"], "sizes of at least 1"),
                        (["demo", "--picture", "g.jpg"], r"\.svg, \.png or \.dot"),
                        (["demo", "--picture", str(tmp_path / "missing" / "g.svg")], "does not exist"),
                        (["show", f"{user}:good"], "good_inputs must be a dict")]:
        with pytest.raises(SystemExit, match=match):
            main(argv)


def test_cache_list_names_a_mask_d(cache_dir, capsys):
    """A kernel whose D is a mask: its configuration names the float8 storage of the mask's bytes,
    and the listing says the output is a torch.bool mask; a plain kernel's line does not."""
    import torch

    import evtc

    a, b = torch.randn(64, 64).half(), torch.randn(64, 128).half()
    for fn in (lambda acc: acc > 0, lambda acc: acc * 2):
        assert evtc.compile(fn, {"a": a, "b": b}, cache_dir=cache_dir).ptx  # built into the cache
    assert main(["cache", "list"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "d_dtype=" in line]
    assert len(lines) == 2
    masks = [line for line in lines if "D is a torch.bool mask" in line]
    assert len(masks) == 1 and "float8_e4m3fn" in masks[0]
