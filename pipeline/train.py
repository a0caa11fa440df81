"""The train step: fit every configured estimator on the cell's problem, and log
each one's hyperparameters, privacy calibration, run time and training-loss curve."""

from __future__ import annotations

import logging
import time

from pipeline import tracking
from pipeline.methods import METHODS
from pipeline.methods.base import Fit

log = logging.getLogger(__name__)


def run(problem, const, cfg) -> dict[str, Fit]:
    tracking.log_params("train", const.as_params() | {"oracle": cfg.oracle, "eps": cfg.privacy.eps, "delta": cfg.privacy.delta})
    fits = {}
    for name in cfg.methods:
        start = time.perf_counter()
        fit = METHODS[name](problem, const, cfg)
        seconds = time.perf_counter() - start
        fits[name] = fit
        if fit.params:
            tracking.log_params(f"train.{name}", fit.params)
        tracking.log_metrics("train", {f"{name}.seconds": seconds})
        if fit.trace:
            tracking.log_curve(f"train.{name}.loss", fit.trace)
        log.info("train: %s in %.2fs", name, seconds)
    return fits
