"""Validation of a language-model config (``task: lm``, the ``experiment=lm_*`` presets), before
anything is read, computed or logged: each refusal a :class:`pipeline.validation.ConfigError`
naming the key and the value (the entry point prints one ``error:`` line, exit 2). Imports no torch:
a refused config answers at once.

The keys (``conf/lm/``'s groups and ``conf/lm/experiment/lm_cpu.yaml``, where each is commented):

- ``dataset``: ``archive`` (the bydate tarball), ``valid_fraction``, ``posts`` (null: every
  training post; a count: the first ones, for small presets), ``eval_posts`` (null: every
  validation and test post; a count: the first ones), ``L`` (tokens per example),
  ``public_groups`` (the newsgroups on the public side), ``part`` (all, public or private: the
  posts a cell reads), ``examples`` (post: one example per post, its first tokens; post_window:
  one example per post, a random window of it drawn afresh each step; windows: every window, public
  pretraining only);
- ``vocab``: ``kind`` (private, public, public_groups or private_groups), ``size`` (BPE's target),
  ``eps_share`` (the private vocabulary's share of eps and of delta), ``max_pieces`` (a post's
  contribution), ``eps`` and ``delta`` (private_groups: the selection's own budget, spent once);
- ``model``: ``d``, ``layers``, ``heads``, ``tied``, ``dropout``, ``init`` (a pretrained model to
  fine-tune, ``pretrained.py``), ``save`` (where a pretraining writes its model);
- ``clipping``: ``name`` (phantom, per_sample, ghost, none), ``C``;
- ``train``: ``batch_size``, ``epochs``, ``lr``, ``warmup``, ``weight_decay``, ``accountant``,
  ``max_physical_batch``, ``eval_batch``, ``validate_every``, ``threads``, ``checkpoint``,
  ``distributed`` (null, or ddp under torchrun: ``ranks.py``);
- ``privacy``: ``eps``, ``delta`` (the run's whole budget, the vocabulary's share included).

A budget DP-SGD's accountant cannot reach with the run's sampling rate and steps is refused here
(``pipeline.dpsgd.check``), before the posts are prepared and before any folder or run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from omegaconf import DictConfig

from pipeline import validation
from pipeline.dpsgd import planning
from pipeline.lm import data, engines, ranks, vocab
from pipeline.validation import ConfigError

ACCOUNTANTS = planning.ACCOUNTANTS
MIN_VOCAB = 257  # the 256 bytes and the end-of-text token: below this BPE cannot encode every text
MAX_VOCAB = 50257  # GPT-2's vocabulary, the issue's largest


@dataclass(frozen=True)
class Settings:
    archive: str
    valid_fraction: float
    posts: int | None
    eval_posts: int | None
    L: int
    vocab_kind: str
    vocab_size: int
    vocab_share: float  # 0 for a public vocabulary
    max_pieces: int
    d: int
    layers: int
    heads: int
    tied: bool
    dropout: float
    engine: str
    C: float
    batch_size: int
    epochs: int
    lr: float
    warmup: float
    weight_decay: float
    accountant: str
    max_physical_batch: int | None
    eval_batch: int
    validate_every: int
    threads: int | None
    checkpoint: bool
    eps: float
    delta: float
    seed: int
    public_groups: tuple[str, ...] | None = None
    part: str = "all"  # the posts a cell reads: every group's, the public groups' or the private groups'
    examples: str = "post"  # post: a post's first L + 1 tokens, one example; post_window: a random window of the post,
                            # drawn afresh each step, one example; windows: every window (public only)
    init: str | None = None  # a pretrained model (file or folder) to start from
    save: str | None = None  # the folder a pretraining writes its model into
    vocab_eps: float = 0.0  # private_groups: the selection's own (eps, delta), spent once and taken off DP-SGD's
    vocab_delta: float = 0.0
    chunked_head: int = 0  # > 0: the training loss reads the output layer this many vocabulary rows at a time
    distributed: str | None = None  # ddp: one cell's DP-SGD across the processes torchrun started (ranks.py)


EXAMPLES = ("post", "post_window", "windows")
GROUP_KINDS = ("public_groups", "private_groups")  # vocabularies of the group split: they need dataset.public_groups


def vocab_budget(s: Settings) -> tuple[float, float]:
    """The (eps, delta) the vocabulary spends of the run's budget: a share of it (``private``), its
    own budget, selected once before a pretraining (``private_groups``), or nothing (public kinds)."""
    if s.vocab_kind == "private":
        return s.vocab_share * s.eps, s.vocab_share * s.delta
    if s.vocab_kind == "private_groups":
        return s.vocab_eps, s.vocab_delta
    return 0.0, 0.0


def dpsgd_budget(s: Settings) -> tuple[float, float]:
    """DP-SGD's part of the run's (eps, delta) (and the DP unigram yardstick's): what the vocabulary
    leaves, by basic composition."""
    if s.vocab_kind == "private_groups":
        return s.eps - s.vocab_eps, s.delta - s.vocab_delta
    return (1 - s.vocab_share) * s.eps, (1 - s.vocab_share) * s.delta


def _unit(value, key: str, *, closed_low: bool = True, closed_high: bool = False) -> float:
    x = validation.number(value, key)
    ok = (x >= 0 if closed_low else x > 0) and (x <= 1 if closed_high else x < 1)
    if not ok:
        raise ConfigError(f"{key} must lie in {'[' if closed_low else '('}0, 1{']' if closed_high else ')'}, got {value!r}")
    return x


def _choice(value, key: str, known) -> str:
    if value not in known:
        raise ConfigError(f"{key} {value!r} is unknown; known: {list(known)}")
    return value


def settings(cfg: DictConfig) -> Settings:
    """The checked settings of ``cfg``; ConfigError on the first bad value."""
    for group in ("dataset", "vocab", "model", "clipping", "train", "privacy"):
        if cfg.get(group) is None:
            raise ConfigError(f"{group}: task=lm needs a {group} config (use an experiment=lm_* preset)")
    ds, vc, m, cl, tr, pr = cfg.dataset, cfg.vocab, cfg.model, cfg.clipping, cfg.train, cfg.privacy
    if not isinstance(ds.archive, str) or not ds.archive:
        raise ConfigError(f"dataset.archive must be a path, got {ds.archive!r}")
    valid_fraction = _unit(ds.valid_fraction, "dataset.valid_fraction", closed_low=False)
    posts = None if ds.posts is None else validation.positive_int(ds.posts, "dataset.posts")
    eval_posts = None if ds.get("eval_posts") is None else validation.positive_int(ds.eval_posts, "dataset.eval_posts")
    L = validation.positive_int(ds.L, "dataset.L")
    try:
        public_groups = data.check_groups(ds.get("public_groups"))
    except data.DataError as err:
        raise ConfigError(str(err)) from None
    part = _choice(ds.get("part", "all"), "dataset.part", data.PARTS)
    if part != "all" and public_groups is None:
        raise ConfigError(f"dataset.part = {part!r} needs dataset.public_groups (the groups of the public side), got null")
    examples = _choice(ds.get("examples", "post"), "dataset.examples", EXAMPLES)
    kind = _choice(vc.kind, "vocab.kind", vocab.KINDS)
    if kind in GROUP_KINDS and public_groups is None:
        raise ConfigError(f"vocab.kind = {kind!r} needs dataset.public_groups (the groups of the public side), got null")
    size = validation.positive_int(vc.size, "vocab.size")
    if not MIN_VOCAB <= size <= MAX_VOCAB:
        raise ConfigError(f"vocab.size must lie in [{MIN_VOCAB}, {MAX_VOCAB}] (the bytes and end-of-text at least, "
                          f"GPT-2's vocabulary at most), got {size!r}")
    share = _unit(vc.eps_share, "vocab.eps_share") if kind == "private" else 0.0
    if kind == "private" and share == 0:
        raise ConfigError("vocab.eps_share = 0 with vocab.kind = private: a private vocabulary needs a share of the "
                          "budget (or use vocab.kind=public, the paper-style assumption)")
    max_pieces = validation.positive_int(vc.max_pieces, "vocab.max_pieces")
    vocab_eps = vocab_delta = 0.0
    if kind == "private_groups":
        vocab_eps = validation.number(vc.get("eps"), "vocab.eps")
        if not (vocab_eps > 0 and math.isfinite(vocab_eps)):
            raise ConfigError(f"vocab.eps must be positive and finite (the private groups' vocabulary's budget), "
                              f"got {vc.get('eps')!r}")
        vocab_delta = _unit(vc.get("delta"), "vocab.delta", closed_low=False)
    d, layers, heads = (validation.positive_int(m[k], f"model.{k}") for k in ("d", "layers", "heads"))
    if d % heads:
        raise ConfigError(f"model.d = {d} must be a multiple of model.heads = {heads}")
    if not isinstance(m.tied, bool):
        raise ConfigError(f"model.tied must be true or false, got {m.tied!r}")
    dropout = _unit(m.dropout, "model.dropout")
    engine = _choice(cl.name, "clipping.name", engines.ENGINES)
    chunked_head = m.get("chunked_head", 0)
    if isinstance(chunked_head, bool) or not isinstance(chunked_head, int) or not 0 <= chunked_head <= validation.MAX_INT:
        raise ConfigError(f"model.chunked_head must be 0 (whole logits) or a positive integer (vocabulary rows at a "
                          f"time), got {chunked_head!r}")
    if chunked_head and engine in ("per_sample", "ghost"):
        raise ConfigError(f"model.chunked_head = {chunked_head} with clipping.name = {engine!r}: the chunked output "
                          "layer is read by the shared engine only (Opacus forms the logits' per-post gradients); use "
                          "clipping=phantom, or model.chunked_head=0")
    if engine == "ghost" and m.tied:
        raise ConfigError("clipping.name = 'ghost' cannot clip a tied model (model.tied = true): Opacus's ghost "
                          "clipping refuses a parameter used twice; use clipping=phantom, or model.tied=false")
    C = validation.number(cl.C, "clipping.C")
    if C <= 0:
        raise ConfigError(f"clipping.C must be positive, got {cl.C!r}")
    batch_size = validation.positive_int(tr.batch_size, "train.batch_size")
    epochs = validation.positive_int(tr.epochs, "train.epochs")
    lr = validation.number(tr.lr, "train.lr")
    if lr <= 0:
        raise ConfigError(f"train.lr must be positive, got {tr.lr!r}")
    warmup = _unit(tr.warmup, "train.warmup")
    weight_decay = validation.number(tr.weight_decay, "train.weight_decay")
    if weight_decay < 0:
        raise ConfigError(f"train.weight_decay must be >= 0, got {tr.weight_decay!r}")
    accountant = _choice(tr.accountant, "train.accountant", ACCOUNTANTS)
    chunk = tr.get("max_physical_batch")
    chunk = None if chunk is None else validation.positive_int(chunk, "train.max_physical_batch")
    eval_batch = validation.positive_int(tr.get("eval_batch", 64), "train.eval_batch")
    validate_every = validation.positive_int(tr.get("validate_every", 1), "train.validate_every")
    threads = validation.threads(tr.get("threads"), "train.threads")
    distributed = tr.get("distributed")
    if distributed == "fsdp":
        raise ConfigError("train.distributed = 'fsdp': the language model's cells run replicated across processes "
                          "(train.distributed=ddp); sharding by FSDP2 is the trainer's (pipeline.dpsgd.distributed."
                          "DistributedDPSGD, examples/dpsgd_distributed.py --mode fsdp)")
    if distributed is not None and distributed not in ranks.MODES:
        raise ConfigError(f"train.distributed must be null (one process) or 'ddp' (one cell across the processes "
                          f"torchrun starts), got {distributed!r}")
    checkpoint = tr.get("checkpoint", True)
    if not isinstance(checkpoint, bool):
        raise ConfigError(f"train.checkpoint must be true or false, got {checkpoint!r}")
    eps = pr.eps if pr.eps == math.inf else validation.number(pr.eps, "privacy.eps")
    if not (eps > 0 and (eps == math.inf or eps <= validation.MAX_EPS)):
        raise ConfigError(f"privacy.eps must lie in (0, {validation.MAX_EPS:g}] or be inf, got {pr.eps!r}")
    if eps == math.inf and kind == "private":
        raise ConfigError("privacy.eps = inf with vocab.kind = private: an infinite budget selects no vocabulary "
                          "with noise; use vocab.kind=public for a non-private run")
    if engine == "none" and eps != math.inf:
        raise ConfigError(f"clipping.name = 'none' trains without clipping or noise, and privacy.eps = {pr.eps!r} "
                          "promises a guarantee: use privacy.eps=inf for the non-private run")
    delta = _unit(pr.delta, "privacy.delta", closed_low=False)
    if kind == "private_groups" and math.isfinite(eps) and not (vocab_eps < eps and vocab_delta < delta):
        raise ConfigError(f"vocab.eps = {vocab_eps:g} and vocab.delta = {vocab_delta:g} (the private groups' vocabulary) "
                          f"must each be less than privacy.eps = {pr.eps!r} and privacy.delta = {pr.delta!r}: DP-SGD "
                          f"gets what the vocabulary leaves")
    if examples == "windows" and eps != math.inf:
        raise ConfigError(f"dataset.examples = 'windows' trains on every window of every post, so a post is several "
                          f"examples and privacy.eps = {pr.eps!r} would not hold per post: windows are for public "
                          f"pretraining (privacy.eps=inf, clipping.name=none)")
    init, save = (_path(m.get(k), f"model.{k}") for k in ("init", "save"))
    if init is not None and part != "private":
        raise ConfigError(f"model.init = {init!r} with dataset.part = {part!r}: a pretrained model has read the public "
                          f"groups, so it is fine-tuned on the private ones only (dataset.part=private)")
    if save is not None and (part != "public" or kind not in GROUP_KINDS or init is not None):
        raise ConfigError(f"model.save = {save!r} writes a model pretrained on the public groups: it needs "
                          f"dataset.part = public (got {part!r}), vocab.kind public_groups or private_groups (got "
                          f"{kind!r}) and no model.init (got {init!r})")
    return Settings(ds.archive, valid_fraction, posts, eval_posts, L, kind, size, share, max_pieces, d, layers, heads,
                    m.tied, dropout, engine, C, batch_size, epochs, lr, warmup, weight_decay, accountant, chunk, eval_batch,
                    validate_every, threads, checkpoint, eps, delta, validation.seed(cfg.seed), public_groups, part,
                    examples, init, save, vocab_eps, vocab_delta, chunked_head, distributed)


def _path(value, key: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key} must be a path or null, got {value!r}")
    return value


PLAN_KEYS = {"eps": "privacy.eps", "delta": "privacy.delta", "batch_size": "train.batch_size",
             "epochs": "train.epochs", "accountant": "train.accountant"}


def calibrates(s: Settings, posts: int) -> None:
    """Refuse (one ``error:`` line naming the key and value) a budget whose DP-SGD share the accountant
    cannot reach at q = B / posts over the run's steps (``pipeline.dpsgd.check``: the plan the run makes)."""
    if s.engine == "none":
        return
    if s.vocab_kind != "private_groups":
        planning.check(eps=s.eps, delta=s.delta, n=posts, batch_size=s.batch_size, epochs=s.epochs,
                       accountant=s.accountant, share=s.vocab_share, keys=PLAN_KEYS)
        return
    eps, delta = dpsgd_budget(s)
    try:
        planning.check(eps=eps, delta=delta, n=posts, batch_size=s.batch_size, epochs=s.epochs,
                       accountant=s.accountant, keys=PLAN_KEYS)
    except ConfigError as err:
        raise ConfigError(f"DP-SGD's part of the budget, what vocab.eps = {s.vocab_eps:g} and vocab.delta = "
                          f"{s.vocab_delta:g} leave of privacy.eps = {s.eps:g} and privacy.delta = {s.delta:g}: "
                          f"{err}") from None


def validate(cfg: DictConfig) -> Settings:
    """The settings of a language-model cell, every refusal before any folder or run: the values
    (``settings``), the pretrained model a fine-tuning starts from (``model.init``: read and matched
    here), then the archive (read and split here, cached for the cell) and the counts it allows."""
    from pipeline.lm import pretrained, streams

    s = settings(cfg)
    ranks.check(s.distributed, cfg)  # the environment's part: torchrun's, before any data
    if s.posts is not None:  # the training set's size is known: the budget is checked before the archive is read
        calibrates(s, s.posts)
    path = data.resolve(s.archive)
    if (why := validation.not_a_file(path)) is not None:
        raise ConfigError(f"dataset.archive = {s.archive!r}: {why}")
    if s.init is not None:  # the file, then its settings against the cell's (the archive's digest among them)
        pretrained.check(s)
    try:  # read here (once per process), so that a damaged archive is refused before any folder
        corpus = data.read_cached(str(path), public_groups=s.public_groups, part=s.part)
        posts = data.split(corpus, valid_fraction=s.valid_fraction, seed=streams.seed_of(s.seed, "split")).train
    except data.DataError as err:
        raise ConfigError(str(err)) from None
    train = len(posts)
    if s.posts is not None and s.posts > train:
        raise ConfigError(f"dataset.posts = {s.posts} is more than the {train} training posts of {s.archive!r}")
    if s.batch_size > (s.posts or train):
        raise ConfigError(f"train.batch_size = {s.batch_size} is more than the {s.posts or train} training posts")
    if s.posts is None:  # every training post: their count is the archive's
        calibrates(s, train)
    # a public vocabulary only: its size is read from the posts (the tokenizer is trained here, once per process, and
    # the cell uses it), which a private vocabulary may not do outside its mechanism (a private selection that
    # releases fewer pieces gives a smaller vocabulary, logged as data.vocab_size); a pretrained model's is its own
    most = None
    if s.init is None and s.vocab_kind == "public":
        most = vocab.public_size(posts[: s.posts] if s.posts else posts, s.vocab_size)
        where, more = f"the {s.posts or train} training posts", ", or more dataset.posts"
    elif s.init is None and s.vocab_kind == "public_groups":
        public = vocab_posts(s)
        most = vocab.public_size(public, s.vocab_size)
        where, more = f"the public groups' {len(public)} train-split posts", ""
    if most is not None:
        raise ConfigError(f"vocab.size = {s.vocab_size} is more than BPE makes from {where} (a public tokenizer of "
                          f"at most {most} tokens): use vocab.size={most} or less{more}")
    return s


def vocab_posts(s: Settings) -> list[str]:
    """The posts a vocabulary of the group split is made from: every train-split post of the public
    groups (``public_groups``: public, read whole) or of the private groups (``private_groups``: read
    by the DP selection only); neither reads a test post."""
    side = "public" if s.vocab_kind == "public_groups" else "private"
    return data.read_cached(str(data.resolve(s.archive)), public_groups=s.public_groups, part=side)["train"]
