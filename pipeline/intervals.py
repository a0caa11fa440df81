"""Student-t intervals for paired per-seed quantities, every task's (``pipeline.lm.sweep``'s tying
gains, ``pipeline.seqrec.sweep``'s DPFormer gains, ``pipeline.seqrec.distraction``'s draws): written
once here.

For n values x_1..x_n (NaN dropped) the interval at ``level`` is mean +- t_{(1+level)/2, n-1} s / sqrt(n),
s the sample standard deviation (ddof 1): exact for normal x, the usual large-sample interval
otherwise. Below two values there is no interval (NaN)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

LEVEL = 0.95  # the paired intervals' level, every task's


@dataclass(frozen=True)
class Interval:
    n: int  # values used (NaN dropped)
    mean: float  # NaN with no value
    half: float  # the half-width (NaN below two values)

    @property
    def low(self) -> float:
        return self.mean - self.half

    @property
    def high(self) -> float:
        return self.mean + self.half


def student_t(values, level: float = LEVEL) -> Interval:
    """The mean of ``values`` and its Student-t interval at ``level`` (the module's docstring)."""
    from scipy import stats

    x = np.asarray(values, dtype=np.float64).ravel()
    x = x[~np.isnan(x)]
    n = int(x.size)
    mean = float(x.mean()) if n else math.nan
    half = float(stats.t.ppf(0.5 + level / 2, n - 1) * x.std(ddof=1) / math.sqrt(n)) if n >= 2 else math.nan
    return Interval(n=n, mean=mean, half=half)
