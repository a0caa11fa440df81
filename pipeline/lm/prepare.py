"""A language-model cell's inputs, before any model: the posts (read, cleaned, split; one side of
the group split where ``dataset.part`` says), the vocabulary (selected with DP, public, the group
split's, or a pretrained model's), and the encoded training rows and evaluation windows.

Everything here is deterministic given the settings and the seed: the split permutation and the
vocabulary's selection noise are the cell's seed's ``split`` and ``vocab`` streams (``streams.py``;
a tied and an untied cell of one seed share their posts and their vocabulary, so their comparison
is paired).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
import torch

from pipeline import progress
from pipeline.lm import config, data, examples, pretrained, streams, vocab

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    tokenizer: object
    eos_id: int
    V: int  # the tokenizer's vocabulary size (a private selection may give fewer than vocab.size)
    rows: torch.Tensor  # (n, L + 1) training rows
    mask: torch.Tensor  # (n, L) their real targets
    splits: dict[str, tuple[torch.Tensor, torch.Tensor]]  # valid, test: windows and their masks
    stats: dict[str, float]
    released: int  # pieces the private selection released (0 for a public vocabulary)
    posts: object = None  # dataset.examples=post_window: every training post's tokens (examples.Posts), drawn from
                          # in training; rows and mask still hold each post's first L + 1 tokens
    reach: tuple | None = None  # (rows, mask, post of each row): every target the training can reach, which the buckets
                                # and the unigram references count: rows and mask themselves (a post's first L + 1
                                # tokens, or every window), or under post_window every token after each post's first


_MEMO: dict[tuple, Prepared] = {}
MEMO_SIZE = 8  # prepared inputs kept per process: a sweep's worker meets each seed's data many times


def _key(s, seed: int) -> tuple:
    """What ``prepare`` reads: the archive (by path, size and time), the split, the counts, the
    vocabulary's settings (its budget only where it is private) and the seed."""
    path = data.resolve(s.archive).resolve()
    st = path.stat()
    budget = (s.vocab_share * s.eps, s.vocab_share * s.delta, s.max_pieces) if s.vocab_kind == "private" else ()
    if s.vocab_kind == "private_groups":
        budget = (s.vocab_eps, s.vocab_delta, s.max_pieces)
    init = ()
    if s.init is not None:  # the pretrained model's tokenizer: its file, by path, size and time
        found = pretrained.path_of(s).resolve()
        init = (str(found), found.stat().st_size, found.stat().st_mtime_ns)
    return (str(path), st.st_size, st.st_mtime_ns, s.valid_fraction, s.posts, s.eval_posts, s.L, s.vocab_kind,
            s.vocab_size, budget, seed, s.part, s.public_groups, s.examples, init)


def prepare(s, seed: int) -> Prepared:
    """The posts, vocabulary and tensors of a cell with settings ``s`` (``config.Settings``), made
    once per process for each distinct input (``_key``: the cells of a sweep that share a seed and
    data settings, tied and untied, every eps of a public vocabulary and every learning rate, share
    one; nothing downstream writes into them)."""
    key = _key(s, seed)
    if key not in _MEMO:
        if len(_MEMO) >= MEMO_SIZE:
            _MEMO.pop(next(iter(_MEMO)))
        _MEMO[key] = _prepare(s, seed)
    return _MEMO[key]


def _prepare(s, seed: int) -> Prepared:
    found_posts = None
    with progress.Progress("preparing data", total=3) as bar:  # seconds to minutes: the vocabulary and the encoding
        bar.start("posts: reading and splitting")
        corpus = data.read_cached(str(data.resolve(s.archive)), public_groups=s.public_groups, part=s.part)
        _, removed = data.deduped_cached(str(data.resolve(s.archive)), s.public_groups if s.part != "all" else None)
        log.info("posts: one message, one side, one privacy unit: %s", removed.line())
        posts = data.split(corpus, valid_fraction=s.valid_fraction, seed=streams.seed_of(seed, "split"))
        train = posts.train[: s.posts] if s.posts else posts.train
        valid = posts.valid[: s.eval_posts] if s.eval_posts else posts.valid
        test = posts.test[: s.eval_posts] if s.eval_posts else posts.test
        released = 0
        if s.init is not None:  # the pretrained model's own (its file was matched to these settings by the validation)
            where = pretrained.path_of(s)
            bar.start(f"vocabulary: {s.vocab_kind}, the pretrained model's ({where})")
            found = pretrained.read(where)
            tokenizer = pretrained.tokenizer(found)
            released = int(found["stats"].get("released_pieces", 0))
        elif s.vocab_kind in ("private", "private_groups"):
            # private: from the training posts, a share of the run's budget; private_groups: from every train-split post
            # of the private groups, at a budget of its own (made once, before a pretraining on the public groups)
            chosen_from = train if s.vocab_kind == "private" else config.vocab_posts(s)
            eps, delta = config.vocab_budget(s)
            bar.start(f"vocabulary: {s.vocab_kind}, DP selection at eps = {eps:g} from {len(chosen_from)} posts, "
                      f"BPE to {s.vocab_size} tokens")
            cal = vocab.calibrate(eps=eps, delta=delta, max_pieces=s.max_pieces)
            chosen = vocab.select(vocab.document_counts(chosen_from, s.max_pieces), cal,
                                  np.random.default_rng(streams.seed_of(seed, "vocab")))
            released = len(chosen)
            tokenizer = vocab.train_private(chosen, s.vocab_size)
        else:
            # public: the training posts themselves (the paper-style assumption); public_groups: every train-split post
            # of the public groups (public text)
            made_from = train if s.vocab_kind == "public" else config.vocab_posts(s)
            bar.start(f"vocabulary: {s.vocab_kind}, BPE to {s.vocab_size} tokens on {len(made_from)} posts")
            tokenizer = vocab.train_public(made_from, s.vocab_size)
        bar.start(f"encoding: {len(train) + len(valid) + len(test)} posts into rows of L = {s.L}")
        eos = tokenizer.token_to_id(vocab.EOS)
        train_ids = examples.encode(train, tokenizer, eos)
        reach = None
        if s.examples == "windows":  # public pretraining: every window of every post (a post is several examples)
            rows, mask, post_of = examples.windows_of(train_ids, s.L, eos)
            reach = (rows, mask, post_of)
        else:  # one post, one example (the privacy unit): its first L + 1 tokens, or a random window of it a step
            rows, mask = examples.training_rows(train_ids, s.L, eos)
            if s.examples == "post_window":
                found_posts = examples.posts(train_ids, s.L, eos)
                reach = examples.windows_of(train_ids, s.L, eos)  # a window can start anywhere: every target
        splits = {name: examples.windows(examples.encode(texts, tokenizer, eos), s.L, eos)
                  for name, texts in (("valid", valid), ("test", test))}
    stats = {"train_posts": len(train), "valid_posts": len(valid), "test_posts": len(test),
             "train_targets": int(mask.sum()), "valid_targets": int(splits["valid"][1].sum()),
             "test_targets": int(splits["test"][1].sum()), "vocab_size": tokenizer.get_vocab_size(),
             "train_examples": int(rows.shape[0]),  # posts, or their windows (dataset.examples=windows)
             "released_pieces": released,  # the share of training posts longer than an example (their tails unread)
             "truncated_share": float(np.mean([len(t) > s.L + 1 for t in train_ids])) if train_ids else math.nan}
    if reach is None:  # one post, one example: its first L + 1 tokens are all the training reads
        reach = (rows, mask, torch.arange(rows.shape[0]))
    stats["reachable_targets"] = int(reach[1].sum())  # what the buckets and the unigram references count
    return Prepared(tokenizer, eos, tokenizer.get_vocab_size(), rows, mask, splits, stats, released, found_posts, reach)
