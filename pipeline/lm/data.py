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

**Public and private groups** (issue 65: public pretraining, DP fine-tuning). Each post's newsgroup is
its folder in the tarball (``read_groups``). ``dataset.public_groups`` assigns some of the 20 groups
(``NEWSGROUPS``) to the public side, the rest are private, so no post is on both sides; ``part``
keeps one side of both splits (``dataset.part``: ``public``, ``private``, or ``all``, every post,
the assignment unused). A side's test posts are put in round-robin order over its groups (the first
post of each group in the tarball's order of groups, then the second, ...): the tarball holds them
group by group, and a count of them (``dataset.eval_posts``) then takes an equal share of every group
(with ``all`` they stay in the tarball's order: the first 150 test posts are all of alt.atheism).

**One message, one side, one privacy unit** (``dedupe``). A message cross-posted to several groups is
in each group's folder; the bydate archive keeps no Message-ID, so a message is known by its cleaned
text, runs of white space made one (``message``). A message on the private side (in any private
group, either split) is private: its copies in public groups are removed from every public split,
so neither the pretraining nor the public vocabulary reads it; a message that occurs more than once
on the private side is one example, its first occurrence (train before test, the tarball's order)
kept. With ``part = all`` every post is private, and repeats are removed the same way. On the shared
archive with the presets' public groups: 5 public train-split and 6 public test posts removed (copies
of private messages), 13 private train-split and 2 private test repeats; with ``part = all``, 40
train-split and 30 test repeats (``tests/test_lm_data.py``; the data phase logs the counts).
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
NEWSGROUPS = ("alt.atheism", "comp.graphics", "comp.os.ms-windows.misc", "comp.sys.ibm.pc.hardware",
              "comp.sys.mac.hardware", "comp.windows.x", "misc.forsale", "rec.autos", "rec.motorcycles",
              "rec.sport.baseball", "rec.sport.hockey", "sci.crypt", "sci.electronics", "sci.med", "sci.space",
              "soc.religion.christian", "talk.politics.guns", "talk.politics.mideast", "talk.politics.misc",
              "talk.religion.misc")  # the bydate tarball's 20 folders
PARTS = ("all", "public", "private")
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


def read_groups(path: str | Path, *, key: str = "dataset.archive",
                cleaned: bool = True) -> dict[str, list[tuple[str, str]]]:
    """split -> (newsgroup, post) of every post of the bydate tarball at ``path``, in the tarball's
    order, cleaned (empty posts dropped); the newsgroup is the post's folder. DataError naming ``key``
    if the file is missing, damaged or has no posts of a split."""
    path = Path(path)
    if (why := validation.not_a_file(path)) is not None:
        raise DataError(f"{key}: no such file {str(path)!r}" if why == "no such file" else f"{key}: {str(path)!r} is {why}")
    out: dict[str, list[tuple[str, str]]] = {s: [] for s in SPLITS}
    try:
        with tarfile.open(path, "r:gz") as tar:
            for member in tar:
                parts = member.name.split("/")
                split = parts[0].removeprefix("20news-bydate-")
                if member.isfile() and len(parts) == 3 and split in out:
                    text = tar.extractfile(member).read().decode("latin-1")
                    text = clean(text) if cleaned else text
                    if text:
                        out[split].append((parts[1], text))
    except (tarfile.TarError, OSError, EOFError) as err:
        raise DataError(f"{key}: {str(path)!r} is not a readable 20news-bydate tarball ({err})") from err
    empty = [s for s in SPLITS if not out[s]]
    if empty:
        raise DataError(f"{key}: {str(path)!r} holds no 20news-bydate-{empty[0]} posts")
    return out


def read(path: str | Path, *, key: str = "dataset.archive", cleaned: bool = True) -> dict[str, list[str]]:
    """split -> the posts of the bydate tarball at ``path``, in the tarball's order, cleaned (empty
    posts dropped). DataError naming ``key`` if the file is missing, damaged or has no posts of a
    split."""
    return texts(read_groups(path, key=key, cleaned=cleaned))


def texts(corpus: dict[str, list[tuple[str, str]]]) -> dict[str, list[str]]:
    """The posts of ``read_groups``' corpus without their newsgroups."""
    return {split: [text for _, text in posts] for split, posts in corpus.items()}


def read_cached(path: str, *, public_groups: tuple[str, ...] | None = None, part: str = "all") -> dict[str, list[str]]:
    """``read`` once per process and archive (a sweep's validation reads it once for all cells); an
    archive replaced in place (another size or time) is read again. With ``part`` public or private:
    that side of the groups (``side``)."""
    return side(read_groups_cached(path), public_groups, part, deduped=lambda groups: deduped_cached(path, groups)[0])


def read_groups_cached(path: str) -> dict[str, list[tuple[str, str]]]:
    """``read_groups`` once per process and archive (as ``read_cached``)."""
    st = os.stat(path)
    return _read_once(path, st.st_size, st.st_mtime_ns)


def deduped_cached(path: str, public_groups: tuple[str, ...] | None) -> tuple[dict[str, list[tuple[str, str]]], "Removed"]:
    """``dedupe`` of the archive's posts once per process, archive and side assignment (as ``read_cached``)."""
    st = os.stat(path)
    return _dedupe_once(path, st.st_size, st.st_mtime_ns, None if public_groups is None else tuple(public_groups))


@functools.lru_cache(maxsize=4)
def _dedupe_once(path: str, size: int, mtime_ns: int, public_groups: tuple[str, ...] | None):
    return dedupe(_read_once(path, size, mtime_ns), public_groups)


@functools.lru_cache(maxsize=2)
def _read_once(path: str, size: int, mtime_ns: int) -> dict[str, list[tuple[str, str]]]:
    return read_groups(path)


def check_groups(groups, key: str = "dataset.public_groups") -> tuple[str, ...] | None:
    """The public groups as a tuple (None for null), or DataError naming ``key``: a name that is not
    one of the 20 newsgroups, a name given twice, no group, or every group (no private side)."""
    if groups is None:
        return None
    if isinstance(groups, str) or not all(isinstance(g, str) for g in groups):
        raise DataError(f"{key} must be a list of newsgroup names, got {groups!r}")
    groups = tuple(groups)
    unknown = [g for g in groups if g not in NEWSGROUPS]
    if unknown:
        raise DataError(f"{key}: {unknown[0]!r} is not one of the 20 newsgroups; known: {list(NEWSGROUPS)}")
    twice = [g for g in groups if groups.count(g) > 1]
    if twice:
        raise DataError(f"{key}: {twice[0]!r} is named twice")
    if not groups or len(groups) == len(NEWSGROUPS):
        raise DataError(f"{key} names {len(groups)} of the {len(NEWSGROUPS)} newsgroups: the public and the private "
                        f"side each need one at least")
    return groups


def side(corpus: dict[str, list[tuple[str, str]]], public_groups: tuple[str, ...] | None,
         part: str, deduped=None) -> dict[str, list[str]]:
    """The posts of one side (``part``: public, private, or all) of ``read_groups``' corpus: the
    public groups' posts, the others', or every post in the tarball's order. A side's train split
    keeps the tarball's order (``split`` permutes it), its test split is put in round-robin order
    over its groups. DataError naming the key where a public group or a side has no posts. ``deduped``:
    ``public_groups -> dedupe(corpus, public_groups)[0]`` where the caller keeps it (``read_cached``)."""
    deduped = deduped or (lambda groups: dedupe(corpus, groups)[0])
    if part not in PARTS:
        raise DataError(f"dataset.part {part!r} is unknown; known: {list(PARTS)}")
    if part == "all":
        return texts(deduped(None))
    if public_groups is None:
        raise DataError(f"dataset.part = {part!r} needs dataset.public_groups (the assignment of the groups to the "
                        f"public side), got null")
    found = {g for posts in corpus.values() for g, _ in posts}
    absent = [g for g in public_groups if g not in found]
    if absent:
        raise DataError(f"dataset.public_groups: {absent[0]!r} has no posts in the archive")
    public = set(public_groups)
    corpus = deduped(tuple(public_groups))
    out = {}
    for split, posts in corpus.items():
        kept = [(g, text) for g, text in posts if (g in public) == (part == "public")]
        if not kept:
            raise DataError(f"dataset.part = {part!r}: the {part} groups have no {split} posts in the archive")
        out[split] = [text for _, text in kept] if split == "train" else round_robin(kept)
    return out


def message(text: str) -> str:
    """A message's identity: its cleaned text with every run of white space made one space."""
    return " ".join(text.split())


@dataclass(frozen=True)
class Removed:
    """What ``dedupe`` removed, per split: public posts whose message is private, private repeats."""
    public: dict[str, int]
    private: dict[str, int]

    def line(self) -> str:
        pub = ", ".join(f"{n} {split}" for split, n in self.public.items())
        rep = ", ".join(f"{n} {split}" for split, n in self.private.items())
        return f"removed {pub} public posts that are private messages; {rep} private repeats"


def dedupe(corpus: dict[str, list[tuple[str, str]]], public_groups: tuple[str, ...] | None
           ) -> tuple[dict[str, list[tuple[str, str]]], Removed]:
    """``read_groups``' corpus with one side per message and one example per private message (the
    module's docstring): public posts whose message is also on the private side removed, and each
    private message kept at its first occurrence (train before test); ``public_groups`` None: every
    post is private. Returns the corpus and the counts removed."""
    public = set(public_groups or ())
    private = {message(text) for posts in corpus.values() for g, text in posts if g not in public}
    seen: set[str] = set()
    out, gone_public, gone_private = {}, {}, {}
    for split in SPLITS:
        kept, gone_public[split], gone_private[split] = [], 0, 0
        for g, text in corpus[split]:
            key = message(text)
            if g in public:
                if key in private:
                    gone_public[split] += 1
                    continue
            elif key in seen:
                gone_private[split] += 1
                continue
            else:
                seen.add(key)
            kept.append((g, text))
        out[split] = kept
    return out, Removed(public=gone_public, private=gone_private)


def round_robin(posts: list[tuple[str, str]]) -> list[str]:
    """The posts of each group in their order, interleaved: the first of every group (groups in their
    order of appearance), then the second, ...; a group that runs out is skipped."""
    groups: dict[str, list[str]] = {}
    for g, text in posts:
        groups.setdefault(g, []).append(text)
    columns = list(groups.values())
    return [column[i] for i in range(max(map(len, columns))) for column in columns if i < len(column)]


def split(corpus: dict[str, list[str]], *, valid_fraction: float, seed: int) -> Posts:
    """Training and validation posts from the train split (a permutation seeded by ``seed``:
    validation gets round(valid_fraction * n) posts), the test split as it is."""
    if not 0 < valid_fraction < 1:
        raise DataError(f"dataset.valid_fraction must lie in (0, 1), got {valid_fraction!r}")
    posts = corpus["train"]
    order = np.random.default_rng(seed).permutation(len(posts))
    n_valid = int(round(valid_fraction * len(posts)))
    if not 0 < n_valid < len(posts):
        which = "validation" if n_valid <= 0 else "training"
        raise DataError(f"dataset.valid_fraction = {valid_fraction!r} leaves no {which} post of dataset.archive's "
                        f"{len(posts)} train-split post(s): use a larger archive"
                        + ("" if len(posts) < 2 else " or another fraction"))
    return Posts(train=[posts[i] for i in order[n_valid:]], valid=[posts[i] for i in order[:n_valid]],
                 test=list(corpus["test"]))
