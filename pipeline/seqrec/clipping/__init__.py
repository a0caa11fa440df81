"""Clipping engines: each turns a batch of users into the clipped sum of their gradients, left in
``p.grad`` (noise is added by the training step, ``pipeline/seqrec/train.py``).

``none``: the plain (unclipped) sum, the non-private baseline. ``phantom``: Phantom Clipping (per-user
norms from ``norms.py``, clipped sum by a second backward pass). ``per_sample``: Opacus's hooks mode,
per-user gradients instantiated (the reference). ``ghost``: Opacus's fast gradient (Ghost) clipping,
untied models only.

Every engine has ``step(ids, targets) -> (per-user losses, per-user gradient norms or None)``.
"""

from __future__ import annotations

import torch

ENGINES = ("none", "phantom", "per_sample", "ghost")
RULES = ("automatic", "classic")


def coefficients(norms: torch.Tensor, *, C: float, rule: str, gamma: float) -> torch.Tensor:
    """Per-user scale c_i with ||c_i g_i|| <= C.

    ``automatic`` (Bu et al., the paper's choice with C = 1): c_i = C / (||g_i|| + gamma).
    ``classic`` (Eq. 3.1, as Opacus): c_i = min(1, C / (||g_i|| + 1e-6))."""
    if rule == "automatic":
        return C / (norms + gamma)
    if rule == "classic":
        return (C / (norms + 1e-6)).clamp(max=1.0)
    raise ValueError(f"unknown clipping rule {rule!r}")


def make(name: str, model, clip) -> "object":
    """The engine ``name`` on ``model``; ``clip`` is the ``clipping`` config (C, rule, gamma, norm_form)."""
    coef = lambda norms: coefficients(norms, C=float(clip.C), rule=clip.rule, gamma=float(clip.gamma))  # noqa: E731
    if name == "none":
        from pipeline.seqrec.clipping.none import NonPrivate
        return NonPrivate(model)
    if name == "phantom":
        from pipeline.seqrec.clipping.phantom import Phantom
        return Phantom(model, coef, form=clip.get("norm_form", "auto"), sum_by=clip.get("sum_by", "bookkeeping"))
    if name == "per_sample":
        from pipeline.seqrec.clipping.per_sample import PerSample
        return PerSample(model, coef)
    if name == "ghost":
        from pipeline.seqrec.clipping.ghost import Ghost
        return Ghost(model, coef, C=float(clip.C))
    raise ValueError(f"unknown clipping engine {name!r}; known: {ENGINES}")
