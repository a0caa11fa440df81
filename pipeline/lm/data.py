"""The posts of 20 Newsgroups ("bydate" tarball) for language modelling: one post, one example.

The privacy unit is one post (an author who wrote several posts is several units; say so where a
guarantee is quoted). Each post is cleaned before anything reads it (``clean``, on by default):

- **headers** (everything up to the first blank line: From, Organization, e-mail addresses) are
  removed;
- **quoted replies** are removed: lines that start with ``>``, ``|>`` or ``:`` and the attribution
  line above them ("In article <...> x@y (Name) writes:", "... wrote:"), which hold other people's
  text and addresses;
- **signatures** are removed: everything after the last line that is ``--`` (with or without its
  trailing space) when what follows is short (at most ``SIGNATURE_LINES`` lines), as signatures hold
  names, addresses and phone numbers;
- **e-mail addresses** left in the body (signatures without a ``--`` line, boxes of asterisks) are
  replaced by ``<email>`` (about 29% of the cleaned training posts still held one).

What is left can still name people (a post may sign with a name in its body): cleaning is a
courtesy to the people in the corpus, not a privacy mechanism; the guarantee is DP-SGD's and the
vocabulary's (``vocab.py``). The train split is divided into training and validation posts by a
seeded permutation (``split``); the test split is the test set.
"""

from __future__ import annotations

import functools
import os
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline import validation

SPLITS = ("train", "test")
SIGNATURE_LINES = 10  # a block after the last "--" line of at most this many lines is a signature
_ATTRIBUTION = re.compile(r"(writes|wrote|says|said)\s*:\s*$|^\s*in (article|message|<)\b", re.IGNORECASE)
_QUOTE = re.compile(r"^\s*(>|\|>|:|\|\s)")
_EMAIL = re.compile(r"[\w.+-]+@[\w-]+(\.[\w-]+)+")


REPO_ROOT = Path(__file__).resolve().parents[2]


def resolve(path: str | Path) -> Path:
    """A data path: absolute, or relative to the directory the command was started in, else to the
    repository root (the presets' ``../shared/data/...`` from anywhere in the checkout)."""
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists():
        return p
    return REPO_ROOT / p if (REPO_ROOT / p).exists() else p


class DataError(ValueError):
    """The corpus cannot be read; the message names the key and says why."""


@dataclass
class Posts:
    train: list[str]
    valid: list[str]
    test: list[str]


def strip_headers(text: str) -> str:
    _, blank, body = text.partition("\n\n")
    return body if blank else ""  # no blank line: the whole text is a header block


def strip_quotes(text: str) -> str:
    lines = text.split("\n")
    kept = [line for line in lines if not _QUOTE.match(line) and not _ATTRIBUTION.search(line)]
    return "\n".join(kept)


def strip_signature(text: str) -> str:
    lines = text.rstrip("\n").split("\n")
    marks = [i for i, line in enumerate(lines) if line.rstrip() == "--"]
    if marks and len(lines) - marks[-1] - 1 <= SIGNATURE_LINES:
        lines = lines[: marks[-1]]
    return "\n".join(lines)


def clean(text: str) -> str:
    """Headers, quoted replies and the signature removed, addresses masked; runs of blank lines
    collapsed; stripped."""
    body = _EMAIL.sub("<email>", strip_signature(strip_quotes(strip_headers(text))))
    return re.sub(r"\n\s*\n+", "\n\n", body).strip()


def read(path: str | Path, *, key: str = "dataset.archive", cleaned: bool = True) -> dict[str, list[str]]:
    """split -> the posts of the bydate tarball at ``path``, in the tarball's order, cleaned (empty
    posts dropped). DataError naming ``key`` if the file is missing, damaged or has no posts of a
    split."""
    path = Path(path)
    if (why := validation.not_a_file(path)) is not None:
        raise DataError(f"{key}: no such file {str(path)!r}" if why == "no such file" else f"{key}: {str(path)!r} is {why}")
    out: dict[str, list[str]] = {s: [] for s in SPLITS}
    try:
        with tarfile.open(path, "r:gz") as tar:
            for member in tar:
                parts = member.name.split("/")
                split = parts[0].removeprefix("20news-bydate-")
                if member.isfile() and len(parts) == 3 and split in out:
                    text = tar.extractfile(member).read().decode("latin-1")
                    text = clean(text) if cleaned else text
                    if text:
                        out[split].append(text)
    except (tarfile.TarError, OSError, EOFError) as err:
        raise DataError(f"{key}: {str(path)!r} is not a readable 20news-bydate tarball ({err})") from err
    empty = [s for s in SPLITS if not out[s]]
    if empty:
        raise DataError(f"{key}: {str(path)!r} holds no 20news-bydate-{empty[0]} posts")
    return out


def read_cached(path: str) -> dict[str, list[str]]:
    """``read`` once per process and archive (a sweep's validation reads it once for all cells); an
    archive replaced in place (another size or time) is read again."""
    st = os.stat(path)
    return _read_once(path, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _read_once(path: str, size: int, mtime_ns: int) -> dict[str, list[str]]:
    return read(path)


def split(corpus: dict[str, list[str]], *, valid_fraction: float, seed: int) -> Posts:
    """Training and validation posts from the train split (a permutation seeded by ``seed``:
    validation gets round(valid_fraction * n) posts), the test split as it is."""
    if not 0 < valid_fraction < 1:
        raise DataError(f"dataset.valid_fraction must lie in (0, 1), got {valid_fraction!r}")
    posts = corpus["train"]
    order = np.random.default_rng(seed).permutation(len(posts))
    n_valid = int(round(valid_fraction * len(posts)))
    if not 0 < n_valid < len(posts):
        raise DataError(f"dataset.valid_fraction = {valid_fraction!r} leaves no training or no validation post "
                        f"of {len(posts)}")
    return Posts(train=[posts[i] for i in order[n_valid:]], valid=[posts[i] for i in order[:n_valid]],
                 test=list(corpus["test"]))
