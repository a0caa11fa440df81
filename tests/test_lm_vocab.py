"""The private vocabulary (``pipeline/lm/vocab.py``): its calibration against the closed forms,
the contribution bound by brute force, the (eps, delta) bound of the released set by an exact
worst-case search, and the tokenizers it trains."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from statistics import NormalDist

import numpy as np
import pytest

from pipeline import privacy
from pipeline.lm import vocab


@pytest.mark.parametrize("eps,delta,k", [(0.5, 1e-6, 16), (1.0, 1e-5, 64), (4.0, 1e-3, 1)])
def test_the_calibration_meets_its_closed_forms(eps, delta, k):
    cal = vocab.calibrate(eps=eps, delta=delta, max_pieces=k)
    assert cal.delta_gauss + math.exp(eps) * cal.delta_threshold == pytest.approx(delta, rel=1e-12)
    # the Gaussian part: sensitivity sqrt(k), std sigma -> exactly (eps, delta_gauss) (Balle and Wang)
    assert privacy.gaussian_delta(mu=math.sqrt(k) / cal.sigma, eps=eps) == pytest.approx(cal.delta_gauss, rel=1e-3)
    # the threshold: k pieces of count 1 pass it with probability delta_threshold at most (union bound)
    assert k * (1 - NormalDist().cdf((cal.tau - 1) / cal.sigma)) == pytest.approx(cal.delta_threshold, rel=1e-6)


def test_refusals():
    for bad in ({"eps": 0.0, "delta": 1e-5}, {"eps": math.inf, "delta": 1e-5}, {"eps": 1.0, "delta": 0.0}):
        with pytest.raises(ValueError, match="the private vocabulary needs"):
            vocab.calibrate(**bad, max_pieces=4)
    with pytest.raises(ValueError, match="max_pieces"):
        vocab.calibrate(eps=1.0, delta=1e-5, max_pieces=0)


POSTS = ["Hello world, hello again.", "The world is round\nand the sky is blue.", "caf\xe9 au lait 123 456!",
         "A long post " + " ".join(f"word{i}" for i in range(50)), ""]


@pytest.mark.parametrize("k", [1, 3, 8, 100])
def test_one_post_moves_at_most_k_counts_by_one(k):
    """Brute force over every post added to every subset of the others: the counts differ by 1 in
    at most k places (the sensitivity the calibration assumes)."""
    for added in range(len(POSTS)):
        rest = [p for i, p in enumerate(POSTS) if i != added]
        for r in range(len(rest) + 1):
            for subset in itertools.combinations(rest, r):
                diff = vocab.document_counts([*subset, POSTS[added]], k)
                diff.subtract(vocab.document_counts(subset, k))
                changed = {w: c for w, c in diff.items() if c}
                assert len(changed) <= k and set(changed.values()) <= {1}


def test_contribution_is_a_posts_first_distinct_pieces():
    assert vocab.contribution("a b a c b d", 3) == ["Ġa", "Ġb", "Ġc"]
    assert vocab.pieces("Hi there") == ["ĠHi", "Ġthere"]


def _release_probabilities(counts: dict[str, int], cal) -> dict[str, float]:
    return {w: 1 - NormalDist().cdf((cal.tau - c) / cal.sigma) for w, c in counts.items() if c > 0}


def _hockey_stick(p: dict[str, float], q: dict[str, float], eps: float) -> float:
    """max over sets S of released sets of P[M(D) in S] - e^eps P[M(D') in S], exactly: every
    outcome (subset of pieces) enumerated, pieces released independently; a piece absent from a
    data set is never released there."""
    words = sorted(set(p) | set(q))
    total = 0.0
    for bits in itertools.product((0, 1), repeat=len(words)):
        pd = pq = 1.0
        for w, b in zip(words, bits):
            pw, qw = p.get(w, 0.0), q.get(w, 0.0)
            pd *= pw if b else 1 - pw
            pq *= qw if b else 1 - qw
        total += max(0.0, pd - math.exp(eps) * pq)
    return total


@pytest.mark.parametrize("eps,delta,k", [(1.0, 0.05, 1), (1.0, 0.05, 2), (0.5, 0.1, 3), (2.0, 0.01, 2)])
def test_the_released_set_is_eps_delta_dp_in_a_worst_case_search(eps, delta, k):
    """Neighbours D' and D = D' plus one post contributing k pieces: pieces it shares with D'
    (their counts near tau, where a count of 1 matters most) and pieces only it holds. Every split
    of its k pieces, other counts on a grid around tau: the exact hockey-stick divergence of the
    released sets, both directions, is at most delta."""
    worst = _worst(vocab.calibrate(eps=eps, delta=delta, max_pieces=k), eps, k)
    assert worst <= delta
    assert worst > delta / 50  # the search reaches the regime the bound is about


def test_selection_draws_do_not_depend_on_the_counts_order():
    a = Counter({"x": 50, "y": 3, "z": 200})
    b = Counter({"z": 200, "x": 50, "y": 3})
    cal = vocab.calibrate(eps=1.0, delta=1e-5, max_pieces=2)
    ra, rb = vocab.select(a, cal, np.random.default_rng(0)), vocab.select(b, cal, np.random.default_rng(0))
    assert ra == rb and "z" in ra and "y" not in ra


def test_the_tokenizers_encode_any_text_and_respect_the_vocabulary_size():
    released = {"Ġhello": 300.0, "Ġworld": 120.0, "Ġthe": 900.0, ",": 500.0}
    tok = vocab.train_private(released, 400)
    assert tok.get_vocab_size() <= 400 and tok.token_to_id(vocab.EOS) == 0
    assert len(tok.encode("hello world").ids) == 2  # released pieces are one token each
    text = "unseen wörds, 123 — and bytes \x7f"
    assert tok.decode(tok.encode(text).ids) == " " + text  # byte fallback: nothing is lost (a leading space added)
    public = vocab.train_public(POSTS * 20, 300)
    assert public.get_vocab_size() == 300
    assert public.decode(public.encode(POSTS[1]).ids) == " " + POSTS[1]


def _worst(cal, eps: float, k: int) -> float:
    grid = sorted({max(1, int(round(cal.tau + s * cal.sigma))) for s in (-1.0, -0.5, 0.0, 0.5)})
    worst = 0.0
    for shared in range(k + 1):
        for base in itertools.product(grid, repeat=shared):
            before = {f"s{i}": c for i, c in enumerate(base)} | {"other": grid[0]}
            after = {w: c + (w != "other") for w, c in before.items()} | {f"u{i}": 1 for i in range(k - shared)}
            p, q = _release_probabilities(after, cal), _release_probabilities(before, cal)
            worst = max(worst, _hockey_stick(p, q, eps), _hockey_stick(q, p, eps))
    return worst


def test_the_search_catches_its_negative_controls():
    """The same search flags a selection calibrated for one piece per post while a post gives four
    (sigma too small by 2) and one whose threshold ignores the pieces only one post holds."""
    import dataclasses

    eps, delta, k = 1.0, 0.05, 4
    cal = vocab.calibrate(eps=eps, delta=delta, max_pieces=k)
    assert _worst(cal, eps, k) <= delta
    assert _worst(dataclasses.replace(cal, sigma=cal.sigma / math.sqrt(k)), eps, k) > 2 * delta
    assert _worst(dataclasses.replace(cal, tau=1 + cal.sigma), eps, k) > 2 * delta
