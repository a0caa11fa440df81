"""A DPFormer run's checkpoint: everything its next epoch depends on, saved at the end of each epoch
into the run folder (``checkpoint.pt``, ``seqrec.checkpoint``), so that a re-launched run continues
where the last one stopped and ends with the numbers an uninterrupted run gives.

Saved (``pipeline.dpsgd.Trainer.state_dict``): the model's and the optimizer's state, the
learning-rate schedule's, the run's device generator (Poisson sampling and DP-SGD's noise) and
torch's global generators (dropout: the CPU's, and the run's CUDA device's), the steps taken, the
last finished epoch and the history so far, and the accountant's state (its history of (noise multiplier, sampling rate, steps), all it needs to say what the steps
so far spent). A checkpoint is resumed from only by a run of the same config
(``tracking.config_hash``), the same code (``code_hash``: every source file of ``pipeline/``), the
same data (``data_hash``: the built data set's every tensor, so a data file changed between the
kill and the re-launch starts over) and the same device kind, and only if its bytes are those
written (a SHA-256 digest heads the file: a damaged checkpoint starts over): a single run
re-launched into its folder (``hydra.run.dir=<the folder>``), or a cell of a sweep resumed with
``hydra.sweeper.resume=true``. Anything else starts over, with a
log line saying why; a sweep launched without resume (every DVC stage) starts each cell over. The
file is removed once the run has FINISHED. The file itself (atomic, headed by its digest) is the
shared ``pipeline.checkpoints``.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict
from pathlib import Path

import torch

from pipeline.checkpoints import NAME, code_hash, load, read, remove  # noqa: F401 - the shared file format
from pipeline.checkpoints import save as write


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


def save(path: Path, *, key: dict, epoch: int, trainer, history) -> None:
    """Write the checkpoint atomically (a kill during the write leaves the previous one): the
    trainer's state (``pipeline.dpsgd.Trainer.state_dict``: model, optimizer, schedule, generators,
    steps, accountant, an audited run's canaries), the last finished epoch and the history."""
    write(path, {"key": key, "epoch": epoch, "history": asdict(history), "dpsgd": trainer.state_dict()})
