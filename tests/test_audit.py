"""The auditor on a plain Gaussian mechanism, whose privacy is known exactly, and end to end."""


import forkserver
import mlflow
import numpy as np
import pandas as pd
import pytest
from scipy.stats import beta

from pipeline import privacy
from pipeline.audit import bounds

DELTA = 1e-5


def _gaussian(eps: float, runs: int, seed: int, scale: float = 1.0):
    """Outputs of the Gaussian mechanism calibrated exactly to (eps, DELTA) on two neighbouring
    inputs (sensitivity 1, the shift mu = 1 / multiplier), its noise std times ``scale``."""
    mu = 1 / privacy.gaussian_multiplier(eps=eps, delta=DELTA)
    gen = np.random.default_rng(seed)
    return gen.normal(mu, scale, runs), gen.normal(0.0, scale, runs)


def test_clopper_pearson_known_values():
    """k = 0 has the closed form upper bound 1 - (1 - level)^(1/n); otherwise the beta quantiles."""
    lo, hi = bounds.clopper_pearson(np.array([0, 7, 100]), 100, 0.975)
    assert lo[0] == 0 and hi[0] == pytest.approx(1 - 0.025 ** (1 / 100))
    assert lo[1] == pytest.approx(beta.ppf(0.025, 7, 94)) and hi[1] == pytest.approx(beta.ppf(0.975, 8, 93))
    assert lo[1] < 0.07 < hi[1] and hi[2] == 1


@pytest.mark.slow
def test_lower_bound_holds_at_its_confidence():
    """Over 100 independent audits of a mechanism that is exactly (1, 1e-5)-DP, the bound may exceed
    the true eps in at most 5% of them (it is conservative: in practice never)."""
    above = sum(bounds.eps_lower_bound(*_gaussian(1.0, 20_000, seed), delta=DELTA).eps_lower > 1.0 for seed in range(100))
    assert above <= 5


@pytest.mark.parametrize("eps", [1.0, 2.0])
def test_lower_bound_is_within_the_stated_factor(eps):
    """The stated tightness (README): with 100,000 runs per set and eps >= 1 the bound lies in
    [eps / 2.5, eps] for the exactly calibrated Gaussian mechanism."""
    for seed in range(3):
        bound = bounds.eps_lower_bound(*_gaussian(eps, 100_000, seed), delta=DELTA)
        assert eps / 2.5 <= bound.eps_lower <= eps, (seed, bound)


def test_halved_noise_is_flagged():
    """The same mechanism with its noise std halved is (eps', 1e-5)-DP only for eps' near 2.3: flagged."""
    bound = bounds.eps_lower_bound(*_gaussian(1.0, 100_000, 7, scale=0.5), delta=DELTA)
    assert bound.eps_lower > 1.0


@pytest.mark.slow
def test_audit_cli_flags_under_noised_ssp_and_passes_the_calibrated_one(tmp_path):
    """python -m pipeline.audit at eps = 1, delta = 1e-5 with 100,000 runs per set: SSP as shipped is
    consistent, SSP with its noise std halved is a violation; each audit is an MLflow run with
    its bound, verdict and histogram."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    verdicts = {}
    for scale in (1.0, 0.5):
        out = tmp_path / f"scale{scale}"
        proc = forkserver.run(["-m", "pipeline.audit", "audit.methods=[ssp]", f"audit.noise_scale={scale}",
                               f"mlflow.tracking_uri={store}", f"hydra.run.dir={out}"], cwd=root, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        row = pd.read_csv(out / "audit.csv").iloc[0]
        assert row["runs"] == 100_000 and row["eps"] == 1.0 and row["delta"] == DELTA
        verdicts[scale] = (row["verdict"], row["eps_lower"])
        assert (out / "audit_ssp.png").stat().st_size > 1000
    assert verdicts[1.0][0] == "consistent" and 0.2 < verdicts[1.0][1] <= 1.0, verdicts
    assert verdicts[0.5][0] == "violation" and verdicts[0.5][1] > 1.0, verdicts
    mlflow.set_tracking_uri(store)
    runs = mlflow.search_runs(search_all_experiments=True, filter_string="tags.kind = 'audit'")
    assert len(runs) == 2 and set(runs["status"]) == {"FINISHED"}
    assert set(runs["tags.verdict"]) == {"consistent", "violation"}
    assert (runs["metrics.audit.eps_lower"] > 0).all()


@pytest.mark.slow
@pytest.mark.parametrize("override,message", [
    ("audit.methods=[gd]", "audit.methods"),
    ("audit.runs=0", "audit.runs"),
    ("audit.select_fraction=1.5", "audit.select_fraction"),
    ("privacy.eps=-1", "privacy.eps"),
])
def test_audit_refuses_bad_input_before_any_run(tmp_path, override, message):
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = forkserver.run(["-m", "pipeline.audit", override, f"mlflow.tracking_uri={store}",
                           f"hydra.run.dir={tmp_path / 'out'}"], cwd=root, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "error:" in proc.stderr
    assert not (tmp_path / "out" / "audit.csv").exists()
    assert not (tmp_path / "mlflow.db").exists()  # refused before the store was even opened


def test_ceiling_is_the_bound_of_perfect_separation():
    """n held-out runs per set: TPR_low = a^(1/n), FPR_high = 1 - a^(1/n) with a = (1 - 0.95) / 2,
    and a perfectly separated sample reaches exactly that bound."""
    n = 180
    a = 0.025 ** (1 / n)
    assert bounds.eps_ceiling(n, delta=DELTA) == pytest.approx(np.log((a - DELTA) / (1 - a)))
    gen = np.random.default_rng(0)
    first, second = 1000 + gen.random(200), gen.random(200)  # 20 selection runs, 180 held out
    assert bounds.eps_lower_bound(first, second, delta=DELTA).eps_lower == pytest.approx(bounds.eps_ceiling(n, delta=DELTA))


def test_power_matches_a_simulated_audit():
    """eps_power (expected counts) agrees with the median bound of simulated audits of the same
    Gaussian mechanism, and grows with the run count."""
    found = [bounds.eps_lower_bound(*_gaussian(2.0, 20_000, seed), delta=DELTA).eps_lower for seed in range(5)]
    assert bounds.eps_power(18_000, 2.0, delta=DELTA) == pytest.approx(np.median(found), abs=0.15)
    assert bounds.eps_power(1_800, 2.0, delta=DELTA) < bounds.eps_power(90_000, 2.0, delta=DELTA)


@pytest.mark.parametrize("runs,expected", [(2_000, "inconclusive"), (100_000, "violation")])
def test_few_runs_are_inconclusive_where_many_prove_a_violation(runs, expected):
    """Halved noise (true eps near 2.3 for a claim of 1): 100,000 runs prove the violation; 2,000 runs
    find no violation, and the verdict says the audit could not tell instead of 'consistent'."""
    bound = bounds.eps_lower_bound(*_gaussian(1.0, runs, 7, scale=0.5), delta=DELTA)
    power = bounds.eps_power(bound.held_out, 2.0, delta=DELTA)
    outcome = bounds.verdict(bound, 1.0, power)
    assert outcome.startswith(expected), (bound, power, outcome)
    if expected == "inconclusive":
        assert bound.eps_lower <= 1.0 and f"at most {bound.eps_ceiling:.3g} provable" in outcome


@pytest.mark.slow
def test_audit_cli_reports_inconclusive_for_a_small_audit(tmp_path):
    """The appendix-B calibration, proven in violation at 100,000 runs (README), audited with 2,000
    runs: 'inconclusive' in the console, audit.csv and the MLflow tag, with the ceiling logged."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = forkserver.run(["-m", "pipeline.audit", "audit.methods=[dp_ridge_paper]", "audit.runs=2000",
                           f"mlflow.tracking_uri={store}", f"hydra.run.dir={tmp_path / 'out'}"], cwd=root, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = pd.read_csv(tmp_path / "out" / "audit.csv").iloc[0]
    assert row["verdict"].startswith("inconclusive (too few runs: at most 6.19 provable"), row["verdict"]
    assert "INCONCLUSIVE" in proc.stderr + proc.stdout
    mlflow.set_tracking_uri(store)
    runs = mlflow.search_runs(search_all_experiments=True, filter_string="tags.kind = 'audit'")
    assert runs["tags.verdict"].iloc[0] == row["verdict"]
    assert runs["metrics.audit.eps_ceiling"].iloc[0] == pytest.approx(6.189, abs=1e-3)
