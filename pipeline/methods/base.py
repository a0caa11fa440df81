"""What every estimator returns, and the walk over chunks of trials."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from torch import Tensor
from tqdm import tqdm


@dataclass
class Fit:
    gamma: Tensor  # (B, len(T), D, D); (B, 1, D, D) for an estimate that does not depend on T
    private: bool
    params: dict[str, object] = field(default_factory=dict)  # hyperparameters and calibration to log
    trace: list[float] = field(default_factory=list)  # training objective per step, first trial
    T: tuple[int, ...] | None = None  # the horizons of gamma's columns when they are not the regime's


def chunks(trials: int, size: int, desc: str) -> Iterator[tuple[int, slice]]:
    """(chunk index, slice of trials); the index names the chunk's random streams."""
    starts = range(0, trials, size)
    for i, start in enumerate(tqdm(starts, desc=desc, leave=False, disable=None)):
        yield i, slice(start, min(start + size, trials))
