"""Empirical privacy audit: ``python -m pipeline.audit [overrides]``.

Composes ``conf/audit.yaml`` (everything of ``conf/config.yaml`` plus the ``audit`` keys) and
hands it to the task it names (``pipeline.tasks``): NoisyHead's audit of every private estimator
on a worst-case pair of prompt sets (the default: ``pipeline/noisyhead/audit.py``), or, with
``task: seqrec`` (``experiment=dpformer_ci``), a canary-user audit of one DP-SGD step
(``pipeline/seqrec/audit.py``). The statistics both share (the Clopper-Pearson lower bound on
eps, the audit's power, the verdict) are ``pipeline/auditing.py``.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from pipeline import tasks
from pipeline.validation import ConfigError


def run(cfg: DictConfig):
    """The audit of ``cfg``'s task: one row per audited mechanism (its device checked by the
    preflight callback, ``Task.audit_devices``, before Hydra made the folder)."""
    return tasks.get(cfg).audit(cfg)


@hydra.main(version_base="1.3", config_path="../conf", config_name="audit")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    from pipeline.overrides import other_tasks_group, repeated, unknown_choice

    argv = sys.argv[1:]
    for warning in repeated(argv):
        print(f"warning: {warning}", file=sys.stderr)
    if (message := unknown_choice(argv) or other_tasks_group(argv)) is not None:
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)
    main()
