"""Empirical privacy audit: ``python -m pipeline.audit [overrides]``.

Composes ``conf/audit.yaml`` (everything of ``conf/config.yaml`` plus the ``audit`` keys) and
hands it to the task it names (``pipeline.tasks``): NoisyHead's audit of every private estimator
on a worst-case pair of prompt sets (the default: ``pipeline/noisyhead/audit.py``), or, with
``task: seqrec`` (``experiment=dpformer_ci``), a canary-user audit of one DP-SGD step
(``pipeline/seqrec/audit.py``). The statistics both share (the Clopper-Pearson lower bound on
eps, the audit's power, the verdict) are ``pipeline/audit/bounds.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from pipeline import preflight, tasks
from pipeline.validation import ConfigError


CONF = str(Path(__file__).resolve().parents[2] / "conf")  # the repository's configs (absolute: this module is imported by __main__)
SCOPES = (None, "run")


def scope(cfg: DictConfig, task) -> str | None:
    """``audit.scope``: null, the task's own audit; ``run``, a whole DP-SGD training audited in one
    run, which a task offers by declaring ``audit_scope = "run"`` (refused by name where it has none)."""
    wanted = (cfg.get("audit") or {}).get("scope")
    if wanted not in SCOPES:
        raise ConfigError(f"audit.scope = {wanted!r} is unknown; known: null (the task's own audit), 'run' "
                          "(a whole DP-SGD training in one run)")
    if wanted == "run" and getattr(task, "audit_scope", None) != "run":
        raise ConfigError(f"audit.scope = 'run': task {task.name} has no whole-run audit; its own audit runs without "
                          "audit.scope (experiment=lm_ci and experiment=dpformer_ci audit a whole DP-SGD training in "
                          "one run)")
    return wanted


def run(cfg: DictConfig):
    """The audit of ``cfg``'s task: one row per audited mechanism (its device checked by the
    preflight callback, ``Task.audit_devices``, before Hydra made the folder)."""
    task = tasks.get(cfg)
    scope(cfg, task)
    found = task.audit(cfg)
    if plan_only(cfg):
        return found
    from pipeline import tracking

    if (page := tracking.experiment_address(cfg)) is not None:  # where the audit's runs are (one per audited mechanism)
        print(f"MLflow: the audit's runs (kind=audit) in experiment {cfg.mlflow.experiment!r}: {page}", flush=True)
    return found


def plan_only(cfg: DictConfig) -> bool:
    """Whether this audit only printed its plan (nothing recorded)."""
    return bool((cfg.get("audit") or {}).get("plan_only"))


@hydra.main(version_base="1.3", config_path=CONF, config_name="audit")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        preflight.forget_run_folder()
        sys.exit(2)


def cli() -> None:
    """The command line: refuse malformed overrides with one ``error:`` line (exit 2), then ``main``."""
    from pipeline.overrides import other_tasks_group, repeated, subfolder, syntax, unknown_choice

    argv = sys.argv[1:]
    if (message := syntax(argv, sweeps=False) or repeated(argv) or unknown_choice(argv)
            or other_tasks_group(argv) or subfolder()) is not None:
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)
    main()
