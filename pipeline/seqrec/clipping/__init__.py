"""Clipping engines: each turns a batch of users into the clipped sum of their gradients, left in
``p.grad`` (noise is added by the training step, ``pipeline/seqrec/train.py``).

``none``: the plain (unclipped) sum, the non-private baseline. ``phantom``: Phantom Clipping, the
shared engine (``pipeline/clipping``: per-user norms without per-user gradients, the tied item table's
two uses found and their cross term included, the clipped sum by book-keeping or a second backward
pass). ``per_sample``: Opacus's hooks mode, per-user gradients instantiated (the reference).
``ghost``: Opacus's fast gradient (Ghost) clipping, untied models only.

Every engine has ``step(ids, targets) -> (per-user losses, per-user gradient norms or None)``.
"""

from __future__ import annotations

import torch

from pipeline.clipping.engine import RULES, coefficients

ENGINES = ("none", "phantom", "per_sample", "ghost")
__all__ = ["ENGINES", "RULES", "coefficients", "make", "user_losses"]


def user_losses(model, batch) -> torch.Tensor:
    """The per-user losses of (ids, targets): the shared engine's ``loss_fn``."""
    from pipeline.seqrec.models import user_losses as losses

    ids, targets = batch
    return losses(model(ids), ids, targets)


class Phantom:
    """The shared engine (``pipeline.clipping.PhantomClipping``) on (ids, targets) batches."""
    private = True

    def __init__(self, model, clip, engine=None):
        from pipeline.clipping import PhantomClipping

        self.model = model
        self.engine = engine or PhantomClipping(
            model, C=float(clip.C), rule=str(clip.rule), gamma=float(clip.gamma),
            sum_by=str(clip.get("sum_by", "bookkeeping")), form=str(clip.get("norm_form", "auto")),
            check=str(clip.get("check", "first")))

    def step(self, ids, targets):
        return self.engine.step(user_losses, (ids, targets))


def make(name: str, model, clip) -> "object":
    """The engine ``name`` on ``model``; ``clip`` is the ``clipping`` config (C, rule, gamma, norm_form,
    sum_by, check)."""
    coef = lambda norms: coefficients(norms, C=float(clip.C), rule=clip.rule, gamma=float(clip.gamma))  # noqa: E731
    if name == "none":
        from pipeline.seqrec.clipping.none import NonPrivate
        return NonPrivate(model)
    if name == "phantom":
        return Phantom(model, clip)
    if name == "per_sample":
        from pipeline.seqrec.clipping.per_sample import PerSample
        return PerSample(model, coef)
    if name == "ghost":
        from pipeline.seqrec.clipping.ghost import Ghost
        return Ghost(model, coef, C=float(clip.C))
    raise ValueError(f"unknown clipping engine {name!r}; known: {ENGINES}")
