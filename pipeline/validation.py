"""What both tasks' validation shares: the one error a refused config raises, and the checks of
values that every task has (counts, finite numbers).

Every refusal is a :class:`ConfigError` whose message names the key and the value; the entry
points print it as one ``error: ...`` line and exit with status 2, before anything is computed,
logged or created. Each task's own rules live in its ``config`` module
(``pipeline/noisyhead/config.py``, ``pipeline/seqrec/config.py``).
"""

from __future__ import annotations

import math


class ConfigError(ValueError):
    """A config value the pipeline refuses; the message names the key and the value."""


class RunFailed(RuntimeError):
    """A run that started and then failed for a reason its message says (training diverged): the run
    ends FAILED with the message as its ``failed_reason`` tag, the console gets one ``error:`` line
    (no traceback), exit status 1. An unexpected exception keeps its traceback: that is a bug."""


MAX_INT = 2**53  # counts and sizes must be exact as float64 numbers


def positive_int(value, key: str) -> int:
    """An integer in [1, 2^53] (booleans refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_INT:
        raise ConfigError(f"{key} must be a positive integer (at most 2^53), got {value!r}")
    return value


def number(value, key: str) -> float:
    """A finite real number (NaN and infinities are refused: no rule or bound survives them)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key} must be a number, got {value!r}")
    try:
        out = float(value)
    except OverflowError:
        out = math.inf
    if not math.isfinite(out):
        raise ConfigError(f"{key} must be a finite number, got {value!r}")
    return out
