"""Hydra's basic sweeper, plus the pipeline's own validation of every cell before any runs.

Hydra already composes each cell of a sweep before launching (catching unknown
keys and options); this sweeper also runs ``pipeline.config.validate`` on each, so
a bad value anywhere in a sweep stops it with one message before any compute.
It lives in ``hydra_plugins`` because Hydra only loads sweepers from there.
"""

from __future__ import annotations

import sys
from typing import Sequence

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper


class ValidatingSweeper(BasicSweeper):
    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        from pipeline.config import ConfigError
        from pipeline.tasks import validate

        loader = self.hydra_context.config_loader
        for overrides in batch:
            cfg = loader.load_sweep_config(master_config=self.config, sweep_overrides=list(overrides))
            try:
                validate(cfg)
            except ConfigError as err:
                print(f"error: in the sweep cell {' '.join(overrides)}: {err}", file=sys.stderr)
                sys.exit(2)
