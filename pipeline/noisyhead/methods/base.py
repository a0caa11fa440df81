"""What every estimator returns, and the walk over chunks of trials."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

from tqdm import tqdm

if TYPE_CHECKING:
    from torch import Tensor


@dataclass
class Fit:
    gamma: Tensor  # (B, len(T), D, D); (B, 1, D, D) for an estimate that does not depend on T
    private: bool
    params: dict[str, object] = field(default_factory=dict)  # hyperparameters and calibration to log
    trace: list[float] = field(default_factory=list)  # training objective per step, first trial
    T: tuple[int, ...] | None = None  # the horizons of gamma's columns when they are not the regime's


def noise_scale(spec) -> float:
    """The factor a private method's file puts on its calibrated noise (``noise_scale``, default 1).
    Below 1 the run is under-noised and its (eps, delta) claim void: it exists as the privacy
    audit's negative control. Every private estimator multiplies its noise by it."""
    return float(getattr(spec, "noise_scale", 1.0))


def steps(n: int, desc: str) -> Iterator[int]:
    """range(n) with a progress bar on a terminal (silent otherwise): the steps of one chunk."""
    return iter(tqdm(range(n), desc=desc, leave=False, disable=None, mininterval=1.0))


def chunks(trials: int, size: int, desc: str) -> Iterator[tuple[int, slice]]:
    """(chunk index, slice of trials). Random draws belong to the trials (``rng``), not to the
    chunk, so the chunk size changes no number."""
    starts = range(0, trials, size)
    for i, start in enumerate(tqdm(starts, desc=desc, leave=False, disable=None)):
        yield i, slice(start, min(start + size, trials))
