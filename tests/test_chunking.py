"""Results do not depend on how the trials are split: every random draw belongs to a trial."""

import math

import numpy as np
import pytest
import torch

from pipeline import rng
from pipeline.noisyhead import config, data, evaluate
from pipeline.noisyhead.methods import ESTIMATORS

METHODS = "method=[ridge,gd,noisyhead,noisyhead_tight,dp_ridge,ssp,dpsgd]"


def _per_trial(cfg_for, chunk: int, threads: int, *overrides: str):
    cfg = cfg_for("trials=20", f"compute.chunk_trials={chunk}", METHODS, "method.dpsgd.batch_size=50",
                  "regime.N=200", *overrides)
    const = config.validate(cfg)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        keep = data.attack_prompts(cfg)
        problem = data.synthetic(const, trials=cfg.trials, n_test=cfg.dataset.n_test, seed=cfg.seed, chunk=chunk,
                                 dtype=torch.float64, keep=keep)
        fits = {name: ESTIMATORS[spec.estimator].fit(problem, const, cfg, spec) for name, spec in cfg.method.items()}
    finally:
        torch.set_num_threads(previous)
    risks = {name: evaluate.gap(fit.gamma, fits["ridge"].gamma, problem.test, chunk) for name, fit in fits.items()}
    return problem, fits, risks


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [(), ("regime.tau=0.5", "attack=perturb", "attack.prompts=3")])
def test_chunk_size_and_threads_change_no_number(cfg_for, overrides):
    p7, fits7, risks7 = _per_trial(cfg_for, 7, 1, *overrides)
    p50, fits50, risks50 = _per_trial(cfg_for, 50, 2, *overrides)
    assert p7.fingerprint == p50.fingerprint  # the prompts are bit for bit the same
    for part in ("train", "private", "test"):
        a, b = getattr(p7, part), getattr(p50, part)
        assert torch.equal(a.q, b.q) and torch.equal(a.v, b.v) and torch.equal(a.y, b.y)
    if p7.kept is not None:
        assert torch.equal(p7.kept.index, p50.kept.index) and torch.equal(p7.kept.x, p50.kept.x)
    for name in fits7:
        # the same draws; only the batch size of the linear algebra differs (round-off)
        torch.testing.assert_close(fits7[name].gamma, fits50[name].gamma, rtol=1e-12, atol=1e-12, msg=name)
        torch.testing.assert_close(risks7[name], risks50[name], rtol=1e-10, atol=1e-14, msg=name)
    assert (risks7["noisyhead"] > 0).all() and (risks7["ridge"] == 0).all()


def test_a_trials_draws_do_not_depend_on_its_neighbours():
    """Trial 5's generator is the same whether it is drawn alone or among 20, and no two
    trials of a stream share a seed."""
    alone = rng.trial_normal(0, "noise:x", slice(5, 6), (3, 3), torch.float64)
    among = rng.trial_normal(0, "noise:x", slice(0, 20), (3, 3), torch.float64)
    assert torch.equal(alone[0], among[5])
    seeds = rng.seeds(0, "noise:x", range(100_000))
    assert len(np.unique(seeds)) == len(seeds)
    assert not np.array_equal(rng.seeds(0, "a", range(10)), rng.seeds(0, "b", range(10)))
    assert not np.array_equal(rng.seeds(0, "a", range(10)), rng.seeds(1, "a", range(10)))


def test_slices_cut_each_trial_at_fixed_offsets():
    """A trial larger than a slice is cut at the same offsets wherever it starts."""
    for n_trials in (1, 3, 7):
        offsets = {}
        for start, m, segments in data._slices(n_trials, 10, 4):
            assert m <= 4 and sum(hi - lo for _, lo, hi in segments) == m
            for t, lo, hi in segments:
                offsets.setdefault(t, []).append(hi - lo)
        assert all(sizes == [4, 4, 2] for sizes in offsets.values())


def test_the_zero_predictors_row_has_its_closed_forms(cfg_for, monkeypatch):
    """The reference row of every cell: predicting 0 has excess risk mean_k <Gamma*, Z_k>^2 against
    the oracle and test MSE mean_k y_k^2, per trial; and it needs no attack risk (it reads no data)."""
    monkeypatch.setattr(evaluate.tracking, "log_metrics", lambda *a, **k: None)  # no MLflow run here
    cfg = cfg_for("trials=6", "regime.N=60", "dataset.n_test=9", "method=[ridge,gd]")
    const = config.validate(cfg)
    problem = data.synthetic(const, trials=6, n_test=9, seed=0, chunk=6, dtype=torch.float64)
    fits = {name: ESTIMATORS[spec.estimator].fit(problem, const, cfg, spec) for name, spec in cfg.method.items()}
    rows = evaluate.run(problem, fits, const, cfg).set_index("method")
    zero = rows.loc["zero"]
    oracle = problem.test.inner(fits["ridge"].gamma)[:, 0]  # (B, n_test): the oracle's predictions
    assert zero["excess_risk_mean"] == pytest.approx(float(oracle.square().mean(-1).mean()), rel=1e-12)
    assert zero["test_mse_mean"] == pytest.approx(float(problem.test.y.square().mean(-1).mean()), rel=1e-12)
    assert not zero["private"] and math.isnan(zero["attack_risk_mean"])
