"""The sweep's side of submitit jobs (``hydra/launcher=submitit_slurm`` or ``submitit_local``).

Hydra's submitit launcher ends ``launch`` with ``[j.results()[0] for j in jobs]``: the first job
that SLURM cancels, times out or kills (no result file, so submitit raises
``UncompletedJobError``) stops the list, and the sweep would summarise while the other cells still
run, counting them as failed. Two helpers fix what the sweep needs:

- ``every_job_awaited()``: while the sweep launches, a job's ``results()`` waits for that job and
  turns its failure into a FAILED ``JobReturn`` of its cell, so the launcher goes on to await
  every other job. A job that vanished from the cluster (in SLURM 22.05 an array task cancelled
  while PENDING leaves no ``sacct`` record, so submitit would wait forever) is failed once neither
  ``sacct`` nor ``squeue`` has known it for ``VANISHED_S`` seconds.
- ``cancel_earlier_jobs(folder)``: the SLURM jobs of an earlier launch into the same submitit
  folder that are still queued or running (their submitting process was killed) are cancelled
  before a new launch, so a resumed sweep does not run a cell twice into one folder. Cancelled
  cells are re-run by the new launch unless they FINISHED (``hydra.sweeper.resume=true``).
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Iterator, List

log = logging.getLogger(__name__)

VANISHED_S = 90.0  # a job neither sacct nor squeue knows for this long is failed (cancelled while pending)
POLL_S = 1.0       # how often a job's result file is looked for (its state: submitit's own schedule)


def _queued(job_ids: List[str]) -> set[str]:
    """The ids among ``job_ids`` (``123`` or ``123_4``) that squeue still lists (pending or running)."""
    if not job_ids or shutil.which("squeue") is None:
        return set()
    try:
        out = subprocess.run(["squeue", "-h", "-r", "-o", "%i", "-j", ",".join(sorted({j.split("_")[0] for j in job_ids}))],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return set()
    listed = set(out.stdout.split())
    return {j for j in job_ids if j in listed}


def _failed(job, error: BaseException):
    """A FAILED JobReturn of the job's cell (its overrides read from the job's submission)."""
    from hydra.core.utils import JobReturn, JobStatus

    try:
        overrides = list(job.submission().args[0])
    except Exception:  # the submission pickle is unreadable: the cell is named by its job id
        overrides = [f"job {job.job_id}"]
    return JobReturn(overrides=overrides, status=JobStatus.FAILED, _return_value=error)


def _await(job, original):
    """``job.results()`` that never raises for a job that ended without its result."""
    from submitit.core.utils import FailedJobError, UncompletedJobError

    unknown_since = None
    while not job.done():
        if job.state.upper() == "UNKNOWN" and job.job_id and not _queued([job.job_id]) \
                and shutil.which("squeue") is not None:
            unknown_since = unknown_since or time.monotonic()
            if time.monotonic() - unknown_since > VANISHED_S:
                return [_failed(job, UncompletedJobError(
                    f"job {job.job_id} left the queue without a result or an accounting record "
                    f"(cancelled while pending?)"))]
        else:
            unknown_since = None
        time.sleep(POLL_S)
    try:
        return original(job)
    except (UncompletedJobError, FailedJobError) as err:
        log.error("job %s (%s) ended without its result: %s", job.job_id, job.state, str(err).splitlines()[0])
        return [_failed(job, err)]


@contextlib.contextmanager
def every_job_awaited() -> Iterator[None]:
    """Within the block, every submitit job's ``results()`` awaits that job and returns a FAILED
    JobReturn where the job ended without a result (see the module docstring)."""
    try:
        from submitit.core.core import Job
    except ImportError:  # no submitit: nothing to patch
        yield
        return
    original = Job.results
    Job.results = lambda job: _await(job, original)
    try:
        yield
    finally:
        Job.results = original


def cancel_earlier_jobs(folder: Path) -> List[str]:
    """Cancel the SLURM jobs recorded in the submitit ``folder`` (one sub-folder per job, named by
    its id: ``123_4``) that are still queued or running, and wait (at most a minute) until squeue
    no longer lists them. Returns their ids."""
    folder = Path(folder)
    if not folder.is_dir() or shutil.which("scancel") is None:
        return []
    ids = [p.name for p in folder.iterdir() if p.is_dir() and re.fullmatch(r"\d+(_\d+)?", p.name)]
    alive = sorted(_queued(ids))
    if not alive:
        return []
    subprocess.run(["scancel", *alive], capture_output=True, text=True, timeout=60)
    deadline = time.monotonic() + 60
    while _queued(alive) and time.monotonic() < deadline:
        time.sleep(1)
    return alive
