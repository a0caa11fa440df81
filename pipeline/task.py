"""The interface a task implements: what the shared machinery (entry point, sweeper, preflight,
sweep end, audit) calls, and nothing else. A task is a package ``pipeline/<name>/`` with the
same rooms as the others (config, data, train, evaluate, plot, cell, sweep, audit) and a
``task.py`` whose ``TASK`` implements this protocol; ``pipeline/tasks.py`` registers it by name.

The shared modules never import a task package, and no task imports another
(``tests/test_layout.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Protocol

if TYPE_CHECKING:
    import pandas as pd
    from omegaconf import DictConfig


@dataclass(frozen=True)
class Memory:
    """A cell's memory estimate: bytes by part (``parts``), and the key to lower (with its value
    and a word of advice) when they do not fit."""

    parts: dict[str, int]
    key: str
    value: object
    advice: str
    device: str = "cpu"  # where the tensors live: a CUDA device's free memory is what they must fit in
    held: int = 0  # bytes this process holds already that the cell reuses or frees before it allocates

    @property
    def total(self) -> int:
        return sum(self.parts.values())


@dataclass
class Cells:
    """The cells of one sweep: the records of those that finished (job order), the others' overrides."""
    done: list[dict] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)  # rows each finished cell gave the sweep's results (set by summarise)

    def rows(self, results: pd.DataFrame) -> Iterator[tuple[dict, pd.DataFrame]]:
        """Each finished cell's record with its own rows of the sweep's concatenated ``results``."""
        start = 0
        for record, size in zip(self.done, self.sizes):
            yield record, results.iloc[start:start + size]
            start += size


class Task(Protocol):
    name: str
    devices: tuple[str, ...]  # the kinds of compute.device its cells run on ("cpu", "cuda")
    audit_devices: tuple[str, ...]  # the kinds its audit (python -m pipeline.audit) runs on

    def validate(self, cfg: DictConfig) -> Any:
        """Check a composed config before anything is computed or created; raise
        ``pipeline.validation.ConfigError`` naming the key and value. Returns what the checks
        derived (NoisyHead's constants; None where nothing is), handed to ``memory`` and
        ``run_cell``."""

    def memory(self, cfg: DictConfig, checked: Any) -> Memory | None:
        """An estimate of one cell's largest tensors; None where the task has no memory model."""

    def run_cell(self, cfg: DictConfig, checked: Any) -> Path:
        """Run one validated cell as one MLflow run (``pipeline.tracking``); return its results.csv."""

    def summarise(self, cfg: DictConfig, sweep_id: str, sweep_dir: Path, cells: Cells, results: pd.DataFrame,
                  csv: Path) -> None:
        """The end of a sweep: ``results`` (every finished cell's results.csv, already written to
        ``csv``) into the task's tables, figures, report and parent run (``pipeline.sweep``)."""

    def audit(self, cfg: DictConfig) -> pd.DataFrame:
        """``python -m pipeline.audit``: validate, then audit the task's mechanisms empirically
        (``pipeline.audit.bounds``); one row per audited mechanism."""
