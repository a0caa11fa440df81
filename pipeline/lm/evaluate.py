"""The language model's evaluation: test (and validation) perplexity and next-token accuracy over
every token (``examples.windows``: each token after a post's first predicted once, padding never a
target), the same over the tokens of each frequency bucket, and the reference rows.

**Frequency buckets** (experiment 2, "where tying helps": DPFormer's effective-error argument,
Claim 5.4, says the rare tokens gain most). Token ids are ranked by their count among the training
targets (the rows DP-SGD trains on); ``head`` holds the most frequent ids that cover the first
``HEAD`` share of the training targets, ``torso`` the next ones up to ``TORSO``, ``tail`` the rest
and every id never seen in training. A documented choice (the paper names no cut). The counts are
read from the private training rows, so the buckets are a measurement tool of the experimenter,
not released with the model.

**Reference rows** (``unigram.py``): ``unigram``, add-one smoothed training frequencies (non-private);
``unigram_dp``, the DP unigram model with DP-SGD's share of the budget (the vocabulary's share is
spent on the same vocabulary), for a private run: a yardstick of what the same budget buys
without a Transformer, **a second mechanism on the same posts**, whose budget is not composed with
the model's (a cell that published both would have spent it twice). A DP language model that
does not beat ``unigram_dp`` has learnt nothing the DP frequencies do not give; the sweep's table
says so.
"""

from __future__ import annotations

import math

import torch

from pipeline.lm import examples, streams, unigram

BUCKETS = ("head", "torso", "tail")
HEAD, TORSO = 0.5, 0.9  # cumulative shares of the training targets: head up to 50%, torso to 90%, tail the rest


def buckets(rows: torch.Tensor, mask: torch.Tensor, V: int) -> torch.Tensor:
    """(V,) bucket index (0 head, 1 torso, 2 tail) of each token id, from the training targets."""
    counts = torch.zeros(V, dtype=torch.float64)
    counts.index_add_(0, rows[:, 1:][mask], torch.ones(int(mask.sum()), dtype=torch.float64))
    order = torch.argsort(counts, descending=True, stable=True)
    before = torch.cumsum(counts[order], 0) - counts[order]  # the targets covered by the ids ranked above
    share = before / counts.sum().clamp(min=1)
    out = torch.full((V,), 2, dtype=torch.long)
    out[order[share < TORSO]] = 1
    out[order[share < HEAD]] = 0
    out[counts == 0] = 2
    return out


def model_rows(model, splits: dict[str, tuple[torch.Tensor, torch.Tensor]], bucket_of: torch.Tensor,
               batch_size: int) -> list[dict]:
    """One row per split: the model's perplexity, accuracy, loss and tokens, overall and per bucket."""
    return [{"method": "lm", "split": split, **examples.evaluate(model, r, m, batch_size, bucket_of, BUCKETS)}
            for split, (r, m) in splits.items()]


def reference_rows(train_rows: torch.Tensor, train_mask: torch.Tensor, V: int,
                   splits: dict[str, tuple[torch.Tensor, torch.Tensor]], bucket_of: torch.Tensor, *,
                   eps: float, delta: float, seed: int, post: torch.Tensor | None = None) -> list[dict]:
    """The unigram rows (and the DP unigram's where eps is finite) on each split, fitted on every
    target the training can reach (``Prepared.reach``: ``post`` the post of each row)."""
    models = {"unigram": unigram.fit(train_rows, train_mask, V)}
    if math.isfinite(eps):
        gen = torch.Generator().manual_seed(streams.seed_of(seed, "unigram"))  # its own stream: not DP-SGD's
        models["unigram_dp"], _ = unigram.fit_private(train_rows, train_mask, V, eps=eps, delta=delta, generator=gen,
                                                      post=post)
    out = []
    for name, logp in models.items():
        for split, (r, m) in splits.items():
            row = {"method": name, "split": split, **unigram.evaluate(logp, r, m)}
            targets = r[:, 1:][m]
            for j, bucket in enumerate(BUCKETS):
                picked = targets[bucket_of[targets] == j]
                row[f"perplexity_{bucket}"] = math.exp(float(-logp[picked].mean())) if picked.numel() else math.nan
                row[f"tokens_{bucket}"] = int(picked.numel())
            out.append(row)
    return out
