"""What a researcher reads: the sweep's summary table and headline numbers, report.html, run names,
the MLflow experiment type, results in grid order, dodged error bars (issue 14)."""

import base64
import json
import math
import re

import mlflow
import numpy as np
import pandas as pd
import pytest
from omegaconf import OmegaConf

from hydra_plugins.pipeline_sweeper.validating_sweeper import swept_keys
from pipeline import plot, report, sweep, tracking
from pipeline.noisyhead import cell
from pipeline.task import Cells


def rows(cells):
    """results.csv-like rows: (N, eps, method, coupling, mean, sd)."""
    return pd.DataFrame([{"N": N, "eps": eps, "T": 5, "attack_c": math.nan, "attack_p": math.nan, "method": m,
                          "coupling": c, "excess_risk_mean": mean, "excess_risk_sd": sd}
                         for N, eps, m, c, mean, sd in cells])


def test_summary_table_keeps_grid_order_and_puts_methods_in_columns():
    df = rows([(100, 0.5, "gd", "", 0.3, 0.01), (100, 0.5, "noisyhead", "", 2.0, 0.5),
               (20, 0.5, "gd", "", 0.4, 0.02), (20, 0.5, "noisyhead", "", 3.0, 0.25)])
    table = report.summary_table(df, "excess_risk", {"noisyhead": "NoisyHead"})
    assert list(table.columns) == ["N", "gd", "NoisyHead"]  # eps and T do not vary: not shown
    assert table["N"].tolist() == ["100", "20"]  # the order of the rows given, not sorted
    assert table.loc[1, "NoisyHead"] == "3 (0.25)"
    text = report.text_table(table).splitlines()
    assert len(text) == 3 and text[0].split() == ["N", "gd", "NoisyHead"]


def test_couplings_become_columns_and_headline_is_min_and_max_of_cell_means():
    df = rows([(10, 1.0, "noisyhead", "independent", 0.5, 0.1), (10, 1.0, "noisyhead", "shared", 1e-9, 1e-10),
               (10, 2.0, "noisyhead", "independent", 0.25, 0.1), (10, 2.0, "noisyhead", "shared", 4e-9, 1e-10),
               (10, 1.0, "ridge", "none", 0.125, 0.0), (10, 2.0, "ridge", "none", 0.0625, 0.0)])
    table = report.summary_table(df, "excess_risk", {})
    assert list(table.columns) == ["eps", "noisyhead, independent noise", "noisyhead, shared noise", "ridge"]
    h = report.headline(df, "excess_risk")
    assert h == {"noisyhead.independent.best_excess_risk": 0.25, "noisyhead.independent.worst_excess_risk": 0.5,
                 "noisyhead.shared.best_excess_risk": 1e-9, "noisyhead.shared.worst_excess_risk": 4e-9,
                 "ridge.best_excess_risk": 0.0625, "ridge.worst_excess_risk": 0.125}


def test_swept_keys_are_those_that_vary_and_cell_names_carry_them(cfg_for):
    jobs = [["attack.c=2", "attack.p=2", "trials=20"], ["attack.c=2", "attack.p=2.02", "trials=20"],
            ["attack.c=4", "attack.p=2", "trials=20"]]
    assert swept_keys(jobs) == ["attack.c", "attack.p"]
    assert report.grid(jobs) == {"attack.c": ["2", "4"], "attack.p": ["2", "2.02"], "trials": ["20"]}
    cfg = cfg_for("experiment=fig4_robustness", "trials=3")
    s = tracking.Sweep(id="x", dir="/tmp", resume=False, overrides=tuple(jobs[1]), swept=("attack.c", "attack.p"))
    from pipeline.noisyhead import config
    const = config.validate(cfg)
    assert cell.cell_name(cfg, const, s) == "fig4_robustness c=2 p=2.02"
    params = cell.headline_params(cfg, const, s)
    assert params["attack.p"] == "2.02" and params["N"] == 5000 and params["eps"] == 0.5
    assert params["alpha"] == pytest.approx(float(cfg.attack.c) * 5000 ** float(cfg.attack.p))
    assert cell.cell_name(cfg, const, None) == "robustness N=5000 eps=0.5 T=8"


def test_report_html_is_self_contained(tmp_path):
    png = tmp_path / "excess_risk.png"
    data = b"\x89PNG\r\n\x1a\n" + bytes(range(40))
    png.write_bytes(data)
    table = pd.DataFrame({"N": ["20"], "NoisyHead": ["3 (0.25)"]})
    page = report.write_html(tmp_path / "report.html", "fig1 <sweep>", "python -m pipeline -m x=1,2", "a: 1\n",
                             table, [png], [("regime.N=20", "abc123", {"device": "cuda:0", "device_name": "NVIDIA H100",
                                                                       "seconds": 12.345, "peak_memory_gb": 1.5}),
                                            ("regime.N=30", "def456", {})])
    html = page.read_text()
    assert base64.b64encode(data).decode() in html and "fig1 &lt;sweep&gt;" in html
    assert "abc123" in html and "3 (0.25)" in html and "python -m pipeline -m x=1,2" in html
    assert not re.search(r"(src|href)=['\"](?!data:)", html)  # nothing loaded from elsewhere
    # the cells table says where each cell ran and what it cost; a cell without a record leaves blanks
    assert "<th>device</th><th>seconds</th><th>peak memory (GiB)</th>" in html and "s / epoch" not in html
    assert "<td>NVIDIA H100 (cuda:0)</td><td>12.3</td><td>1.5</td>" in html
    assert "<td><code>def456</code></td><td></td><td></td><td></td>" in html
    assert "across the cells" not in html  # no swept keys given: the config is all there is


def test_report_html_says_which_keys_the_cells_vary(tmp_path):
    """The Config section is the first cell's (an N = 1000,2000 sweep showed N: 1000 alone): the
    keys the cells vary are listed above it with every value; a key one value only is not."""
    table = pd.DataFrame({"N": ["1000", "2000"]})
    overrides = [["regime.N=1000", "seed=0"], ["regime.N=2000", "seed=0"]]
    page = report.write_html(tmp_path / "report.html", "t", "python -m pipeline -m", "regime:\n  N: 1000\n", table, [],
                             [(" ".join(o), f"r{i}", {}) for i, o in enumerate(overrides)], swept=report.grid(overrides))
    html = page.read_text()
    assert "<li><code>regime.N</code>: 1000, 2000</li>" in html and "<code>seed</code>" not in html
    assert html.index("across the cells") < html.index("N: 1000")


def test_report_html_shows_the_extra_tables_and_says_what_each_figure_shows(tmp_path):
    """The paired gains and their verdicts were in table.md only (the report said so); figures were
    captioned with their file names. A table passed with its caption follows the results; a figure
    with a caption says what it shows and what its bars are, one without keeps its name."""
    pngs = [tmp_path / "curves.png", tmp_path / "other.png"]
    for png in pngs:
        png.write_bytes(b"\x89PNG\r\n\x1a\n")
    table = pd.DataFrame({"model": ["tied"]})
    gains = pd.DataFrame({"eps": ["1"], "gain": ["+3.0%"], "verdict": ["inconclusive"]})
    page = report.write_html(tmp_path / "report.html", "t", "python -m pipeline -m", "seed: 0\n", table, pngs, [],
                             tables=[("Tying's gain <paired>", gains)], captions={"curves.png": "mean, bars +-1 sd"})
    html = page.read_text()
    assert "<p>Tying&#x27;s gain &lt;paired&gt;</p>" in html and "<td>inconclusive</td>" in html
    assert html.index("<td>tied</td>") < html.index("<td>inconclusive</td>") < html.index("<h2>Figures</h2>")
    assert "<figcaption>curves.png: mean, bars +-1 sd</figcaption>" in html
    assert "<figcaption>other.png</figcaption>" in html


def test_collect_returns_cells_in_grid_order_not_folder_order(tmp_path):
    jobs = [[f"regime.N={n}"] for n in range(20, 32)]  # job folders 0..11: lexicographic would put 10, 11 after 1
    for i, job in enumerate(jobs):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "results.csv").write_text(f"N\n{20 + i}\n")
        tracking.write_record(tmp_path / str(i), {"run_id": f"r{i}", "status": "FINISHED", "sweep": "s",
                                                  "overrides": job,
                                                  "results_sha256": tracking._sha256(tmp_path / str(i) / "results.csv")})
    cells = sweep.collect(tmp_path, "s", jobs)
    assert [r["run_id"] for r in cells.done] == [f"r{i}" for i in range(12)]


def test_experiment_opens_as_a_machine_learning_experiment(tmp_path):
    cfg = OmegaConf.create({"mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'm.db'}", "experiment": "e",
                                       "experiment_kind": "custom_model_development"}})
    try:
        tracking.setup(cfg)
        experiment = mlflow.MlflowClient().get_experiment_by_name("e")
        assert experiment.tags[tracking.KIND_TAG] == "custom_model_development"
    finally:
        mlflow.set_tracking_uri(None)  # unset, as before ("" would leave the refused ./mlruns file store set)


def test_series_at_one_x_are_dodged_symmetrically():
    x = pd.Series([100.0, 1000.0])
    xs = np.array([100.0, 1000.0, 10000.0])
    lin = [plot.dodged(x, [i, i], [3, 3], xs, log=False) for i in range(3)]
    assert lin[0][0] < lin[1][0] == 100.0 < lin[2][0] and lin[1][0] - lin[0][0] == pytest.approx(lin[2][0] - lin[1][0])
    assert lin[2][0] - lin[0][0] < 900  # within the gap to the next x
    log = [plot.dodged(x, [i, i], [2, 2], xs, log=True) for i in range(2)]
    assert log[0][1] / 1000 == pytest.approx(1000 / log[1][1]) and log[0][1] < 1000 < log[1][1]
    assert (plot.dodged(x, [0, 0], [1, 1], xs, log=False) == x.to_numpy()).all()


@pytest.fixture
def errorbars(monkeypatch):
    """Every ``Axes.errorbar`` call a figure makes while the test runs, as (x, keyword arguments)."""
    import matplotlib.pyplot as plt

    calls, real = [], plt.Axes.errorbar

    def spy(self, x, y, *a, **k):
        calls.append((list(np.asarray(x, dtype=float)), k))
        return real(self, x, y, *a, **k)

    monkeypatch.setattr(plt.Axes, "errorbar", spy)
    return calls


def test_a_point_alone_at_its_x_is_drawn_where_it_is(tmp_path, errorbars):
    """The default run's single N = 1000 (two methods, one per panel) and a sweep's N = 500 where
    only one series has a point: no shift (before: 975 and 1025, 487 and 512)."""
    from omegaconf import OmegaConf

    from pipeline.noisyhead import plot as nh_plot

    rows = [{"method": m, "N": n, "excess_risk_mean": 1.0 + i, "excess_risk_sd": 0.1, "log10_excess_risk_mean": 0.0,
             "log10_excess_risk_sd": 0.1, "eps": 0.2, "T": 100, "coupling": ""}
            for i, (m, n) in enumerate([("gd", 500), ("gd", 1000), ("noisyhead", 1000), ("noisyhead", 1500)])]
    spec = OmegaConf.create({"y": "excess_risk", "x": "N", "hue": None, "facet": None, "k_sd": 1.0,
                             "error_bars": "sd", "yscale": "linear", "methods": None, "title": None, "colors": None})
    nh_plot.figure(pd.DataFrame(rows), spec, tmp_path / "f.png")
    at = {k["label"]: x for x, k in errorbars}
    assert at["gd"][0] == 500 and at["noisyhead"][1] == 1500  # alone at their x: unshifted
    assert at["gd"][1] < 1000 < at["noisyhead"][0]  # the two at N = 1000: spread around it


def test_a_method_has_one_colour_in_every_figure():
    assert plot.color("noisyhead") == plot.color("noisyhead") != plot.color("gd")
    assert plot.color("transformer (non-private)") == plot.color("transformer")
    assert plot.color("some_new_method") == plot.color("some_new_method")  # fixed, from the name


def test_the_report_dvc_hashes_is_the_same_bytes_whatever_the_run_ids_and_timings(tmp_path):
    table = pd.DataFrame({"N": [40], "noisyhead": ["0.1 (0.01)"]})
    pages = []
    for i, (run_id, seconds) in enumerate((("aaa111", 1.5), ("bbb222", 9.25))):
        page = report.write_html(tmp_path / f"r{i}.html", "t", "python -m pipeline", "seed: 0\n", table, [],
                                 [("regime.N=40", run_id, {"device": "cpu", "device_name": "x", "seconds": seconds})],
                                 parent=f"parent{i}", caption="excess risk, mean (sd) across B = 2 trials")
        pages.append(page.read_text())
    assert pages[0] != pages[1] and "aaa111" in pages[0]  # the sweep folder's copy keeps them
    a, b = report.stable(pages[0]), report.stable(pages[1])
    assert a == b and "aaa111" not in a and "parent0" not in a
    assert "excess risk, mean (sd) across B = 2 trials" in a and "<h2>Config</h2>" in a


def test_headline_metrics_are_rounded_for_display():
    shown = tracking.for_display({"test_hit10": 28.999999904632568, "risk": 2.956041234e-6, "zero": 0.0})
    assert shown == {"test_hit10": 29.0, "risk": 2.95604e-6, "zero": 0.0}


def test_the_sweeps_view_shows_its_cells_unfolded_with_the_params_that_vary(tmp_path):
    """The runs-table view (tracking.share_view): the sweep's cells in run-name order (MLflow folds
    child runs under the parent only in start-time order), the params that differ between cells,
    then the headline metrics, params first."""
    store = f"sqlite:///{tmp_path / 'm.db'}"
    client = mlflow.MlflowClient(tracking_uri=store)
    experiment = client.create_experiment("e")
    parent = client.create_run(experiment, run_name="sweep").info.run_id
    for n in (40, 60):
        run = client.create_run(experiment, tags={tracking.SWEEP_TAG: "s1", "kind": "cell"}, run_name=f"N={n}").info.run_id
        client.log_param(run, "N", n)
        client.log_param(run, "eps", 0.5)
    try:
        mlflow.set_tracking_uri(store)
        assert tracking.share_view(parent, "s1", ["N", "eps"], ["risk"]) == experiment
        state = json.loads(client.get_experiment(experiment).tags[tracking.VIEW_TAG + "s1"])
    finally:
        mlflow.set_tracking_uri(None)
    assert state["selectedColumns"] == state["columnOrder"] == ["params.`N`", "metrics.`risk`"]
    assert state["orderByKey"] == "tags.`mlflow.runName`" and state["orderByAsc"] is True
    assert state["searchFilter"] == f"tags.{tracking.SWEEP_TAG} = 's1' and tags.kind = 'cell'"


def test_every_dpformer_model_and_ablation_variant_has_a_colour_of_its_own():
    """In the ablation's figures two variants shared one colour (a hash of their names). Every name a
    DPFormer figure can hold, the models of conf/seqrec/model/ and the ablation preset's form x errors
    x blocks variants (their names from train.model_name), gets a distinct colour, and keeps it in every figure."""
    from omegaconf import OmegaConf

    from pipeline.seqrec import plot as seqrec_plot
    from pipeline.seqrec.train import model_name

    from conftest import ROOT

    names = {p.stem.replace("_public", ":presence-public") for p in (ROOT / "conf/seqrec/model").glob("*.yaml")}
    names |= {"popular", "oracle"}
    for form in ("propagated", "paper", "off"):
        for errors in ("paper", "adam"):
            for blocks in (None, [2]):
                cfg = OmegaConf.create({"name": "dpformer", "reattention": {"presence": "public", "form": form,
                                                                            "errors": errors, "blocks": blocks}})
                names.add(model_name(cfg))
    assert {"dpformer:presence-public:form-off", "dpformer:form-off:errors-adam", "dpformer:errors-adam",
            "dpformer:form-paper:errors-adam:blocks-2"} <= names
    names.add("dpformer:blocks-1")  # a variant not listed anywhere: a colour of the variants' own pool
    colours = {name: seqrec_plot.model_color(name) for name in names}
    assert len(set(colours.values())) == len(names), colours
    assert seqrec_plot.model_color("dpformer:errors-adam (non-private)") == colours["dpformer:errors-adam"]


def test_series_of_one_method_share_its_colour_but_not_their_look_and_the_legend_fits(tmp_path, errorbars, monkeypatch):
    """Figure 4 drew NoisyHead with independent and with shared noise in one colour and one style (two
    identical legend entries); Figures 3 and 6 cut their legends at both edges. Now: each method its
    colour of every figure, its several series a line style and marker each, and a legend no wider
    than the figure."""
    import matplotlib.pyplot as plt
    from omegaconf import OmegaConf

    from pipeline import plot
    from pipeline.noisyhead import plot as nh_plot

    real_legend, legends = plt.Figure.legend, []

    def legend_spy(self, *a, **k):
        legends.append(real_legend(self, *a, **k))
        return legends[-1]

    labels = {"noisyhead": "NoisyHead (cost of privacy), a long name", "gd": "non-private GD (cost of descent), long too"}
    rows = [{"method": m, "coupling": c, "attack_p": p, "attack_risk_mean": 1.0, "attack_risk_sd": 0.1,
             "log10_attack_risk_mean": 0.0, "log10_attack_risk_sd": 0.1, "eps": 0.5, "N": 50, "T": 3}
            for m, c in (("noisyhead", "independent"), ("noisyhead", "shared"), ("gd", "none")) for p in (2.0, 2.1)]
    spec = OmegaConf.create({"y": "attack_risk", "x": "attack_p", "hue": None, "facet": None, "k_sd": 1.0,
                             "error_bars": "log_sd", "yscale": "log", "methods": None, "title": None, "colors": None})
    monkeypatch.setattr(plt.Figure, "legend", legend_spy)
    nh_plot.figure(pd.DataFrame(rows), spec, tmp_path / "f.png", labels)
    drawn = {k["label"]: (k["color"], k.get("ls", "-"), k.get("marker")) for _, k in errorbars}
    independent, shared = drawn[f"{labels['noisyhead']}, independent noise"], drawn[f"{labels['noisyhead']}, shared noise"]
    assert independent[0] == shared[0] == plot.color("noisyhead") and drawn[labels["gd"]][0] == plot.color("gd")
    assert independent[1:] != shared[1:]  # told apart by line and marker
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = legends[-1].figure
    assert legends[-1].get_window_extent(FigureCanvasAgg(fig).get_renderer()).width <= fig.bbox.width


def test_the_reports_run_ids_link_to_their_runs_in_the_ui_as_the_printed_link_does(tmp_path):
    """Issue 63: report.html listed each cell's run id as text. Each is now a link to the run's page,
    the address ``ui_address`` prints for it (the printed link worked); the note says where it opens;
    a run the store does not hold keeps its id as text; the copy DVC hashes drops them with the ids."""
    store = f"sqlite:///{tmp_path / 'm.db'}"
    cfg = OmegaConf.create({"mlflow": {"tracking_uri": store, "experiment": "e", "ui": "http://127.0.0.1:5000"}})
    client = mlflow.MlflowClient(tracking_uri=store)
    client.create_experiment("other")  # the cells' experiment is not the first: its id is read from each run
    experiment = client.create_experiment("e")
    ids = [client.create_run(experiment).info.run_id for _ in range(2)]
    try:
        links = tracking.run_links(cfg, [*ids, "0123456789abcdef"])
        printed = [tracking.ui_address(cfg, i).split()[0] for i in ids]
        note = sweep.report_links(cfg, Cells(done=[{"run_id": i} for i in ids]))["links_note"]
    finally:
        mlflow.set_tracking_uri(None)
    assert [links[i] for i in ids] == printed and "0123456789abcdef" not in links
    assert printed[0] == f"http://127.0.0.1:5000/#/experiments/{experiment}/runs/{ids[0]}?workflowType=machine_learning"
    assert note.endswith(f"mlflow ui --backend-store-uri {store}")
    table = pd.DataFrame({"N": [40]})
    page = report.write_html(tmp_path / "r.html", "t", "python -m pipeline", "seed: 0\n", table, [],
                             [("regime.N=40", ids[0], {}), ("regime.N=60", "0123456789abcdef", {})], parent=ids[1],
                             links=links, links_note=note).read_text()
    assert f"<td><a href='{links[ids[0]]}'><code>{ids[0]}</code></a></td>" in page
    assert f"MLflow parent run: <a href='{links[ids[1]]}'><code>{ids[1]}</code></a>" in page
    assert "<td><code>0123456789abcdef</code></td>" in page and "mlflow ui --backend-store-uri" in page
    assert not re.search(r"src=['\"](?!data:)", page)  # links navigate; nothing is loaded from elsewhere
    assert "href=" not in report.stable(page)
