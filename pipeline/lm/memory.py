"""A language-model cell's largest tensors, for the preflight's check before any run
(``pipeline.preflight``; ``Task.memory``): float32 throughout.

- the model, its gradient and Adam's two moments: 4 x P floats (P: distinct parameters, a tied table once);
- the output layer's logits and their gradient for a Poisson batch (B + 3 sqrt(B) posts, the
  batch's mean plus three of its standard deviations): 2 x B L V floats; Phantom keeps the output
  gradient for its book-keeping sum (one more B L V) and Opacus's hooks keep the same; with
  ``model.chunked_head`` = k, a chunk's, 3 x B L min(k, V) floats, in place of them;
- each block's activations kept for the backward: about 16 B L d floats per block (attention's
  (B, heads, L, L) scores added);
- evaluation: one ``train.eval_batch`` of windows' logits, eval_batch L V floats;
- ``per_sample``: every post's gradient, B x P floats (the reference's cost, B x V x d for the table).

Vocabulary: ``vocab.size`` (a private selection may train fewer tokens: an upper bound). A refusal
names the key behind the largest part: ``model.d`` where the parameters alone are most of it (no
batch size makes a model of 100,000 dimensions fit), ``train.eval_batch`` for the evaluation's
logits, else ``train.batch_size``.
"""

from __future__ import annotations

import math

from omegaconf import DictConfig

from pipeline.task import Memory

FLOAT = 4


def parameters(V: int, L: int, d: int, layers: int, tied: bool) -> int:
    """GPT-2's distinct parameters: tables, blocks (12 d^2 + 13 d each), final norm, untied head."""
    return V * d + L * d + layers * (12 * d * d + 13 * d) + 2 * d + (0 if tied else V * d)


def estimate(cfg: DictConfig, device: str) -> Memory:
    from pipeline.lm import config

    s = config.settings(cfg)
    V, L, d = s.vocab_size, s.L, s.d
    P = parameters(V, L, d, s.layers, s.tied)
    B = math.ceil(s.batch_size + 3 * math.sqrt(s.batch_size))
    parts = {"parameters, gradients and Adam's moments": 4 * P * FLOAT,
             "logits and their gradient": (2 + (s.engine in ("phantom", "per_sample"))) * B * L * V * FLOAT
                                          if not s.chunked_head else 3 * B * L * min(s.chunked_head, V) * FLOAT,
             "activations": s.layers * (16 * B * L * d + 2 * B * s.heads * L * L) * FLOAT,
             "evaluation logits": s.eval_batch * L * V * FLOAT}
    if s.engine == "per_sample":
        parts["per-post gradients"] = B * P * FLOAT
    sizes = f"V = {V}, L = {L}, d = {d}, P = {P:,} parameters"
    largest = max(parts, key=parts.get)  # the refusal names the key behind the largest part
    if largest.startswith("parameters"):  # the model itself: no batch size makes it fit (model.d=100000: 1.9 TB)
        return Memory(parts, "model.d", d, f"lower model.d, model.layers or vocab.size ({sizes})", device)
    if largest == "evaluation logits":
        return Memory(parts, "train.eval_batch", s.eval_batch,
                      f"lower train.eval_batch, dataset.L or vocab.size ({sizes})", device)
    return Memory(parts, "train.batch_size", s.batch_size,
                  f"lower train.batch_size, dataset.L or vocab.size ({sizes})", device)
