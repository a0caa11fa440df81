"""The language-model config's refusals (``pipeline/lm/config.py``): each names its key and value."""

from __future__ import annotations

import math

import pytest
from omegaconf import OmegaConf

from pipeline.lm import config
from pipeline.validation import ConfigError

BASE = {"seed": 0,
        "dataset": {"archive": "news.tar.gz", "valid_fraction": 0.1, "posts": None, "L": 64},
        "vocab": {"kind": "private", "size": 8000, "eps_share": 0.1, "max_pieces": 16},
        "model": {"d": 64, "layers": 2, "heads": 4, "tied": True, "dropout": 0.1},
        "clipping": {"name": "phantom", "C": 1.0},
        "train": {"batch_size": 64, "epochs": 3, "lr": 1e-3, "warmup": 0.1, "weight_decay": 0.0, "accountant": "prv"},
        "privacy": {"eps": 8.0, "delta": 1e-5}}


def _cfg(**changes):
    cfg = OmegaConf.create(BASE)
    for key, value in changes.items():
        OmegaConf.update(cfg, key.replace("__", "."), value, merge=False)
    return cfg


def test_the_base_config_is_accepted():
    s = config.settings(_cfg())
    assert s.vocab_share == 0.1 and s.engine == "phantom" and s.tied and s.posts is None
    assert config.settings(_cfg(vocab__kind="public")).vocab_share == 0.0


@pytest.mark.parametrize("key,value,message", [
    ("clipping__name", "ghost", "clipping.name = 'ghost' cannot clip a tied model"),
    ("clipping__name", "fast", "clipping.name 'fast' is unknown"),
    ("vocab__size", 100, "vocab.size must lie in [257, 50257]"),
    ("vocab__size", 60000, "vocab.size must lie in [257, 50257]"),
    ("vocab__kind", "shared", "vocab.kind 'shared' is unknown"),
    ("vocab__eps_share", 0.0, "vocab.eps_share = 0 with vocab.kind = private"),
    ("vocab__eps_share", 1.0, "vocab.eps_share must lie in [0, 1)"),
    ("model__heads", 3, "model.d = 64 must be a multiple of model.heads = 3"),
    ("model__tied", "yes", "model.tied must be true or false"),
    ("dataset__L", 0, "dataset.L must be a positive integer"),
    ("dataset__valid_fraction", 1.0, "dataset.valid_fraction must lie in (0, 1)"),
    ("privacy__eps", math.inf, "privacy.eps = inf with vocab.kind = private"),
    ("privacy__eps", 0.0, "privacy.eps must lie in (0, 100]"),
    ("privacy__delta", 0.0, "privacy.delta must lie in (0, 1)"),
    ("train__accountant", "gdp", "train.accountant 'gdp' is unknown"),
    ("train__lr", -1.0, "train.lr must be positive"),
    ("clipping__C", 0.0, "clipping.C must be positive"),
    ("model__chunked_head", -1, "model.chunked_head must be 0 (whole logits) or a positive integer"),
    ("model__chunked_head", True, "model.chunked_head must be 0 (whole logits) or a positive integer"),
    ("model__chunked_head", "8192", "model.chunked_head must be 0 (whole logits) or a positive integer"),
])
def test_each_bad_value_is_refused_naming_its_key(key, value, message):
    with pytest.raises(ConfigError) as err:
        config.settings(_cfg(**{key: value}))
    assert str(err.value).startswith(message), str(err.value)


def test_the_chunked_head_is_read_and_refused_with_opacus():
    assert config.settings(_cfg()).chunked_head == 0 and config.settings(_cfg(model__chunked_head=4096)).chunked_head == 4096
    for engine in ("per_sample", "ghost"):
        with pytest.raises(ConfigError, match=f"model.chunked_head = 4096 with clipping.name = '{engine}'"):
            config.settings(_cfg(model__chunked_head=4096, model__tied=False, clipping__name=engine))


def test_a_missing_group_is_named():
    cfg = _cfg()
    del cfg["vocab"]
    with pytest.raises(ConfigError, match="^vocab: task=lm needs a vocab config"):
        config.settings(cfg)


@pytest.mark.parametrize("changes, key, value", [
    ({"model__d": 100000, "model__heads": 1}, "model.d", 100000),  # issue 63: 1.9 TB of parameters, not the batch
    ({"train__batch_size": 100000}, "train.batch_size", 100000),  # the batch's logits
    ({"train__eval_batch": 10**6}, "train.eval_batch", 10**6),  # the evaluation's logits
])
def test_the_memory_refusal_names_the_key_behind_the_largest_part(changes, key, value):
    """A cell too large for the memory is refused naming what makes it large: the parameters (with
    their gradient and Adam's moments) are a model's, which no batch size shrinks."""
    from pipeline.lm import memory

    need = memory.estimate(_cfg(**changes), "cpu")
    largest = max(need.parts, key=need.parts.get)
    assert (need.key, need.value) == (key, value), (need.key, largest)
    if key == "model.d":
        assert largest.startswith("parameters") and need.parts[largest] > 1e12 and "lower model.d" in need.advice
