"""The perturbation attack of Section 5, and the risks it is measured by."""


import pytest
import torch
from omegaconf import OmegaConf

from pipeline.noisyhead import attacks, config, data, evaluate
from pipeline.noisyhead.features import from_tokens

D64 = torch.float64


@pytest.fixture
def attacked_setup(cfg_for):
    cfg = cfg_for("attack=perturb", "trials=6", "regime.N=30", "regime.L=7", "dataset.n_test=15",
                  "compute.chunk_trials=4", "attack.prompts=2")
    const = config.validate(cfg)
    problem = data.synthetic(const, trials=6, n_test=15, seed=0, chunk=4, dtype=D64, keep=2)
    return cfg, const, problem


def test_kept_tokens_are_the_chosen_prompts(attacked_setup):
    cfg, const, problem = attacked_setup
    kept = problem.kept
    assert kept.index.shape == (6, 2) and (kept.index[:, 0] != kept.index[:, 1]).all()
    again = from_tokens(kept.x, kept.y)
    rows = torch.arange(6).unsqueeze(1)
    assert torch.allclose(again.q, problem.train.q[rows, kept.index])
    assert torch.allclose(again.v, problem.train.v[rows, kept.index])
    assert torch.allclose(again.y, problem.train.y[rows, kept.index])


def test_perturb_replaces_exactly_the_chosen_prompts(attacked_setup):
    cfg, const, problem = attacked_setup
    spec = OmegaConf.create({"mu": 1.0, "c": 2.0, "p": 0.5, "shift_query_response": True})
    bad = attacks.perturb(problem, const, spec)
    kept, rows = problem.kept, torch.arange(6).unsqueeze(1)
    alpha = 2.0 * 30**0.5
    expected = from_tokens(kept.x + 1.0, kept.y + alpha)
    assert torch.allclose(bad.train.v[rows, kept.index], expected.v)
    assert torch.allclose(bad.train.q[rows, kept.index], kept.x[..., -1] + 1.0)
    assert torch.allclose(bad.train.y[rows, kept.index], kept.y[..., -1] + alpha)
    # the private view of the perturbed prompts is clipped and projected like any other
    assert bad.private.y.abs().max() <= const.C and bad.private.norms().max() <= const.G * (1 + 1e-12)
    others = torch.ones(6, 30, dtype=torch.bool)
    others[rows, kept.index] = False
    assert torch.equal(bad.train.v[others], problem.train.v[others])
    assert bad.test is problem.test
    # without the query shift only the context responses move
    quiet = attacks.perturb(problem, const, OmegaConf.create(dict(spec, shift_query_response=False)))
    assert torch.allclose(quiet.train.y[rows, kept.index], kept.y[..., -1])


def test_a_null_perturbation_has_zero_shared_noise_risk(cfg_for):
    """mu = 0 and c = 0 leave the prompts as they are: with shared draws the attacked run is the
    clean run (risk exactly 0); with independent draws the risk is the noise's alone."""
    from pipeline.noisyhead import train

    cfg = cfg_for("attack=perturb", "attack.mu=0", "attack.c=0", "trials=5", "regime.N=40",
                  "dataset.n_test=10", "method=[ridge,noisyhead]")
    const = config.validate(cfg)
    problem = data.synthetic(const, trials=5, n_test=10, seed=0, chunk=5, dtype=D64, keep=1)
    clean = {name: train._fit(problem, const, cfg, name, spec, "")[0] for name, spec in cfg.method.items()}
    bad = train.run_attacked(attacks.perturb(problem, const, cfg.attack), const, cfg)
    assert set(bad["noisyhead"]) == {"independent", "shared"} and set(bad["ridge"]) == {"none"}
    shared = evaluate.gap(clean["noisyhead"].gamma, bad["noisyhead"]["shared"].gamma, problem.test, 5)
    independent = evaluate.gap(clean["noisyhead"].gamma, bad["noisyhead"]["independent"].gamma, problem.test, 5)
    ridge = evaluate.gap(clean["ridge"].gamma, bad["ridge"]["none"].gamma, problem.test, 5)
    assert shared.abs().max() < 1e-20 and ridge.abs().max() < 1e-20
    assert independent.min() > 1e-6


def test_attack_config_is_validated(cfg_for):
    with pytest.raises(config.ConfigError, match="attack.prompts"):
        config.validate(cfg_for("attack=perturb", "attack.prompts=0"))
    with pytest.raises(config.ConfigError, match="attack.choice"):
        config.validate(cfg_for("attack=perturb", "attack.choice=first"))
