"""What both tasks' validation shares: the one error a refused config raises, and the checks of
values that every task has (counts, finite numbers).

Every refusal is a :class:`ConfigError` whose message names the key and the value; the entry
points print it as one ``error: ...`` line and exit with status 2, before anything is computed,
logged or created. Each task's own rules live in its ``config`` module
(``pipeline/noisyhead/config.py``, ``pipeline/seqrec/config.py``).
"""

from __future__ import annotations

import errno
import math
import os
import stat


class ConfigError(ValueError):
    """A config value the pipeline refuses; the message names the key and the value."""


class RunFailed(RuntimeError):
    """A run that started and then failed for a reason its message says (training diverged): the run
    ends FAILED with the message as its ``failed_reason`` tag, the console gets one ``error:`` line
    (no traceback), exit status 1. An unexpected exception keeps its traceback: that is a bug."""


MAX_INT = 2**53  # counts and sizes must be exact as float64 numbers
MAX_SEED = 2**63 - 1  # torch's generators take a signed 64-bit seed (2^64 fails when the run seeds them)
MAX_THREADS = 1024  # compute.threads, seqrec.threads: far above any machine's cores; torch segfaults at 1e8
MAX_EPS = 100.0  # a finite eps above this promises nothing (a factor e^100) and Opacus's calibration of DP-SGD
                  # noise may never end above it (seen: the prv accountant at 1,000, rdp at 1e308): use inf, no noise


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


def seed(value, key: str = "seed") -> int:
    """A seed torch, numpy and Python all take: an integer in [0, 2^63 - 1]."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEED:
        raise ConfigError(f"{key} must be an integer from 0 to 2^63 - 1, got {value!r}")
    return value


def threads(value, key: str) -> int | None:
    """A thread count for torch: null (torch's default) or an integer in [1, MAX_THREADS]."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_THREADS:
        raise ConfigError(f"{key} must be null (torch's default) or an integer from 1 to {MAX_THREADS} (torch's "
                          f"thread pools crash far beyond the machine's cores), got {value!r}")
    return value


def epsilon(value, key: str = "privacy.eps") -> float:
    """A privacy budget: a number in (0, MAX_EPS], or inf (no noise)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{key} must be a positive number (inf: no noise), got {value!r}")
    if math.isfinite(value) and value > MAX_EPS:
        raise ConfigError(f"{key} = {value!r}: a finite eps above {MAX_EPS:g} promises nothing (a factor e^{MAX_EPS:g}) "
                          "and DP-SGD's noise cannot be calibrated to it; use inf for no noise")
    return float(value)


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def not_a_file(path) -> str | None:
    """Why a data path is no regular file ("no such file", "a folder, not a file", "a symbolic link
    loop", ...), or None where it is one (a symbolic link to a file is one). A folder, FIFO or
    /dev/zero was refused as "no such file"; the message now says what is there."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a broken symbolic link (its target does not exist)" if os.path.islink(path) else "no such file"
    except OSError as err:
        if err.errno == errno.ELOOP:
            return "a symbolic link loop, not a file"
        return f"not readable ({err.strerror})"
    if stat.S_ISREG(mode):
        return None
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return f"{kind}, not a file"
