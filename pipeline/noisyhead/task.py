"""NoisyHead as a task of the pipeline (``task: noisyhead``, the default): what the shared
machinery calls (``pipeline.task.Task``), each a step of this package."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig


class NoisyHead:
    name = "noisyhead"
    devices = ("cpu", "cuda")  # the batched trials: drawn on the CPU, placed on the device (data.make_problem)
    audit_devices = ("cpu",)  # the audit's few trials run on the CPU

    def validate(self, cfg: DictConfig):
        from pipeline.noisyhead import config

        return config.validate(cfg)

    def memory(self, cfg: DictConfig, checked):
        from pipeline import device
        from pipeline.noisyhead import data, memory

        where = device.of(cfg, self.devices)
        return memory.estimate(cfg, checked, str(where), held=data.held_bytes(where))

    def run_cell(self, cfg: DictConfig, checked) -> Path:
        from pipeline.noisyhead import cell

        return cell.run(cfg, checked)

    def summarise(self, cfg, sweep_id, sweep_dir, cells, results, csv) -> None:
        from pipeline.noisyhead import sweep

        sweep.summarise(cfg, sweep_id, sweep_dir, cells, results, csv)

    def audit(self, cfg: DictConfig):
        from pipeline.noisyhead import audit

        return audit.run(cfg)


TASK = NoisyHead()
