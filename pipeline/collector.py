"""Python's garbage collector while a command starts and when it exits.

Before a cell computes, the command line imports torch, MLflow, SQLAlchemy, SciPy, pandas and
matplotlib: millions of objects that live as long as the process. CPython's collector walks every
object it tracks at each full collection, which the imports' own allocations set off again and again,
and it walks them once more in the interpreter's collections at exit. Of one fresh process that does
only what a small cell cannot skip, that was about two seconds of 5.5 (``benchmarks/startup.py``'s
floor rows, docs/tests.md).

``hold`` (``python -m pipeline``, a single run) turns the collector off for the start-up. ``release``,
when the cell's MLflow run begins (``pipeline.tracking.run``), freezes every object that exists then
(``gc.freeze``: moved where no collection walks) and turns the collector back on, so the cell's own
garbage is collected as before. ``freeze_at_exit`` freezes the heap once more at exit, which skips the
interpreter's final collections (refusals and sweeps, which never release, pay about a second there):
what a process must write is written and closed by its code (``with`` blocks, MLflow's calls) and its
exit handlers, not by a collection.

What this costs: the garbage made in the start-up (objects in reference cycles, freed only by a
collection) is kept until the process ends, once per process. A sweep never holds the collector: its
sweeper validates every cell before the first starts, and the default launcher runs the cells one
after another in its own process, so the collector stays on there.
"""

from __future__ import annotations

import atexit
import gc

_held = False  # the collector was turned off by ``hold`` and is still off


def start(argv: list[str]) -> None:
    """``python -m pipeline``'s start, before its imports: the heap frozen at exit, and the collector
    held unless the command is a sweep (``-m``, ``--multirun``, ``hydra.mode=...``)."""
    freeze_at_exit()
    sweep = {"-m", "--multirun"} & set(argv) or any(a.lstrip("+~").startswith("hydra.mode=") for a in argv)
    if not sweep:
        hold()


def hold() -> None:
    """Turn the collector off until ``release`` (left as it is when something else turned it off)."""
    global _held
    if gc.isenabled():
        gc.disable()
        _held = True


def release() -> None:
    """The start-up is over: freeze what it made and turn the collector back on (a no-op unless held)."""
    global _held
    if _held:
        _held = False
        gc.freeze()
        gc.enable()


def freeze_at_exit() -> None:
    """Freeze the heap at exit (an exit handler: the others still run, in their order)."""
    atexit.unregister(gc.freeze)  # once, however often asked
    atexit.register(gc.freeze)
