"""The train step: fit every configured estimator on the cell's problem, and log each
one's hyperparameters, privacy calibration, run time and training-loss curve.

Under an attack, every estimator is also fitted on the attacked problem: a private one
twice, with random draws independent of the clean run's (``independent``, the published
protocol) and with the same draws (``shared``, which isolates what the perturbation does).
"""

from __future__ import annotations

import logging
import time

from pipeline import device, tracking
from pipeline.noisyhead.methods import ESTIMATORS
from pipeline.noisyhead.methods.base import Fit

log = logging.getLogger(__name__)

COUPLINGS = {"independent": ":attacked", "shared": ""}  # coupling -> stream suffix of the attacked run


def _fit(problem, const, cfg, name, spec, stream: str) -> tuple[Fit, bool]:
    """Fit one estimator, reusing an identical earlier fit on the same problem (the eps cells of a
    sweep share their non-private fits; the attack cells their clean private ones)."""
    method = ESTIMATORS[spec.estimator]
    key = (name, str(spec), tuple(const.as_params().items()), cfg.oracle, cfg.seed)
    if method.PRIVATE:
        key += (str(cfg.privacy), stream)
    if key in problem.fits:
        return problem.fits[key], True
    fit = method.fit(problem, const, cfg, spec, stream=stream)
    problem.fits[key] = fit
    return fit, False


def run(problem, const, cfg) -> dict[str, Fit]:
    tracking.log_params("train", const.as_params() | {"oracle": cfg.oracle, "eps": cfg.privacy.eps, "delta": cfg.privacy.delta})
    fits = {}
    dev = problem.train.q.device
    for name, spec in cfg.method.items():
        start = time.perf_counter()
        fit, reused = _fit(problem, const, cfg, name, spec, stream="")
        device.synchronize(dev)  # a GPU's queued work is part of the fit's time
        seconds = time.perf_counter() - start
        fits[name] = fit
        if fit.params:
            tracking.log_params(f"train.{name}", fit.params)
        timing = {f"{name}.seconds": seconds}
        if ESTIMATORS[spec.estimator].ITERATIVE and not reused:  # per step of its longest horizon
            timing[f"{name}.seconds_per_step"] = seconds / max(fit.T or const.T)
        tracking.log_metrics("train", timing)
        if fit.trace:
            tracking.log_curve(f"train.{name}.loss", fit.trace)
        log.info("train: %s %s in %.2fs", name, "reused from an earlier cell" if reused else "fitted", seconds)
    return fits


def run_attacked(bad, const, cfg) -> dict[str, dict[str, Fit]]:
    """Fits on the attacked problem: {method: {coupling: Fit}}; a non-private estimator has no
    random draws to couple, and one fit, under 'none'."""
    fits = {}
    for name, spec in cfg.method.items():
        start = time.perf_counter()
        couplings = COUPLINGS if ESTIMATORS[spec.estimator].PRIVATE else {"none": ""}
        fits[name] = {c: _fit(bad, const, cfg, name, spec, stream)[0] for c, stream in couplings.items()}
        device.synchronize(bad.train.q.device)
        tracking.log_metrics("train", {f"{name}.attacked_seconds": time.perf_counter() - start})
    return fits
