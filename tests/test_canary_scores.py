"""White-box canaries' per-step log-likelihood ratio scores (``pipeline/audit/canaries.py``) and what the
whole-run audit builds on them (``pipeline/audit/run.py``): the ratio is the Poisson-subsampled
Gaussian mechanism's, the per-step moments are read without the inclusion bits, the ratio keeps what
the sum throws away where the noise is small, the simulation of a run without data is what a real
run's excluded canaries follow (and replayed noise breaks that), and ``audit.plan_only`` prints each
bound's expected value and ceiling before anything runs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from scipy.stats import norm

from pipeline.audit import one_run
from pipeline.audit import summary as stage_summary
from pipeline.audit import run as run_audit
from pipeline.audit.canaries import DiracCanaries, step_llr, step_moments


def test_the_step_ratio_is_the_subsampled_gaussian_likelihood_ratio():
    y = np.linspace(-4, 6, 41)
    for q, v, mu, C in ((0.1, 1.0, 0.0, 1.0), (0.5, 0.3, 0.2, 2.0), (1.0, 2.0, -1.0, 0.5)):
        want = np.log(((1 - q) * norm.pdf(y, mu, np.sqrt(v)) + q * norm.pdf(y, mu + C, np.sqrt(v)))
                      / norm.pdf(y, mu, np.sqrt(v)))
        np.testing.assert_allclose(step_llr(y, mu=mu, v=v, q=q, C=C), want, rtol=1e-10, atol=1e-12)


def test_a_steps_moments_are_read_without_the_bits():
    # m observations: half the canaries included, each sampled with q; the excluded law N(0.3, 2.0)
    rng = np.random.default_rng(0)
    m, q, C = 200_000, 0.2, 1.5
    bits = rng.random(m) < 0.5
    y = 0.3 + np.sqrt(2.0) * rng.standard_normal(m) + C * (bits & (rng.random(m) < q))
    mu, v = step_moments(y, q=q, C=C)
    assert mu == pytest.approx(0.3, abs=0.01) and v == pytest.approx(2.0, rel=0.02)
    assert step_moments(np.zeros(10), q=q, C=C)[1] == pytest.approx(C * C * 1e-6)  # floored, never zero


def _run(m, steps, sigma, *, replay_from=None, seed=0):
    """Dirac canaries on a model with no data (zero gradients), sigma C noise once per step (the shared
    trainer's ``add_noise``); ``replay_from``: steps after it draw the noise of the steps from the start."""
    from pipeline.dpsgd import noise

    params = [torch.nn.Parameter(torch.zeros(m))]
    can = DiracCanaries(params, m=m, C=1.0, sample_rate=0.25, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    start = g.get_state()
    for t in range(steps):
        if replay_from is not None and t == replay_from:
            g.set_state(start)
        params[0].grad = torch.zeros(m)
        can.add()
        noise.add_noise(params, sigma, 1.0, g)
        can.observe()
    return can


def test_the_ratio_keeps_what_the_sum_throws_away_at_small_noise():
    can = _run(4000, 60, 0.6)
    bits = can.reveal()
    kw = dict(delta=1e-5, confidence=0.95, guesses=run_audit.default_guesses(4000))
    ratio = one_run.one_run_bound(can.llr_scores(), bits, **kw).eps_lower
    total = one_run.one_run_bound(can.scores(), bits, **kw).eps_lower
    assert ratio > total + 0.3 and ratio > 2.0


def test_a_run_without_data_matches_its_simulation_and_replayed_noise_does_not():
    @dataclasses.dataclass
    class Plan:
        sigma: float
        sample_rate: float = 0.25
        steps: int = 80

    honest = _run(3000, 80, 1.0, seed=2)
    assert run_audit.sanity(honest, honest.reveal(), Plan(1.0)) > 0.01
    replayed = _run(3000, 80, 1.0, replay_from=40, seed=2)  # the resume control's defect
    assert run_audit.sanity(replayed, replayed.reveal(), Plan(1.0)) < 1e-4
    # the simulation itself: the canaries alone, as scored in a run
    linear, llr, bits = run_audit.simulate(2000, q=0.25, sigma=1.0, steps=50, seed=0)
    assert linear.shape == llr.shape == bits.shape == (2000,)
    assert linear[bits].mean() == pytest.approx(0.25 * 50, rel=0.1) and abs(linear[~bits].mean()) < 0.5


def test_the_plan_prints_each_bounds_expected_value_and_ceiling_before_anything_runs(capsys):
    from omegaconf import OmegaConf

    from pipeline.validation import ConfigError

    @dataclasses.dataclass
    class Plan:
        sigma: float
        sample_rate: float
        steps: int

    claimed = Plan(1.7, 0.25, 60)
    cfg = OmegaConf.create({"audit": {"plan_only": True, "confidence": 0.95}})
    variants = [("engine", "dirac"), ("no_noise", "dirac"), ("engine", "input")]
    m = {"dirac": 500, "input": 100}
    assert run_audit.plan_only(cfg, variants, m, 10_000, "audit.lm.m", claimed=claimed, eps=8.0, delta=1e-5,
                               accountant="prv")
    out = capsys.readouterr().out
    assert "audit plan (claim eps = 8" in out and "engine:dirac" in out and "input canaries: no model" in out
    rows = run_audit.plan(variants, m, claimed=claimed, eps=8.0, delta=1e-5, accountant="prv", confidence=0.95, seeds=1)
    engine, bare = rows[0], rows[1]
    for kind in ("steinke", "fdp", "gauss", "gdp"):  # the two proofs and the two estimates
        assert 0 <= engine[f"llr_{kind}"] <= engine[f"ceiling_{kind}"] + 1e-9
        assert bare[f"llr_{kind}"] >= engine[f"llr_{kind}"]
    for kind in ("steinke", "fdp"):  # the proofs' power (a run at twice the claim) and their sum-statistic values
        assert 0 <= engine[f"power_{kind}"] <= engine[f"ceiling_{kind}"] + 1e-9 and f"sum_{kind}" in engine
    assert "power (proofs)" in out and "estimates" in out
    assert engine["ceiling_steinke"] == pytest.approx(one_run.one_run_ceiling(
        500, delta=1e-5, guesses=run_audit.default_guesses(500)))
    cfg.audit.plan_only = False
    assert not run_audit.plan_only(cfg, variants, m, 10_000, "audit.lm.m", claimed=claimed, eps=8.0, delta=1e-5,
                                   accountant="prv")
    with pytest.raises(ConfigError, match="audit.lm.m = 500: each white-box canary is one of the model's 400"):
        run_audit.plan_only(cfg, variants, m, 400, "audit.lm.m", claimed=claimed, eps=8.0, delta=1e-5, accountant="prv")


def test_a_stages_audits_over_seeds_are_summarised_per_claim_model_and_variant(tmp_path):
    import json

    import pandas as pd

    base = {"canaries": "dirac", "m": 100, "eps_lower": 0.2, "fdp_p": 0.5, "fdp_eps_proved": 0.3, "best_proved": 0.3,
            "gauss_eps_estimate": 0.4, "gdp_eps_estimate": 0.5, "best_estimate": 0.5, "sum_eps_lower": 0.2,
            "eps_ceiling": 4.0, "fdp_ceiling": 8.0, "gauss_ceiling": 9.0, "gdp_ceiling": 20.0, "power": 0.5,
            "sanity_p": 0.3, "confidence": 0.95}
    controls = {0: {"verdict": "violation (Steinke: ...; f-DP test: ...)", "eps_lower": 1.5, "fdp_p": 0.01,
                    "fdp_eps_proved": 1.4},  # proved twice
                1: {"verdict": "consistent; estimates under a Gaussian trade-off above the claim (...): not a proof",
                    "eps_lower": 0.5, "fdp_p": 0.3, "fdp_eps_proved": 0.6, "best_estimate": 1.2}}  # estimated only
    for seed, control in controls.items():
        folder = tmp_path / "runs" / f"eps1-tied-seed{seed}"
        folder.mkdir(parents=True)
        pd.DataFrame([base | {"variant": "engine", "verdict": "too weak to say (...)" if seed == 0 else "consistent"},
                      base | {"variant": "noise_halved"} | control]).to_csv(folder / "audit.csv", index=False)
    (tmp_path / "runs" / "eps8-untied-seed0").mkdir()
    pd.DataFrame([base | {"variant": "engine", "verdict": "consistent", "best_proved": 5.0}]).to_csv(
        tmp_path / "runs" / "eps8-untied-seed0" / "audit.csv", index=False)
    (tmp_path / "runs" / "notes").mkdir()  # not an audit's folder: left alone
    summary = stage_summary.summarize(tmp_path).set_index(["claim", "model", "variant"])
    halved = summary.loc[(1.0, "tied", "noise_halved")]
    # flagged counts proofs only; an estimate above the claim is counted beside, never flagged
    assert halved[["seeds", "flagged", "steinke_proofs", "fdp_proofs", "estimates_above"]].tolist() == [2, 1, 1, 1, 1]
    assert halved["eps_lower_median"] == pytest.approx(1.0) and halved["fdp_eps_proved_min"] == pytest.approx(0.6)
    assert summary.loc[(1.0, "tied", "engine"), "flagged"] == 0
    assert summary.loc[(8.0, "untied", "engine"), "best_proved_median"] == 5.0
    rows = pd.read_csv(tmp_path / "audit.csv")
    assert len(rows) == 5 and set(rows["seed"]) == {0, 1}
    table = (tmp_path / "audit.md").read_text()
    assert "| 1 | tied | noise_halved | dirac | 100 | 2 | 1 (1 / 1) | 1.00 [0.50, 1.50] | 1.00 [0.60, 1.40] | 0.3 |" in table
    assert "Estimates (true only if the run's trade-off is Gaussian, never a proof)" in table
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["eps1.tied.noise_halved.dirac.flagged"] == 1 and metrics["runs"] == 5
    assert metrics["eps1.tied.noise_halved.dirac.estimates_above"] == 1
