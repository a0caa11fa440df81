"""Attention distraction, measured directly (beyond the paper).

On ``synthetic_longtail`` the generator records which positions of each user's test input drove
the test target (``Sequences.relevant``: the recent item whose successor the target is). For a
Transformer, the attention mass that the last block's last query (the position that predicts the
target) puts on those positions, averaged over heads and over the users that have one, says how
much attention goes where it should. DP noise in rare items' embeddings pulls attention away
("attention distraction", Section 5); Re-Attention is meant to restore it.

Reported beside it: the mass uniform attention over the allowed (non-padding, causal) positions
would put there, the chance level.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def relevant_mass(model, inputs: torch.Tensor, relevant: torch.BoolTensor, *, batch: int) -> dict[str, float]:
    """{"attention_relevant": mean attention mass on the relevant positions, "attention_uniform":
    the same for uniform attention over the allowed keys}; NaN for models without attention."""
    users = relevant.any(1).nonzero().squeeze(1)
    if not hasattr(model, "blocks") or len(users) == 0:
        return {"attention_relevant": float("nan"), "attention_uniform": float("nan")}
    was = model.training
    model.eval()
    device = next(model.parameters()).device
    mass = uniform = 0.0
    for s in range(0, len(users), batch):
        u = users[s:s + batch]
        record: list = []
        ids = inputs[u].to(device)
        model(ids, record=record, last=True)  # the last block records its last query's attention alone
        att = record[-1]["att"][:, :, -1].mean(1)  # (n, T): last block, last query, mean over heads
        rel = relevant[u].to(device=device, dtype=att.dtype)
        mass += float((att * rel).sum())
        allowed = (ids != 0).to(att.dtype)
        allowed[:, -1] = 1.0  # the query always sees itself
        uniform += float(((allowed * rel).sum(1) / allowed.sum(1)).sum())
    model.train(was)
    return {"attention_relevant": mass / len(users), "attention_uniform": uniform / len(users)}
