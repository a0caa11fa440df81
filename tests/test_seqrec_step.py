"""The step benchmark's Figure 3 writer (benchmarks/seqrec_step.py): its ratios against hand-computed
values, and the figure drawn from saved rows (no timing)."""

import json
import math
from pathlib import Path

import forkserver
import matplotlib.image as mpimg
import pytest

from benchmarks import seqrec_step

ROOT = Path(__file__).resolve().parents[1]


def row(engine, model, B, M, seconds, peak, L=20):
    return {"B": B, "L": L, "M": M, "engine": engine, "model": model, "seconds": seconds, "peak_gb": peak,
            "device": "cpu", "threads": 1}


# two M at B = 128 and two B at M = 5000; a skipped row; a cell whose non-private step did not run
ROWS = [row("none", "transformer", 128, 1000, 0.2, 0.1),
        row("phantom", "transformer", 128, 1000, 0.3, 0.11),
        row("ghost", "transformer_untied", 128, 1000, 0.5, 0.2),
        row("none", "transformer", 128, 5000, 0.4, 0.25),
        row("phantom", "transformer", 128, 5000, 0.5, 0.25),
        row("ghost", "transformer_untied", 128, 5000, 1.6, 1.0),
        row("none", "transformer", 32, 5000, 0.1, 0.05),
        row("phantom", "transformer", 32, 5000, 0.12, 0.06),
        {"B": 32, "L": 20, "M": 5000, "engine": "ghost", "model": "transformer_untied", "skipped": "estimated"},
        row("phantom", "transformer", 32, 1000, 0.07, 0.04)]


def test_ratios_equal_hand_computed_values():
    df = seqrec_step.ratios(ROWS).set_index(["B", "M", "engine"])
    assert len(df) == 9  # the skipped row is dropped
    expected = {(128, 1000, "none"): (1.0, 1.0), (128, 1000, "phantom"): (1.5, 1.1),
                (128, 1000, "ghost"): (2.5, 2.0), (128, 5000, "phantom"): (1.25, 1.0),
                (128, 5000, "ghost"): (4.0, 4.0), (32, 5000, "phantom"): (1.2, 1.2)}
    for key, (t, m) in expected.items():
        assert df.loc[key, "time_ratio"] == pytest.approx(t)
        assert df.loc[key, "mem_ratio"] == pytest.approx(m)
    assert math.isnan(df.loc[(32, 1000, "phantom"), "time_ratio"])  # no non-private step in its cell
    assert df.loc[(128, 1000, "ghost"), "series"] == r"Ghost (untied, $d = 64$)"


def test_a_non_positive_reference_peak_gives_no_memory_ratio():
    df = seqrec_step.ratios([row("none", "transformer", 8, 10, 0.1, 0.0), row("phantom", "transformer", 8, 10, 0.2, 0.1)])
    assert df["time_ratio"].tolist() == pytest.approx([1.0, 2.0])
    assert df["mem_ratio"].isna().all()


def test_figure_has_a_panel_per_measure_and_variable(tmp_path):
    path = seqrec_step.figure(ROWS, tmp_path / "fig.png")
    image = mpimg.imread(path)
    assert image.shape[0] > 500 and image.shape[1] > 1000  # two columns (M and B) of two rows
    one = seqrec_step.figure([r for r in ROWS if r["B"] == 128], tmp_path / "one.png")
    assert mpimg.imread(one).shape[1] < image.shape[1] * 0.7  # B takes one value: the M column only


def test_figure_without_a_non_private_step_is_refused(tmp_path):
    with pytest.raises(ValueError, match="non-private"):
        seqrec_step.figure([r for r in ROWS if r.get("engine") != "none"], tmp_path / "fig.png")
    assert not (tmp_path / "fig.png").exists()


def run(*args):  # the benchmark's command line, forked (tests/forkserver.py): it draws and refuses, times nothing
    return forkserver.run(["-m", "benchmarks.seqrec_step", *args], cwd=ROOT)


@pytest.mark.slow
def test_from_json_draws_without_timing_and_rejects_bad_input(tmp_path):
    saved = tmp_path / "rows.json"
    saved.write_text(json.dumps(ROWS))
    proc = run("--from-json", str(saved), "--figure", str(tmp_path / "out.png"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out.png").stat().st_size > 10_000
    proc = run("--from-json", str(saved))
    assert proc.returncode == 2 and proc.stderr.startswith("error: --figure")
    proc = run("--from-json", str(tmp_path / "missing.json"), "--figure", str(tmp_path / "x.png"))
    assert proc.returncode == 2 and proc.stderr.startswith("error: --from-json") and "missing.json" in proc.stderr
    proc = run("--engines", "phantom:transformer", "--figure", str(tmp_path / "x.png"))
    assert proc.returncode == 2 and "none:transformer" in proc.stderr
    proc = run("--engines", "bogus:transformer")
    assert proc.returncode == 2 and "'bogus:transformer'" in proc.stderr
    assert not (tmp_path / "x.png").exists()


def test_the_validation_benchmark_ranks_the_last_position_as_the_full_forward_does(tmp_path, capsys):
    from benchmarks import seqrec_validation

    rows = seqrec_validation.main(["--users", "8", "--M", "30", "--L", "6", "--batch", "4", "--repeats", "1",
                                   "--json", str(tmp_path / "rows.json")])
    assert [(r["model"], r["mode"]) for r in rows] == [(m, k) for m in ("transformer", "dpformer")
                                                       for k in ("every position", "last position")]
    assert all(r["max_score_difference"] < 1e-5 for r in rows if "speedup" in r)
    assert "s per 1,000 users" in capsys.readouterr().out and (tmp_path / "rows.json").is_file()
    with pytest.raises(SystemExit) as stop:
        seqrec_validation.main(["--users", "0"])
    assert stop.value.code == 2


def test_the_provenance_benchmark_times_each_pass_of_the_stages_model(tmp_path, capsys):
    """benchmarks/provenance.py at a toy size: every pass timed, the provenance's share of the Phantom
    step and the null mode's floor read from those times, the rows written."""
    from benchmarks import provenance

    rows = provenance.main(["--B", "4", "--L", "5", "--M", "20", "--repeats", "2", "--json", str(tmp_path / "p.json")])
    (r,) = rows
    assert all(r[f"{k}_ms"] > 0 for k in ("plain", "provenance", "null", "step"))
    assert r["share"] == pytest.approx((r["provenance_ms"] - r["plain_ms"]) / r["step_ms"], rel=1e-3)
    assert r["floor"] == pytest.approx((r["null_ms"] - r["plain_ms"]) / r["step_ms"], rel=1e-3)
    assert "share" in capsys.readouterr().out and (tmp_path / "p.json").is_file()
