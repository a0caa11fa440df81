"""Attacks on the training prompts (Section 5).

``perturb`` replaces the chosen prompts of every trial by E_bad(mu, alpha) of (5.1): every
coordinate of every token x (context and query) plus mu, every context response plus
alpha = c N^p, and the query response too when ``shift_query_response`` (the authors'
code). The chosen prompts' raw tokens were kept by the data step; everything else about
the problem (the other prompts, the test prompts) is shared with the clean one.
"""

from __future__ import annotations

import dataclasses

from pipeline import lazy
from pipeline.noisyhead.features import Features, from_tokens, privatize

torch = lazy.module("torch")  # imported at first use: the config's checks load this module (pipeline/lazy.py)


def alpha(spec, N: int) -> float:
    return float(spec.c) * N ** float(spec.p)


def _replace(feats: Features, index: torch.Tensor, new: Features) -> Features:
    rows = torch.arange(index.shape[0], device=index.device).unsqueeze(1)
    out = Features(feats.q.clone(), feats.v.clone(), feats.y.clone())
    out.q[rows, index], out.v[rows, index], out.y[rows, index] = new.q, new.v, new.y
    return out


def perturb(problem, const, spec):
    """The attacked copy of a clean problem."""
    kept = problem.kept
    shift = torch.full_like(kept.y, alpha(spec, const.N))
    if not spec.shift_query_response:
        shift[..., -1] = 0
    x, y = kept.x + float(spec.mu), kept.y + shift
    raw = from_tokens(x, y)
    private = privatize(from_tokens(x, y, clip=const.C), const.G)
    return dataclasses.replace(
        problem,
        train=_replace(problem.train, kept.index, raw),
        private=_replace(problem.private, kept.index, private),
        fingerprint=f"{problem.fingerprint}+perturb(mu={spec.mu},c={spec.c},p={spec.p})",
        fits={},
    )


ATTACKS = {"perturb": perturb}
