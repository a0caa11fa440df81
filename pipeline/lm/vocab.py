"""The vocabulary: a byte-level BPE tokenizer (Hugging Face ``tokenizers``), trained on words
selected with DP (``private``, the default) or on the raw training posts (``public``, the
paper-style assumption that the vocabulary is public: named so wherever it is used).

**Private selection** (partition selection with Gaussian noise; Korolova et al. 2009, Wilson et al.
2020, Gopi et al. 2020). A post is split into pieces by GPT-2's byte-level pre-tokenizer (a word
with its leading space, a run of digits or punctuation, a newline). Each post contributes its first
``max_pieces`` distinct pieces, once each (its *contribution*; nothing else of it is read), so the
document counts c_w = #posts contributing w change by at most 1 in at most ``max_pieces`` places
when one post is added or removed: L2 sensitivity sqrt(max_pieces). The mechanism releases the set
{w : c_w > 0 and c_w + N(0, sigma^2) > tau} (and, for BPE's merges, those noisy counts). It is
(eps, delta)-DP with (``calibrate``):

- sigma = sqrt(max_pieces) * the analytic Gaussian multiplier of (eps, delta_g), delta_g = delta / 2:
  on the pieces both neighbours hold, the noisy counts are a Gaussian mechanism of that sensitivity;
- tau = 1 + sigma * Phi^-1(1 - delta_t / max_pieces), delta_t = delta / (2 e^eps): a piece only the
  added post holds (count 1) passes tau with probability at most delta_t / max_pieces, so some such
  piece is released with probability at most delta_t (event E).

Then P[M(D) in S] <= P[E] + e^eps P[M(D') in S] + delta_g and, with the pieces of D' released
independently of E, P[M(D') in S] <= e^eps P[M(D) in S] / (1 - delta_t) + delta_g <= e^eps
P[M(D) in S] + e^eps delta_t + delta_g: delta_g + e^eps delta_t = delta in both directions. The
tokenizer is post-processing of the release: BPE's merges are learnt from the selected pieces
weighted by their noisy counts. Its share of the run's budget (``vocab.eps_share`` of eps and of
delta) composes with DP-SGD's by basic composition, as Re-Attention's histogram does.

A post's pieces beyond the first ``max_pieces`` distinct ones are not seen by the selection (they
are still trained on: the tokenizer encodes any text, falling back to shorter pieces and bytes).

**The group split's vocabularies** (``dataset.public_groups``; ``prepare.py`` makes them, a
pretraining saves them with its model, ``pretrained.py``): ``public_groups``, ``train_public`` on
every train-split post of the public groups (public text: no privacy cost); ``private_groups``, this
selection on every train-split post of the private groups at a budget of its own (``vocab.eps``,
``vocab.delta``), made once before the pretraining and taken off each fine-tuning's (eps, delta)
(``config.dpsgd_budget``). Neither reads a test post.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass
from statistics import NormalDist
from typing import Iterable

import numpy as np

EOS = "<|endoftext|>"  # ends every post; also the padding token (never a target)
KINDS = ("private", "public", "public_groups", "private_groups")  # the last two: the group split's (``data.side``)


@dataclass(frozen=True)
class Calibration:
    sigma: float  # noise std on each document count
    tau: float  # the release threshold on noisy counts
    delta_gauss: float  # delta of the Gaussian part
    delta_threshold: float  # probability that some piece only one post holds is released


def calibrate(*, eps: float, delta: float, max_pieces: int) -> Calibration:
    """sigma and tau of the selection for (eps, delta)-DP, one post contributing at most
    ``max_pieces`` pieces (the module's docstring derives them)."""
    from pipeline.privacy import gaussian_multiplier

    if not (eps > 0 and math.isfinite(eps)) or not 0 < delta < 1:
        raise ValueError(f"the private vocabulary needs eps > 0 finite and delta in (0, 1), got {eps}, {delta}")
    if max_pieces < 1:
        raise ValueError(f"max_pieces must be at least 1, got {max_pieces}")
    delta_g, delta_t = delta / 2, delta / (2 * math.exp(eps))
    sigma = math.sqrt(max_pieces) * gaussian_multiplier(eps=eps, delta=delta_g)
    tau = 1 + sigma * NormalDist().inv_cdf(1 - delta_t / max_pieces)
    return Calibration(sigma=sigma, tau=tau, delta_gauss=delta_g, delta_threshold=delta_t)


@functools.lru_cache(maxsize=1)
def _pre_tokenizer():
    from tokenizers import pre_tokenizers

    return pre_tokenizers.ByteLevel(add_prefix_space=True)


def pieces(text: str) -> list[str]:
    """The post's pieces as BPE sees them (GPT-2's byte-level pre-tokenizer, a leading space added)."""
    return [p for p, _ in _pre_tokenizer().pre_tokenize_str(text)]


def contribution(text: str, max_pieces: int) -> list[str]:
    """The first ``max_pieces`` distinct pieces of a post, in order: all it gives the selection."""
    seen: dict[str, None] = {}
    for p in pieces(text):
        if p not in seen:
            seen[p] = None
            if len(seen) == max_pieces:
                break
    return list(seen)


def document_counts(posts: Iterable[str], max_pieces: int) -> Counter:
    """c_w: how many posts contribute piece w."""
    counts: Counter = Counter()
    for post in posts:
        counts.update(contribution(post, max_pieces))
    return counts


def select(counts: Counter, cal: Calibration, rng: np.random.Generator) -> dict[str, float]:
    """The released pieces and their noisy counts: noise drawn for every piece with c_w > 0 (in
    sorted order, so the draw does not depend on how the counts were gathered), kept where above tau."""
    words = sorted(counts)
    noisy = np.array([counts[w] for w in words], dtype=np.float64) + rng.normal(0.0, cal.sigma, len(words))
    return {w: float(c) for w, c in zip(words, noisy) if c > cal.tau}


def reachable(posts: Iterable[str], size: int) -> int | None:
    """None if BPE could reach ``size`` tokens from these posts' pieces (a public vocabulary's
    check: a private one is not checked against its posts outside its mechanism), else the most it
    could: the 256 bytes, the end-of-text token and one token per merge, and a merge joins two
    tokens of some distinct piece, so a piece of k bytes allows at most k - 1 of them. Reads posts
    only until the bound passes ``size`` (a few hundred posts for GPT-2's 50,257)."""
    seen: set[str] = set()
    most = 257
    for post in posts:
        for w in pieces(post):
            if w not in seen:
                seen.add(w)
                most += len(w) - 1
        if most >= size:
            return None
    return most


def _trainer(vocab_size: int):
    from tokenizers import pre_tokenizers, trainers

    return trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet())


def _finish(tok):
    from tokenizers import decoders, pre_tokenizers

    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def train_private(released: dict[str, float], vocab_size: int):
    """A byte-level BPE tokenizer whose merges are learnt from the released pieces, each weighted by
    its noisy count (rounded; post-processing of the release). Its vocabulary holds at most
    ``vocab_size`` tokens: fewer where the released pieces allow fewer merges."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # a released piece holds no space: it is one word
    lines = (" ".join([w] * max(1, int(round(c)))) for w, c in released.items())
    tok.train_from_iterator(lines, trainer=_trainer(vocab_size))
    return _finish(tok)


_PUBLIC: dict[tuple, object] = {}  # (posts, size) -> the trained tokenizer: validation trains it, the cell reuses it
PUBLIC_KEPT = 8  # tokenizers kept per process (a sweep's seeds each split the posts their own way)


def train_public(posts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer trained on the posts themselves (``vocab=public``: the vocabulary
    is treated as public, as the paper-style baselines do; no DP for it). Kept per process for the
    same posts and size: the config's validation trains it to learn the size BPE reaches
    (``public_size``), and the cell then uses the same tokenizer."""
    from tokenizers import Tokenizer, models

    key = (tuple(posts), int(vocab_size))
    if key not in _PUBLIC:
        tok = _finish(Tokenizer(models.BPE()))
        tok.train_from_iterator(posts, trainer=_trainer(vocab_size))
        if len(_PUBLIC) >= PUBLIC_KEPT:
            _PUBLIC.pop(next(iter(_PUBLIC)))
        _PUBLIC[key] = tok
    return _PUBLIC[key]


def public_size(posts: list[str], size: int) -> int | None:
    """None if a public tokenizer trained on ``posts`` holds ``size`` tokens, else how many it holds:
    BPE stops when no two tokens of a piece are left to merge, and how many merges that allows
    depends on their order, so the exact figure is the trained tokenizer's (seconds on every
    training post; ``reachable``'s bound first, which refuses most sizes without training)."""
    if (most := reachable(posts, size)) is not None:
        return most
    made = train_public(list(posts), size).get_vocab_size()
    return None if made >= size else made
