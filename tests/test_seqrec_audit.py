"""The canary-user audit of one DP-SGD step (pipeline/seqrec/audit.py): the real Phantom engine keeps
the canary's clipped gradient within C and passes at the claimed eps; halved noise and fastDP's
one-branch norm of the tied item table are flagged; the noise the audit draws is the training
step's; the CLI end to end."""

from pathlib import Path

import forkserver
import mlflow
import numpy as np
import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir
from scipy.stats import ks_2samp

from pipeline import privacy
from pipeline.seqrec import audit as seqaudit
from pipeline.seqrec import clipping, data, models, train

ROOT = Path(__file__).resolve().parents[1]
# a model and data set smaller than dpformer_ci's (1,528 parameters): 100,000 runs per batch in about a second
TINY = ["experiment=dpformer_ci", "model.d=8", "model.d_ff=16", "dataset.n_items=30", "dataset.n_users=40",
        "dataset.L=10", "dataset.min_len=3", "dataset.mean_len=10", "dataset.max_len=30", "audit.seqrec.users=10"]


@pytest.fixture(scope="module")
def setup():
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("audit", overrides=TINY)
    seqs = data.load(cfg.dataset, int(cfg.dataset.L), int(cfg.seed))
    D, D_, item = seqaudit.batches(seqs, int(cfg.audit.seqrec.users))
    return cfg, seqs, D, D_, item


def _clipped_per_user(variant, cfg, seqs, D):
    """||c_i g_i|| per user of D: brute-force per-user gradients (one backward each) times the
    engine's own coefficients."""
    dtype = getattr(torch, cfg.compute.dtype)
    model = seqaudit.model_for(cfg, seqs, dtype)
    grads = []
    for i in range(D.shape[0]):
        model.zero_grad()
        models.user_losses(model(D[i:i + 1, :-1]), D[i:i + 1, :-1], D[i:i + 1, 1:]).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    g = torch.stack(grads).norm(dim=1)
    engine = seqaudit.engine_for(variant, model, cfg)
    _, norms = engine.step(D[:, :-1], D[:, 1:])
    c = clipping.coefficients(norms, C=float(cfg.clipping.C), rule=cfg.clipping.rule, gamma=float(cfg.clipping.gamma))
    return c * g


def test_batches_differ_by_one_canary_of_the_rarest_item(setup):
    cfg, seqs, D, D_, item = setup
    assert torch.equal(D[:-1], D_) and D_.shape[0] == 10
    counts = torch.bincount(D_.flatten(), minlength=seqs.n_items + 1)[1:]
    assert counts[item - 1] == counts.min() and (D[-1] == item).all()


def test_real_engine_clips_the_canary_within_C_and_passes(setup):
    """Phantom (automatic clipping, C = 1): every user's clipped gradient, the canary's included, has
    norm <= C; the difference of the two clipped sums is the canary's clipped gradient; at 100,000
    runs per batch the audit has the power to show a twofold violation and finds none."""
    cfg, seqs, D, D_, _ = setup
    C = float(cfg.clipping.C)
    clipped = _clipped_per_user("engine", cfg, seqs, D)
    assert (clipped <= C * (1 + 1e-9)).all() and clipped[-1] > 0.99 * C
    row, *_ = seqaudit.measure("engine", cfg, seqs, D, D_)
    assert row["canary_norm"] == pytest.approx(float(clipped[-1]), rel=1e-6)
    assert row["eps_true"] <= row["eps"]
    assert row["verdict"] == "consistent" and 0.2 < row["eps_lower"] <= row["eps"], row


def test_halved_noise_is_a_violation(setup):
    cfg, seqs, D, D_, _ = setup
    row, *_ = seqaudit.measure("noise_halved", cfg, seqs, D, D_)
    assert row["noise_scale"] == 0.5 and row["canary_norm"] <= float(cfg.clipping.C)
    assert row["verdict"] == "violation" and row["eps_lower"] > row["eps"], row


@pytest.mark.slow
def test_one_branch_norm_lets_the_canary_exceed_C_and_is_a_violation(setup):
    """fastDP's bug (the tied table's norm from the lookup branch only): measured directly, the
    canary's clipped gradient is more than twice C (every user's exceeds C), and the audit proves
    eps above the claim."""
    cfg, seqs, D, D_, _ = setup
    C = float(cfg.clipping.C)
    clipped = _clipped_per_user("one_branch", cfg, seqs, D)
    assert clipped[-1] > 2 * C and (clipped > C).all()
    row, *_ = seqaudit.measure("one_branch", cfg, seqs, D, D_)
    assert row["canary_norm"] == pytest.approx(float(clipped[-1]), rel=1e-6)
    assert row["verdict"] == "violation" and row["eps_lower"] > row["eps"], row


class _FixedSum:
    """An engine that leaves a given clipped sum S in the gradients (to test the noise alone), with the
    engines' interface (``step(loss_fn, batch)``) and bound as the task binds one (``.engine``)."""

    private = True

    def __init__(self, model, S):
        self.model, self.S, self.engine = model, S, self

    def step(self, loss_fn, batch):
        ids, _ = batch
        at = 0
        for p in self.model.parameters():
            p.grad = self.S[at:at + p.numel()].view_as(p).clone()
            at += p.numel()
        return torch.zeros(ids.shape[0]), torch.zeros(ids.shape[0])


@pytest.mark.slow
def test_audit_noise_is_the_training_steps_noise(setup):
    """The audit's batched full-vector releases <S + sigma C Z, u> against train.noisy_gradient's own
    noise (times B), projected on the same u: the same distribution (two-sample KS test), mean S.u
    and std sigma C (C = 0.3, so a noise missing its factor C would fail)."""
    cfg, seqs, D, _, _ = setup
    model = seqaudit.model_for(cfg, seqs, torch.float64)
    P = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(5)
    S = torch.randn(P, generator=gen, dtype=torch.float64)
    u = torch.randn(P, generator=gen, dtype=torch.float64)
    u /= u.norm()
    sigma, C, B, runs = 2.0, 0.3, 7, 3000
    engine = _FixedSum(model, S)
    ref = np.empty(runs)
    for r in range(runs):
        train.dp_gradient(engine, model, D[:, :-1], D[:, 1:], sigma=sigma, C=C, expected_batch=B, generator=gen)
        ref[r] = float(B * torch.cat([p.grad.flatten() for p in model.parameters()]) @ u)
    ours = seqaudit.releases(S, u, std=sigma * C, runs=runs, chunk=1000, seed=0, stream="test")
    assert ks_2samp(ours, ref).pvalue > 1e-3
    for s in (ours, ref):
        assert abs(s.mean() - float(S @ u)) < 4 * sigma * C / np.sqrt(runs)
        assert s.std() == pytest.approx(sigma * C, rel=0.06)


def test_claim_is_the_analytic_gaussian_mechanism(setup):
    """sigma is the analytic Gaussian multiplier of the claim: a step of sensitivity exactly C has
    delta(eps) = delta (Balle and Wang's closed form)."""
    cfg, *_ = setup
    eps, delta = float(cfg.privacy.eps), float(cfg.privacy.delta)
    sigma = privacy.gaussian_multiplier(eps=eps, delta=delta)
    assert privacy.gaussian_delta(mu=1 / sigma, eps=eps) == pytest.approx(delta, rel=1e-3)


def test_run_sigma_is_the_runs_multiplier_against_one_steps_exact_eps(setup):
    """audit.seqrec.sigma=run: the training run's calibrated multiplier (train.plan at privacy.eps = 8),
    and the claim is one Gaussian step's eps with it: delta(eps) = delta exactly."""
    cfg, seqs, *_ = setup
    cfg = cfg.copy()
    cfg.privacy.eps, cfg.audit.seqrec.sigma = 8.0, "run"
    sigma, eps, delta = seqaudit.claim(cfg, seqs.n_users)
    assert sigma == train.plan(cfg, seqs.n_users).sigma and 0 < sigma < 2
    assert privacy.gaussian_delta(mu=1 / sigma, eps=eps) == pytest.approx(delta, rel=1e-3)
    assert privacy.gaussian_delta(mu=1 / sigma, eps=0.99 * eps) > 1.01 * delta  # the smallest such eps


def _cli(tmp_path, *args):
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = forkserver.run(["-m", "pipeline.audit", *TINY, *args, f"mlflow.tracking_uri={store}",
                           f"hydra.run.dir={tmp_path / 'out'}"], cwd=ROOT, timeout=600)
    return proc, store


@pytest.mark.slow
def test_cli_audits_the_engine_and_the_controls(tmp_path):
    """python -m pipeline.audit experiment=dpformer_ci ... controls: one row of audit.csv, one MLflow run
    (kind=audit, FINISHED, verdict tag) and one histogram per variant; at 20,000 runs per batch the
    one-branch bug is already proven, the real engine is not flagged."""
    proc, store = _cli(tmp_path, "audit.runs=20000", "audit.seqrec.controls=[noise_halved,one_branch]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = pd.read_csv(tmp_path / "out" / "audit.csv").set_index("method")
    assert list(table.index) == ["phantom:engine", "phantom:noise_halved", "phantom:one_branch"]
    assert (table["runs"] == 20_000).all() and (table["eps"] == 1.0).all()
    assert table.loc["phantom:engine", "eps_lower"] <= 1.0 and table.loc["phantom:engine", "verdict"] != "violation"
    assert table.loc["phantom:one_branch", "verdict"] == "violation"
    assert table.loc["phantom:one_branch", "canary_norm"] > 2.0
    for v in ("engine", "noise_halved", "one_branch"):
        assert (tmp_path / "out" / f"audit_seqrec_{v}.png").stat().st_size > 1000
    mlflow.set_tracking_uri(store)
    runs = mlflow.search_runs(search_all_experiments=True, filter_string="tags.kind = 'audit'")
    assert len(runs) == 3 and set(runs["status"]) == {"FINISHED"}
    assert set(runs["tags.task"]) == {"seqrec"}
    assert dict(zip(runs["tags.method"], runs["tags.verdict"]))["phantom:one_branch"] == "violation"


@pytest.mark.slow
@pytest.mark.parametrize("override,message", [
    ("audit.seqrec.controls=[nosuch]", "audit.seqrec.controls"),
    ("model=transformer_untied", "one_branch"),
])
def test_cli_refuses_bad_input_before_any_run(tmp_path, override, message):
    proc, _ = _cli(tmp_path, override, "audit.seqrec.controls=[one_branch]" if override.startswith("model") else "audit.runs=10")
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], proc.stderr[-2000:]
    assert not (tmp_path / "out" / "audit.csv").exists()
    assert not (tmp_path / "mlflow.db").exists()
