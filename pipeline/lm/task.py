"""DP language modelling on 20 Newsgroups as a task of the pipeline (``task: lm``, set by the
``experiment=lm_*`` presets): what the shared machinery calls (``pipeline.task.Task``), each a
step of this package."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig


class LanguageModel:
    name = "lm"
    devices = ("cpu", "cuda")
    audit_devices = ("cpu",)
    audit_scope = "run"  # its audit is of a whole DP-SGD training, in one run (pipeline/lm/audit.py)

    def validate(self, cfg: DictConfig):
        from pipeline.lm import config

        return config.validate(cfg)

    def memory(self, cfg: DictConfig, checked):
        from pipeline import device
        from pipeline.lm import memory

        return memory.estimate(cfg, str(device.of(cfg, self.devices)))

    def run_cell(self, cfg: DictConfig, checked) -> Path:
        from pipeline.lm import cell

        return cell.run(cfg, checked)

    def summarise(self, cfg, sweep_id, sweep_dir, cells, results, csv) -> None:
        from pipeline.lm import sweep

        sweep.summarise(cfg, sweep_id, sweep_dir, cells, results, csv)

    def audit(self, cfg: DictConfig):
        from pipeline.lm import audit

        return audit.from_config(cfg)


TASK = LanguageModel()
