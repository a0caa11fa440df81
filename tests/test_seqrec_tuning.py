"""Per-model tuning on validation (pipeline/seqrec/tuning.py): a grid's tuned.yaml, and runs that
take their model's setting from it."""

import pandas as pd
import pytest
import yaml
from omegaconf import OmegaConf

from pipeline.seqrec import sweep, tuning
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


@pytest.mark.parametrize("text", ["", "[1, 2]\n", "gru: {lr: -1, batch_size: 128}\n", "gru: {lr: 0.01}\n",
                                  "gru: {lr: 0.01, batch_size: 1.5}\n", "gru: [\n"])
def test_a_bad_tuned_file_is_refused_naming_the_key(tmp_path, text):
    path = tmp_path / "tuned.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="seqrec.tuned"):
        tuning.apply(run_cfg(path))
    with pytest.raises(ConfigError, match="seqrec.tuned = .*no such file"):
        tuning.apply(run_cfg(tmp_path / "absent.yaml"))


def test_the_cli_runs_each_model_at_its_tuned_setting(run_cli, tmp_path):
    path = tmp_path / "tuned.yaml"
    path.write_text("gru: {lr: 0.02, batch_size: 64}\ntransformer: {lr: 0.004, batch_size: 32}\n")
    run_cli("experiment=dpformer_ci", "model=gru,transformer", f"seqrec.tuned={path}", "seqrec.epochs=1",
            "seqrec.lr=0.9", "seqrec.batch_size=999", "-m")
    results = pd.read_csv(run_cli.tmp / "sweep" / "results.csv")
    got = results.groupby("model")[["lr", "batch_size"]].first()
    assert got.loc["gru"].tolist() == [0.02, 64] and got.loc["transformer"].tolist() == [0.004, 32]
