"""The whole-run audit of DPFormer's DP-SGD (pipeline/seqrec/audit_run.py): the canaries join the
real training loop's clipped sums before the noise without moving anything else, an audited run
resumes to the uninterrupted scores, an excluded input canary has no gradient, the controls are
caught or said to be unseeable, and bad settings are refused by name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from pipeline.audit.canaries import DiracCanaries
from pipeline.validation import ConfigError

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["experiment=dpformer_ci", "dataset.n_users=60", "dataset.L=6", "model.d=8", "model.d_ff=16",
         "seqrec.batch_size=20", "seqrec.epochs=2"]


def audit_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("audit", overrides=[*SMALL, *overrides])


def _data(cfg):
    from pipeline.seqrec import data

    return data.load(cfg.dataset, int(cfg.dataset.L), int(cfg.seed))


def test_canaries_join_the_clipped_sum_before_the_noise_and_change_nothing_else():
    """noisy_gradient with canaries: the observed coordinate is the clipped sum's plus C per sampled
    canary plus the noise (before the division by B); with no canary included, every gradient is
    the one without canaries, bit for bit, and the noise generator is drawn as without them."""
    from pipeline.seqrec import clipping, train

    cfg = audit_cfg()
    seqs = _data(cfg)
    rows = seqs.train[:7]

    def step(canaries, seed=3):
        torch.manual_seed(0)
        model = train.build(cfg.model, seqs.n_items, seqs.L)
        engine = clipping.make("phantom", model, cfg.clipping)
        made = canaries(model) if canaries else None
        gen = torch.Generator().manual_seed(seed)
        train.dp_gradient(engine, model, rows[:, :-1], rows[:, 1:], sigma=0.7, C=1.0, expected_batch=5,
                             generator=gen, canaries=made)
        return [p.grad.clone() for p in model.parameters()], gen.get_state(), made

    plain, plain_gen, _ = step(None)

    def none_included(model):
        c = DiracCanaries(list(model.parameters()), m=50, C=1.0, sample_rate=1.0, seed=1)
        c._included[:] = False
        return c

    quiet, quiet_gen, c = step(none_included)
    assert all(torch.equal(a, b) for a, b in zip(plain, quiet)) and torch.equal(plain_gen, quiet_gen)
    expected = np.zeros(50)  # each canary's coordinate of the noisy sum: the gradient left times B (5), over C (1)
    for w, (ix, js) in c._by_param.items():
        expected[js] = (plain[w].view(-1)[ix] * 5).double().numpy()
    np.testing.assert_allclose(c.scores(), expected, rtol=1e-6)

    def all_included(model):
        c = DiracCanaries(list(model.parameters()), m=50, C=1.0, sample_rate=1.0, seed=1)
        c._included[:] = True
        return c

    loud, _, c = step(all_included)
    moved = np.concatenate([((b - a).view(-1) * 5)[ix].numpy() for (ix, _), a, b in
                            zip(c._by_param.values(), [plain[w] for w in c._by_param], [loud[w] for w in c._by_param])])
    np.testing.assert_allclose(moved, 1.0, rtol=1e-4)  # C = 1 on each canary's coordinate, the rest untouched
    assert sum(int((b != a).sum()) for a, b in zip(plain, loud)) == 50


def test_an_audited_run_killed_and_resumed_scores_its_canaries_as_an_uninterrupted_one(tmp_path):
    from pipeline.seqrec import train

    cfg = audit_cfg("seqrec.epochs=4")
    seqs = _data(cfg)
    plan = train.plan(cfg, seqs.n_users)
    made = []

    def canaries(model):
        made.append(DiracCanaries(list(model.parameters()), m=40, C=1.0, sample_rate=plan.sample_rate, seed=2))
        return made[-1]

    whole, _ = train.run(seqs, cfg, plan, canaries=canaries)
    expected = made[-1].scores()

    class Stop(Exception):
        pass

    def stop(epoch, metrics):
        if epoch == 2:
            raise Stop

    path = tmp_path / "ckpt.pt"
    with pytest.raises(Stop):
        train.run(seqs, cfg, plan, canaries=canaries, checkpoint=path, digest="x", on_epoch=stop)
    resumed, _ = train.run(seqs, cfg, plan, canaries=canaries, checkpoint=path, resume=True, digest="x")
    assert np.array_equal(made[-1].scores(), expected)
    assert all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(), resumed.state_dict().values()))
    with pytest.raises(Stop):
        train.run(seqs, cfg, plan, checkpoint=tmp_path / "plain.pt", digest="y", on_epoch=stop)
    with pytest.raises(ValueError, match="holds no canaries' state"):  # an unaudited checkpoint is not resumed into one
        train.run(seqs, cfg, plan, canaries=canaries, checkpoint=tmp_path / "plain.pt", resume=True, digest="y")
    with pytest.raises(ValueError, match="a plain run does not resume it"):  # nor an audited one into a plain run
        train.run(seqs, cfg, plan, checkpoint=path, resume=True, digest="x")

    def others(model):  # canaries of another seed: other coordinates and bits
        return DiracCanaries(list(model.parameters()), m=40, C=1.0, sample_rate=plan.sample_rate, seed=5)

    with pytest.raises(ValueError, match="drawn with seed 2 cannot resume an audit whose canaries are drawn with seed 5"):
        train.run(seqs, cfg, plan, canaries=others, checkpoint=path, resume=True, digest="x")


def test_an_excluded_input_canary_is_all_padding_with_no_gradient():
    from pipeline.seqrec import audit_run, clipping, train

    cfg = audit_cfg()
    seqs = _data(cfg)
    rows, included = audit_run.input_canaries(30, L=seqs.L, n_items=seqs.n_items, seed=0)
    assert rows.shape == (30, seqs.L + 1) and rows.min() >= 1 and rows.max() <= seqs.n_items
    assert 0 < included.sum() < 30 and len({tuple(r) for r in rows.tolist()}) == 30
    model = train.build(cfg.model, seqs.n_items, seqs.L)
    engine = clipping.make("phantom", model, cfg.clipping)
    batch = torch.cat([seqs.train[:3], torch.zeros(1, seqs.L + 1, dtype=torch.long)])
    losses, norms = engine.step(batch[:, :-1], batch[:, 1:])
    assert losses[-1] == 0 and norms[-1] == 0 and torch.isfinite(norms).all() and (norms[:3] > 0).all()
    from pipeline.seqrec.models import user_losses  # the brute force: its gradient is exactly 0, every parameter

    lone = user_losses(model(batch[-1:, :-1]), batch[-1:, :-1], batch[-1:, 1:]).sum()
    grads = torch.autograd.grad(lone, list(model.parameters()), allow_unused=True)
    assert all(g is None or not g.any() for g in grads)


@pytest.mark.slow
def test_no_noise_is_caught_and_a_clipping_defect_is_said_unseeable_by_white_box_canaries():
    from pipeline.seqrec import audit_run

    cfg = audit_cfg("seqrec.epochs=4", "seqrec.batch_size=30")
    seqs = _data(cfg)
    rows = {v: audit_run.run(seqs, cfg, variant=v, m=400) for v in ("engine", "no_noise", "one_branch")}
    assert rows["no_noise"]["verdict"].startswith("violation") and rows["no_noise"]["eps_lower"] > 1
    assert not rows["engine"]["verdict"].startswith("violation") and rows["engine"]["eps_lower"] <= rows["engine"]["eps_ceiling"]
    assert rows["no_noise"]["sigma_used"] == 0 and rows["engine"]["sigma_used"] == rows["engine"]["sigma_claimed"] > 0
    one = rows["one_branch"]  # white-box canaries join after clipping: the row says it cannot see the defect
    assert "join the sum after clipping" in one["verdict"], one["verdict"]
    inputs = audit_run.run(seqs, cfg, variant="engine", canaries="input", m=30)
    assert inputs["n"] == seqs.n_users + 30 and inputs["canaries"] == "input" and inputs["verdict"] != "consistent"


@pytest.mark.parametrize("overrides, key", [
    (["audit.seqrec.run.variants=[half]"], "audit.seqrec.run.variants"),
    (["audit.seqrec.run.variants=[engine,engine]"], "named twice"),
    (["audit.seqrec.run.variants=[engine:text]"], "names canaries"),
    (["audit.seqrec.run.m=0"], "audit.seqrec.run.m"),
    (["audit.seqrec.run.variants=[resume_reuses_noise]", "seqrec.epochs=1"], "has no half"),
    (["audit.seqrec.run.variants=[one_branch]", "model=transformer_untied"], "one_branch is a bug of the tied"),
    (["audit.seqrec.run.variants=[engine:input]", "model=dpformer"], "item histogram would count"),
    (["privacy.eps=inf"], "audits a private run"),
    (["+audit.seqrec.run.input_M=5"], "audit.seqrec.run.input_M is not a key"),
])
def test_bad_settings_are_refused_by_name(overrides, key):  # noqa: D103
    from pipeline.seqrec import audit_run

    with pytest.raises(ConfigError, match=key.replace("[", r"\[")):
        audit_run.validate(audit_cfg("audit.scope=run", *overrides))


def test_one_branch_trains_with_the_one_branch_engine(monkeypatch):
    """The control is wired to the test double (pipeline.seqrec.audit.OneBranchPhantom): its norms of
    the tied table, from the input branch only, are below the real engine's on every user with a target."""
    from pipeline.clipping import PhantomClipping
    from pipeline.seqrec import audit as step_audit
    from pipeline.seqrec import audit_run

    cfg = audit_cfg("seqrec.epochs=2")
    seqs = _data(cfg)
    seen = []

    class Spy(step_audit.OneBranchPhantom):
        def _sq_norms(self, uses, n, stacks=None):
            buggy = super()._sq_norms(uses, n)
            real = PhantomClipping._sq_norms(self, uses, n)  # the real engine's, every use and cross term
            seen.append((sum(buggy.values()).detach(), sum(real.values()).detach()))
            return buggy

    monkeypatch.setattr(step_audit, "OneBranchPhantom", Spy)
    audit_run.run(seqs, cfg, variant="one_branch", m=50)
    assert seen and all((b <= r * (1 + 1e-5)).all() for b, r in seen)
    assert any((b < r * 0.99).any() for b, r in seen)

