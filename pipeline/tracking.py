"""The MLflow conventions, in one place.

- One MLflow run per cell (one Hydra job). Parameters and metrics carry the name
  of the step that produced them: ``data.*``, ``train.*``, ``evaluate.*``.
- The cells of one Hydra sweep share the tag ``sweep`` (the sweep's id) and ``sweep_dir``;
  when the sweep ends, a parent run holds the sweep's ``results.csv`` and figure, and the
  cells are attached to it (``mlflow.parentRunId``), so the UI shows them side by side.
- A run that raises is ended as FAILED (KILLED on Ctrl-C or SIGTERM): none is left RUNNING.
  A cell's job folder gets a ``cell.json`` once its run FINISHED (run id, config hash, sweep id):
  the sweep's summary reads only the records of its own sweep, and a resumed sweep skips
  the cells whose record matches their config.
- Every write to the store goes through this module, ``shielded`` from Ctrl-C and SIGTERM: a
  signal that arrives during a write acts when the write is done.
- A sqlite store (MLflow's default ``./mlflow.db``) is created and migrated by one process
  at a time (a file lock next to it), so parallel jobs on a fresh store lose nothing.
- A store whose disk fills, at the start or during a run, is ``OSError(ENOSPC)`` naming the store
  (the entry point's one ``error:`` line), never MLflow's chained tracebacks: the run ends FAILED
  with the reason if the store can still record it, and ``run_unrecorded`` says when it could not.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

import mlflow
from mlflow.entities import Metric, RunStatus
from omegaconf import DictConfig, OmegaConf

from pipeline import collector
from pipeline.validation import ConfigError, RunFailed

log = logging.getLogger(__name__)

SWEEP_TAG = "sweep"
SWEEP_DIR_TAG = "sweep_dir"
HASH_TAG = "config_hash"
KIND_TAG = "mlflow.experimentKind"
RECORD = "cell.json"
TERMINATED = 143  # the exit status of a process stopped by SIGTERM (128 + 15)


def _store_full(err: BaseException) -> bool:
    """Whether ``err`` (or an exception it was raised from) is the store's disk being full: sqlite's
    "database or disk is full", which MLflow and SQLAlchemy wrap, or an ENOSPC/EDQUOT of its own."""
    seen = 0
    while err is not None and seen < 8:
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "database or disk is full" in str(err):
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


def _full() -> OSError:
    """The store's full disk as the entry point reports it (pipeline.__main__.full_disk)."""
    return OSError(errno.ENOSPC, "the MLflow store's disk is full", mlflow.get_tracking_uri())


class _QuietWhenFull(logging.Filter):
    """MLflow logs each failed database write, traceback and SQL included, before raising it; a full
    disk is raised here as one line (``_full``), so its log records are dropped."""
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and _store_full(record.exc_info[1])) and \
            "database or disk is full" not in record.getMessage()


logging.getLogger("mlflow.store.db.utils").addFilter(_QuietWhenFull())

run_unrecorded: str | None = None  # the id of a run whose end the full store could not record (reap ends it)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the process is (ends runs as KILLED, like Ctrl-C)."""


def _terminate(signum, frame):
    raise Terminated(f"signal {signum}")


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within the block (main thread only), SIGTERM raises ``Terminated``."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if main else None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """Within the block (main thread only), SIGINT and SIGTERM wait for its end, then act as they
    would have. Every store write of this module runs in one: MLflow's SQL store keeps sqlite's
    write lock when a KeyboardInterrupt lands inside its transaction, so the run's KILLED update
    then waits out the 20 s busy timeout and fails with "database is locked", leaving the run
    RUNNING (seen in 2 of 45 Ctrl-C's on a DPFormer run that logs every epoch; 0 of 40 shielded)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []

    def defer(signum, frame):
        caught.append(signum)

    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) is not None:  # None: a handler set outside Python, which cannot be restored
            previous[sig] = signal.signal(sig, defer)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if caught:
            signal.raise_signal(caught[0])  # the handler now in force acts on it (an enclosing shield defers it again)


@contextlib.contextmanager
def _store_lock(uri: str) -> Iterator[None]:
    """Hold an exclusive lock next to a sqlite store (no-op for other stores)."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    import fcntl

    db = uri[len("sqlite:///"):].split("?", 1)[0]  # sqlite:///relative.db, sqlite:////absolute.db
    if not db or db == ":memory:":
        yield
        return
    lock = Path(db).with_name(Path(db).name + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@shielded()
def setup(cfg: DictConfig) -> None:
    """Point MLflow at the configured store (null: MLflow's default, ./mlflow.db) and experiment.
    Creating and migrating a sqlite store, and creating the experiment, happen under a file lock:
    MLflow's migrations are not safe when several processes open a fresh store at once."""
    if cfg.mlflow.tracking_uri:
        mlflow.set_tracking_uri(cfg.mlflow.tracking_uri)
    uri = mlflow.get_tracking_uri()
    try:
        with _store_lock(uri):
            experiment = mlflow.set_experiment(cfg.mlflow.experiment)
            kind = cfg.mlflow.get("experiment_kind")
            if kind and experiment.tags.get(KIND_TAG) != kind:  # the UI opens the runs table, not the GenAI overview
                mlflow.MlflowClient().set_experiment_tag(experiment.experiment_id, KIND_TAG, str(kind))
    except Exception as err:
        if not _store_full(err):
            raise
        # the disk filled after the preflight checked it: the entry point's one line (pipeline.__main__.full_disk)
        raise _full() from None
    reap(cfg)  # runs left RUNNING by a process of this host that was killed


OWNER_TAGS = ("owner.host", "owner.pid", "owner.started")


def _started(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, /proc/<pid>/stat field 22), or None if
    there is no such process: with the pid, it names one process even after the pid is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def owner() -> dict[str, str]:
    """The tags that name the process owning a run (its host, pid and start): ``reap`` ends the
    run FAILED once that process is gone."""
    pid = os.getpid()
    return {"owner.host": socket.gethostname(), "owner.pid": str(pid), "owner.started": _started(pid) or "?"}


@shielded()
def reap(cfg: DictConfig) -> int:
    """End FAILED every RUNNING run of the store (any experiment) whose owning process, on this
    host, no longer exists (killed with SIGKILL, out of memory, a lost terminal), with the reason
    as the tag ``failed_reason``; return how many. Runs owned on other hosts are left alone (a
    sweep ends its own cells' runs when it ends)."""
    client = mlflow.MlflowClient()
    experiments = [e.experiment_id for e in client.search_experiments()]
    if not experiments:
        return 0
    host = socket.gethostname().replace("'", "\\'")
    found = client.search_runs(experiments, filter_string=f"attributes.status = 'RUNNING' and tags.`owner.host` = '{host}'",
                               max_results=10000)
    dead = 0
    for r in found:
        pid, started = r.data.tags.get("owner.pid", ""), r.data.tags.get("owner.started")
        if not pid.isdigit() or _started(int(pid)) == started:
            continue
        client.set_tag(r.info.run_id, "failed_reason",
                       f"its process (pid {pid} on {r.data.tags['owner.host']}) ended without ending the run: it was "
                       f"killed, or the store's disk was full then (its log says which)")
        client.set_terminated(r.info.run_id, "FAILED")
        dead += 1
    if dead:
        log.warning("marked %d RUNNING run(s) FAILED: their process on this host is gone", dead)
    return dead


_watching = False  # whether this process already watches its parent (die_with_parent)


def die_with_parent(poll: float = 1.0) -> bool:
    """In a worker process that a sweep started (a joblib launcher's loky worker: multiprocessing's
    ``parent_process`` is set), exit as soon as that parent is gone. A sweep killed with SIGKILL
    cannot stop its workers; loky's once ran on for 10 minutes and more (4 workers and 2 resource
    trackers, about 2.4 GB). A daemon thread compares ``os.getppid()`` with the parent's pid every
    ``poll`` seconds (portable; Linux's PR_SET_PDEATHSIG follows the parent *thread*, which loky may
    retire while the sweep lives). The run the worker had open stays RUNNING until the next launch
    ends it FAILED (``reap``). Returns whether this process is watched: False in a single run and in
    the sweep's own process, whose parent is the user's shell."""
    import multiprocessing

    global _watching
    spawner = multiprocessing.parent_process()
    if spawner is None:
        return False
    if not _watching:
        parent = spawner.pid  # not os.getppid(): the sweep may already be gone (then this is 1)

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(poll)
            os._exit(1)  # the sweep is gone: nobody will read this worker's result

        threading.Thread(target=watch, name="die-with-parent", daemon=True).start()
        _watching = True
    return True


def output_dir() -> Path:
    """The folder of the running Hydra job (a single run's or a sweep cell's); outside a Hydra app
    (tests, notebooks), the working directory."""
    from hydra.core.hydra_config import HydraConfig

    try:
        return Path(HydraConfig.get().runtime.output_dir)
    except ValueError:
        return Path.cwd()


def _ui_base(cfg: DictConfig) -> tuple[str, bool]:
    """The UI's address, and whether it is the tracking server itself (else ``mlflow.ui``, where
    ``mlflow ui`` serves a local store)."""
    uri = mlflow.get_tracking_uri()
    if uri.startswith(("http://", "https://")):
        return uri.rstrip("/"), True
    return str(cfg.mlflow.get("ui") or "http://127.0.0.1:5000").rstrip("/"), False


def ui_address(cfg: DictConfig, run_id: str) -> str:
    """Where a run is shown: the tracking server's page, or the page `mlflow ui` serves for a local store."""
    base, served = _ui_base(cfg)
    experiment = mlflow.get_run(run_id).info.experiment_id
    # workflowType: MLflow 3's UI otherwise shows its GenAI navigation (runs as "Evaluations")
    page = f"{base}/#/experiments/{experiment}/runs/{run_id}?workflowType=machine_learning"
    if served:
        return page
    return f"{page}  (after: mlflow ui --backend-store-uri {mlflow.get_tracking_uri()})"


def experiment_address(cfg: DictConfig) -> str | None:
    """The page of ``cfg``'s experiment in the UI (its runs table), with ``ui_address``'s note for a
    local store; None where the experiment is not in the store (nothing was recorded)."""
    experiment = mlflow.get_experiment_by_name(cfg.mlflow.experiment)
    if experiment is None:
        return None
    base, served = _ui_base(cfg)
    page = f"{base}/#/experiments/{experiment.experiment_id}?workflowType=machine_learning"
    return page if served else f"{page}  (after: mlflow ui --backend-store-uri {mlflow.get_tracking_uri()})"


def run_links(cfg: DictConfig, run_ids) -> dict[str, str]:
    """Each run's page in the UI (``ui_address``'s link, without its note), for the sweep report's
    cells table; a run the store cannot find gets none."""
    if cfg.mlflow.tracking_uri:
        mlflow.set_tracking_uri(cfg.mlflow.tracking_uri)
    base, _ = _ui_base(cfg)
    client = mlflow.MlflowClient()
    links = {}
    for run_id in run_ids:
        try:
            experiment = client.get_run(run_id).info.experiment_id
        except Exception:  # noqa: BLE001 -- MLflow's "run not found": the id is shown without a link
            continue
        links[run_id] = f"{base}/#/experiments/{experiment}/runs/{run_id}?workflowType=machine_learning"
    return links


def ui_served(cfg: DictConfig) -> bool:
    """Whether the store is a tracking server, whose own address the links open (else ``mlflow.ui``)."""
    return _ui_base(cfg)[1]


DISPLAY_DIGITS = 6  # significant digits of the headline metrics the runs table shows (results.csv keeps every digit)


def for_display(metrics: Mapping[str, float]) -> dict[str, float]:
    """The headline metrics rounded to ``DISPLAY_DIGITS`` significant digits: MLflow's table prints
    a float as stored, so a HIT@10 of 29 computed in float32 read 28.9999999."""
    return {k: float(f"{float(v):.{DISPLAY_DIGITS}g}") for k, v in metrics.items()}


VIEW_TAG = "mlflow.sharedViewState."  # + a key: an experiment tag MLflow's UI opens as a "shared view"


@shielded()
def share_view(parent: str, sweep: str, params: list[str], metrics: list[str]) -> str:
    """A runs-table view of a sweep that MLflow's UI opens with ``?viewStateShareKey=<sweep>``: one
    row per cell (filtered by the ``sweep`` tag), unfolded, in run-name order; as columns, those of
    ``params`` whose value differs between the cells (all of them for a one-cell sweep), then
    ``metrics`` (logged rounded for display: ``for_display``). At 1280 px beside MLflow's assistant
    panel the table shows about five columns: the constant params would push the measures off
    screen (each run's page lists them). MLflow keeps a user's column choice in the browser only;
    a shared view is the one setting a server can carry: the JSON UI state MLflow's "Share" button
    stores as the experiment tag ``mlflow.sharedViewState.<key>``. Returns the experiment id."""
    client = mlflow.MlflowClient()
    experiment = client.get_run(parent).info.experiment_id
    query = f"tags.{SWEEP_TAG} = '{sweep}' and tags.kind = 'cell'"
    cells = client.search_runs([experiment], filter_string=query, max_results=10000)
    varying = [k for k in params if len({c.data.params.get(k) for c in cells}) > 1]
    columns = [f"params.`{k}`" for k in (varying or params)] + [f"metrics.`{k}`" for k in metrics]
    widths = {c: 80 if c.startswith("params.") else 130 for c in columns}  # px; MLflow's default is 150
    state = {"selectedColumns": columns, "columnOrder": columns, "columnWidths": widths, "searchFilter": query,
             # ordered by run name: MLflow's table folds child runs under their parent (a click to
             # open them; a shared view cannot carry runsExpanded) only when it orders by start time
             "orderByKey": "tags.`mlflow.runName`", "orderByAsc": True}
    client.set_experiment_tag(experiment, VIEW_TAG + sweep, json.dumps(state))
    return experiment


def view_address(cfg: DictConfig, experiment: str, key: str) -> str:
    """The runs table of ``experiment`` in the shared view ``key`` (see ``share_view``)."""
    base, _ = _ui_base(cfg)
    return f"{base}/#/experiments/{experiment}/runs?viewStateShareKey={key}&workflowType=machine_learning"


@contextlib.contextmanager
def run(name: str, tags: Mapping[str, str]) -> Iterator[mlflow.ActiveRun]:
    """An MLflow run that ends FINISHED, FAILED on an exception, or KILLED on Ctrl-C or SIGTERM
    (SIGTERM raises ``Terminated`` from before the run is created until it ends, and then exits
    with status 143, as terminated: Ctrl-C stays a KeyboardInterrupt, 130). The start-up ends here:
    the garbage collector, off while a single run loaded its modules, is back on (pipeline.collector)."""
    collector.release()
    with sigterm_raises():
        try:
            with shielded():
                try:
                    active = mlflow.start_run(run_name=name, tags={**owner(), **dict(tags)})
                except Exception as err:
                    if _store_full(err):
                        raise _full() from None
                    raise
            yield active
        except Terminated:
            _end(RunStatus.KILLED)
            raise SystemExit(TERMINATED) from None
        except KeyboardInterrupt as stop:
            _end(RunStatus.KILLED)
            stop.ended_run = True  # what the command's message says (pipeline/__main__.py)
            raise
        except BaseException as err:
            full = _store_full(err)
            reason = str(_full()) if full else str(err) if isinstance(err, RunFailed) else f"{type(err).__name__}: {err}"
            _end(RunStatus.FAILED, reason)
            if full:
                raise _full() from None  # one line, not MLflow's chained tracebacks
            raise
        else:
            _end(RunStatus.FINISHED)
            if run_unrecorded:  # the results are written; the store could not say so
                raise _full()


@shielded()
def _end(status: int, reason: str | None = None) -> None:
    """End the active run (if any) with ``status``, tagged with ``reason`` when given."""
    global run_unrecorded
    active = mlflow.active_run()
    if active is None:
        return
    if reason is not None:
        try:
            mlflow.set_tag("failed_reason", reason[:4000])
        except Exception:  # the store itself may be what failed: the run still ends FAILED
            log.warning("could not tag the failed run with its reason: %s", reason[:200])
    try:
        mlflow.end_run(RunStatus.to_string(status))  # MLflow forgets the active run first, then writes its end
    except Exception as err:
        if not _store_full(err):
            raise
        run_unrecorded = active.info.run_id
        log.error("the MLflow store's disk is full: run %s stays RUNNING there until the next launch on this host "
                  "ends it FAILED", run_unrecorded)


# --- sweeps ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Sweep:
    """What a cell knows of the sweep it belongs to (from Hydra's config of the job)."""
    id: str
    dir: str
    resume: bool
    overrides: tuple[str, ...]
    swept: tuple[str, ...] = ()   # the keys whose value differs between the sweep's cells
    cells: int = 0                # how many cells the sweep has
    started: float = 0.0          # when the sweep started (epoch seconds)


def current_sweep() -> Sweep | None:
    """The sweep this process runs a cell of, or None (a single run, or no Hydra app)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    try:
        hc = HydraConfig.get()
    except ValueError:
        return None
    if hc.mode != RunMode.MULTIRUN or not hc.sweeper.get("sweep_id"):
        return None
    return Sweep(id=str(hc.sweeper.sweep_id), dir=str(Path(hc.sweep.dir).resolve()),
                 resume=bool(hc.sweeper.get("resume", False)), overrides=tuple(hc.overrides.task),
                 swept=tuple(hc.sweeper.get("swept") or ()), cells=int(hc.sweeper.get("cells") or 0),
                 started=float(hc.sweeper.get("started") or 0.0))


def config_hash(cfg: DictConfig) -> str:
    """A digest of the resolved config (Hydra's own settings excluded)."""
    data = OmegaConf.to_container(cfg, resolve=True)
    data.pop("hydra", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read_record(folder: Path) -> dict | None:
    try:
        return json.loads((Path(folder) / RECORD).read_text())
    except (OSError, ValueError):
        return None


def write_record(folder: Path, record: Mapping[str, object]) -> None:
    """Write ``cell.json`` atomically (a reader never sees half of it)."""
    path = Path(folder) / RECORD
    tmp = path.with_name(f".{RECORD}.{os.getpid()}")
    tmp.write_text(json.dumps(dict(record), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def forget_record(folder: Path) -> None:
    (Path(folder) / RECORD).unlink(missing_ok=True)


@dataclass(frozen=True)
class Cell:
    """One cell's place in the sweep machinery: its job folder, config digest and sweep."""
    out: Path
    digest: str
    sweep: Sweep | None

    def tags(self) -> dict[str, str]:
        """The tags every cell run carries (its config hash; its sweep and sweep folder)."""
        tags = {"kind": "cell", HASH_TAG: self.digest}
        if self.sweep is not None:
            tags |= {SWEEP_TAG: self.sweep.id, SWEEP_DIR_TAG: self.sweep.dir}
        return tags

    def finished(self, run_id: str, compute: Mapping[str, object] | None = None) -> None:
        """Record that this folder now holds a FINISHED cell (what a sweep's summary collects), with
        what it ran on and how long it took (``compute``: device, device_name, seconds, ...; the
        sweep report's cells table)."""
        sweep = self.sweep
        write_record(self.out, {"run_id": run_id, "config_hash": self.digest, "status": "FINISHED",
                                "results_sha256": _sha256(self.out / "results.csv"),
                                "sweep": sweep.id if sweep else None,
                                "overrides": list(sweep.overrides) if sweep else None,
                                "compute": dict(compute or {})})


def begin_cell(cfg: DictConfig, out: Path) -> Cell | None:
    """Start a cell in ``out``: None when a resumed sweep finds this folder already holds a
    FINISHED cell of the same config (claimed for the sweep: skip the compute); else the Cell,
    with any stale record of the folder forgotten."""
    die_with_parent()  # a joblib worker ends with its sweep, even one killed with SIGKILL
    cell = Cell(Path(out), config_hash(cfg), current_sweep())
    if cell.sweep is None:  # a sweep's cells are the sweep's, whose folder lock (.sweep.lock) keeps a second out
        _hold_run_folder(cell.out)
    if cell.sweep is not None and cell.sweep.resume and _claim(cell):
        return None
    forget_record(cell.out)  # whatever this folder held no longer describes it
    return cell


_HELD: dict[Path, object] = {}  # a single run's folder -> its lock, held until the process ends


def hold(folder: Path, name: str, key: str, what: str):
    """An exclusive lock on ``folder`` (the file ``name`` in it, holding this process's pid), kept
    while the returned handle lives: the kernel drops it when the process ends, even by SIGKILL.
    If another process holds it: ConfigError naming ``key`` (the folder's config key) and the
    holder's pid, ``what`` naming what holds it ("run", "sweep")."""
    import fcntl

    handle = open(Path(folder) / name, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "?"
        handle.close()
        raise ConfigError(f"{key} = {str(folder)!r} is in use by another {what} (pid {holder}); wait for it to "
                          f"end, or give another {key}") from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


def _hold_run_folder(out: Path) -> None:
    """Lock a single run's folder (``.run.lock``) for this process: a second copy of the same
    command launched into it while the first runs is refused (one ``error:`` line, exit 2) instead
    of marking the first one's run FAILED and sharing its checkpoint."""
    folder = Path(out).resolve()
    if folder not in _HELD:  # else this process runs in it again (an in-process caller)
        _HELD[folder] = hold(out, ".run.lock", "hydra.run.dir", "run")


def _sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def results_intact(folder: Path, record: Mapping[str, object]) -> bool:
    """Whether ``folder``'s results.csv is the one its FINISHED cell wrote (its hash, recorded
    then): a file cut short, emptied or edited since is not."""
    found = _sha256(Path(folder) / "results.csv")
    if found is None or found != record.get("results_sha256"):
        log.warning("%s/results.csv is missing or not what its cell wrote (damaged?); the cell counts as not done",
                    folder)
        return False
    return True


def _claim(cell: Cell) -> bool:
    record = read_record(cell.out)
    if not record or record.get("config_hash") != cell.digest or record.get("status") != "FINISHED" \
            or not results_intact(cell.out, record):
        return False
    write_record(cell.out, record | {"sweep": cell.sweep.id, "overrides": list(cell.sweep.overrides)})
    log.info("resume: %s finished earlier with the same config (run %s); skipped", cell.out, record["run_id"])
    return True


def _client_and_experiments(cfg: DictConfig) -> tuple[mlflow.MlflowClient, list[str]]:
    client = mlflow.MlflowClient()
    experiment = client.get_experiment_by_name(cfg.mlflow.experiment)
    return client, [experiment.experiment_id] if experiment else []


@shielded()
def end_running(cfg: DictConfig, tag: str, value: str, status: str) -> int:
    """End every RUNNING run tagged ``tag = value`` with ``status``; return how many."""
    client, experiments = _client_and_experiments(cfg)
    if not experiments:
        return 0
    value = value.replace("'", "\\'")
    stale = client.search_runs(experiments, filter_string=f"tags.{tag} = '{value}' and attributes.status = 'RUNNING'",
                               max_results=10000)
    for found in stale:
        client.set_terminated(found.info.run_id, status)
    return len(stale)


def finish_sweep(sweep: str, name: str, artifacts: list[str], params: Mapping[str, object],
                 cells: list[str], tags: Mapping[str, str] | None = None,
                 metrics: Mapping[str, float] | None = None, description: str | None = None) -> str:
    """Create the sweep's parent run, log its artifacts, and attach the given cell runs to it
    (a resumed sweep's cells may come from an earlier launch: they are re-tagged with this sweep)."""
    with run(name, {SWEEP_TAG: sweep, "kind": "sweep", **(tags or {})}) as parent, shielded():
        mlflow.log_params(params)
        for path in artifacts:
            mlflow.log_artifact(path)
        client = mlflow.MlflowClient()
        for run_id in cells:
            client.set_tag(run_id, "mlflow.parentRunId", parent.info.run_id)
            client.set_tag(run_id, SWEEP_TAG, sweep)
        mlflow.log_metrics({"cells": len(cells), **(metrics or {})})
        if description:  # the run page's Description
            mlflow.set_tag("mlflow.note.content", description[:50000])
        return parent.info.run_id


# --- logging helpers (the active run's writes; each one shielded) -------------------------------

def _to_active_run(write):
    """``write`` logs to the active run, shielded; outside a run (a test or a notebook calling a
    step such as ``data.run`` directly) it does nothing: MLflow's fluent API would start a run in
    ./mlflow.db and leave it RUNNING (seen: a fresh clone's test suite left one there)."""
    @functools.wraps(write)
    def logged(*args, **kwargs):
        if mlflow.active_run() is None:
            return None
        with shielded():
            try:
                return write(*args, **kwargs)
            except Exception as err:
                if _store_full(err):
                    raise _full() from None
                raise

    return logged


@_to_active_run
def log_config(cfg: DictConfig) -> None:
    """The resolved config, as the run's artifact ``config.yaml``."""
    mlflow.log_text(OmegaConf.to_yaml(cfg, resolve=True), "config.yaml")


@_to_active_run
def log_headline_params(params: Mapping[str, object]) -> None:
    """The run's headline params, unprefixed: the runs table's first columns."""
    mlflow.log_params(dict(params))


@_to_active_run
def log_headline_metrics(metrics: Mapping[str, float]) -> None:
    """The run's headline metrics, unprefixed and rounded for display (``for_display``): the runs
    table's measures."""
    mlflow.log_metrics(for_display(metrics))


@_to_active_run
def log_params(step: str, params: Mapping[str, object]) -> None:
    mlflow.log_params({f"{step}.{k}": v for k, v in params.items()})


@_to_active_run
def log_metrics(step: str, metrics: Mapping[str, float], at: int | None = None) -> None:
    mlflow.log_metrics({f"{step}.{k}": float(v) for k, v in metrics.items()}, step=at)


@_to_active_run
def log_artifacts(*paths: Path | str) -> None:
    for path in paths:
        mlflow.log_artifact(str(path))


@_to_active_run
def set_tag(key: str, value: str) -> None:
    mlflow.set_tag(key, value)


@_to_active_run
def log_curve(key: str, values: list[float]) -> None:
    """A per-step metric in one request (the training loss can have hundreds of steps)."""
    run_id = mlflow.active_run().info.run_id
    now = int(time.time() * 1000)
    metrics = [Metric(key, float(v), now, i) for i, v in enumerate(values)]
    client = mlflow.MlflowClient()
    for start in range(0, len(metrics), 1000):
        client.log_batch(run_id, metrics=metrics[start : start + 1000])
