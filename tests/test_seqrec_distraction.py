"""The distraction measurement (pipeline/seqrec/distraction.py): the popularity buckets against a
brute-force ranking, the attention masses against uniform attention's closed form and their sum,
zero noise leaving the clean model's numbers, and the entry point end to end (MLflow, report.dir,
refusals before any folder)."""

import json
import os
from pathlib import Path

import forkserver
import pytest
import torch
from conftest import merged
from omegaconf import OmegaConf

from pipeline.seqrec import distraction, train

ROOT = Path(__file__).resolve().parents[1]
M, L = 12, 6


def rows(seed=0, users=40):
    g = torch.Generator().manual_seed(seed)
    probs = torch.linspace(1, 0.05, M)  # item 1 most held
    out = torch.stack([torch.multinomial(probs, L + 1, replacement=True, generator=g) + 1 for _ in range(users)])
    out[:5, :3] = 0  # some left padding
    out[out == M] = M - 1  # item M held by nobody: its count is 0, not floored to 1
    return out


def model(seed=1):
    torch.manual_seed(seed)
    cfg = dict(arch="transformer", d=8, heads=2, blocks=2, d_ff=16, dropout=0.0, tied=True, init_std=0.3, layers=1,
               reattention={"presence": "public"})
    return train.build(OmegaConf.create(cfg), M, L)


def test_buckets_split_items_by_how_many_users_hold_them():
    r = rows()
    bucket, counts = distraction.item_buckets(r, M, [0.5, 0.9])
    brute = torch.tensor([len({int(u) for u in (r == i).any(1).nonzero().flatten()}) for i in range(M + 1)])
    assert torch.equal(counts[1:], brute[1:]) and counts[M] == 0
    assert bucket[0] == -1
    order = sorted(range(1, M + 1), key=lambda i: (int(brute[i]), i))  # least held first, ties by id
    expect = [0] * 6 + [1] * 5 + [2] * 1  # shares (rank + 0.5) / 12 below 0.5: 6 items; below 0.9: 5 more
    assert [int(bucket[i]) for i in order] == expect


def test_masses_sum_to_one_and_match_uniform_attention_in_closed_form():
    m = model()
    r = rows(seed=3)
    inputs, target = r[:, :-1], r[:, -1]
    bucket, _ = distraction.item_buckets(r, M, [0.5, 0.9])
    got = distraction.masses(m, inputs, target, None, bucket, k=5, batch=7)
    for b in (1, 2):
        assert sum(got[f"b{b}_{name}"] for name in distraction.BUCKETS) == pytest.approx(1.0, abs=1e-5)
    with torch.no_grad():  # zero queries: every allowed position gets the same weight in every block
        for block in m.blocks:
            block.attn.q.weight.zero_()
            block.attn.q.bias.zero_()
    got = distraction.masses(m, inputs, target, None, bucket, k=5, batch=7)
    kind = bucket[inputs]
    allowed = (inputs != 0).double()
    tail = ((kind == 0).double() * allowed).sum(1) / allowed.sum(1)
    assert got["b1_tail"] == pytest.approx(float(tail.mean()), abs=1e-6)
    assert got["b2_tail"] == pytest.approx(float(tail.mean()), abs=1e-6)
    for name in distraction.BUCKETS:  # the chance level the measurement reports is uniform attention's
        assert got[f"uniform_{name}"] == pytest.approx(got[f"b2_{name}"], abs=1e-6)
    relevant = torch.zeros_like(inputs, dtype=torch.bool)
    relevant[:, -2] = True
    got = distraction.masses(m, inputs, target, relevant, bucket, k=5, batch=7)
    expect = (allowed[:, -2] / allowed.sum(1)).mean()
    assert got["b2_relevant"] == pytest.approx(float(expect), abs=1e-6)
    assert got["uniform_relevant"] == pytest.approx(float(expect), abs=1e-6)


def test_the_summary_reads_each_mass_against_uniform_attention():
    """The share of the way to chance: (mean - clean) / (uniform - clean), per mass."""
    import pandas as pd

    clean = {"variant": "clean", "noise": "none", "eps": float("inf"), "b2_tail": 0.30, "b2_relevant": 0.60,
             "ndcg": 50.0, "uniform_tail": 0.20, "uniform_relevant": 0.10}
    draws = [{"variant": v, "noise": "paper", "eps": 8.0, "b2_tail": t, "b2_relevant": r, "ndcg": 40.0}
             for v, t, r in (("noisy", 0.25, 0.35), ("noisy", 0.25, 0.35), ("corrected", 0.18, 0.60),
                             ("corrected", 0.18, 0.60))]
    summ = distraction.summary(pd.DataFrame([clean, *draws]), blocks=2).set_index("variant")
    assert summ.loc["noisy", "tail_to_uniform"] == pytest.approx(0.5)  # half way to chance
    assert summ.loc["corrected", "tail_to_uniform"] == pytest.approx(1.2)  # past it
    assert summ.loc["noisy", "relevant_to_uniform"] == pytest.approx(0.5)
    assert summ.loc["corrected", "relevant_to_uniform"] == pytest.approx(0.0)
    text = distraction.table(summ.reset_index(), 10)
    assert "| paper | 8 | 0.3000 | 0.2000 | 0.2500 ± 0.0000 | 0.1800 ± 0.0000 | 0.50 / 1.20 | 0.6000 | 0.1000 |" in text


def setting(seed, distraction, **seqrec):
    """Sequences of 60 users and the config ``distraction.measure`` reads (phantom, eps 8, B 20)."""
    from pipeline.seqrec.sequences import Sequences

    r = rows(seed=seed, users=60)
    seqs = Sequences(n_items=M, train=r, valid_input=r[:, :-1], valid_target=r[:, -1], test_input=r[:, 1:],
                     test_target=r[:, -1], popularity=torch.bincount(r.flatten(), minlength=M + 1))
    cfg = OmegaConf.create({
        "seed": 0, "clipping": {"name": "phantom", "C": 1.0},
        "privacy": {"eps": 8.0, "delta": 1e-5},
        "seqrec": {"k": 5, "eval_batch": 16, "batch_size": 20, "epochs": 1, "accountant": "rdp", **seqrec},
        "model": {"reattention": {"presence": "public", "form": "propagated"}},
        "distraction": {"draws": 2, "users": 50, "buckets": [0.5, 0.9], **distraction}})
    return seqs, cfg


@pytest.mark.slow
def test_without_noise_the_noisy_variant_is_the_clean_model():
    seqs, cfg = setting(5, {"eps": [8.0], "noise": ["uniform"], "uniform_std": 1e-12})
    m = model()
    out = distraction.measure(m, seqs, cfg, torch.Generator().manual_seed(0))
    clean = out[out.variant == "clean"].iloc[0]
    noisy = out[out.variant == "noisy"]
    assert len(noisy) == 2 and len(out[out.variant == "corrected"]) == 2
    for col in ("b1_tail", "b2_tail", "b2_head", "ndcg"):
        assert noisy[col].to_numpy() == pytest.approx(float(clean[col]), abs=1e-6)
    assert (out[out.variant == "noisy"]["sigma"] > 0).all()


@pytest.mark.slow
def test_adam_noise_is_the_runs_adam_error_at_every_eps_and_the_correction_is_told_it():
    from pipeline.seqrec import train

    seqs, cfg = setting(6, {"eps": [1.0, 8.0], "noise": ["adam", "paper"], "uniform_std": 0.0},
                        epochs=3, lr=0.01, warmup=0.2)
    plan = train.plan(cfg, seqs.n_users)
    expect = float(train.adam_errors(cfg, plan)[-1])
    assert plan.steps == 9 and 0.01 < expect < 0.05
    out = distraction.measure(model(), seqs, cfg, torch.Generator().manual_seed(0))
    adam = out[out.noise == "adam"]
    assert len(adam) == 2 * 2 * 2  # eps x draws x (noisy, corrected)
    assert adam["block_err"].to_numpy() == pytest.approx(expect, rel=1e-12)  # the same at eps 1 and 8
    assert adam["tail_item_err"].to_numpy() == pytest.approx(expect, rel=1e-12)
    paper = out[out.noise == "paper"]
    assert paper.groupby("eps")["block_err"].first().nunique() == 2  # the paper's errors move with eps


def cli(*args, cwd=ROOT):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return forkserver.run(["-m", "pipeline.seqrec.distraction", *args], cwd=cwd, env=env, timeout=600)


TINY = ["dataset=synthetic_longtail_tiny", "seqrec.epochs=1", "distraction.draws=2", "distraction.users=40",
        "distraction.eps=[8]", "seqrec.batch_size=32"]


@pytest.mark.slow
def test_the_entry_point_logs_to_mlflow_and_writes_report_dir(tmp_path):
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = cli(*TINY, f"mlflow.tracking_uri={store}", f"report.dir={tmp_path / 'report'}",
               f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = tmp_path / "report"
    for name in ("results.csv", "table.md", "distraction.png", "metrics.json"):
        assert (report / name).is_file(), name
    metrics = json.loads((report / "metrics.json").read_text())
    assert {"paper.eps8.noisy.tail", "paper.eps8.corrected.ndcg", "adam.eps8.noisy.tail", "clean.ndcg",
            "uniform.tail", "paper.eps8.noisy.tail_to_uniform"} <= set(metrics)
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=store)
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FINISHED" and run.data.tags["kind"] == "distraction"
    assert "distraction.paper.eps8.noisy.tail_mass" in run.data.metrics


@pytest.mark.slow
@pytest.mark.parametrize("bad,key", [
    ("distraction.draws=1", "distraction.draws"),
    ("distraction.eps=[8,-1]", "distraction.eps[1]"),
    ("distraction.eps=[8,1000]", "distraction.eps[1] = 1000"),  # above MAX_EPS: Opacus's calibration would not end
    ("distraction.eps=[1e-9,8]", "distraction.eps[0] = 1e-09"),  # no noise multiplier reaches it
    ("distraction.noise=[nosuch]", "distraction.noise"),
    ("distraction.buckets=[0.9,0.5]", "distraction.buckets"),
    ("model=transformer", "model=transformer"),
    ("clipping=none", "clipping=none"),
    ("distraction=null", "distraction: no such settings"),  # refused once Hydra made the folder: removed again
])
def test_bad_settings_are_refused_before_any_folder(tmp_path, bad, key):
    proc = cli(*merged(*TINY, bad), f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and key in lines[0], proc.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "mlflow.db").exists()
