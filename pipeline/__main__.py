"""``python -m pipeline [overrides] [-m]``: compose the config, look up its task, run the cell."""

import errno
import signal
import sys

if __name__ == "__main__" and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C while the modules load: the process ends, no traceback

if __name__ == "__main__":  # before the imports: pipeline/collector.py
    from pipeline import collector

    collector.start(sys.argv[1:])  # a single run: the collector off until its cell's run begins

import hydra
from omegaconf import DictConfig

from pipeline.validation import ConfigError, RunFailed


def _in_a_sweep() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.get().mode == RunMode.MULTIRUN


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        from pipeline import preflight, tasks  # here: a refused config does not wait for MLflow and plotting to load

        checked = preflight.checked(cfg)  # done once: before Hydra made the folder, or by the sweeper
        tasks.get(cfg).run_cell(cfg, checked)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except RunFailed as err:  # the run ended FAILED with the reason as a tag (pipeline.tracking.run)
        if _in_a_sweep():
            raise  # Hydra records the cell FAILED and the sweep goes on (SystemExit would stop the sweep)
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt as stop:  # Ctrl-C: a run it hit ended KILLED (pipeline.tracking.run); no traceback
        _interrupted(stop)
    except OSError as err:
        if err.errno not in FULL or _in_a_sweep():
            raise  # a sweep's cell: Hydra records it FAILED and the sweep goes on
        from pipeline import preflight

        preflight.forget_run_folder()  # stopped before writing anything: no folder of Hydra's files and a lock
        print(f"error: {full_disk(err)}", file=sys.stderr)
        sys.exit(1)


FULL = (errno.ENOSPC, errno.EDQUOT)  # the disk (or the user's quota) is full


def full_disk(err: OSError) -> str:
    """One line for a run that the disk stopped: what could not be written, and that a run it hit
    ended FAILED with the reason (pipeline.tracking.run), in place of a chained traceback."""
    where = f" writing {err.filename}" if err.filename else ""
    unrecorded = getattr(sys.modules.get("pipeline.tracking"), "run_unrecorded", None)
    ended = (f"the store could not record the end of run {unrecorded}: the next launch on this host ends it FAILED"
             if unrecorded else "a run it hit ended FAILED with this reason")
    return f"no space left on the device{where} ({err.strerror}); {ended}: free some space and launch it again"


def _interrupted(stop: KeyboardInterrupt) -> None:
    """Exit after Ctrl-C (130, one line saying whether it ended a run) or SIGTERM (143, silent)."""
    tracking = sys.modules.get("pipeline.tracking")  # not imported here: Ctrl-C may have cut its import short
    if isinstance(stop, getattr(tracking, "Terminated", ())):  # SIGTERM in a sweep's cell before its run began
        sys.exit(tracking.TERMINATED)  # as within one
    ended = "the run ended KILLED" if getattr(stop, "ended_run", False) else "no run was left RUNNING"
    print(f"error: interrupted (Ctrl-C); {ended}", file=sys.stderr)
    sys.exit(130)


if __name__ == "__main__":
    from pipeline import usage
    from pipeline.overrides import other_tasks_group, repeated, subfolder, syntax, unknown_choice, unknown_key

    argv = sys.argv[1:]
    if (message := syntax(argv) or repeated(argv) or unknown_choice(argv) or other_tasks_group(argv)
            or unknown_key(argv)) is not None:
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)
    if usage.wanted(argv):  # Hydra's page, without Hydra's second or two of listing groups
        usage.main(argv)
        sys.exit(0)
    if (message := subfolder()) is not None:  # a second store and outputs/ inside the checkout
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)
    if signal.getsignal(signal.SIGINT) == signal.SIG_DFL:  # set above (ignored by a shell's background job: left so)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # from here Ctrl-C raises: runs end KILLED
    try:
        main()
    except KeyboardInterrupt as stop:  # outside a cell (Hydra's start: the checks; its end): no traceback
        _interrupted(stop)
