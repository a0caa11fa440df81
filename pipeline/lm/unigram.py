"""The unigram reference rows: a model that predicts every token from its training frequency alone.
A language model that does not beat it has learnt nothing about context; a DP language model that
does not beat the DP unigram model at the same eps is reported as such.

``fit(rows, mask, V)``: non-private, add-one smoothed token frequencies of the training targets.
``fit_private``: each post contributes its normalised target-token histogram (its counts divided
by its number of targets: L1 norm 1, so L2 norm at most 1), the histograms are summed and Gaussian
noise of std ``sigma`` (the analytic Gaussian multiplier of (eps, delta), sensitivity 1 under
adding or removing one post) is added to every one of the V entries; negative entries are set to
a floor before normalising (post-processing). The same posts and the same targets DP-SGD can reach:
each post's first L + 1 tokens, or, where the training draws a random window of each post
(``dataset.examples=post_window``), every token after its first (a post's histogram normalised over
all its windows, so one post still moves the sum by at most 1 in L1 and L2).
"""

from __future__ import annotations

import math

import torch


def _histograms(rows: torch.Tensor, mask: torch.Tensor, V: int, normalise: bool,
                post: torch.Tensor | None = None) -> torch.Tensor:
    """The targets' counts; ``normalise``: each post's counts divided by its number of targets, over
    all its rows (``post``: the post of each row; None: a row is a post)."""
    targets = rows[:, 1:]
    weights = mask.double()
    if normalise:
        per_row = weights.sum(1)
        if post is None:
            total = per_row
        else:
            total = torch.zeros(int(post.max()) + 1 if post.numel() else 0, dtype=torch.float64).index_add_(0, post, per_row)[post]
        weights = weights / total[:, None].clamp(min=1)
    out = torch.zeros(V, dtype=torch.float64)
    out.index_add_(0, targets[mask], weights[mask])
    return out


def fit(rows: torch.Tensor, mask: torch.Tensor, V: int) -> torch.Tensor:
    """log-probabilities (V,): add-one smoothed counts of the training targets."""
    counts = _histograms(rows, mask, V, normalise=False) + 1.0
    return (counts / counts.sum()).log()


def fit_private(rows: torch.Tensor, mask: torch.Tensor, V: int, *, eps: float, delta: float,
                generator: torch.Generator, floor: float = 1e-3, post: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, float]:
    """(log-probabilities (V,), sigma) of the DP unigram model at (eps, delta); ``post``: the post of
    each row where a post has several (its histogram is normalised over all of them: L1 norm 1)."""
    from pipeline.privacy import gaussian_multiplier

    if not (eps > 0 and math.isfinite(eps)):
        raise ValueError(f"the DP unigram model needs a finite eps > 0, got {eps}")
    sigma = gaussian_multiplier(eps=eps, delta=delta)  # sensitivity 1: one post's histogram has L2 norm <= 1
    noisy = _histograms(rows, mask, V, normalise=True, post=post) + sigma * torch.randn(V, generator=generator,
                                                                                          dtype=torch.float64)
    noisy = noisy.clamp(min=floor)
    return (noisy / noisy.sum()).log(), sigma


def evaluate(logp: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Perplexity and accuracy of the unigram model over every masked target (as ``examples.evaluate``)."""
    targets = rows[:, 1:][mask]
    mean = float(-logp[targets].mean()) if targets.numel() else math.nan
    best = int(logp.argmax())
    return {"perplexity": math.exp(mean), "loss": mean, "accuracy": float((targets == best).double().mean()),
            "tokens": int(targets.numel())}
