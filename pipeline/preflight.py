"""Checks of the environment a cell will run in, before anything is computed or logged.

``config.validate`` checks the values of a config; this module checks what the values point
at: that the output folder can be written, that the MLflow store can be reached (a server
answers within ``mlflow.connect_timeout`` seconds) and written (a local store's database and
artifact folders), and that the cell's tensors fit in the memory that is available (an
estimate from the shapes, against MemAvailable and any cgroup limit). Each refusal is a
``ConfigError`` naming the key, which the entry point prints as one ``error:`` line (exit 2).

Called at the top of ``pipeline.cell.run``, by the validating sweeper for every cell of a sweep
before any job starts, and by ``PreflightCallback`` before Hydra creates a single run's folder.
"""

from __future__ import annotations

import os
import socket
import sqlite3
import sys
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from pipeline.config import ConfigError, Constants

_PORTS = {"http": 80, "https": 443, "postgresql": 5432, "mysql": 3306, "mssql": 1433}


def check(cfg: DictConfig, const: Constants | None, output: str | Path | None = None, key: str | None = None) -> None:
    """Every environment check for one cell; ``output`` (named ``key``) is its output folder
    (default: the Hydra job's, or the working directory outside Hydra). ``const`` None (a task
    with no memory model, DPFormer's): the memory check is skipped."""
    if output is None:
        output, key = _job_output()
    folder(output, key or "output folder")
    tracking_store(cfg)
    if const is not None:
        memory(cfg, const)


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

def _unwritable(path: str | Path) -> str | None:
    """None when a file can be created in ``path`` or, if it does not exist yet, in its nearest
    existing ancestor (where it will be created); else why not. Tries for real: permission bits
    say nothing to root, nor about read-only or immutable file systems."""
    target = Path(path).expanduser().absolute()
    while not target.exists() and target != target.parent:
        target = target.parent
    if not target.is_dir():
        return f"{str(target)!r} is not a folder"
    try:
        fd, name = tempfile.mkstemp(prefix=".preflight-", dir=target)
        os.close(fd)
        os.unlink(name)
    except OSError as err:
        return f"nothing can be written in {str(target)!r} ({err.strerror or err})"
    return None


def folder(path: str | Path, key: str) -> None:
    why = _unwritable(path)
    if why:
        raise ConfigError(f"{key} = {str(path)!r} cannot be written: {why}")


# --- the MLflow store ----------------------------------------------------------------------

def tracking_uri(cfg: DictConfig) -> tuple[str, str]:
    """The store's URI and where it comes from (the config, the environment or MLflow's default)."""
    if cfg.mlflow.tracking_uri:
        return str(cfg.mlflow.tracking_uri), "mlflow.tracking_uri"
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"], "mlflow.tracking_uri (from MLFLOW_TRACKING_URI)"
    import mlflow

    return mlflow.get_tracking_uri(), "mlflow.tracking_uri (MLflow's default)"


def tracking_store(cfg: DictConfig) -> None:
    uri, key = tracking_uri(cfg)
    parsed = urlparse(uri)
    scheme = parsed.scheme.lower()
    if scheme == "sqlite":
        _sqlite_store(uri, key, cfg)
    elif scheme in ("", "file") or (len(scheme) == 1 and sys.platform == "win32"):  # a local folder
        path = unquote(parsed.path) if scheme == "file" else uri
        why = _unwritable(path)
        if why:
            raise ConfigError(f"{key} = {uri!r}: the MLflow store cannot be written: {why}")
    elif scheme.split("+")[0] in _PORTS and parsed.hostname:
        port = parsed.port or _PORTS[scheme.split("+")[0]]
        timeout = float(cfg.mlflow.connect_timeout)
        try:
            socket.create_connection((parsed.hostname, port), timeout=timeout).close()
        except OSError as err:
            raise ConfigError(f"{key} = {uri!r}: the tracking server {parsed.hostname}:{port} cannot be reached "
                              f"({err.strerror or err or 'timed out'}; waited at most {timeout:g} s)") from None


def _sqlite_store(uri: str, key: str, cfg: DictConfig) -> None:
    """The database file (and its folder, for sqlite's journal) can be written, and so can the
    artifact folder of the configured experiment (or ./mlruns, where a new one would go)."""
    path = uri[len("sqlite://"):].split("?")[0]
    if path in ("", "/", "/:memory:"):
        return
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
            db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
            try:
                row = db.execute("SELECT artifact_location FROM experiments WHERE name = ?",
                                 (str(cfg.mlflow.experiment),)).fetchone()
            finally:
                db.close()
        except sqlite3.OperationalError:  # a fresh store without tables yet
            row = None
        except sqlite3.DatabaseError as err:
            raise ConfigError(f"{key} = {uri!r}: {str(path)!r} is not an MLflow database ({err})") from None
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


def memory_needed(cfg: DictConfig, const: Constants) -> dict[str, int]:
    """An estimate, in bytes, of the cell's largest tensors: ``prompts`` (features of every trial:
    raw, clipped and private training views, test prompts, and an attack's copies), ``chunk``
    (the largest temporary of one chunk of trials in any estimator) and ``fits`` (the estimates)."""
    from pipeline.methods import ESTIMATORS, ridge
    from pipeline.methods.noisyhead import horizons

    item = 8 if cfg.compute.dtype == "float64" else 4
    B, N, L, D = int(cfg.trials), const.N, const.L, const.D
    n_test = int(cfg.dataset.n_test)
    chunk = min(int(cfg.compute.chunk_trials), B)
    per_prompt = (2 * D + 1) * item  # q, v, y
    prompts = B * (2 * N * per_prompt + N * D * item + n_test * per_prompt)
    attacked = cfg.attack.name != "none"
    if attacked:
        prompts += B * 2 * N * per_prompt
    d = D * D
    work = [chunk * N * d * item]  # vec(Z) of a chunk: the gram, the direct solves
    if not ridge._primal_cost(N, D) <= ridge._dual_cost(N, D):
        work.append(chunk * N * N * item)  # the dual system
    else:
        work.append(2 * chunk * d * d * item)  # the gram and the normal equations
    fits = 0
    for spec in cfg.method.values():
        module = ESTIMATORS[spec.estimator]
        Ts = horizons(spec, const, cfg) if spec.estimator == "noisyhead" else const.T
        if spec.estimator == "noisyhead":
            work.append(chunk * max(Ts) * d * (4 + item))  # the standard normals of every step
        if spec.estimator == "dpsgd":
            work.append(chunk * max(Ts) * (N + d) * (4 + item))  # the Poisson batches and the noise
        if spec.estimator == "ssp":
            work.append(chunk * d * d * (4 + 3 * item))  # W, sym(W), the noisy system
        horizons_out = len(Ts) if spec.estimator in ("noisyhead", "gd", "dpsgd") else 1
        fits += B * horizons_out * d * item * (3 if attacked and module.PRIVATE else 2 if attacked else 1)
    return {"prompts": prompts, "chunk": max(work), "fits": fits}


def _size(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n / 1e3:.3g} kB"


def memory(cfg: DictConfig, const: Constants) -> None:
    available = available_memory()
    if available is None:
        return
    need = memory_needed(cfg, const)
    total = sum(need.values())
    if total <= available:
        return
    if need["chunk"] > need["prompts"] + need["fits"]:
        key, value, advice = "compute.chunk_trials", cfg.compute.chunk_trials, "lower compute.chunk_trials"
    elif const.N >= int(cfg.trials):
        key, value, advice = "regime.N", const.N, f"lower regime.N or trials (= {cfg.trials})"
    else:
        key, value, advice = "trials", cfg.trials, f"lower trials or regime.N (= {const.N})"
    raise ConfigError(
        f"{key} = {value!r}: the cell's tensors need about {_size(total)} of memory (prompts {_size(need['prompts'])}, "
        f"largest chunk temporary {_size(need['chunk'])}, estimates {_size(need['fits'])}) and "
        f"{_size(available)} are available; {advice}"
    )


# --- a single run, before Hydra creates its folder ------------------------------------------

class PreflightCallback(Callback):
    """Hydra callback: checks a single run's config and environment before Hydra creates the run
    folder and writes into it, and a sweep's folder and store before the sweeper creates the folder
    (the validating sweeper then checks every cell, values and memory, before any job starts)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        from pipeline.tasks import validate

        _exit_on_error(lambda: check(config, validate(config), Path(str(config.hydra.run.dir)), "hydra.run.dir"))

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        def environment() -> None:
            folder(str(config.hydra.sweep.dir), "hydra.sweep.dir")
            tracking_store(config)

        _exit_on_error(environment)


def _exit_on_error(step) -> None:
    """Hydra turns a callback's exception into a warning: a refusal exits here, with one line."""
    try:
        step()
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
