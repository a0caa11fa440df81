"""Estimators. Each module has ``fit(problem, const, cfg, spec) -> Fit``, batched over
trials, and ``PRIVATE``: whether its output is differentially private (a private estimate
depends on eps and delta; a non-private one is shared by every cell with the same data), and
``ITERATIVE``: whether it runs T steps (its seconds per step are logged).

Which estimators run is configuration: ``conf/noisyhead/method/<name>.yaml`` holds ``<name>:`` with
``estimator`` (a key of ``ESTIMATORS``), a ``label`` and the estimator's own settings
(``spec``); one estimator can serve several method files with different settings.
"""

from pipeline.noisyhead.methods import dp_ridge, dpsgd, gd, noisyhead, ridge, ssp

ESTIMATORS = {"ridge": ridge, "gd": gd, "noisyhead": noisyhead, "dp_ridge": dp_ridge, "dpsgd": dpsgd, "ssp": ssp}
