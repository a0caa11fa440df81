"""The two tasks behind one entry point: ``task: noisyhead`` (the default: pipeline/cell.py) and
``task: seqrec`` (DPFormer's next-item prediction: pipeline/seqrec/cell.py, set by the
``experiment=dpformer_*`` presets). The entry point, the validating sweeper and the sweep callback
dispatch here."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from pipeline.config import ConfigError

TASKS = ("noisyhead", "seqrec")


def task(cfg: DictConfig) -> str:
    name = cfg.get("task", "noisyhead")
    if name not in TASKS:
        raise ConfigError(f"task {name!r} is unknown; known: {list(TASKS)}")
    return name


def validate(cfg: DictConfig):
    """The task's own validation; returns NoisyHead's derived constants (None for seqrec), which
    ``pipeline.preflight`` uses to estimate a cell's memory."""
    if task(cfg) == "seqrec":
        from pipeline.seqrec.config import validate as check

        check(cfg)
        return None
    from pipeline.config import validate as check

    return check(cfg)


def run(cfg: DictConfig) -> Path:
    if task(cfg) == "seqrec":
        from pipeline.seqrec import cell
    else:
        from pipeline import cell
    return cell.run(cfg)
