"""The language-model task's posts (``pipeline/lm/data.py``): cleaning, reading a tarball the
test makes, and the seeded split."""

from __future__ import annotations

import io
import tarfile

import pytest

from pipeline.lm import data

POST = """From: someone@example.edu (Some One)
Subject: Re: a question
Organization: A University
Lines: 12

In article <1993Apr5.1234@host.example.com>, other@host.example.com (Other Person) writes:
> Is it true that the sky is blue?
>> nested quote
|> another quoting style

Yes, it is blue on most days.
Write to me at me@my.host.example.org for more.

-- 
Some One, someone@example.edu, (555) 123-4567
A University, Somewhere
"""


def test_cleaning_removes_headers_quotes_attribution_signature_and_masks_addresses():
    text = data.clean(POST)
    assert text == "Yes, it is blue on most days.\nWrite to me at <email> for more."
    for gone in ("From:", "Organization", "writes:", "sky", "nested", "another", "555", "@"):
        assert gone not in text


def test_a_long_block_after_a_dash_line_is_kept():
    body = "x\n\nline\n--\n" + "\n".join(f"more text {i}" for i in range(data.SIGNATURE_LINES + 1))
    assert data.clean(body).endswith(f"more text {data.SIGNATURE_LINES}")
    assert data.clean("only headers\nno blank line") == ""


def _tarball(path, members):
    with tarfile.open(path, "w:gz") as tar:
        for name, text in members.items():
            raw = text.encode("latin-1")
            info = tarfile.TarInfo(name)
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))


def test_read_cleans_every_post_and_drops_empty_ones(tmp_path):
    path = tmp_path / "news.tar.gz"
    _tarball(path, {"20news-bydate-train/sci.space/1": POST, "20news-bydate-train/sci.space/2": "H: x\n\nhello caf\xe9",
                    "20news-bydate-train/sci.space/3": "H: only a header\n\n> quote only",
                    "20news-bydate-test/sci.space/4": "H: y\n\nworld"})
    corpus = data.read(path)
    assert corpus == {"train": [data.clean(POST), "hello café"], "test": ["world"]}
    assert data.read(path, cleaned=False)["train"][0] == POST


def test_read_refuses_what_it_cannot_use(tmp_path):
    with pytest.raises(data.DataError, match="^dataset.archive: no such file"):
        data.read(tmp_path / "missing.tar.gz")
    with pytest.raises(data.DataError, match="^dataset.archive: '.*' is a folder, not a file"):
        data.read(tmp_path)
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(b"\x1f\x8b not really gzip")
    with pytest.raises(data.DataError, match="is not a readable 20news-bydate tarball"):
        data.read(bad)
    only_train = tmp_path / "train.tar.gz"
    _tarball(only_train, {"20news-bydate-train/g/1": "H: x\n\ntext"})
    with pytest.raises(data.DataError, match="holds no 20news-bydate-test posts"):
        data.read(only_train, key="lm.archive")


def test_the_split_is_seeded_disjoint_and_complete():
    corpus = {"train": [f"post {i}" for i in range(100)], "test": ["t"]}
    a = data.split(corpus, valid_fraction=0.1, seed=3)
    assert len(a.valid) == 10 and len(a.train) == 90 and a.test == ["t"]
    assert sorted(a.train + a.valid) == sorted(corpus["train"])
    assert data.split(corpus, valid_fraction=0.1, seed=3) == a
    assert data.split(corpus, valid_fraction=0.1, seed=4).valid != a.valid
    for bad in (0.0, 1.0, 0.001):
        with pytest.raises(data.DataError, match="dataset.valid_fraction"):
            data.split(corpus, valid_fraction=bad, seed=0)


def test_a_message_is_on_one_side_and_one_example():
    """A cross-post (the same cleaned text in a public and a private group's folder) is private: gone
    from every public split; a private message met twice (white space aside, or in train and test)
    is one example, its first occurrence; public repeats of public messages stay (public data)."""
    corpus = {"train": [("pub", "shared  text"), ("priv", "shared text"), ("priv", "mine"), ("priv", "mine\n"),
                        ("pub", "open"), ("pub", "open")],
              "test": [("pub", "shared text"), ("priv", "mine"), ("priv", "new")]}
    out, removed = data.dedupe(corpus, ("pub",))
    assert out["train"] == [("priv", "shared text"), ("priv", "mine"), ("pub", "open"), ("pub", "open")]
    assert out["test"] == [("priv", "new")]
    assert removed.public == {"train": 1, "test": 1} and removed.private == {"train": 1, "test": 1}
    assert "removed 1 train, 1 test public posts" in removed.line()
    everything, removed = data.dedupe(corpus, None)  # part = all: every post private, repeats removed
    assert [t for _, t in everything["train"]] == ["shared  text", "mine", "open"] and removed.public == {"train": 0, "test": 0}


def test_the_shared_archives_cross_posts_and_repeats_are_removed():
    """On the shared 20 Newsgroups archive with the presets' public groups (docs/lm.md's counts)."""
    from pathlib import Path

    from omegaconf import OmegaConf

    archive = Path(__file__).resolve().parents[2] / "shared" / "data" / "20news-bydate.tar.gz"
    if not archive.is_file():
        pytest.skip(f"no shared archive at {archive}")
    root = Path(__file__).resolve().parents[1]
    groups = tuple(OmegaConf.load(root / "conf/lm/dataset/newsgroups_posts.yaml").public_groups)
    corpus = data.read_groups(archive)
    _, removed = data.dedupe(corpus, groups)
    assert removed.public == {"train": 5, "test": 6} and removed.private == {"train": 13, "test": 2}
    _, removed = data.dedupe(corpus, None)
    assert removed.private == {"train": 40, "test": 30}
    public, private = data.side(corpus, groups, "public"), data.side(corpus, groups, "private")
    assert [len(public[s]) for s in data.SPLITS] == [5623, 3740] and [len(private[s]) for s in data.SPLITS] == [5631, 3752]
    pub = {data.message(t) for s in data.SPLITS for t in public[s]}
    assert not pub & {data.message(t) for s in data.SPLITS for t in private[s]}
    seen = [data.message(t) for s in data.SPLITS for t in private[s]]
    assert len(seen) == len(set(seen))
    # the cached reading gives the same sides and dedupes once per archive and side assignment
    data._dedupe_once.cache_clear()
    for part in ("public", "private", "private"):
        assert data.read_cached(str(archive), public_groups=groups, part=part) == (public if part == "public" else private)
    assert data.read_cached(str(archive), part="all") == data.side(corpus, None, "all")
    info = data._dedupe_once.cache_info()
    assert (info.misses, info.hits) == (2, 2)
    assert data.deduped_cached(str(archive), groups)[1] == data.dedupe(corpus, groups)[1]


def test_a_tiny_archive_is_refused_naming_the_archive_and_the_fraction():
    corpus = {"train": ["a", "b", "c"], "test": ["d"]}
    with pytest.raises(data.DataError, match=r"dataset.valid_fraction = 0.1 leaves no validation post of "
                                             r"dataset.archive's 3 train-split post\(s\): use a larger archive"):
        data.split(corpus, valid_fraction=0.1, seed=0)
