"""The 20 Newsgroups corpus ("bydate" split) as articles with features, for ``dataset=newsgroups``.

Per article (Section 7): x = its top-D TF-IDF scores in decreasing order (D = 30; fewer
distinct words are padded with zeros), y = its length in tokens. Every normalisation is
fixed from public facts, never from statistics of the training articles:

- the TF-IDF vectorizer is fitted on the *test* split (``vectorizer_fit: test``), treated as
  public side data, so a training article enters only through its own features;
- TF-IDF rows are L2-normalised, so ||x|| <= 1 for every article;
- y = log10(1 + tokens) - ``y_center`` (2: a 100-token article maps to 0), so that the
  response clip C of the regime is a statement about lengths (C = 2: up to 10^4 tokens).

``python -m pipeline.noisyhead.newsgroups ARCHIVE OUT.npz`` writes the features (the DVC stage
``features`` runs it); the pipeline reads that file when ``dataset.features`` names it, and
builds the same features in memory from ``dataset.archive`` otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import tarfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from pipeline import validation

log = logging.getLogger(__name__)

SPLITS = ("train", "test")


class DataError(ValueError):
    """The corpus or its feature file cannot be read; the message says which and why."""


@dataclass
class Articles:
    x: dict[str, np.ndarray]  # split -> (n, D) top-D TF-IDF scores
    y: dict[str, np.ndarray]  # split -> (n,) normalised length
    group: dict[str, np.ndarray]  # split -> (n,) newsgroup index


def _articles(path: str | Path, *, texts: bool) -> Iterator[tuple[str, str, str | None]]:
    """(split, newsgroup, text) of every article of the bydate tarball, in its order (the text
    None unless ``texts``), read within one guard: DataError if the file is missing, corrupt or
    holds no article of a split."""
    path = Path(path)
    if (why := validation.not_a_file(path)) is not None:
        raise DataError(f"dataset.archive: no such file {str(path)!r}" if why == "no such file"
                        else f"dataset.archive: {str(path)!r} is {why}")
    seen = set()
    try:
        with tarfile.open(path, "r:gz") as tar:
            for member in tar:
                parts = member.name.split("/")
                split = parts[0].removeprefix("20news-bydate-")
                if member.isfile() and len(parts) == 3 and split in SPLITS:
                    seen.add(split)
                    yield split, parts[1], tar.extractfile(member).read().decode("latin-1") if texts else None
    except (tarfile.TarError, OSError, EOFError) as err:
        raise DataError(f"dataset.archive: {str(path)!r} is not a readable 20news-bydate tarball ({err})") from err
    if seen != set(SPLITS):
        raise DataError(f"dataset.archive: {str(path)!r} holds no 20news-bydate-train/-test articles")


def read_archive(path: str | Path) -> dict[str, tuple[list[str], list[str]]]:
    """split -> (texts, newsgroup names) from the bydate tarball; DataError if missing or corrupt."""
    out: dict[str, tuple[list[str], list[str]]] = {s: ([], []) for s in SPLITS}
    for split, group, text in _articles(path, texts=True):
        out[split][0].append(text)
        out[split][1].append(group)
    return out


def check_archive(path: str | Path) -> dict[str, dict[str, int]]:
    """Read the whole tarball (headers and gzip stream) without keeping it: split -> newsgroup ->
    its number of articles, as ``read_archive`` counts them; DataError as there. About a second
    for the 14 MB corpus."""
    counts: dict[str, dict[str, int]] = {s: {} for s in SPLITS}
    for split, group, _ in _articles(path, texts=False):
        counts[split][group] = counts[split].get(group, 0) + 1
    return counts


def download() -> dict[str, tuple[list[str], list[str]]]:
    """scikit-learn's ordinary download, for machines that are online."""
    from sklearn.datasets import fetch_20newsgroups

    out = {}
    for split in SPLITS:
        bunch = fetch_20newsgroups(subset=split)
        out[split] = (list(bunch.data), [bunch.target_names[t] for t in bunch.target])
    return out


def featurize(corpus, *, D: int, y_center: float, vectorizer_fit: str) -> Articles:
    from sklearn.feature_extraction.text import TfidfVectorizer

    vectorizer = TfidfVectorizer(stop_words="english")
    vectorizer.fit(corpus[vectorizer_fit][0])
    analyzer = vectorizer.build_analyzer()
    groups = sorted(set(corpus["train"][1]) | set(corpus["test"][1]))
    index = {g: i for i, g in enumerate(groups)}
    x, y, group = {}, {}, {}
    for split, (texts, names) in corpus.items():
        tfidf = vectorizer.transform(texts).tocsr()
        top = np.zeros((len(texts), D))
        for i in range(len(texts)):
            row = np.sort(tfidf.data[tfidf.indptr[i] : tfidf.indptr[i + 1]])[::-1][:D]
            top[i, : len(row)] = row
        x[split] = top
        y[split] = np.log10(1 + np.array([len(analyzer(t)) for t in texts], dtype=float)) - y_center
        group[split] = np.array([index[n] for n in names])
    return Articles(x, y, group)


def save(articles: Articles, path: str | Path, meta: dict) -> None:
    arrays = {f"{k}_{s}": getattr(articles, k)[s] for k in ("x", "y", "group") for s in SPLITS}
    np.savez_compressed(path, **arrays, meta=np.array(repr(sorted(meta.items()))))


def load(path: str | Path, meta: dict) -> Articles:
    path = Path(path)
    if (why := validation.not_a_file(path)) is not None:
        raise DataError(f"dataset.features: no such file {str(path)!r} (build it with `dvc repro features`)"
                        if why == "no such file" else f"dataset.features: {str(path)!r} is {why}")
    try:  # np.load reads lazily: a truncated or damaged member fails only when it is read, here
        with np.load(path, allow_pickle=False) as f:
            stored = str(f["meta"])
            arrays = {k: f[k] for k in f.files if k != "meta"}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error) as err:
        raise DataError(f"dataset.features: {str(path)!r} is not a readable feature file "
                        f"({type(err).__name__}: {err}); rebuild it with `dvc repro features`") from err
    if stored != repr(sorted(meta.items())):
        raise DataError(f"dataset.features: {str(path)!r} was built with other settings ({stored}); rebuild it")
    missing = [f"{k}_{s}" for k in ("x", "y", "group") for s in SPLITS if f"{k}_{s}" not in arrays]
    if missing:
        raise DataError(f"dataset.features: {str(path)!r} lacks {missing}; rebuild it")
    found = Articles(*({s: arrays[f"{k}_{s}"] for s in SPLITS} for k in ("x", "y", "group")))
    problem = check_articles(found, D=int(meta["D"]))
    if problem:
        raise DataError(f"dataset.features: {str(path)!r} {problem}; rebuild it")
    return found


NORM_SLACK = 1e-9  # TF-IDF rows have norm 1 up to round-off


def check_articles(a: Articles, *, D: int) -> str | None:
    """What is wrong with article features (the privacy constants rest on them), or None: every
    split has (n, D) finite scores in [0, 1] with row norms <= 1, n finite lengths and n integer
    newsgroups."""
    for s in SPLITS:
        x, y, g = a.x[s], a.y[s], a.group[s]
        n = len(y)
        if x.ndim != 2 or x.shape != (n, D) or y.ndim != 1 or g.shape != (n,) or n == 0:
            return (f"has inconsistent shapes in its {s} split: x {x.shape}, y {y.shape}, group {g.shape} "
                    f"(expected (n, {D}), (n,), (n,))")
        if not (np.issubdtype(x.dtype, np.floating) and np.issubdtype(y.dtype, np.floating)
                and np.issubdtype(g.dtype, np.integer)):
            return f"has the wrong types in its {s} split: x {x.dtype}, y {y.dtype}, group {g.dtype}"
        bad = ~np.isfinite(x).all(1) | ~np.isfinite(y)
        if bad.any():
            return f"holds NaN or infinite values ({int(bad.sum())} {s} articles, the first is number {int(np.argmax(bad))})"
        if (x < 0).any() or (np.linalg.norm(x, axis=1) > 1 + NORM_SLACK).any():
            return f"has {s} scores that are not TF-IDF scores (negative, or a row norm above 1)"
        if (g < 0).any():
            return f"has negative newsgroup numbers in its {s} split"
    return None


def meta_of(dataset) -> dict:
    return {"D": int(dataset.D), "y_center": float(dataset.y_center), "vectorizer_fit": str(dataset.vectorizer_fit)}


_cache: tuple[str, Articles] | None = None


def articles(dataset) -> Articles:
    """The corpus' article features: from ``dataset.features``, else built from ``dataset.archive``
    (or scikit-learn's download when that is null); kept for the next cell of a sweep."""
    global _cache
    meta = meta_of(dataset)
    key = repr((dataset.features, dataset.archive, sorted(meta.items())))
    if _cache is None or _cache[0] != key:
        if dataset.features:
            found = load(dataset.features, meta)
        else:
            corpus = read_archive(dataset.archive) if dataset.archive else download()
            found = featurize(corpus, **meta)
        _cache = (key, found)
    return _cache[1]


def fingerprint(a: Articles) -> str:
    digest = hashlib.sha256()
    for k in ("x", "y", "group"):
        for s in SPLITS:
            digest.update(np.ascontiguousarray(getattr(a, k)[s]).data)
    return digest.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description="Build the 20 Newsgroups article features (a DVC stage).")
    parser.add_argument("archive", help="path of 20news-bydate.tar.gz")
    parser.add_argument("out", help="where to write the .npz")
    parser.add_argument("--D", type=int, default=30)
    parser.add_argument("--y-center", type=float, default=2.0)
    parser.add_argument("--vectorizer-fit", choices=SPLITS, default="test")
    args = parser.parse_args()
    meta = {"D": args.D, "y_center": args.y_center, "vectorizer_fit": args.vectorizer_fit}
    try:
        found = featurize(read_archive(args.archive), **meta)
    except DataError as err:
        raise SystemExit(f"error: {err}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    save(found, args.out, meta)
    print(f"wrote {args.out}: " + ", ".join(f"{s} {len(found.y[s])} articles" for s in SPLITS))


if __name__ == "__main__":
    main()
