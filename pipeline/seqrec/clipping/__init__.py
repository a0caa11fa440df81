"""Clipping engines: each turns a batch of users into the clipped sum of their gradients, left in
``p.grad`` (noise is added by the training step, ``pipeline/seqrec/train.py``).

``none``: the plain (unclipped) sum, the non-private baseline (``pipeline.dpsgd.NonPrivate``). ``phantom``: Phantom Clipping, the
shared engine (``pipeline/clipping``: per-user norms without per-user gradients, the tied item table's
two uses found and their cross term included, the clipped sum by book-keeping or a second backward
pass). ``per_sample``: Opacus's hooks mode, per-user gradients instantiated (the reference).
``ghost``: Opacus's fast gradient (Ghost) clipping, untied models only. Both are the shared
engine's Opacus wrappers (``pipeline/clipping/opacus.py``), with the config's clipping rule.

Every engine has ``step(ids, targets) -> (per-user losses, per-user gradient norms or None)``.
"""

from __future__ import annotations

import torch

from pipeline.clipping.engine import RULES, coefficients

ENGINES = ("none", "phantom", "per_sample", "ghost")
__all__ = ["ENGINES", "RULES", "Bound", "coefficients", "make", "phantom", "user_losses"]


def user_losses(model, batch) -> torch.Tensor:
    """The per-user losses of (ids, targets): the shared engine's ``loss_fn``."""
    from pipeline.seqrec.models import user_losses as losses

    ids, targets = batch
    return losses(model(ids), ids, targets)


class Bound:
    """A shared engine (``pipeline.clipping``, or ``pipeline.dpsgd.NonPrivate``: ``step(loss_fn, batch)``)
    on (ids, targets) batches; the trainer takes its ``engine`` with ``user_losses``."""

    def __init__(self, engine):
        self.engine = engine
        self.private = bool(getattr(engine, "private", True))

    def step(self, ids, targets):
        return self.engine.step(user_losses, (ids, targets))


def phantom(model, clip, engine=None) -> Bound:
    """Phantom Clipping (``pipeline.clipping.PhantomClipping``) as the ``clipping`` config sets it, or ``engine``."""
    from pipeline.clipping import PhantomClipping

    return Bound(engine or PhantomClipping(
        model, C=float(clip.C), rule=str(clip.rule), gamma=float(clip.gamma),
        sum_by=str(clip.get("sum_by", "bookkeeping")), form=str(clip.get("norm_form", "auto")),
        check=str(clip.get("check", "guard"))))


def make(name: str, model, clip) -> "object":
    """The engine ``name`` on ``model``; ``clip`` is the ``clipping`` config (C, rule, gamma, norm_form,
    sum_by, check)."""
    if name == "none":  # the plain sum, no clipping and no noise
        from pipeline.dpsgd import NonPrivate

        return Bound(NonPrivate(model))
    if name == "phantom":
        return phantom(model, clip)
    if name in ("per_sample", "ghost"):
        from pipeline.clipping import opacus

        engine = opacus.PerSample if name == "per_sample" else opacus.Ghost
        return Bound(engine(model, C=float(clip.C), rule=str(clip.rule), gamma=float(clip.gamma)))
    raise ValueError(f"unknown clipping engine {name!r}; known: {ENGINES}")
