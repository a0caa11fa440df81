"""The train step: fit every configured estimator on the cell's problem, and log
each one's hyperparameters, privacy calibration, run time and training-loss curve."""

from __future__ import annotations

import logging
import time

from pipeline import tracking
from pipeline.methods import ESTIMATORS
from pipeline.methods.base import Fit

log = logging.getLogger(__name__)


def run(problem, const, cfg) -> dict[str, Fit]:
    tracking.log_params("train", const.as_params() | {"oracle": cfg.oracle, "eps": cfg.privacy.eps, "delta": cfg.privacy.delta})
    fits = {}
    for name, spec in cfg.method.items():
        method = ESTIMATORS[spec.estimator]
        start = time.perf_counter()
        # A non-private estimate does not depend on eps or delta: cells that share their
        # problem (a sweep over eps) share it too.
        key = (name, str(spec), tuple(const.as_params().items()), cfg.oracle, cfg.seed)
        if method.PRIVATE or key not in problem.fits:
            fit = method.fit(problem, const, cfg, spec)
            if not method.PRIVATE:
                problem.fits[key] = fit
        else:
            fit = problem.fits[key]
            log.info("train: %s reused from the previous cell (same data, not private)", name)
        seconds = time.perf_counter() - start
        fits[name] = fit
        if fit.params:
            tracking.log_params(f"train.{name}", fit.params)
        tracking.log_metrics("train", {f"{name}.seconds": seconds})
        if fit.trace:
            tracking.log_curve(f"train.{name}.loss", fit.trace)
        log.info("train: %s in %.2fs", name, seconds)
    return fits
