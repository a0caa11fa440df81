"""The one-run audit's bounds (``pipeline/audit/one_run.py``) against reference numbers computed with
Google DeepMind's jax_privacy ``auditing.py`` on the same saved scores (``tests/fixtures/
jax_privacy_audit.json``: its numbers, with the commit and how they were made; none of its code):
Steinke et al.'s p-value and bound, Mahloujifar et al.'s f-DP bound, and the Gaussian-DP bound with
jax_privacy's fix of 2026-07 for scores that show no separation (mu <= 0 gives 0, not |mu|)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.audit import one_run
REF = json.loads((Path(__file__).parent / "fixtures" / "jax_privacy_audit.json").read_text())
CASES = sorted(REF["cases"])


@pytest.mark.parametrize("row", REF["p_values"]["rows"], ids=lambda r: f"m{r['m']}-k{r['n_guess']}-v{r['n_correct']}")
def test_steinke_p_value_matches_the_reference(row):
    got = one_run.one_run_p_value(row["m"], row["n_guess"], row["n_correct"], row["eps"], row["delta"])
    assert got == pytest.approx(row["p_value"], rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("row", REF["one_run_from_counts"]["rows"],
                         ids=lambda r: f"m{r['m']}-k{r['n_guess']}-v{r['n_correct']}-d{r['delta']}")
@pytest.mark.parametrize("bound,key", [("binomial", "epsilon_one_run"), ("gaussian", "epsilon_one_run_fdp")])
def test_one_run_bounds_from_counts_match_the_reference(row, bound, key):
    got = one_run.one_run_eps(row["m"], row["n_guess"], row["n_correct"], delta=row["delta"],
                               alpha=row["significance"], bound=bound)
    assert got == pytest.approx(row[key], abs=2e-5)


@pytest.mark.parametrize("case", CASES)
def test_one_run_bounds_at_the_references_thresholds_match(case):
    # a fixed guess set (every canary scoring at least t guessed "in", none "out"), no correction
    c = REF["cases"][case]
    m = c["params"]["m"]
    for key, out in c["outputs"].items():
        if "explicit_threshold" not in out:  # the reference's delta = 0 and delta-free outputs
            continue
        delta = float(key.split("=")[1])
        for t in out["explicit_threshold"]:
            for bound, name in (("binomial", "epsilon_one_run"), ("gaussian", "epsilon_one_run_fdp")):
                got = one_run.one_run_eps(m, t["n_guess"], t["n_correct"], delta=delta, alpha=c["significance"],
                                           bound=bound)
                assert got == pytest.approx(t[name], abs=2e-5), (case, key, t["label"], bound)


@pytest.mark.parametrize("case", CASES)
def test_the_gaussian_dp_bound_matches_the_reference_including_no_separation(case):
    c = REF["cases"][case]
    scores, included = np.asarray(c["scores"]), np.asarray(c["included"], dtype=bool)
    for key, out in c["outputs"].items():
        if "epsilon_from_gdp" not in out:
            continue
        delta = float(key.split("=")[1])
        got = one_run.gdp_estimate(scores, included, delta=delta, confidence=c["confidence"])
        assert got.eps == pytest.approx(float(out["epsilon_from_gdp"]), abs=1e-5), (case, key)
        details = out.get("gdp_mu_details") or {}
        if details.get("mu_used_by_fixed_version") is not None:
            assert got.mu == pytest.approx(max(0.0, details["mu_used_by_fixed_version"]), rel=1e-9, abs=1e-12)
        assert got.thresholds == c["n_pareto_thresholds"]
    if case == "D":  # no separation: the signed mu is negative; the pre-fix |mu| would have claimed eps ~ 5.6
        assert got.mu == 0.0 and got.eps == 0.0


@pytest.mark.parametrize("row", [r for r in REF["gdp_table"]["rows"]], ids=lambda r: f"mu{r['mu']}-d{r['delta']}")
def test_gdp_to_eps_conversion_matches_the_reference(row):
    assert one_run.gdp_epsilon(row["mu"], row["delta"]) == pytest.approx(row["eps_tight_xtol1e-12"], abs=1e-7)
