"""A pretrained language model as a file (issue 65: public pretraining, DP fine-tuning): the weights
of a GPT-2 trained on the public groups (a cell with ``model.save`` writes it at its end), the
tokenizer it used and the settings a fine-tuning must share with it. A cell with ``model.init``
starts from it; a file that is missing, damaged or of other settings is refused by the config's
validation, one ``error:`` line naming the key and both values, before any folder or run.

The file is ``pipeline.checkpoints``' format (torch.save's bytes headed by their SHA-256, written
atomically: a damaged or truncated file is refused), one per vocabulary and tying, named
``<vocab.kind>-<tied|untied>.pt`` in the ``model.save`` folder. ``model.init`` names that folder
(the cell's own vocabulary and tying choose the file: a sweep over ``model.tied`` and ``vocab``
fine-tunes each from its own) or one file.

What must match (``MATCH``): the shape (``model.d``, ``model.layers``, ``model.heads``,
``dataset.L``: the position table has L rows), the tying, the vocabulary (kind and target size;
for ``private_groups`` its budget and ``max_pieces`` too, since the fine-tuning's accounting takes
that budget off its own), the group assignment (the fine-tuning's private side must be exactly the
groups the model never read) and the corpus (the archive's SHA-256).
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
from pathlib import Path

from pipeline import checkpoints
from pipeline.validation import ConfigError

FORMAT = "pipeline.lm.pretrained/1"
MATCH = (  # (the cell's key, the saved setting): each must be equal
    ("model.tied", "tied"), ("model.d", "d"), ("model.layers", "layers"), ("model.heads", "heads"),
    ("dataset.L", "L"), ("vocab.kind", "vocab_kind"), ("vocab.size", "vocab_size"),
    ("dataset.public_groups", "public_groups"), ("vocab.eps", "vocab_eps"), ("vocab.delta", "vocab_delta"),
    ("vocab.max_pieces", "max_pieces"), ("dataset.archive", "archive_sha256"))


def name(vocab_kind: str, tied: bool) -> str:
    """The file a pretraining of this vocabulary and tying writes into its ``model.save`` folder."""
    return f"{vocab_kind}-{'tied' if tied else 'untied'}.pt"


def path_of(s) -> Path:
    """The file ``model.init`` names for the cell's settings ``s``: the folder's file of the cell's
    vocabulary and tying, or the file itself."""
    from pipeline.lm import data

    where = data.resolve(s.init)
    return where / name(s.vocab_kind, s.tied) if where.is_dir() else where


def archive_sha256(path: str | Path) -> str:
    """The archive's SHA-256 (once per process and file: a file replaced in place is read again)."""
    st = os.stat(path)
    return _digest(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _digest(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def settings_of(s) -> dict:
    """What a fine-tuning must share with the model (``MATCH``'s right column), from settings ``s``;
    a public vocabulary's budget and contribution are not its (0 and None)."""
    from pipeline.lm import data

    private = s.vocab_kind == "private_groups"
    return {"tied": bool(s.tied), "d": s.d, "layers": s.layers, "heads": s.heads, "L": s.L, "vocab_kind": s.vocab_kind,
            "vocab_size": s.vocab_size, "public_groups": sorted(s.public_groups or ()),
            "vocab_eps": float(s.vocab_eps) if private else 0.0, "vocab_delta": float(s.vocab_delta) if private else 0.0,
            "max_pieces": s.max_pieces if private else None,
            "archive_sha256": archive_sha256(data.resolve(s.archive))}


def save(folder: str | Path, model, tokenizer, s, stats: dict) -> Path:
    """Write the trained ``model`` (its weights on the CPU), its ``tokenizer`` and ``settings_of(s)``
    to ``folder / name(...)``; ``stats`` (the pretraining's posts, steps, perplexities) ride along."""
    from pipeline.lm import data

    folder = data.resolve(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name(s.vocab_kind, s.tied)
    weights = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    checkpoints.save(path, {"format": FORMAT, "settings": settings_of(s), "tokenizer": tokenizer.to_str(),
                            "V": int(tokenizer.get_vocab_size()), "state_dict": weights, "stats": dict(stats)})
    return path


def read(path: str | Path) -> dict:
    """The saved model at ``path`` (once per process and file); ValueError saying why it cannot be read."""
    st = os.stat(path)
    return _read(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read(path: str, size: int, mtime_ns: int) -> dict:
    import torch

    found = torch.load(io.BytesIO(checkpoints.read(Path(path))), map_location="cpu", weights_only=True)
    if not isinstance(found, dict) or found.get("format") != FORMAT:
        raise ValueError(f"it is not a pretrained model of this task (format {FORMAT!r})")
    return found


def check(s) -> None:
    """ConfigError (one line naming the key and both values) where ``model.init`` is missing,
    unreadable, or saved with other settings than the cell's ``s``."""
    from pipeline import validation

    path = path_of(s)
    if (why := validation.not_a_file(path)) is not None:
        raise ConfigError(f"model.init = {s.init!r}: {str(path)!r} is {why} (a pretraining with model.save writes "
                          f"{name(s.vocab_kind, s.tied)} for vocab.kind = {s.vocab_kind!r} and model.tied = {s.tied})"
                          if why != "no such file" else
                          f"model.init = {s.init!r}: no such file {str(path)!r} (a pretraining with model.save writes "
                          f"it: dvc repro lm_pretrain)")
    try:
        found = read(path)
    except Exception as err:  # noqa: BLE001 - any unreadable file is one refusal
        raise ConfigError(f"model.init = {s.init!r}: {str(path)!r} cannot be read as a pretrained model ({err})") from None
    theirs, mine = found["settings"], settings_of(s)
    for key, field in MATCH:
        if theirs.get(field) != mine[field]:
            raise ConfigError(f"{key} = {_shown(key, mine[field], s)} does not match the pretrained model "
                              f"{str(path)!r} ({key} = {_shown(key, theirs.get(field), s)}): fine-tune it with the "
                              f"settings it was pretrained with")


def _shown(key: str, value, s):
    if key == "dataset.archive":  # the path is the cell's; the digest is what differs
        return f"{s.archive!r} of SHA-256 {str(value)[:12]}..." if value == settings_of(s)["archive_sha256"] else \
            f"an archive of SHA-256 {str(value)[:12]}..."
    return repr(value)


def tokenizer(found: dict):
    """The saved tokenizer."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(found["tokenizer"])


def load_into(model, found: dict) -> None:
    """The saved weights into ``model`` (built with the saved shape and tying: every key must fit)."""
    model.load_state_dict(found["state_dict"])


def digest(path: str | Path) -> str:
    """The file's digest (a fine-tuning's checkpoint is resumed only from the same pretrained model)."""
    raw = Path(path).read_bytes()
    return raw[len(checkpoints.MAGIC): len(checkpoints.MAGIC) + 16].decode()
