"""Noisy copies of a model at Re-Attention's effective errors, and what the noise does to each
block's attention logits, by Monte Carlo: the reference the propagated variances
(``pipeline/seqrec/reattention.py``) are checked against, at every block.

The noise model is Re-Attention's (section 5.1 of the paper, ``reattention.effective_errors``):
every weight inside the blocks and the position table gets independent N(0, block_err^2), item
row i of the (tied) embedding N(0, item_err_i^2), the padding row none. A draw is the model with
such noise added to its parameters; its forward is the model's own (Re-Attention's correction
computed from its noisy activations, as a noisy model computes it).

``logit_variance`` measures what ``DPFormer.logit_var`` predicts: over the draws, the variance
of each block's logit <q_t, K_i> / sqrt(d_h) with the query q_t held at the unperturbed model's
(the correction conditions on the query it has) and the keys K_i those of the noisy draw.
"""

from __future__ import annotations

import copy
import math

import torch


def noisy_copy(model, block_err: float, item_err: torch.Tensor, generator: torch.Generator):
    """A copy of ``model`` with N(0, block_err^2) added to every block weight and the position
    table, and N(0, item_err_i^2) to item row i (``model.items``)."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in out.named_parameters():
            z = torch.randn(p.shape, generator=generator, dtype=p.dtype, device=p.device)
            if name.startswith("items."):
                p.add_(z * item_err.to(p)[:, None])
            else:
                p.add_(z * block_err)
    return out


def logit_variance(model, ids: torch.Tensor, draws: int, generator: torch.Generator) -> list[torch.Tensor]:
    """Per block, the Monte Carlo variance over ``draws`` noisy copies (at the model's own
    ``block_err`` and ``item_err``) of the logits <q_t, K_i> / sqrt(d_h), q_t the unperturbed
    model's: a list of (n, h, T, T) tensors, to compare with the ``var`` the model records."""
    centre = []
    with torch.no_grad():
        model(ids, record=centre)
    total = [torch.zeros_like(r["var"]) for r in centre]
    square = [torch.zeros_like(r["var"]) for r in centre]
    for _ in range(draws):
        noisy = noisy_copy(model, model.block_err, model.item_err, generator)
        record = []
        with torch.no_grad():
            noisy(ids, record=record)
        for b, (rec, ref) in enumerate(zip(record, centre)):
            attn = noisy.blocks[b].attn
            k = attn.split(attn.k(rec["x"]))
            logits = ref["q"] @ k.transpose(-1, -2) / math.sqrt(k.shape[-1])
            total[b] += logits
            square[b] += logits * logits
    return [(s - t * t / draws) / (draws - 1) for t, s in zip(total, square)]
