"""A DPFormer run's checkpoint: everything its next epoch depends on, saved at the end of each epoch
into the run folder (``checkpoint.pt``, ``seqrec.checkpoint``), so that a re-launched run continues
where the last one stopped and ends with the numbers an uninterrupted run gives.

Saved: the model's and the optimizer's state, the learning-rate schedule's, the run's device
generator (Poisson sampling and DP-SGD's noise) and torch's global generators (dropout: the CPU's,
and the run's CUDA device's), the last finished epoch and the history so far, and the accountant's
state (its history of (noise multiplier, sampling rate, steps), all it needs to say what the steps
so far spent). A checkpoint is resumed from only by a run of the same config
(``tracking.config_hash``), the same code (``code_hash``: every source file of ``pipeline/``), the
same data (``data_hash``: the built data set's every tensor, so a data file changed between the
kill and the re-launch starts over) and the same device kind, and only if its bytes are those
written (a SHA-256 digest heads the file: a damaged checkpoint starts over): a single run
re-launched into its folder (``hydra.run.dir=<the folder>``), or a cell of a sweep resumed with
``hydra.sweeper.resume=true``. Anything else starts over, with a
log line saying why; a sweep launched without resume (every DVC stage) starts each cell over. The
file is removed once the run has FINISHED.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
from dataclasses import asdict
from functools import lru_cache
from pathlib import Path

import torch

NAME = "checkpoint.pt"
log = logging.getLogger(__name__)


@lru_cache(maxsize=1)
def code_hash() -> str:
    """A digest of the pipeline's source (every ``pipeline/**/*.py``): a checkpoint of other code is not resumed."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def data_hash(seqs) -> str:
    """A digest of the data set a run trains and evaluates on (every tensor of ``Sequences``)."""
    digest = hashlib.sha256(str(seqs.n_items).encode())
    for name, value in sorted(vars(seqs).items()):
        if isinstance(value, torch.Tensor):
            digest.update(name.encode() + b"\0" + str(tuple(value.shape)).encode())
            digest.update(value.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def key(config_digest: str, device: torch.device, seqs=None) -> dict:
    """What a checkpoint must match to be resumed from (``seqs``: the data set, when known)."""
    found = {"config_hash": config_digest, "code_hash": code_hash(), "device": torch.device(device).type}
    if seqs is not None:
        found["data_hash"] = data_hash(seqs)
    return found


MAGIC = b"pipeline-checkpoint sha256 "  # then 64 hex digits and a newline, then torch.save's bytes


def save(path: Path, *, key: dict, epoch: int, model, opt, sched, gen: torch.Generator, history,
         accountant: dict, canaries: dict | None = None) -> None:
    """Write the checkpoint atomically (a kill during the write leaves the previous one); an audited
    run's canaries' state (``DiracCanaries.state``) with it."""
    device = gen.device
    state = {
        "key": key, "epoch": epoch, "model": model.state_dict(), "optimizer": opt.state_dict(),
        "schedule": sched.state_dict(), "generator": gen.get_state(), "cpu_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "history": asdict(history), "accountant": accountant,
    }
    if canaries is not None:
        state["canaries"] = canaries
    write(path, state)


def write(path: Path, state: dict) -> None:
    """``state`` to ``path`` atomically, headed by its digest (``read`` checks it)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    tmp = Path(path).with_suffix(f".{os.getpid()}.tmp")  # one per process: two writers never share it
    try:
        with open(tmp, "wb") as handle:
            handle.write(MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
        os.replace(tmp, path)
    except BaseException:  # a full disk, Ctrl-C: no half-written temporary file is left in the run's folder
        tmp.unlink(missing_ok=True)
        raise


def load(path: Path | None, key: dict) -> dict | None:
    """The checkpoint at ``path`` if it matches ``key`` (config, code, device kind), else None."""
    if path is None or not Path(path).is_file():
        return None
    try:
        state = torch.load(io.BytesIO(read(path)), map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - a damaged checkpoint is not resumed from
        log.warning("resume: %s cannot be read (%s); starting over", path, err)
        return None
    found = state.get("key") if isinstance(state, dict) else None
    if found != key:
        differs = [k for k in key if not isinstance(found, dict) or found.get(k) != key[k]]
        log.warning("resume: %s is of another %s; starting over", path, " and ".join(differs) or "kind")
        return None
    return state


def read(path: Path) -> bytes:
    """The torch.save bytes of the checkpoint at ``path``, checked against the digest that heads
    them (ValueError if they differ: a damaged, truncated or foreign file)."""
    raw = Path(path).read_bytes()
    head, payload = raw[:len(MAGIC) + 65], raw[len(MAGIC) + 65:]
    if not head.startswith(MAGIC) or head[len(MAGIC):-1] != hashlib.sha256(payload).hexdigest().encode():
        raise ValueError("its bytes do not match the digest written with them (damaged, truncated or not a checkpoint)")
    return payload


def restore(state: dict, *, model, opt, sched, gen: torch.Generator) -> None:
    """Put the saved states back (the model and optimizer on their current device)."""
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["schedule"])
    gen.set_state(state["generator"])
    torch.set_rng_state(state["cpu_rng"])
    if state.get("cuda_rng") is not None:
        torch.cuda.set_rng_state(state["cuda_rng"], gen.device)


def remove(path: Path | None) -> None:
    if path is not None:
        Path(path).unlink(missing_ok=True)
