"""Per-model tuning on validation (pipeline/seqrec/tuning.py): a grid's tuned.yaml, and runs that
take their model's setting from it."""

import pandas as pd
import pytest
import yaml
from omegaconf import OmegaConf

from pipeline.seqrec import sweep, train, tuning
from pipeline.validation import ConfigError


def grid_results():
    """Two models over lr x B at eps 8 (one seed): the transformer's validation peaks at (0.01, 512), the
    GRU's at (0.03, 128); their test numbers peak elsewhere (the selection must ignore them)."""
    valid = {("transformer", 0.01, 512): 5.0, ("gru", 0.03, 128): 4.0}
    rows = []
    for method in ("transformer", "gru"):
        for lr in (0.003, 0.01, 0.03):
            for b in (128, 512):
                v = valid.get((method, lr, b), 1.0)
                common = dict(method=method, clipping="phantom", eps=8.0, lr=lr, batch_size=b, seed=0)
                rows += [dict(split="valid", ndcg10=v, hit10=2 * v, **common),
                         dict(split="test", ndcg10=9.0 if (lr, b) == (0.003, 128) else v, hit10=1.0, **common)]
    return pd.DataFrame(rows)


def test_a_table_of_tuned_models_is_not_a_grid():
    """Each model at its own (lr, B), one per eps (a table run with seqrec.tuned): nothing to select, so no
    grid.* / tuned.yaml is written; a model at two settings at one eps is a grid."""
    results = grid_results()
    tuned = results[((results.method == "transformer") & (results.lr == 0.01) & (results.batch_size == 512))
                    | ((results.method == "gru") & (results.lr == 0.03) & (results.batch_size == 128))]
    assert tuned["lr"].nunique() == 2 and not sweep.is_grid(tuned)
    popular = tuned.assign(method="popular", lr=0.5)  # a baseline's row has no setting of its own
    assert not sweep.is_grid(pd.concat([tuned, popular]))
    assert sweep.is_grid(results)
    assert sweep.is_grid(results[results.method == "gru"])


def test_tuned_yaml_holds_each_models_setting_selected_on_validation(tmp_path):
    path = tuning.write(sweep.grid(grid_results(), 10), tmp_path / "tuned.yaml", 10)
    table = yaml.safe_load(path.read_text())
    assert table["transformer"] == {"lr": 0.01, "batch_size": 512, "valid_ndcg10": 5.0, "eps": 8.0}
    assert table["gru"]["lr"] == 0.03 and table["gru"]["batch_size"] == 128
    assert tuning.read(path) == table


def run_cfg(path, model="gru", presence=None):
    m = {"name": model} | ({"reattention": {"presence": presence}} if presence else {})
    return OmegaConf.create({"model": m, "seqrec": {"lr": 0.5, "batch_size": 7, "tuned": str(path)}})


def test_a_run_takes_its_models_setting_and_a_missing_model_is_refused(tmp_path):
    path = tuning.write(sweep.grid(grid_results(), 10), tmp_path / "tuned.yaml", 10)
    cfg = run_cfg(path)
    tuning.apply(cfg)
    tuning.apply(cfg)  # idempotent
    assert (cfg.seqrec.lr, cfg.seqrec.batch_size) == (0.03, 128)
    with pytest.raises(ConfigError, match="no setting for model 'dpformer:presence-public'"):
        tuning.apply(run_cfg(path, "dpformer", "public"))
    untouched = run_cfg(path)
    untouched.seqrec.tuned = None
    tuning.apply(untouched)
    assert (untouched.seqrec.lr, untouched.seqrec.batch_size) == (0.5, 7)


def test_an_ablation_runs_at_the_setting_of_the_model_it_ablates(tmp_path):
    path = tmp_path / "tuned.yaml"
    path.write_text("dpformer:presence-public: {lr: 0.02, batch_size: 64}\ndpformer: {lr: 0.005, batch_size: 32}\n")
    for extra, setting in (({"form": "off"}, (0.02, 64)), ({"errors": "adam"}, (0.02, 64)),
                           ({"form": "paper", "blocks": [2]}, (0.02, 64)), ({}, (0.02, 64))):
        cfg = run_cfg(path, "dpformer", "public")
        cfg.model.reattention.update(extra)
        tuning.apply(cfg)
        assert (cfg.seqrec.lr, cfg.seqrec.batch_size) == setting, extra
    private = run_cfg(path, "dpformer", "private")
    private.model.reattention.form = "off"
    tuning.apply(private)
    assert (private.seqrec.lr, private.seqrec.batch_size) == (0.005, 32)
    with pytest.raises(ConfigError, match="no setting for model 'gru'"):
        tuning.apply(run_cfg(path, "gru"))


def test_gains_are_taken_over_the_configured_reference():
    """An ablation sweep pairs each variant with its own uncorrected model (seqrec.gain_over)."""
    rows = []
    for seed in range(3):
        for model, ndcg in (("dpformer:form-off", 10.0), ("dpformer", 11.0 + 0.1 * seed), ("transformer", 5.0),
                            ("dpformer:form-off:errors-adam", 10.0)):  # a control: no gain over an uncorrected model
            rows.append(dict(method=model, model=model, split="test", clipping="phantom", eps=8.0, lr=0.01,
                             batch_size=128, seed=seed, ndcg10=ndcg))
    results = pd.DataFrame(rows)
    long = results.groupby(["model", "eps"], as_index=False)[["lr", "batch_size"]].first()
    over_off = sweep.gains(results, long, 10, 0.2, reference="dpformer:form-off").set_index("variant")
    assert list(over_off.index) == ["dpformer"] and over_off.loc["dpformer", "gain_mean"] == pytest.approx(0.11)
    over_vanilla = sweep.gains(results, long, 10, 0.2).set_index("variant")
    assert over_vanilla.loc["dpformer", "gain_mean"] == pytest.approx(1.22) and "dpformer:form-off" in over_vanilla.index
    assert [train.uncorrected(m) for m in ("dpformer:form-off", "dpformer:presence-public:form-off:errors-adam",
                                           "dpformer:form-paper", "dpformer", "transformer")] == [True, True, False,
                                                                                                 False, False]


@pytest.mark.parametrize("text", ["", "[1, 2]\n", "gru: {lr: -1, batch_size: 128}\n", "gru: {lr: 0.01}\n",
                                  "gru: {lr: 0.01, batch_size: 1.5}\n", "gru: [\n"])
def test_a_bad_tuned_file_is_refused_naming_the_key(tmp_path, text):
    path = tmp_path / "tuned.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="seqrec.tuned"):
        tuning.apply(run_cfg(path))
    with pytest.raises(ConfigError, match="seqrec.tuned = .*no such file"):
        tuning.apply(run_cfg(tmp_path / "absent.yaml"))


@pytest.mark.slow
def test_the_cli_runs_each_model_at_its_tuned_setting(run_cli, tmp_path):
    path = tmp_path / "tuned.yaml"
    path.write_text("gru: {lr: 0.02, batch_size: 64}\ntransformer: {lr: 0.004, batch_size: 32}\n")
    run_cli("experiment=dpformer_ci", "model=gru,transformer", f"seqrec.tuned={path}", "seqrec.epochs=1",
            "seqrec.lr=0.9", "seqrec.batch_size=999", "-m")
    results = pd.read_csv(run_cli.tmp / "sweep" / "results.csv")
    got = results.groupby("model")[["lr", "batch_size"]].first()
    assert got.loc["gru"].tolist() == [0.02, 64] and got.loc["transformer"].tolist() == [0.004, 32]
