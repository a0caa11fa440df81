"""A run's checkpoint file, for any task: written atomically at the end of each epoch into the run
folder, headed by a SHA-256 digest of its bytes (a damaged, truncated or foreign file is never
resumed from), matched against a key (the config's digest, the code's, the data's, the device
kind) before it is. What the state holds is the task's (its model, optimizer, schedule,
generators, history, accountant); this module only keeps it safe. The language model's training
(``pipeline/lm/train.py``), DPFormer's (``pipeline/seqrec/checkpoint.py``) and the public DP-SGD
trainer (``pipeline.dpsgd.DPSGD``) use it; the state they save is ``pipeline.dpsgd.Trainer.state_dict``'s.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
from functools import lru_cache
from pathlib import Path

NAME = "checkpoint.pt"
MAGIC = b"pipeline-checkpoint sha256 "  # then 64 hex digits and a newline, then torch.save's bytes
log = logging.getLogger(__name__)


@lru_cache(maxsize=1)
def code_hash() -> str:
    """A digest of the pipeline's source (every ``pipeline/**/*.py``): a checkpoint of other code is not resumed."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def tensors_hash(*tensors) -> str:
    """A digest of tensors' shapes and bytes (the data a run trains and evaluates on)."""
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(str(tuple(t.shape)).encode() + str(t.dtype).encode())
        digest.update(t.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def save(path: Path, state: dict) -> None:
    """Write ``state`` (``torch.save``-able) atomically: a kill during the write leaves the previous
    checkpoint, a full disk leaves no temporary file."""
    import torch

    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    tmp = Path(path).with_suffix(f".{os.getpid()}.tmp")  # one per process: two writers never share it
    try:
        with open(tmp, "wb") as handle:
            handle.write(MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read(path: Path) -> bytes:
    """The torch.save bytes at ``path``, checked against the digest heading them (ValueError if they differ)."""
    raw = Path(path).read_bytes()
    head, payload = raw[:len(MAGIC) + 65], raw[len(MAGIC) + 65:]
    if not head.startswith(MAGIC) or head[len(MAGIC):-1] != hashlib.sha256(payload).hexdigest().encode():
        raise ValueError("its bytes do not match the digest written with them (damaged, truncated or not a checkpoint)")
    return payload


def load(path: Path | None, key: dict, *, strict: bool = False) -> dict | None:
    """The state at ``path`` if its ``key`` equals ``key``, else None (with a log line saying why, that the
    run starts over); ``strict``: a ValueError saying why instead (a resume that was asked for)."""
    import torch

    def refuse(why: str, *args) -> None:
        if strict:
            raise ValueError(why % args)
        log.warning(f"resume: {why}; starting over", *args)

    if path is None or not Path(path).is_file():
        if strict:
            refuse("%s does not exist", path)
        return None
    try:
        state = torch.load(io.BytesIO(read(path)), map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - a damaged checkpoint is not resumed from
        refuse("%s cannot be read (%s)", path, err)
        return None
    found = state.get("key") if isinstance(state, dict) else None
    if found != key:
        differs = [k for k in key if not isinstance(found, dict) or found.get(k) != key[k]]
        refuse("%s is of another %s", path, " and ".join(differs) or "kind")
        return None
    return state


def remove(path: Path | None) -> None:
    if path is not None:
        Path(path).unlink(missing_ok=True)
