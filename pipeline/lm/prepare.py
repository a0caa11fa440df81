"""A language-model cell's inputs, before any model: the posts (read, cleaned, split), the
vocabulary (selected with DP, or public), and the encoded training rows and evaluation windows.

Everything here is deterministic given the settings and the seed: the split permutation and the
vocabulary's selection noise are the cell's seed's ``split`` and ``vocab`` streams (``streams.py``;
a tied and an untied cell of one seed share their posts and their vocabulary, so their comparison
is paired).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from pipeline import progress
from pipeline.lm import data, examples, streams, vocab


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


_MEMO: dict[tuple, Prepared] = {}
MEMO_SIZE = 8  # prepared inputs kept per process: a sweep's worker meets each seed's data many times


def _key(s, seed: int) -> tuple:
    """What ``prepare`` reads: the archive (by path, size and time), the split, the counts, the
    vocabulary's settings (its budget only where it is private) and the seed."""
    path = data.resolve(s.archive).resolve()
    st = path.stat()
    budget = (s.vocab_share * s.eps, s.vocab_share * s.delta, s.max_pieces) if s.vocab_kind == "private" else ()
    return (str(path), st.st_size, st.st_mtime_ns, s.valid_fraction, s.posts, s.eval_posts, s.L, s.vocab_kind,
            s.vocab_size, budget, seed)


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
    with progress.Progress("preparing data", total=3) as bar:  # seconds to minutes: the vocabulary and the encoding
        bar.start("posts: reading and splitting")
        posts = data.split(data.read_cached(str(data.resolve(s.archive))), valid_fraction=s.valid_fraction,
                           seed=streams.seed_of(seed, "split"))
        train = posts.train[: s.posts] if s.posts else posts.train
        valid = posts.valid[: s.eval_posts] if s.eval_posts else posts.valid
        test = posts.test[: s.eval_posts] if s.eval_posts else posts.test
        released = 0
        bar.start(f"vocabulary: {s.vocab_kind}, BPE to {s.vocab_size} tokens on {len(train)} posts")
        if s.vocab_kind == "private":
            cal = vocab.calibrate(eps=s.vocab_share * s.eps, delta=s.vocab_share * s.delta, max_pieces=s.max_pieces)
            chosen = vocab.select(vocab.document_counts(train, s.max_pieces), cal,
                                  np.random.default_rng(streams.seed_of(seed, "vocab")))
            released = len(chosen)
            tokenizer = vocab.train_private(chosen, s.vocab_size)
        else:
            tokenizer = vocab.train_public(train, s.vocab_size)
        bar.start(f"encoding: {len(train) + len(valid) + len(test)} posts into rows of L = {s.L}")
        eos = tokenizer.token_to_id(vocab.EOS)
        train_ids = examples.encode(train, tokenizer, eos)
        rows, mask = examples.training_rows(train_ids, s.L, eos)
        splits = {name: examples.windows(examples.encode(texts, tokenizer, eos), s.L, eos)
                  for name, texts in (("valid", valid), ("test", test))}
    stats = {"train_posts": len(train), "valid_posts": len(valid), "test_posts": len(test),
             "train_targets": int(mask.sum()), "valid_targets": int(splits["valid"][1].sum()),
             "test_targets": int(splits["test"][1].sum()), "vocab_size": tokenizer.get_vocab_size(),
             "released_pieces": released,  # the share of training posts longer than an example (their tails unread)
             "truncated_share": float(np.mean([len(t) > s.L + 1 for t in train_ids])) if train_ids else math.nan}
    return Prepared(tokenizer, eos, tokenizer.get_vocab_size(), rows, mask, splits, stats, released)
