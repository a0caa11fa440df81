"""The empirical privacy audits, one package (``python -m pipeline.audit [overrides]``):

- ``__main__``: the entry point; composes ``conf/audit.yaml`` and hands it to the task's audit;
- ``bounds``: an audit of many runs on two neighbouring inputs (the Clopper-Pearson lower bound on
  eps, its ceiling and power, the verdict);
- ``one_run``: an audit of one training run with m canaries: Steinke et al.'s lower bound on eps
  (a proof), the f-DP test against the accountant's own trade-off curve (a proof), and the
  Gaussian-trade-off numbers, which are estimates and are named so;
- ``canaries``: white-box (Dirac) canaries and their per-step log-likelihood ratio scores;
- ``run``: the whole-run audit every task's DP-SGD shares (variants and negative controls, the
  plan, the scoring into one row, one MLflow run per audited training);
- ``summary``: a DVC stage's audits over seeds and claims (``python -m pipeline.audit.summary ROOT``).

Importing the package imports none of them (the entry point needs Hydra; the statistics do not).
"""
