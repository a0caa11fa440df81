"""The task registry: the one place that knows every task, by name.

``task: noisyhead`` (the default: NoisyHead's in-context learning, ``pipeline/noisyhead/``),
``task: seqrec`` (DPFormer's next-item prediction, ``pipeline/seqrec/``, set by the
``experiment=dpformer_*`` presets) and ``task: lm`` (DP language modelling on 20 Newsgroups,
``pipeline/lm/``, set by the ``experiment=lm_*`` presets). Each entry names the module whose ``TASK`` implements
``pipeline.task.Task``, imported only when the task is used (a refused config does not wait
for MLflow or torch to load), and the task's config groups, ``conf/<name>/`` (Hydra's search
path: ``hydra_plugins/pipeline_sweeper/searchpath.py``). Adding a task: docs/layout.md, "Adding a task".
"""

from __future__ import annotations

import importlib
from pathlib import Path

from omegaconf import DictConfig

from pipeline.task import Task
from pipeline.validation import ConfigError

CONF = Path(__file__).resolve().parents[1] / "conf"
TASKS = {  # name -> the module whose TASK implements it
    "noisyhead": "pipeline.noisyhead.task",
    "seqrec": "pipeline.seqrec.task",
    "lm": "pipeline.lm.task",
}
DEFAULT = "noisyhead"


def name(cfg: DictConfig) -> str:
    found = cfg.get("task", DEFAULT)
    if found not in TASKS:
        raise ConfigError(f"task {found!r} is unknown; known: {list(TASKS)}")
    return found


def get(cfg: DictConfig) -> Task:
    """The task ``cfg.task`` names (ConfigError if none does)."""
    return importlib.import_module(TASKS[name(cfg)]).TASK


def validate(cfg: DictConfig):
    """The config's task's own validation (``Task.validate``)."""
    return get(cfg).validate(cfg)


def conf_dirs() -> list[Path]:
    """Where each task's config groups live: ``conf/<name>/``."""
    return [CONF / task for task in TASKS]
