"""Estimators: each module has ``fit(problem, const, cfg) -> Fit``, batched over trials."""

from pipeline.methods import gd, noisyhead, ridge

METHODS = {"ridge": ridge.fit, "gd": gd.fit, "noisyhead": noisyhead.fit}
