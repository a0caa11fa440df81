"""Non-private training: the plain sum of the users' gradients (no clipping, no noise)."""

from __future__ import annotations

from pipeline.seqrec.models import user_losses


class NonPrivate:
    private = False

    def __init__(self, model):
        self.model = model

    def step(self, ids, targets):
        losses = user_losses(self.model(ids), ids, targets)
        self.model.zero_grad()
        losses.sum().backward()
        return losses.detach(), None
