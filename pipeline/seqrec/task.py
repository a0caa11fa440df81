"""DPFormer's next-item prediction as a task of the pipeline (``task: seqrec``, set by the
``experiment=dpformer_*`` presets): what the shared machinery calls (``pipeline.task.Task``),
each a step of this package."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig


class SeqRec:
    name = "seqrec"
    devices = ("cpu", "cuda")
    audit_devices = ("cpu",)
    audit_scope = "run"  # besides its one-step audit: a whole DP-SGD training in one run (pipeline/seqrec/audit_run.py)

    def validate(self, cfg: DictConfig) -> None:
        from pipeline.seqrec import config, tuning

        config.groups(cfg)
        tuning.apply(cfg)  # seqrec.tuned: this model's setting selected on validation, before anything reads it
        config.validate(cfg)

    def memory(self, cfg: DictConfig, checked):
        from pipeline import device
        from pipeline.seqrec import memory

        return memory.estimate(cfg, str(device.of(cfg, self.devices)))

    def run_cell(self, cfg: DictConfig, checked) -> Path:
        from pipeline.seqrec import cell

        return cell.run(cfg)

    def summarise(self, cfg, sweep_id, sweep_dir, cells, results, csv) -> None:
        from pipeline.seqrec import sweep

        sweep.summarise(cfg, sweep_id, sweep_dir, cells, results, csv)

    def audit(self, cfg: DictConfig):
        if (cfg.get("audit") or {}).get("scope") == "run":
            from pipeline.seqrec import audit_run

            return audit_run.from_config(cfg)
        from pipeline.seqrec import audit

        return audit.run(cfg)


TASK = SeqRec()
