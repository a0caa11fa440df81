"""Where a long task stands: one line that updates in place on a terminal (tqdm), plain lines when
the output is not a terminal (a log, a pipe, a SLURM job's file).

A task names its phases (data preparation: the posts, the vocabulary, the encoding) or counts its
items (an audit's variants); each start is shown with k/n, the time so far, a rate and an estimate
of what is left::

    with progress.Progress("audit", total=len(variants), unit="variant") as bar:
        for variant in variants:
            bar.start(variant)      # a terminal: one line updates; a log: "audit: 2/8 no_noise ..."
            ...
            bar.write(result_line)  # printed above the updating line, or as a plain line

On a terminal the line goes to stderr (tqdm's ``leave=True``: its last state stays on screen);
off one, each start and the end are one line of the logger (``pipeline.progress``), which Hydra's
job logging writes to the console and to the job's log file. Nothing here changes what a task
computes. The sweep's own k/n line (``pipeline.sweep.progress``) is separate and unchanged.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Iterable, Iterator, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


def on_terminal(stream=None) -> bool:
    """Whether ``stream`` (default: stderr, where the updating line goes) is a terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def duration(seconds: float) -> str:
    """``42 s``, ``3 min 5 s``, ``1 h 2 min``: how the plain lines say a time."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"
    minutes, s = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {s} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


HEARTBEAT = 10.0  # seconds: the longest a log goes without a line inside an item (``Progress.note``)


class Progress:
    """``total`` items (phases, variants) of a task called ``title``: ``start(label)`` at the
    beginning of each, ``close()`` (or the ``with`` block's end) when the last is done."""

    def __init__(self, title: str, total: int, unit: str = "phase", terminal: bool | None = None,
                 clock=time.perf_counter, estimate: bool | None = None):
        self.title, self.total, self.unit = title, max(int(total), 0), unit
        # a rate and what is left mean something for items alike (variants, mechanisms), not for phases
        self.estimate = unit != "phase" if estimate is None else estimate
        self.terminal = on_terminal() if terminal is None else terminal
        self.clock = clock
        self.began = clock()
        self.done = 0  # items finished (every started one but the current)
        self.current: str | None = None
        self.closed = False
        self._heard = self.began  # the last line a log was given (``note``)
        self._bar = None
        if self.terminal:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc=title, unit=unit, file=sys.stderr, leave=True,
                             dynamic_ncols=True, mininterval=0.5)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, kind, value, tb) -> None:
        self.close(failed=kind is not None)

    def elapsed(self) -> float:
        return self.clock() - self.began

    def left(self) -> float | None:
        """Seconds the items not yet finished should take at the rate so far (None before the first is done)."""
        if not self.done:
            return None
        return self.elapsed() / self.done * (self.total - self.done)

    def line(self, label: str) -> str:
        """The plain line for the start of item ``done + 1``: k/n, the label, the time so far and,
        for items alike (``estimate``), the rate and the estimate of what is left."""
        said = f"{self.title}: {min(self.done + 1, self.total)}/{self.total} {label}"
        if not self.done or not self.estimate:
            return f"{said} ({duration(self.elapsed())} so far)"
        each = self.elapsed() / self.done
        article = "an" if self.unit[:1] in "aeiou" else "a"
        return (f"{said} ({duration(self.elapsed())} so far, {duration(each)} {article} {self.unit}, "
                f"about {duration(self.left())} left)")

    def start(self, label: str) -> None:
        """The next item begins (the one before it, if any, is done)."""
        self._heard = self.clock()
        if self.current is not None:
            self.done += 1
            if self._bar is not None:
                self._bar.update(1)
        self.current = label
        if self._bar is not None:
            self._bar.set_postfix_str(label)
        else:
            log.info("%s", self.line(label))

    def note(self, text: str) -> None:
        """What the current item is doing now (``training``, ``scoring``, ``step 5/40``): on a terminal
        in the updating line; in a log, a line at most every ``HEARTBEAT`` seconds, so that a long item
        (an epoch, a training) is never a silent minute."""
        if self._bar is not None:
            self._bar.set_postfix_str(f"{self.current}: {text}" if self.current else text)
        elif self.clock() - self._heard >= HEARTBEAT:
            self._heard = self.clock()
            log.info("%s: %s (%s so far)", self.title, text, duration(self.elapsed()))

    def write(self, text: str) -> None:
        """A result line: above the updating line on a terminal, a plain print otherwise."""
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, flush=True)

    def close(self, failed: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        if self.current is not None and not failed:
            self.done += 1
        if self._bar is not None:
            if not failed:
                self._bar.update(self.done - self._bar.n)
            self._bar.close()
        elif not failed:
            log.info("%s: %d %s%s done in %s", self.title, self.done, self.unit, "" if self.done == 1 else "s",
                     duration(self.elapsed()))


def steps(title: str, items: Iterable[T], label=str, unit: str = "phase") -> Iterator[T]:
    """``items``, each announced (``Progress.start``) before it is handed out."""
    items = list(items)
    with Progress(title, len(items), unit=unit) as bar:
        for item in items:
            bar.start(label(item))
            yield item
