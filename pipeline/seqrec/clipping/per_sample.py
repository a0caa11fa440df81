"""The reference engine: Opacus's hooks mode (``GradSampleModule``) instantiates every user's
gradient (its grad samplers for Linear, LayerNorm and Embedding, functorch for the tied item
table, summing a parameter's calls, so ties are handled), then clips and sums them."""

from __future__ import annotations

import warnings

import torch
from opacus import GradSampleModule

from pipeline.seqrec.models import user_losses

# the ids need no gradient, so torch warns that Opacus's full backward hooks see outputs only
warnings.filterwarnings("ignore", message="Full backward hook is firing")
warnings.filterwarnings("ignore", message="In CPU autocast")


class PerSample:
    private = True

    def __init__(self, model, coef):
        self.model, self.coef = model, coef
        self.gsm = GradSampleModule(model, batch_first=True, loss_reduction="sum")
        self.params = [p for p in model.parameters() if p.requires_grad]

    def per_user_grads(self, ids, targets):
        self.gsm.zero_grad(set_to_none=True)
        losses = user_losses(self.gsm(ids), ids, targets)
        losses.sum().backward()
        return losses, [p.grad_sample for p in self.params]

    def step(self, ids, targets):
        losses, gs = self.per_user_grads(ids, targets)
        norms = torch.stack([g.flatten(1).square().sum(1) for g in gs]).sum(0).sqrt()
        c = self.coef(norms)
        for p, g in zip(self.params, gs):
            p.grad = torch.einsum("n,n...->...", c, g)
            p.grad_sample = None
        return losses.detach(), norms
