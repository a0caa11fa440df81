"""Issue 65, public pretraining and DP fine-tuning (``pipeline/lm/``): the group split of the posts,
the pretrained model's file and its refusals, a tiny pretraining and fine-tuning through the task's
own cells (in process, on a tarball the test makes: the public-only model's rows, the references,
the paired gains and the checks), and the checks' verdicts and size line against closed forms."""

from __future__ import annotations

import io
import math
import tarfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from pipeline.lm import cell, config, data, evaluate, pretrained, sweep, train
from pipeline.validation import ConfigError

ROOT = Path(__file__).resolve().parents[1]

COMMON = "the a of to and in is it that for on with as was this".split()
TOPICS = {"comp.graphics": "pixel image render colour screen polygon", "rec.autos": "car engine wheel brake drive gear",
          "sci.space": "orbit launch moon rocket shuttle probe", "talk.politics.misc": "vote law tax congress senate bill"}
PUBLIC = ["comp.graphics", "rec.autos"]  # the archive's other two groups are private


def _archive(path, n_train: int = 60, n_test: int = 12, seed: int = 0):
    """A bydate-shaped tarball of four real newsgroup folders, each post mixing common words with its
    group's own."""
    rng = np.random.default_rng(seed)
    with tarfile.open(path, "w:gz") as tar:
        for split, n in (("train", n_train), ("test", n_test)):
            for group, topic in TOPICS.items():
                words = COMMON + topic.split()
                for i in range(n):
                    body = " ".join(rng.choice(words, size=int(rng.integers(8, 40))))
                    raw = f"From: x@y.z\nSubject: s\n\n{body}\n".encode()
                    info = tarfile.TarInfo(f"20news-bydate-{split}/{group}/{i}")
                    info.size = len(raw)
                    tar.addfile(info, io.BytesIO(raw))
    return path


TINY = ("dataset.L=8", "dataset.eval_posts=8", "vocab.size=300", "model.d=8", "model.layers=1", "model.heads=2",
        "train.batch_size=20", "train.epochs=1", "train.validate_every=1", "train.threads=null",
        f"dataset.public_groups=[{','.join(PUBLIC)}]")


def _pretraining(cfg_for, archive, tmp_path, *more):
    return cfg_for("experiment=lm_pretrain", f"dataset.archive={archive}", *TINY, f"model.save={tmp_path / 'models'}",
                   f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}", *more)


def _fine_tuning(cfg_for, archive, tmp_path, *more):
    from conftest import merged

    return cfg_for(*merged("experiment=lm_finetune", f"dataset.archive={archive}", *TINY,
                           f"model.init={tmp_path / 'models'}", f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
                           *more))


def _run(cfg, folder, monkeypatch) -> pd.DataFrame:
    """One cell in process, into ``folder``: its results.csv."""
    from pipeline import tracking

    folder.mkdir(parents=True)
    monkeypatch.setattr(tracking, "output_dir", lambda: folder)
    return pd.read_csv(cell.run(cfg, config.validate(cfg)))


# the group split ------------------------------------------------------------------------------------------------


def test_read_groups_keeps_each_posts_newsgroup_and_read_is_unchanged(tmp_path):
    archive = _archive(tmp_path / "news.tar.gz", n_train=3, n_test=2)
    found = data.read_groups(archive)
    assert [g for g, _ in found["train"]] == [g for g in TOPICS for _ in range(3)]  # the tarball's order
    assert data.read(archive) == {split: [t for _, t in posts] for split, posts in found.items()}


def test_the_two_sides_are_disjoint_complete_and_their_test_posts_interleave_the_groups(tmp_path):
    corpus = data.read_groups(_archive(tmp_path / "news.tar.gz", n_train=5, n_test=3))
    public, private = (data.side(corpus, tuple(PUBLIC), part) for part in ("public", "private"))
    for split in data.SPLITS:
        both = public[split] + private[split]
        assert sorted(both) == sorted(t for _, t in corpus[split]) and not set(public[split]) & set(private[split])
    owner = {t: g for split in data.SPLITS for g, t in corpus[split]}
    assert {owner[t] for t in public["train"]} == set(PUBLIC)
    assert [owner[t] for t in private["test"]] == ["sci.space", "talk.politics.misc"] * 3  # round robin
    assert data.side(corpus, tuple(PUBLIC), "all") == data.texts(corpus)
    with pytest.raises(data.DataError, match="^dataset.public_groups: 'sci.med' has no posts in the archive"):
        data.side(corpus, ("sci.med",), "public")
    with pytest.raises(data.DataError, match="^dataset.part = 'private' needs dataset.public_groups"):
        data.side(corpus, None, "private")


def test_round_robin_takes_each_group_in_turn_until_it_runs_out():
    posts = [("a", "a1"), ("a", "a2"), ("a", "a3"), ("b", "b1"), ("c", "c1"), ("c", "c2")]
    assert data.round_robin(posts) == ["a1", "b1", "c1", "a2", "c2", "a3"]


@pytest.mark.parametrize("groups,message", [
    (["rec.sport.cricket"], "dataset.public_groups: 'rec.sport.cricket' is not one of the 20 newsgroups"),
    (["sci.med", "sci.med"], "dataset.public_groups: 'sci.med' is named twice"),
    ([], "dataset.public_groups names 0 of the 20 newsgroups"),
    (list(data.NEWSGROUPS), "dataset.public_groups names 20 of the 20 newsgroups"),
    ("sci.med", "dataset.public_groups must be a list of newsgroup names"),
])
def test_a_bad_group_assignment_is_refused_naming_its_key_before_any_data_is_read(cfg_for, monkeypatch, groups, message):
    def unread(*args, **kwargs):
        raise AssertionError("the archive was read before the assignment was checked")

    monkeypatch.setattr(data, "read_groups", unread)
    cfg = cfg_for("experiment=lm_ci")
    cfg.dataset.public_groups = groups
    with pytest.raises(ConfigError) as refused:
        config.validate(cfg)
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


def test_the_default_assignment_is_ten_groups_on_each_side(cfg_for):
    s = config.settings(cfg_for("experiment=lm_finetune"))
    assert len(s.public_groups) == 10 and set(s.public_groups) < set(data.NEWSGROUPS) and s.part == "private"
    prefixes = {g.split(".")[0] for g in s.public_groups}
    assert {"comp", "rec", "sci", "talk"} <= prefixes  # every large hierarchy on both sides
    assert {"comp", "rec", "sci", "talk"} <= {g.split(".")[0] for g in set(data.NEWSGROUPS) - set(s.public_groups)}


@pytest.mark.parametrize("overrides,message", [
    (["dataset.part=middle"], "dataset.part 'middle' is unknown"),
    (["dataset.part=private", "dataset.public_groups=null"], "dataset.part = 'private' needs dataset.public_groups"),
    (["vocab=public_groups", "dataset.public_groups=null"], "vocab.kind = 'public_groups' needs dataset.public_groups"),
    (["dataset.examples=windows"], "dataset.examples = 'windows' trains on every window"),
    (["vocab=private_groups", "vocab.eps=0"], "vocab.eps must be positive and finite"),
    (["vocab=private_groups", "vocab.eps=8"], "vocab.eps = 8 and vocab.delta = 1e-06 (the private groups' vocabulary)"),
    (["model.init=x.pt"], "model.init = 'x.pt' with dataset.part = 'all'"),
    (["model.save=out"], "model.save = 'out' writes a model pretrained on the public groups"),
])
def test_the_group_splits_keys_are_refused_naming_them(cfg_for, overrides, message):
    with pytest.raises(ConfigError) as refused:
        config.settings(cfg_for("experiment=lm_ci", *overrides))
    assert str(refused.value).startswith(message), str(refused.value)


# the budget of a vocabulary selected once --------------------------------------------------------------------------


def test_a_vocabulary_of_its_own_budget_is_taken_off_dp_sgds_and_counted_once(cfg_for):
    s = config.settings(cfg_for("experiment=lm_finetune", "vocab=private_groups", "privacy.eps=3"))
    assert (s.vocab_eps, s.vocab_delta) == (0.5, 1e-6) and s.vocab_share == 0.0
    assert config.vocab_budget(s) == (0.5, 1e-6) and config.dpsgd_budget(s) == pytest.approx((2.5, 9e-6))
    found = train.plan(n_posts=5080, batch_size=250, epochs=4, eps=3.0, delta=1e-5, private=True, vocab_share=0.0,
                       vocab_spent=(0.5, 1e-6))
    alone = train.plan(n_posts=5080, batch_size=250, epochs=4, eps=2.5, delta=9e-6, private=True, vocab_share=0.0)
    assert found.sigma == alone.sigma and found.eps_spent == pytest.approx(alone.eps_spent + 0.5)
    assert 2.99 <= found.eps_spent <= 3.0 and (found.vocab_eps, found.vocab_delta) == (0.5, 1e-6)
    shared = config.settings(cfg_for("experiment=lm_ci"))  # a share of the run's budget, as before
    assert config.dpsgd_budget(shared) == (0.9 * 8, 0.9 * 1e-5)


# the pretrained file -----------------------------------------------------------------------------------------------


def _compose(*overrides: str):
    """The real config with overrides, as ``cfg_for`` composes it (for the module's fixture)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


@pytest.fixture(scope="module")
def pretrained_models(tmp_path_factory):
    """A tiny pretraining of the tied and the untied model on the public groups, through the cell, once
    for the module (the MLflow tracking URI it sets is put back after)."""
    from mlflow.tracking._tracking_service import utils

    tmp_path = tmp_path_factory.mktemp("pretrained")
    archive = _archive(tmp_path / "news.tar.gz")
    before = utils._tracking_uri
    found = {}
    with pytest.MonkeyPatch.context() as patch:
        for tied in (True, False):
            cfg = _pretraining(_compose, archive, tmp_path, f"model.tied={tied}")
            found[tied] = _run(cfg, tmp_path / f"pretrain-{tied}", patch)
    yield archive, tmp_path, found
    import mlflow

    mlflow.set_tracking_uri(before)


def test_a_pretraining_reads_the_public_groups_windows_and_writes_its_model(pretrained_models, cfg_for):
    archive, tmp_path, found = pretrained_models
    models = tmp_path / "models"  # the module's pretraining folder
    assert sorted(p.name for p in models.iterdir()) == ["public_groups-tied.pt", "public_groups-untied.pt"]
    saved = pretrained.read(models / "public_groups-tied.pt")
    assert saved["settings"]["public_groups"] == sorted(PUBLIC) and saved["settings"]["tied"] is True
    assert saved["stats"]["train_examples"] > saved["stats"]["train_posts"]  # every window of the public posts
    assert set(found[True]["part"]) == {"public"} and set(found[True]["examples"]) == {"windows"}
    s = config.validate(_pretraining(cfg_for, archive, tmp_path))
    from pipeline.lm.prepare import prepare

    prep = prepare(s, s.seed)
    tokenizer = pretrained.tokenizer(saved)
    assert tokenizer.get_vocab() == prep.tokenizer.get_vocab()  # the public groups' vocabulary, saved with the model
    public = data.side(data.read_groups(archive), tuple(PUBLIC), "public")
    n = len(public["train"])  # the public groups' train split, less its validation share: every post of theirs
    assert prep.stats["train_posts"] == n - round(s.valid_fraction * n) and prep.rows.shape[0] > n


def test_a_fine_tuning_starts_from_the_pretrained_weights_and_reports_the_public_only_model(
        pretrained_models, tmp_path, cfg_for, monkeypatch):
    archive, models_at, _ = pretrained_models
    runs = []
    for tied in (True, False):
        for seed in (0, 1):
            cfg = _fine_tuning(cfg_for, archive, models_at, f"model.tied={tied}", f"seed={seed}", "privacy.eps=8")
            runs.append(_run(cfg, tmp_path / f"finetune-{tied}-{seed}", monkeypatch))
    results = pd.concat(runs, ignore_index=True)
    assert set(results["part"]) == {"private"} and set(results["method"]) == {"lm", "unigram", "unigram_dp", "pretrained"}
    # the public-only model: the pretrained weights on the same private test posts, before any of them was trained on
    s = config.validate(_fine_tuning(cfg_for, archive, models_at, "model.tied=true", "privacy.eps=8"))
    from pipeline.lm import models
    from pipeline.lm.prepare import prepare

    prep = prepare(s, 0)
    model = models.build(vocab_size=prep.V, max_len=s.L, d=s.d, layers=s.layers, heads=s.heads, tied=True,
                         dropout=0.0, eos_id=prep.eos_id)
    pretrained.load_into(model, pretrained.read(pretrained.path_of(s)))
    expected = evaluate.model_rows(model, {"test": prep.splits["test"]}, evaluate.buckets(prep.rows, prep.mask, prep.V),
                                   s.eval_batch)[0]["perplexity"]
    public_only = results[(results["method"] == "pretrained") & (results["split"] == "test")]
    tied = public_only[public_only["tying"] == "tied"]["perplexity"]
    assert tied.tolist() == pytest.approx([expected, expected], rel=1e-12)  # one model, the same test posts: every seed
    trained = results[(results["method"] == "lm") & (results["split"] == "test")]
    assert not np.allclose(trained["perplexity"].to_numpy(), public_only["perplexity"].to_numpy())  # DP-SGD moved it
    private = data.side(data.read_groups(archive), tuple(PUBLIC), "private")
    assert prep.stats["test_posts"] == s.eval_posts and len(private["test"]) > s.eval_posts
    # the sweep's tables: tying's paired gain, and each fine-tuned model against the public-only and unigram models
    results = sweep._with_setting(results)
    picks = sweep.selected(results)
    gains = sweep.gains(results, picks)
    assert gains["eps"].tolist() == [8.0] and gains["seeds"].tolist() == [2]
    found = sweep.checks(results, picks)
    assert len(found) == 4 and set(found["reference"]) == {"public-only", "unigram"}
    row = found[(found["model"] == "tied") & (found["reference"] == "public-only")].iloc[0]
    assert row.reference_perplexity == pytest.approx(expected)
    mine = trained[trained["tying"] == "tied"]["perplexity"].to_numpy()
    assert row.gain_mean == pytest.approx(float(np.mean(1 - mine / expected)))
    long = sweep.table(results, picks)
    text = sweep.markdown(long, gains, sweep.bucket_gains(results, picks), sweep.scale(results), found)
    assert "| public-only (tied) |" in text and "| public-only (untied) |" in text
    assert "- eps=8: do the private fine-tuned models beat the public-only model and the non-private unigram model?" in text
    assert "- **The setting is " in text and "pretrained on the public groups, fine-tuned on the private groups" in text


def test_a_fine_tuning_trains_on_random_windows_of_whole_posts(pretrained_models, tmp_path, cfg_for, monkeypatch):
    """lm_finetune's ``dataset.examples=post_window``: ``prepare`` holds every training post's tokens
    (and the first L + 1 tokens of each as rows, for the counts and references), the cell hands them
    to the trainer, and the windows read cover more than the posts' first L + 1 tokens; with
    ``examples=post`` it holds none and the cell trains on the rows."""
    from pipeline.lm.prepare import prepare

    archive, models_at, _ = pretrained_models
    s = config.validate(_fine_tuning(cfg_for, archive, models_at, "privacy.eps=8"))
    assert s.examples == "post_window"
    prep = prepare(s, 0)
    assert prep.posts is not None and len(prep.posts.length) == prep.rows.shape[0] == prep.stats["train_posts"]
    assert int(prep.posts.length.max()) > s.L + 1  # some post is longer than one example
    seen, real = [], train.run

    def spy(*args, **kw):
        seen.append(kw.get("windows"))
        return real(*args, **kw)

    monkeypatch.setattr(train, "run", spy)
    _run(_fine_tuning(cfg_for, archive, models_at, "privacy.eps=8"), tmp_path / "window", monkeypatch)
    _run(_fine_tuning(cfg_for, archive, models_at, "privacy.eps=8", "dataset.examples=post"), tmp_path / "post",
         monkeypatch)
    assert seen[0] is not None and torch.equal(seen[0].ids, prep.posts.ids) and seen[1] is None
    assert prepare(config.validate(_fine_tuning(cfg_for, archive, models_at, "privacy.eps=8",
                                                "dataset.examples=post")), 0).posts is None


def test_a_pretrained_file_of_other_settings_is_refused_naming_the_key(pretrained_models, tmp_path, cfg_for):
    archive, models_at, _ = pretrained_models

    def refused(*overrides) -> str:
        with pytest.raises(ConfigError) as err:
            config.validate(_fine_tuning(cfg_for, archive, models_at, *overrides))
        assert "\n" not in str(err.value)
        return str(err.value)

    assert refused("model.d=16").startswith("model.d = 16 does not match the pretrained model ")
    assert "(model.d = 8): fine-tune it with the settings it was pretrained with" in refused("model.d=16")
    assert refused("dataset.L=16").startswith("dataset.L = 16 does not match")
    assert refused("vocab.size=280").startswith("vocab.size = 280 does not match")
    assert refused("dataset.public_groups=[comp.graphics]").startswith("dataset.public_groups = ['comp.graphics'] does not match")
    file = models_at / "models" / "public_groups-untied.pt"
    assert refused(f"model.init={file}", "model.tied=true").startswith("model.tied = True does not match")
    assert refused("vocab=private_groups", "vocab.size=300").startswith(
        "model.init = ") and "no such file" in refused("vocab=private_groups", "vocab.size=300")
    other = _archive(tmp_path / "other.tar.gz", seed=1)
    said = refused(f"dataset.archive={other}")
    assert said.startswith(f"dataset.archive = '{other}' of SHA-256 ") and "an archive of SHA-256" in said
    damaged = tmp_path / "damaged.pt"
    damaged.write_bytes(file.read_bytes()[:-10])
    assert "cannot be read as a pretrained model (its bytes do not match the digest" in refused(f"model.init={damaged}",
                                                                                                "model.tied=false")
    config.validate(_fine_tuning(cfg_for, archive, models_at, f"model.init={file}", "model.tied=false"))  # the file itself


# the checks against closed forms -----------------------------------------------------------------------------------


def _fine_tuned(per_seed: dict[float, dict[str, list[float]]], public_only: float = 100.0) -> pd.DataFrame:
    """Cells of a fine-tuning: per eps and tying, the model's test perplexity per seed; the public-only
    model's is ``public_only`` in every cell, the unigram model's 400 + seed."""
    rows = []
    for e, models in per_seed.items():
        for tying, values in models.items():
            for seed, ppl in enumerate(values):
                def row(method, split, value):
                    return {"tying": tying, "eps": e, "lr": 1e-3, "seed": seed, "method": method, "split": split,
                            "perplexity": value, "accuracy": 0.1, "part": "private",
                            **{f"perplexity_{b}": value for b in evaluate.BUCKETS}}
                rows += [row("lm", "valid", ppl), row("lm", "test", ppl), row("pretrained", "test", public_only),
                         row("unigram", "test", 400.0 + seed), row("unigram_dp", "test", 500.0)]
    return pd.DataFrame(rows)


def test_the_checks_gain_interval_verdicts_and_size_line():
    from scipy import stats

    per = {8.0: {"tied": [90.0, 92.0, 91.0], "untied": [99.0, 101.0, 100.5]}, 1.0: {"tied": [110.0, 112.0, 111.0],
                                                                                    "untied": [120.0, 119.0, 121.0]}}
    results = _fine_tuned(per)
    found = sweep.checks(results, sweep.selected(results))
    at = found.set_index(["eps", "model", "reference"])
    gains = 1 - np.array(per[8.0]["tied"]) / 100.0
    half = stats.t.ppf(0.975, 2) * gains.std(ddof=1) / math.sqrt(3)
    assert at.loc[(8.0, "tied", "public-only"), "gain_mean"] == pytest.approx(gains.mean())
    assert at.loc[(8.0, "tied", "public-only"), "ci_low"] == pytest.approx(gains.mean() - half)
    unigram = 1 - np.array(per[8.0]["tied"]) / (400.0 + np.arange(3))  # paired with each seed's own unigram model
    assert at.loc[(8.0, "tied", "unigram"), "gain_mean"] == pytest.approx(unigram.mean())
    assert at.loc[(8.0, "tied", "public-only"), "verdict"] == "beats"
    assert at.loc[(8.0, "untied", "public-only"), "verdict"] == "inconclusive"  # -1%, +1%, +0.5%
    assert at.loc[(1.0, "tied", "public-only"), "verdict"] == "does not beat"
    assert list(found["eps"].drop_duplicates()) == [1.0, 8.0]
    lines = sweep.check_lines(found)
    assert lines[0].startswith("- eps=1: do the private fine-tuned models beat the public-only model and the non-private "
                               "unigram model? **no**: tied 111.0 (against public-only 100.0: -11.0% [")
    assert lines[1].startswith("- eps=8: do the private fine-tuned models beat") and "**not decided**" in lines[1]
    assert lines[2] == ("- **The setting is too small**: at eps=8 not every private fine-tuned model beats both "
                        "references (untied against public-only (inconclusive)): resize it (more private posts or "
                        "steps, a larger model) before reading its tying verdicts")
    per[8.0]["untied"] = [95.0, 96.0, 95.5]
    results = _fine_tuned(per)
    lines = sweep.check_lines(sweep.checks(results, sweep.selected(results)))
    assert "**yes**" in lines[1] and lines[2].startswith("- **The setting is large enough**: at eps=8 every private")


def test_a_sweep_without_pretrained_models_has_no_checks():
    from test_lm_task import _results

    results = _results({8.0: [0.1, 0.2]})
    assert sweep.checks(results, sweep.selected(results)).empty
