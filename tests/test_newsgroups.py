"""20 Newsgroups: reading the tarball, the features, the prompts, and bad files."""

import io
import tarfile

import numpy as np
import pytest
import torch

from pipeline.noisyhead import config, data, newsgroups

WORDS = "privacy attention prompt noise gradient ridge query token head clip project sphere".split()


def make_tarball(path, per_group=12, groups=("comp.a", "rec.b", "sci.c")):
    rng = np.random.default_rng(0)
    with tarfile.open(path, "w:gz") as tar:
        for split in ("train", "test"):
            for g in groups:
                for i in range(per_group):
                    text = " ".join(rng.choice(WORDS, size=rng.integers(5, 80))) + f" {g.split('.')[1]}word"
                    blob = text.encode("latin-1")
                    info = tarfile.TarInfo(f"20news-bydate-{split}/{g}/{i}")
                    info.size = len(blob)
                    tar.addfile(info, io.BytesIO(blob))
    return path


def test_features_follow_the_documented_normalisation(tmp_path):
    corpus = newsgroups.read_archive(make_tarball(tmp_path / "c.tar.gz"))
    assert {s: len(corpus[s][0]) for s in newsgroups.SPLITS} == {"train": 36, "test": 36}
    a = newsgroups.featurize(corpus, D=5, y_center=2.0, vectorizer_fit="test")
    for split in newsgroups.SPLITS:
        x = a.x[split]
        assert x.shape == (36, 5)
        assert (np.diff(x, axis=1) <= 1e-12).all()  # decreasing importance within the article
        assert (np.linalg.norm(x, axis=1) <= 1 + 1e-12).all()  # TF-IDF rows have norm <= 1
        lengths = np.array([len(t.split()) for t in corpus[split][0]])
        assert np.allclose(a.y[split], np.log10(1 + lengths) - 2.0)
        assert sorted(set(a.group[split])) == [0, 1, 2]


def test_feature_file_round_trip_and_mismatch(tmp_path):
    corpus = newsgroups.read_archive(make_tarball(tmp_path / "c.tar.gz"))
    meta = {"D": 5, "y_center": 2.0, "vectorizer_fit": "test"}
    a = newsgroups.featurize(corpus, **meta)
    newsgroups.save(a, tmp_path / "f.npz", meta)
    b = newsgroups.load(tmp_path / "f.npz", meta)
    assert newsgroups.fingerprint(a) == newsgroups.fingerprint(b)
    with pytest.raises(newsgroups.DataError, match="other settings"):
        newsgroups.load(tmp_path / "f.npz", dict(meta, D=6))


@pytest.mark.parametrize("content", [None, b"not a tarball at all", b"\x1f\x8b\x08\x00broken gzip"])
def test_missing_or_corrupt_archive_is_refused_before_compute(cfg_for, tmp_path, content):
    path = tmp_path / "20news.tar.gz"
    if content is not None:
        path.write_bytes(content)
    cfg = cfg_for("dataset=newsgroups", "regime=newsgroups", "privacy.eps=0.5", f"dataset.archive={path}")
    with pytest.raises(config.ConfigError, match="dataset.archive"):
        config.validate(cfg)


def test_prompts_take_one_newsgroup_each(cfg_for, tmp_path):
    archive = make_tarball(tmp_path / "c.tar.gz", per_group=12)
    cfg = cfg_for("dataset=newsgroups", "regime=newsgroups", "privacy.eps=0.5", f"dataset.archive={archive}",
                  "regime.N=20", "regime.L=4", "regime.D=5", "dataset.n_test=6", "trials=3")
    const = config.validate(cfg)
    p = data.newsgroups(const, trials=3, n_test=6, seed=0, chunk=2, dtype=torch.float64, dataset=cfg.dataset)
    assert p.train.shape == (3, 20, 5) and p.test.shape == (3, 6, 5)
    groups = newsgroups.articles(cfg.dataset).group["train"]
    idx = data._group_prompts(groups, [torch.Generator().manual_seed(t) for t in range(3)], 20, 5)
    assert all(len(set(groups[row.numpy()])) == 1 for row in idx.reshape(-1, 5))  # one newsgroup per prompt
    assert all(len(set(row.tolist())) == 5 for row in idx.reshape(-1, 5))  # no article twice in a prompt
    assert p.private.norms().max() <= const.G * (1 + 1e-12) and p.private.y.abs().max() <= const.C


def test_archive_with_too_few_articles_per_newsgroup_is_refused_before_compute(cfg_for, tmp_path):
    """A prompt takes L + 1 articles of one newsgroup: an archive whose smallest newsgroup has fewer
    is refused at validation (it used to pass the check and fail in the run's data step)."""
    archive = make_tarball(tmp_path / "c.tar.gz", per_group=4)
    assert newsgroups.check_archive(archive) == {s: {"comp.a": 4, "rec.b": 4, "sci.c": 4} for s in newsgroups.SPLITS}
    base = ("dataset=newsgroups", "regime=newsgroups", "privacy.eps=0.5", f"dataset.archive={archive}",
            "regime.N=20", "regime.D=5")
    config.validate(cfg_for(*base, "regime.L=3"))  # 4 articles: enough for L + 1 = 4
    with pytest.raises(config.ConfigError, match=r"dataset.archive: a newsgroup of the train split has 4 articles, "
                                                 r"fewer than the L \+ 1 = 5"):
        config.validate(cfg_for(*base, "regime.L=4"))


@pytest.mark.parametrize("bad,key", [("regime.L=abc", "regime.L"), ("regime.N=2.5", "regime.N"),
                                     ("regime.N=-4", "regime.N")])
def test_a_bad_regime_is_refused_by_name_before_the_archive_is_counted(cfg_for, tmp_path, bad, key):
    """The archive check needs L + 1: a bad regime.N or regime.L is refused by its own check first
    (it crashed in math.isqrt or a TypeError when the archive was counted first)."""
    archive = make_tarball(tmp_path / "c.tar.gz", per_group=4)
    cfg = cfg_for("dataset=newsgroups", "regime=newsgroups", "privacy.eps=0.5", f"dataset.archive={archive}",
                  "regime.D=5", "regime.L=null", bad)
    with pytest.raises(config.ConfigError, match=rf"^{key}"):
        config.validate(cfg)
