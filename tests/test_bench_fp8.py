"""bench/fp8.py without a GPU: run_rows announces how many rows it will measure and closes with a
line, so that a run the DSL aborted part-way reads as cut short."""

from __future__ import annotations

import pytest
from bench_modules import bench_module


@pytest.fixture(scope="module")
def fp8():
    with bench_module("fp8") as module:
        yield module


def _fake_row(name, m, n, k):
    return (name, m, n, k, 1.0, 1.1, 1.2, 10.0, 1e-3, 2e-3)


def test_run_rows_counts_the_rows_before_and_after(fp8, capsys):
    rows = fp8.run_rows([64, 512], [], _fake_row, "ratios", "{:.2f} {:.2f} {:.2f}")
    out = capsys.readouterr().out.splitlines()
    assert rows and out[0] == f"# {len(rows)} rows to measure"
    assert out[-1] == f"# all {len(rows)} rows measured"
    assert {r[1] for r in rows} == {64, 512}


def test_a_row_that_ends_the_run_leaves_no_closing_line(fp8, capsys):
    def dies_on_the_third(name, m, n, k, seen=[]):  # noqa: B006 - a call counter
        seen.append(name)
        if len(seen) == 3:
            raise SystemExit(134)  # as an abort would end it: no Python error reaches the loop
        return _fake_row(name, m, n, k)

    with pytest.raises(SystemExit):
        fp8.run_rows([64], [], dies_on_the_third, "ratios", "{:.2f} {:.2f} {:.2f}")
    out = capsys.readouterr().out
    assert "rows to measure" in out and "rows measured" not in out


def test_bench_modules_leave_sys_path_and_modules_as_they_were():
    import sys

    from bench_modules import BENCH

    path, modules = list(sys.path), set(sys.modules)
    with bench_module("sweep_configs") as sweep:  # imports bench/shapes.py as `shapes`
        assert sweep.name_of
    assert sys.path == path
    assert not [m for m in set(sys.modules) - modules
                if str(getattr(sys.modules[m], "__file__", None) or "").startswith(str(BENCH))]


def test_row_benches_share_their_arguments(fp8):
    args = fp8.row_parser(None, "128,2048", 9).parse_args(["--layers", "qwen2.5-7b/down,", "--ms", "64,512"])
    assert fp8.row_selection(args) == ([64, 512], ["qwen2.5-7b/down"]) and args.samples == 9


def test_config_knobs_pin_a_tile_for_every_kernel(fp8):
    assert fp8.config_knobs("") == {}
    knobs = fp8.config_knobs('{"schedule": "cooperative", "tile_n": 128, "cluster": [1, 2]}')
    assert knobs == {"schedule": "cooperative", "tile_n": 128, "cluster": (1, 2)}
    with pytest.raises(SystemExit, match="JSON object"):
        fp8.config_knobs("[128]")


def test_graphs_time_each_call_from_a_cuda_graph_per_call(fp8, monkeypatch):
    """--graphs: time_calls replays each call from a graph of GRAPH_CALLS calls and reports the time
    of one call; without it, the calls themselves are timed."""
    assert fp8.row_parser(None, "64", 3).parse_args(["--graphs"]).graphs
    assert not fp8.row_parser(None, "64", 3).parse_args([]).graphs
    captured, timed = [], []
    monkeypatch.setattr(fp8.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(fp8, "graphed", lambda f, calls: captured.append(calls) or ("replay", f))

    def fake_time_paired(fns, warmup, samples, reps):
        timed.append((fns, reps))
        return [2.0 * (i + 1) for i in range(len(fns))]

    monkeypatch.setattr(fp8, "time_paired", fake_time_paired)
    calls = {"a": lambda: None, "b": lambda: None}
    times = fp8.time_calls(calls, 5, graphs=True)
    assert captured == [fp8.GRAPH_CALLS] * 2 and all(f[0] == "replay" for f in timed[0][0])
    assert times == {"a": 2.0 / fp8.GRAPH_CALLS, "b": 4.0 / fp8.GRAPH_CALLS}
    assert fp8.time_calls(calls, 5) == {"a": 2.0, "b": 4.0} and timed[1][0] == list(calls.values())


def test_rows_of_four_ratios_print_and_summarise(fp8, capsys):
    """The benches that time the dequantization anchor too print and summarise four ratios: each
    ratio's geomean and worst row, and the errors from the row's last two fields."""
    def four(name, m, n, k):
        return (name, m, n, k, 1.0, 2.0, 4.0, 0.5 if m == 64 else 2.0, 10.0, 1e-3, 2e-3)

    rows = fp8.run_rows([64, 512], [], four, "ratios", "{:.2f} {:.2f} {:.2f} {:.2f}")
    fp8.print_summary(rows, [64, 512], ("one", "two", "four", "dequant"), "test")
    out = capsys.readouterr().out
    assert " 1.00 2.00 4.00 0.50 |     10.0  1.00e-03  2.00e-03" in out
    assert f"dequant: geomean 1.000 over {len(rows)} rows, worst 0.500" in out
    assert "four: geomean 4.000" in out and "evtc 1.00e-03, baseline 2.00e-03" in out
