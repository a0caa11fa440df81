"""Checks of a cell before anything is computed or logged: its config, by its task's rules
(``Task.validate``), and the environment the values point at: that ``compute.device`` is a
device this machine has and the task runs on (``pipeline.device``), that the output folder can be
written, that the MLflow store can be reached (a server answers within
``mlflow.connect_timeout`` seconds) and written (a local store's database and artifact folders),
and that the cell's tensors fit in the memory that is available (the task's estimate,
``Task.memory``, times the cells a joblib sweep runs at once, against MemAvailable and any cgroup
limit). Each refusal is a ``ConfigError`` naming the key, which the entry point prints as one
``error:`` line (exit 2).

``check`` runs for a single run once, in ``PreflightCallback`` before Hydra creates the run's folder
(the entry point takes its result with ``checked``); for a sweep in the validating sweeper, for every
cell before any job starts, and again by each cell when it starts (its folder, the store, the memory
left by then).
"""

from __future__ import annotations

import logging
import os
import socket
import sqlite3
import sys
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException

from pipeline import device, lazy, tasks
from pipeline.task import Memory
from pipeline.validation import ConfigError

torch = lazy.module("torch")  # imported at first use: the config's checks load this module (pipeline/lazy.py)

_PORTS = {"http": 80, "https": 443, "postgresql": 5432, "mysql": 3306, "mssql": 1433}


_CHECKED: dict[str, Any] = {}  # a config's text -> what its task's validate derived, for the cells checked here


def _fingerprint(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml({k: v for k, v in cfg.items() if k != "hydra"})


def check(cfg: DictConfig, output: str | Path | None = None, key: str | None = None, concurrent: int = 1,
          remember: bool = False, here: bool = True) -> Any:
    """Every check of one cell: its task's validation, its device, then its output folder ``output``
    (named ``key``; default: the Hydra job's, or the working directory outside Hydra), the MLflow
    store, and its memory (times ``concurrent`` cells at once). Returns what the validation
    derived; ``remember``: also for ``checked`` (a single run, checked by the callback).
    ``here=False``: the cell runs on another machine (``runs_here``), so its device's form only:
    whether that machine has the device, and the memory for it, are checked where it runs.
    A key the checks read that the config lacks (``~privacy.eps``) is a ConfigError naming it."""
    try:
        return _check(cfg, output, key, concurrent, remember, here)
    except OmegaConfBaseException as err:
        raise ConfigError(_omegaconf_message(err)) from None


def _omegaconf_message(err: OmegaConfBaseException) -> str:
    key = getattr(err, "full_key", None) or getattr(err, "key", None)
    if isinstance(err, MissingMandatoryValue):
        return f"{key} must be given (it is ??? in the config): {key}=..."
    if isinstance(err, (ConfigAttributeError, ConfigKeyError)):
        return f"{key} is not in the config (was it removed with ~{key}, or is its config group missing?)"
    return f"{key}: {str(err).splitlines()[0]}"


def refusal(err: Exception) -> str:
    """The ``error:`` line's text for an exception raised while checking a config: a ConfigError's
    message, or, for any other (a check that failed instead of refusing: a bug to report), its
    type and message, so that a refusal never becomes a traceback and a run folder."""
    if isinstance(err, ConfigError):
        return str(err)
    return (f"the config could not be checked ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
            "nothing was run or created. Please report this with the command line")


def _check(cfg: DictConfig, output: str | Path | None, key: str | None, concurrent: int, remember: bool,
           here: bool) -> Any:
    task = tasks.get(cfg)
    found = task.validate(cfg)
    if "audit" in cfg:  # python -m pipeline.audit (conf/audit.yaml)
        device.of(cfg, task.audit_devices, f"the {task.name} audit")
    else:  # a device this machine has and the task runs on
        device.of(cfg, task.devices, f"task={task.name}", here=here)
    if output is None:
        output, key = _job_output()
    folder(output, key or "output folder")
    report_dir(cfg)
    tracking_store(cfg)
    if here:
        memory(cfg, task.memory(cfg, found), concurrent)
    if remember:
        _CHECKED[_fingerprint(cfg)] = found
    return found


def checked(cfg: DictConfig) -> Any:
    """What the callback's ``check`` derived for this single run, or ``check`` now: a cell of a sweep
    is checked again where and when it starts (its folder, the store, the memory left by then)."""
    key = _fingerprint(cfg)
    return _CHECKED[key] if key in _CHECKED else check(cfg)


def _job_output() -> tuple[Path, str]:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    try:
        hydra = HydraConfig.get()
    except ValueError:  # outside a Hydra app
        return Path.cwd(), "output folder"
    key = "hydra.sweep.dir" if hydra.mode == RunMode.MULTIRUN else "hydra.run.dir"
    return Path(hydra.runtime.output_dir), key


# --- folders -------------------------------------------------------------------------------

MIN_FREE = 16 * 2**20  # bytes a folder's disk must have free: a new MLflow store alone is about 1 MB


def free_bytes(folder: Path) -> int | None:
    """Bytes an unprivileged process may still write on ``folder``'s file system (None if unknown)."""
    try:
        st = os.statvfs(folder)
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize


def _unwritable(path: str | Path) -> str | None:
    """None when a file can be created and written in ``path`` or, if it does not exist yet, in its
    nearest existing ancestor (where it will be created); else why not. Tries for real (permission
    bits say nothing to root, nor about read-only or immutable file systems), with a block of data
    (an empty file is still created on a full disk), and refuses a disk with less than ``MIN_FREE``
    left: MLflow's store on a full disk failed with a database traceback, its folder left."""
    target = Path(path).expanduser().absolute()
    while not target.exists() and target != target.parent:
        target = target.parent
    if not target.is_dir():
        return f"{str(target)!r} is not a folder"
    free = free_bytes(target)
    if free is not None and free < MIN_FREE:
        return (f"the disk under {str(target)!r} is full ({_size(free)} free, a run needs {MIN_FREE // 2**20} MB "
                f"at least): free some space or choose a folder on another disk")
    try:
        fd, name = tempfile.mkstemp(prefix=".preflight-", dir=target)
        try:
            os.write(fd, bytes(4096))  # a full disk (or quota) refuses the block, not the empty file
        finally:
            os.close(fd)
            os.unlink(name)
    except OSError as err:
        return f"nothing can be written in {str(target)!r} ({err.strerror or err})"
    return None


def folder(path: str | Path, key: str) -> None:
    if not str(path).strip():
        raise ConfigError(f"{key} is empty: it would write into the working directory; give a folder")
    why = _unwritable(path)
    if why:
        raise ConfigError(f"{key} = {str(path)!r} cannot be written: {why}")


def report_dir(cfg: DictConfig) -> None:
    """``report.dir`` (where a sweep copies its summary for DVC), if set, can be written."""
    where = OmegaConf.select(cfg, "report.dir")
    if where:
        folder(str(where), "report.dir")


# --- the MLflow store ----------------------------------------------------------------------

def tracking_uri(cfg: DictConfig) -> tuple[str, str]:
    """The store's URI and where it comes from (the config, the environment or MLflow's default)."""
    if cfg.mlflow.tracking_uri:
        return str(cfg.mlflow.tracking_uri), "mlflow.tracking_uri"
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"], "mlflow.tracking_uri (from MLFLOW_TRACKING_URI)"
    import mlflow

    return mlflow.get_tracking_uri(), "mlflow.tracking_uri (MLflow's default)"


MAX_EXPERIMENT_NAME = 500  # MLflow's limit (mlflow.utils.validation.MAX_EXPERIMENT_NAME_LENGTH)


def tracking_store(cfg: DictConfig) -> None:
    timeout = cfg.mlflow.get("connect_timeout")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 3600:
        raise ConfigError(f"mlflow.connect_timeout must be a number of seconds in (0, 3600], got {timeout!r}")
    name = cfg.mlflow.get("experiment")
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_EXPERIMENT_NAME:
        shown = f"{name[:60]!r}... ({len(name)} characters)" if isinstance(name, str) and len(name) > 60 else repr(name)
        raise ConfigError(f"mlflow.experiment must be a name of 1 to {MAX_EXPERIMENT_NAME} characters, got {shown}")
    run_id = os.environ.get("MLFLOW_RUN_ID")
    if run_id:  # set by `mlflow run` and job wrappers: MLflow's start_run would reopen that run and log into it
        raise ConfigError(f"MLFLOW_RUN_ID = {run_id!r} (from the environment): MLflow would reopen that run and "
                          "write this one into it; the pipeline makes a run of its own for each cell and sweep. "
                          "Unset it: env -u MLFLOW_RUN_ID python -m pipeline ...")
    uri, key = tracking_uri(cfg)
    parsed = urlparse(uri)
    scheme = parsed.scheme.lower()
    if uri.lower() in ("databricks", "databricks-uc"):  # MLflow's names of a Databricks workspace, not folders
        scheme = uri.lower()
    if scheme.split("+")[0] in _PORTS and not parsed.hostname:
        raise ConfigError(f"{key} = {uri!r} names no host (e.g. http://localhost:5000)")
    if scheme == "sqlite":
        _sqlite_store(uri, key, cfg)
    elif scheme in ("", "file") or (len(scheme) == 1 and sys.platform == "win32"):  # a local folder
        if _folder_store_refused():
            raise ConfigError(f"{key} = {uri!r}: this MLflow's folder store accepts no new runs (its 'maintenance "
                              "mode'); give a database file, sqlite:///<folder>/mlflow.db (or set "
                              "MLFLOW_ALLOW_FILE_STORE=true, MLflow's opt-out)")
        path = unquote(parsed.path) if scheme == "file" else uri
        why = _unwritable(path)
        if why:
            raise ConfigError(f"{key} = {uri!r}: the MLflow store cannot be written: {why}")
    elif scheme.split("+")[0] in _PORTS and parsed.hostname:
        port = parsed.port or _PORTS[scheme.split("+")[0]]
        try:
            socket.create_connection((parsed.hostname, port), timeout=float(timeout)).close()
        except OSError as err:
            raise ConfigError(f"{key} = {uri!r}: the tracking server {parsed.hostname}:{port} cannot be reached "
                              f"({err.strerror or err or 'timed out'}; waited at most {timeout:g} s)") from None
    else:
        _other_store(uri, key, scheme)


def _folder_store_refused() -> bool:
    """Whether the installed MLflow refuses to open a folder store (3.x unless MLFLOW_ALLOW_FILE_STORE
    is true; older releases have no such switch and use it)."""
    try:
        from mlflow.environment_variables import MLFLOW_ALLOW_FILE_STORE
    except ImportError:
        return False
    return not MLFLOW_ALLOW_FILE_STORE.get()


def _other_store(uri: str, key: str, scheme: str) -> None:
    """A scheme MLflow must know (``bogus://x`` is refused); Databricks's needs its credentials."""
    from mlflow.tracking._tracking_service.utils import _tracking_store_registry

    try:
        _tracking_store_registry.get_store_builder(uri)
    except Exception:  # noqa: BLE001 -- MLflow's unsupported-URI exception
        raise ConfigError(f"{key} = {uri!r}: MLflow knows no tracking store of scheme {scheme!r}; give "
                          "sqlite:///path.db, http(s)://host:port or a database URL") from None
    if scheme.startswith("databricks"):
        from mlflow.utils.databricks_utils import get_databricks_host_creds

        quiet = logging.getLogger("mlflow.utils.databricks_utils")
        level, quiet.level = quiet.level, logging.ERROR  # its warning would print a second line
        try:
            get_databricks_host_creds(uri)
        except Exception as err:  # noqa: BLE001 -- MLflow's message says what is missing
            raise ConfigError(f"{key} = {uri!r}: the Databricks credentials cannot be read "
                              f"({str(err).splitlines()[0][:200]})") from None
        finally:
            quiet.setLevel(level)


def _sqlite_store(uri: str, key: str, cfg: DictConfig) -> None:
    """The database file (and its folder, for sqlite's journal) can be written, and so can the
    artifact folder of the configured experiment (or ./mlruns, where a new one would go)."""
    path = uri[len("sqlite://"):].split("?")[0]
    if path in ("", "/", "/:memory:") or "mode=memory" in uri:
        raise ConfigError(f"{key} = {uri!r} is an in-memory database: the runs would be gone when the process "
                          "ends; give a file, sqlite:///path/mlflow.db")
    path = Path(path[1:] if path.startswith("/") else path)  # sqlite:///rel.db, sqlite:////abs.db
    why = _unwritable(path.parent)
    if why:
        raise ConfigError(f"{key} = {uri!r}: the MLflow store cannot be written: {why}")
    artifacts = Path.cwd() / "mlruns"
    if path.exists():
        try:
            with open(path, "r+b"):
                pass
        except OSError as err:
            raise ConfigError(f"{key} = {uri!r}: the MLflow store cannot be written: "
                              f"{str(path)!r} ({err.strerror or err})") from None
        try:
            wait = float(cfg.mlflow.connect_timeout)  # checked by tracking_store
            db = sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True, timeout=wait)  # %, # escaped
            try:
                row = db.execute("SELECT artifact_location, lifecycle_stage, experiment_id FROM experiments "
                                 "WHERE name = ?", (str(cfg.mlflow.experiment),)).fetchone()
            finally:
                db.close()
        except sqlite3.OperationalError as err:
            if "locked" in str(err) or "busy" in str(err):  # another process holds it
                raise ConfigError(f"{key} = {uri!r}: the store cannot be read ({err}; waited {wait:g} s, "
                                  "mlflow.connect_timeout): is another process holding it?") from None
            row = None  # a fresh store without tables yet ("no such table")
        except sqlite3.DatabaseError as err:
            raise ConfigError(f"{key} = {uri!r}: {str(path)!r} is not an MLflow database ({err})") from None
        if row and row[1] == "deleted":
            raise ConfigError(f"mlflow.experiment = {str(cfg.mlflow.experiment)!r} is deleted in the store {uri!r}; "
                              f"restore it (MLFLOW_TRACKING_URI={uri} mlflow experiments restore --experiment-id "
                              f"{row[2]}) or give another mlflow.experiment")
        if row and row[0]:
            location = urlparse(row[0])
            if location.scheme not in ("", "file"):
                return  # a remote artifact store: MLflow's own client reports it
            artifacts = Path(unquote(location.path))
    why = _unwritable(artifacts)
    if why:
        raise ConfigError(f"{key} = {uri!r}: the artifact folder {str(artifacts)!r} cannot be written: {why}")


# --- memory --------------------------------------------------------------------------------

def available_memory() -> int | None:
    """Bytes this process can still allocate: MemAvailable, capped by a cgroup v2 limit (None if unknown)."""
    found = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found = int(line.split()[1]) * 1024
    except OSError:
        try:
            found = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            found = min(found if found is not None else 1 << 62, int(limit) - used)
    except (OSError, ValueError):
        pass
    return found


def _size(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n / 1e3:.3g} kB"


def runs_here(cfg: DictConfig) -> bool:
    """Whether a sweep's cells run on this machine: not under ``hydra/launcher=submitit_slurm``,
    whose jobs run on the cluster's nodes (a GPU node's device is not the submitting machine's)."""
    launcher = (cfg.hydra.get("launcher") or {}) if "hydra" in cfg else {}
    return "SlurmLauncher" not in str(launcher.get("_target_", ""))


SLURM_TIMEOUT = 30  # seconds sinfo may take to answer before a submitit_slurm sweep is refused


def cluster(cfg: DictConfig) -> None:
    """Under ``hydra/launcher=submitit_slurm``: the cluster answers (``sinfo``, which asks what
    ``sbatch`` would, without submitting) and has the partition ``hydra.launcher.partition``, if
    one is given; else a sweep would make its folder and then fail every cell at submission."""
    if runs_here(cfg):
        return
    import shutil
    import subprocess

    sinfo = shutil.which("sinfo")
    if sinfo is None:
        raise ConfigError("hydra/launcher=submitit_slurm: SLURM's commands (sbatch, sinfo) are not on PATH; run the "
                          "sweep from a machine of the cluster (a login node)")
    try:
        proc = subprocess.run([sinfo, "-h", "-o", "%P"], capture_output=True, text=True, timeout=SLURM_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"hydra/launcher=submitit_slurm: the SLURM cluster did not answer (sinfo) within "
                          f"{SLURM_TIMEOUT} s") from None
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        raise ConfigError(f"hydra/launcher=submitit_slurm: the SLURM cluster does not answer (sinfo: {why})")
    partitions = [p.strip().rstrip("*") for p in proc.stdout.split()]
    wanted = (cfg.hydra.get("launcher") or {}).get("partition")
    if wanted and str(wanted) not in partitions:
        raise ConfigError(f"hydra.launcher.partition = {str(wanted)!r} is not a partition of this cluster; "
                          f"partitions: {partitions}")


def jobs(cfg: DictConfig) -> int:
    """Cells that run at once on this machine: joblib's ``n_jobs`` (-1: every core, -k: all but
    k - 1), else 1 (the basic launcher runs one after another; submitit's jobs run elsewhere)."""
    launcher = (cfg.hydra.get("launcher") or {}) if "hydra" in cfg else {}
    if "joblib" not in str(launcher.get("_target_", "")) or launcher.get("n_jobs") is None:
        return 1
    n = launcher.get("n_jobs")
    if isinstance(n, bool) or not isinstance(n, int) or n == 0:
        raise ConfigError(f"hydra.launcher.n_jobs must be a non-zero integer (k: k cells at once; -1: one per core), "
                          f"got {n!r}")
    return max(1, (os.cpu_count() or 1) + 1 + n) if n < 0 else max(1, n)


def memory(cfg: DictConfig, need: Memory | None, concurrent: int = 1) -> None:
    """Refuse a cell whose tensors (``need``, the task's estimate), times the cells that run at
    once (``concurrent``), exceed the memory available."""
    if need is None:
        return
    on_gpu = need.device.startswith("cuda")
    available = device.free_memory(torch.device(need.device)) if on_gpu else available_memory()
    if available is None:
        return
    available += need.held  # what this process holds that the cell reuses or frees first
    total = need.total * concurrent
    if total <= available:
        return
    parts = ", ".join(f"{name} {_size(size)}" for name, size in need.parts.items())
    at_once = f" x {concurrent} cells at once (hydra.launcher.n_jobs)" if concurrent > 1 else ""
    advice = need.advice + (" or hydra.launcher.n_jobs" if concurrent > 1 else "")
    raise ConfigError(
        f"{need.key} = {need.value!r}: the cell's tensors need about {_size(need.total)} of memory ({parts}){at_once} "
        f"and {_size(available)} are {'free on ' + need.device if on_gpu else 'available'}; {advice}"
    )


# --- a single run, before Hydra creates its folder ------------------------------------------

class PreflightCallback(Callback):
    """Hydra callback: checks a single run's config and environment before Hydra creates the run
    folder and writes into it, and a sweep's folder and store before the sweeper creates the folder
    (the validating sweeper then checks every cell, values and memory, before any job starts)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _exit_on_error(lambda: check(config, str(config.hydra.run.dir), "hydra.run.dir", remember=True))

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        def environment() -> None:
            folder(str(config.hydra.sweep.dir), "hydra.sweep.dir")
            report_dir(config)
            tracking_store(config)
            cluster(config)

        _exit_on_error(environment)


def forget_run_folder() -> None:
    """Remove the folder Hydra made for this single run, refused after Hydra made it (an entry
    point's own keys, such as the audit's, checked once its task is known) or stopped by a full disk
    before it wrote anything (pipeline.__main__), if it holds nothing but
    Hydra's own files (``.hydra/`` and the job's log), with the parents Hydra made for it up to the
    working folder: a refusal leaves no folder. The callback above refuses the rest before the folder
    exists."""
    import shutil

    from hydra.core.hydra_config import HydraConfig

    try:
        hc = HydraConfig.get()
    except ValueError:  # called outside Hydra (tests)
        return
    folder = Path(hc.runtime.output_dir)
    own = {".hydra", f"{hc.job.name}.log", ".run.lock"}  # the lock: this process's own (tracking._hold_run_folder)
    if folder.is_dir() and {p.name for p in folder.iterdir()} <= own:
        logging.shutdown()
        shutil.rmtree(folder, ignore_errors=True)
        cwd = Path.cwd().resolve()
        for parent in folder.resolve().parents:  # the parents it made (outputs/audit/), up to the working folder
            if parent == cwd or cwd not in parent.parents:
                break
            try:
                parent.rmdir()  # only if empty
            except OSError:
                break


def _exit_on_error(step) -> None:
    """Hydra turns a callback's exception into a warning (and then creates the folder): a refusal,
    or a check that failed, exits here with one line, before the folder exists."""
    try:
        step()
    except Exception as err:  # noqa: BLE001 -- see refusal
        print(f"error: {refusal(err)}", file=sys.stderr)
        sys.exit(2)
