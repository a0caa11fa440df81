"""Ghost Clipping (the paper's baseline): Opacus's fast gradient clipping module, which computes
per-user norms of Linear and Embedding layers without per-user gradients (LayerNorm's from its
small per-user gradients) and refuses a parameter used twice, so it runs on untied models only.
The clipped sum is Opacus's second backward pass over the re-weighted loss, with this pipeline's
clipping coefficients (automatic or classic)."""

from __future__ import annotations

import warnings

from opacus.grad_sample import GradSampleModuleFastGradientClipping

from pipeline.seqrec.models import user_losses

# the ids need no gradient, so torch warns that Opacus's full backward hooks see outputs only
warnings.filterwarnings("ignore", message="Full backward hook is firing")
warnings.filterwarnings("ignore", message="In CPU autocast")


class Ghost:
    private = True

    def __init__(self, model, coef, C: float):
        if getattr(model, "tied", False):
            raise ValueError("ghost clipping refuses the tied item embedding; use an untied model")
        self.model, self.coef = model, coef
        self.gsm = GradSampleModuleFastGradientClipping(model, batch_first=True, loss_reduction="sum",
                                                        max_grad_norm=C, use_ghost_clipping=True)

    def step(self, ids, targets):
        self.gsm.zero_grad(set_to_none=True)
        losses = user_losses(self.gsm(ids), ids, targets)
        losses.sum().backward(retain_graph=True)
        norms = self.gsm.get_norm_sample().detach()
        c = self.coef(norms)
        self.gsm.zero_grad(set_to_none=True)
        self.gsm.disable_hooks()
        try:
            (c * losses).sum().backward()
        finally:
            self.gsm.enable_hooks()
        return losses.detach(), norms
