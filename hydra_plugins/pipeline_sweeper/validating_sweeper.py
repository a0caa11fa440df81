"""Hydra's basic sweeper, plus what the pipeline needs around a sweep, under any launcher
(basic, ``hydra/launcher=joblib``, ``submitit_local``, ``submitit_slurm``):

- every cell is composed and checked by ``pipeline.preflight.check`` (its task's validation, its
  folder, the store, its memory times the cells joblib runs at once) before any runs, so a bad
  value anywhere in a sweep stops it with one message before any compute;
- the MLflow store is created and migrated once, here, before any job starts, and RUNNING runs
  left by an earlier launch into the same sweep folder are marked FAILED;
- every cell gets the sweep's id and folder through its Hydra config (``hydra.sweeper.sweep_id``,
  ``hydra.sweep.dir``, made concrete here), which reaches joblib and submitit workers alike;
- ``hydra.sweeper.resume=true``: cells whose job folder holds a FINISHED result of the same
  resolved config are skipped (``pipeline.tracking.begin_cell``), the rest run;
- when the cells are done, ``pipeline.sweep`` and the task's ``summarise`` write the tables,
  figures, report and parent run from the cells of this sweep that finished; failed cells are named and the exit status is 1;
- one sweep at a time per folder: a second launch into a folder a running sweep holds is refused;
- Ctrl-C or SIGTERM ends the sweep's RUNNING runs as KILLED (joblib's workers are stopped);
  SIGTERM exits with 143;
- under a submitit launcher, a cell that the cluster cancels, times out or kills is reported
  failed while the sweep goes on awaiting, collecting and summarising the others; a relaunch into
  the same folder first cancels the SLURM jobs its killed predecessor left queued or running
  (``submitit_jobs``).

It lives in ``hydra_plugins`` because Hydra only loads sweepers from there.
"""

import logging
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

import pipeline  # noqa: F401  registers ${uid:} wherever Hydra loads its plugins (compose() included)
from hydra_plugins.pipeline_sweeper import compose_cache, submitit_jobs

log = logging.getLogger(__name__)


@dataclass
class ValidatingSweeperConf:
    _target_: str = "hydra_plugins.pipeline_sweeper.validating_sweeper.ValidatingSweeper"
    max_batch_size: Optional[int] = None
    params: Optional[Dict[str, str]] = None
    resume: bool = False           # skip cells that FINISHED earlier in this sweep folder with the same config
    max_cells: int = 10000         # a sweep of more cells is refused at once, with its count (raise it to run one)
    sweep_id: str = "${uid:}"      # tags every cell of this sweep (made concrete before launching)
    swept: List[str] = field(default_factory=list)  # set here: the keys whose value differs between cells
    cells: int = 0                 # set here: the number of cells (a cell's k/n progress line)
    started: float = 0.0           # set here: when the sweep started (a cell's estimate of the time left)


ConfigStore.instance().store(group="hydra/sweeper", name="validating", node=ValidatingSweeperConf,
                             provider="pipeline")


PROGRESS_EVERY = 10.0  # seconds between the lines saying how many cells were checked


def cell_count(overrides) -> int:
    """The number of cells the overrides sweep (the product of each swept key's number of values; a
    key given again replaces its values, as in ``split_arguments``), counted without listing them: a
    range's length is computed, not iterated."""
    from hydra.core.override_parser.types import ChoiceSweep, RangeSweep

    values = {}
    for override in overrides:
        value = override.value()
        if not override.is_sweep_override() or not override.is_discrete_sweep():
            n = 1  # an interval (an optimizer's sweep): split_arguments refuses it, as before
        elif isinstance(value, ChoiceSweep):
            n = len(value.list)
        elif isinstance(value, RangeSweep) and value.step:
            n = max(0, math.ceil((value.stop - value.start) / value.step))
        else:  # glob: as Hydra lists it
            n = len(list(override.sweep_string_iterator()))
        values[override.get_key_element()] = n
    return math.prod(values.values())


def _quote(value: str) -> str:
    """A value as a Hydra override carries it, always quoted: unquoted, Hydra would parse a random
    id such as ``6e123456`` as a float (inf) and ``00001234`` as an int, and the cells' records
    would no longer match their sweep."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _error(message: str, status: int) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(status)


def swept_keys(jobs: Sequence[Sequence[str]]) -> List[str]:
    """The override keys whose value differs between the jobs, in the order of the overrides."""
    values: Dict[str, set] = {}
    for job in jobs:
        for override in job:
            key, _, value = override.partition("=")
            values.setdefault(key, set()).add(value)
    counts = {key: sum(1 for job in jobs if any(o.partition("=")[0] == key for o in job)) for key in values}
    return [key for key, seen in values.items() if len(seen) > 1 or counts[key] < len(jobs)]


class ValidatingSweeper(BasicSweeper):
    def __init__(self, max_batch_size: Optional[int] = None, params: Optional[Dict[str, str]] = None,
                 resume: bool = False, sweep_id: str = "", swept: Optional[List[str]] = None,
                 cells: int = 0, started: float = 0.0, max_cells: int = 10000) -> None:
        super().__init__(max_batch_size=max_batch_size, params=params)
        self.resume = resume
        self.max_cells = max_cells
        self._checked = 0  # cells checked so far (progress of a long validation)
        self._first_checked: Optional[float] = None  # when the first cell was checked (its imports paid)
        self._said = time.monotonic()
        self.sweep_id = sweep_id

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        """Hydra's setup, with a config loader that composes the cells of one choice of config
        groups once (``compose_cache``): for the validation here and for the launcher's jobs."""
        loader = compose_cache.SweepConfigLoader(hydra_context.config_loader)
        super().setup(hydra_context=HydraContext(config_loader=loader, callbacks=hydra_context.callbacks),
                      task_function=task_function, config=config)

    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        from pipeline import preflight

        loader = self.hydra_context.config_loader
        cells = sum(len(b) for b in self.overrides) if self.overrides else len(batch)
        for overrides in batch:
            self._checked += 1
            if time.monotonic() - self._said >= PROGRESS_EVERY:
                log.info("checked %d of %d cells", self._checked, cells)
                self._said = time.monotonic()
            cfg = loader.load_sweep_config(master_config=self.config, sweep_overrides=list(overrides))
            try:  # the memory of the cells a joblib launcher runs at once; a SLURM cell's device where it runs
                preflight.check(cfg, str(cfg.hydra.sweep.dir), "hydra.sweep.dir", min(preflight.jobs(cfg), cells),
                                here=preflight.runs_here(cfg))
            except Exception as err:  # noqa: BLE001 -- a ConfigError, or a check that failed (preflight.refusal)
                print(f"error: in the sweep cell {' '.join(overrides)}: {preflight.refusal(err)}", file=sys.stderr)
                sys.exit(2)
            if self._first_checked is None:
                self._first_checked = time.perf_counter()

    def _pin(self, sweep_dir: Path, jobs: Sequence[Sequence[str]]) -> None:
        """Make the sweep's id and folder concrete in every cell's config (each launcher composes
        a cell's config from the master config's Hydra overrides, in its own process), with the
        keys the sweep varies (a cell's run name and params), its size and start (progress)."""
        swept = swept_keys(jobs)
        with read_write(self.config.hydra), open_dict(self.config.hydra):
            self.config.hydra.overrides.hydra.extend(
                [f"hydra.sweeper.sweep_id={_quote(self.sweep_id)}", f"hydra.sweep.dir={_quote(str(sweep_dir))}",
                 f"hydra.sweeper.swept=[{','.join(_quote(k) for k in swept)}]",
                 f"hydra.sweeper.cells={len(jobs)}", f"hydra.sweeper.started={time.time():.3f}"])

    def _cancel_earlier_jobs(self) -> List[str]:
        """Under ``submitit_slurm``: cancel the jobs an earlier launch into this sweep's submitit
        folder left queued or running (see ``submitit_jobs.cancel_earlier_jobs``)."""
        from pipeline import preflight

        launcher = self.config.hydra.launcher
        if preflight.runs_here(self.config) or not launcher.get("submitit_folder"):
            return []
        folder = Path(str(launcher.submitit_folder))
        folder = folder.parent if "%" in folder.name else folder
        return submitit_jobs.cancel_earlier_jobs(folder)

    def sweep(self, arguments: List[str]) -> Any:
        assert self.config is not None and self.launcher is not None and self.hydra_context is not None
        if self.max_batch_size is not None and (isinstance(self.max_batch_size, bool)
                                                or not isinstance(self.max_batch_size, int) or self.max_batch_size < 1):
            _error(f"hydra.sweeper.max_batch_size must be null (every cell at once) or a positive integer, "
                   f"got {self.max_batch_size!r}", 2)
        if isinstance(self.max_cells, bool) or not isinstance(self.max_cells, int) or self.max_cells < 1:
            _error(f"hydra.sweeper.max_cells must be a positive integer, got {self.max_cells!r}", 2)
        params_conf = self._parse_config()
        params_conf.extend(arguments)
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        parsed = parser.parse_overrides(params_conf)
        count = cell_count(parsed)
        if count > self.max_cells:  # before composing any: 700k cells took hours to validate, 1e10 ran out of memory
            _error(f"hydra.sweeper.max_cells = {self.max_cells:,}: the sweep has {count:,} cells, more than that; "
                   f"to run them all, add hydra.sweeper.max_cells={count}", 2)
        self.overrides = self.split_arguments(parsed, self.max_batch_size)
        from pipeline import sweep as summary  # after the count: a refused sweep does not wait for MLflow to load
        from pipeline import tracking
        from pipeline.validation import ConfigError

        checking = time.perf_counter()
        for batch in self.overrides:  # every cell, before any runs
            self.validate_batch_is_legal(batch)
        jobs = [list(job) for batch in self.overrides for job in batch]
        done = time.perf_counter()
        first = (self._first_checked or done) - checking
        log.info("checked %d cells in %.2f s: the first in %.2f s (the imports and store it opens), the others in "
                 "%.1f ms a cell", len(jobs), done - checking, first, 1000 * (done - checking - first) / max(len(jobs) - 1, 1))

        self.sweep_id = str(self.config.hydra.sweeper.sweep_id)
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).resolve()
        self._pin(sweep_dir, jobs)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        try:  # a second sweep launched into the folder while this one runs is refused, not interleaved
            self._lock = tracking.hold(sweep_dir, ".sweep.lock", "hydra.sweep.dir", "sweep")  # held until exit
        except ConfigError as err:
            _error(str(err), 2)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        cancelled = self._cancel_earlier_jobs()
        if cancelled:
            log.warning("cancelled %d SLURM job(s) of an earlier launch into %s: %s", len(cancelled), sweep_dir,
                        " ".join(cancelled))
        tracking.setup(self.config)  # create and migrate the store once, before any job opens it
        stale = tracking.end_running(self.config, tracking.SWEEP_DIR_TAG, str(sweep_dir), "FAILED")
        if stale:
            log.warning("marked %d RUNNING run(s) of an earlier launch into %s as FAILED", stale, sweep_dir)
        log.info("sweep %s: %d cells into %s%s", self.sweep_id, len(jobs), sweep_dir, " (resume)" if self.resume else "")

        returns = []
        crashed = None
        try:
            with tracking.sigterm_raises(), submitit_jobs.every_job_awaited():
                initial_job_idx = 0
                while not self.is_done():
                    batch = self.get_job_batch()
                    returns.append(self.launcher.launch(batch, initial_job_idx=initial_job_idx))
                    initial_job_idx += len(batch)
        except (KeyboardInterrupt, SystemExit) as stop:  # Ctrl-C; SIGTERM here or in a cell (exit 143)
            killed = tracking.end_running(self.config, tracking.SWEEP_TAG, self.sweep_id, "KILLED")
            log.warning("sweep %s stopped (%s); %d RUNNING run(s) marked KILLED", self.sweep_id,
                        type(stop).__name__, killed)
            terminated = isinstance(stop, tracking.Terminated) or \
                (isinstance(stop, SystemExit) and stop.code == tracking.TERMINATED)
            if isinstance(stop, SystemExit) and not terminated:
                raise
            _error(f"sweep {sweep_dir} {'terminated' if terminated else 'interrupted'}; resume it with the same "
                   f"command and hydra.sweep.dir={_quote(str(sweep_dir))} hydra.sweeper.resume=true",
                   tracking.TERMINATED if terminated else 130)
        except Exception as err:  # a launcher that lost a job (a worker killed, a cluster job gone)
            crashed = f"{type(err).__name__}: {err}"
            log.error("the launcher stopped: %s", crashed)
        for results in returns:
            for ret in results:
                if ret.status.name == "FAILED":
                    err = ret._return_value
                    log.error("cell %s failed: %s: %s", " ".join(ret.overrides), type(err).__name__, err)

        failed_runs = tracking.end_running(self.config, tracking.SWEEP_TAG, self.sweep_id, "FAILED")
        if failed_runs:
            log.warning("marked %d RUNNING run(s) of this sweep as FAILED (their process died)", failed_runs)
        try:
            with tracking.sigterm_raises():
                cells = summary.collect(sweep_dir, self.sweep_id, jobs)
                summary.summarise(self.config, self.sweep_id, sweep_dir, cells)
        except KeyboardInterrupt as stop:  # Ctrl-C or SIGTERM while the summary is written: it may be partial
            terminated = isinstance(stop, tracking.Terminated)
            _error(f"sweep {sweep_dir} {'terminated' if terminated else 'interrupted'} while its summary was written "
                   f"(its cells are done); write it again with the same command and "
                   f"hydra.sweep.dir={_quote(str(sweep_dir))} hydra.sweeper.resume=true",
                   tracking.TERMINATED if terminated else 130)
        except Exception as err:
            _error(f"the end of sweep {sweep_dir} failed: {type(err).__name__}: {err}", 1)
        if cells.failed:
            _error(f"{len(cells.failed)} of {len(jobs)} cells failed ({'; '.join(cells.failed)}); "
                   f"the summary in {sweep_dir} holds the {len(cells.done)} that finished", 1)
        if crashed:
            _error(f"the launcher stopped: {crashed}", 1)
        return returns
