"""Estimators: each module has ``fit(problem, const, cfg) -> Fit``, batched over trials,
and ``PRIVATE``, whether its output is differentially private (a private estimate depends
on eps and delta; a non-private one is shared by every cell with the same data)."""

from pipeline.methods import gd, noisyhead, ridge

METHODS = {"ridge": ridge, "gd": gd, "noisyhead": noisyhead}
