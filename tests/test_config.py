"""Config composition, the derived constants, and the refusal of bad input."""

import math

import pytest
from omegaconf import OmegaConf

from pipeline.noisyhead import config
from pipeline.validation import ConfigError


def test_default_is_the_papers_low_dimensional_cell(cfg_for):
    cfg = cfg_for()
    c = config.validate(cfg)
    assert (cfg.regime.name, c.N, c.D, c.L, c.lam, cfg.privacy.eps, cfg.privacy.delta, cfg.trials) == (
        "lowdim", 1000, 5, 31, 5.0, 0.2, 1e-5, 500)
    # Theorem 4.1 with kappa = 1, written out independently
    C = math.sqrt(2 * math.log(1000 * 31))
    G = C / math.sqrt(31) * (1 + (math.log(1000) / 25) ** 0.25)
    assert math.isclose(c.C, C) and math.isclose(c.G, G)
    assert math.isclose(c.R, C**2 * math.sqrt(1000 / 31) / 5)
    assert math.isclose(c.eta0, 3.1667 / (5 + G**2) ** 2, rel_tol=1e-4)  # the paper's 3.17 / (5 + G^2)^2
    assert c.T == (math.floor(2.5 * math.log(1000) / math.log(1 / (1 - 5 * c.eta0))),) == (44,)
    assert math.isclose(c.sigma, 2 * G * (C + c.R * G))


def test_high_dimensional_rules(cfg_for):
    c = config.validate(cfg_for("regime=highdim", "regime.N=700"))
    assert (c.D, c.L, c.T) == (26, 26, (5,))
    assert math.isclose(c.lam, 700 / 26)
    # the paper's eta0 = 0.07 N D / (N + D G^2)^2, up to its rounding of 0.2/3
    assert math.isclose(c.eta0, 0.2 / 3 * 700 * 26 / (700 + 26 * c.G**2) ** 2)


def test_overparameterised_regime_runs_every_horizon(cfg_for):
    c = config.validate(cfg_for("experiment=fig3_overparam"))
    assert c.T == tuple(range(1, 482, 20)) and (c.N, c.L, c.D) == (1000, 31, 31)
    assert math.isclose(c.eta0, 0.02 * c.lam / (3 * (c.lam + c.G**2) ** 2))


def test_user_values_override_rules(cfg_for):
    c = config.validate(cfg_for("regime.C=3", "regime.G=0.5", "regime.R=2", "regime.eta0=0.01", "regime.T=7"))
    assert (c.C, c.G, c.R, c.eta0, c.T) == (3.0, 0.5, 2.0, 0.01, (7,))


@pytest.mark.parametrize("experiment,grid", [
    ("fig1_lowdim", {"regime.N": 7, "privacy.eps": 5}),
    ("fig2_highdim", {"regime.N": 6, "privacy.eps": 5}),
    ("fig3_overparam", {}),
    ("fig4_robustness", {"attack.c": 2, "attack.p": 6}),
    ("fig5_dpsgd", {"regime.N": 7, "privacy.eps": 5}),
    ("table1_dpridge", {"regime.N": 3, "privacy.eps": 2}),
])
def test_each_preset_sweeps_exactly_its_papers_grid(cfg_for, experiment, grid):
    cfg = cfg_for(f"experiment={experiment}", hydra=True)
    params = cfg.hydra.sweeper.params or {}
    assert {k: len(str(v).split(",")) for k, v in params.items()} == grid
    assert cfg.trials == 500
    config.validate(cfg)


def test_regimes_carry_the_papers_grids(cfg_for):
    low = cfg_for("regime=lowdim", hydra=True).hydra.sweeper.params
    assert low["regime.N"] == "1000,1500,2000,2500,3000,3500,4000"
    assert cfg_for("regime=highdim", hydra=True).hydra.sweeper.params["regime.N"] == "500,600,700,800,900,1000"
    fig1 = cfg_for("experiment=fig1_lowdim", hydra=True).hydra.sweeper.params
    assert fig1["privacy.eps"] == "0.2,0.4,0.6,0.8,1.0"


@pytest.mark.parametrize("override,key", [
    ("privacy.eps=0", "privacy.eps"),
    ("privacy.eps=-0.5", "privacy.eps"),
    ("privacy.delta=0", "privacy.delta"),
    ("privacy.delta=1.5", "privacy.delta"),
    ("regime.N=0", "regime.N"),
    ("regime.N=-10", "regime.N"),
    ("regime.L=0", "regime.L"),
    ("regime.D=-1", "regime.D"),
    ("trials=0", "trials"),
    ("regime.eta0=1.0", "eta0"),
    ("regime.lam=-1", "regime.lam"),
    ("method=[gd,noisyhead]", "ridge"),
    ("+method.mine.estimator=sgd", "method.mine.estimator"),
    ("regime.T=[]", "regime.T"),
    ("privacy.accountant=rdp", "privacy.accountant"),
    ("method.dp_ridge.calibration=classic", "method.dp_ridge"),  # with privacy.eps=1.5 below: classic needs eps < 1
    ("method.noisyhead.horizon=longest", "method.noisyhead"),
    ("method.noisyhead.accountant=rdp", "method.noisyhead"),
    ("regime.kappa=nan", "regime.kappa"),
    ("regime.R=inf", "regime.R"),
    ("regime.G=1e200", "regime.G"),  # G^2 overflows
    ("regime.lam=nan", "regime.lam"),
    ("compute.threads=0", "compute.threads"),
    ("plot.x=foo", "plot.x"),
    ("plot.hue=foo", "plot.hue"),
    ("plot.error_bars=box", "plot.error_bars"),
    ("plot.y=attack_risk", "plot.y"),  # there is no attack
    ("plot.methods=[ssp]", "plot.methods"),  # not among the methods run
])
def test_bad_values_are_refused_naming_the_key(cfg_for, override, key):
    extra = ["privacy.eps=1.5", "method=[ridge,dp_ridge]"] if "dp_ridge" in override else []
    if "dp_ridge" in override:  # the method must be selected before its keys can be set
        override, extra = extra[1], [extra[0], override]
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config.validate(cfg_for(override, *extra))


def test_basic_composition_needs_per_step_eps_below_one(cfg_for):
    with pytest.raises(ConfigError, match="per-step eps"):
        config.validate(cfg_for("privacy.eps=3", "regime.T=2"))
    config.validate(cfg_for("privacy.eps=3", "regime.T=2", "privacy.accountant=tight"))  # no such limit


def test_unknown_keys_and_options_are_refused_by_composition(cfg_for):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        cfg_for("regime=nosuchregime")
    with pytest.raises(ConfigCompositionException):
        cfg_for("regime.nosuchkey=1")
    with pytest.raises(ConfigCompositionException):
        cfg_for("method=[ridge,nosuchmethod]")


def test_methods_are_a_config_group(cfg_for):
    assert list(cfg_for().method) == ["ridge", "gd", "noisyhead"]
    cfg = cfg_for("method=[ridge,noisyhead]")
    assert list(cfg.method) == ["ridge", "noisyhead"]
    assert cfg.method.noisyhead.estimator == "noisyhead"


def test_every_regime_constant_is_documented_in_yaml():
    from pathlib import Path

    for path in Path(__file__).parents[1].glob("conf/noisyhead/regime/*.yaml"):
        lines = path.read_text().splitlines()
        regime = OmegaConf.load(path).regime
        for key in regime:
            line = next(l for l in lines if l.strip().startswith(f"{key}:"))
            assert "#" in line or key == "name", f"{path.name}: {key} has no comment"


def test_the_float_limits_the_checks_use_are_torchs():
    """The config's checks bound numbers by each dtype's largest float without importing torch
    (pipeline.lazy): the constants must be torch's own."""
    import torch

    from pipeline.noisyhead.constants import FLOAT_MAX

    assert FLOAT_MAX == {name: torch.finfo(getattr(torch, name)).max for name in ("float64", "float32")}


@pytest.mark.slow
def test_a_config_is_checked_without_importing_torch():
    """The refusals answer in a fraction of a second because the checks import no torch: a fresh
    interpreter validates a NoisyHead config (its methods' calibration included) with torch unloaded."""
    import subprocess
    import sys

    from conftest import ROOT

    code = ("import sys\nfrom hydra import compose, initialize_config_dir\nfrom pipeline import preflight, tasks\n"
            f"with initialize_config_dir(config_dir={str(ROOT / 'conf')!r}, version_base='1.3'):\n"
            "    cfg = compose('config', overrides=['method=[ridge,gd,noisyhead,dp_ridge,dpsgd,ssp]'])\n"
            "tasks.get(cfg).validate(cfg)\n"
            "print(sorted(m for m in ('torch', 'mlflow', 'matplotlib', 'pandas') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", proc.stdout
