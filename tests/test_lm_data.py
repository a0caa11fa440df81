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
